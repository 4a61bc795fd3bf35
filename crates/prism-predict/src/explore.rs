//! `prism explore` as library calls: search the parallel layouts of a job for the fastest one.
//!
//! 1. [`feasible`]: enumerate every (tp, pp, dp, cp, vpp, micro_batch, recompute,
//!    distributed_optimizer, and with cp > 1 the context-parallel form: the job's own,
//!    Transformer Engine's ring `p2p` and the all-to-all `a2a`) for the job's model on its GPU
//!    count, global batch fixed; keep
//!    those that pass [`Job::validate`] and fit in GPU memory ([`memory::peak_memory`]). The
//!    job's own layout is always a candidate.
//! 2. [`evaluate`]: simulate each feasible candidate once, deterministically (`Mode::Reduced`,
//!    falling back to `Mode::Full` for asymmetric placements), in parallel.
//! 3. [`sample`]: Monte Carlo iterations (every GPU, perturbed as in `prism predict`) for the
//!    fastest candidates, with [`crate::predict::sample_steps`]: the max-plus step model
//!    ([`crate::step_model::StepModel`], frozen communication durations) where the candidate
//!    and the jitter allow it, else the per-rank engine.
//! 4. [`rank`] by the objective (mean, p95 or p99 iteration time); [`p99_inversions`] lists the
//!    pairs the mean and the p99 rank differently.
//! 5. [`analyse_slow_gpus`]: for the job's own layout, compare where N GPUs whose kernels run
//!    slower could sit (one TP group, one pipeline stage, one DP replica, spread evenly, the
//!    least-loaded stage), each simulated with `Mode::Full` and a per-rank [`Perturbation`].

use prism_core::cost::compute::KernelTable;
use prism_core::engine::{Mode, SimError, SimOptions};
use prism_core::job::{CpCommType, Job, Parallel, Recompute, Schedule};
use prism_core::layout::{Coord, Layout};
use prism_core::memory;
use prism_core::pipeline_layout::PipelineLayout;

use crate::perturbation::Perturbation;
use crate::stats;
use crate::step_model::Frozen;
use crate::variability::Variability;
use crate::{Error, Progress};
use std::sync::Arc;

pub use prism_core::units::GIB;

/// What a search minimises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    /// Mean iteration time.
    Mean,
    /// 95th percentile.
    P95,
    /// 99th percentile.
    P99,
}

impl Objective {
    /// The objective's name (`mean`, `p95`, `p99`).
    pub fn name(self) -> &'static str {
        match self {
            Objective::Mean => "mean",
            Objective::P95 => "p95",
            Objective::P99 => "p99",
        }
    }
}

/// Monte Carlo statistics of one candidate.
#[derive(Clone, Copy, Debug)]
pub struct Sampled {
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

/// One evaluated candidate.
#[derive(Clone, Debug)]
pub struct Evaluated {
    pub job: Job,
    /// The layout the job file describes.
    pub is_job_config: bool,
    pub iteration_s: f64,
    pub mfu: f64,
    pub tokens_per_s: f64,
    pub peak_bytes: u64,
    pub sampled: Option<Sampled>,
    /// The deterministic run's frozen durations (when it was reduced), so the step model of
    /// step 3 need not run the engine again.
    pub frozen: Option<Arc<Frozen>>,
}

impl Evaluated {
    /// Value of the objective: the sample statistic when sampled, else the deterministic time.
    pub fn objective(&self, o: Objective) -> f64 {
        match (self.sampled, o) {
            (None, _) => self.iteration_s,
            (Some(s), Objective::Mean) => s.mean,
            (Some(s), Objective::P95) => s.p95,
            (Some(s), Objective::P99) => s.p99,
        }
    }

    /// Mean iteration time (sampled, else deterministic).
    pub fn mean(&self) -> f64 {
        self.sampled.map_or(self.iteration_s, |s| s.mean)
    }

