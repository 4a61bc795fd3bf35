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
//!   body). Supported: jitter that is normal (or constant) per op class.
//!
//! Scope: dense models (no expert parallelism) with `cp = 1` and a symmetric placement; other
//! jobs get [`SimError::InvalidOption`] and callers fall back to the per-rank engine.

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
    /// Tensor-parallel collective of frozen duration `d` (starts at the latest lane).
    Tp { d: SimTime },
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
    kop: Vec<u32>,
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
    /// Factor mean and standard deviation per op class, indexed by `class as usize`.
    class: Vec<(f64, f64)>,
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
    nominal_s: f64,
}

/// Per-stage evaluation state of one replica.
#[derive(Clone, Debug, Default)]
struct Inst {
    pc: [u32; NUM_STREAMS],
    /// End of every op, `lanes` values per op (lane 0 only when `uni`).
    ends: Vec<SimTime>,
    uni: Vec<bool>,
    mail: Vec<SimTime>,
    mail_full: Vec<bool>,
}

/// How a sample draws kernel times.
enum Draw<'a> {
    /// The engine's per-kernel hash draws.
    Exact(&'a Perturbation),
    /// Per-segment draws with order-statistic shortcuts.
    Fast {
        stats: &'a SegStats,
        table: &'a MaxTable,
        rank_factor: &'a [f64],
        rng: Xoshiro256PlusPlus,
    },
    /// Nominal durations.
    Nominal,
}

/// Unsupported job for the fast path.
fn unsupported(why: impl Into<String>) -> SimError {
    SimError::InvalidOption(format!("max-plus step model: {}", why.into()))
}

impl StepModel {
    /// Compiles the step model of a validated job. `opts` supplies the cost parameters
    /// (compute, comm, kernel table); its mode and perturbation are ignored.
    pub fn new(job: &Job, opts: &SimOptions) -> Result<StepModel, SimError> {
        let par = &job.parallel;
        if par.cp != 1 {
            return Err(unsupported("context parallelism (cp > 1) is not supported"));
        }
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
        Ok(StepModel {
            layout,
            stages,
            nominal_s: run.summary.iteration_time_s,
        })
    }

    /// Iteration time of the deterministic engine run the model was compiled from, seconds.
    pub fn nominal_s(&self) -> f64 {
        self.nominal_s
    }

    /// Iteration time with nominal durations (equals [`StepModel::nominal_s`]: a self-check).
    pub fn evaluate_nominal(&self) -> Result<f64, SimError> {
        self.evaluate(&mut Draw::Nominal, 1.0)
    }

    /// One sample with the engine's own per-kernel draws (`p.seed`, ranks, ops): equal to the
    /// engine's perturbed full run when communication does not depend on timing.
    pub fn sample_exact(&self, p: &Perturbation) -> Result<f64, SimError> {
        check_comm_factor(p.comm_factor)?;
        self.evaluate(&mut Draw::Exact(p), p.comm_factor)
    }

    /// Whether [`StepModel::sample_fast`] can draw this perturbation's kernel jitter.
    pub fn fast_stats(&self, p: &Perturbation) -> Result<FastStats, SimError> {
        let mut class_factor = Vec::with_capacity(OpClass::ALL.len());
        for class in OpClass::ALL {
            let mut k = 1.0;
            let mut normal: Option<(f64, f64)> = None;
            for (c, d) in &p.jitter {
                if c.is_some_and(|c| c != class) {
                    continue;
                }
                match *d {
                    Dist::Constant(v) => k *= v,
                    Dist::Normal { mean, std } if normal.is_none() => {
                        if !(mean > 0.0 && std >= 0.0 && std <= 0.15 * mean) {
                            return Err(unsupported(format!(
                                "normal jitter of {} needs mean > 0 and std <= 0.15 mean (got \
                                 {mean}, {std})",
                                class.name()
                            )));
                        }
                        normal = Some((mean, std));
                    }
                    _ => {
                        return Err(unsupported(format!(
                            "kernel jitter of {} must be one normal (or constant) distribution",
                            class.name()
                        )));
                    }
                }
            }
            let (m, s) = normal.unwrap_or((1.0, 0.0));
            class_factor.push((k * m, k * s));
        }
        let mut mean = Vec::new();
        let mut sd = Vec::new();
        for st in &self.stages {
            let mut m = vec![0.0; st.kind.len()];
            let mut v = vec![0.0; st.kind.len()];
            for (i, k) in st.kind.iter().enumerate() {
                if let MKind::Seg { k0, k1, .. } = *k {
                    let mut var = 0.0;
                    for j in k0..k1 {
                        let (mu, sigma) = class_factor[st.kclass[j as usize] as usize];
                        let d = st.kd[j as usize] as f64;
                        m[i] += d * mu;
                        var += (d * sigma) * (d * sigma);
                    }
                    v[i] = var.sqrt();
                }
            }
            mean.push(m);
            sd.push(v);
        }
        Ok(FastStats {
            stats: SegStats {
                mean,
                sd,
                class: class_factor,
            },
            table: MaxTable::new(self.layout.tp),
        })
    }

