//! Max-plus evaluation of one iteration with frozen communication: the Monte Carlo step model
//! that makes `prism predict` fast at 65,536 GPUs.
//!
//! PRISM (Golden et al., arXiv:2510.15596) composes a step from sampled op durations: a kernel
//! takes its own draw, a collective takes one duration shared by all its participants, and the
//! step is the longest path of the dependency graph ("sum along serial dependencies, max over
//! joining branches"). With every communication duration fixed, the engine's run *is* that
//! longest path, and this module evaluates it directly, without events or a network:
//!
//! 1. One deterministic reduced engine run ([`crate::engine::simulate`]) records the duration of
//!    every collective and send of each stage. These are frozen; a sample scales them by its
//!    communication regime.
//! 2. Each stage's [`Program`](crate::graph::Program) is compiled into macro-ops: a run of
//!    kernels that nothing outside the compute stream can observe becomes one *segment*.
//! 3. A sample evaluates one data-parallel replica at a time (its stages exchange pipeline
//!    messages; its TP members are the *lanes* of each stage), in dataflow order: an op is
//!    evaluated once its inputs are known, `end = max(inputs) + duration`. A TP collective
//!    starts at the maximum over lanes. Replicas meet only in data-parallel collectives: those
//!    that depend on nothing but earlier DP collectives (the parameter all-gather at the start)
//!    are the same on every replica; the rest (gradient reduce-scatter, the optimizer and
//!    everything after) form the *tail*, evaluated last with the maximum over replicas.
//!
//! Two samplers:
//! - [`StepModel::sample_exact`] draws every kernel exactly as the engine does (the same
//!   counter-based hash of seed, rank and op). It equals the engine's perturbed full run
//!   whenever communication durations do not depend on timing (no contention on shared links,
//!   e.g. within a node), to the picosecond; that is the test of this module.
//! - [`StepModel::sample_fast`] draws per segment and uses the exact shortcuts: a segment's time
//!   is the sum of its kernels' normal factors, itself normal (`N(sum d mu, sum d^2 sigma^2)`);
//!   when the lanes of a TP group are i.i.d. and only their maximum is observable (the segment
//!   ends in a TP collective that gates the next kernel), the maximum of `L` i.i.d. normals is
//!   drawn once, as `Phi^-1(U^(1/L))` (order statistics); with persistent per-GPU speeds and no
//!   jitter the maximum is the slowest lane's time. Each draw is exact in distribution (up to
//!   picosecond rounding, the engine's truncation of a normal factor at 1e-3, and the
//!   interpolation of a 16,384-point quantile table, below 1e-6 standard deviations in the
//!   body). A class whose jitter is not one normal (log-normal, gamma, empirical, several
//!   distributions) has no segment-sum shortcut: its segments are drawn kernel by kernel from
//!   the class's distributions (several at one shared uniform, as the engine draws them).
//!
//! Context parallelism: a stage of a replica has `tp x cp` lanes; a TP collective starts at the
//! latest lane of its TP group, a CP collective at the latest of its CP group, and a tail DP
//! collective at the latest over every replica's lanes of the same TP rank (Megatron's `dp_cp`
//! group). The order-statistic shortcut for segments applies when `cp = 1`.
//!
//! Scope: dense models (no expert parallelism) and a symmetric placement; other jobs get
//! [`SimError::InvalidOption`] and callers fall back to the per-rank engine.

use std::collections::BTreeMap;

use rand::RngExt;
use rand_distr::{Distribution, StandardNormal};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::engine::{Mode, Perturbation, SimError, SimOptions};
use crate::graph::{ExecutionGraph, NUM_STREAMS, OpKind, Stream};
use crate::job::Job;
use crate::layout::{Coord, GroupKind, Layout};
use crate::ops::OpClass;
use crate::units::SimTime;
use crate::variability::Dist;

/// What a macro-op does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum MKind {
    /// Kernels `k0..k1` of the compute stream (indices into the stage's kernel arrays).
    Seg { k0: u32, k1: u32, collapsible: bool },
    /// Tensor-parallel collective of frozen duration `d` (starts at the latest lane of its
    /// group: the lanes of the same context-parallel rank).
    Tp { d: SimTime },
    /// Context-parallel collective of frozen duration `d` (starts at the latest lane of its
    /// group: the lanes of the same tensor-parallel rank).
    Cp { d: SimTime },
    /// Collective of a group of one, or a data-parallel collective that every replica reaches
    /// at the same time: lane-local, duration `d`.
    Local { d: SimTime },
    /// Data-parallel collective of the tail (maximum over replicas).
    Dp { d: SimTime },
    /// Pipeline send of duration `d` to the stage `delta` away, into mailbox `slot`.
    Send { d: SimTime, delta: i8, slot: u32 },
    /// Pipeline receive from mailbox `slot`.
    Recv { slot: u32 },
}

/// One stage's program as macro-ops (op ids are a topological order).
#[derive(Clone, Debug, Default)]
struct StageProg {
    kind: Vec<MKind>,
    stream: Vec<u8>,
    pos: Vec<u32>,
    dep_off: Vec<u32>,
    deps: Vec<u32>,
    stream_ops: [Vec<u32>; NUM_STREAMS],
    /// Evaluated in the tail (after every replica's pipeline).
    tail: Vec<bool>,
    /// Slot in the tail store (boundary and tail ops), `u32::MAX` otherwise.
    slot: Vec<u32>,
    slots: u32,
    tail_ops: Vec<u32>,
    boundary_ops: Vec<u32>,
    recv_slots: u32,
    /// Kernels of the compute stream in order: nominal ps, class and original op id.
    kd: Vec<SimTime>,
    kclass: Vec<OpClass>,
    kname: Vec<&'static str>,
    kop: Vec<u32>,
    /// Original op id of each macro-op (a segment's first kernel).
    orig_op: Vec<u32>,
    /// Gates of each segment (CSR): (kernel index, op) where a kernel inside the segment also
    /// waits for a parameter all-gather that is the same on every lane and replica.
    gate_off: Vec<u32>,
    gates: Vec<(u32, u32)>,
    /// Streams to re-check once an op is done (its own and those of its dependents).
    wake: Vec<u8>,
}

impl StageProg {
    fn deps_of(&self, op: u32) -> &[u32] {
        &self.deps[self.dep_off[op as usize] as usize..self.dep_off[op as usize + 1] as usize]
    }

    fn gates_of(&self, op: u32) -> &[(u32, u32)] {
        &self.gates[self.gate_off[op as usize] as usize..self.gate_off[op as usize + 1] as usize]
    }

    /// The op before `op` on its stream.
    fn stream_pred(&self, op: u32) -> Option<u32> {
        let p = self.pos[op as usize];
        (p > 0).then(|| self.stream_ops[self.stream[op as usize] as usize][p as usize - 1])
    }

    /// Index of `op` (a boundary or tail op) of replica `r`, lane `lane`, in the tail store.
    fn tail_at(&self, r: usize, op: u32, lane: usize, l: usize) -> usize {
        (r * self.slots as usize + self.slot[op as usize] as usize) * l + lane
    }

    /// Ready time of tail op `op` on replica `r`, lane `lane`: the latest end among its
    /// predecessors in the tail store, and that predecessor (the first on ties).
    fn tail_ready(&self, store: &[f64], r: usize, op: u32, lane: usize, l: usize) -> (f64, u32) {
        let mut best = (0.0f64, u32::MAX);
        for p in self.preds(op) {
            let e = store[self.tail_at(r, p, lane, l)];
            if best.1 == u32::MAX || e > best.0 {
                best = (e, p);
            }
        }
        best
    }

    /// Everything `op` waits for: its stream predecessor and its dependencies.
    fn preds(&self, op: u32) -> impl Iterator<Item = u32> + '_ {
        self.stream_pred(op)
            .into_iter()
            .chain(self.deps_of(op).iter().copied())
    }
}

/// Per-segment statistics of the fast sampler.
#[derive(Clone, Debug)]
struct SegStats {
    /// Mean duration of each macro-op that is a segment (ps; 0 otherwise), per stage.
    mean: Vec<Vec<f64>>,
    /// Standard deviation (ps), per stage.
    sd: Vec<Vec<f64>>,
    /// Factor mean and standard deviation per jitter group (kernels of one class with the same
    /// op-name entries; for a group drawn per kernel: the mean, used only to weigh
    /// attribution, and 0).
    group: Vec<(f64, f64)>,
    /// Groups whose jitter is not one normal: drawn kernel by kernel as a constant times the
    /// product of these distributions.
    kernel: Vec<Option<KernelDraw>>,
    /// Jitter group of each kernel, per stage.
    kgroup: Vec<Vec<u32>>,
    /// Segments (per stage) holding such a kernel.
    pk: Vec<Vec<bool>>,
}

/// The per-kernel draw of a class whose jitter has no segment-sum shortcut: `k` times one draw
/// of the only distribution, or, when several apply, the product of their quantiles at one
/// shared uniform (as the engine draws them).
#[derive(Clone, Debug)]
struct KernelDraw {
    k: f64,
    dists: Vec<Dist>,
}

impl KernelDraw {
    fn draw(&self, rng: &mut Xoshiro256PlusPlus) -> f64 {
        match self.dists.as_slice() {
            [d] => self.k * d.sample(rng),
            ds => {
                let u: f64 = rng.random();
                self.k * ds.iter().map(|d| d.quantile(u)).product::<f64>()
            }
        }
    }

    fn mean(&self) -> f64 {
        self.k * self.dists.iter().map(Dist::mean).product::<f64>()
    }
}

/// Quantile table of the maximum of `lanes` i.i.d. standard normals.
#[derive(Clone, Debug)]
struct MaxTable {
    lanes: u32,
    q: Vec<f64>,
}

const TABLE_POINTS: usize = 16_384;
/// Bins at either end (1% of the probability each) computed exactly instead of interpolated.
const TABLE_EXACT_BINS: usize = 164;

impl MaxTable {
    fn new(lanes: u32) -> Self {
        let q = (0..=TABLE_POINTS)
            .map(|k| Self::exact(lanes, k as f64 / TABLE_POINTS as f64))
            .collect();
        MaxTable { lanes, q }
    }

    fn exact(lanes: u32, u: f64) -> f64 {
        crate::stats::std_normal_quantile(u.powf(1.0 / lanes as f64))
    }

    /// `Phi^-1(u^(1/lanes))`.
    fn quantile(&self, u: f64) -> f64 {
        let x = u * TABLE_POINTS as f64;
        let i = x as usize;
        if !(TABLE_EXACT_BINS..TABLE_POINTS - TABLE_EXACT_BINS).contains(&i) {
            return Self::exact(self.lanes, u);
        }
        let w = x - i as f64;
        self.q[i] + w * (self.q[i + 1] - self.q[i])
    }
}

/// The compiled step model of a job.
#[derive(Clone, Debug)]
pub struct StepModel {
    layout: Layout,
    stages: Vec<StageProg>,
    /// The execution graph (op names for attribution).
    graph: ExecutionGraph,
    nominal_s: f64,
    /// The replica program with nominal durations (no lane differs from another).
    nominal_tape: Tape,
}

/// Where a macro-op's end lives in a replica's value array: one time shared by every lane of
/// the stage, or one per lane (`lanes` consecutive values).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Val {
    at: u32,
    lanes: bool,
}

