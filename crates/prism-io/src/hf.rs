//! hf (placeholder)
