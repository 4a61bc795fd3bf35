//! `prism explore`: searches the parallel layouts of a job for the fastest one. The search is
//! [`prism_predict::explore`] (enumerate, evaluate, sample, rank, slow-GPU placements); this
//! module parses the arguments, calls it with progress bars and prints the table or the JSON.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::job::Job;
use prism_io::report_json::{recompute_name, schedule_name};
use prism_predict::explore::{
    self as search, Counts, Evaluated, GIB, Objective, Placement, SampleOptions, SlowGpuAnalysis,
};
use prism_predict::variability::Variability;
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
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Mean)]
    objective: ObjectiveArg,
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
    /// Clusters each candidate's samples are spread over: each cluster draws its GPUs'
    /// persistent speeds once, as in `prism predict` (default: one cluster per 20 samples;
    /// `--clusters` equal to `--samples` gives every sample its own GPUs).
    #[arg(long)]
    clusters: Option<u64>,
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

/// `--objective` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ObjectiveArg {
    Mean,
    P95,
    P99,
}

impl From<ObjectiveArg> for Objective {
    fn from(o: ObjectiveArg) -> Self {
        match o {
            ObjectiveArg::Mean => Objective::Mean,
            ObjectiveArg::P95 => Objective::P95,
            ObjectiveArg::P99 => Objective::P99,
        }
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

fn print_slow_gpus(a: &SlowGpuAnalysis) -> Result<()> {
    let p = &a.job.parallel;
    outln!()?;
    outln!(
        "  Slow GPUs: {} of {} with {:.2}x kernel time, in the job's layout (tp {} pp {} dp {} cp {}); no slow GPU: {:.4} s",
        a.slow_gpus,
        a.job.num_gpus(),
        a.slowdown,
        p.tp,
        p.pp,
        p.dp,
        p.cp,
        a.baseline_s
    )?;
    let stages: Vec<String> = a
        .stage_compute_s
        .iter()
        .map(|s| format!("{s:.4}"))
        .collect();
    outln!(
        "  kernel time per GPU by stage: {} s; least loaded: stage {}",
        stages.join(", "),
        a.least_loaded_stage
    )?;
    outln!()?;
    outln!(
        "  {:<20} {:<38} {:>11} {:>8}  slow ranks",
        "placement",
        "where",
        "iteration s",
        "vs none"
    )?;
    for (i, r) in a.runs.iter().enumerate() {
        out!(
            "  {:<20} {:<38} {:>11.4} {:>+7.2}%  {}",
            r.placement.name(),
            r.placement.description(),
            r.iteration_s,
            100.0 * (r.iteration_s / a.baseline_s - 1.0),
            rank_list(&r.ranks)
        )?;
        if let Some(q) = r.same_as {
            out!(" (same GPUs as {})", q.name())?;
        }
        if i == a.best {
            out!("  <- best")?;
        }
        outln!()?;
    }
    outln!(
        "  best: {}, {:.2}% faster than the worst ({}) and {:.2}% faster than spreading them evenly",
        a.runs[a.best].placement.name(),
        a.gain_pct(a.worst),
        a.runs[a.worst].placement.name(),
        a.gain_pct(a.spread)
    )?;
    Ok(())
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

pub fn run(args: &ExploreArgs) -> Result<()> {
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
        Some(path) => Some(prism_io::kernel_table::read_kernel_table_for(path, &base)?),
        None => None,
    };
    // 5 (first, so a bad request fails fast). Slow-GPU placements in the job's own layout.
    let slow = match slow_gpu_count(args, base.num_gpus())? {
        Some(n) => Some(search::analyse_slow_gpus(
            &base,
            n,
            args.slowdown,
            &kernel_table,
        )?),
        None => None,
    };
    // 1. Enumerate and filter.
    let (feasible, counts) = search::feasible(&base, args.max_candidates)?;
    // 2. Deterministic simulation of every candidate.
    let bar = progress(feasible.len(), "explore", "layouts");
    let mut evaluated = search::evaluate(feasible, &kernel_table, &|n| bar.inc(n))?;
    bar.finish_and_clear();
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
        let opts = SampleOptions {
            samples,
            clusters: args.clusters.unwrap_or(
                prism_predict::predict::PredictOptions::default_clusters(samples),
            ),
            seed,
            per_rank: args.per_rank,
        };
        let bar = progress(k * args.samples, "explore", "Monte Carlo iterations");
        step_method = Some(search::sample(
            &mut evaluated[..k],
            v,
            &opts,
            &kernel_table,
            &label,
            &|n| bar.inc(n),
        )?);
        bar.finish_and_clear();
    }
    // 4. Rank: sampled candidates by the objective, then the rest by deterministic time.
    let objective = Objective::from(args.objective);
    search::rank(&mut evaluated, objective);
    let feasible_count = evaluated.len();
    let shown = if args.top == 0 {
        evaluated.len()
    } else {
        args.top.min(evaluated.len())
    };
    let inversions = if sampled {
        search::p99_inversions(&evaluated)
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
            "rejected_too_large": counts.too_large,
            "feasible": feasible_count,
            "ranking": ranking,
            "p99_inversions": inv,
        });
        if let Some(a) = &slow {
            out["slow_gpu_placement"] = slow_gpu_json(a);
        }
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
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
    )?;
    if !inversions.is_empty() {
        outln!()?;
        outln!("  where the p99 ranking differs from the mean ranking:")?;
        for x in inversions.iter().take(10) {
            outln!(
                "    configuration #{} ({}) is {:.1}% faster on average but {:.1}% slower at p99 than #{} ({})",
                x.a + 1,
                label(&evaluated[x.a].job),
                x.mean_gain_pct,
                x.p99_loss_pct,
                x.b + 1,
                label(&evaluated[x.b].job),
            )?;
        }
        if inversions.len() > 10 {
            outln!("    ... and {} more (see --json)", inversions.len() - 10)?;
        }
    }
    if let Some(a) = &slow {
        print_slow_gpus(a)?;
    }
    Ok(())
}