/// What an instruction of the replica program computes.
#[derive(Clone, Copy, Debug)]
enum Code {
    /// Ends at its latest input plus `d` (times the communication regime): a collective of a
    /// group of one, a head data-parallel collective, a send, or (`d = 0`) a receive.
    Add { d: SimTime },
    /// A tensor-parallel collective: starts at the latest input over the lanes of its group
    /// (every lane when `cp = 1`).
    Tp { d: SimTime },
    /// A context-parallel collective: starts at the latest input over the lanes of its group.
    Cp { d: SimTime },
    /// A segment: nominal time `m` (ps), standard deviation `sd` of its fast draw, gates in
    /// `Tape::gates[g0..g1]`.
    Seg {
        m: f64,
        sd: f64,
        collapsible: bool,
        g0: u32,
        g1: u32,
        /// Drawn kernel by kernel (a jitter without the normal shortcut).
        pk: bool,
    },
    /// A fused run of one-time-for-every-lane steps `Tape::steps[s0..s1]`, each starting when
    /// the previous one ends (see [`Tape::fuse`]).
    Run { s0: u32, s1: u32 },
}

/// One step of a fused run: a duration added to the running time, whose end is written to
/// value `out`.
#[derive(Clone, Copy, Debug)]
struct Step {
    out: u32,
    kind: StepKind,
}

#[derive(Clone, Copy, Debug)]
enum StepKind {
    /// A collective (or receive) of frozen duration `d`, scaled by the communication regime.
    Comm { d: SimTime },
    /// A segment whose lanes start together and of which only the latest lane is observable
    /// (or whose lanes are all alike): nominal `m`, standard deviation `sd`.
    Seg { m: f64, sd: f64 },
}

/// One instruction: macro-op `op` of stage `stage`.
#[derive(Clone, Debug)]
struct Ins {
    code: Code,
    stage: u32,
    op: u32,
    out: Val,
    /// Inputs in `Tape::inputs[i0..i1]`; `lanes_in`: at least one holds per-lane times.
    i0: u32,
    i1: u32,
    lanes_in: bool,
}

/// A replica's macro-ops as a straight-line program: the dataflow order is the same for every
/// replica and sample, so it is found once (a static sweep of the stages) and every sample only
/// replays it. Whether a value is per lane is decided statically too: a segment whose lanes
/// may differ (jitter, per-GPU speeds) makes its successors per lane until a tensor-parallel
/// collective joins them again.
#[derive(Clone, Debug, Default)]
struct Tape {
    ins: Vec<Ins>,
    inputs: Vec<Val>,
    steps: Vec<Step>,
    /// The instructions before fusion, and the one producing each value (critical paths).
    orig: Vec<Ins>,
    producer: Vec<u32>,
    /// (kernel index, value of the gating all-gather).
    gates: Vec<(u32, Val)>,
    /// Values per replica.
    len: usize,
    /// Value of each macro-op of each stage (`None` for tail ops).
    val: Vec<Vec<Option<Val>>>,
    /// Ends that nothing outside the tail waits for: their maximum is the replica's last end
    /// (every duration is non-negative).
    sinks: Vec<Val>,
}

impl Tape {
    /// Fuses chains of instructions into runs: an instruction whose inputs and output are one
    /// time for every lane joins the run that produced one of its inputs when every other input
    /// is an ancestor of the run's last instruction (so it ends no later; every duration is
    /// non-negative). A run is evaluated as one loop where it starts; the instructions it
    /// absorbed were placed later, but everything they read is computed by the run or before it.
    /// Works on the unfused list `orig` (with `producer` set) and replaces `ins`.
    fn fuse(&mut self) {
        let old = &self.orig;
        // Open runs by the value of their last step: (index in the new list, last old index).
        let mut open: std::collections::BTreeMap<u32, (usize, u32)> = Default::default();
        let mut new: Vec<Ins> = Vec::with_capacity(old.len());
        let mut steps: Vec<Vec<Step>> = Vec::new();
        for (i, ins) in old.iter().enumerate() {
            let inputs = &self.inputs[ins.i0 as usize..ins.i1 as usize];
            let kind = match ins.code {
                _ if ins.lanes_in || ins.out.lanes => None,
                Code::Tp { d } | Code::Cp { d } | Code::Add { d } => Some(StepKind::Comm { d }),
                Code::Seg {
                    m,
                    sd,
                    g0,
                    g1,
                    pk: false,
                    ..
                } if g0 == g1 => Some(StepKind::Seg { m, sd }),
                _ => None,
            };
            let Some(kind) = kind else {
                new.push(ins.clone());
                continue;
            };
            let step = Step {
                out: ins.out.at,
                kind,
            };
            // A run this instruction can join.
            let join = inputs.iter().find_map(|v| {
                let &(run, last) = open.get(&v.at)?;
                let others_earlier = inputs
                    .iter()
                    .filter(|w| w.at != v.at)
                    .all(|w| self.is_ancestor(self.producer[w.at as usize], last));
                others_earlier.then_some((v.at, run))
            });
            match join {
                Some((at, run)) => {
                    open.remove(&at);
                    let Code::Run { s0, .. } = new[run].code else {
                        unreachable!("open runs are runs")
                    };
                    steps[s0 as usize].push(step);
                    open.insert(ins.out.at, (run, i as u32));
                }
                None => {
                    let id = steps.len() as u32;
                    steps.push(vec![step]);
                    open.insert(ins.out.at, (new.len(), i as u32));
                    new.push(Ins {
                        code: Code::Run { s0: id, s1: 0 },
                        ..ins.clone()
                    });
                }
            }
        }
        // Lay the runs' steps out contiguously.
        let mut flat = Vec::with_capacity(old.len());
        for ins in &mut new {
            if let Code::Run { s0, .. } = ins.code {
                let run = &steps[s0 as usize];
                let start = flat.len() as u32;
                flat.extend_from_slice(run);
                ins.code = Code::Run {
                    s0: start,
                    s1: flat.len() as u32,
                };
            }
        }
        self.steps = flat;
        self.ins = new;
    }

    /// Whether unfused instruction `a` is an ancestor of `b` (`a == b` included), by a bounded
    /// backward search over inputs; "no" when unsure.
    fn is_ancestor(&self, a: u32, b: u32) -> bool {
        const LIMIT: usize = 64;
        if a == u32::MAX {
            return false;
        }
        let mut stack = vec![b];
        let mut seen = 0;
        while let Some(x) = stack.pop() {
            if x == a {
                return true;
            }
            seen += 1;
            if seen > LIMIT {
                return false;
            }
            // Inputs are produced earlier in the old order; `a` cannot be reached from below it.
            if x < a {
                continue;
            }
            let ins = &self.orig[x as usize];
            for v in &self.inputs[ins.i0 as usize..ins.i1 as usize] {
                let p = self.producer[v.at as usize];
                if p != u32::MAX && p >= a {
                    stack.push(p);
                }
            }
        }
        false
    }
}

/// The larger of two times (never NaN): a plain comparison, cheaper than `f64::max` in the
/// sampler's inner loops.
#[inline(always)]
fn mx(a: f64, b: f64) -> f64 {
    if a > b { a } else { b }
}

/// The candidate that ends latest (the first on ties): `((end, what), replica, lane)`.
fn latest<T>(
    it: impl Iterator<Item = ((f64, T), usize, usize)>,
) -> Option<((f64, T), usize, usize)> {
    it.fold(None, |best, c| match best {
        Some(b) if b.0.0 >= c.0.0 => Some(b),
        _ => Some(c),
    })
}

/// Scaling of frozen communication durations by a sample's regime. The engine rounds a scaled
/// duration to the picosecond (the exact and nominal evaluations do too); the fast sampler need
/// not.
#[derive(Clone, Copy, Debug, Default)]
struct Scale {
    c: f64,
    round: bool,
}

impl Scale {
    fn new(c: f64, draw: &Draw) -> Self {
        Scale {
            c,
            round: !matches!(draw, Draw::Fast { .. }),
        }
    }

    #[inline]
    fn of(self, d: SimTime) -> f64 {
        if self.c == 1.0 {
            d as f64
        } else if self.round {
            (d as f64 * self.c).round()
        } else {
            d as f64 * self.c
        }
    }
}

/// Scratch space of one evaluation.
struct Work {
    /// Ends of the current replica's macro-ops (see [`Tape`]).
    vals: Vec<f64>,
    ready: Vec<f64>,
    /// Persistent per-GPU factors of the current replica, `tp` per stage.
    lane_fs: Vec<f64>,
    /// The slowest lane's factor per stage.
    fmax: Vec<f64>,
}

impl Work {
    fn new(m: &StepModel, tape: &Tape) -> Self {
        let l = lanes(&m.layout);
        let pp = m.layout.pp as usize;
        Work {
            vals: vec![0.0; tape.len],
            ready: vec![0.0; l],
            lane_fs: vec![1.0; pp * l],
            fmax: vec![1.0; pp],
        }
    }
}

/// Where the iteration's last end was produced.
#[derive(Clone, Copy, Debug, Default)]
enum Loc {
    /// Nothing ran.
    #[default]
    Start,
    /// Lane `lane` of value `val` of replica `r`'s program.
    Replica { r: usize, val: Val, lane: usize },
    /// Tail op `op` of stage `s`, replica `r`, lane `lane`.
    Tail {
        s: usize,
        op: u32,
        r: usize,
        lane: usize,
    },
}

/// The latest end seen so far and where it was produced (the first on ties).
#[derive(Clone, Copy, Debug, Default)]
struct Latest {
    t: f64,
    at: Loc,
}

impl Latest {
    #[inline]
    fn note(&mut self, e: f64, at: Loc) {
        if e > self.t {
            *self = Latest { t: e, at };
        }
    }
}

/// What [`StepModel::evaluate_traced`] keeps for the critical-path walk.
#[derive(Debug, Default)]
struct Trace {
    store: Vec<Vec<f64>>,
    last: Loc,
    scale: Scale,
}

/// Who a part of the critical path is charged to.
#[derive(Clone, Copy, Debug)]
enum Who {
    /// One GPU's own work.
    Rank(u32),
    /// A tensor-parallel group (by its first rank): its collectives, and segments drawn as the
    /// maximum over its lanes.
    Group(u32),
    /// A data-parallel collective (every replica).
    Nobody,
}

/// Critical-path charges in picoseconds (ordered maps: the output does not depend on hashing).
#[derive(Default)]
struct Charges {
    by_op: BTreeMap<String, f64>,
    by_class: BTreeMap<String, f64>,
    class_of: BTreeMap<String, String>,
    by_rank: BTreeMap<u32, f64>,
    by_group: BTreeMap<u32, f64>,
    path: f64,
}

impl Charges {
    fn finish(self, step_s: f64) -> StepAttribution {
        fn sorted<K: Ord + Clone>(m: BTreeMap<K, f64>) -> Vec<(K, f64)> {
            let mut v: Vec<(K, f64)> = m
                .into_iter()
                .filter(|(_, t)| *t > 0.0)
                .map(|(k, t)| (k, t * 1e-12))
                .collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            v
        }
        StepAttribution {
            step_s,
            by_op: sorted(self.by_op),
            by_class: sorted(self.by_class),
            class_of: self.class_of,
            by_rank: sorted(self.by_rank),
            by_tp_group: sorted(self.by_group),
            path_s: self.path * 1e-12,
        }
    }
}

