//! Helpers shared by the integration tests (each test crate uses some of them).
#![allow(dead_code)]

use prism_core::graph::{ExecutionGraph, OpKind, Program};
use prism_core::ops::Work;

/// Memory bytes of each compute op called `name` in program `p`, in program order; panics
/// where such an op is not memory-bound.
pub fn memory_bytes_of(p: &Program, name: &str) -> Vec<u64> {
    p.kind
        .iter()
        .filter_map(|k| match k {
            OpKind::Compute(op) if op.name == name => match op.work {
                Work::Memory { bytes } => Some(bytes),
                ref w => panic!("{name} is memory-bound, got {w:?}"),
            },
            _ => None,
        })
        .collect()
}

/// Memory bytes of the compute ops called `name`, summed per program (pipeline stage); panics
/// where such an op is not memory-bound.
pub fn memory_bytes_per_program(g: &ExecutionGraph, name: &str) -> Vec<u64> {
    g.programs
        .iter()
        .map(|p| memory_bytes_of(p, name).iter().sum())
        .collect()
}

/// `job`, checked valid and holding `micro_batches` micro-batches per pipeline.
pub fn valid_with(job: prism_core::job::Job, micro_batches: u64) -> prism_core::job::Job {
    job.validate().expect("valid test job");
    assert_eq!(job.micro_batches(), micro_batches);
    job
}
