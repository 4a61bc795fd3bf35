//! Cost models: what a compute kernel and a collective cost on the job's hardware.

pub mod comm;
pub mod compute;
