//! Compute cost model (placeholder; owned by the compute-cost work).
