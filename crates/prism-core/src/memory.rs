//! Memory model (placeholder).