fn label(job: &Job) -> String {
    let p = &job.parallel;
    let form = if p.cp > 1 {
        format!(" ({})", p.cp_comm_type.name())
    } else {
        String::new()
    };
    format!(
        "tp {} pp {} dp {} cp {}{form} vpp {} mb {} recompute {} dist-opt {}",
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
        format!("parallel.cp_comm_type={}", p.cp_comm_type.name()),
        format!("parallel.dp={}", p.dp),
        format!("parallel.vpp={}", p.vpp),
        format!("parallel.micro_batch={}", p.micro_batch),
        format!("parallel.recompute={}", recompute_name(p.recompute)),
        format!("parallel.distributed_optimizer={}", p.distributed_optimizer),
        format!("parallel.sequence_parallel={}", p.sequence_parallel),
        format!("parallel.schedule={}", schedule_name(p.schedule)),
        format!(
            "parallel.pipeline_layout={}",
            p.pipeline_layout
                .as_ref()
                .map_or(String::new(), |l| l.text.clone())
        ),
        format!(
            "parallel.first_stage_layers={}",
            p.first_stage_layers
                .map_or(String::new(), |x| x.to_string())
        ),
        format!(
            "parallel.last_stage_layers={}",
            p.last_stage_layers.map_or(String::new(), |x| x.to_string())
        ),
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
        "cp_comm_type": p.cp_comm_type.name(),
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
        "pipeline_layout": p.pipeline_layout.as_ref().map(|l| l.text.clone()),
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
) -> Result<()> {
    outln!("Prism explore: {}  ({source})", base.name)?;
    outln!(
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
    )?;
    outln!(
        "  {} layouts enumerated: {} break a job rule, {} do not fit in {:.0} GiB, {} exceed the graph size limit, {feasible} feasible and simulated",
        counts.enumerated,
        counts.invalid,
        counts.out_of_memory,
        base.cluster.gpu.hbm_gib,
        counts.too_large
    )?;
    outln!()?;
    let q = sampling.is_some();
    out!(
        "  {:>4} {:>3} {:>3} {:>5} {:>3} {:>10} {:>3} {:>3} {:>9} {:>8} {:>11} {:>6} {:>8}",
        "rank",
        "tp",
        "pp",
        "dp",
        "cp",
        "cp form",
        "vpp",
        "mb",
        "recompute",
        "dist-opt",
        "iteration s",
        "MFU",
        "mem GiB"
    )?;
    if q {
        out!(" {:>8} {:>8} {:>8}", "mean s", "p95 s", "p99 s")?;
    }
    outln!()?;
    for (i, e) in rows.iter().enumerate() {
        let p = &e.job.parallel;
        out!(
            "  {:>4} {:>3} {:>3} {:>5} {:>3} {:>10} {:>3} {:>3} {:>9} {:>8} {:>11.4} {:>5.1}% {:>8.1}",
            i + 1,
            p.tp,
            p.pp,
            p.dp,
            p.cp,
            if p.cp > 1 { p.cp_comm_type.name() } else { "-" },
            p.vpp,
            p.micro_batch,
            recompute_name(p.recompute),
            if p.distributed_optimizer { "on" } else { "off" },
            e.iteration_s,
            100.0 * e.mfu,
            e.peak_bytes as f64 / GIB,
        )?;
        if q {
            match e.sampled {
                Some(s) => out!(" {:>8.4} {:>8.4} {:>8.4}", s.mean, s.p95, s.p99)?,
                None => out!(" {:>8} {:>8} {:>8}", "-", "-", "-")?,
            }
        }
        if e.is_job_config {
            out!("  <- job")?;
        }
        if p.first_stage_layers.is_some() || p.last_stage_layers.is_some() {
            out!("  (uneven split)")?;
        }
        if let Some(l) = &p.pipeline_layout {
            out!("  (layout {})", l.text)?;
        }
        outln!()?;
    }
    if !rows.iter().any(|e| e.is_job_config) {
        outln!("  (the job's own layout is not among these rows)")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_collapse_runs() {
        assert_eq!(rank_list(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(rank_list(&[3]), "3");
        let many: Vec<u32> = (0..40).map(|i| 2 * i).collect();
        assert!(rank_list(&many).ends_with("... (32 more runs)"));
    }
}
