//! kernel_table (placeholder)
