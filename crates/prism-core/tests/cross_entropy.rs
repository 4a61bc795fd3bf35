//! Megatron-Core's fused cross-entropy kernels (`training.cross_entropy_fusion`) against their
//! definition: the loss ops move the bytes per logit element that each implementation's kernels
//! read and write (`CrossEntropyFusion`), over the tokens and the vocabulary shard of the GPU,
//! and a step with a cheaper loss is never slower.

mod common;

use prism_core::graph::ExecutionGraph;
use prism_core::job::fixtures::small_job;
use prism_core::job::{CrossEntropyFusion, Job, Stack};
use prism_core::{SimOptions, simulate};

/// TP 2 over one node with a large vocabulary, so that the loss is visible in the step.
fn job(fusion: CrossEntropyFusion) -> Job {
    let mut job = small_job(1, 2, 1, 16);
    job.model.vocab = 128_256;
    job.model.seq_len = 4096;
    job.model.layers = 2;
    job.training.cross_entropy_fusion = fusion;
    job.validate().expect("valid test job");
    job
}

/// Bytes of the first `loss_fwd` and `loss_bwd` ops of the last stage.
fn loss_bytes(g: &ExecutionGraph) -> (u64, u64) {
    let p = g.programs.last().expect("a stage");
    let first = |name: &str| {
        *common::memory_bytes_of(p, name)
            .first()
            .unwrap_or_else(|| panic!("no {name}"))
    };
    (first("loss_fwd"), first("loss_bwd"))
}

/// Truth: the kernels' own reads and writes per logit (Megatron's unfused loss 38 / 14 bytes,
/// Megatron-Core's fused JIT functions 22 / 6, Transformer Engine's Triton kernel 6 / 4), times
/// the micro-batch's tokens and this GPU's vocabulary shard (128,256 / TP 2).
#[test]
fn loss_bytes_follow_each_implementation() {
    let tokens = 4096u64; // micro-batch 1 of 4,096 tokens, no context parallelism
    let shard = 128_256u64 / 2;
    for (fusion, fwd, bwd) in [
        (CrossEntropyFusion::None, 38, 14),
        (CrossEntropyFusion::Native, 22, 6),
        (CrossEntropyFusion::Te, 6, 4),
    ] {
        let j = job(fusion);
        assert_eq!(j.training.stack, Stack::MegatronCore);
        let g = ExecutionGraph::build(&j);
        assert_eq!(
            loss_bytes(&g),
            (fwd * tokens * shard, bwd * tokens * shard),
            "{fusion:?}"
        );
        assert_eq!(fusion.loss_bytes_per_logit(j.training.stack), (fwd, bwd));
    }
    // Other stacks keep their own loss whatever the job says.
    assert_eq!(
        CrossEntropyFusion::Te.loss_bytes_per_logit(Stack::TorchTitan),
        Stack::TorchTitan.loss_bytes_per_logit()
    );
}

/// Invariant: the step only loses work from the unfused loss to Megatron-Core's fusion to
/// Transformer Engine's, so its time never grows, and strictly shrinks with this vocabulary.
#[test]
fn fused_losses_make_the_step_faster() {
    let t = |f| {
        simulate(&job(f), &SimOptions::default())
            .expect("simulates")
            .summary
            .iteration_time_s
    };
    let (none, native, te) = (
        t(CrossEntropyFusion::None),
        t(CrossEntropyFusion::Native),
        t(CrossEntropyFusion::Te),
    );
    assert!(none > native && native > te, "{none} {native} {te}");
}
