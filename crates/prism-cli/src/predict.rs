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
    /// Write an SVG of the step-time and training-time CDFs with the guarantee marked.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

/// Applies a `prism fit` distribution table (`[variability.distributions] table`): a row named
/// after an op class (or `all`) becomes that class's kernel jitter, a row named after a kernel
/// of the job (e.g. `fc1_fwd`) that kernel's jitter on top of its class's, a row named `comm`
/// the communication regime; each duration distribution is divided by its mean, giving a time
/// factor of mean 1 around the cost model's nominal time.
fn with_fit_table(
    job: &Job,
    mut v: Variability,
    table: &std::collections::BTreeMap<String, prism_core::variability::Dist>,
    origin: &str,
) -> Result<Variability> {
    use prism_core::variability::{CommRegime, KernelJitter, OpJitter};
    let mut kernels = None;
    for (sig, d) in table {
        let mean = d.mean();
        if !(mean.is_finite() && mean > 0.0) {
            bail!(
                "{origin}: signature `{sig}`: the distribution's mean must be positive (got {mean})"
            );
        }
        let factor = d.scaled(1.0 / mean);
        if sig == "comm" {
            v.comm_regime = Some(CommRegime { factor });
        } else if sig == "all" || OpClass::from_name(sig).is_some() {
            v.kernel_jitter.retain(|j| j.class != *sig);
            v.kernel_jitter.push(KernelJitter {
                class: sig.clone(),
                factor,
            });
        } else {
            let names = kernels.get_or_insert_with(|| {
                prism_core::graph::ExecutionGraph::build(job).kernel_names()
            });
            if !names.contains(sig.as_str()) {
                bail!(
                    "{origin}: signature `{sig}` is neither an op class (gemm, attention, norm, \
                     softmax, elementwise, embedding, loss, router, optimizer, framework, all), \
                     nor `comm`, nor the name of a kernel of this job ({})",
                    names.iter().copied().collect::<Vec<_>>().join(", ")
                );
            }
            v.op_jitter.retain(|j| j.op != *sig);
            v.op_jitter.push(OpJitter {
                op: sig.clone(),
                factor,
            });
        }
    }
    Ok(v)
}

/// The job's variability, with its `prism fit` table applied when `[variability.distributions]`
/// names one.
pub(crate) fn variability_of(loaded: &prism_io::jobfile::LoadedJob) -> Result<Variability> {
    Ok(match &loaded.dist_table {
        Some(path) => {
            let table = prism_io::samples::read_dist_table(path)?;
            with_fit_table(
                &loaded.job,
                loaded.variability.clone(),
                &table,
                &path.display().to_string(),
            )?
        }
        None => loaded.variability.clone(),
    })
}

/// Draws the perturbation of sample `i` on cluster `i % clusters`: the persistent per-GPU
/// speeds belong to the cluster (the same GPUs for every step of a run); kernel jitter and the
/// communication regime are fresh for every iteration.
pub(crate) fn draw_in(
    job: &Job,
    v: &Variability,
    seed: u64,
    i: u64,
    clusters: u64,
) -> Perturbation {
    let n = job.num_gpus() as usize;
    let mut rng = stats::stream_rng(seed, &[1, i % clusters.max(1)]);
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
                Some(OpClass::from_name(&j.class)?)
            };
            Some((class, j.factor.clone()))
        })
        .collect();
    let op_jitter = (v.op_jitter.iter())
        .map(|j| (j.op.clone(), j.factor.clone()))
        .collect();
    Perturbation {
        rank_factor,
        jitter,
        op_jitter,
        comm_factor: comm_factor(v, seed, i),
        seed: stats::stream_rng(seed, &[2, i]).random::<u64>(),
    }
}

/// The communication regime of sample `i`.
fn comm_factor(v: &Variability, seed: u64, i: u64) -> f64 {
    let mut rng = stats::stream_rng(seed, &[4, i]);
    (v.comm_regime.as_ref()).map_or(1.0, |c| c.factor.sample(&mut rng).max(1e-3))
}

