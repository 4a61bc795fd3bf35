//! Max-plus evaluation of one iteration with frozen communication: the Monte Carlo step model
//! that makes `prism predict` fast at 65,536 GPUs.
//!
//! PRISM (Golden et al., arXiv:2510.15596) composes a step from sampled op durations: a kernel
//! takes its own draw, a collective takes one duration shared by all its participants, and the
//! step is the longest path of the dependency graph ("sum along serial dependencies, max over
//! joining branches"). With every communication duration fixed, the engine's run *is* that
//! longest path, and this module evaluates it directly, without events or a network:
//!
//! 1. One deterministic reduced engine run ([`prism_core::engine::simulate`]) records the duration of
//!    every collective and send of each stage. These are frozen; a sample scales them by its
//!    communication regime.
//! 2. Each stage's [`Program`](prism_core::graph::Program) is compiled into macro-ops: a run of
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
//!   e.g. within a node) and every kernel chain starts beside the same NCCL kernels as in the
//!   deterministic run (whose SM-held kernel prices are frozen with the rest); that is the test
//!   of this module (within 1e-4 in a node).
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
//!   Without per-GPU speeds, the blocks whose lanes race (a weight-gradient GEMM overlapping
//!   its group's collective) are drawn from per-sample pools of exact draws when a shape
//!   repeats often enough: each block exactly distributed, the blocks of a sample sharing the
//!   pool (the `pool` module; an approximation with a stated bound).
//!
//! Context parallelism: a stage of a replica has `tp x cp` lanes; a TP collective starts at the
//! latest lane of its TP group, a CP collective at the latest of its CP group, and a tail DP
//! collective at the latest over every replica's lanes of the same TP rank (Megatron's `dp_cp`
//! group). The order-statistic shortcut for segments applies when `cp = 1`.
//!
//! Scope: dense models (no expert parallelism) and a symmetric placement; other jobs get
//! [`SimError::InvalidOption`] and callers fall back to the per-rank engine.

mod attribute;
mod compile;
mod draw;
mod eval;
mod pool;
mod prune;

use attribute::*;
use compile::*;
use draw::*;
use eval::*;
use pool::*;
use prune::*;

pub use attribute::StepAttribution;
pub use draw::{DrawCount, FastStats, normal_draws};
pub use pool::{PoolSettings, PoolSummary};
pub use prune::{Pilot, Pruner};

use std::collections::BTreeMap;

use rand::RngExt;
use rand_distr::{Distribution, StandardNormal};
use rand_xoshiro::Xoshiro256PlusPlus;

use prism_core::engine::{Mode, SimError, SimOptions};

use crate::perturbation::Perturbation;
use crate::variability::Dist;
use prism_core::graph::{ExecutionGraph, NUM_STREAMS, OpKind, Stream};
use prism_core::job::Job;
use prism_core::layout::{Coord, GroupKind, Layout};
use prism_core::ops::OpClass;
use prism_core::units::SimTime;

/// The durations one deterministic reduced engine run gave every op of each stage's
/// representative (stage `s`: rank `s x stage_size`), and its iteration time: what the step
/// model freezes. A caller that already ran the job (explore's deterministic phase) keeps it and
/// compiles the model without running the engine again.
#[derive(Clone, Debug, PartialEq)]
pub struct Frozen {
    durations: Vec<Vec<SimTime>>,
    nominal_s: f64,
}

impl Frozen {
    /// The ranks a run must record for [`Frozen::from_run`]: one representative per stage.
    pub fn record_ranks(job: &Job) -> Vec<u32> {
        let layout = Layout::new(job);
        (0..layout.pp)
            .map(|s| layout.first_rank_of_stage(s))
            .collect()
    }

    /// Runs the job once, deterministic and reduced, recording the representatives.
    pub fn record(job: &Job, opts: &SimOptions) -> Result<Frozen, SimError> {
        let run = prism_core::engine::simulate(
            job,
            &SimOptions {
                mode: Mode::Reduced,
                record_ranks: Self::record_ranks(job),
                perturbation: None,
                ..opts.clone()
            },
        )?;
        Ok(Self::from_run(&run).expect("the representatives were recorded"))
    }

