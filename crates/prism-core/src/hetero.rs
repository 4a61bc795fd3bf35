//! Heterogeneous pipelines on the engine: data-parallel replicas whose pipeline stages each have
//! their own tensor-parallel degree, layer count and device speeds, fed micro-batches of
//! variable composition (packed sequences), plus fail-stop devices and a reconfiguration cost.
//!
//! This is what resilience planning needs from the engine (ResiHP, arXiv 2605.06374): after a
//! device turns slow or fails, a tensor-parallel group may shrink, layers move between stages,
//! and micro-batches move between data-parallel replicas, so no two stages need be alike.
//!
//! Model of one iteration:
//!
//! - A micro-batch is a pack of sequences ([`MicroBatch`]): its linear work grows with its
//!   tokens, its attention work with the sum of its squared sequence lengths.
//! - A stage of `L` layers on a tensor-parallel group of `k` devices with speeds `v_j` spends on
//!   a micro-batch's forward `L x ((a tokens + b sum len^2) / (k min_j v_j) + c(k) tokens)`,
//!   where `a` and `b` are the per-layer costs at TP 1 and speed 1 ([`LayerCost`]) and `c(k)`
//!   the ring all-reduces of tensor parallelism over NVLink (`2 (k-1)/k` of the payload); its
//!   backward the compute part times `backward_factor` plus the same communication. A group runs
//!   at its slowest member's pace (every layer ends in a collective).
//! - Every stage of every replica is one instance of the engine (its own program, one
//!   representative rank per tensor-parallel group on its own node, so pipeline messages cross
//!   the scale-out network): forward and backward compute ops in GPipe or 1F1B order
//!   ([`crate::graph::schedule`]), activation and gradient sends of `tokens x act_bytes / k`
//!   bytes per group member between neighbouring stages. The engine plays them out (network
//!   contention included).
//! - The data-parallel gradient reduction follows the last replica: a ring all-reduce over the
//!   replicas of the largest per-device gradient shard (closed form, scale-out bandwidth).
//! - A failed device stops its stage: [`simulate_hetero`] answers [`HeteroError::FailStop`].
//!
//! The reconfiguration cost ([`ReconfigCost`]) is the restart time plus the time to move the
//! training state (weights, gradients, optimizer state) of every layer whose owner changed, the
//! busiest receiving NIC setting the pace.

use crate::cost::comm::{CommParams, nic_bytes_per_s, nvlink_bytes_per_s};
use crate::cost::compute::ComputeParams;
use crate::engine::{GraphOptions, SimError, simulate_graph};
use crate::graph::{ExecutionGraph, NONE, OpKind, OpTag, Phase, Program, Stream, schedule};
use crate::job::{Cluster, Job, RankOrder, Schedule};
use crate::layout::Layout;
use crate::ops::{ComputeOp, OpClass, Work};
use crate::units::{PS_PER_S, ps_from_s, s_from_ps};

/// A micro-batch of packed sequences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MicroBatch {
    /// Tokens (sum of the sequence lengths).
    pub tokens: u64,
    /// Sum of the squared sequence lengths (what attention work grows with).
    pub sum_sq_len: u64,
}

impl MicroBatch {
    /// The micro-batch packing sequences of these lengths.
    pub fn packed(lens: &[u64]) -> Self {
        MicroBatch {
            tokens: lens.iter().sum(),
            sum_sq_len: lens.iter().map(|l| l * l).sum(),
        }
    }

    /// `count` sequences of `seq` tokens each (a fixed-shape micro-batch).
    pub fn uniform(seq: u64, count: u64) -> Self {
        MicroBatch {
            tokens: seq * count,
            sum_sq_len: seq * seq * count,
        }
    }
}

