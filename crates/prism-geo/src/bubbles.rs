//! `prism geo bubbles`: BUBBLETEA, inference prefill served inside the training pipeline's
//! bubbles.
//!
//! 1. The training iteration is simulated (one representative per stage, every op recorded);
//!    each stage's *idle intervals* are the gaps of its compute stream, including the warm-up
//!    gap before its first kernel and the cool-down gap after its last one up to the end of the
//!    iteration. Every iteration repeats the same schedule, so the gaps recur with the
//!    iteration period.
//! 2. A prefill request stream (Poisson arrivals or a trace; prompt lengths from a
//!    distribution or the trace) is served by inference instances of `tp` GPUs carved out of
//!    each stage's GPUs. A prefill's latency comes from the engine: the inference model's
//!    forward pass over the prompt, simulated on the same GPUs ([`PrefillModel`]).
//! 3. A request is admitted only where its prefill and the hand-off of its KV cache (over the
//!    instance's NICs, to a decode cluster elsewhere) fit inside one gap with a guard band
//!    before and after, the inference weights and KV cache fit in memory beside the stage's
//!    training state, and its time to first token meets the SLO; otherwise it is left to
//!    dedicated inference servers (not admitted).
//! 4. The training slowdown is *measured*, not assumed: the iteration is simulated again with,
//!    in every gap, a compute op as long as the largest occupation any admitted prefill gave
//!    it (from the gap's start to the end of its hand-off plus the guard band), and the
//!    iteration time and every training kernel's end are compared with the run without.

use prism_core::engine::{Mode, SimError, SimOptions, SimResult, simulate, simulate_with_graph};
use prism_core::graph::{ExecutionGraph, OpKind, Phase};
use prism_core::insert::with_compute_inserted;
use prism_core::job::{Job, Model, RankOrder, Recompute, Schedule};
use prism_core::memory;
use prism_core::ops::{ComputeOp, OpClass, Work};
use prism_core::units::SimTime;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};
use rand_xoshiro::Xoshiro256PlusPlus;

/// Prompt lengths of generated requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PromptDist {
    /// Every prompt has this many tokens.
    Fixed(u32),
    /// Uniform in `[lo, hi]` tokens.
    Uniform {
        /// Shortest.
        lo: u32,
        /// Longest.
        hi: u32,
    },
    /// Log-normal with this median and log-space sigma, clipped to `[16, max]`.
    LogNormal {
        /// Median tokens.
        median: f64,
        /// Sigma of the log.
        sigma: f64,
        /// Longest prompt.
        max: u32,
    },
}

/// One prefill request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// Arrival, seconds from the start.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
}

/// Poisson arrivals at `rate_per_s` for `duration_s`, prompt lengths from `prompts`, seeded.
pub fn poisson_requests(
    rate_per_s: f64,
    duration_s: f64,
    prompts: PromptDist,
    seed: u64,
) -> Vec<Request> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut out = Vec::new();
    if !(rate_per_s > 0.0 && rate_per_s.is_finite()) {
        return out;
    }
    let gap = Exp::new(rate_per_s).expect("positive rate");
    let mut t = 0.0;
    loop {
        t += gap.sample(&mut rng);
        if t > duration_s {
            break;
        }
        let tokens = match prompts {
            PromptDist::Fixed(n) => n,
            PromptDist::Uniform { lo, hi } => rng.random_range(lo.min(hi)..=hi.max(lo)),
            PromptDist::LogNormal { median, sigma, max } => {
                let d = LogNormal::new(median.max(1.0).ln(), sigma.max(0.0)).expect("valid");
                (d.sample(&mut rng).round() as u32).clamp(16, max.max(16))
            }
        };
        out.push(Request {
            arrival_s: t,
            prompt_tokens: tokens.max(1),
        });
    }
    out
}

/// Options of `geo bubbles`.
#[derive(Clone, Debug)]
pub struct BubbleOptions {
    /// The inference model.
    pub model: Model,
    /// Tensor parallelism of one inference instance (GPUs of one node).
    pub tp: u32,
    /// Time-to-first-token objective, s.
    pub slo_s: f64,
    /// Guard band before and after each admitted prefill (and its hand-off), s.
    pub guard_s: f64,
}