/// Where the critical path of one step-model sample went ([`StepModel::attribute_fast`]).
/// Lists are sorted by time, largest first, and hold only non-zero entries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepAttribution {
    /// The sample's step time, seconds.
    pub step_s: f64,
    /// Seconds by op name (kernel name, or e.g. `"tp all_gather"`, `"dp reduce_scatter"`).
    pub by_op: Vec<(String, f64)>,
    /// Seconds by class (kernel class, or `"tp comm"`, `"dp comm"`, `"pp comm"`).
    pub by_class: Vec<(String, f64)>,
    /// The class of every name in `by_op`.
    pub class_of: BTreeMap<String, String>,
    /// Seconds of one GPU's own work (a lane drawn on its own), by rank.
    pub by_rank: Vec<(u32, f64)>,
    /// Seconds charged to a whole tensor-parallel group, by its first rank: its collectives,
    /// and segments drawn at once as the slowest of its lanes (which lane is not drawn).
    pub by_tp_group: Vec<(u32, f64)>,
    /// Length of the path: equals `step_s` (the charges telescope).
    pub path_s: f64,
}

/// How a sample draws kernel times.
enum Draw<'a> {
    /// The engine's per-kernel hash draws.
    Exact(&'a Perturbation),
    /// Per-segment draws with order-statistic shortcuts; replica `r` draws from its own stream
    /// `replica_rng(seed, r)` (the tail from `replica_rng(seed, dp)`).
    Fast {
        group: &'a [(f64, f64)],
        /// Jitter group of each kernel, per stage ([`SegStats::kgroup`]).
        kgroup: &'a [Vec<u32>],
        kernel: &'a [Option<KernelDraw>],
        /// Segments holding a kernel drawn on its own ([`SegStats::pk`]).
        pk: &'a [Vec<bool>],
        table: &'a MaxTable,
        rank_factor: &'a [f64],
        seed: u64,
        rng: Xoshiro256PlusPlus,
    },
    /// Nominal durations.
    Nominal,
}