/// Per-layer costs of a model on one GPU model (forward, tensor-parallel degree 1, speed 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerCost {
    /// Seconds of forward per token per layer (GEMMs and other linear work): `a`.
    pub token_s: f64,
    /// Seconds of forward per squared sequence length per layer (attention scores): `b`.
    pub sq_s: f64,
    /// Backward compute over forward compute (2: input and weight gradients).
    pub backward_factor: f64,
    /// Tensor-parallel all-reduce payload per token per layer pass (bytes, both all-reduces of a
    /// Megatron layer together).
    pub tp_bytes_per_token: f64,
    /// Pipeline activation bytes per token (one hidden vector).
    pub act_bytes_per_token: u64,
    /// Gradient bytes of one layer reduced over data parallelism (fp32), at TP 1.
    pub grad_bytes_per_layer: u64,
    /// Training state of one layer (weights, gradients, optimizer state), bytes at TP 1.
    pub state_bytes_per_layer: u64,
    /// Weights, gradients and optimizer state bytes per parameter.
    pub state_bytes_per_param: u64,
}

impl LayerCost {
    /// The costs of `job`'s model on its GPU from first principles: linear FLOPs `2 P_layer`
    /// per token at the GPU's BF16 GEMM efficiency ceiling, causal attention `2 h len^2` FLOPs
    /// per sequence at its fused-attention forward ceiling (both from
    /// [`ComputeParams::for_gpu`]); `state_bytes_per_param` bytes of state per parameter (16 for
    /// mixed-precision Adam: bf16 weights and gradients, fp32 master weights and two moments).
    pub fn from_job(job: &Job, state_bytes_per_param: u64) -> Self {
        let m = &job.model;
        let gpu = &job.cluster.gpu;
        let cp = ComputeParams::for_gpu(gpu);
        let peak = gpu.peak_tflops_bf16 * 1e12;
        let layer_params = m.layer_params() as f64;
        let token_s = 2.0 * layer_params / (peak * cp.gemm_eff_max_bf16);
        let sq_s = 2.0 * m.hidden as f64 / (peak * cp.attn_fwd_eff_max);
        LayerCost {
            token_s,
            sq_s,
            backward_factor: 2.0,
            tp_bytes_per_token: 2.0 * 2.0 * m.hidden as f64,
            act_bytes_per_token: 2 * m.hidden as u64,
            grad_bytes_per_layer: 4 * m.layer_params(),
            state_bytes_per_layer: state_bytes_per_param * m.layer_params(),
            state_bytes_per_param,
        }
    }
}

/// One device (GPU) of a stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Device {
    /// Global id (for reports and fault injection).
    pub id: u32,
    /// Speed relative to a healthy device (1.0; 0.5 is twice as slow).
    pub speed: f64,
    /// Failed (fail-stop): the stage cannot run.
    pub failed: bool,
}

impl Device {
    /// A healthy device.
    pub fn healthy(id: u32) -> Self {
        Device {
            id,
            speed: 1.0,
            failed: false,
        }
    }
}

/// A pipeline stage: consecutive layers on one tensor-parallel group.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    /// Decoder layers of the stage.
    pub layers: u32,
    /// The tensor-parallel group (its size is the stage's TP degree).
    pub devices: Vec<Device>,
}

impl Stage {
    /// Tensor-parallel degree.
    pub fn tp(&self) -> u32 {
        self.devices.len() as u32
    }

    /// The pace of the group: its slowest member's speed.
    pub fn speed(&self) -> f64 {
        (self.devices.iter())
            .map(|d| d.speed)
            .fold(f64::INFINITY, f64::min)
    }
}

/// One data-parallel replica: a pipeline and the micro-batches it runs this iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct Replica {
    /// Stages in pipeline order.
    pub stages: Vec<Stage>,
    /// Micro-batches of the iteration (may be empty: a replica that only takes part in the
    /// gradient reduction).
    pub micro_batches: Vec<MicroBatch>,
}

/// A heterogeneous data-parallel pipeline job for one iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct HeteroPipeline {
    /// Replicas.
    pub replicas: Vec<Replica>,
    /// GPipe or 1F1B.
    pub schedule: Schedule,
    /// Per-layer costs.
    pub cost: LayerCost,
}

