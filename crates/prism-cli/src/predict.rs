//! `prism predict`: training time as a distribution, with a probabilistic guarantee. The
//! computation is [`prism_predict::predict::predict`]; this module parses, calls and prints.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::engine::SimOptions;
use prism_predict::coverage::{Coverage, Covered};
use prism_predict::guarantee::{NoBound, QuantileError};
use prism_predict::predict::{Guarantee, P95Attribution, PredictOptions, TOP_CONTRIBUTORS};
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
    #[arg(long, default_value_t = PredictOptions::DEFAULT_SAMPLES as usize)]
    samples: usize,
    /// Clusters the step samples are spread over: each cluster draws its GPUs' persistent speeds
    /// once; run r trains on cluster r mod clusters with that cluster's step samples. The
    /// guarantee's independent units (default: 1.6 x the fewest the guarantee needs, at least
    /// 100, at most one per sample).
    #[arg(long)]
    clusters: Option<u64>,
    /// End-to-end run samples drawn from the step-time samples (default: 10 per cluster, at
    /// least 1000).
    #[arg(long)]
    runs: Option<usize>,
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
    /// Check the guarantee's coverage instead of predicting once: N predictions with seeds
    /// seed..seed+N-1 and these settings against one reference run with 10x the clusters;
    /// prints the observed coverage with its exact binomial 95% interval, the median margin of
    /// the bound over the reference quantile, and the wall time.
    #[arg(long, value_name = "N")]
    check_coverage: Option<u64>,
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
    let samples = args.samples as u64;
    let clusters = (args.clusters).unwrap_or_else(|| {
        PredictOptions::predict_clusters(samples, args.quantile, args.confidence)
    });
    let runs = match args.runs {
        Some(r) => r as u64,
        None => PredictOptions::predict_runs(clusters.clamp(1, samples.max(1))),
    };
    if samples == 0 || samples > 100_000 || runs == 0 || runs > 1_000_000 {
        bail!("--samples must be in 1..=100000 and --runs in 1..=1000000");
    }
    if args.check_coverage.is_some_and(|n| n == 0 || n > 10_000) {
        bail!("--check-coverage must be in 1..=10000 seeds");
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
    let bar = indicatif::ProgressBar::new(samples + runs).with_style(
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
        samples,
        clusters,
        runs,
        quantile: args.quantile,
        confidence: args.confidence,
        seed,
        per_rank: args.per_rank,
        prune: !args.no_prune,
        pool: !args.no_pool,
    };
    if let Some(n) = args.check_coverage {
        let reference = prism_predict::coverage::reference_options(&opts, n);
        bar.set_length(n * (samples + runs) + reference.samples + reference.runs);
        let clock = std::time::Instant::now();
        let c = prism_predict::coverage::check_coverage(
            job,
            v,
            &opts,
            &base_opts,
            n,
            &|k| bar.inc(k),
            &|| clock.elapsed().as_secs_f64(),
        )?;
        bar.finish_and_clear();
        return print_coverage(job, &c, clock.elapsed().as_secs_f64(), args.json);
    }
    let pr = prism_predict::predict::predict(job, v, &opts, &base_opts, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    let (steps, totals, step, total) = (&pr.steps, &pr.totals, &pr.step, &pr.total);
    let guarantee = pr.guarantee.training_s.clone().ok();
    let step_guarantee = pr.guarantee.step_s.clone().ok();
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
            "samples": samples, "step_method": method,
            "clusters": clusters, "runs": runs, "seed": seed,
            "step_time_s": s5(step, 1.0),
            "training_time_days": s5(total, day),
            "step_time_s_error": errors_json(&pr.step_error, 1.0),
            "training_time_days_error": errors_json(&pr.total_error, day),
            "expected_interruptions": interruptions,
            "effective_training_time_ratio": ratio,
            "guarantee": guarantee_json(&pr.guarantee),
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
        samples,
        method,
        runs
    )?;
    outln!()?;
    outln!(
        "  step time (s)        mean {:.3}  {}",
        step.mean,
        quantiles_text(step, &pr.step_error, 1.0, 3)
    )?;
    outln!(
        "  training time (days) mean {:.2}  {}",
        total.mean / day,
        quantiles_text(total, &pr.total_error, day, 2)
    )?;
    outln!(
        "  (+- : Monte Carlo standard error, a bootstrap over the {clusters} independent clusters)"
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
            runs
        )?;
    }
    if !pr.block_exact {
        outln!(
            "  runs played out in central-limit blocks of {} iterations (past {} per block)",
            pr.block,
            prism_predict::predict::EXACT_BLOCK_MAX
        )?;
    }
    match &pr.guarantee.training_s {
        Ok(t) => outln!(
            "  guarantee: P(training time <= {:.2} days) >= {} (at {:.0}% confidence; {})",
            t / day,
            args.quantile,
            100.0 * args.confidence,
            if pr.random {
                format!("bound over {clusters} independent clusters")
            } else {
                "nothing varies".to_string()
            }
        )?,
        Err(why) => outln!(
            "  guarantee: none at the {} quantile and {:.0}% confidence: {why}",
            args.quantile,
            100.0 * args.confidence,
        )?,
    }
    print_attribution(p95_attr)?;
    Ok(())
}

/// Names of [`prism_predict::predict::REPORTED_QUANTILES`] in text and JSON.
const REPORTED_NAMES: [&str; 4] = ["p50", "p90", "p95", "p99"];