/// Prefill latency of an inference model on a GPU type, from the engine: the forward pass of
/// one prompt simulated at a grid of lengths, linear in between.
#[derive(Clone, Debug)]
pub struct PrefillModel {
    /// `(tokens, seconds)`, increasing.
    pub grid: Vec<(u32, f64)>,
    /// KV-cache bytes per prompt token (all layers, K and V, 16-bit).
    pub kv_bytes_per_token: f64,
    /// Inference weights per GPU, bytes.
    pub weight_bytes_per_gpu: f64,
}

/// The job that prices one prefill of `tokens` tokens: `model` on one node of the training
/// cluster, tensor-parallel over `tp` GPUs, one sequence per replica.
pub fn prefill_job(training: &Job, model: &Model, tp: u32, tokens: u32) -> Job {
    let mut job = training.clone();
    job.name = format!("prefill {} x {tokens}", model.name);
    job.model = model.clone();
    job.model.seq_len = tokens.max(1);
    job.model.dropout = false;
    job.cluster.nodes = 1;
    job.cluster.topology.wan = Default::default();
    let dp = (job.cluster.gpus_per_node / tp.max(1)).max(1);
    let p = &mut job.parallel;
    p.tp = tp;
    p.pp = 1;
    p.cp = 1;
    p.ep = 1;
    p.dp = dp;
    p.vpp = 1;
    p.micro_batch = 1;
    p.sequence_parallel = tp > 1;
    p.recompute = Recompute::None;
    p.schedule = Schedule::OneFOneB;
    p.first_stage_layers = None;
    p.last_stage_layers = None;
    p.pipeline_layout = None;
    p.order = RankOrder::TpCpEpDpPp;
    p.tp_comm_overlap = false;
    // No optimizer state to gather before the forward: inference holds its weights.
    p.set_zero_stage(0);
    p.overlap_param_gather = false;
    job.training.global_batch = dp;
    job
}

/// Seconds of the forward pass of the prefill job (its first micro-batch's forward ops on
/// rank 0, TP collectives included).
pub fn prefill_seconds(job: &Job) -> Result<f64, SimError> {
    let r = simulate(
        job,
        &SimOptions {
            mode: Mode::Reduced,
            record_ranks: vec![0],
            ..Default::default()
        },
    )?;
    let prog = &r.graph.programs[0];
    let end = r.timelines[0]
        .ops
        .iter()
        .filter(|o| prog.tag[o.op as usize].phase == Phase::Forward)
        .map(|o| o.end)
        .max()
        .unwrap_or(0);
    Ok(end as f64 * 1e-12)
}

impl PrefillModel {
    /// Simulates the forward pass at 256, 512, ... tokens up to `max_tokens` (at least 256).
    pub fn new(training: &Job, model: &Model, tp: u32, max_tokens: u32) -> Result<Self, SimError> {
        let mut grid = Vec::new();
        let mut n = 256u32;
        loop {
            let s = prefill_seconds(&prefill_job(training, model, tp, n))?;
            grid.push((n, s));
            if n >= max_tokens {
                break;
            }
            n = n.saturating_mul(2);
        }
        let kv_bytes_per_token =
            2.0 * model.layers as f64 * model.kv_heads as f64 * model.head_dim as f64 * 2.0;
        Ok(PrefillModel {
            grid,
            kv_bytes_per_token,
            weight_bytes_per_gpu: model.params() as f64 * 2.0 / tp.max(1) as f64,
        })
    }

    /// Prefill latency of `tokens` tokens, s (linear between grid points, proportional below
    /// the first).
    pub fn seconds(&self, tokens: u32) -> f64 {
        let (n0, s0) = self.grid[0];
        if tokens <= n0 {
            return s0 * tokens as f64 / n0 as f64;
        }
        for w in self.grid.windows(2) {
            let ((a, sa), (b, sb)) = (w[0], w[1]);
            if tokens <= b {
                return sa + (sb - sa) * (tokens - a) as f64 / (b - a) as f64;
            }
        }
        let (a, sa) = self.grid[self.grid.len() - 2];
        let (b, sb) = self.grid[self.grid.len() - 1];
        sb + (sb - sa) * (tokens - b) as f64 / (b - a) as f64
    }
}

/// An idle interval of a stage's compute stream within the iteration, ps, and the compute op
/// (position in the compute stream) it follows (`None`: the warm-up gap before the first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gap {
    /// Start, ps.
    pub start: SimTime,
    /// End, ps.
    pub end: SimTime,
    /// Compute-stream position of the op before it.
    pub after: Option<u32>,
}

