//! ZeRO-3 (FSDP) in the execution graph against counts and bytes worked out by hand: how often
//! each layer's parameters are all-gathered and its gradients reduce-scattered under
//! `parallel.reshard_after_forward` and `parallel.zero3_grad_sync`, what the optimizer step
//! reads and writes, the memory the held parameters and unreduced gradients take, and the
//! routed experts' bias adds of a stack without a bias epilogue.

use prism_core::arch::fixtures::small_deepseek_job;
use prism_core::cost::comm::Collective;
use prism_core::graph::{ExecutionGraph, NONE, OpKind};
use prism_core::job::fixtures::small_job;
use prism_core::job::{Job, Schedule, Stack, Zero3Sync};
use prism_core::layout::GroupKind;
use prism_core::memory::{layer_params_at, stage_memory, stage_params};
use prism_core::{SimOptions, simulate};

/// GPT-small (8 layers) on 8 H100s under torchtitan's FSDP: pp 2, dp 4, 16 micro-batches in
/// two runs of the schedule (`pipeline_rounds = 2`), ZeRO-3.
fn fsdp_job(reshard: bool, sync: Zero3Sync, vpp: u32) -> Job {
    let mut job = small_job(1, 1, 2, 64);
    job.training.stack = Stack::TorchTitan;
    job.parallel.set_zero_stage(3);
    job.parallel.sequence_parallel = false;
    job.parallel.pipeline_rounds = 2;
    job.parallel.vpp = vpp;
    if vpp > 1 {
        job.parallel.schedule = Schedule::Interleaved;
    }
    job.parallel.reshard_after_forward = reshard;
    job.parallel.zero3_grad_sync = sync;
    common::valid_with(job, 16)
}

/// Per program (pipeline stage): the count and total bytes of the data-parallel collectives
/// `op` that belong to a transformer layer (ZeRO-3's per-layer gathers and reductions; the
/// embedding's and LM head's carry no layer).
fn layer_collectives(g: &ExecutionGraph, op: Collective) -> Vec<(u64, u64)> {
    g.programs
        .iter()
        .map(|p| {
            p.kind
                .iter()
                .zip(&p.tag)
                .filter_map(|(k, tag)| match *k {
                    OpKind::Collective {
                        group: GroupKind::Dp,
                        op: o,
                        bytes,
                    } if o == op && tag.layer != NONE => Some(bytes),
                    _ => None,
                })
                .fold((0, 0), |(n, b), x| (n + 1, b + x))
        })
        .collect()
}

/// Truth, per stage of L = 4 layers of W parameters, m = 16 micro-batches in r = 2 runs:
/// * resharding after the forward gathers each layer before every forward and every backward
///   (2 m gathers); keeping the parameters gathers once per forward (m) and, where the sync is
///   deferred, once per span (r for the schedule run, 1 for the iteration);
/// * gradients are reduce-scattered after every backward (m), once per run (r) or once (1);
/// * each gather moves 2 W bytes (BF16), each reduction 4 W (FP32).
#[test]
fn zero3_gathers_and_reductions_follow_the_sync_span() {
    let (layers, m, r) = (4u64, 16u64, 2u64);
    let w = small_job(1, 1, 2, 64).model.layer_params();
    let cases = [
        (true, Zero3Sync::MicroBatch, 2 * m, m),
        (false, Zero3Sync::MicroBatch, m, m),
        (true, Zero3Sync::ScheduleRun, 2 * m, r),
        (false, Zero3Sync::ScheduleRun, r, r),
        (true, Zero3Sync::Iteration, 2 * m, 1),
        (false, Zero3Sync::Iteration, 1, 1),
    ];
    for (reshard, sync, gathers, reductions) in cases {
        for vpp in [1, 2] {
            let g = ExecutionGraph::build(&fsdp_job(reshard, sync, vpp));
            let what = format!("reshard {reshard}, {}, vpp {vpp}", sync.name());
            for (stage, (n, bytes)) in layer_collectives(&g, Collective::AllGather)
                .into_iter()
                .enumerate()
            {
                assert_eq!(n, layers * gathers, "{what}: stage {stage} gathers");
                assert_eq!(bytes, n * 2 * w, "{what}: stage {stage} gather bytes");
            }
            for (stage, (n, bytes)) in layer_collectives(&g, Collective::ReduceScatter)
                .into_iter()
                .enumerate()
            {
                assert_eq!(n, layers * reductions, "{what}: stage {stage} reductions");
                assert_eq!(bytes, n * 4 * w, "{what}: stage {stage} reduction bytes");
            }
        }
    }
    // Less traffic never makes the iteration longer.
    let time = |j: &Job| {
        simulate(j, &SimOptions::default())
            .expect("simulates")
            .summary
            .iteration_time_s
    };
    let per_mb = time(&fsdp_job(true, Zero3Sync::MicroBatch, 1));
    let per_run = time(&fsdp_job(false, Zero3Sync::ScheduleRun, 1));
    let once = time(&fsdp_job(false, Zero3Sync::Iteration, 1));
    assert!(per_run <= per_mb, "{per_run} vs {per_mb}");
    assert!(once <= per_run, "{once} vs {per_run}");
}