    /// One sample drawn per segment with the exact order-statistic shortcuts. `rank_factor`
    /// holds persistent per-GPU time factors (empty = 1), `comm_factor` the communication
    /// regime, `rng` the sample's generator.
    pub fn sample_fast(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        rng: Xoshiro256PlusPlus,
    ) -> Result<f64, SimError> {
        check_comm_factor(comm_factor)?;
        if !rank_factor.is_empty() && rank_factor.len() != self.layout.num_ranks() as usize {
            return Err(unsupported("rank_factor must have one entry per rank"));
        }
        self.evaluate(
            &mut Draw::Fast {
                stats: &fast.stats,
                table: &fast.table,
                rank_factor,
                rng,
            },
            comm_factor,
        )
    }

    fn evaluate(&self, draw: &mut Draw, comm_factor: f64) -> Result<f64, SimError> {
        let l = self.layout.tp as usize;
        let pp = self.layout.pp as usize;
        let dp = self.layout.dp;
        let scale = |d: SimTime| -> SimTime {
            if comm_factor == 1.0 {
                d
            } else {
                (d as f64 * comm_factor).round() as SimTime
            }
        };
        let mut insts: Vec<Inst> = self
            .stages
            .iter()
            .map(|st| Inst {
                pc: [0; NUM_STREAMS],
                ends: vec![0; st.kind.len() * l],
                uni: vec![false; st.kind.len()],
                mail: vec![0; st.recv_slots as usize * l],
                mail_full: vec![false; st.recv_slots as usize],
            })
            .collect();
        // Tail store per stage: [replica][slot][lane].
        let mut store: Vec<Vec<SimTime>> = self
            .stages
            .iter()
            .map(|st| vec![0; dp as usize * st.slots as usize * l])
            .collect();
        let mut end_max: SimTime = 0;
        let mut ready = vec![0 as SimTime; l];
        // Persistent per-GPU factors of the current replica, `l` per stage.
        let mut lane_fs = vec![1.0f64; pp * l];
        for r in 0..dp {
            if let Draw::Fast { rank_factor, .. } = draw {
                for (i, f) in lane_fs.iter_mut().enumerate() {
                    let (s, lane) = (i / l, i % l);
                    *f = lane_factor(&self.layout, rank_factor, r, s as u32, lane as u32);
                }
            }
            for inst in insts.iter_mut() {
                inst.pc = [0; NUM_STREAMS];
                inst.mail_full.iter_mut().for_each(|x| *x = false);
            }
            // Sweep the stages until none moves.
            loop {
                let mut moved = false;
                for s in 0..pp {
                    let st = &self.stages[s];
                    let lane_f = &lane_fs[s * l..(s + 1) * l];
                    let mut mask: u8 = (1u16 << NUM_STREAMS) as u8 - 1;
                    while mask != 0 {
                        let sidx = mask.trailing_zeros() as usize;
                        mask &= mask - 1;
                        loop {
                            let inst = &insts[s];
                            let pc = inst.pc[sidx] as usize;
                            let Some(&op) = st.stream_ops[sidx].get(pc) else {
                                break;
                            };
                            if st.tail[op as usize] {
                                break;
                            }
                            let done = |d: u32| {
                                inst.pc[st.stream[d as usize] as usize] > st.pos[d as usize]
                            };
                            if !st.deps_of(op).iter().all(|&d| done(d))
                                || !st.gates_of(op).iter().all(|&(_, g)| done(g))
                            {
                                break;
                            }
                            if let MKind::Recv { slot } = st.kind[op as usize]
                                && !inst.mail_full[slot as usize]
                            {
                                break;
                            }
                            // Inputs: stream predecessor and dependencies.
                            let uni_in = gather(st, inst, op, l, &mut ready);
                            let (uni_out, send) = self.eval_op(
                                st, s as u32, r, op, uni_in, &mut ready, lane_f, draw, &scale,
                                &insts[s],
                            );
                            let inst = &mut insts[s];
                            let base = op as usize * l;
                            if uni_out {
                                inst.ends[base] = ready[0];
                                end_max = end_max.max(ready[0]);
                            } else {
                                inst.ends[base..base + l].copy_from_slice(&ready);
                                end_max = end_max.max(*ready.iter().max().expect("lanes"));
                            }
                            inst.uni[op as usize] = uni_out;
                            inst.pc[sidx] += 1;
                            mask |= st.wake[op as usize] & !(1 << sidx);
                            moved = true;
                            if let Some((delta, slot)) = send {
                                let peer = (s as i64 + delta as i64).rem_euclid(pp as i64) as usize;
                                let m = &mut insts[peer];
                                let b = slot as usize * l;
                                if uni_out {
                                    m.mail[b..b + l].iter_mut().for_each(|x| *x = ready[0]);
                                } else {
                                    m.mail[b..b + l].copy_from_slice(&ready);
                                }
                                m.mail_full[slot as usize] = true;
                            }
                        }
                    }
                }
                if !moved {
                    break;
                }
            }
            // Every stream must have reached its end or the tail.
            for (s, st) in self.stages.iter().enumerate() {
                for sidx in 0..NUM_STREAMS {
                    if let Some(&op) = st.stream_ops[sidx].get(insts[s].pc[sidx] as usize)
                        && !st.tail[op as usize]
                    {
                        return Err(SimError::Deadlock {
                            rank: self.layout.rank(Coord {
                                tp: 0,
                                cp: 0,
                                dp: r,
                                pp: s as u32,
                            }),
                            stream: crate::graph::STREAMS[sidx].name(),
                            detail: format!("max-plus model stuck at macro-op {op}"),
                        });
                    }
                }
                // Save the boundary ops for the tail.
                let inst = &insts[s];
                for &op in &st.boundary_ops {
                    let base = (r as usize * st.slots as usize + st.slot[op as usize] as usize) * l;
                    for lane in 0..l {
                        store[s][base + lane] = lane_end(inst, op, lane, l);
                    }
                }
            }
        }
        // Tail: the data-parallel collectives and what follows them, all replicas together.
        for (s, st) in self.stages.iter().enumerate() {
            let slots = st.slots as usize;
            let at = |r: usize, op: u32, lane: usize| {
                (r * slots + st.slot[op as usize] as usize) * l + lane
            };
            let store = &mut store[s];
            for &op in &st.tail_ops {
                let ready_of = |store: &Vec<SimTime>, r: usize, lane: usize| {
                    st.preds(op)
                        .map(|p| store[at(r, p, lane)])
                        .max()
                        .unwrap_or(0)
                };
                match st.kind[op as usize] {
                    MKind::Dp { d } => {
                        for lane in 0..l {
                            let start = (0..dp as usize)
                                .map(|r| ready_of(store, r, lane))
                                .max()
                                .unwrap_or(0);
                            for r in 0..dp as usize {
                                store[at(r, op, lane)] = start + scale(d);
                            }
                            end_max = end_max.max(start + scale(d));
                        }
                    }
                    MKind::Tp { d } => {
                        for r in 0..dp as usize {
                            let start = (0..l)
                                .map(|lane| ready_of(store, r, lane))
                                .max()
                                .unwrap_or(0);
                            for lane in 0..l {
                                store[at(r, op, lane)] = start + scale(d);
                            }
                            end_max = end_max.max(start + scale(d));
                        }
                    }
                    MKind::Local { d } => {
                        for r in 0..dp as usize {
                            for lane in 0..l {
                                let e = ready_of(store, r, lane) + scale(d);
                                store[at(r, op, lane)] = e;
                                end_max = end_max.max(e);
                            }
                        }
                    }
                    MKind::Seg { .. } => {
                        for r in 0..dp as usize {
                            for lane in 0..l {
                                let t0 = ready_of(store, r, lane);
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
                                store[at(r, op, lane)] = e;
                                end_max = end_max.max(e);
                            }
                        }
                    }
                    MKind::Send { .. } | MKind::Recv { .. } => {
                        unreachable!("pipeline messages in the tail are rejected at compile time")
                    }
                }
            }
        }
        Ok(end_max as f64 * 1e-12)
    }