/// The simulated training iteration and each stage's idle intervals.
#[derive(Clone, Debug)]
pub struct Schedule1 {
    /// Iteration time, ps.
    pub iteration_ps: SimTime,
    /// Per stage, its gaps in time order.
    pub gaps: Vec<Vec<Gap>>,
    /// Per stage, compute busy time, ps.
    pub busy_ps: Vec<SimTime>,
    /// Per stage, the end of every compute op (by compute-stream position), ps.
    pub op_ends: Vec<Vec<SimTime>>,
    /// Temporal WAN sharing: how far the last pipeline runs behind the representative, ps
    /// (0 otherwise).
    pub lag_ps: SimTime,
}

fn record_opts(job: &Job) -> SimOptions {
    let layout = prism_core::layout::Layout::new(job);
    SimOptions {
        mode: Mode::Reduced,
        record_ranks: (0..job.parallel.pp)
            .map(|s| layout.first_rank_of_stage(s))
            .collect(),
        ..Default::default()
    }
}

fn schedule_of(r: &SimResult) -> Schedule1 {
    let t = (r.summary.iteration_time_s * 1e12).round() as SimTime;
    // With temporal WAN sharing the reduced run's representative is the first pipeline to
    // take each turn; the k-th runs up to k turns (at most `lag`) later, and the iteration ends
    // when the last does. The gaps here are the representative's; admission shortens them per
    // pipeline by its offset, and the last one ends where the representative's own work ends.
    let own_end = r
        .timelines
        .iter()
        .flat_map(|t| t.ops.iter().map(|o| o.end))
        .max()
        .unwrap_or(t)
        .min(t);
    let lag = t - own_end;
    let layout = r.graph.layout;
    let mut gaps = Vec::new();
    let mut busy = Vec::new();
    let mut ends = Vec::new();
    for s in 0..layout.pp {
        let ops = training_compute_ops(r, s);
        let mut g = Vec::new();
        let mut at = 0;
        let mut after = None;
        let mut b = 0;
        for &(pos, st, en) in &ops {
            if st > at {
                g.push(Gap {
                    start: at,
                    end: st,
                    after,
                });
            }
            b += en - st;
            at = en;
            after = Some(pos);
        }
        if own_end > at {
            g.push(Gap {
                start: at,
                end: own_end,
                after,
            });
        }
        gaps.push(g);
        busy.push(b);
        ends.push(ops.iter().map(|o| o.2).collect());
    }
    Schedule1 {
        iteration_ps: t,
        gaps,
        busy_ps: busy,
        op_ends: ends,
        lag_ps: lag,
    }
}

/// Simulates the training iteration of `job` and returns its schedule.
pub fn training_schedule(job: &Job) -> Result<Schedule1, SimError> {
    Ok(schedule_of(&simulate(job, &record_opts(job))?))
}

/// One admitted prefill.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Admitted {
    /// Request index.
    pub request: usize,
    /// Stage whose GPUs ran it.
    pub stage: u32,
    /// Gap index in that stage.
    pub gap: usize,
    /// Prefill start, s from the start of the run.
    pub start_s: f64,
    /// Prefill end (first token), s.
    pub prefill_end_s: f64,
    /// KV hand-off end, s.
    pub handoff_end_s: f64,
    /// Time to first token, s.
    pub ttft_s: f64,
}

/// Result of `geo bubbles`.
#[derive(Clone, Debug)]
pub struct BubbleReport {
    /// Training iteration, s.
    pub iteration_s: f64,
    /// Training iteration with the admitted prefill inserted, s (re-simulated).
    pub iteration_with_prefill_s: f64,
    /// Training slowdown: (with - without) / without, from the re-simulation.
    pub training_slowdown: f64,
    /// Largest shift of any training kernel's end in the re-simulation, s.
    pub max_kernel_shift_s: f64,
    /// Idle share of the GPUs' time (compute stream) without prefill.
    pub idle_fraction: f64,
    /// GPU utilisation (compute-busy share) without prefill.
    pub utilisation_without: f64,
    /// GPU utilisation with the admitted prefill.
    pub utilisation_with: f64,
    /// Requests offered.
    pub requests: usize,
    /// Requests admitted.
    pub admitted: Vec<Admitted>,
    /// Prompt tokens admitted.
    pub admitted_tokens: u64,
    /// Seconds covered by the request stream.
    pub horizon_s: f64,
    /// TTFT percentiles of admitted requests (p50, p99), s.
    pub ttft_p50_s: f64,
    /// See `ttft_p50_s`.
    pub ttft_p99_s: f64,
    /// SLO, s.
    pub slo_s: f64,
    /// Stages where the inference model fits in memory beside training.
    pub stages_fitting: Vec<bool>,
    /// Prefill model used.
    pub prefill: PrefillModel,
    /// Training schedule.
    pub schedule: Schedule1,
    /// Inference instances per stage.
    pub instances_per_stage: u32,
    /// The slowdown check's occupation per (stage, gap), ps from the gap's start.
    pub occupation: Vec<Vec<SimTime>>,
}

