//! `prism predict`: training time as a distribution, with a probabilistic guarantee.
//!
//! 1. Step time: `--samples` Monte Carlo iterations, each a full per-rank simulation with its
//!    own draws (per-GPU speed, per-kernel jitter, one communication regime per iteration).
//! 2. Whole run: `--runs` end-to-end samples; each run draws its steps from the step-time
//!    samples and adds fail-slow episodes, failures (lost work since the last checkpoint plus
//!    restart) and checkpoint writes (`prism_core::reliability`).
//! 3. The guarantee: the smallest `t` with `P(T <= t) >= q` holding at the given confidence, a
//!    distribution-free order-statistic bound on the q-quantile (`prism_core::stats::guarantee`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::engine::{Mode, Perturbation, SimOptions};
use prism_core::job::Job;
use prism_core::ops::OpClass;
use prism_core::reliability::{self, RunModel};
use prism_core::stats;
use prism_core::variability::Variability;
use rand::RngExt;

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
}

fn op_class(name: &str) -> Option<OpClass> {
    use OpClass::*;
    [
        Gemm,
        Attention,
        Norm,
        Elementwise,
        Softmax,
        Embedding,
        Loss,
        Router,
        Optimizer,
        Framework,
    ]
    .into_iter()
    .find(|c| c.name() == name)
}

/// Draws the perturbation of Monte Carlo sample `i`.
fn draw(job: &Job, v: &Variability, seed: u64, i: u64) -> Perturbation {
    let n = job.num_gpus() as usize;
    let mut rng = stats::stream_rng(seed, &[1, i]);
    let rank_factor = match &v.gpu_speed {
        Some(g) => (0..n)
            .map(|_| {
                let f = g.factor.sample(&mut rng).max(1e-3);
                if rng.random::<f64>() < g.outlier_fraction {
                    f * g.outlier_slowdown
                } else {
                    f
                }
            })
            .collect(),
        None => Vec::new(),
    };
    let jitter = v
        .kernel_jitter
        .iter()
        .filter_map(|j| {
            let class = if j.class == "all" {
                None
            } else {
                Some(op_class(&j.class)?)
            };
            Some((class, j.factor.clone()))
        })
        .collect();
    let comm_factor = v
        .comm_regime
        .as_ref()
        .map_or(1.0, |c| c.factor.sample(&mut rng).max(1e-3));
    Perturbation {
        rank_factor,
        jitter,
        comm_factor,
        seed: stats::stream_rng(seed, &[2, i]).random::<u64>(),
    }
}

pub fn run(args: &PredictArgs) -> Result<()> {
    use rayon::prelude::*;
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
        crate::check_memory(job)?;
    }
    let v = &loaded.variability;
    let seed = args.seed.or(loaded.variability_seed).unwrap_or(1);
    let bar = indicatif::ProgressBar::new(args.samples as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} iterations {elapsed} (eta {eta})",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    bar.set_prefix("predict");
    let mut steps: Vec<f64> = (0..args.samples as u64)
        .into_par_iter()
        .map(|i| {
            let opts = SimOptions {
                mode: Mode::Full,
                perturbation: Some(draw(job, v, seed, i)),
                ..SimOptions::default()
            };
            let r = prism_core::simulate(job, &opts).map(|r| r.summary.iteration_time_s);
            bar.inc(1);
            r
        })
        .collect::<Result<Vec<f64>, _>>()
        .context("simulation failed")?;
    bar.finish_and_clear();
    steps.sort_by(f64::total_cmp);
    let step = stats::summarize(&steps);
    // Whole runs.
    let iterations = (args.tokens / job.tokens_per_iteration() as f64).ceil() as u64;
    // A run is played out in blocks of `block` iterations, each the exact sum of `block`
    // draws from the step-time samples (iterations rounded up to a whole number of blocks).
    let block = iterations.div_ceil(4096).max(1);
    let model = RunModel {
        steps: iterations.div_ceil(block),
        gpus: job.num_gpus(),
        failures: v.failures.clone(),
        fail_slow: v.fail_slow.clone(),
    };
    let outcomes: Vec<reliability::RunOutcome> = (0..args.runs as u64)
        .into_par_iter()
        .map(|r| {
            let mut rng = stats::stream_rng(seed, &[3, r]);
            let one = |rng: &mut rand_xoshiro::Xoshiro256PlusPlus| {
                steps[rng.random_range(0..steps.len())]
            };
            let mut sampler = reliability::exact_block(one, block);
            reliability::simulate_run(&mut sampler, &model, &mut rng)
        })
        .collect();
    let mut totals: Vec<f64> = outcomes.iter().map(|o| o.total_s).collect();
    totals.sort_by(f64::total_cmp);
    let total = stats::summarize(&totals);
    let interruptions =
        outcomes.iter().map(|o| o.interruptions as f64).sum::<f64>() / outcomes.len() as f64;
    let ratio = outcomes
        .iter()
        .map(reliability::effective_training_ratio)
        .sum::<f64>()
        / outcomes.len() as f64;
    let guarantee = stats::guarantee(&totals, args.quantile, args.confidence);
    let step_guarantee = stats::guarantee(&steps, args.quantile, args.confidence);
    let day = 86400.0;
    if args.json {
        let s5 = |s: &stats::Summary5, scale: f64| serde_json::json!({"mean": s.mean / scale, "p50": s.p50 / scale, "p90": s.p90 / scale, "p95": s.p95 / scale, "p99": s.p99 / scale, "min": s.min / scale, "max": s.max / scale});
        let v = serde_json::json!({
            "name": job.name, "num_gpus": job.num_gpus(), "tokens": args.tokens, "iterations": iterations,
            "samples": args.samples, "runs": args.runs, "seed": seed,
            "step_time_s": s5(&step, 1.0),
            "training_time_days": s5(&total, day),
            "expected_interruptions": interruptions,
            "effective_training_time_ratio": ratio,
            "guarantee": {"quantile": args.quantile, "confidence": args.confidence,
                          "training_time_days": guarantee.map(|t| t / day), "step_time_s": step_guarantee},
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "Prism predict: {}  ({} GPUs, {:.3e} tokens = {} iterations)",
        job.name,
        job.num_gpus(),
        args.tokens,
        iterations
    );
    println!(
        "  {} Monte Carlo iterations (every rank simulated), {} end-to-end runs, seed {seed}",
        args.samples, args.runs
    );
    println!();
    println!(
        "  step time (s)        mean {:.3}  p50 {:.3}  p90 {:.3}  p95 {:.3}  p99 {:.3}",
        step.mean, step.p50, step.p90, step.p95, step.p99
    );
    println!(
        "  training time (days) mean {:.2}  p50 {:.2}  p90 {:.2}  p95 {:.2}  p99 {:.2}",
        total.mean / day,
        total.p50 / day,
        total.p90 / day,
        total.p95 / day,
        total.p99 / day
    );
    println!(
        "  expected interruptions {interruptions:.1}; effective training time ratio {:.1}%",
        100.0 * ratio
    );
    match guarantee {
        Some(t) => println!(
            "  guarantee: P(training time <= {:.2} days) >= {} (at {:.0}% confidence)",
            t / day,
            args.quantile,
            100.0 * args.confidence
        ),
        None => println!(
            "  guarantee: too few runs for a {:.0}%-confidence bound on the {} quantile; raise --runs",
            100.0 * args.confidence,
            args.quantile
        ),
    }
    Ok(())
}
