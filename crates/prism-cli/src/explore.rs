//! `prism explore`: searches the parallel layouts of a job for the fastest one.
//!
//! 1. Enumerate every (tp, pp, dp, cp, vpp, micro_batch, recompute, distributed_optimizer) for
//!    the job's model on its GPU count (or `--gpus`), global batch fixed; keep those that pass
//!    [`Job::validate`] and fit in GPU memory ([`memory::peak_memory`]). The job's own layout is
//!    always a candidate.
//! 2. Simulate each feasible candidate once, deterministically (`Mode::Reduced`, falling back to
//!    `Mode::Full` for asymmetric placements), in parallel.
//! 3. With `--samples K` and a `[variability]` section, run K Monte Carlo iterations (every GPU,
//!    perturbed as in `prism predict`) for the `--sample-top` fastest candidates, with
//!    [`crate::predict::sample_steps`]: the max-plus step model
//!    ([`prism_core::maxplus::StepModel`], frozen communication durations) where the candidate
//!    and the jitter allow it, else (or with `--per-rank`) the per-rank engine (`Mode::Full`, or
//!    `Mode::Reduced` when a sample's perturbation keeps the ranks symmetric).
//! 4. Rank by the objective (mean, p95 or p99 iteration time) and report.
//! 5. With `--slow-gpus N` (or `--slow-fraction F`), for the job's own layout: compare where N
//!    GPUs whose kernels run `--slowdown` times slower could sit (one TP group, one pipeline
//!    stage, one DP replica, spread evenly, the least-loaded stage), each simulated with
//!    `Mode::Full` and a per-rank [`Perturbation`], and report the best and its gain.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::cost::compute::KernelTable;
use prism_core::engine::{Mode, Perturbation, SimError, SimOptions};
use prism_core::job::{Job, Parallel, Recompute, Schedule};
use prism_core::layout::{Coord, Layout};
use prism_core::memory;
use prism_core::stats;
use prism_core::variability::Variability;
use prism_io::report_json::{recompute_name, schedule_name};
use serde_json::{Value, json};

#[derive(Debug, clap::Args)]
pub struct ExploreArgs {
    /// Job file (default: the embedded example).
    job: Option<PathBuf>,
    /// Override a job key (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Search for this GPU count instead of the job's (sets cluster.nodes = N / gpus_per_node).
    #[arg(long)]
    gpus: Option<u64>,
    /// What to minimise: mean, p95 or p99 iteration time (p95/p99 need --samples and a
    /// [variability] section; without them every quantile equals the deterministic time).
    #[arg(long, value_enum, default_value_t = Objective::Mean)]
    objective: Objective,
    /// Monte Carlo iterations for each of the --sample-top fastest candidates (0: deterministic
    /// only).
    #[arg(long, default_value_t = 0)]
    samples: usize,
    /// How many of the fastest candidates (by deterministic time) get the Monte Carlo
    /// iterations (0: every feasible candidate).
    #[arg(long, value_name = "N", default_value_t = 10)]
    sample_top: usize,
    /// Rows to report (0: all).
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Most feasible candidates to simulate; above it the search stops with an error.
    #[arg(long, default_value_t = 5000)]
    max_candidates: usize,
    /// Seed of the Monte Carlo draws (default: `[variability] seed`, else 1).
    #[arg(long)]
    seed: Option<u64>,
    /// Compare placements of this many slow GPUs in the job's own layout.
    #[arg(long, value_name = "N", conflicts_with = "slow_fraction")]
    slow_gpus: Option<u64>,
    /// Like --slow-gpus, as a fraction of the GPUs (rounded up, at least one).
    #[arg(long, value_name = "F")]
    slow_fraction: Option<f64>,
    /// Kernel time factor of a slow GPU (1.2: kernels take 20% longer).
    #[arg(long, value_name = "X", default_value_t = 1.2)]
    slowdown: f64,
    /// Simulate every rank of every sample with the event-driven engine instead of the
    /// max-plus step model.
    #[arg(long)]
    per_rank: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Objective {
    Mean,
    P95,
    P99,
}

impl Objective {
    fn name(self) -> &'static str {
        match self {
            Objective::Mean => "mean",
            Objective::P95 => "p95",
            Objective::P99 => "p99",
        }
    }
}