impl BubbleReport {
    /// Admitted prefill per second.
    pub fn prefill_per_s(&self) -> f64 {
        self.admitted.len() as f64 / self.horizon_s.max(1e-12)
    }
    /// Admitted prompt tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.admitted_tokens as f64 / self.horizon_s.max(1e-12)
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Runs BUBBLETEA on `job`'s training iteration for `requests` (sorted by arrival).
pub fn bubbles(
    job: &Job,
    requests: &[Request],
    opts: &BubbleOptions,
) -> Result<BubbleReport, SimError> {
    let (tp, max_tokens) = prefill_shape(job, requests, opts);
    let prefill = PrefillModel::new(job, &opts.model, tp, max_tokens)?;
    bubbles_with(job, requests, opts, prefill)
}

/// The prefill's tensor parallelism (inside one node) and the longest prompt (256 tokens when
/// there are no requests).
fn prefill_shape(job: &Job, requests: &[Request], opts: &BubbleOptions) -> (u32, u32) {
    let tp = opts.tp.clamp(1, job.cluster.gpus_per_node);
    let max_tokens = requests
        .iter()
        .map(|r| r.prompt_tokens)
        .max()
        .unwrap_or(256);
    (tp, max_tokens)
}

/// [`bubbles`] with a prefill model already made (it must cover the longest prompt).
pub fn bubbles_with(
    job: &Job,
    requests: &[Request],
    opts: &BubbleOptions,
    prefill: PrefillModel,
) -> Result<BubbleReport, SimError> {
    let sched = training_schedule(job)?;
    let pp = job.parallel.pp;
    let t_it = sched.iteration_ps as f64 * 1e-12;
    let (tp, max_tokens) = prefill_shape(job, requests, opts);
    // Memory beside training: weights + KV of the longest prompt + activations of one layer
    // (a few hidden-sized tensors per token), per GPU.
    let hbm = job.cluster.gpu.hbm_gib * (1u64 << 30) as f64;
    let act = 8.0 * max_tokens as f64 * opts.model.hidden.max(opts.model.ffn_hidden) as f64 * 2.0
        / tp as f64;
    let need = prefill.weight_bytes_per_gpu
        + prefill.kv_bytes_per_token * max_tokens as f64 / tp as f64
        + act;
    let stages_fitting: Vec<bool> = (0..pp)
        .map(|s| memory::stage_memory(job, s).total() as f64 + need <= hbm)
        .collect();
    let stage_gpus = job.parallel.tp * job.parallel.cp * job.parallel.dp;
    let instances = (stage_gpus / tp).max(1);
    // Instances belong to pipelines (data-parallel replicas); with temporal WAN sharing the
    // k-th pipeline may run up to k turns behind the representative, so its gaps (all but the
    // warm-up one, which later pipelines only lengthen) are usable only from `offset` after
    // their start: idle for every shift in [0, offset]. Pipelines are grouped into classes
    // sharing the class's largest offset.
    let dp = job.parallel.dp.max(1);
    let lag_s = sched.lag_ps as f64 * 1e-12;
    let classes = if sched.lag_ps == 0 { 1 } else { dp.min(8) };
    let per_pipeline = (job.parallel.tp * job.parallel.cp / tp).max(1);
    let class_of =
        |i: u32| ((i / per_pipeline).min(dp - 1) as u64 * classes as u64 / dp as u64) as u32;
    let offset: Vec<f64> = (0..classes)
        .map(|c| {
            // The last pipeline of class c.
            let last =
                (((c + 1) as u64 * dp as u64).div_ceil(classes as u64) - 1).min(dp as u64 - 1);
            if dp > 1 {
                lag_s * last as f64 / (dp - 1) as f64
            } else {
                0.0
            }
        })
        .collect();
    // Per stage and class, the free times of its instances (s, as order-preserving bits of
    // non-negative f64); instances of a class are identical, so the earliest free one is used.
    let mut free: Vec<Vec<std::collections::BinaryHeap<std::cmp::Reverse<u64>>>> = (0..pp)
        .map(|_| {
            let mut v: Vec<std::collections::BinaryHeap<std::cmp::Reverse<u64>>> =
                vec![Default::default(); classes as usize];
            for i in 0..instances {
                v[class_of(i) as usize].push(std::cmp::Reverse(0f64.to_bits()));
            }
            v
        })
        .collect();
    let nic = job.cluster.nic_gbps * 1e9 / 8.0;
    let nic_lat = job.cluster.nic_latency_us * 1e-6;
    let guard = opts.guard_s.max(0.0);
    let mut occupation: Vec<Vec<SimTime>> = sched.gaps.iter().map(|g| vec![0; g.len()]).collect();
    let mut admitted = Vec::new();
    let mut tokens = 0u64;
    for (ri, r) in requests.iter().enumerate() {
        let p = prefill.seconds(r.prompt_tokens);
        let h = nic_lat + prefill.kv_bytes_per_token * r.prompt_tokens as f64 / (tp as f64 * nic);
        // finish, stage, class, gap, start
        let mut best: Option<(f64, u32, usize, usize, f64)> = None;
        for (s, c) in (0..pp).flat_map(|s| (0..classes as usize).map(move |c| (s, c))) {
            if !stages_fitting[s as usize] {
                continue;
            }
            let Some(top) = free[s as usize][c].peek() else {
                continue;
            };
            let f = f64::from_bits(top.0);
            let t0 = r.arrival_s.max(f);
            let mut it = (t0 / t_it).floor().max(0.0) as u64;
            let gaps = &sched.gaps[s as usize];
            'scan: while (it as f64) * t_it <= r.arrival_s + opts.slo_s {
                let base = it as f64 * t_it;
                // Gaps that end before the earliest start cannot hold it.
                let from_ps = ((t0 - base).max(0.0) * 1e12) as SimTime;
                let first = gaps.partition_point(|g| g.end <= from_ps);
                for (gi, g) in gaps.iter().enumerate().skip(first) {
                    let lead = if g.after.is_some() { offset[c] } else { 0.0 };
                    let gs = base + g.start as f64 * 1e-12 + lead;
                    let ge = base + g.end as f64 * 1e-12;
                    let start = t0.max(gs + guard);
                    if start + p + h + guard <= ge {
                        let finish = start + p;
                        if finish - r.arrival_s <= opts.slo_s && best.is_none_or(|b| finish < b.0) {
                            best = Some((finish, s, c, gi, start));
                        }
                        break 'scan;
                    }
                }
                it += 1;
            }
        }
        if let Some((finish, s, c, gi, start)) = best {
            free[s as usize][c].pop();
            free[s as usize][c].push(std::cmp::Reverse((finish + h).to_bits()));
            let g = sched.gaps[s as usize][gi];
            let base = (start / t_it).floor() * t_it;
            let occ = ((finish + h + guard - base) * 1e12).round() as SimTime;
            let o = &mut occupation[s as usize][gi];
            *o = (*o).max(occ.saturating_sub(g.start).min(g.end - g.start));
            tokens += r.prompt_tokens as u64;
            admitted.push(Admitted {
                request: ri,
                stage: s,
                gap: gi,
                start_s: start,
                prefill_end_s: finish,
                handoff_end_s: finish + h,
                ttft_s: finish - r.arrival_s,
            });
        }
    }
    // Verification: the iteration again with every gap's largest occupation as a compute op.
    let graph = ExecutionGraph::build(job);
    let programs = graph
        .programs
        .iter()
        .enumerate()
        .map(|(s, prog)| {
            let inserts: Vec<(Option<u32>, ComputeOp)> = sched.gaps[s]
                .iter()
                .zip(&occupation[s])
                .filter(|(_, o)| **o > 0)
                .map(|(g, &o)| {
                    (
                        g.after,
                        ComputeOp {
                            name: PREFILL_OP,
                            class: OpClass::Gemm,
                            // From the end of the op before the gap (the gap's start) to the
                            // end of the last hand-off plus the guard band: it covers every
                            // pipeline's prefill seen in the representative's frame.
                            work: Work::Measured { ps: o },
                            recompute: false,
                            sm_margin: false,
                        },
                    )
                })
                .collect();
            with_compute_inserted(prog, &inserts)
        })
        .collect();
    let again = simulate_with_graph(
        job,
        ExecutionGraph {
            layout: graph.layout,
            programs,
            ep_nic_scale: graph.ep_nic_scale,
        },
        &record_opts(job),
    )?;
    let with = schedule_of_filtered(&again);
    let max_shift = sched
        .op_ends
        .iter()
        .zip(&with)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| y.abs_diff(*x)))
        .max()
        .unwrap_or(0);
    let t_with = again.summary.iteration_time_s;
    let horizon = requests
        .iter()
        .map(|r| r.arrival_s)
        .fold(0.0, f64::max)
        .max(t_it);
    let gpus = job.num_gpus() as f64;
    let busy: f64 =
        sched.busy_ps.iter().map(|&b| b as f64 * 1e-12).sum::<f64>() / (pp as f64 * t_it);
    let prefill_gpu_s: f64 = admitted
        .iter()
        .map(|a| (a.prefill_end_s - a.start_s) * tp as f64)
        .sum();
    let mut ttft: Vec<f64> = admitted.iter().map(|a| a.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    Ok(BubbleReport {
        iteration_s: t_it,
        iteration_with_prefill_s: t_with,
        training_slowdown: (t_with - t_it) / t_it,
        max_kernel_shift_s: max_shift as f64 * 1e-12,
        idle_fraction: 1.0 - busy,
        utilisation_without: busy,
        utilisation_with: busy + prefill_gpu_s / (gpus * horizon),
        requests: requests.len(),
        admitted_tokens: tokens,
        horizon_s: horizon,
        ttft_p50_s: percentile(&ttft, 0.5),
        ttft_p99_s: percentile(&ttft, 0.99),
        admitted,
        slo_s: opts.slo_s,
        stages_fitting,
        prefill,
        schedule: sched,
        instances_per_stage: instances,
        occupation,
    })
}