    /// End of segment `op` on one lane started at `start`, kernel by kernel: each kernel waits
    /// for its gate (`gate_end`, by position in `st.gates_of(op)`) and takes its own draw.
    #[allow(clippy::too_many_arguments)]
    fn seg_lane(
        &self,
        st: &StageProg,
        stage: u32,
        replica: u32,
        lane: u32,
        op: u32,
        start: SimTime,
        gate_end: &[SimTime],
        draw: &mut Draw,
    ) -> SimTime {
        let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
            unreachable!("segment")
        };
        let gates = st.gates_of(op);
        let mut g = 0;
        let mut t = start;
        let rank = self.layout.rank(Coord {
            tp: lane,
            cp: 0,
            dp: replica,
            pp: stage,
        });
        for k in k0..k1 {
            while g < gates.len() && gates[g].0 == k {
                t = t.max(gate_end[g]);
                g += 1;
            }
            let d = st.kd[k as usize];
            t += match draw {
                Draw::Nominal => d,
                Draw::Exact(p) => {
                    let f = p.kernel_factor(rank, st.kop[k as usize], st.kclass[k as usize]);
                    (d as f64 * f).round().max(1.0) as SimTime
                }
                Draw::Fast {
                    stats,
                    rank_factor,
                    rng,
                    ..
                } => {
                    let (mu, sigma) = stats.class[st.kclass[k as usize] as usize];
                    let z: f64 = if sigma > 0.0 {
                        StandardNormal.sample(rng)
                    } else {
                        0.0
                    };
                    let f = if rank_factor.is_empty() {
                        1.0
                    } else {
                        rank_factor[rank as usize]
                    };
                    (f * d as f64 * (mu + sigma * z)).round().max(0.0) as SimTime
                }
            };
        }
        t
    }

    /// Evaluates macro-op `op` of `stage` on replica `r` given its ready time(s) in `ready`
    /// (lane 0 only when `uni_in`); leaves the end time(s) in `ready`. Returns whether the end
    /// is the same on every lane, and the (delta, slot) of a send.
    #[allow(clippy::too_many_arguments)]
    fn eval_op(
        &self,
        st: &StageProg,
        stage: u32,
        r: u32,
        op: u32,
        uni_in: bool,
        ready: &mut [SimTime],
        lane_f: &[f64],
        draw: &mut Draw,
        scale: &dyn Fn(SimTime) -> SimTime,
        inst: &Inst,
    ) -> (bool, Option<(i8, u32)>) {
        let l = ready.len();
        match st.kind[op as usize] {
            MKind::Tp { d } => {
                let start = if uni_in {
                    ready[0]
                } else {
                    *ready.iter().max().expect("lanes")
                };
                ready[0] = start + scale(d);
                (true, None)
            }
            MKind::Local { d } => {
                let d = scale(d);
                add_to_lanes(ready, uni_in, d);
                (uni_in, None)
            }
            MKind::Send { d, delta, slot } => {
                let d = scale(d);
                add_to_lanes(ready, uni_in, d);
                (uni_in, Some((delta, slot)))
            }
            MKind::Recv { slot } => {
                let b = slot as usize * l;
                let arr = &inst.mail[b..b + l];
                if uni_in {
                    let t0 = ready[0];
                    for (t, &a) in ready.iter_mut().zip(arr) {
                        *t = t0.max(a);
                    }
                } else {
                    for (t, &a) in ready.iter_mut().zip(arr) {
                        *t = (*t).max(a);
                    }
                }
                (ready.iter().all(|&t| t == ready[0]), None)
            }
            MKind::Dp { .. } => unreachable!("tail ops are evaluated after the replicas"),
            MKind::Seg { collapsible, .. } => {
                let gate_end: Vec<SimTime> = st
                    .gates_of(op)
                    .iter()
                    .map(|&(_, g)| inst.ends[g as usize * l])
                    .collect();
                let rmin = if uni_in {
                    ready[0]
                } else {
                    *ready.iter().min().expect("lanes")
                };
                // A gate that ends before the segment starts changes nothing.
                let gated = gate_end.iter().any(|&g| g > rmin);
                if !gated
                    && let Draw::Fast {
                        stats, table, rng, ..
                    } = draw
                {
                    let m = stats.mean[stage as usize][op as usize];
                    let sd = stats.sd[stage as usize][op as usize];
                    let same = lane_f.iter().all(|&f| f == lane_f[0]);
                    if uni_in && collapsible && (sd == 0.0 || same) {
                        // Only the slowest lane is observable: draw the maximum directly.
                        let dur = if sd == 0.0 {
                            let fmax = lane_f.iter().copied().fold(0.0, f64::max);
                            fmax * m
                        } else {
                            let u: f64 = rng.random();
                            lane_f[0] * (m + sd * table.quantile(u))
                        };
                        ready[0] += dur.round().max(0.0) as SimTime;
                        return (true, None);
                    }
                    if uni_in && sd == 0.0 && same {
                        ready[0] += (lane_f[0] * m).round().max(0.0) as SimTime;
                        return (true, None);
                    }
                    let t0 = ready[0];
                    let mut max_end = 0;
                    for (lane, t) in ready.iter_mut().enumerate() {
                        let z: f64 = if sd > 0.0 {
                            StandardNormal.sample(rng)
                        } else {
                            0.0
                        };
                        let start = if uni_in { t0 } else { *t };
                        *t = start + (lane_f[lane] * (m + sd * z)).round().max(0.0) as SimTime;
                        max_end = max_end.max(*t);
                    }
                    if collapsible {
                        ready[0] = max_end;
                        return (true, None);
                    }
                    return (false, None);
                }
                if !gated && let Draw::Nominal = draw {
                    let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
                        unreachable!("segment")
                    };
                    let d: SimTime = (k0..k1).map(|k| st.kd[k as usize]).sum();
                    add_to_lanes(ready, uni_in, d);
                    return (uni_in, None);
                }
                let t0 = ready[0];
                let mut max_end = 0;
                for (lane, t) in ready.iter_mut().enumerate() {
                    let start = if uni_in { t0 } else { *t };
                    *t = self.seg_lane(st, stage, r, lane as u32, op, start, &gate_end, draw);
                    max_end = max_end.max(*t);
                }
                if collapsible && !matches!(draw, Draw::Exact(_)) {
                    ready[0] = max_end;
                    return (true, None);
                }
                (ready.iter().all(|&t| t == ready[0]), None)
            }
        }
    }
}

