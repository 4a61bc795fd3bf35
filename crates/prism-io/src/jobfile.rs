//! jobfile (placeholder)