/// The random stream of replica `r` of a fast sample.
fn replica_rng(seed: u64, r: u64) -> Xoshiro256PlusPlus {
    use rand::SeedableRng;
    Xoshiro256PlusPlus::seed_from_u64(seed ^ r.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Takes `n` standard normal draws from the fast sampler's generator (the per-replica stream of
/// sample `seed`) and returns their sum, so that `prism bench` can time one draw.
pub fn normal_draws(n: u64, seed: u64) -> f64 {
    let mut rng = replica_rng(seed, 0);
    (0..n)
        .map(|_| -> f64 { StandardNormal.sample(&mut rng) })
        .sum()
}

/// Unsupported job for the fast path.
fn unsupported(why: impl Into<String>) -> SimError {
    SimError::InvalidOption(format!("max-plus step model: {}", why.into()))
}

impl StepModel {
    /// Compiles the step model of a validated job. `opts` supplies the cost parameters
    /// (compute, comm, kernel table); its mode and perturbation are ignored.
    pub fn new(job: &Job, opts: &SimOptions) -> Result<StepModel, SimError> {
        if job.model.moe.is_some() {
            return Err(unsupported("mixture-of-experts models are not supported"));
        }
        let graph = ExecutionGraph::build(job);
        let layout = graph.layout;
        let reps: Vec<u32> = (0..layout.pp).map(|s| s * layout.stage_size()).collect();
        let run = crate::engine::simulate(
            job,
            &SimOptions {
                mode: Mode::Reduced,
                record_ranks: reps.clone(),
                perturbation: None,
                ..opts.clone()
            },
        )?;
        let mut stages = Vec::with_capacity(layout.pp as usize);
        for (s, prog) in graph.programs.iter().enumerate() {
            let rec = run
                .timelines
                .iter()
                .find(|t| t.rank == reps[s])
                .expect("recorded representative");
            let mut dur = vec![0 as SimTime; prog.len()];
            for r in &rec.ops {
                dur[r.op as usize] = r.end - r.start;
            }
            stages.push(compile_stage(&graph, s as u32, &dur, &layout)?);
        }
        let mut model = StepModel {
            layout,
            stages,
            graph,
            nominal_s: run.summary.iteration_time_s,
            nominal_tape: Tape::default(),
        };
        model.nominal_tape = model.compile_tape(&|_, _| false, None, true)?;
        Ok(model)
    }

    /// Iteration time of the deterministic engine run the model was compiled from, seconds.
    pub fn nominal_s(&self) -> f64 {
        self.nominal_s
    }

    /// Iteration time with nominal durations (equals [`StepModel::nominal_s`]: a self-check).
    pub fn evaluate_nominal(&self) -> Result<f64, SimError> {
        Ok(self.evaluate(&self.nominal_tape, &mut Draw::Nominal, 1.0))
    }

    /// One sample with the engine's own per-kernel draws (`p.seed`, ranks, ops): equal to the
    /// engine's perturbed full run when communication does not depend on timing.
    pub fn sample_exact(&self, p: &Perturbation) -> Result<f64, SimError> {
        check_comm_factor(p.comm_factor)?;
        let tape = self.compile_tape(&|_, _| true, None, false)?;
        Ok(self.evaluate(&tape, &mut Draw::Exact(p), p.comm_factor))
    }

    /// The fast sampler's statistics for this perturbation's kernel jitter (and, when
    /// `p.rank_factor` is set, per-GPU speeds); an error when [`StepModel::sample_fast`] cannot
    /// draw it.
    pub fn fast_stats(&self, p: &Perturbation) -> Result<FastStats, SimError> {
        // Kernels alike in jitter (same class, same op-name entries) share a group.
        let mut keys: BTreeMap<(OpClass, Vec<usize>), u32> = BTreeMap::new();
        let mut group_key: Vec<(OpClass, Vec<usize>)> = Vec::new();
        let mut kgroup = Vec::with_capacity(self.stages.len());
        for st in &self.stages {
            let mut g = Vec::with_capacity(st.kd.len());
            for (&class, &name) in st.kclass.iter().zip(&st.kname) {
                let ops: Vec<usize> = (p.op_jitter.iter().enumerate())
                    .filter(|(_, (n, _))| n == name)
                    .map(|(i, _)| i)
                    .collect();
                let key = (class, ops);
                let next = group_key.len() as u32;
                let id = *keys.entry(key.clone()).or_insert_with(|| {
                    group_key.push(key);
                    next
                });
                g.push(id);
            }
            kgroup.push(g);
        }
        let mut group_factor = Vec::with_capacity(group_key.len());
        let mut kernel = Vec::with_capacity(group_key.len());
        for (class, ops) in &group_key {
            let mut k = 1.0;
            let mut dists: Vec<Dist> = Vec::new();
            let class_entries = (p.jitter.iter())
                .filter(|(c, _)| c.is_none_or(|c| c == *class))
                .map(|(_, d)| (class.name(), d));
            let op_entries = ops
                .iter()
                .map(|&i| (p.op_jitter[i].0.as_str(), &p.op_jitter[i].1));
            for (what, d) in class_entries.chain(op_entries) {
                d.validate()
                    .map_err(|e| unsupported(format!("kernel jitter of {what}: {e}")))?;
                match d {
                    Dist::Constant(v) => k *= v,
                    other => dists.push(other.clone()),
                }
            }
            match dists.as_slice() {
                [] => {
                    group_factor.push((k, 0.0));
                    kernel.push(None);
                }
                // One normal (far from its floor): a segment's time is a normal sum.
                [Dist::Normal { mean, std }] if *mean > 0.0 && *std <= 0.15 * mean => {
                    group_factor.push((k * mean, k * std));
                    kernel.push(None);
                }
                _ => {
                    let kd = KernelDraw { k, dists };
                    group_factor.push((kd.mean(), 0.0));
                    kernel.push(Some(kd));
                }
            }
        }
        let mut mean = Vec::new();
        let mut sd = Vec::new();
        let mut pk = Vec::new();
        for (st, kg) in self.stages.iter().zip(&kgroup) {
            let mut m = vec![0.0; st.kind.len()];
            let mut v = vec![0.0; st.kind.len()];
            let mut per_kernel = vec![false; st.kind.len()];
            for (i, k) in st.kind.iter().enumerate() {
                if let MKind::Seg { k0, k1, .. } = *k {
                    let mut var = 0.0;
                    for j in k0..k1 {
                        let c = kg[j as usize] as usize;
                        let (mu, sigma) = group_factor[c];
                        let d = st.kd[j as usize] as f64;
                        m[i] += d * mu;
                        var += (d * sigma) * (d * sigma);
                        per_kernel[i] |= kernel[c].is_some();
                    }
                    v[i] = var.sqrt();
                }
            }
            mean.push(m);
            sd.push(v);
            pk.push(per_kernel);
        }
        let speeds = !p.rank_factor.is_empty();
        let stats = SegStats {
            mean,
            sd,
            group: group_factor,
            kernel,
            pk,
            kgroup,
        };
        let tape = self.compile_tape(
            &|s, op| speeds || stats.sd[s][op as usize] > 0.0 || stats.pk[s][op as usize],
            Some(&stats),
            true,
        )?;
        let prune = if speeds {
            self.prune_weights(&tape, &stats)
        } else {
            None
        };
        Ok(FastStats {
            stats,
            table: MaxTable::new(self.layout.tp),
            tape,
            speeds,
            prune,
        })
    }

    /// One sample drawn per segment with the exact order-statistic shortcuts. `rank_factor`
    /// holds persistent per-GPU time factors (empty = 1; non-empty only if the statistics were
    /// made with per-GPU speeds), `comm_factor` the communication regime, `seed` the sample's
    /// random stream.
    pub fn sample_fast(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<f64, SimError> {
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        Ok(self.evaluate(&fast.tape, &mut draw, comm_factor))
    }

    /// The fast sampler's draw for one sample, after checking its arguments.
    fn fast_draw<'a>(
        &self,
        fast: &'a FastStats,
        rank_factor: &'a [f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<Draw<'a>, SimError> {
        check_comm_factor(comm_factor)?;
        if !rank_factor.is_empty()
            && (rank_factor.len() != self.layout.num_ranks() as usize || !fast.speeds)
        {
            return Err(unsupported(
                "rank_factor must have one entry per rank, and the fast statistics must have \
                 been made with per-GPU speeds",
            ));
        }
        Ok(Draw::Fast {
            group: &fast.stats.group,
            kgroup: &fast.stats.kgroup,
            kernel: &fast.stats.kernel,
            pk: &fast.stats.pk,
            table: &fast.table,
            rank_factor,
            seed,
            rng: replica_rng(seed, 0),
        })
    }

    /// The weights replica pruning needs, from two longest-path evaluations of `tape` with
    /// every communication duration 0: segments weighted by their variance (the Lipschitz
    /// constants), then by their mean (which values no segment reaches). `None` when a value
    /// could escape the bounds: a jitter that is not normal (no Gaussian concentration), or an
    /// op outside the tail that nothing waits for (a sink, read without the tail store). Made
    /// only with per-GPU speeds: without them the replicas are alike and none can be skipped.
    fn prune_weights(&self, tape: &Tape, stats: &SegStats) -> Option<PruneWeights> {
        if stats.kernel.iter().any(Option::is_some) || !tape.sinks.is_empty() {
            return None;
        }
        let l = lanes(&self.layout);
        let weigh = |w: &dyn Fn(f64, f64) -> f64| -> Vec<Vec<f64>> {
            let mut t = tape.clone();
            for ins in &mut t.ins {
                ins.code = match ins.code {
                    Code::Seg {
                        m, sd, collapsible, ..
                    } => Code::Seg {
                        m: w(m, sd),
                        sd: 0.0,
                        collapsible,
                        g0: 0,
                        g1: 0,
                        pk: false,
                    },
                    Code::Tp { .. } => Code::Tp { d: 0 },
                    Code::Cp { .. } => Code::Cp { d: 0 },
                    Code::Add { .. } => Code::Add { d: 0 },
                    run @ Code::Run { .. } => run,
                };
            }
            for step in &mut t.steps {
                step.kind = match step.kind {
                    StepKind::Comm { .. } => StepKind::Comm { d: 0 },
                    StepKind::Seg { m, sd } => StepKind::Seg {
                        m: w(m, sd),
                        sd: 0.0,
                    },
                };
            }
            // Replica 0's boundary values: the first `slots x lanes` of each stage's store.
            let mut work = Work::new(self, &t);
            let mut draw = Draw::Nominal;
            let scale = Scale::new(1.0, &draw);
            let mut store = self.new_store();
            let mut last = Latest::default();
            self.replica_to_store(&t, 0, &mut draw, scale, &mut work, &mut store, &mut last);
            store
        };
        let var = weigh(&|_, sd| sd * sd);
        let mean = weigh(&|m, sd| m + sd);
        let mut w = PruneWeights {
            varying: Vec::new(),
            lip: Vec::new(),
            shared: Vec::new(),
        };
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.boundary_ops {
                for lane in 0..l {
                    let j = st.slot[op as usize] as usize * l + lane;
                    let at = (s as u32, j as u32);
                    if mean[s][j] == 0.0 {
                        w.shared.push(at);
                    } else {
                        w.varying.push(at);
                        w.lip.push(var[s][j].sqrt());
                    }
                }
            }
        }
        Some(w)
    }

    /// A fast sample (exactly [`StepModel::sample_fast`]) that also returns every replica's
    /// boundary values: a pilot for [`Pruner::new`].
    pub fn sample_pilot(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<(f64, Pilot), SimError> {
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let mut trace = Trace::default();
        let step = self.evaluate_traced(&fast.tape, &mut draw, comm_factor, Some(&mut trace));
        Ok((
            step,
            Pilot {
                comm_factor,
                store: trace.store,
            },
        ))
    }

    /// [`StepModel::sample_fast`] evaluating only the replicas that can matter, with the same
    /// draws and, but for an event of probability below 1e-17 per replica and boundary value,
    /// the same result to the bit. Returns the step time and how many replicas were evaluated.
    ///
    /// The pruner's pilots bound every replica's boundary values from above (see [`Pruner`]).
    /// The replicas with the highest bound of some value are evaluated first, then every
    /// replica whose bound exceeds the largest evaluated value at some boundary value, until
    /// none does. The skipped replicas' boundary values are then certified irrelevant: the
    /// tail (monotone in them, with its own draws) is evaluated twice, with each skipped value
    /// at its upper bound and at 0; equal ends mean the true values, in between, give that end
    /// too. If the ends differ, the skipped replicas are evaluated after all. Without per-GPU
    /// speeds, or with a regime outside the pilots', every replica is evaluated.
    pub fn sample_pruned(
        &self,
        fast: &FastStats,
        pruner: &Pruner,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<(f64, usize), SimError> {
        let dp = self.layout.dp as usize;
        let w = match &fast.prune {
            Some(w)
                if (pruner.c0..=pruner.c1).contains(&comm_factor)
                    && pruner.base.len() == dp * w.varying.len()
                    && !rank_factor.is_empty() =>
            {
                w
            }
            _ => {
                let t = self.sample_fast(fast, rank_factor, comm_factor, seed)?;
                return Ok((t, dp));
            }
        };
        let l = lanes(&self.layout);
        let n = w.varying.len();
        let tape = &fast.tape;
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let scale = Scale::new(comm_factor, &draw);
        let lam = if pruner.c1 > pruner.c0 {
            (comm_factor - pruner.c0) / (pruner.c1 - pruner.c0)
        } else {
            0.0
        };
        let stride: Vec<usize> = self.stages.iter().map(|st| st.slots as usize * l).collect();
        // Upper bounds of replica r's varying values.
        let hi = |r: usize| {
            let (b, sl) = (
                &pruner.base[r * n..(r + 1) * n],
                &pruner.slope[r * n..(r + 1) * n],
            );
            b.iter().zip(sl).map(move |(&b, &s)| b + lam * s)
        };
        let at = |r: usize, (s, j): (u32, u32)| (s as usize, r * stride[s as usize] + j as usize);
        let mut work = Work::new(self, tape);
        let mut store = self.new_store();
        let mut last = Latest::default();
        let mut done = vec![false; dp];
        // First the replicas with the highest bound of some value.
        let mut best = vec![(f64::NEG_INFINITY, 0); n];
        for r in 0..dp {
            for (b, h) in best.iter_mut().zip(hi(r)) {
                if h > b.0 {
                    *b = (h, r);
                }
            }
        }
        let mut want = vec![false; dp];
        for &(_, r) in &best {
            want[r] = true;
        }
        // Then every replica whose bound exceeds the largest evaluated value somewhere.
        let mut top = vec![f64::NEG_INFINITY; n];
        loop {
            let mut any = false;
            for r in 0..dp {
                if want[r] && !done[r] {
                    self.replica_to_store(
                        tape, r, &mut draw, scale, &mut work, &mut store, &mut last,
                    );
                    done[r] = true;
                    any = true;
                    for (t, &v) in top.iter_mut().zip(&w.varying) {
                        let (s, i) = at(r, v);
                        *t = mx(*t, store[s][i]);
                    }
                }
            }
            if !any {
                break;
            }
            for r in 0..dp {
                want[r] = !done[r] && hi(r).zip(&top).any(|(h, &t)| h > t);
            }
        }
        let evaluated = done.iter().filter(|&&d| d).count();
        if evaluated < dp {
            // The skipped replicas' values: shared ones as on an evaluated replica, varying ones
            // at their upper bound, then at 0; equal tails certify the end.
            let r0 = done.iter().position(|&d| d).expect("one replica evaluated");
            for r in (0..dp).filter(|&r| !done[r]) {
                for &v in &w.shared {
                    let ((s, i), (_, i0)) = (at(r, v), at(r0, v));
                    store[s][i] = store[s][i0];
                }
                for (h, &v) in hi(r).zip(&w.varying) {
                    let (s, i) = at(r, v);
                    store[s][i] = h;
                }
            }
            let (mut a, mut b) = (last, last);
            self.tail(&mut store, &mut draw, scale, &mut a);
            for r in (0..dp).filter(|&r| !done[r]) {
                for &v in &w.varying {
                    let (s, i) = at(r, v);
                    store[s][i] = 0.0;
                }
            }
            self.tail(&mut store, &mut draw, scale, &mut b);
            if a.t == b.t {
                return Ok((a.t * 1e-12, evaluated));
            }
            for r in (0..dp).filter(|&r| !done[r]) {
                self.replica_to_store(tape, r, &mut draw, scale, &mut work, &mut store, &mut last);
            }
        }
        self.tail(&mut store, &mut draw, scale, &mut last);
        Ok((last.t * 1e-12, dp))
    }

    /// The number of random draws one [`StepModel::sample_fast`] takes with these statistics
    /// (with per-GPU speeds when they were made with them), counted on the compiled program. A
    /// segment whose all-gather gate may still be running when it starts is counted at its
    /// most: one draw per lane per piece between gates.
    pub fn draws_per_sample(&self, fast: &FastStats) -> DrawCount {
        let l = lanes(&self.layout) as u64;
        let dp = self.layout.dp as u64;
        let tape = &fast.tape;
        let mut n = DrawCount::default();
        for ins in &tape.ins {
            match ins.code {
                Code::Seg {
                    sd,
                    collapsible,
                    g0,
                    g1,
                    pk,
                    ..
                } => {
                    if g1 > g0 || pk {
                        n.lane += l * self.lane_draws(&fast.stats, ins.stage as usize, ins.op);
                    } else if sd > 0.0 && (ins.out.lanes || collapsible) {
                        if !fast.speeds && !ins.lanes_in && collapsible {
                            n.group += 1;
                        } else {
                            n.lane += l;
                        }
                    }
                }
                Code::Run { s0, s1 } => {
                    for step in &tape.steps[s0 as usize..s1 as usize] {
                        if let StepKind::Seg { sd, .. } = step.kind
                            && sd > 0.0
                        {
                            if fast.speeds {
                                n.lane += l;
                            } else {
                                n.group += 1;
                            }
                        }
                    }
                }
                Code::Add { .. } | Code::Tp { .. } | Code::Cp { .. } => {}
            }
        }
        n.lane *= dp;
        n.group *= dp;
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.tail_ops {
                if matches!(st.kind[op as usize], MKind::Seg { .. }) {
                    n.lane += dp * l * self.lane_draws(&fast.stats, s, op);
                }
            }
        }
        n
    }

    /// Draws of [`StepModel::seg_lane`] for segment `op` of stage `s` with every gate binding:
    /// one per piece between gates with any jitter, or, for a segment holding a kernel without
    /// the normal shortcut, one per jittered kernel.
    fn lane_draws(&self, stats: &SegStats, s: usize, op: u32) -> u64 {
        let st = &self.stages[s];
        let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
            unreachable!("segment")
        };
        let jittered = |k: u32| {
            let c = stats.kgroup[s][k as usize] as usize;
            stats.kernel[c].is_some() || stats.group[c].1 > 0.0
        };
        if stats.pk[s][op as usize] {
            return (k0..k1).filter(|&k| jittered(k)).count() as u64;
        }
        let mut pieces = 0;
        for_each_piece(st, op, &stats.group, &stats.kgroup[s], |_, _, var| {
            pieces += u64::from(var > 0.0);
        });
        pieces
    }

    /// The critical path of the fast sample `(rank_factor, comm_factor, seed)` (the same draws
    /// as [`StepModel::sample_fast`]): walked backwards from the op that ends last, through the
    /// tail (the latest replica at each data-parallel collective) into that replica's program,
    /// re-evaluated with its own random stream. At each op the input that ended last set its
    /// start (ties: the stream predecessor); the op's end minus that start is charged to it, so
    /// the charges add up to the step time. A segment's charge is split over its kernels by
    /// their mean times.
    pub fn attribute_fast(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<StepAttribution, SimError> {
        let tape = &fast.tape;
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let mut trace = Trace::default();
        let step_s = self.evaluate_traced(tape, &mut draw, comm_factor, Some(&mut trace));
        let l = lanes(&self.layout);
        let (tp, cp) = (self.layout.tp as usize, self.layout.cp as usize);
        let dp = self.layout.dp as usize;
        let rank =
            |r: usize, s: u32, lane: usize| lane_rank(&self.layout, r as u32, s, lane as u32);
        let mut acc = Charges::default();
        // The tail, back to the boundary op of the replica that was latest.
        let mut entry: Option<(usize, Val, usize)> = None;
        let mut loc = trace.last;
        loop {
            match loc {
                Loc::Start => break,
                Loc::Replica { r, val, lane } => {
                    entry = Some((r, val, lane));
                    break;
                }
                Loc::Tail { s, op, r, lane } => {
                    let st = &self.stages[s];
                    let store = &trace.store[s];
                    let end = store[st.tail_at(r, op, lane, l)];
                    let ready = |r: usize, lane: usize| st.tail_ready(store, r, op, lane, l);
                    let kind = st.kind[op as usize];
                    let ((start, pred), r, lane) = match kind {
                        MKind::Dp { .. } => latest(
                            (0..dp)
                                .flat_map(|r| group(tp, cp, false, lane).map(move |k| (r, k)))
                                .map(|(r, k)| (ready(r, k), r, k)),
                        )
                        .expect("replicas"),
                        MKind::Tp { .. } | MKind::Cp { .. } => {
                            let tp_group = matches!(kind, MKind::Tp { .. });
                            latest(group(tp, cp, tp_group, lane).map(|k| (ready(r, k), r, k)))
                                .expect("lanes")
                        }
                        _ => (ready(r, lane), r, lane),
                    };
                    let who = match kind {
                        MKind::Dp { .. } | MKind::Cp { .. } => Who::Nobody,
                        MKind::Tp { .. } => Who::Group(rank(r, s as u32, lane / tp * tp)),
                        _ => Who::Rank(rank(r, s as u32, lane)),
                    };
                    self.charge(&mut acc, &fast.stats, s, op, who, end - start);
                    if pred == u32::MAX {
                        break;
                    }
                    if st.tail[pred as usize] {
                        loc = Loc::Tail {
                            s,
                            op: pred,
                            r,
                            lane,
                        };
                    } else {
                        let val = tape.val[s][pred as usize].expect("boundary op evaluated");
                        entry = Some((r, val, lane));
                        break;
                    }
                }
            }
        }
        // The replica's program, re-evaluated with the same draws.
        if let Some((r, mut val, mut lane)) = entry {
            let mut work = Work::new(self, tape);
            self.replica(tape, r, &mut draw, trace.scale, &mut work);
            let vals = &work.vals;
            let at = |v: Val, lane: usize| vals[v.at as usize + if v.lanes { lane } else { 0 }];
            loop {
                let ins = &tape.orig[tape.producer[val.at as usize] as usize];
                let end = at(val, lane);
                let mut best: Option<(f64, Val, usize)> = None;
                let coll = match ins.code {
                    Code::Tp { .. } => Some(true),
                    Code::Cp { .. } => Some(false),
                    _ => None,
                };
                for &v in &tape.inputs[ins.i0 as usize..ins.i1 as usize] {
                    let latest_of = |it: &mut dyn Iterator<Item = usize>| {
                        it.map(|k| (at(v, k), k))
                            .fold((f64::NEG_INFINITY, 0), |b, c| if c.0 > b.0 { c } else { b })
                    };
                    let (e, ln) = match coll {
                        // One start per group: after the group's latest lane.
                        Some(tp_group) if v.lanes && ins.out.lanes => {
                            latest_of(&mut group(tp, cp, tp_group, lane))
                        }
                        // One end for every lane: it started after the latest lane.
                        _ if v.lanes && !ins.out.lanes => latest_of(&mut (0..l)),
                        _ => (at(v, lane), lane),
                    };
                    if best.is_none_or(|b| e > b.0) {
                        best = Some((e, v, ln));
                    }
                }
                let start = best.map_or(0.0, |b| b.0);
                let who = match coll {
                    Some(true) => Who::Group(rank(r, ins.stage, lane / tp * tp)),
                    Some(false) => Who::Nobody,
                    None if ins.out.lanes => Who::Rank(rank(r, ins.stage, lane)),
                    None => Who::Group(rank(r, ins.stage, 0)),
                };
                self.charge(
                    &mut acc,
                    &fast.stats,
                    ins.stage as usize,
                    ins.op,
                    who,
                    end - start,
                );
                match best {
                    Some((_, v, ln)) => {
                        val = v;
                        lane = ln;
                    }
                    None => break,
                }
            }
        }
        Ok(acc.finish(step_s))
    }

    /// Charges `t` ps of the critical path to macro-op `op` of stage `s` (a segment's kernels
    /// by their mean times) and to `who`.
    fn charge(&self, acc: &mut Charges, stats: &SegStats, s: usize, op: u32, who: Who, t: f64) {
        if t <= 0.0 {
            return;
        }
        let st = &self.stages[s];
        let prog = &self.graph.programs[s];
        match who {
            Who::Rank(r) => *acc.by_rank.entry(r).or_default() += t,
            Who::Group(r) => *acc.by_group.entry(r).or_default() += t,
            Who::Nobody => {}
        }
        acc.path += t;
        let mut add = |orig: u32, x: f64| {
            let (name, class) = crate::attribution::op_label(prog, orig);
            *acc.by_op.entry(name.clone()).or_default() += x;
            *acc.by_class.entry(class.clone()).or_default() += x;
            acc.class_of.entry(name).or_insert(class);
        };
        if let MKind::Seg { k0, k1, .. } = st.kind[op as usize] {
            let w = |k: u32| {
                st.kd[k as usize] as f64 * stats.group[stats.kgroup[s][k as usize] as usize].0
            };
            let total: f64 = (k0..k1).map(w).sum();
            for k in k0..k1 {
                let share = if total > 0.0 {
                    w(k) / total
                } else {
                    1.0 / (k1 - k0) as f64
                };
                add(st.kop[k as usize], t * share);
            }
        } else {
            add(st.orig_op[op as usize], t);
        }
    }

    /// Finds the dataflow order of one replica by a static sweep of its stages and compiles it
    /// into a [`Tape`]. `vary(stage, op)`: whether segment `op` may end at different times on
    /// different lanes that started together.
    fn compile_tape(
        &self,
        vary: &dyn Fn(usize, u32) -> bool,
        stats: Option<&SegStats>,
        fuse: bool,
    ) -> Result<Tape, SimError> {
        let l = lanes(&self.layout) as u32;
        let (tp, cp) = (self.layout.tp, self.layout.cp);
        let pp = self.layout.pp as usize;
        let mut pc = vec![[0u32; NUM_STREAMS]; pp];
        let mut mail: Vec<Vec<Option<Val>>> = self
            .stages
            .iter()
            .map(|st| vec![None; st.recv_slots as usize])
            .collect();
        let mut tape = Tape {
            val: self
                .stages
                .iter()
                .map(|st| vec![None; st.kind.len()])
                .collect(),
            ..Tape::default()
        };
        loop {
            let mut moved = false;
            for s in 0..pp {
                let st = &self.stages[s];
                let mut mask: u8 = (1u16 << NUM_STREAMS) as u8 - 1;
                while mask != 0 {
                    let sidx = mask.trailing_zeros() as usize;
                    mask &= mask - 1;
                    while let Some(&op) = st.stream_ops[sidx].get(pc[s][sidx] as usize) {
                        let vals = &tape.val[s];
                        if st.tail[op as usize]
                            || !st.deps_of(op).iter().all(|&d| vals[d as usize].is_some())
                            || !st
                                .gates_of(op)
                                .iter()
                                .all(|&(_, g)| vals[g as usize].is_some())
                        {
                            break;
                        }
                        let mail_in = match st.kind[op as usize] {
                            MKind::Recv { slot } => match mail[s][slot as usize] {
                                Some(v) => Some(v),
                                None => break,
                            },
                            _ => None,
                        };
                        let i0 = tape.inputs.len() as u32;
                        for p in st.preds(op) {
                            tape.inputs.push(vals[p as usize].expect("evaluated input"));
                        }
                        tape.inputs.extend(mail_in);
                        let lanes_in = tape.inputs[i0 as usize..].iter().any(|v| v.lanes);
                        let (code, lanes) = match st.kind[op as usize] {
                            // A group collective is one time per group: per lane unless the
                            // group spans every lane or every input is one time for all.
                            MKind::Tp { d } => (Code::Tp { d }, lanes_in && cp > 1),
                            MKind::Cp { d } => (Code::Cp { d }, lanes_in && tp > 1),
                            MKind::Local { d } | MKind::Send { d, .. } => {
                                (Code::Add { d }, lanes_in)
                            }
                            MKind::Recv { .. } => (Code::Add { d: 0 }, lanes_in),
                            MKind::Seg {
                                k0,
                                k1,
                                collapsible,
                            } => {
                                let g0 = tape.gates.len() as u32;
                                for &(k, g) in st.gates_of(op) {
                                    tape.gates.push((k, vals[g as usize].expect("gate")));
                                }
                                let (m, sd, pk) = match stats {
                                    Some(f) => (
                                        f.mean[s][op as usize],
                                        f.sd[s][op as usize],
                                        f.pk[s][op as usize],
                                    ),
                                    None => (
                                        (k0..k1).map(|k| st.kd[k as usize]).sum::<SimTime>() as f64,
                                        0.0,
                                        false,
                                    ),
                                };
                                let code = Code::Seg {
                                    m,
                                    sd,
                                    pk,
                                    collapsible,
                                    g0,
                                    g1: tape.gates.len() as u32,
                                };
                                (code, !collapsible && (lanes_in || vary(s, op)))
                            }
                            MKind::Dp { .. } => unreachable!("tail ops stop the sweep"),
                        };
                        let out = Val {
                            at: tape.len as u32,
                            lanes,
                        };
                        tape.len += if lanes { l as usize } else { 1 };
                        tape.val[s][op as usize] = Some(out);
                        tape.ins.push(Ins {
                            code,
                            stage: s as u32,
                            op,
                            out,
                            i0,
                            i1: tape.inputs.len() as u32,
                            lanes_in,
                        });
                        if let MKind::Send { delta, slot, .. } = st.kind[op as usize] {
                            let peer = (s as i64 + delta as i64).rem_euclid(pp as i64) as usize;
                            mail[peer][slot as usize] = Some(out);
                        }
                        pc[s][sidx] += 1;
                        mask |= st.wake[op as usize] & !(1 << sidx);
                        moved = true;
                    }
                }
            }
            if !moved {
                break;
            }
        }
        for (s, st) in self.stages.iter().enumerate() {
            // Every stream must have reached its end or the tail.
            for (sidx, (ops, &at)) in st.stream_ops.iter().zip(&pc[s]).enumerate() {
                if let Some(&op) = ops.get(at as usize)
                    && !st.tail[op as usize]
                {
                    return Err(SimError::Deadlock {
                        rank: self.layout.rank(Coord {
                            tp: 0,
                            cp: 0,
                            dp: 0,
                            pp: s as u32,
                        }),
                        stream: crate::graph::STREAMS[sidx].name(),
                        detail: format!("max-plus model stuck at macro-op {op}"),
                    });
                }
            }
            // Sinks: ops that no op waits for (sends feed a receive, gates a segment).
            let mut waited = vec![false; st.kind.len()];
            for op in 0..st.kind.len() as u32 {
                for p in st.preds(op) {
                    waited[p as usize] = true;
                }
                for &(_, g) in st.gates_of(op) {
                    waited[g as usize] = true;
                }
            }
            for (op, kind) in st.kind.iter().enumerate() {
                if !waited[op]
                    && !matches!(kind, MKind::Send { .. })
                    && let Some(v) = tape.val[s][op]
                {
                    tape.sinks.push(v);
                }
            }
        }
        tape.orig = tape.ins.clone();
        tape.producer = vec![u32::MAX; tape.len];
        for (i, ins) in tape.orig.iter().enumerate() {
            tape.producer[ins.out.at as usize] = i as u32;
        }
        if fuse {
            tape.fuse();
        }
        Ok(tape)
    }

    /// Evaluates one iteration: every replica's program, then the tail.
    fn evaluate(&self, tape: &Tape, draw: &mut Draw, comm_factor: f64) -> f64 {
        self.evaluate_traced(tape, draw, comm_factor, None)
    }

    /// [`StepModel::evaluate`], optionally keeping what the critical-path walk needs.
    fn evaluate_traced(
        &self,
        tape: &Tape,
        draw: &mut Draw,
        comm_factor: f64,
        trace: Option<&mut Trace>,
    ) -> f64 {
        let scale = Scale::new(comm_factor, draw);
        let mut work = Work::new(self, tape);
        let mut store = self.new_store();
        let mut last = Latest::default();
        for r in 0..self.layout.dp as usize {
            self.replica_to_store(tape, r, draw, scale, &mut work, &mut store, &mut last);
        }
        self.tail(&mut store, draw, scale, &mut last);
        if let Some(t) = trace {
            t.store = store;
            t.last = last.at;
            t.scale = scale;
        }
        last.t * 1e-12
    }

    /// An empty tail store: per stage, `[replica][slot][lane]`.
    fn new_store(&self) -> Vec<Vec<f64>> {
        let l = lanes(&self.layout);
        let dp = self.layout.dp as usize;
        (self.stages.iter())
            .map(|st| vec![0.0; dp * st.slots as usize * l])
            .collect()
    }

    /// Evaluates replica `r`, notes its sinks in `last` and saves its boundary ops (what the
    /// tail reads) in `store`.
    #[allow(clippy::too_many_arguments)]
    fn replica_to_store(
        &self,
        tape: &Tape,
        r: usize,
        draw: &mut Draw,
        scale: Scale,
        work: &mut Work,
        store: &mut [Vec<f64>],
        last: &mut Latest,
    ) {
        let l = lanes(&self.layout);
        self.replica(tape, r, draw, scale, work);
        let vals = &work.vals;
        for v in &tape.sinks {
            let n = if v.lanes { l } else { 1 };
            for lane in 0..n {
                last.note(
                    vals[v.at as usize + lane],
                    Loc::Replica { r, val: *v, lane },
                );
            }
        }
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.boundary_ops {
                let v = tape.val[s][op as usize].expect("boundary op evaluated");
                let base = (r * st.slots as usize + st.slot[op as usize] as usize) * l;
                for lane in 0..l {
                    store[s][base + lane] = vals[v.at as usize + if v.lanes { lane } else { 0 }];
                }
            }
        }
    }

    /// The tail: the data-parallel collectives and what follows them, all replicas together,
    /// from the boundary ops in `store` (the tail ops' own slots are overwritten). Draws from
    /// the tail's stream `replica_rng(seed, dp)`, restarted here: two tails of one sample take
    /// the same draws.
    fn tail(&self, store: &mut [Vec<f64>], draw: &mut Draw, scale: Scale, last: &mut Latest) {
        let l = lanes(&self.layout);
        let (tp, cp) = (self.layout.tp as usize, self.layout.cp as usize);
        let dp = self.layout.dp as usize;
        if let Draw::Fast { seed, rng, .. } = draw {
            *rng = replica_rng(*seed, dp as u64);
        }
        for (s, st) in self.stages.iter().enumerate() {
            let store = &mut store[s];
            for &op in &st.tail_ops {
                let at = |r: usize, lane: usize| st.tail_at(r, op, lane, l);
                // The predecessors' slots, so that a ready time is a few loads.
                let preds: Vec<usize> =
                    st.preds(op).map(|p| st.slot[p as usize] as usize).collect();
                let slots = st.slots as usize;
                let ready = |store: &[f64], r: usize, lane: usize| {
                    (preds.iter())
                        .map(|&p| store[(r * slots + p) * l + lane])
                        .fold(0.0, mx)
                };
                let mut note = |e: f64, r: usize, lane: usize| {
                    last.note(e, Loc::Tail { s, op, r, lane });
                };
                match st.kind[op as usize] {
                    MKind::Dp { d } => {
                        // The group: every replica's lanes of the same TP rank (CP folded in).
                        for head in group_heads(tp, cp, false) {
                            let start = (0..dp)
                                .flat_map(|r| group(tp, cp, false, head).map(move |k| (r, k)))
                                .map(|(r, k)| ready(store, r, k))
                                .fold(0.0, f64::max);
                            for r in 0..dp {
                                for k in group(tp, cp, false, head) {
                                    store[at(r, k)] = start + scale.of(d);
                                }
                            }
                            note(start + scale.of(d), 0, head);
                        }
                    }
                    MKind::Tp { d } | MKind::Cp { d } => {
                        let tp_group = matches!(st.kind[op as usize], MKind::Tp { .. });
                        for r in 0..dp {
                            for head in group_heads(tp, cp, tp_group) {
                                let start = group(tp, cp, tp_group, head)
                                    .map(|k| ready(store, r, k))
                                    .fold(0.0, f64::max);
                                for k in group(tp, cp, tp_group, head) {
                                    store[at(r, k)] = start + scale.of(d);
                                }
                                note(start + scale.of(d), r, head);
                            }
                        }
                    }
                    MKind::Local { d } => {
                        for r in 0..dp {
                            for lane in 0..l {
                                let e = ready(store, r, lane) + scale.of(d);
                                store[at(r, lane)] = e;
                                note(e, r, lane);
                            }
                        }
                    }
                    MKind::Seg { .. } => {
                        for r in 0..dp {
                            for lane in 0..l {
                                let t0 = ready(store, r, lane);
                                let e = self.seg_lane(
                                    st,
                                    s as u32,
                                    r as u32,
                                    lane as u32,
                                    op,
                                    t0,
                                    &[],
                                    draw,
                                );
                                store[at(r, lane)] = e;
                                note(e, r, lane);
                            }
                        }
                    }
                    MKind::Send { .. } | MKind::Recv { .. } => {
                        unreachable!("pipeline messages in the tail are rejected at compile time")
                    }
                }
            }
        }
    }

    /// Evaluates replica `r`'s program into `work.vals`, drawing from the replica's own stream.
    fn replica(&self, tape: &Tape, r: usize, draw: &mut Draw, scale: Scale, work: &mut Work) {
        // The common lane counts as compile-time constants (unrolled lane loops).
        match lanes(&self.layout) {
            1 => self.run_replica::<1>(tape, r, draw, scale, work),
            2 => self.run_replica::<2>(tape, r, draw, scale, work),
            4 => self.run_replica::<4>(tape, r, draw, scale, work),
            8 => self.run_replica::<8>(tape, r, draw, scale, work),
            _ => self.run_replica::<0>(tape, r, draw, scale, work),
        }
    }

    /// [`StepModel::replica`] with `L` lanes (`L = 0`: the layout's count, not a constant).
    fn run_replica<const L: usize>(
        &self,
        tape: &Tape,
        r: usize,
        draw: &mut Draw,
        scale: Scale,
        work: &mut Work,
    ) {
        let l = if L == 0 { lanes(&self.layout) } else { L };
        debug_assert_eq!(l, lanes(&self.layout));
        let tp = self.layout.tp as usize;
        let Work {
            vals,
            ready,
            lane_fs,
            fmax,
        } = work;
        let ready = &mut ready[..l];
        if let Draw::Fast {
            rank_factor,
            seed,
            rng,
            ..
        } = draw
        {
            *rng = replica_rng(*seed, r as u64);
            if !rank_factor.is_empty() {
                for (i, f) in lane_fs.iter_mut().enumerate() {
                    *f = lane_factor(
                        &self.layout,
                        rank_factor,
                        r as u32,
                        (i / l) as u32,
                        (i % l) as u32,
                    );
                }
                for (s, f) in fmax.iter_mut().enumerate() {
                    *f = lane_fs[s * l..(s + 1) * l].iter().copied().fold(0.0, mx);
                }
            }
        }
        for ins in &tape.ins {
            let inputs = &tape.inputs[ins.i0 as usize..ins.i1 as usize];
            let mut t = 0.0f64;
            if ins.lanes_in {
                ready.fill(0.0);
                for v in inputs {
                    let a = v.at as usize;
                    if v.lanes {
                        for (x, &y) in ready.iter_mut().zip(&vals[a..a + l]) {
                            *x = mx(*x, y);
                        }
                    } else {
                        let y = vals[a];
                        ready.iter_mut().for_each(|x| *x = mx(*x, y));
                    }
                }
            } else {
                for v in inputs {
                    t = mx(t, vals[v.at as usize]);
                }
            }
            let out = ins.out.at as usize;
            match ins.code {
                Code::Tp { d } | Code::Cp { d } => {
                    let d = scale.of(d);
                    if ins.out.lanes {
                        // One start per group: the latest of its lanes.
                        let tp_group = matches!(ins.code, Code::Tp { .. });
                        let cp = l / tp;
                        for head in group_heads(tp, cp, tp_group) {
                            let start = group(tp, cp, tp_group, head)
                                .map(|k| ready[k])
                                .fold(0.0, mx);
                            for k in group(tp, cp, tp_group, head) {
                                vals[out + k] = start + d;
                            }
                        }
                    } else {
                        if ins.lanes_in {
                            t = ready.iter().copied().fold(0.0, mx);
                        }
                        vals[out] = t + d;
                    }
                }
                Code::Add { d } => {
                    let d = scale.of(d);
                    if ins.lanes_in {
                        for (x, &y) in vals[out..out + l].iter_mut().zip(ready.iter()) {
                            *x = y + d;
                        }
                    } else {
                        vals[out] = t + d;
                    }
                }
                Code::Run { s0, s1 } => {
                    let lane_f = &lane_fs[ins.stage as usize * l..(ins.stage as usize + 1) * l];
                    let fmax = fmax[ins.stage as usize];
                    for step in &tape.steps[s0 as usize..s1 as usize] {
                        t += match step.kind {
                            StepKind::Comm { d } => scale.of(d),
                            StepKind::Seg { m, sd } => match draw {
                                Draw::Fast {
                                    table,
                                    rank_factor,
                                    rng,
                                    ..
                                } => {
                                    if sd == 0.0 {
                                        fmax * m
                                    } else if rank_factor.is_empty() {
                                        // Only the slowest of the i.i.d. lanes is observable:
                                        // draw the maximum.
                                        let u: f64 = rng.random();
                                        mx(m + sd * table.quantile(u), 0.0)
                                    } else {
                                        let mut d = 0.0f64;
                                        for &f in lane_f {
                                            let z: f64 = StandardNormal.sample(rng);
                                            d = mx(d, f * (m + sd * z));
                                        }
                                        d
                                    }
                                }
                                _ => m,
                            },
                        };
                        vals[step.out as usize] = t;
                    }
                }
                Code::Seg { .. } => {
                    let lane_f = &lane_fs[ins.stage as usize * l..(ins.stage as usize + 1) * l];
                    self.eval_seg::<L>(tape, ins, r as u32, t, ready, lane_f, vals, draw);
                }
            }
        }
    }

    /// Evaluates segment instruction `ins` of replica `r`: the input is `t` (one time for every
    /// lane) or `ready` (per lane, when `ins.lanes_in`); writes the end into `vals`.
    #[allow(clippy::too_many_arguments)]
    fn eval_seg<const L: usize>(
        &self,
        tape: &Tape,
        ins: &Ins,
        r: u32,
        t: f64,
        ready: &mut [f64],
        lane_f: &[f64],
        vals: &mut [f64],
        draw: &mut Draw,
    ) {
        let Code::Seg {
            m,
            sd,
            collapsible,
            g0,
            g1,
            pk,
        } = ins.code
        else {
            unreachable!("segment")
        };
        let l = if L == 0 { ready.len() } else { L };
        let ready = &mut ready[..l];
        let out = ins.out;
        let at = out.at as usize;
        if !ins.lanes_in {
            ready.fill(t);
        }
        // A gate that ends before the segment starts changes nothing.
        let gates = &tape.gates[g0 as usize..g1 as usize];
        let gated = !gates.is_empty() && {
            let rmin = ready.iter().copied().fold(f64::INFINITY, f64::min);
            gates.iter().any(|&(_, g)| vals[g.at as usize] > rmin)
        };
        let per_kernel = gated || pk || matches!(draw, Draw::Exact(_));
        if !per_kernel {
            match draw {
                Draw::Nominal => {
                    if out.lanes {
                        for (x, &y) in vals[at..at + l].iter_mut().zip(ready.iter()) {
                            *x = y + m;
                        }
                    } else {
                        // Collapsible (the latest lane) or every lane alike.
                        vals[at] = ready.iter().copied().fold(0.0, mx) + m;
                    }
                    return;
                }
                Draw::Fast {
                    table,
                    rank_factor,
                    rng,
                    ..
                } => {
                    if rank_factor.is_empty() && !ins.lanes_in && collapsible {
                        // Only the slowest of the i.i.d. lanes is observable: draw the maximum.
                        let dur = if sd > 0.0 {
                            let u: f64 = rng.random();
                            m + sd * table.quantile(u)
                        } else {
                            m
                        };
                        vals[at] = t + mx(dur, 0.0);
                        return;
                    }
                    if !out.lanes && !collapsible {
                        // Every lane alike and no jitter.
                        vals[at] = t + m;
                        return;
                    }
                    // Lanes in chunks: the draws first, then the arithmetic (a loop without
                    // the sampler's branches; the same draws in the same order).
                    const CHUNK: usize = 16;
                    let mut z = [0.0f64; CHUNK];
                    for (c, xs) in ready.chunks_mut(CHUNK).enumerate() {
                        let z = &mut z[..xs.len()];
                        let fs = (!rank_factor.is_empty())
                            .then(|| &lane_f[c * CHUNK..c * CHUNK + xs.len()]);
                        if sd > 0.0 {
                            for z in z.iter_mut() {
                                *z = StandardNormal.sample(rng);
                            }
                            match fs {
                                Some(fs) => {
                                    for ((x, &z), &f) in xs.iter_mut().zip(z.iter()).zip(fs) {
                                        *x += mx(f * (m + sd * z), 0.0);
                                    }
                                }
                                None => {
                                    for (x, &z) in xs.iter_mut().zip(z.iter()) {
                                        *x += mx(m + sd * z, 0.0);
                                    }
                                }
                            }
                        } else {
                            match fs {
                                Some(fs) => {
                                    for (x, &f) in xs.iter_mut().zip(fs) {
                                        *x += f * m;
                                    }
                                }
                                None => xs.iter_mut().for_each(|x| *x += m),
                            }
                        }
                    }
                    if out.lanes {
                        vals[at..at + l].copy_from_slice(ready);
                    } else {
                        vals[at] = ready.iter().copied().fold(0.0, mx);
                    }
                    return;
                }
                Draw::Exact(_) => unreachable!("per kernel"),
            }
        }
        let gate_end: Vec<f64> = gates.iter().map(|&(_, g)| vals[g.at as usize]).collect();
        let st = &self.stages[ins.stage as usize];
        let mut max_end = 0.0f64;
        for (lane, x) in ready.iter_mut().enumerate() {
            *x = self.seg_lane(st, ins.stage, r, lane as u32, ins.op, *x, &gate_end, draw);
            max_end = mx(max_end, *x);
        }
        if out.lanes {
            vals[at..at + l].copy_from_slice(ready);
        } else {
            // Collapsible, or every lane alike.
            vals[at] = max_end;
        }
    }

    /// End of segment `op` on one lane started at `start`, kernel by kernel: each kernel waits
    /// for its gate (`gate_end`, by position in `st.gates_of(op)`) and takes its own draw. With
    /// the fast sampler and normal jitter the kernels between two gates take one draw, of their
    /// sum (itself normal).
    #[allow(clippy::too_many_arguments)]
    #[inline(never)] // The rare path: kept out of the replica loop's registers.
    fn seg_lane(
        &self,
        st: &StageProg,
        stage: u32,
        replica: u32,
        lane: u32,
        op: u32,
        start: f64,
        gate_end: &[f64],
        draw: &mut Draw,
    ) -> f64 {
        let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
            unreachable!("segment")
        };
        let gates = st.gates_of(op);
        let mut g = 0;
        let mut t = start;
        let rank = lane_rank(&self.layout, replica, stage, lane);
        if let Draw::Fast {
            group,
            kgroup,
            pk,
            rank_factor,
            rng,
            ..
        } = draw
            && !pk[stage as usize][op as usize]
        {
            let f = if rank_factor.is_empty() {
                1.0
            } else {
                rank_factor[rank as usize]
            };
            let mut piece = |m: f64, var: f64| {
                if var > 0.0 {
                    let z: f64 = StandardNormal.sample(rng);
                    mx(f * (m + var.sqrt() * z), 0.0)
                } else {
                    f * m
                }
            };
            for_each_piece(st, op, group, &kgroup[stage as usize], |waits, m, var| {
                for &e in &gate_end[waits] {
                    t = mx(t, e);
                }
                t += piece(m, var);
            });
            return t;
        }
        for k in k0..k1 {
            while g < gates.len() && gates[g].0 == k {
                t = t.max(gate_end[g]);
                g += 1;
            }
            let d = st.kd[k as usize];
            t += match draw {
                Draw::Nominal => d as f64,
                Draw::Exact(p) => {
                    let f = p.kernel_factor(
                        rank,
                        st.kop[k as usize],
                        st.kclass[k as usize],
                        st.kname[k as usize],
                    );
                    (d as f64 * f).round().max(1.0)
                }
                Draw::Fast {
                    group,
                    kgroup,
                    kernel,
                    rank_factor,
                    rng,
                    ..
                } => {
                    let c = kgroup[stage as usize][k as usize] as usize;
                    let jf = match &kernel[c] {
                        Some(kd) => kd.draw(rng),
                        None => {
                            let (mu, sigma) = group[c];
                            if sigma > 0.0 {
                                let z: f64 = StandardNormal.sample(rng);
                                mu + sigma * z
                            } else {
                                mu
                            }
                        }
                    };
                    let f = if rank_factor.is_empty() {
                        1.0
                    } else {
                        rank_factor[rank as usize]
                    };
                    (f * d as f64 * jf).max(0.0)
                }
            };
        }
        t
    }
}

/// Splits segment `op` of `st` at its gates and calls `f(waits, mean, var)` for each piece in
/// order: `waits`, the gates (indices into `st.gates_of(op)`) the piece waits for before it
/// starts (none for the first piece), and the sums over its kernels of the nominal time times
/// the jitter group's factor mean (`group`, by the kernels' groups `kgroup`) and of its squared
/// standard deviation.
fn for_each_piece(
    st: &StageProg,
    op: u32,
    group: &[(f64, f64)],
    kgroup: &[u32],
    mut f: impl FnMut(std::ops::Range<usize>, f64, f64),
) {
    let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
        unreachable!("segment")
    };
    let gates = st.gates_of(op);
    let (mut waits, mut g) = (0..0, 0);
    let (mut m, mut var) = (0.0, 0.0);
    for k in k0..k1 {
        if g < gates.len() && gates[g].0 == k {
            f(waits, m, var);
            (m, var) = (0.0, 0.0);
            let first = g;
            while g < gates.len() && gates[g].0 == k {
                g += 1;
            }
            waits = first..g;
        }
        let (mu, sigma) = group[kgroup[k as usize] as usize];
        let d = st.kd[k as usize] as f64;
        m += d * mu;
        var += (d * sigma) * (d * sigma);
    }
    f(waits, m, var);
}