/// The compiled step model and its fast statistics, when [`sample_steps`] used them.
pub(crate) type FastModel = (
    prism_core::maxplus::StepModel,
    prism_core::maxplus::FastStats,
);

/// Monte Carlo step times of `samples` iterations (sample `i` on cluster `i % clusters`), with
/// the max-plus step model when the job and the jitter allow it (unless `per_rank`), otherwise
/// with the per-rank engine; `bar` advances once per sample. Returns the samples in index
/// order, a description of the method used, and the step model it used (if any).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sample_steps(
    job: &Job,
    v: &Variability,
    seed: u64,
    samples: u64,
    clusters: u64,
    per_rank: bool,
    prune: bool,
    base_opts: &SimOptions,
    bar: &indicatif::ProgressBar,
) -> Result<(Vec<f64>, String, Option<FastModel>)> {
    use rayon::prelude::*;
    // The max-plus step model (frozen communication durations, exact order-statistic draws)
    // when the job and the jitter allow it; otherwise every rank runs in the engine.
    let probe = draw_in(job, v, seed, 0, clusters);
    // Why the step model was not used, when it was not.
    let mut why_not: Option<String> = None;
    let step_model = if per_rank {
        why_not = Some("--per-rank".into());
        None
    } else if probe.is_symmetric() {
        None
    } else {
        match prism_core::maxplus::StepModel::new(job, base_opts)
            .and_then(|m| m.fast_stats(&probe).map(|f| (m, f)))
        {
            Ok(model) => Some(model),
            Err(e) => {
                why_not = Some(e.to_string());
                None
            }
        }
    };
    let method = match (&step_model, probe.is_symmetric()) {
        (_, true) => "ranks stay symmetric: one representative per stage, exact".to_string(),
        (Some(_), false) => {
            "max-plus step model: every GPU, frozen communication durations".to_string()
        }
        (None, false) => format!(
            "every rank simulated by the engine ({})",
            why_not.as_deref().unwrap_or("step model unavailable")
        ),
    };
    if let Some((m, fast)) = &step_model {
        let steps = step_model_samples(job, v, seed, samples, clusters, prune, m, fast, bar)?;
        return Ok((steps, method, step_model));
    }
    let steps: Vec<f64> = (0..samples)
        .into_par_iter()
        .map(|i| {
            // Exact shortcut: a perturbation that treats every rank alike (a shared network
            // regime only) keeps the ranks symmetric, so one representative per stage suffices.
            let p = draw_in(job, v, seed, i, clusters);
            let mode = if p.is_symmetric() {
                Mode::Reduced
            } else {
                Mode::Full
            };
            let opts = SimOptions {
                mode,
                perturbation: Some(p),
                ..base_opts.clone()
            };
            let r = match prism_core::simulate(job, &opts) {
                Err(prism_core::engine::SimError::Asymmetric(_)) => prism_core::simulate(
                    job,
                    &SimOptions {
                        mode: Mode::Full,
                        ..opts
                    },
                ),
                other => other,
            }
            .map(|r| r.summary.iteration_time_s);
            bar.inc(1);
            r
        })
        .collect::<Result<Vec<f64>, _>>()
        .context("simulation failed")?;
    Ok((steps, method, step_model))
}