    /// 99th-percentile iteration time (sampled, else deterministic).
    pub fn p99(&self) -> f64 {
        self.sampled.map_or(self.iteration_s, |s| s.p99)
    }
}

/// Counts of the enumeration.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub enumerated: usize,
    pub invalid: usize,
    pub out_of_memory: usize,
    /// Rejected: the execution graph would exceed [`prism_core::graph::MAX_OPS`].
    pub too_large: usize,
}

fn divisors(n: u32) -> Vec<u32> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Same layout (every field explore varies, plus the uneven split).
pub fn same_layout(a: &Parallel, b: &Parallel) -> bool {
    (
        a.tp,
        a.pp,
        a.cp,
        a.dp,
        a.vpp,
        a.micro_batch,
        a.recompute,
        a.distributed_optimizer,
        a.schedule,
        a.sequence_parallel,
        a.first_stage_layers,
        a.last_stage_layers,
    ) == (
        b.tp,
        b.pp,
        b.cp,
        b.dp,
        b.vpp,
        b.micro_batch,
        b.recompute,
        b.distributed_optimizer,
        b.schedule,
        b.sequence_parallel,
        b.first_stage_layers,
        b.last_stage_layers,
    ) && a.pipeline_layout == b.pipeline_layout
        && a.cp_comm_type == b.cp_comm_type
}