/// Why a heterogeneous iteration could not run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum HeteroError {
    /// A device of a stage has failed: the iteration cannot complete.
    #[error("device {device} of replica {replica} stage {stage} has failed (fail-stop)")]
    FailStop {
        /// Replica.
        replica: usize,
        /// Stage.
        stage: usize,
        /// Device id.
        device: u32,
    },
    /// The description is not runnable.
    #[error("{0}")]
    Invalid(String),
    /// The engine refused it.
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// The result of one heterogeneous iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct HeteroResult {
    /// Iteration time, seconds (pipelines plus gradient reduction).
    pub iteration_s: f64,
    /// End of each replica's pipeline, seconds.
    pub replica_end_s: Vec<f64>,
    /// Data-parallel gradient reduction after the pipelines, seconds.
    pub dp_sync_s: f64,
    /// Per replica, per stage: (first compute start, last compute end, busy seconds).
    pub stage_spans: Vec<Vec<(f64, f64, f64)>>,
    /// Tokens processed.
    pub tokens: u64,
}

/// Forward seconds of `mb` on `stage` (see the module docs); ignores failures.
pub fn forward_s(stage: &Stage, mb: &MicroBatch, cost: &LayerCost, cluster: &Cluster) -> f64 {
    let k = stage.tp().max(1) as f64;
    let compute =
        (cost.token_s * mb.tokens as f64 + cost.sq_s * mb.sum_sq_len as f64) / (k * stage.speed());
    stage.layers as f64 * (compute + tp_comm_s(stage.tp(), mb.tokens, cost, cluster))
}

/// Backward seconds of `mb` on `stage`.
pub fn backward_s(stage: &Stage, mb: &MicroBatch, cost: &LayerCost, cluster: &Cluster) -> f64 {
    let k = stage.tp().max(1) as f64;
    let compute =
        (cost.token_s * mb.tokens as f64 + cost.sq_s * mb.sum_sq_len as f64) / (k * stage.speed());
    stage.layers as f64
        * (cost.backward_factor * compute + tp_comm_s(stage.tp(), mb.tokens, cost, cluster))
}

/// Tensor-parallel communication of one layer pass of `tokens` tokens on `k` devices (ring
/// all-reduce over NVLink).
pub fn tp_comm_s(k: u32, tokens: u64, cost: &LayerCost, cluster: &Cluster) -> f64 {
    if k <= 1 {
        return 0.0;
    }
    let bw = nvlink_bytes_per_s(cluster, &CommParams::for_gpu(&cluster.gpu));
    2.0 * (k - 1) as f64 / k as f64 * cost.tp_bytes_per_token * tokens as f64 / bw
}

/// The data-parallel gradient reduction after the pipelines: a ring all-reduce over the
/// replicas of the largest per-device gradient shard, at the scale-out bandwidth.
pub fn dp_sync_s(p: &HeteroPipeline, cluster: &Cluster) -> f64 {
    let d = p.replicas.len();
    if d <= 1 {
        return 0.0;
    }
    let shard = (p.replicas.iter())
        .flat_map(|r| r.stages.iter())
        .map(|s| s.layers as f64 * p.cost.grad_bytes_per_layer as f64 / s.tp().max(1) as f64)
        .fold(0.0, f64::max);
    let bw = nic_bytes_per_s(cluster, &CommParams::for_gpu(&cluster.gpu)) as f64;
    2.0 * (d - 1) as f64 / d as f64 * shard / bw
}

fn check(p: &HeteroPipeline) -> Result<(), HeteroError> {
    if p.replicas.is_empty() {
        return Err(HeteroError::Invalid("no replicas".into()));
    }
    if p.schedule == Schedule::Interleaved {
        return Err(HeteroError::Invalid(
            "heterogeneous pipelines run GPipe or 1F1B, not the interleaved schedule".into(),
        ));
    }
    let c = &p.cost;
    for (name, v) in [
        ("token_s", c.token_s),
        ("sq_s", c.sq_s),
        ("backward_factor", c.backward_factor),
        ("tp_bytes_per_token", c.tp_bytes_per_token),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(HeteroError::Invalid(format!(
                "layer cost {name} must be finite and >= 0 (got {v})"
            )));
        }
    }
    for (r, rep) in p.replicas.iter().enumerate() {
        if rep.stages.is_empty() {
            return Err(HeteroError::Invalid(format!("replica {r} has no stages")));
        }
        for (s, st) in rep.stages.iter().enumerate() {
            if st.devices.is_empty() {
                return Err(HeteroError::Invalid(format!(
                    "replica {r} stage {s} has no devices"
                )));
            }
            for d in &st.devices {
                if d.failed {
                    return Err(HeteroError::FailStop {
                        replica: r,
                        stage: s,
                        device: d.id,
                    });
                }
                if !(d.speed.is_finite() && d.speed > 0.0) {
                    return Err(HeteroError::Invalid(format!(
                        "device {} speed must be finite and > 0 (got {})",
                        d.id, d.speed
                    )));
                }
            }
        }
    }
    Ok(())
}

