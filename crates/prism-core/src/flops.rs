//! FLOP counts (placeholder).