/// Truth: the optimizer step updates every parameter of the stage, ZeRO-3's layers included
/// (their gradients never pass through the end-of-iteration buckets): 30 bytes per parameter
/// of the stage's shard (`stage_params / dp`, rounded up per part).
#[test]
fn zero3_optimizer_step_covers_every_parameter() {
    for stage3 in [false, true] {
        let mut job = small_job(1, 1, 2, 64);
        if stage3 {
            job.training.stack = Stack::TorchTitan;
            job.parallel.set_zero_stage(3);
        }
        job.validate().expect("valid");
        let dp = job.parallel.dp as u64;
        let g = ExecutionGraph::build(&job);
        let steps = common::memory_bytes_per_program(&g, "optimizer_step");
        for (stage, &bytes) in steps.iter().enumerate() {
            let params = stage_params(&job, stage as u32).total();
            assert_eq!(
                bytes,
                30 * params.div_ceil(dp),
                "ZeRO-3 {stage3}, stage {stage}"
            );
        }
    }
}

/// Truth, for a dense stage of L layers of W parameters with `rest` parameters outside them
/// (embedding or LM head) and dp shards: the BF16 weights are every shard (2 L W / dp) plus
/// the gathered layers whole (two, the one being computed and the one prefetched, when
/// resharding after the forward; all L when not) plus `rest`; the FP32 gradients are every
/// shard plus one layer's unreduced gradients, or all L where the sync is deferred.
#[test]
fn zero3_memory_holds_what_the_rhythm_keeps() {
    for (reshard, sync) in [
        (true, Zero3Sync::MicroBatch),
        (false, Zero3Sync::MicroBatch),
        (false, Zero3Sync::ScheduleRun),
        (true, Zero3Sync::Iteration),
    ] {
        let job = fsdp_job(reshard, sync, 1);
        let dp = job.parallel.dp as u64;
        for stage in 0..2u32 {
            let p = stage_params(&job, stage).total();
            let one = layer_params_at(&job, 0).total();
            let layers = job.stage_layers()[stage as usize] as u64;
            let rest = p - layers * one;
            let held = if reshard { 2 } else { layers };
            let unreduced = if sync == Zero3Sync::MicroBatch {
                1
            } else {
                layers
            };
            let mem = stage_memory(&job, stage);
            let what = format!("reshard {reshard}, {}, stage {stage}", sync.name());
            assert_eq!(
                mem.weights,
                2 * (rest + held * one) + (2 * layers * one).div_ceil(dp),
                "{what}"
            );
            assert_eq!(
                mem.gradients,
                4 * (rest + unreduced * one) + (4 * layers * one).div_ceil(dp),
                "{what}"
            );
        }
    }
}

mod common;

/// Memory bytes of the compute ops called `name` over the whole graph.
fn op_bytes(g: &ExecutionGraph, name: &str) -> u64 {
    common::memory_bytes_per_program(g, name).iter().sum()
}

/// Truth: under torchtitan's stack the routed experts' biases are added in kernels of their
/// own, per routed token copy 8 bytes per element of the fc1 output (2 x 512 wide) and 20 of
/// the fc2 output (1024 wide) forward, 2 and 16 backward (`Stack::unfused_expert_bias_bytes`);
/// 7 MoE layers, 16 micro-batches of 2,048 tokens, 2 copies each. Megatron-Core adds them in
/// the GEMM epilogue; a model without expert biases runs no such kernel.
#[test]
fn expert_bias_adds_cost_what_the_stack_moves() {
    let build = |stack: Stack, bias: bool| {
        let mut job = small_deepseek_job(1, 1, 1, 128, 8);
        job.training.stack = stack;
        job.model.arch.expert_bias = bias;
        if stack == Stack::TorchTitan {
            job.parallel.set_zero_stage(3);
        }
        job.validate().expect("valid");
        job
    };
    let job = build(Stack::TorchTitan, true);
    let g = ExecutionGraph::build(&job);
    let m = job.micro_batches();
    let moe_layers = job.model.moe_layers() as u64;
    let copies = 2048 * 2;
    let (n_fc1, h) = (2 * 512u64, 1024u64);
    // Summed over the eight data-parallel ranks' identical programs.
    let per = moe_layers * m * copies * g.programs.len() as u64;
    assert_eq!(op_bytes(&g, "expert_fc1_bias_fwd"), per * 8 * n_fc1);
    assert_eq!(op_bytes(&g, "expert_fc2_bias_fwd"), per * 20 * h);
    assert_eq!(op_bytes(&g, "expert_fc1_bias_bwd"), per * 2 * n_fc1);
    assert_eq!(op_bytes(&g, "expert_fc2_bias_bwd"), per * 16 * h);
    for (stack, bias) in [(Stack::MegatronCore, true), (Stack::TorchTitan, false)] {
        let g = ExecutionGraph::build(&build(stack, bias));
        for name in [
            "expert_fc1_bias_fwd",
            "expert_fc2_bias_fwd",
            "expert_fc1_bias_bwd",
            "expert_fc2_bias_bwd",
        ] {
            assert_eq!(op_bytes(&g, name), 0, "{stack:?}, bias {bias}: {name}");
        }
    }
    let time = |j: &Job| {
        simulate(j, &SimOptions::default())
            .expect("simulates")
            .summary
            .iteration_time_s
    };
    assert!(time(&job) > time(&build(Stack::TorchTitan, false)));
}