/// Step-model samples, cluster by cluster. With per-GPU speeds and at least three samples in
/// a cluster (and `prune`), the cluster's samples with the lowest and the highest
/// communication regime are evaluated in full as pilots, and the others skip the replicas the
/// pilots prove irrelevant ([`prism_core::maxplus::StepModel::sample_pruned`]): the same
/// samples, faster.
#[allow(clippy::too_many_arguments)]
fn step_model_samples(
    job: &Job,
    v: &Variability,
    seed: u64,
    samples: u64,
    clusters: u64,
    prune: bool,
    m: &prism_core::maxplus::StepModel,
    fast: &prism_core::maxplus::FastStats,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<f64>> {
    use prism_core::maxplus::Pruner;
    use rayon::prelude::*;
    let clusters = clusters.clamp(1, samples.max(1));
    let by_cluster = (0..clusters)
        .into_par_iter()
        .map(|k| -> Result<Vec<(u64, f64)>> {
            let idx: Vec<u64> = (k..samples).step_by(clusters as usize).collect();
            let rank_factor = draw_in(job, v, seed, k, clusters).rank_factor;
            let comm: Vec<f64> = idx.iter().map(|&i| comm_factor(v, seed, i)).collect();
            // Sample j of the cluster, pruned when there is a pruner.
            let one = |j: usize, pruner: Option<&Pruner>| -> Result<(u64, f64)> {
                let (i, c) = (idx[j], comm[j]);
                let t = match pruner {
                    Some(p) => {
                        m.sample_pruned(fast, p, &rank_factor, c, sample_seed(seed, i))?
                            .0
                    }
                    None => m.sample_fast(fast, &rank_factor, c, sample_seed(seed, i))?,
                };
                bar.inc(1);
                Ok((i, t))
            };
            if !prune || rank_factor.is_empty() || idx.len() < 3 {
                return (0..idx.len())
                    .into_par_iter()
                    .map(|j| one(j, None))
                    .collect();
            }
            // The pilots: the lowest and the highest regime (the first on ties).
            let by = |better: fn(f64, f64) -> bool| {
                (0..comm.len()).fold(0, |b, j| if better(comm[j], comm[b]) { j } else { b })
            };
            let (lo, hi) = (by(|a, b| a < b), by(|a, b| a > b));
            let pilot = |j: usize| {
                let r = m.sample_pilot(fast, &rank_factor, comm[j], sample_seed(seed, idx[j]));
                bar.inc(1);
                r
            };
            let (a, b) = rayon::join(|| pilot(lo), || (hi != lo).then(|| pilot(hi)));
            let (ta, pa) = a?;
            let mut out = vec![(idx[lo], ta)];
            let pb = match b.transpose()? {
                Some((tb, pb)) => {
                    out.push((idx[hi], tb));
                    Some(pb)
                }
                None => None,
            };
            let pruner = Pruner::new(m, fast, &rank_factor, pa, pb);
            let rest = (0..idx.len())
                .into_par_iter()
                .filter(|&j| j != lo && j != hi)
                .map(|j| one(j, pruner.as_ref()))
                .collect::<Result<Vec<_>>>()?;
            out.extend(rest);
            Ok(out)
        })
        .collect::<Result<Vec<_>>>()
        .context("simulation failed")?;
    let mut steps = vec![0.0; samples as usize];
    for (i, t) in by_cluster.into_iter().flatten() {
        steps[i as usize] = t;
    }
    Ok(steps)
}

/// The random seed of step-model sample `i`.
fn sample_seed(seed: u64, i: u64) -> u64 {
    stats::stream_rng(seed, &[5, i]).random::<u64>()
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
    let v = &variability_of(&loaded)?;
    let seed = args.seed.or(loaded.variability_seed).unwrap_or(1);
    let bar = indicatif::ProgressBar::new(args.samples as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} iterations {elapsed} (eta {eta})",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    bar.set_prefix("predict");
    let clusters = args
        .clusters
        .unwrap_or((args.samples as u64 / 20).max(1))
        .clamp(1, args.samples as u64);
    let kernel_table = match &loaded.kernel_table {
        Some(path) => Some(prism_io::kernel_table::read_kernel_table(path)?),
        None => None,
    };
    let base_opts = SimOptions {
        kernel_table,
        ..SimOptions::default()
    };
    let (sample_steps, method, step_model) = sample_steps(
        job,
        v,
        seed,
        args.samples as u64,
        clusters,
        args.per_rank,
        !args.no_prune,
        &base_opts,
        &bar,
    )?;
    bar.finish_and_clear();
    let mut steps = sample_steps.clone();
    steps.sort_by(f64::total_cmp);
    let step = stats::summarize(&steps);
    // --- p95 critical-path attribution (begin) ---
    let p95_attr = p95_attribution(
        job,
        v,
        seed,
        clusters,
        &sample_steps,
        step.p95,
        &base_opts,
        step_model.as_ref(),
    )?;
    // --- p95 critical-path attribution (end) ---
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
    // Step samples by cluster (sample i ran on cluster i mod clusters).
    let by_cluster: Vec<Vec<f64>> = (0..clusters)
        .map(|c| {
            sample_steps
                .iter()
                .skip(c as usize)
                .step_by(clusters as usize)
                .copied()
                .collect()
        })
        .collect();
    let outcomes: Vec<reliability::RunOutcome> = (0..args.runs as u64)
        .into_par_iter()
        .map(|r| {
            let mut rng = stats::stream_rng(seed, &[3, r]);
            let own = &by_cluster[(r % clusters) as usize];
            let one =
                |rng: &mut rand_xoshiro::Xoshiro256PlusPlus| own[rng.random_range(0..own.len())];
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
                sorted: &steps,
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
            "step_time_s": s5(&step, 1.0),
            "training_time_days": s5(&total, day),
            "expected_interruptions": interruptions,
            "effective_training_time_ratio": ratio,
            "guarantee": {"quantile": args.quantile, "confidence": args.confidence,
                          "training_time_days": guarantee.map(|t| t / day), "step_time_s": step_guarantee},
            "p95_attribution": p95_attr.json(),
            "p95_attribution_sample": p95_attr.meta_json(),
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
        "  {} Monte Carlo iterations ({}) on {clusters} clusters of GPUs, {} end-to-end runs, seed {seed}",
        args.samples, method, args.runs
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
    p95_attr.print();
    Ok(())
}

// --- p95 critical-path attribution (begin) ---

/// Entries printed and put in the JSON.
const TOP_CONTRIBUTORS: usize = 10;

/// The critical-path attribution of the Monte Carlo sample at the p95 step time.
struct P95Attribution {
    /// Sample index and its step time.
    sample: u64,
    step_s: f64,
    /// How the path was found.
    method: &'static str,
    /// True when every rank is a candidate of the path (else one DP replica per stage).
    all_ranks: bool,
    /// Ops and collectives: (name, class, seconds), largest first.
    ops: Vec<(String, String, f64)>,
    /// Ranks and tensor-parallel groups: (name, kind, seconds), largest first.
    who: Vec<(String, String, f64)>,
    path_s: f64,
    wait_s: f64,
}

/// Attributes the sample whose step time is the smallest at or above `p95` (the first such
/// sample on ties). With the step model: the model's own critical path of that sample (the same
/// draws, every GPU). Otherwise the sample is re-simulated by the engine with the same
/// perturbation, recording every rank for jobs of up to 4096 GPUs; larger jobs record the ranks
/// of the first data-parallel replica of every stage (all its tp x cp ranks), so the path is
/// followed across stages and tensor/context groups but waits on a straggler outside that
/// replica are charged to the collective it delays.
#[allow(clippy::too_many_arguments)]
fn p95_attribution(
    job: &Job,
    v: &Variability,
    seed: u64,
    clusters: u64,
    samples: &[f64],
    p95: f64,
    base_opts: &SimOptions,
    step_model: Option<&FastModel>,
) -> Result<P95Attribution> {
    let (i, &step_s) = samples
        .iter()
        .enumerate()
        .filter(|(_, t)| **t >= p95)
        .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(&b.0)))
        .or_else(|| samples.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)))
        .context("no step-time samples")?;
    let p = draw_in(job, v, seed, i as u64, clusters);
    let top_ops = |by_op: &[(String, f64)],
                   class_of: &std::collections::BTreeMap<String, String>| {
        by_op
            .iter()
            .take(TOP_CONTRIBUTORS)
            .map(|(name, t)| {
                let class = class_of.get(name).cloned().unwrap_or_default();
                (name.clone(), class, *t)
            })
            .collect()
    };
    if let Some((m, fast)) = step_model {
        let a = m
            .attribute_fast(
                fast,
                &p.rank_factor,
                p.comm_factor,
                sample_seed(seed, i as u64),
            )
            .context("p95 critical path failed")?;
        let mut who: Vec<(String, String, f64)> = a
            .by_rank
            .iter()
            .map(|(r, t)| (format!("rank {r}"), "rank".to_string(), *t))
            .chain(
                a.by_tp_group
                    .iter()
                    .map(|(r, t)| (format!("tp group of rank {r}"), "tp_group".to_string(), *t)),
            )
            .collect();
        who.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        who.truncate(TOP_CONTRIBUTORS);
        return Ok(P95Attribution {
            sample: i as u64,
            step_s,
            method: "step-model critical path, every GPU",
            all_ranks: true,
            ops: top_ops(&a.by_op, &a.class_of),
            who,
            path_s: a.path_s,
            wait_s: 0.0,
        });
    }
    let n = job.num_gpus() as u32;
    let all_ranks = n <= 4096;
    let record_ranks: Vec<u32> = if all_ranks {
        (0..n).collect()
    } else {
        let l = prism_core::layout::Layout::new(job);
        (0..l.pp)
            .flat_map(|pp| {
                (0..l.cp).flat_map(move |cp| {
                    (0..l.tp).map(move |tp| l.rank(prism_core::layout::Coord { tp, cp, dp: 0, pp }))
                })
            })
            .collect()
    };
    let opts = SimOptions {
        mode: Mode::Full,
        perturbation: Some(p),
        record_ranks,
        ..base_opts.clone()
    };
    let r = prism_core::simulate(job, &opts).context("p95 re-simulation failed")?;
    let attr = prism_core::attribution::critical_path(&r);
    Ok(P95Attribution {
        sample: i as u64,
        step_s,
        method: "engine re-simulation",
        all_ranks,
        ops: top_ops(&attr.by_op, &attr.class_of),
        who: attr
            .by_rank
            .iter()
            .take(TOP_CONTRIBUTORS)
            .map(|(r, t)| (format!("rank {r}"), "rank".to_string(), *t))
            .collect(),
        path_s: attr.path_s,
        wait_s: attr.wait_s,
    })
}