/// Monte Carlo statistics of one candidate.
#[derive(Clone, Copy, Debug)]
struct Sampled {
    mean: f64,
    p50: f64,
    p95: f64,
    p99: f64,
}

/// One evaluated candidate.
#[derive(Clone, Debug)]
struct Evaluated {
    job: Job,
    /// The layout the job file describes.
    is_job_config: bool,
    iteration_s: f64,
    mfu: f64,
    tokens_per_s: f64,
    peak_bytes: u64,
    sampled: Option<Sampled>,
}

impl Evaluated {
    /// Value of the objective: the sample statistic when sampled, else the deterministic time.
    fn objective(&self, o: Objective) -> f64 {
        match (self.sampled, o) {
            (None, _) => self.iteration_s,
            (Some(s), Objective::Mean) => s.mean,
            (Some(s), Objective::P95) => s.p95,
            (Some(s), Objective::P99) => s.p99,
        }
    }

    fn mean(&self) -> f64 {
        self.sampled.map_or(self.iteration_s, |s| s.mean)
    }

    fn p99(&self) -> f64 {
        self.sampled.map_or(self.iteration_s, |s| s.p99)
    }
}

/// Counts of the enumeration.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    enumerated: usize,
    invalid: usize,
    out_of_memory: usize,
}

fn divisors(n: u32) -> Vec<u32> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Same layout (every field explore varies, plus the uneven split).
fn same_layout(a: &Parallel, b: &Parallel) -> bool {
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
    )
}