/// Every candidate layout of `base` (validated or not), the job's own layout first.
pub fn enumerate(base: &Job) -> Vec<Job> {
    let m = &base.model;
    let c = &base.cluster;
    let gpus = c.num_gpus();
    let bp = &base.parallel;
    let gb = base.training.global_batch as u64;
    // Pipeline splits: every even split, plus the job's uneven split at its own pp, plus the
    // job's pipeline layout at every pp dividing its virtual stage count (vpp = stages / pp).
    type Split = (u32, Option<u32>, Option<u32>, Option<(PipelineLayout, u32)>);
    let mut splits: Vec<Split> = divisors(m.layers)
        .into_iter()
        .map(|pp| (pp, None, None, None))
        .collect();
    if bp.first_stage_layers.is_some() || bp.last_stage_layers.is_some() {
        splits.push((bp.pp, bp.first_stage_layers, bp.last_stage_layers, None));
    }
    if let Some(l) = &bp.pipeline_layout {
        let stages = l.stages.len() as u32;
        for pp in divisors(stages) {
            splits.push((pp, None, None, Some((l.clone(), stages / pp))));
        }
    }
    let tps: Vec<u32> = divisors(c.gpus_per_node)
        .into_iter()
        .filter(|&t| m.heads.is_multiple_of(t) && m.kv_heads.is_multiple_of(t))
        .collect();
    let cps: Vec<u32> = [1u32, 2, 4, 8]
        .into_iter()
        .filter(|&cp| cp == 1 || (m.seq_len / 2).is_multiple_of(cp))
        .collect();
    // Sequence parallelism: as the job file says for tp > 1 (default on).
    let sp = |tp: u32| tp > 1 && (bp.tp == 1 || bp.sequence_parallel);
    // Context-parallel forms: the job's own first, then the ring and the all-to-all (the
    // latter's head rule is left to `Job::validate`).
    let mut cp_forms = vec![bp.cp_comm_type];
    for f in [CpCommType::P2p, CpCommType::A2a] {
        if !cp_forms.contains(&f) {
            cp_forms.push(f);
        }
    }
    let mut out = vec![base.clone()];
    for &tp in &tps {
        for (pp, first, last, layout) in &splits {
            let (pp, first, last) = (*pp, *first, *last);
            let uneven = first.is_some() || last.is_some();
            let vpps: &[u32] = match layout {
                Some((_, v)) => std::slice::from_ref(v),
                None => &[1, 2, 4],
            };
            for &cp in &cps {
                let mp = tp as u64 * pp as u64 * cp as u64;
                if !gpus.is_multiple_of(mp) {
                    continue;
                }
                let dp = gpus / mp;
                for mb in [1u32, 2, 4] {
                    let step = dp * mb as u64;
                    if !gb.is_multiple_of(step) {
                        continue;
                    }
                    let mbs = gb / step;
                    for &vpp in vpps {
                        if layout.is_some() && vpp > 1 && (pp < 2 || !mbs.is_multiple_of(pp as u64))
                        {
                            continue;
                        }
                        if layout.is_none()
                            && vpp > 1
                            && (uneven
                                || pp < 2
                                || !m.layers.is_multiple_of(pp * vpp)
                                || !mbs.is_multiple_of(pp as u64))
                        {
                            continue;
                        }
                        let forms = if cp > 1 {
                            &cp_forms[..]
                        } else {
                            &cp_forms[..1]
                        };
                        let choices = forms.iter().flat_map(|&f| {
                            [Recompute::None, Recompute::Selective, Recompute::Full]
                                .into_iter()
                                .flat_map(move |r| [(f, r, true), (f, r, false)])
                        });
                        for (form, recompute, dist) in choices {
                            let mut j = base.clone();
                            let p = &mut j.parallel;
                            p.tp = tp;
                            p.pp = pp;
                            p.cp = cp;
                            p.cp_comm_type = form;
                            p.dp = dp as u32;
                            p.vpp = vpp;
                            p.micro_batch = mb;
                            p.recompute = recompute;
                            p.set_distributed_optimizer(dist);
                            p.sequence_parallel = sp(tp);
                            // A job running Megatron-Core's combined 1F1B keeps it
                            // wherever its rules allow (one chunk without pipeline
                            // stages, several with them, no full recompute).
                            let overlap = base.parallel.schedule == Schedule::OneFOneBOverlap
                                && (pp == 1) == (vpp == 1)
                                && recompute != Recompute::Full;
                            p.schedule = if overlap {
                                Schedule::OneFOneBOverlap
                            } else if vpp > 1 {
                                Schedule::Interleaved
                            } else {
                                Schedule::OneFOneB
                            };
                            p.first_stage_layers = first;
                            p.last_stage_layers = last;
                            p.pipeline_layout = layout.as_ref().map(|(l, _)| l.clone());
                            if !same_layout(&j.parallel, bp) {
                                out.push(j);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Deterministic iteration of one candidate: reduced, or full where the placement is asymmetric.
pub fn simulate_det(
    job: &Job,
    kernel_table: &Option<KernelTable>,
) -> Result<prism_core::SimResult, SimError> {
    simulate_det_frozen(job, kernel_table).map(|(r, _)| r)
}

/// [`simulate_det`], and when the run was reduced, its durations frozen for the step model.
pub fn simulate_det_frozen(
    job: &Job,
    kernel_table: &Option<KernelTable>,
) -> Result<(prism_core::SimResult, Option<Frozen>), SimError> {
    let opts = SimOptions {
        mode: Mode::Reduced,
        kernel_table: kernel_table.clone(),
        record_ranks: Frozen::record_ranks(job),
        ..SimOptions::default()
    };
    match prism_core::engine::simulate(job, &opts) {
        Ok(r) => {
            let frozen = Frozen::from_run(&r);
            Ok((r, frozen))
        }
        Err(SimError::Asymmetric(_)) => prism_core::engine::simulate(
            job,
            &SimOptions {
                mode: Mode::Full,
                record_ranks: Vec::new(),
                ..opts
            },
        )
        .map(|r| (r, None)),
        Err(e) => Err(e),
    }
}

/// Where the slow GPUs of one candidate placement sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Packed into TP groups: fill the TP groups of one DP replica of stage 0, then the next TP
    /// group of the same stage (rank order).
    TpGroup,
    /// Packed into stage 0, one per DP replica (then the next TP rank, then the next stage).
    PipelineStage,
    /// Concentrated in DP replica 0, spread over its stages (then its other ranks, then the
    /// next replica).
    DpReplica,
    /// Spread evenly: one per TP group, round-robin over stages and DP replicas (diagonally).
    Spread,
    /// Packed into TP groups of the stage with the least kernel time (then the next least).
    LeastLoadedStage,
}

impl Placement {
    /// Every placement, in report order.
    pub const ALL: [Placement; 5] = [
        Placement::TpGroup,
        Placement::PipelineStage,
        Placement::DpReplica,
        Placement::Spread,
        Placement::LeastLoadedStage,
    ];

    /// The placement's name.
    pub fn name(self) -> &'static str {
        match self {
            Placement::TpGroup => "tp-group",
            Placement::PipelineStage => "pipeline-stage",
            Placement::DpReplica => "dp-replica",
            Placement::Spread => "spread",
            Placement::LeastLoadedStage => "least-loaded-stage",
        }
    }

    /// What the placement does, in a few words.
    pub fn description(self) -> &'static str {
        match self {
            Placement::TpGroup => "packed into one TP group",
            Placement::PipelineStage => "one pipeline stage, across DP replicas",
            Placement::DpReplica => "one DP replica, across its stages",
            Placement::Spread => "spread evenly, one per TP group",
            Placement::LeastLoadedStage => "packed into the least-loaded stage",
        }
    }

    /// Every rank of `l`, in the order this placement makes GPUs slow (the first N are slow).
    /// `stages_by_load`: the stages from the least to the most kernel time.
    pub fn order(self, l: &Layout, stages_by_load: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(l.num_ranks() as usize);
        match self {
            Placement::TpGroup => out.extend(0..l.num_ranks()),
            Placement::PipelineStage => {
                for pp in 0..l.pp {
                    for tp in 0..l.tp {
                        for cp in 0..l.cp {
                            for dp in 0..l.dp {
                                out.push(l.rank(Coord { tp, cp, dp, pp }));
                            }
                        }
                    }
                }
            }
            Placement::DpReplica => {
                for dp in 0..l.dp {
                    for cp in 0..l.cp {
                        for tp in 0..l.tp {
                            for pp in 0..l.pp {
                                out.push(l.rank(Coord { tp, cp, dp, pp }));
                            }
                        }
                    }
                }
            }
            Placement::Spread => {
                // TP group i sits on stage i % pp and replica (i / pp + stage) % dp, so
                // consecutive slow GPUs change both stage and replica.
                for tp in 0..l.tp {
                    for i in 0..l.pp * l.dp * l.cp {
                        let pp = i % l.pp;
                        let q = i / l.pp;
                        let dp = (q % l.dp + pp) % l.dp;
                        let cp = q / l.dp;
                        out.push(l.rank(Coord { tp, cp, dp, pp }));
                    }
                }
            }
            Placement::LeastLoadedStage => {
                for &s in stages_by_load {
                    out.extend(l.stage_ranks(s));
                }
            }
        }
        out
    }
}

/// One simulated placement of the slow GPUs.
#[derive(Clone, Debug)]
pub struct PlacementRun {
    pub placement: Placement,
    /// The slow ranks, ascending.
    pub ranks: Vec<u32>,
    pub iteration_s: f64,
    /// An earlier placement with the same slow ranks.
    pub same_as: Option<Placement>,
}

/// Placements of slow GPUs in the job's own layout.
#[derive(Clone, Debug)]
pub struct SlowGpuAnalysis {
    pub job: Job,
    pub slow_gpus: usize,
    pub slowdown: f64,
    /// Iteration time with no slow GPU (`Mode::Full`, unperturbed).
    pub baseline_s: f64,
    /// Mean kernel time per GPU of each stage, in the unperturbed run.
    pub stage_compute_s: Vec<f64>,
    pub least_loaded_stage: u32,
    pub runs: Vec<PlacementRun>,
    pub best: usize,
    pub worst: usize,
    pub spread: usize,
}

impl SlowGpuAnalysis {
    /// How much faster the best placement is than `other`, percent.
    pub fn gain_pct(&self, other: usize) -> f64 {
        100.0 * (self.runs[other].iteration_s / self.runs[self.best].iteration_s - 1.0)
    }
}

/// A feasible candidate: the job, its peak bytes per GPU, and whether it is the job's own
/// layout.
pub type Candidate = (Job, u64, bool);

/// Step 1: every candidate layout of `base` that passes the job rules and fits in GPU memory,
/// as (job, peak bytes per GPU, is the job's own layout), with the counts of the enumeration.
/// Fails when nothing is feasible or more than `max_candidates` are.
pub fn feasible(base: &Job, max_candidates: usize) -> Result<(Vec<Candidate>, Counts), Error> {
    let capacity = base.cluster.gpu.hbm_gib * GIB;
    let all = enumerate(base);
    let mut counts = Counts {
        enumerated: all.len(),
        ..Counts::default()
    };
    let mut feasible: Vec<Candidate> = Vec::new();
    for (i, j) in all.into_iter().enumerate() {
        if j.validate().is_err() {
            counts.invalid += 1;
            continue;
        }
        let peak = memory::peak_memory(&j).1.total();
        if peak as f64 > capacity {
            counts.out_of_memory += 1;
            continue;
        }
        if prism_core::graph::size_check(&j).is_err() {
            counts.too_large += 1;
            continue;
        }
        feasible.push((j, peak, i == 0));
    }
    if feasible.is_empty() {
        return Err(Error::Invalid(format!(
            "no feasible layout: {} enumerated, {} break a job rule, {} do not fit in {:.0} GiB per GPU, {} exceed the graph size limit",
            counts.enumerated,
            counts.invalid,
            counts.out_of_memory,
            base.cluster.gpu.hbm_gib,
            counts.too_large
        )));
    }
    if feasible.len() > max_candidates {
        return Err(Error::Invalid(format!(
            "{} feasible layouts exceed --max-candidates {}; raise it, or narrow the search (fewer GPUs)",
            feasible.len(),
            max_candidates
        )));
    }
    Ok((feasible, counts))
}

/// Step 2: one deterministic simulation of every feasible candidate, in parallel, fastest
/// first (ties keep enumeration order). `progress` is called once per candidate.
pub fn evaluate(
    feasible: Vec<Candidate>,
    kernel_table: &Option<KernelTable>,
    progress: &Progress<'_>,
) -> Result<Vec<Evaluated>, Error> {
    use rayon::prelude::*;
    let mut evaluated: Vec<Evaluated> = feasible
        .into_par_iter()
        .map(|(job, peak_bytes, is_job_config)| {
            let r = simulate_det_frozen(&job, kernel_table);
            progress(1);
            let r = r.map_err(|e| {
                let p = &job.parallel;
                Error::sim(
                    format!(
                        "simulation failed for tp {} pp {} cp {} dp {} vpp {} micro-batch {}",
                        p.tp, p.pp, p.cp, p.dp, p.vpp, p.micro_batch
                    ),
                    e,
                )
            })?;
            let (r, frozen) = r;
            let s = &r.summary;
            Ok(Evaluated {
                iteration_s: s.iteration_time_s,
                mfu: s.mfu,
                tokens_per_s: s.tokens_per_s,
                peak_bytes,
                is_job_config,
                sampled: None,
                frozen: frozen.map(Arc::new),
                job,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    // Stable sort: ties keep enumeration order, so the output is deterministic.
    evaluated.sort_by(|a, b| a.iteration_s.total_cmp(&b.iteration_s));
    Ok(evaluated)
}

/// How step 3 samples.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// Monte Carlo iterations per candidate.
    pub samples: u64,
    /// Clusters a candidate's samples are spread over (sample `i` on cluster `i % clusters`),
    /// as in `prism predict`; with three or more samples per cluster the step model prunes
    /// replicas. `clusters = samples` gives every sample its own GPUs.
    pub clusters: u64,
    /// Seed of every draw.
    pub seed: u64,
    /// Every rank of every sample in the engine instead of the step model.
    pub per_rank: bool,
}

/// Step 3: Monte Carlo iterations of each of `candidates`, in parallel, with
/// [`crate::predict::sample_steps`]. Sample `i` of every candidate draws from the same streams
/// (per-GPU speeds of its cluster, jitter, communication regime): common random numbers.
/// Returns the step methods used, `; `-joined. `label` names a candidate in errors; `progress`
/// is called once per sample.
pub fn sample(
    candidates: &mut [Evaluated],
    v: &Variability,
    opts: &SampleOptions,
    kernel_table: &Option<KernelTable>,
    label: &(dyn Fn(&Job) -> String + Sync),
    progress: &Progress<'_>,
) -> Result<String, Error> {
    use rayon::prelude::*;
    let base_opts = SimOptions {
        kernel_table: kernel_table.clone(),
        ..SimOptions::default()
    };
    let runs: Vec<(Vec<f64>, String)> = candidates
        .par_iter()
        .map(|e| {
            crate::predict::sample_steps_frozen(
                &e.job,
                v,
                opts.seed,
                opts.samples,
                opts.clusters,
                opts.per_rank,
                crate::predict::Shortcuts::default(),
                &base_opts,
                e.frozen.as_deref(),
                progress,
            )
            // The step model is not needed once the samples are drawn.
            .map(|(steps, method, _model)| (steps, method))
            .map_err(|err| match err {
                Error::Sim { context, source } => Error::sim(
                    format!(
                        "Monte Carlo simulation failed for {}: {context}",
                        label(&e.job)
                    ),
                    source,
                ),
                other => Error::Invalid(format!(
                    "Monte Carlo simulation failed for {}: {other}",
                    label(&e.job)
                )),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let mut methods: Vec<String> = Vec::new();
    for (c, (times, method)) in runs.into_iter().enumerate() {
        if !methods.contains(&method) {
            methods.push(method);
        }
        let mut sorted = times;
        sorted.sort_by(f64::total_cmp);
        let s = stats::summarize(&sorted);
        candidates[c].sampled = Some(Sampled {
            mean: s.mean,
            p50: s.p50,
            p95: s.p95,
            p99: s.p99,
        });
    }
    Ok(methods.join("; "))
}

/// Step 4: sampled candidates first, by the objective, then the rest by deterministic time
/// (stable).
pub fn rank(evaluated: &mut [Evaluated], objective: Objective) {
    evaluated.sort_by(|a, b| {
        b.sampled
            .is_some()
            .cmp(&a.sampled.is_some())
            .then(a.objective(objective).total_cmp(&b.objective(objective)))
    });
}

/// Simulates every placement of `slow_gpus` GPUs, `slowdown` times slower, in `job`'s layout.
pub fn analyse_slow_gpus(
    job: &Job,
    slow_gpus: usize,
    slowdown: f64,
    kernel_table: &Option<KernelTable>,
) -> Result<SlowGpuAnalysis, Error> {
    use rayon::prelude::*;
    job.validate().map_err(|e| {
        Error::Invalid(format!(
            "--slow-gpus compares placements in the job's own layout, which is invalid: {e}"
        ))
    })?;
    let l = Layout::new(job);
    let opts = SimOptions {
        mode: Mode::Full,
        kernel_table: kernel_table.clone(),
        ..SimOptions::default()
    };
    let base = prism_core::simulate(job, &opts)
        .map_err(|e| Error::sim("simulation of the job's layout failed", e))?;
    let mut sum = vec![0.0; l.pp as usize];
    let mut count = vec![0usize; l.pp as usize];
    for r in &base.ranks {
        let s = l.coord(r.rank).pp as usize;
        sum[s] += r.compute_s;
        count[s] += 1;
    }
    let stage_compute_s: Vec<f64> = sum
        .iter()
        .zip(&count)
        .map(|(s, &c)| if c == 0 { 0.0 } else { s / c as f64 })
        .collect();
    let mut stages_by_load: Vec<u32> = (0..l.pp).collect();
    // Stable: equal stages keep their index order.
    stages_by_load
        .sort_by(|a, b| stage_compute_s[*a as usize].total_cmp(&stage_compute_s[*b as usize]));
    let sets: Vec<(Placement, Vec<u32>)> = Placement::ALL
        .iter()
        .map(|&p| {
            let mut ranks = p.order(&l, &stages_by_load);
            ranks.truncate(slow_gpus);
            ranks.sort_unstable();
            (p, ranks)
        })
        .collect();
    let times: Vec<f64> = sets
        .par_iter()
        .map(|(_, ranks)| {
            let mut rank_factor = vec![1.0; l.num_ranks() as usize];
            for &r in ranks {
                rank_factor[r as usize] = slowdown;
            }
            let o = Perturbation {
                rank_factor,
                ..Perturbation::default()
            }
            .options(&opts);
            prism_core::simulate(job, &o).map(|r| r.summary.iteration_time_s)
        })
        .collect::<Result<Vec<f64>, _>>()
        .map_err(|e| Error::sim("simulation with slow GPUs failed", e))?;
    let runs: Vec<PlacementRun> = sets
        .iter()
        .zip(&times)
        .enumerate()
        .map(|(i, ((p, ranks), &t))| PlacementRun {
            placement: *p,
            ranks: ranks.clone(),
            iteration_s: t,
            same_as: sets[..i].iter().find(|(_, r)| r == ranks).map(|(q, _)| *q),
        })
        .collect();
    // Ties go to the earlier placement.
    let mut best = 0;
    let mut worst = 0;
    for (i, r) in runs.iter().enumerate() {
        if r.iteration_s < runs[best].iteration_s {
            best = i;
        }
        if r.iteration_s > runs[worst].iteration_s {
            worst = i;
        }
    }
    let spread = runs
        .iter()
        .position(|r| r.placement == Placement::Spread)
        .expect("spread is a placement");
    Ok(SlowGpuAnalysis {
        job: job.clone(),
        slow_gpus,
        slowdown,
        baseline_s: base.summary.iteration_time_s,
        least_loaded_stage: stages_by_load[0],
        stage_compute_s,
        runs,
        best,
        worst,
        spread,
    })
}

/// A pair of sampled candidates (indices into the ranking) where `a` has the lower mean but
/// the higher p99.
#[derive(Clone, Debug)]
pub struct Inversion {
    /// Faster on average.
    pub a: usize,
    /// Faster at p99.
    pub b: usize,
    /// How much faster `a` is on average, percent.
    pub mean_gain_pct: f64,
    /// How much slower `a` is at p99, percent.
    pub p99_loss_pct: f64,
}

/// Every inversion among the sampled candidates of `ranked`, by (a, b).
pub fn p99_inversions(ranked: &[Evaluated]) -> Vec<Inversion> {
    let idx: Vec<usize> = (0..ranked.len())
        .filter(|&i| ranked[i].sampled.is_some())
        .collect();
    let mut out = Vec::new();
    for &a in &idx {
        for &b in &idx {
            let (ea, eb) = (&ranked[a], &ranked[b]);
            if ea.mean() < eb.mean() && ea.p99() > eb.p99() {
                out.push(Inversion {
                    a,
                    b,
                    mean_gain_pct: 100.0 * (eb.mean() / ea.mean() - 1.0),
                    p99_loss_pct: 100.0 * (ea.p99() / eb.p99() - 1.0),
                });
            }
        }
    }
    out.sort_by_key(|x| (x.a, x.b));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_core::job::fixtures::small_job;

    fn cand(det: f64, mean: f64, p99: f64) -> Evaluated {
        Evaluated {
            job: small_job(2, 2, 2, 16),
            is_job_config: false,
            iteration_s: det,
            mfu: 0.5,
            tokens_per_s: 1.0,
            peak_bytes: 0,
            sampled: Some(Sampled {
                mean,
                p50: mean,
                p95: p99,
                p99,
            }),
            frozen: None,
        }
    }

    #[test]
    fn inversions_compare_mean_and_p99() {
        // #1 is 10% faster on average than #2 but 20% slower at p99; #3 is slower on both.
        let ranked = [
            cand(1.0, 1.0, 1.2),
            cand(1.0, 1.1, 1.0),
            cand(1.0, 2.0, 3.0),
        ];
        let inv = p99_inversions(&ranked);
        assert_eq!(inv.len(), 1);
        assert_eq!((inv[0].a, inv[0].b), (0, 1));
        assert!((inv[0].mean_gain_pct - 10.0).abs() < 1e-9);
        assert!((inv[0].p99_loss_pct - 20.0).abs() < 1e-9);
    }

    fn layout(tp: u32, cp: u32, dp: u32, pp: u32) -> Layout {
        Layout {
            tp,
            cp,
            dp,
            pp,
            ep: 1,
            gpus_per_node: 8,
            order: prism_core::job::RankOrder::TpCpEpDpPp,
        }
    }

    #[test]
    fn placement_orders_are_permutations_with_the_promised_shape() {
        use prism_core::layout::GroupKind;
        for l in [
            layout(2, 1, 4, 2),
            layout(4, 2, 3, 3),
            layout(1, 1, 8, 4),
            layout(8, 1, 1, 2),
        ] {
            let stages: Vec<u32> = (0..l.pp).rev().collect();
            for p in Placement::ALL {
                let mut o = p.order(&l, &stages);
                let first = o.clone();
                o.sort_unstable();
                assert_eq!(o, (0..l.num_ranks()).collect::<Vec<_>>(), "{p:?}");
                let head = &first[..l.tp as usize];
                let tp_groups: std::collections::BTreeSet<u32> =
                    head.iter().map(|&r| l.group_of(GroupKind::Tp, r)).collect();
                let coords: Vec<Coord> = head.iter().map(|&r| l.coord(r)).collect();
                match p {
                    // The first tp slow GPUs fill one TP group.
                    Placement::TpGroup => assert_eq!(tp_groups.len(), 1),
                    Placement::LeastLoadedStage => {
                        assert_eq!(tp_groups.len(), 1);
                        assert!(coords.iter().all(|c| c.pp == stages[0]));
                    }
                    Placement::PipelineStage => assert!(coords.iter().all(|c| c.pp == 0)),
                    Placement::DpReplica => assert!(coords.iter().all(|c| c.dp == 0)),
                    // One per TP group until every TP group has one.
                    Placement::Spread => {
                        let n = (l.pp * l.dp * l.cp) as usize;
                        let g: std::collections::BTreeSet<u32> = first[..n]
                            .iter()
                            .map(|&r| l.group_of(GroupKind::Tp, r))
                            .collect();
                        assert_eq!(g.len(), n);
                        // The first min(pp, dp) sit on distinct stages and replicas.
                        let k = l.pp.min(l.dp) as usize;
                        let c: Vec<Coord> = first[..k].iter().map(|&r| l.coord(r)).collect();
                        for (i, a) in c.iter().enumerate() {
                            for b in &c[i + 1..] {
                                assert!(a.pp != b.pp && a.dp != b.dp, "{a:?} {b:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn enumeration_keeps_the_job_first_and_unique() {
        let job = small_job(2, 2, 2, 16);
        let all = enumerate(&job);
        assert_eq!(all[0], job);
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert!(!same_layout(&a.parallel, &b.parallel));
            }
        }
        // Interleaved only with pp >= 2 and vpp > 1.
        assert!(
            all.iter()
                .all(|j| (j.parallel.schedule == Schedule::Interleaved) == (j.parallel.vpp > 1))
        );
    }
}