/// The fast sampler's per-job statistics ([`StepModel::fast_stats`]).
#[derive(Clone, Debug)]
pub struct FastStats {
    stats: SegStats,
    table: MaxTable,
    tape: Tape,
    /// Made with per-GPU speeds (their segments are per lane).
    speeds: bool,
    /// What replica pruning needs ([`StepModel::sample_pruned`]); `None` when it cannot apply.
    prune: Option<PruneWeights>,
}

/// The boundary values of one replica (what the tail reads) as replica pruning sees them.
/// A value is *shared* when no path to it crosses a segment (a chain of collectives only: the
/// same on every replica); the others are *varying*, each with `lip`, its Lipschitz constant
/// in the sample's standard normal draws with every per-GPU factor 1 (ps): the square root of
/// the largest sum of segment variances along a path to it.
#[derive(Clone, Debug)]
struct PruneWeights {
    /// Varying values: (stage, index `slot * lanes + lane` within a replica's part of the
    /// stage's tail store).
    varying: Vec<(u32, u32)>,
    lip: Vec<f64>,
    /// Shared values, the same way.
    shared: Vec<(u32, u32)>,
}

/// Twice the concentration margin of replica pruning, in Lipschitz constants: each bound
/// (the pilot's mean, the sample's deviation from it) holds but for probability
/// `exp(-9^2 / 2) = 2.6e-18`.
const PRUNE_T2: f64 = 18.0;