/// Every candidate layout of `base` (validated or not), the job's own layout first.
fn enumerate(base: &Job) -> Vec<Job> {
    let m = &base.model;
    let c = &base.cluster;
    let gpus = c.num_gpus();
    let bp = &base.parallel;
    let gb = base.training.global_batch as u64;
    // Pipeline splits: every even split, plus the job's uneven split at its own pp.
    let mut splits: Vec<(u32, Option<u32>, Option<u32>)> = divisors(m.layers)
        .into_iter()
        .map(|pp| (pp, None, None))
        .collect();
    if bp.first_stage_layers.is_some() || bp.last_stage_layers.is_some() {
        splits.push((bp.pp, bp.first_stage_layers, bp.last_stage_layers));
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
    let mut out = vec![base.clone()];
    for &tp in &tps {
        for &(pp, first, last) in &splits {
            let uneven = first.is_some() || last.is_some();
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
                    for vpp in [1u32, 2, 4] {
                        if vpp > 1
                            && (uneven
                                || pp < 2
                                || !m.layers.is_multiple_of(pp * vpp)
                                || !mbs.is_multiple_of(pp as u64))
                        {
                            continue;
                        }
                        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                            for dist in [true, false] {
                                let mut j = base.clone();
                                let p = &mut j.parallel;
                                p.tp = tp;
                                p.pp = pp;
                                p.cp = cp;
                                p.dp = dp as u32;
                                p.vpp = vpp;
                                p.micro_batch = mb;
                                p.recompute = recompute;
                                p.distributed_optimizer = dist;
                                p.sequence_parallel = sp(tp);
                                p.schedule = if vpp > 1 {
                                    Schedule::Interleaved
                                } else {
                                    Schedule::OneFOneB
                                };
                                p.first_stage_layers = first;
                                p.last_stage_layers = last;
                                if !same_layout(&j.parallel, bp) {
                                    out.push(j);
                                }
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
fn simulate_det(
    job: &Job,
    kernel_table: &Option<KernelTable>,
) -> Result<prism_core::SimResult, SimError> {
    let opts = SimOptions {
        mode: Mode::Reduced,
        kernel_table: kernel_table.clone(),
        ..SimOptions::default()
    };
    match prism_core::simulate(job, &opts) {
        Err(SimError::Asymmetric(_)) => prism_core::simulate(
            job,
            &SimOptions {
                mode: Mode::Full,
                ..opts
            },
        ),
        r => r,
    }
}

/// Where the slow GPUs of one candidate placement sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
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
    const ALL: [Placement; 5] = [
        Placement::TpGroup,
        Placement::PipelineStage,
        Placement::DpReplica,
        Placement::Spread,
        Placement::LeastLoadedStage,
    ];

    fn name(self) -> &'static str {
        match self {
            Placement::TpGroup => "tp-group",
            Placement::PipelineStage => "pipeline-stage",
            Placement::DpReplica => "dp-replica",
            Placement::Spread => "spread",
            Placement::LeastLoadedStage => "least-loaded-stage",
        }
    }

    fn description(self) -> &'static str {
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
    fn order(self, l: &Layout, stages_by_load: &[u32]) -> Vec<u32> {
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
                let size = l.stage_size();
                for &s in stages_by_load {
                    out.extend(s * size..(s + 1) * size);
                }
            }
        }
        out
    }
}

/// One simulated placement of the slow GPUs.
#[derive(Clone, Debug)]
struct PlacementRun {
    placement: Placement,
    /// The slow ranks, ascending.
    ranks: Vec<u32>,
    iteration_s: f64,
    /// An earlier placement with the same slow ranks.
    same_as: Option<Placement>,
}

/// Placements of slow GPUs in the job's own layout.
#[derive(Clone, Debug)]
struct SlowGpuAnalysis {
    job: Job,
    slow_gpus: usize,
    slowdown: f64,
    /// Iteration time with no slow GPU (`Mode::Full`, unperturbed).
    baseline_s: f64,
    /// Mean kernel time per GPU of each stage, in the unperturbed run.
    stage_compute_s: Vec<f64>,
    least_loaded_stage: u32,
    runs: Vec<PlacementRun>,
    best: usize,
    worst: usize,
    spread: usize,
}

impl SlowGpuAnalysis {
    /// How much faster the best placement is than `other`, percent.
    fn gain_pct(&self, other: usize) -> f64 {
        100.0 * (self.runs[other].iteration_s / self.runs[self.best].iteration_s - 1.0)
    }
}

/// Number of slow GPUs asked for (`--slow-gpus` or `--slow-fraction`) on `ranks` GPUs.
fn slow_gpu_count(args: &ExploreArgs, ranks: u64) -> Result<Option<usize>> {
    let n = match (args.slow_gpus, args.slow_fraction) {
        (Some(n), _) => n,
        (None, Some(f)) => {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--slow-fraction must be in (0, 1] (got {f})");
            }
            ((f * ranks as f64 - 1e-9).ceil() as u64).max(1)
        }
        (None, None) => return Ok(None),
    };
    if n == 0 || n > ranks {
        bail!("--slow-gpus {n} must be between 1 and the job's {ranks} GPUs");
    }
    if !(args.slowdown.is_finite() && args.slowdown >= 1.0) {
        bail!(
            "--slowdown must be a finite factor of at least 1 (got {})",
            args.slowdown
        );
    }
    Ok(Some(n as usize))
}

/// Simulates every placement of `slow_gpus` GPUs, `slowdown` times slower, in `job`'s layout.
fn analyse_slow_gpus(
    job: &Job,
    slow_gpus: usize,
    slowdown: f64,
    kernel_table: &Option<KernelTable>,
) -> Result<SlowGpuAnalysis> {
    use rayon::prelude::*;
    job.validate().map_err(|e| {
        anyhow::anyhow!(
            "--slow-gpus compares placements in the job's own layout, which is invalid: {e}"
        )
    })?;
    let l = Layout::new(job);
    let opts = SimOptions {
        mode: Mode::Full,
        kernel_table: kernel_table.clone(),
        ..SimOptions::default()
    };
    let base = prism_core::simulate(job, &opts).context("simulation of the job's layout failed")?;
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
            let o = SimOptions {
                perturbation: Some(Perturbation {
                    rank_factor,
                    ..Perturbation::default()
                }),
                ..opts.clone()
            };
            prism_core::simulate(job, &o).map(|r| r.summary.iteration_time_s)
        })
        .collect::<Result<Vec<f64>, _>>()
        .context("simulation with slow GPUs failed")?;
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

fn slow_gpu_json(a: &SlowGpuAnalysis) -> Value {
    let p = &a.job.parallel;
    let placements: Vec<Value> = a
        .runs
        .iter()
        .map(|r| {
            json!({
                "placement": r.placement.name(),
                "description": r.placement.description(),
                "slow_ranks": r.ranks,
                "iteration_time_s": r.iteration_s,
                "slowdown_pct": 100.0 * (r.iteration_s / a.baseline_s - 1.0),
                "same_gpus_as": r.same_as.map(Placement::name),
            })
        })
        .collect();
    json!({
        "slow_gpus": a.slow_gpus,
        "num_gpus": a.job.num_gpus(),
        "slowdown": a.slowdown,
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "cp": p.cp,
        "baseline_iteration_time_s": a.baseline_s,
        "stage_compute_s": a.stage_compute_s,
        "least_loaded_stage": a.least_loaded_stage,
        "placements": placements,
        "best": a.runs[a.best].placement.name(),
        "worst": a.runs[a.worst].placement.name(),
        "gain_vs_worst_pct": a.gain_pct(a.worst),
        "gain_vs_spread_pct": a.gain_pct(a.spread),
    })
}