/// Name of the compute ops that stand for admitted prefill in a re-simulated iteration.
const PREFILL_OP: &str = "prefill";

/// Compute-op ends per stage of a re-simulated run, the inserted prefill ops left out.
fn schedule_of_filtered(r: &SimResult) -> Vec<Vec<SimTime>> {
    (0..r.graph.layout.pp)
        .map(|s| {
            training_compute_ops(r, s)
                .into_iter()
                .map(|o| o.2)
                .collect()
        })
        .collect()
}

/// The training compute ops (inserted prefill ops left out) of stage `stage`'s representative
/// rank, as `(position in the program, start, end)` in program order.
fn training_compute_ops(r: &SimResult, stage: u32) -> Vec<(u32, SimTime, SimTime)> {
    let rank = r.graph.layout.first_rank_of_stage(stage);
    let prog = &r.graph.programs[stage as usize];
    let tl = r
        .timelines
        .iter()
        .find(|t| t.rank == rank)
        .expect("recorded");
    let mut ops: Vec<(u32, SimTime, SimTime)> = tl
        .ops
        .iter()
        .filter(|o| match prog.kind[o.op as usize] {
            OpKind::Compute(c) => c.name != PREFILL_OP,
            _ => false,
        })
        .map(|o| (prog.pos[o.op as usize], o.start, o.end))
        .collect();
    ops.sort_unstable();
    ops
}

/// The compute stream, for plots: per stage, `(start, end, is_prefill)` of the training
/// kernels (merged where contiguous) and of the admitted prefill of the first iteration that
/// holds any, in s within the iteration.
pub fn stage_timeline(rep: &BubbleReport, stage: u32) -> Vec<(f64, f64, bool)> {
    let s = stage as usize;
    let t_it = rep.iteration_s;
    let mut bars = Vec::new();
    let mut at = 0.0;
    for g in &rep.schedule.gaps[s] {
        let gs = g.start as f64 * 1e-12;
        if gs > at {
            bars.push((at, gs, false));
        }
        at = g.end as f64 * 1e-12;
    }
    if at < t_it {
        bars.push((at, t_it, false));
    }
    let first_it = rep
        .admitted
        .iter()
        .filter(|a| a.stage == stage)
        .map(|a| (a.start_s / t_it).floor())
        .fold(f64::INFINITY, f64::min);
    if first_it.is_finite() {
        for a in rep.admitted.iter().filter(|a| a.stage == stage) {
            if (a.start_s / t_it).floor() == first_it {
                let base = first_it * t_it;
                bars.push((a.start_s - base, a.handoff_end_s - base, true));
            }
        }
    }
    bars
}