/// Every replica's boundary values in one fast sample ([`StepModel::sample_pilot`]).
#[derive(Clone, Debug)]
pub struct Pilot {
    comm_factor: f64,
    store: Vec<Vec<f64>>,
}

/// Upper bounds on every replica's boundary values for samples of one cluster (fixed per-GPU
/// speeds) with a communication regime between those of two pilots of the cluster.
///
/// A boundary value `F` is a longest path through segments of normal duration: a convex,
/// non-decreasing function of the communication factor `c` and, in the sample's standard
/// normal draws `z`, Lipschitz with constant `L` (a path's gradient is its segments' standard
/// deviations; `L` is the largest root sum of squares, scaled by the replica's slowest GPU).
/// Gaussian concentration (Tsirelson-Ibragimov-Sudakov) gives `F <= E F + 9 L` and, for each
/// independent pilot, `E F <= F_pilot + 9 L`, but for probability `2.6e-18` each; `E F` is
/// convex in `c`, so at `c` between the pilots' `c0 <= c1` it is below the chord. The bound
/// is the chord of the pilots plus `18 L` (and a rounding allowance of 1e-9 relative).
#[derive(Clone, Debug)]
pub struct Pruner {
    c0: f64,
    c1: f64,
    /// Per replica and varying value (replica-major): the bound at `c0` (margins included) and
    /// its increase to `c1`.
    base: Vec<f64>,
    slope: Vec<f64>,
}