/// `p50 1.234+-0.005  p90 ...` with each quantile's Monte Carlo standard error.
fn quantiles_text(
    s: &stats::Summary5,
    e: &[Option<QuantileError>; 4],
    scale: f64,
    digits: usize,
) -> String {
    let values = [s.p50, s.p90, s.p95, s.p99];
    (REPORTED_NAMES.iter().zip(values).zip(e))
        .map(|((name, v), e)| match e {
            Some(e) => format!("{name} {:.digits$}+-{:.digits$}", v / scale, e.se / scale),
            None => format!("{name} {:.digits$}", v / scale),
        })
        .collect::<Vec<_>>()
        .join("  ")
}

/// `{"p50": {"se": .., "ci95": [lo, hi]}, ...}` (null where there is no error estimate).
fn errors_json(e: &[Option<QuantileError>; 4], scale: f64) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (name, e) in REPORTED_NAMES.iter().zip(e) {
        m.insert(
            name.to_string(),
            match e {
                Some(e) => {
                    serde_json::json!({"se": e.se / scale, "ci95": [e.lo / scale, e.hi / scale]})
                }
                None => serde_json::Value::Null,
            },
        );
    }
    serde_json::Value::Object(m)
}

fn guarantee_json(g: &Guarantee) -> serde_json::Value {
    let why = |r: &Result<f64, NoBound>| r.as_ref().err().map(|e| e.to_string());
    serde_json::json!({
        "quantile": g.quantile, "confidence": g.confidence,
        "training_time_days": g.training_s.as_ref().ok().map(|t| t / 86400.0),
        "step_time_s": g.step_s.as_ref().ok(),
        "method": g.method,
        "independent_clusters": g.clusters,
        "min_clusters": g.min_clusters,
        "training_time_note": why(&g.training_s),
        "step_time_note": why(&g.step_s),
    })
}

fn print_coverage(job: &prism_core::job::Job, c: &Coverage, wall_s: f64, json: bool) -> Result<()> {
    let day = 86400.0;
    let median = |xs: &[f64]| {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        stats::quantile_sorted(&v, 0.5)
    };
    let settings = |o: &PredictOptions| serde_json::json!({"samples": o.samples, "clusters": o.clusters, "runs": o.runs, "seed": o.seed});
    let part = |k: &Covered, scale: f64| {
        serde_json::json!({
            "observed": k.observed, "covered": k.covered, "no_bound": k.no_bound,
            "interval95": [k.interval.0, k.interval.1],
            "reference_quantile": k.reference_quantile / scale,
            "reference_quantile_se": k.reference_error.map(|e| e.se / scale),
            "median_margin_pct": 100.0 * k.median_margin,
            "bounds": k.bounds.iter().map(|b| b.map(|b| b / scale)).collect::<Vec<_>>(),
        })
    };
    if json {
        let mut training = part(&c.training, day);
        let extra = serde_json::json!({
            "nominal": c.nominal, "quantile": c.quantile, "seeds": c.seeds,
            "first_seed": c.first_seed, "unit": "days",
            "tried": settings(&c.tried), "reference": settings(&c.reference),
            "step_time_s": part(&c.step, 1.0),
            "wall_s": wall_s, "reference_wall_s": c.reference_wall_s,
            "seed_wall_s_median": median(&c.seed_wall_s),
            "seed_wall_s_max": c.seed_wall_s.iter().copied().fold(0.0, f64::max),
        });
        if let (Some(t), Some(e)) = (training.as_object_mut(), extra.as_object()) {
            t.extend(e.clone());
        }
        let v =
            serde_json::json!({"name": job.name, "num_gpus": job.num_gpus(), "coverage": training});
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    outln!(
        "Prism predict --check-coverage: {}  ({} GPUs)",
        job.name,
        job.num_gpus()
    )?;
    outln!(
        "  {} seeds ({}..{}) of --samples {} --clusters {} --runs {}; reference: --samples {} --clusters {} --runs {} (seed {})",
        c.seeds,
        c.first_seed,
        c.first_seed.wrapping_add(c.seeds - 1),
        c.tried.samples,
        c.tried.clusters,
        c.tried.runs,
        c.reference.samples,
        c.reference.clusters,
        c.reference.runs,
        c.reference.seed
    )?;
    for (what, k, scale, unit) in [
        ("training time", &c.training, day, "days"),
        ("step time", &c.step, 1.0, "s"),
    ] {
        outln!(
            "  {what}: reference p{} {:.4} {unit} (+-{:.4}); guarantee >= it in {} of {} seeds = {:.1}% \
             (95% interval {:.1}-{:.1}%), nominal {:.0}%; median margin {:+.2}%{}",
            (c.quantile * 1e4).round() / 1e2,
            k.reference_quantile / scale,
            k.reference_error.map_or(f64::NAN, |e| e.se / scale),
            k.covered,
            c.seeds,
            100.0 * k.observed,
            100.0 * k.interval.0,
            100.0 * k.interval.1,
            100.0 * c.nominal,
            100.0 * k.median_margin,
            if k.no_bound > 0 {
                format!("; {} seeds gave no bound", k.no_bound)
            } else {
                String::new()
            }
        )?;
    }
    outln!(
        "  wall: {wall_s:.1} s in all; reference {:.1} s; per seed median {:.1} s, max {:.1} s",
        c.reference_wall_s,
        median(&c.seed_wall_s),
        c.seed_wall_s.iter().copied().fold(0.0, f64::max)
    )?;
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