fn measured(name: &'static str, seconds: f64) -> OpKind {
    OpKind::Compute(ComputeOp {
        name,
        class: OpClass::Framework,
        work: Work::Measured {
            ps: ps_from_s(seconds),
        },
        recompute: false,
        sm_margin: false,
    })
}

/// Builds the engine graph of `p` (one program per stage of every replica, in replica order)
/// and the cluster it runs on (one node per stage instance).
pub fn build_graph(p: &HeteroPipeline, cluster: &Cluster) -> (ExecutionGraph, Cluster) {
    let mut programs = Vec::new();
    for rep in &p.replicas {
        let np = rep.stages.len() as u32;
        let m = rep.micro_batches.len() as u32;
        for (s, st) in rep.stages.iter().enumerate() {
            let s32 = s as u32;
            let mut prog = Program::default();
            let k = st.tp().max(1) as u64;
            for step in schedule(p.schedule, s32, np, m, 1) {
                let i = step.micro_batch;
                let mb = &rep.micro_batches[i as usize];
                let bytes = (mb.tokens * p.cost.act_bytes_per_token).div_ceil(k).max(1);
                let tag = OpTag {
                    phase: if step.forward {
                        Phase::Forward
                    } else {
                        Phase::Backward
                    },
                    micro_batch: i,
                    layer: NONE,
                };
                let (from_prev, to_next) = if step.forward {
                    (s > 0, s32 + 1 < np)
                } else {
                    (s32 + 1 < np, s > 0)
                };
                let mut deps = Vec::new();
                if from_prev {
                    // Slots: activation of micro-batch i at 2i, its gradient at 2i + 1.
                    let slot = 2 * i + u32::from(!step.forward);
                    deps.push(prog.push(OpKind::Recv { slot }, Stream::PpRecv, tag, &[]));
                }
                let work = if step.forward {
                    measured("forward", forward_s(st, mb, &p.cost, cluster))
                } else {
                    measured("backward", backward_s(st, mb, &p.cost, cluster))
                };
                let c = prog.push(work, Stream::Compute, tag, &deps);
                if to_next {
                    let (delta, slot) = if step.forward {
                        (1, 2 * i)
                    } else {
                        (-1, 2 * i + 1)
                    };
                    prog.push(
                        OpKind::Send { delta, bytes, slot },
                        Stream::PpSend,
                        tag,
                        &[c],
                    );
                }
            }
            prog.recv_slots = 2 * m;
            programs.push(prog);
        }
    }
    let n = programs.len() as u32;
    let layout = Layout {
        tp: 1,
        cp: 1,
        dp: 1,
        pp: n,
        ep: 1,
        gpus_per_node: 1,
        order: RankOrder::TpCpEpDpPp,
    };
    let mut c = cluster.clone();
    c.gpus_per_node = 1;
    c.nodes = n;
    (
        ExecutionGraph {
            layout,
            programs,
            ep_nic_scale: 1.0,
        },
        c,
    )
}