impl Pruner {
    /// The pruner of a cluster from one or two of its pilots (in any order), made with the
    /// cluster's `rank_factor` (empty: every factor 1). `None` when the statistics do not allow
    /// pruning.
    pub fn new(
        model: &StepModel,
        fast: &FastStats,
        rank_factor: &[f64],
        a: Pilot,
        b: Option<Pilot>,
    ) -> Option<Pruner> {
        let w = fast.prune.as_ref()?;
        let b = b.unwrap_or_else(|| a.clone());
        let (lo, hi) = if a.comm_factor <= b.comm_factor {
            (a, b)
        } else {
            (b, a)
        };
        let layout = &model.layout;
        let l = lanes(layout);
        let n = w.varying.len();
        let dp = layout.dp as usize;
        let mut base = Vec::with_capacity(dp * n);
        let mut slope = Vec::with_capacity(dp * n);
        for r in 0..dp {
            // The replica's slowest GPU scales every standard deviation at most by its factor.
            let fmax = (0..layout.pp)
                .flat_map(|s| (0..l as u32).map(move |lane| (s, lane)))
                .map(|(s, lane)| {
                    if rank_factor.is_empty() {
                        1.0
                    } else {
                        lane_factor(layout, rank_factor, r as u32, s, lane)
                    }
                })
                .fold(0.0, f64::max);
            for (&(s, j), &lip) in w.varying.iter().zip(&w.lip) {
                let stride = model.stages[s as usize].slots as usize * l;
                let i = r * stride + j as usize;
                let (p0, p1) = (lo.store[s as usize][i], hi.store[s as usize][i]);
                // Concentration margin, and 1e-9 relative (plus 1 ps) for rounding.
                let margin = PRUNE_T2 * fmax * lip + 1e-9 * p0.abs().max(p1.abs()) + 1.0;
                base.push(p0 + margin);
                slope.push(p1 - p0);
            }
        }
        Some(Pruner {
            c0: lo.comm_factor,
            c1: hi.comm_factor,
            base,
            slope,
        })
    }
}

