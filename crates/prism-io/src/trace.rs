//! trace (placeholder)