/// Runs one iteration of `p` on the engine (module docs). `ideal_network`: pipeline messages
/// and the gradient reduction cost nothing (for checks against schedule formulas).
pub fn simulate_hetero(
    p: &HeteroPipeline,
    cluster: &Cluster,
    ideal_network: bool,
) -> Result<HeteroResult, HeteroError> {
    check(p)?;
    let (graph, c) = build_graph(p, cluster);
    let opts = GraphOptions {
        ideal_network,
        record_ranks: (0..graph.layout.pp).collect(),
        ..Default::default()
    };
    let res = simulate_graph(&graph, &c, &opts, None)?;
    let mut spans: Vec<Vec<(f64, f64, f64)>> = Vec::new();
    let mut ends = Vec::new();
    let mut g = 0usize;
    for rep in &p.replicas {
        let mut v = Vec::new();
        let mut end = 0.0f64;
        for _ in &rep.stages {
            let prog = &graph.programs[g];
            let tl = res.timelines.iter().find(|t| t.rank == g as u32);
            let (mut lo, mut hi, mut busy) = (u64::MAX, 0u64, 0u64);
            for rec in tl.map(|t| t.ops.as_slice()).unwrap_or(&[]) {
                if prog.stream[rec.op as usize] == Stream::Compute {
                    lo = lo.min(rec.start);
                    hi = hi.max(rec.end);
                    busy += rec.end - rec.start;
                }
            }
            if lo == u64::MAX {
                lo = 0;
            }
            end = end.max(s_from_ps(hi));
            v.push((s_from_ps(lo), s_from_ps(hi), busy as f64 / PS_PER_S));
            g += 1;
        }
        spans.push(v);
        ends.push(end);
    }
    let sync = if ideal_network {
        0.0
    } else {
        dp_sync_s(p, cluster)
    };
    let pipe = s_from_ps(res.iteration_ps).max(ends.iter().copied().fold(0.0, f64::max));
    Ok(HeteroResult {
        iteration_s: pipe + sync,
        replica_end_s: ends,
        dp_sync_s: sync,
        stage_spans: spans,
        tokens: (p.replicas.iter())
            .flat_map(|r| r.micro_batches.iter())
            .map(|m| m.tokens)
            .sum(),
    })
}

/// The cost of changing plans: a restart plus moving training state over the network.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReconfigCost {
    /// Fixed restart time (process groups rebuilt, kernels warmed), seconds.
    pub restart_s: f64,
    /// Restart time of a checkpoint restart (reload from storage, rebuild), seconds.
    pub checkpoint_restart_s: f64,
}

impl Default for ReconfigCost {
    /// 30 s in-place restart, 600 s checkpoint restart.
    fn default() -> Self {
        ReconfigCost {
            restart_s: 30.0,
            checkpoint_restart_s: 600.0,
        }
    }
}