/// How many draws one fast sample takes ([`StepModel::draws_per_sample`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrawCount {
    /// Draws of one lane's segment (or, for a jitter without the normal shortcut, kernel) time.
    pub lane: u64,
    /// Draws of a whole tensor-parallel group's slowest lane at once (order statistics).
    pub group: u64,
}

fn check_comm_factor(c: f64) -> Result<(), SimError> {
    if c.is_finite() && c > 0.0 {
        Ok(())
    } else {
        Err(SimError::InvalidOption(format!(
            "perturbation.comm_factor must be a positive finite number (got {c})"
        )))
    }
}

fn lane_factor(layout: &Layout, rank_factor: &[f64], replica: u32, stage: u32, lane: u32) -> f64 {
    if rank_factor.is_empty() {
        return 1.0;
    }
    rank_factor[lane_rank(layout, replica, stage, lane) as usize]
}

/// Lanes of one stage of one replica: its `tp x cp` GPUs, lane `c * tp + t` being TP rank `t`
/// of CP rank `c`.
fn lanes(layout: &Layout) -> usize {
    (layout.tp * layout.cp) as usize
}

/// The rank of lane `lane` of stage `stage` of replica `replica`.
fn lane_rank(layout: &Layout, replica: u32, stage: u32, lane: u32) -> u32 {
    layout.rank(Coord {
        tp: lane % layout.tp,
        cp: lane / layout.tp,
        dp: replica,
        pp: stage,
    })
}

/// The lanes of the TP group (`tp_group`) or else the CP group that holds `lane`, among
/// `tp x cp` lanes.
fn group(tp: usize, cp: usize, tp_group: bool, lane: usize) -> impl Iterator<Item = usize> {
    let (t, c) = (lane % tp, lane / tp);
    let n = if tp_group { tp } else { cp };
    (0..n).map(move |i| if tp_group { c * tp + i } else { i * tp + t })
}

/// One lane of each TP group (`tp_group`) or else of each CP group.
fn group_heads(tp: usize, cp: usize, tp_group: bool) -> impl Iterator<Item = usize> {
    let (n, step) = if tp_group { (cp, tp) } else { (tp, 1) };
    (0..n).map(move |i| i * step)
}

/// Compiles stage `s`'s program with the recorded durations `dur` (by original op id).
fn compile_stage(
    graph: &ExecutionGraph,
    s: u32,
    dur: &[SimTime],
    layout: &Layout,
) -> Result<StageProg, SimError> {
    let p = &graph.programs[s as usize];
    let n = p.len();
    // Macro-op of each original op.
    let mut macro_of = vec![u32::MAX; n];
    let mut out = StageProg {
        recv_slots: p.recv_slots,
        dep_off: vec![0],
        ..Default::default()
    };
    let compute = &p.stream_ops[Stream::Compute as usize];
    let mut kernel_index = vec![u32::MAX; n];
    for (i, &op) in compute.iter().enumerate() {
        kernel_index[op as usize] = i as u32;
        let OpKind::Compute(c) = p.kind[op as usize] else {
            return Err(unsupported("a non-kernel op on the compute stream"));
        };
        out.kd.push(dur[op as usize]);
        out.kclass.push(c.class);
        out.kname.push(c.name);
        out.kop.push(op);
    }
    // Head data-parallel collectives of the original program: they wait for nothing but
    // earlier head collectives, so every lane and replica reaches them at the same time.
    let mut head_orig = vec![false; n];
    for o in 0..n {
        if let OpKind::Collective {
            group: GroupKind::Dp,
            ..
        } = p.kind[o]
        {
            let pos = p.pos[o] as usize;
            let pred = (pos > 0).then(|| p.stream_ops[p.stream[o] as usize][pos - 1]);
            head_orig[o] = pred
                .into_iter()
                .chain(p.deps_of(o as u32).iter().copied())
                .all(|q| head_orig[q as usize]);
        }
    }
    let mut pending_deps: Vec<u32> = Vec::new();
    // Gates by segment (original op ids until every op is mapped).
    let mut seg_gates: Vec<Vec<(u32, u32)>> = Vec::new();
    let mut op = 0u32;
    while (op as usize) < n {
        let stream = p.stream[op as usize];
        let mut gates_here: Vec<(u32, u32)> = Vec::new();
        let kind = match p.kind[op as usize] {
            OpKind::Compute(_) => {
                // Extend while nothing outside the compute stream can observe the boundary; a
                // later kernel may wait for a head all-gather (a gate, same on every lane).
                let mut last = op;
                loop {
                    let k = kernel_index[last as usize] as usize;
                    let Some(&next) = compute.get(k + 1) else {
                        break;
                    };
                    if p.has_dependents[last as usize]
                        || !p.deps_of(next).iter().all(|&d| head_orig[d as usize])
                    {
                        break;
                    }
                    for &d in p.deps_of(next) {
                        gates_here.push((kernel_index[next as usize], d));
                    }
                    last = next;
                }
                let k0 = kernel_index[op as usize];
                let k1 = kernel_index[last as usize] + 1;
                MKind::Seg {
                    k0,
                    k1,
                    collapsible: false,
                }
            }
            OpKind::Collective { group, .. } => {
                let d = dur[op as usize];
                let size = layout.group_size(group);
                match group {
                    _ if size == 1 => MKind::Local { d },
                    GroupKind::Tp => MKind::Tp { d },
                    GroupKind::Cp => MKind::Cp { d },
                    // A head collective is reached at the same time on every lane and replica.
                    GroupKind::Dp if head_orig[op as usize] => MKind::Local { d },
                    GroupKind::Dp => MKind::Dp { d },
                    other => {
                        return Err(unsupported(format!(
                            "{other:?} collectives are not supported"
                        )));
                    }
                }
            }
            OpKind::Send { delta, slot, .. } => MKind::Send {
                d: dur[op as usize],
                delta,
                slot,
            },
            OpKind::Recv { slot } => MKind::Recv { slot },
        };
        let id = out.kind.len() as u32;
        out.orig_op.push(op);
        out.kind.push(kind);
        out.stream.push(stream as u8);
        out.pos.push(out.stream_ops[stream as usize].len() as u32);
        out.stream_ops[stream as usize].push(id);
        pending_deps.clear();
        for &d in p.deps_of(op) {
            let m = macro_of[d as usize];
            debug_assert!(m != u32::MAX, "dependency on a later op");
            if !pending_deps.contains(&m) {
                pending_deps.push(m);
            }
        }
        out.deps.extend_from_slice(&pending_deps);
        out.dep_off.push(out.deps.len() as u32);
        seg_gates.push(gates_here);
        // Map every original op of the macro-op (kernels of a segment are consecutive on the
        // compute stream but not in id order).
        if let MKind::Seg { k0, k1, .. } = kind {
            for k in k0..k1 {
                macro_of[compute[k as usize] as usize] = id;
            }
        } else {
            macro_of[op as usize] = id;
        }
        // Next unmapped op.
        op += 1;
        while (op as usize) < n && macro_of[op as usize] != u32::MAX {
            op += 1;
        }
    }
    out.gate_off.push(0);
    for g in &seg_gates {
        for &(k, d) in g {
            out.gates.push((k, macro_of[d as usize]));
        }
        out.gate_off.push(out.gates.len() as u32);
    }
    let m = out.kind.len();
    // The tail: data-parallel collectives that are not head collectives (those became `Local`
    // above), and everything after them.
    let mut tail = vec![false; m];
    for i in 0..m as u32 {
        tail[i as usize] = matches!(out.kind[i as usize], MKind::Dp { .. })
            || out.preds(i).any(|q| tail[q as usize]);
    }
    // Boundary ops (non-tail inputs of tail ops) and the tail store's slots.
    out.slot = vec![u32::MAX; m];
    for i in 0..m as u32 {
        if !tail[i as usize] {
            continue;
        }
        if matches!(
            out.kind[i as usize],
            MKind::Send { .. } | MKind::Recv { .. }
        ) {
            return Err(unsupported(
                "pipeline messages after a data-parallel collective",
            ));
        }
        if !out.gates_of(i).is_empty() {
            return Err(unsupported(
                "a parameter gather gating kernels after the gradient reduction",
            ));
        }
        out.tail_ops.push(i);
        let preds: Vec<u32> = out.preds(i).collect();
        for q in preds {
            if !tail[q as usize] && out.slot[q as usize] == u32::MAX {
                out.slot[q as usize] = out.slots;
                out.slots += 1;
                out.boundary_ops.push(q);
            }
        }
    }
    for &i in &out.tail_ops {
        out.slot[i as usize] = out.slots;
        out.slots += 1;
    }
    // Streams stop at their first tail op: every later op on the stream must be tail too.
    for ops in &out.stream_ops {
        if let Some(first) = ops.iter().position(|&o| tail[o as usize])
            && ops[first..].iter().any(|&o| !tail[o as usize])
        {
            return Err(unsupported(
                "a stream continues after a data-parallel collective",
            ));
        }
    }
    out.tail = tail;
    // Collapsible segments: only a TP collective observes the end, and the next kernel waits
    // for that collective (so every lane's next step starts after the slowest lane).
    let mut dependents: Vec<Vec<u32>> = vec![Vec::new(); m];
    for i in 0..m as u32 {
        for &d in out.deps_of(i) {
            dependents[d as usize].push(i);
        }
    }
    // (With context parallelism a TP collective sees only its group's lanes: none is.)
    let cops = out.stream_ops[Stream::Compute as usize].clone();
    for (k, &i) in cops.iter().enumerate() {
        if layout.cp > 1 {
            break;
        }
        if out.tail[i as usize] || out.slot[i as usize] != u32::MAX {
            continue;
        }
        let deps_i = &dependents[i as usize];
        if deps_i.is_empty()
            || !deps_i
                .iter()
                .all(|&t| matches!(out.kind[t as usize], MKind::Tp { .. }))
        {
            continue;
        }
        let Some(&next) = cops.get(k + 1) else {
            continue;
        };
        let gated = out.deps_of(next).iter().any(|d| deps_i.contains(d));
        if gated && let MKind::Seg { collapsible, .. } = &mut out.kind[i as usize] {
            *collapsible = true;
        }
    }
    out.wake = (0..m)
        .map(|i| {
            let mut w = 1u8 << out.stream[i];
            for &t in &dependents[i] {
                w |= 1 << out.stream[t as usize];
            }
            w
        })
        .collect();
    // A gate's all-gather wakes the compute stream too.
    for &(_, g) in &out.gates {
        out.wake[g as usize] |= 1 << Stream::Compute as u8;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The interpolated quantile table of the maximum of 8 normals against the exact formula.
    #[test]
    fn max_table_matches_the_exact_quantile() {
        let t = MaxTable::new(8);
        let mut worst: f64 = 0.0;
        for i in 1..200_000 {
            let u = i as f64 / 200_000.0;
            worst = worst.max((t.quantile(u) - MaxTable::exact(8, u)).abs());
        }
        assert!(worst < 1e-5, "max error {worst}");
        // Independent check through the CDF: P(max of 8 <= q(u)) = Phi(q(u))^8 = u.
        for u in [0.001, 0.05, 0.5, 0.95, 0.999] {
            let p = crate::stats::std_normal_cdf(t.quantile(u)).powi(8);
            assert!((p - u).abs() < 1e-9 + 1e-6 * u, "u {u}: {p}");
        }
    }
}