    /// The frozen durations of a deterministic, unperturbed reduced run that recorded
    /// [`Frozen::record_ranks`]; `None` when it did not record them all.
    pub fn from_run(run: &prism_core::SimResult) -> Option<Frozen> {
        let layout = run.graph.layout;
        let mut durations = Vec::with_capacity(layout.pp as usize);
        for (s, prog) in run.graph.programs.iter().enumerate() {
            let rep = layout.first_rank_of_stage(s as u32);
            let rec = run.timelines.iter().find(|t| t.rank == rep)?;
            let mut dur = vec![0 as SimTime; prog.len()];
            for r in &rec.ops {
                dur[r.op as usize] = r.end - r.start;
            }
            durations.push(dur);
        }
        Some(Frozen {
            durations,
            nominal_s: run.summary.iteration_time_s,
        })
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

/// Unsupported job for the fast path.
fn unsupported(why: impl Into<String>) -> SimError {
    SimError::InvalidOption(format!("max-plus step model: {}", why.into()))
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

impl StepModel {
    /// Compiles the step model of a validated job. `opts` supplies the cost parameters
    /// (compute, comm, kernel table); its mode and perturbation are ignored.
    pub fn new(job: &Job, opts: &SimOptions) -> Result<StepModel, SimError> {
        Self::with_frozen(job, &Frozen::record(job, opts)?)
    }

    /// Compiles the step model from an earlier deterministic run's frozen durations (which
    /// must come from the same job and options: [`Frozen::record`] or [`Frozen::from_run`]).
    pub fn with_frozen(job: &Job, frozen: &Frozen) -> Result<StepModel, SimError> {
        if job.model.moe.is_some() {
            return Err(unsupported("mixture-of-experts models are not supported"));
        }
        if job.parallel.shards_params() {
            return Err(unsupported(
                "ZeRO-3 parameter sharding is not supported (its data-parallel gathers sit \
                 inside the pipeline)",
            ));
        }
        let graph = ExecutionGraph::build(job);
        let layout = graph.layout;
        if frozen.durations.len() != graph.programs.len()
            || (frozen.durations.iter().zip(&graph.programs)).any(|(d, p)| d.len() != p.len())
        {
            return Err(unsupported("the frozen durations belong to another job"));
        }
        let mut stages = Vec::with_capacity(layout.pp as usize);
        for (s, dur) in frozen.durations.iter().enumerate() {
            stages.push(compile_stage(&graph, s as u32, dur, &layout)?);
        }
        let mut model = StepModel {
            layout,
            stages,
            graph,
            nominal_s: frozen.nominal_s,
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
        self.fast_stats_with(p, PoolSettings::default())
    }

    /// [`StepModel::fast_stats`] with the given pooling of lane races (see the `pool` module).
    pub fn fast_stats_with(
        &self,
        p: &Perturbation,
        pools: PoolSettings,
    ) -> Result<FastStats, SimError> {
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
        // Lane races repeat identically only when the lanes are alike.
        let pooled = if speeds {
            None
        } else {
            self.pool_regions(&tape, pools)
        };
        Ok(FastStats {
            stats,
            table: MaxTable::new(self.layout.tp),
            tape,
            speeds,
            prune,
            pooled,
        })
    }

    /// One sample drawn per segment with the exact order-statistic shortcuts (and, without
    /// per-GPU speeds, the statistics' pools of lane races, if any). `rank_factor`
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
        // Pools draw from streams of their own, and every replica restarts its stream: one
        // draw serves both.
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let (tape, pools) = match &fast.pooled {
            Some(pooled) if rank_factor.is_empty() => {
                let scale = Scale::new(comm_factor, &draw);
                (&pooled.tape, self.fill_pools(pooled, &mut draw, scale))
            }
            _ => (&fast.tape, Vec::new()),
        };
        if let Draw::Fast { pools: p, .. } = &mut draw {
            *p = &pools;
        }
        Ok(self.evaluate(tape, &mut draw, comm_factor))
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
            pools: &[],
            seed,
            rng: replica_rng(seed, 0),
        })
    }
}