/// `0-3, 8, 12-13`: ranks, runs collapsed.
fn rank_list(ranks: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    if parts.len() > 8 {
        let more = parts.len() - 8;
        parts.truncate(8);
        parts.push(format!("... ({more} more runs)"));
    }
    parts.join(", ")
}

fn print_slow_gpus(a: &SlowGpuAnalysis) {
    let p = &a.job.parallel;
    println!();
    println!(
        "  Slow GPUs: {} of {} with {:.2}x kernel time, in the job's layout (tp {} pp {} dp {} cp {}); no slow GPU: {:.4} s",
        a.slow_gpus,
        a.job.num_gpus(),
        a.slowdown,
        p.tp,
        p.pp,
        p.dp,
        p.cp,
        a.baseline_s
    );
    let stages: Vec<String> = a
        .stage_compute_s
        .iter()
        .map(|s| format!("{s:.4}"))
        .collect();
    println!(
        "  kernel time per GPU by stage: {} s; least loaded: stage {}",
        stages.join(", "),
        a.least_loaded_stage
    );
    println!();
    println!(
        "  {:<20} {:<38} {:>11} {:>8}  slow ranks",
        "placement", "where", "iteration s", "vs none"
    );
    for (i, r) in a.runs.iter().enumerate() {
        print!(
            "  {:<20} {:<38} {:>11.4} {:>+7.2}%  {}",
            r.placement.name(),
            r.placement.description(),
            r.iteration_s,
            100.0 * (r.iteration_s / a.baseline_s - 1.0),
            rank_list(&r.ranks)
        );
        if let Some(q) = r.same_as {
            print!(" (same GPUs as {})", q.name());
        }
        if i == a.best {
            print!("  <- best");
        }
        println!();
    }
    println!(
        "  best: {}, {:.2}% faster than the worst ({}) and {:.2}% faster than spreading them evenly",
        a.runs[a.best].placement.name(),
        a.gain_pct(a.worst),
        a.runs[a.worst].placement.name(),
        a.gain_pct(a.spread)
    );
}