impl P95Attribution {
    /// The top ops and collectives (kind: their class), then the top ranks (kind "rank") and
    /// tensor-parallel groups (kind "tp_group").
    fn top(&self) -> Vec<(String, String, f64)> {
        self.ops.iter().chain(&self.who).cloned().collect()
    }

    fn share(&self, t: f64) -> f64 {
        if self.path_s > 0.0 {
            t / self.path_s
        } else {
            0.0
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.top()
                .into_iter()
                .map(|(name, kind, t)| {
                    serde_json::json!({"name": name, "kind": kind, "seconds": t, "share": self.share(t)})
                })
                .collect(),
        )
    }

    fn meta_json(&self) -> serde_json::Value {
        serde_json::json!({"sample": self.sample, "step_time_s": self.step_s,
                           "path_s": self.path_s, "wait_s": self.wait_s,
                           "all_ranks_recorded": self.all_ranks, "method": self.method})
    }

    fn print(&self) {
        println!();
        println!(
            "  top {TOP_CONTRIBUTORS} contributors to the p95 step ({}): sample {}, step {:.3} s, path {:.3} s{}",
            self.method,
            self.sample,
            self.step_s,
            self.path_s,
            if self.all_ranks {
                ""
            } else {
                " (first DP replica of every stage recorded)"
            }
        );
        for (name, kind, t) in &self.ops {
            println!(
                "    {:<28} {:<12} {:>9.4} s  {:>5.1}%",
                name,
                kind,
                t,
                100.0 * self.share(*t)
            );
        }
        let who: Vec<String> = self
            .who
            .iter()
            .map(|(name, _, t)| format!("{name} {:.1}%", 100.0 * self.share(*t)))
            .collect();
        println!("    by rank: {}", who.join(", "));
    }
}
// --- p95 critical-path attribution (end) ---