/// The fast sampler's per-job statistics ([`StepModel::fast_stats`]).
#[derive(Clone, Debug)]
pub struct FastStats {
    stats: SegStats,
    table: MaxTable,
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
    rank_factor[layout.rank(Coord {
        tp: lane,
        cp: 0,
        dp: replica,
        pp: stage,
    }) as usize]
}

/// Adds `d` to the ready time(s): lane 0 only when every lane holds the same time.
fn add_to_lanes(ready: &mut [SimTime], uni: bool, d: SimTime) {
    if uni {
        ready[0] += d;
    } else {
        ready.iter_mut().for_each(|t| *t += d);
    }
}

fn lane_end(inst: &Inst, op: u32, lane: usize, l: usize) -> SimTime {
    if inst.uni[op as usize] {
        inst.ends[op as usize * l]
    } else {
        inst.ends[op as usize * l + lane]
    }
}

/// Max of the stream predecessor's and the dependencies' ends into `ready`; true when the
/// result is the same on every lane (then only `ready[0]` is set).
fn gather(st: &StageProg, inst: &Inst, op: u32, l: usize, ready: &mut [SimTime]) -> bool {
    let pred = st.stream_pred(op);
    let deps = st.deps_of(op);
    let all_uni =
        pred.is_none_or(|p| inst.uni[p as usize]) && deps.iter().all(|&d| inst.uni[d as usize]);
    if all_uni {
        let mut t = pred.map_or(0, |p| inst.ends[p as usize * l]);
        for &d in deps {
            t = t.max(inst.ends[d as usize * l]);
        }
        ready[0] = t;
        return true;
    }
    for (lane, slot) in ready.iter_mut().enumerate() {
        let mut t = pred.map_or(0, |p| lane_end(inst, p, lane, l));
        for &d in deps {
            t = t.max(lane_end(inst, d, lane, l));
        }
        *slot = t;
    }
    false
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
    let cops = out.stream_ops[Stream::Compute as usize].clone();
    for (k, &i) in cops.iter().enumerate() {
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