impl ReconfigCost {
    /// Seconds to move `bytes_per_receiver` (bytes each receiving device takes in) over the
    /// scale-out network plus the restart: the busiest receiver sets the pace. No bytes, no
    /// restart: 0.
    pub fn seconds(&self, bytes_per_receiver: &[u64], cluster: &Cluster) -> f64 {
        let max = bytes_per_receiver.iter().copied().max().unwrap_or(0);
        if max == 0 {
            return 0.0;
        }
        let bw = nic_bytes_per_s(cluster, &CommParams::for_gpu(&cluster.gpu)) as f64;
        self.restart_s + max as f64 / bw
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::h100_cluster;

    fn cost(a: f64, b: f64) -> LayerCost {
        LayerCost {
            token_s: a,
            sq_s: b,
            backward_factor: 2.0,
            tp_bytes_per_token: 0.0,
            act_bytes_per_token: 2,
            grad_bytes_per_layer: 1,
            state_bytes_per_layer: 1,
            state_bytes_per_param: 16,
        }
    }

    fn stage(layers: u32, tp: u32, speed: f64) -> Stage {
        Stage {
            layers,
            devices: (0..tp)
                .map(|i| Device {
                    id: i,
                    speed,
                    failed: false,
                })
                .collect(),
        }
    }

    /// Independent max-plus evaluation of a schedule (no engine): each step ends at the later
    /// of its stage's previous step and its input's arrival, plus its duration.
    fn max_plus(sched: Schedule, f: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
        let p = f.len();
        let m = f[0].len();
        let orders: Vec<Vec<crate::graph::Step>> = (0..p)
            .map(|s| schedule(sched, s as u32, p as u32, m as u32, 1))
            .collect();
        let mut fe = vec![vec![f64::NAN; m]; p];
        let mut be = vec![vec![f64::NAN; m]; p];
        let mut pos = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut progress = true;
        while progress {
            progress = false;
            for s in 0..p {
                while pos[s] < orders[s].len() {
                    let st = orders[s][pos[s]];
                    let i = st.micro_batch as usize;
                    let ready = if st.forward {
                        if s == 0 {
                            Some(0.0)
                        } else {
                            Some(fe[s - 1][i])
                        }
                    } else if s + 1 == p {
                        Some(fe[s][i])
                    } else {
                        Some(be[s + 1][i])
                    };
                    let r = ready.unwrap();
                    if r.is_nan() {
                        break;
                    }
                    let start = free[s].max(r);
                    let end = start + if st.forward { f[s][i] } else { b[s][i] };
                    if st.forward {
                        fe[s][i] = end;
                    } else {
                        be[s][i] = end;
                    }
                    free[s] = end;
                    pos[s] += 1;
                    progress = true;
                }
            }
        }
        free.iter().copied().fold(0.0, f64::max)
    }

    fn run(p: &HeteroPipeline) -> f64 {
        simulate_hetero(p, &h100_cluster(1), true)
            .unwrap()
            .iteration_s
    }

    /// GPipe with unequal stage times and identical micro-batches: the flow-shop closed form
    /// `sum_s t_s + (m - 1) max_s t_s` for the forward sweep, and again for the backward.
    #[test]
    fn gpipe_unequal_stages_match_closed_form() {
        let c = cost(1e-6, 0.0);
        let stages = vec![stage(4, 1, 1.0), stage(2, 1, 1.0), stage(6, 2, 0.5)];
        let m = 5;
        let mb = MicroBatch::uniform(1000, 1);
        let p = HeteroPipeline {
            replicas: vec![Replica {
                stages: stages.clone(),
                micro_batches: vec![mb; m],
            }],
            schedule: Schedule::GPipe,
            cost: c,
        };
        let cl = h100_cluster(1);
        let tf: Vec<f64> = stages.iter().map(|s| forward_s(s, &mb, &c, &cl)).collect();
        let tb: Vec<f64> = stages.iter().map(|s| backward_s(s, &mb, &c, &cl)).collect();
        let flow = |t: &[f64]| {
            t.iter().sum::<f64>() + (m - 1) as f64 * t.iter().cloned().fold(0.0, f64::max)
        };
        let want = flow(&tf) + flow(&tb);
        let got = run(&p);
        assert!((got - want).abs() < 1e-9 * want.max(1.0), "{got} vs {want}");
        // Stage 2 (6 layers, TP 2 at half speed) is 6 / (2 x 0.5) = 6 layer-units: the bottleneck.
        assert!((tf[2] - 6e-3).abs() < 1e-12);
    }

    /// 1F1B with equal stages: `(m + p - 1)(t_f + t_b)`; with unequal stages and variable
    /// micro-batches, the independent max-plus recursion.
    #[test]
    fn one_f_one_b_matches_closed_form_and_max_plus() {
        let c = cost(1e-6, 1e-9);
        let cl = h100_cluster(1);
        let mb = MicroBatch::uniform(1024, 2);
        let (p, m) = (4usize, 7usize);
        let pipe = HeteroPipeline {
            replicas: vec![Replica {
                stages: vec![stage(3, 1, 1.0); p],
                micro_batches: vec![mb; m],
            }],
            schedule: Schedule::OneFOneB,
            cost: c,
        };
        let tf = forward_s(&pipe.replicas[0].stages[0], &mb, &c, &cl);
        let want = (m + p - 1) as f64 * (tf + 2.0 * tf);
        let got = run(&pipe);
        assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");

        // Unequal stages, variable micro-batches, both schedules.
        let stages = vec![stage(5, 2, 1.0), stage(2, 1, 1.0), stage(5, 4, 0.6)];
        let mbs: Vec<MicroBatch> = [
            vec![512u64, 512],
            vec![2048],
            vec![100, 300, 600],
            vec![4096],
        ]
        .iter()
        .map(|l| MicroBatch::packed(l))
        .collect();
        for sched in [Schedule::GPipe, Schedule::OneFOneB] {
            let pipe = HeteroPipeline {
                replicas: vec![Replica {
                    stages: stages.clone(),
                    micro_batches: mbs.clone(),
                }],
                schedule: sched,
                cost: c,
            };
            let f: Vec<Vec<f64>> = (stages.iter())
                .map(|s| mbs.iter().map(|mb| forward_s(s, mb, &c, &cl)).collect())
                .collect();
            let b: Vec<Vec<f64>> = (stages.iter())
                .map(|s| mbs.iter().map(|mb| backward_s(s, mb, &c, &cl)).collect())
                .collect();
            let want = max_plus(sched, &f, &b);
            let got = run(&pipe);
            assert!(
                (got - want).abs() < 1e-9 * want,
                "{sched:?}: {got} vs {want}"
            );
        }
    }

    /// One stage: the iteration is the hand-computed sum over micro-batches of
    /// `3 L (a tokens + b sum len^2)` (forward plus twice as long a backward).
    #[test]
    fn variable_micro_batches_sum_by_hand() {
        let (a, b) = (2e-6, 3e-9);
        let lens = [vec![100u64, 200, 700], vec![1000], vec![10; 100]];
        let mbs: Vec<MicroBatch> = lens.iter().map(|l| MicroBatch::packed(l)).collect();
        assert_eq!(mbs[0].tokens, 1000);
        assert_eq!(mbs[0].sum_sq_len, 10_000 + 40_000 + 490_000);
        let p = HeteroPipeline {
            replicas: vec![Replica {
                stages: vec![stage(4, 1, 1.0)],
                micro_batches: mbs,
            }],
            schedule: Schedule::OneFOneB,
            cost: cost(a, b),
        };
        let want = 3.0 * 4.0 * (a * 3000.0 + b * (540_000.0 + 1_000_000.0 + 10_000.0));
        let got = run(&p);
        assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    }

    /// Replicas run side by side; the slowest sets the iteration; a failed device stops it.
    #[test]
    fn replicas_speed_and_fail_stop() {
        let c = cost(1e-6, 0.0);
        let rep = |speed: f64, m: usize| Replica {
            stages: vec![stage(2, 2, speed), stage(2, 2, 1.0)],
            micro_batches: vec![MicroBatch::uniform(1000, 1); m],
        };
        let p = HeteroPipeline {
            replicas: vec![rep(1.0, 4), rep(0.5, 4), rep(1.0, 6)],
            schedule: Schedule::OneFOneB,
            cost: c,
        };
        let r = simulate_hetero(&p, &h100_cluster(1), true).unwrap();
        assert_eq!(r.replica_end_s.len(), 3);
        assert!(r.replica_end_s[1] > r.replica_end_s[0]);
        assert!(r.replica_end_s[2] > r.replica_end_s[0]);
        assert_eq!(
            r.iteration_s,
            r.replica_end_s.iter().cloned().fold(0.0, f64::max)
        );
        assert_eq!(r.tokens, 14_000);
        let mut bad = p.clone();
        bad.replicas[1].stages[1].devices[0].failed = true;
        assert!(matches!(
            simulate_hetero(&bad, &h100_cluster(1), true),
            Err(HeteroError::FailStop {
                replica: 1,
                stage: 1,
                ..
            })
        ));
        // With the network, messages and the gradient reduction take time.
        let real = simulate_hetero(&p, &h100_cluster(1), false).unwrap();
        assert!(real.iteration_s > r.iteration_s && real.dp_sync_s > 0.0);
    }

    #[test]
    fn reconfiguration_cost() {
        let cl = h100_cluster(1);
        let rc = ReconfigCost::default();
        assert_eq!(rc.seconds(&[], &cl), 0.0);
        let bw = nic_bytes_per_s(&cl, &CommParams::for_gpu(&cl.gpu)) as f64;
        let t = rc.seconds(&[1 << 30, 4 << 30], &cl);
        assert!((t - (30.0 + (4u64 << 30) as f64 / bw)).abs() < 1e-9);
    }
}
