//! `prism predict`: training time as a distribution, with a probabilistic guarantee. The
//! computation is [`prism_predict::predict::predict`]; this module parses, calls and prints.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::engine::SimOptions;
use prism_predict::predict::{P95Attribution, PredictOptions, TOP_CONTRIBUTORS};
use prism_predict::stats;
use prism_predict::variability::Variability;

#[derive(Debug, clap::Args)]
pub struct PredictArgs {
    /// Job file (default: the embedded example).
    job: Option<PathBuf>,
    /// Override a job key (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Tokens to train on (e.g. 15e12).
    #[arg(long)]
    tokens: f64,
    /// Monte Carlo step-time samples (each simulates every rank).
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Clusters the step samples are spread over: each cluster draws its GPUs' persistent speeds
    /// once; run r trains on cluster r mod clusters with that cluster's step samples
    /// (default: one cluster per 20 samples).
    #[arg(long)]
    clusters: Option<u64>,
    /// End-to-end run samples drawn from the step-time samples.
    #[arg(long, default_value_t = 1000)]
    runs: usize,
    /// Probability of the guarantee "P(T <= t) >= q".
    #[arg(long, default_value_t = 0.95)]
    quantile: f64,
    /// Confidence of the guarantee's bound.
    #[arg(long, default_value_t = 0.95)]
    confidence: f64,
    /// Seed (default: `[variability] seed`, else 1).
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Simulate even when a stage does not fit in GPU memory.
    #[arg(long)]
    allow_oom: bool,
    /// Simulate every rank of every sample with the event-driven engine (network contention
    /// re-simulated per sample) instead of the max-plus step model.
    #[arg(long)]
    per_rank: bool,
    /// Evaluate every data-parallel replica in every step-model sample. By default a cluster's
    /// samples skip the replicas that provably cannot change the step time (bounds from two
    /// pilot samples of the cluster; the same result but for probability below 1e-17 per
    /// replica and value); this switch is for timing and checking that shortcut.
    #[arg(long)]
    no_prune: bool,
    /// Draw every lane of every lane race exactly. By default, when one block shape in which
    /// the lanes of a tensor-parallel group race (a weight-gradient GEMM overlapping the
    /// group's collective) occurs at least 262,144 times per sample, each sample draws 65,536
    /// of them exactly and every block picks one at random: each block exactly distributed,
    /// blocks of one sample sharing the pool (bound in docs/predict.md, "Pooled lane races")
    #[arg(long)]
    no_pool: bool,
    /// Write an SVG of the step-time and training-time CDFs with the guarantee marked.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

/// The job's variability, with its `prism fit` table applied when `[variability.distributions]`
/// names one.
pub(crate) fn variability_of(loaded: &prism_io::jobfile::LoadedJob) -> Result<Variability> {
    Ok(match &loaded.dist_table {
        Some(path) => {
            let table = prism_io::samples::read_dist_table(path)?;
            prism_predict::predict::with_fit_table(
                &loaded.job,
                loaded.variability.clone(),
                &table,
                &path.display().to_string(),
            )?
        }
        None => loaded.variability.clone(),
    })
}

pub fn run(args: &PredictArgs) -> Result<()> {
    if !(args.tokens.is_finite() && args.tokens > 0.0) {
        bail!(
            "--tokens must be a positive number of tokens (got {})",
            args.tokens
        );
    }
    let open_unit = |x: f64| x > 0.0 && x < 1.0;
    if !open_unit(args.quantile) || !open_unit(args.confidence) {
        bail!("--quantile and --confidence must be strictly between 0 and 1");
    }
    if args.samples == 0 || args.samples > 100_000 || args.runs == 0 || args.runs > 1_000_000 {
        bail!("--samples must be in 1..=100000 and --runs in 1..=1000000");
    }
    let loaded = match &args.job {
        Some(p) => prism_io::jobfile::load_job_file(p, &args.sets)?,
        None => prism_io::jobfile::default_job(&args.sets)?,
    };
    let job = &loaded.job;
    if !args.allow_oom {
        crate::check_memory(job, &loaded.source)?;
    }
    let v = &variability_of(&loaded)?;
    let seed = args.seed.or(loaded.variability_seed).unwrap_or(1);
    // Step samples first, then end-to-end runs.
    let bar = indicatif::ProgressBar::new(args.samples as u64 + args.runs as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} samples, then runs {elapsed} (eta {eta})",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    bar.set_prefix("predict");
    let kernel_table = match &loaded.kernel_table {
        Some(path) => Some(prism_io::kernel_table::read_kernel_table_for(path, job)?),
        None => None,
    };
    let base_opts = SimOptions {
        kernel_table,
        ..SimOptions::default()
    };
    let opts = PredictOptions {
        tokens: args.tokens,
        samples: args.samples as u64,
        clusters: args
            .clusters
            .unwrap_or(PredictOptions::default_clusters(args.samples as u64)),
        runs: args.runs as u64,
        quantile: args.quantile,
        confidence: args.confidence,
        seed,
        per_rank: args.per_rank,
        prune: !args.no_prune,
        pool: !args.no_pool,
    };
    let pr = prism_predict::predict::predict(job, v, &opts, &base_opts, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    let (steps, totals, step, total) = (&pr.steps, &pr.totals, &pr.step, &pr.total);
    let (guarantee, step_guarantee) = (pr.guarantee_s, pr.step_guarantee_s);
    let (interruptions, ratio, iterations) = (pr.interruptions, pr.effective_ratio, pr.iterations);
    let (method, clusters, p95_attr) = (&pr.method, pr.clusters, &pr.p95);
    if let Some(path) = &args.plot {
        let days: Vec<f64> = totals.iter().map(|t| t / 86400.0).collect();
        let mark = |t: Option<f64>, unit: &str, scale: f64| {
            t.map(|t| {
                (
                    t / scale,
                    args.quantile,
                    format!("P(T <= {:.3} {unit}) >= {}", t / scale, args.quantile),
                )
            })
        };
        let svg = prism_io::plot::cdfs_svg(&[
            prism_io::plot::CdfPanel {
                title: "step time",
                x_label: "seconds",
                sorted: steps,
                mark: mark(step_guarantee, "s", 1.0),
            },
            prism_io::plot::CdfPanel {
                title: "training time",
                x_label: "days",
                sorted: &days,
                mark: mark(guarantee, "days", 86400.0),
            },
        ])
        .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg)
            .with_context(|| format!("cannot write plot {}", path.display()))?;
    }
    let day = 86400.0;
    if args.json {
        let s5 = |s: &stats::Summary5, scale: f64| serde_json::json!({"mean": s.mean / scale, "p50": s.p50 / scale, "p90": s.p90 / scale, "p95": s.p95 / scale, "p99": s.p99 / scale, "min": s.min / scale, "max": s.max / scale});
        let v = serde_json::json!({
            "name": job.name, "num_gpus": job.num_gpus(), "tokens": args.tokens, "iterations": iterations,
            "samples": args.samples, "step_method": method,
            "clusters": clusters, "runs": args.runs, "seed": seed,
            "step_time_s": s5(step, 1.0),
            "training_time_days": s5(total, day),
            "expected_interruptions": interruptions,
            "effective_training_time_ratio": ratio,
            "guarantee": {"quantile": args.quantile, "confidence": args.confidence,
                          "training_time_days": guarantee.map(|t| t / day), "step_time_s": step_guarantee},
            "p95_attribution": attribution_json(p95_attr),
            "p95_attribution_sample": attribution_meta_json(p95_attr),
            "abandoned_runs": pr.abandoned_runs,
            "block_iterations": pr.block,
            "block_exact": pr.block_exact,
        });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    outln!(
        "Prism predict: {}  ({} GPUs, {:.3e} tokens = {} iterations)",
        job.name,
        job.num_gpus(),
        args.tokens,
        iterations
    )?;
    outln!(
        "  {} Monte Carlo iterations ({}) on {clusters} clusters of GPUs, {} end-to-end runs, seed {seed}",
        args.samples,
        method,
        args.runs
    )?;
    outln!()?;
    outln!(
        "  step time (s)        mean {:.3}  p50 {:.3}  p90 {:.3}  p95 {:.3}  p99 {:.3}",
        step.mean,
        step.p50,
        step.p90,
        step.p95,
        step.p99
    )?;
    outln!(
        "  training time (days) mean {:.2}  p50 {:.2}  p90 {:.2}  p95 {:.2}  p99 {:.2}",
        total.mean / day,
        total.p50 / day,
        total.p90 / day,
        total.p95 / day,
        total.p99 / day
    )?;
    outln!(
        "  expected interruptions {interruptions:.1}; effective training time ratio {:.1}%",
        100.0 * ratio
    )?;
    if pr.abandoned_runs > 0 {
        outln!(
            "  did not complete: {} of {} runs abandoned (failures too frequent for training to \
             progress); the training time above covers the completed runs only",
            pr.abandoned_runs,
            args.runs
        )?;
    }
    if !pr.block_exact {
        outln!(
            "  runs played out in central-limit blocks of {} iterations (past {} per block)",
            pr.block,
            prism_predict::predict::EXACT_BLOCK_MAX
        )?;
    }
    match guarantee {
        Some(t) => outln!(
            "  guarantee: P(training time <= {:.2} days) >= {} (at {:.0}% confidence)",
            t / day,
            args.quantile,
            100.0 * args.confidence
        )?,
        None => outln!(
            "  guarantee: too few runs for a {:.0}%-confidence bound on the {} quantile; raise --runs",
            100.0 * args.confidence,
            args.quantile
        )?,
    }
    print_attribution(p95_attr)?;
    Ok(())
}

fn attribution_json(a: &P95Attribution) -> serde_json::Value {
    serde_json::Value::Array(
        a.top()
            .into_iter()
            .map(|(name, kind, t)| {
                serde_json::json!({"name": name, "kind": kind, "seconds": t, "share": a.share(t)})
            })
            .collect(),
    )
}

fn attribution_meta_json(a: &P95Attribution) -> serde_json::Value {
    serde_json::json!({"sample": a.sample, "step_time_s": a.step_s,
                       "path_s": a.path_s, "wait_s": a.wait_s,
                       "all_ranks_recorded": a.all_ranks, "method": a.method})
}

fn print_attribution(a: &P95Attribution) -> Result<()> {
    outln!()?;
    outln!(
        "  top {TOP_CONTRIBUTORS} contributors to the p95 step ({}): sample {}, step {:.3} s, path {:.3} s{}",
        a.method,
        a.sample,
        a.step_s,
        a.path_s,
        if a.all_ranks {
            ""
        } else {
            " (first DP replica of every stage recorded)"
        }
    )?;
    for (name, kind, t) in &a.ops {
        outln!(
            "    {:<28} {:<12} {:>9.4} s  {:>5.1}%",
            name,
            kind,
            t,
            100.0 * a.share(*t)
        )?;
    }
    let who: Vec<String> = a
        .who
        .iter()
        .map(|(name, _, t)| format!("{name} {:.1}%", 100.0 * a.share(*t)))
        .collect();
    outln!("    by rank: {}", who.join(", "))?;
    Ok(())
}
