//! Helpers shared by the integration tests (each test crate uses some of them).
#![allow(dead_code)]

use prism_core::cost::comm::Collective;
use prism_core::graph::{ExecutionGraph, OpKind, Phase, Program};
use prism_core::layout::GroupKind;
use prism_core::ops::{OpClass, Work};

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

/// One attention-related op of a layer, in program order: an attention kernel, a
/// context-parallel collective, or a context-parallel elementwise pass (`cp_*`) with its bytes.
#[derive(Debug, PartialEq)]
pub enum Step {
    Kernel(Work),
    Exchange(Collective, u64),
    Pass(&'static str, u64),
}

/// The attention-related ops of `layer`, micro-batch 0, of `phase` in the first program.
pub fn attention_steps(g: &ExecutionGraph, layer: u32, phase: Phase) -> Vec<Step> {
    let p = &g.programs[0];
    let mut steps = Vec::new();
    for (i, k) in p.kind.iter().enumerate() {
        let t = p.tag[i];
        if t.layer != layer || t.micro_batch != 0 || t.phase != phase {
            continue;
        }
        match k {
            OpKind::Compute(op) if matches!(op.work, Work::Attention { .. }) => {
                steps.push(Step::Kernel(op.work))
            }
            OpKind::Compute(op) if op.name.starts_with("cp_") => {
                assert_eq!(op.class, OpClass::Elementwise, "{}", op.name);
                let Work::Memory { bytes } = op.work else {
                    panic!("{} is a memory pass", op.name)
                };
                steps.push(Step::Pass(op.name, bytes))
            }
            OpKind::Collective {
                group: GroupKind::Cp,
                op,
                bytes,
            } => steps.push(Step::Exchange(*op, *bytes)),
            _ => {}
        }
    }
    steps
}

/// The attention kernels among `steps`.
pub fn kernels(steps: &[Step]) -> Vec<Work> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Kernel(w) => Some(*w),
            _ => None,
        })
        .collect()
}

/// The context-parallel collectives among `steps`.
pub fn exchanges(steps: &[Step]) -> Vec<(Collective, u64)> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Exchange(c, b) => Some((*c, *b)),
            _ => None,
        })
        .collect()
}
