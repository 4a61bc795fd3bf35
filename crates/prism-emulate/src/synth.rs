//! Synthetic recorded traces of a GPT-like training step with tensor, pipeline and data
//! parallelism, as a recording backend would write them for any rank: for tests and benchmarks
//! of slicing and the coordinator, without running a workload.
//!
//! Per rank (1F1B schedule, Megatron's rank order): for every forward step, receive the
//! activation from the previous stage (unless first), then per layer a compute segment and two
//! TP all-reduces (attention and MLP), then send to the next stage (unless last); backward
//! mirrors it with gradients; then the gradient reduce-scatter and parameter all-gather over the
//! DP group, a loss all-reduce over DP, a TP broadcast from the group's first member and a TP
//! barrier. Compute durations depend only on the stage, the step and the layer (every rank of a
//! stage does the same work), in whole microseconds so that they are exact in picoseconds.

use prism_core::graph::schedule;
use prism_core::job::Schedule;
use prism_core::layout::{Coord, GroupKind};

use crate::graph_file::LayoutSpec;
use crate::protocol::{Bye, Call, DType, Hello, Op, ReduceOp};
use crate::slice::RankTrace;

/// Shape of a synthetic step.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    /// Target layout.
    pub layout: LayoutSpec,
    /// Micro-batches per step.
    pub micro_batches: u32,
    /// Layers of each stage (length `pp`; may differ between stages).
    pub layers: Vec<u32>,
    /// Activation message and TP all-reduce size, bytes.
    pub activation_bytes: u64,
    /// Gradient bytes of one stage's parameters (DP reduce-scatter input).
    pub grad_bytes: u64,
    /// Forward compute of one layer on stage 0, microseconds (later stages add 10% each).
    pub layer_us: u64,
}

impl SynthSpec {
    /// A small default step on `layout`: 4 micro-batches, 2 layers per stage.
    pub fn small(layout: LayoutSpec) -> Self {
        SynthSpec {
            layout,
            micro_batches: 4,
            layers: vec![2; layout.pp as usize],
            activation_bytes: 1 << 16,
            grad_bytes: 1 << 20,
            layer_us: 200,
        }
    }
}

/// The synthetic trace of `rank`.
pub fn trace(spec: &SynthSpec, rank: u32) -> RankTrace {
    let ls = spec.layout;
    let layout = ls.layout(1);
    let n = layout.num_ranks();
    let c = layout.coord(rank);
    let s = c.pp;
    let tp_group: Vec<u32> = layout
        .members(GroupKind::Tp, layout.group_of(GroupKind::Tp, rank))
        .collect();
    let dp_group: Vec<u32> = layout
        .members(GroupKind::Dp, layout.group_of(GroupKind::Dp, rank))
        .collect();
    let neighbour = |pp: u32| layout.rank(Coord { pp, ..c });
    let stage_us = |us: u64| us + us * s as u64 / 10;
    let mut calls: Vec<Call> = Vec::new();
    let mut pending_us: u64 = 0;
    let mut call = |pending: &mut u64, op: Op, group: &[u32], bytes: u64, peer: u32| {
        calls.push(Call {
            seq: calls.len() as u64,
            op: op as i32,
            group: group.to_vec(),
            bytes,
            dtype: DType::F32 as i32,
            reduce: ReduceOp::Sum as i32,
            peer,
            data: Vec::new(),
            compute_s: *pending as f64 * 1e-6,
        });
        *pending = 0;
    };
    let layers = spec.layers[s as usize];
    let a = spec.activation_bytes;
    for (i, step) in schedule(Schedule::OneFOneB, s, ls.pp, spec.micro_batches, 1)
        .iter()
        .enumerate()
    {
        pending_us += 5 + (i as u64 % 3);
        if step.forward {
            if s > 0 {
                call(&mut pending_us, Op::Recv, &[], a, neighbour(s - 1));
            }
            for l in 0..layers {
                pending_us += stage_us(spec.layer_us + 7 * l as u64);
                call(&mut pending_us, Op::AllReduce, &tp_group, a, 0);
                pending_us += stage_us(spec.layer_us / 2);
                call(&mut pending_us, Op::AllReduce, &tp_group, a, 0);
            }
            if s + 1 < ls.pp {
                pending_us += 3;
                call(&mut pending_us, Op::Send, &[], a, neighbour(s + 1));
            } else {
                pending_us += stage_us(spec.layer_us / 4);
            }
        } else {
            if s + 1 < ls.pp {
                call(&mut pending_us, Op::Recv, &[], a, neighbour(s + 1));
            }
            for l in 0..layers {
                pending_us += stage_us(2 * spec.layer_us + 11 * l as u64);
                call(&mut pending_us, Op::AllReduce, &tp_group, a, 0);
                pending_us += stage_us(spec.layer_us);
                call(&mut pending_us, Op::AllReduce, &tp_group, a, 0);
            }
            if s > 0 {
                pending_us += 3;
                call(&mut pending_us, Op::Send, &[], a, neighbour(s - 1));
            }
        }
    }
    pending_us += 13;
    let g = spec.grad_bytes;
    let shard = g / ls.dp as u64;
    call(
        &mut pending_us,
        Op::ReduceScatter,
        &dp_group,
        shard * ls.dp as u64,
        0,
    );
    pending_us += stage_us(spec.layer_us / 2);
    call(&mut pending_us, Op::AllGather, &dp_group, shard, 0);
    call(&mut pending_us, Op::AllReduce, &dp_group, 4, 0);
    pending_us += 2;
    call(&mut pending_us, Op::Broadcast, &tp_group, 64, tp_group[0]);
    call(&mut pending_us, Op::Barrier, &tp_group, 0, 0);
    RankTrace {
        origin: format!("synthetic rank {rank}"),
        hello: Hello {
            rank,
            world_size: n,
            client: "prism-emulate synth".into(),
        },
        calls,
        bye: Bye {
            compute_s: stage_us(17) as f64 * 1e-6,
            peak_memory_bytes: 1_000_000 + 1000 * s as u64,
        },
    }
}