fn progress(len: usize, prefix: &'static str, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len as u64).with_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{prefix}} [{{bar:30}}] {{pos}}/{{len}} {what} {{elapsed}} (eta {{eta}})"
        ))
        .expect("template")
        .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(args: &ExploreArgs) -> Result<()> {
    use rayon::prelude::*;
    if args.samples > 100_000 {
        bail!("--samples must be at most 100000");
    }
    if args.max_candidates == 0 {
        bail!("--max-candidates must be at least 1");
    }
    let loaded = match &args.job {
        Some(p) => prism_io::jobfile::load_job_file(p, &args.sets)?,
        None => prism_io::jobfile::default_job(&args.sets)?,
    };
    let mut base = loaded.job.clone();
    if let Some(n) = args.gpus {
        let per = base.cluster.gpus_per_node as u64;
        if n == 0 || !n.is_multiple_of(per) {
            bail!(
                "--gpus {n} must be a positive multiple of cluster.gpus_per_node ({per}): whole nodes only"
            );
        }
        base.cluster.nodes = u32::try_from(n / per).context("--gpus: too many nodes")?;
        // The job's own layout may not fit the new count; it stays a candidate and is
        // filtered like any other.
        let mp = base.parallel.tp as u64 * base.parallel.pp as u64 * base.parallel.cp as u64;
        if n.is_multiple_of(mp) {
            base.parallel.dp = (n / mp) as u32;
        }
    }
    let kernel_table = match &loaded.kernel_table {
        Some(path) => Some(prism_io::kernel_table::read_kernel_table(path)?),
        None => None,
    };
    // 5 (first, so a bad request fails fast). Slow-GPU placements in the job's own layout.
    let slow = match slow_gpu_count(args, base.num_gpus())? {
        Some(n) => Some(analyse_slow_gpus(&base, n, args.slowdown, &kernel_table)?),
        None => None,
    };
    // 1. Enumerate and filter.
    let capacity = base.cluster.gpu.hbm_gib * GIB;
    let all = enumerate(&base);
    let mut counts = Counts {
        enumerated: all.len(),
        ..Counts::default()
    };
    let mut feasible: Vec<(Job, u64, bool)> = Vec::new();
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
        feasible.push((j, peak, i == 0));
    }
    if feasible.is_empty() {
        bail!(
            "no feasible layout: {} enumerated, {} break a job rule, {} do not fit in {:.0} GiB per GPU",
            counts.enumerated,
            counts.invalid,
            counts.out_of_memory,
            base.cluster.gpu.hbm_gib
        );
    }
    if feasible.len() > args.max_candidates {
        bail!(
            "{} feasible layouts exceed --max-candidates {}; raise it, or narrow the search (fewer GPUs)",
            feasible.len(),
            args.max_candidates
        );
    }
    // 2. Deterministic simulation of every candidate.
    let bar = progress(feasible.len(), "explore", "layouts");
    let mut evaluated: Vec<Evaluated> = feasible
        .into_par_iter()
        .map(|(job, peak_bytes, is_job_config)| {
            let r = simulate_det(&job, &kernel_table);
            bar.inc(1);
            let r = r.with_context(|| {
                let p = &job.parallel;
                format!(
                    "simulation failed for tp {} pp {} cp {} dp {} vpp {} micro-batch {}",
                    p.tp, p.pp, p.cp, p.dp, p.vpp, p.micro_batch
                )
            })?;
            let s = &r.summary;
            Ok(Evaluated {
                iteration_s: s.iteration_time_s,
                mfu: s.mfu,
                tokens_per_s: s.tokens_per_s,
                peak_bytes,
                is_job_config,
                sampled: None,
                job,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    bar.finish_and_clear();
    // Stable sort: ties keep enumeration order, so the output is deterministic.
    evaluated.sort_by(|a, b| a.iteration_s.total_cmp(&b.iteration_s));
    // 3. Monte Carlo for the fastest candidates.
    let v = &crate::predict::variability_of(&loaded)?;
    let has_variability = *v != Variability::default();
    let seed = args.seed.or(loaded.variability_seed).unwrap_or(1);
    let sampled = args.samples > 0 && has_variability;
    if args.samples > 0 && !has_variability && !args.json {
        eprintln!(
            "note: the job has no [variability] section, so every sample would equal the \
             deterministic time; --samples ignored"
        );
    }
    let mut step_method: Option<String> = None;
    let mut sampled_count = 0;
    if sampled {
        let k = match args.sample_top {
            0 => evaluated.len(),
            n => evaluated.len().min(n),
        };
        sampled_count = k;
        let samples = args.samples as u64;
        let bar = progress(k * args.samples, "explore", "Monte Carlo iterations");
        let base_opts = SimOptions {
            kernel_table: kernel_table.clone(),
            ..SimOptions::default()
        };
        // Sample i of every candidate draws the same per-GPU speeds, jitter stream and
        // communication regime (common random numbers); `clusters = samples` gives every
        // sample its own cluster.
        let runs: Vec<(Vec<f64>, String)> = evaluated[..k]
            .par_iter()
            .map(|e| {
                crate::predict::sample_steps(
                    &e.job,
                    v,
                    seed,
                    samples,
                    samples,
                    args.per_rank,
                    true,
                    &base_opts,
                    &bar,
                )
                // The step model is not needed once the samples are drawn.
                .map(|(steps, method, _model)| (steps, method))
                .with_context(|| format!("Monte Carlo simulation failed for {}", label(&e.job)))
            })
            .collect::<Result<Vec<_>>>()?;
        bar.finish_and_clear();
        let mut methods: Vec<String> = Vec::new();
        for (c, (times, method)) in runs.into_iter().enumerate() {
            if !methods.contains(&method) {
                methods.push(method);
            }
            let mut sorted = times;
            sorted.sort_by(f64::total_cmp);
            let s = stats::summarize(&sorted);
            evaluated[c].sampled = Some(Sampled {
                mean: s.mean,
                p50: s.p50,
                p95: s.p95,
                p99: s.p99,
            });
        }
        step_method = Some(methods.join("; "));
    }
    // 4. Rank: sampled candidates by the objective, then the rest by deterministic time.
    let objective = args.objective;
    evaluated.sort_by(|a, b| {
        b.sampled
            .is_some()
            .cmp(&a.sampled.is_some())
            .then(a.objective(objective).total_cmp(&b.objective(objective)))
    });
    let feasible_count = evaluated.len();
    let shown = if args.top == 0 {
        evaluated.len()
    } else {
        args.top.min(evaluated.len())
    };
    let inversions = if sampled {
        p99_inversions(&evaluated)
    } else {
        Vec::new()
    };
    if args.json {
        let ranking: Vec<Value> = evaluated[..shown]
            .iter()
            .enumerate()
            .map(|(i, e)| candidate_json(i + 1, e, objective))
            .collect();
        let inv: Vec<Value> = inversions
            .iter()
            .map(|x| {
                json!({"faster_on_average": x.a + 1, "faster_at_p99": x.b + 1,
                       "mean_gain_pct": x.mean_gain_pct, "p99_loss_pct": x.p99_loss_pct})
            })
            .collect();
        let mut out = json!({
            "name": base.name,
            "num_gpus": base.num_gpus(),
            "global_batch": base.training.global_batch,
            "objective": objective.name(),
            "samples": if sampled { args.samples } else { 0 },
            "sampled_candidates": sampled_count,
            "step_method": step_method,
            "seed": seed,
            "candidates_evaluated": counts.enumerated,
            "rejected_invalid": counts.invalid,
            "rejected_out_of_memory": counts.out_of_memory,
            "feasible": feasible_count,
            "ranking": ranking,
            "p99_inversions": inv,
        });
        if let Some(a) = &slow {
            out["slow_gpu_placement"] = slow_gpu_json(a);
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_table(
        &base,
        &loaded.source,
        counts,
        &evaluated[..shown],
        feasible_count,
        objective,
        step_method
            .as_deref()
            .map(|m| (args.samples, sampled_count, m)),
    );
    if !inversions.is_empty() {
        println!();
        println!("  where the p99 ranking differs from the mean ranking:");
        for x in inversions.iter().take(10) {
            println!(
                "    configuration #{} ({}) is {:.1}% faster on average but {:.1}% slower at p99 than #{} ({})",
                x.a + 1,
                label(&evaluated[x.a].job),
                x.mean_gain_pct,
                x.p99_loss_pct,
                x.b + 1,
                label(&evaluated[x.b].job),
            );
        }
        if inversions.len() > 10 {
            println!("    ... and {} more (see --json)", inversions.len() - 10);
        }
    }
    if let Some(a) = &slow {
        print_slow_gpus(a);
    }
    Ok(())
}

/// A pair of sampled candidates (indices into the ranking) where `a` has the lower mean but
/// the higher p99.
struct Inversion {
    a: usize,
    b: usize,
    mean_gain_pct: f64,
    p99_loss_pct: f64,
}

fn p99_inversions(ranked: &[Evaluated]) -> Vec<Inversion> {
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

fn label(job: &Job) -> String {
    let p = &job.parallel;
    format!(
        "tp {} pp {} dp {} cp {} vpp {} mb {} recompute {} dist-opt {}",
        p.tp,
        p.pp,
        p.dp,
        p.cp,
        p.vpp,
        p.micro_batch,
        recompute_name(p.recompute),
        if p.distributed_optimizer { "on" } else { "off" }
    )
}

/// `--set` arguments that select this layout in `prism simulate`.
fn set_args(job: &Job) -> Vec<String> {
    let p = &job.parallel;
    vec![
        format!("cluster.nodes={}", job.cluster.nodes),
        format!("parallel.tp={}", p.tp),
        format!("parallel.pp={}", p.pp),
        format!("parallel.cp={}", p.cp),
        format!("parallel.dp={}", p.dp),
        format!("parallel.vpp={}", p.vpp),
        format!("parallel.micro_batch={}", p.micro_batch),
        format!("parallel.recompute={}", recompute_name(p.recompute)),
        format!("parallel.distributed_optimizer={}", p.distributed_optimizer),
        format!("parallel.sequence_parallel={}", p.sequence_parallel),
        format!("parallel.schedule={}", schedule_name(p.schedule)),
    ]
}

fn candidate_json(rank: usize, e: &Evaluated, objective: Objective) -> Value {
    let p = &e.job.parallel;
    let mut v = json!({
        "rank": rank,
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "cp": p.cp,
        "ep": p.ep,
        "vpp": p.vpp,
        "micro_batch": p.micro_batch,
        "micro_batches": e.job.micro_batches(),
        "schedule": schedule_name(p.schedule),
        "recompute": recompute_name(p.recompute),
        "distributed_optimizer": p.distributed_optimizer,
        "sequence_parallel": p.sequence_parallel,
        "first_stage_layers": p.first_stage_layers,
        "last_stage_layers": p.last_stage_layers,
        "iteration_time_s": e.iteration_s,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "peak_memory_bytes": e.peak_bytes,
        "peak_memory_gib": e.peak_bytes as f64 / GIB,
        "objective_s": e.objective(objective),
        "is_job_config": e.is_job_config,
        "set": set_args(&e.job),
    });
    if let Some(s) = e.sampled {
        v["sampled"] = json!({"mean": s.mean, "p50": s.p50, "p95": s.p95, "p99": s.p99});
    }
    v
}

fn print_table(
    base: &Job,
    source: &str,
    counts: Counts,
    rows: &[Evaluated],
    feasible: usize,
    objective: Objective,
    // Monte Carlo iterations per sampled layout and how they were simulated.
    sampling: Option<(usize, usize, &str)>,
) {
    println!("Prism explore: {}  ({source})", base.name);
    println!(
        "  {} x {} GPUs ({} nodes), global batch {} x {} tokens; objective: {} iteration time{}",
        base.num_gpus(),
        base.cluster.gpu.name,
        base.cluster.nodes,
        base.training.global_batch,
        base.model.seq_len,
        objective.name(),
        match sampling {
            Some((k, n, method)) =>
                format!(" ({k} Monte Carlo iterations for the {n} fastest; {method})"),
            None => " (deterministic)".into(),
        }
    );
    println!(
        "  {} layouts enumerated: {} break a job rule, {} do not fit in {:.0} GiB, {feasible} feasible and simulated",
        counts.enumerated, counts.invalid, counts.out_of_memory, base.cluster.gpu.hbm_gib
    );
    println!();
    let q = sampling.is_some();
    print!(
        "  {:>4} {:>3} {:>3} {:>5} {:>3} {:>3} {:>3} {:>9} {:>8} {:>11} {:>6} {:>8}",
        "rank",
        "tp",
        "pp",
        "dp",
        "cp",
        "vpp",
        "mb",
        "recompute",
        "dist-opt",
        "iteration s",
        "MFU",
        "mem GiB"
    );
    if q {
        print!(" {:>8} {:>8} {:>8}", "mean s", "p95 s", "p99 s");
    }
    println!();
    for (i, e) in rows.iter().enumerate() {
        let p = &e.job.parallel;
        print!(
            "  {:>4} {:>3} {:>3} {:>5} {:>3} {:>3} {:>3} {:>9} {:>8} {:>11.4} {:>5.1}% {:>8.1}",
            i + 1,
            p.tp,
            p.pp,
            p.dp,
            p.cp,
            p.vpp,
            p.micro_batch,
            recompute_name(p.recompute),
            if p.distributed_optimizer { "on" } else { "off" },
            e.iteration_s,
            100.0 * e.mfu,
            e.peak_bytes as f64 / GIB,
        );
        if q {
            match e.sampled {
                Some(s) => print!(" {:>8.4} {:>8.4} {:>8.4}", s.mean, s.p95, s.p99),
                None => print!(" {:>8} {:>8} {:>8}", "-", "-", "-"),
            }
        }
        if e.is_job_config {
            print!("  <- job");
        }
        if p.first_stage_layers.is_some() || p.last_stage_layers.is_some() {
            print!("  (uneven split)");
        }
        println!();
    }
    if !rows.iter().any(|e| e.is_job_config) {
        println!("  (the job's own layout is not among these rows)");
    }
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
    fn rank_lists_collapse_runs() {
        assert_eq!(rank_list(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(rank_list(&[3]), "3");
        let many: Vec<u32> = (0..40).map(|i| 2 * i).collect();
        assert!(rank_list(&many).ends_with("... (32 more runs)"));
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
