//! `prism predict` as a library call: training time as a distribution, with a probabilistic
//! guarantee.
//!
//! 1. Step time: `samples` Monte Carlo iterations, each with its own draws (per-GPU speed,
//!    per-kernel jitter, one communication regime per iteration), played by the max-plus step
//!    model where the job allows it, else by the engine ([`sample_steps`]). A job whose
//!    iterations cannot differ is simulated once.
//! 2. Whole run: `runs` end-to-end samples; each run draws its steps from the step-time
//!    samples and adds fail-slow episodes, failures (lost work since the last checkpoint plus
//!    restart) and checkpoint writes ([`crate::reliability`]).
//! 3. The guarantee: the smallest `t` with `P(T <= t) >= q` holding at the given confidence, a
//!    distribution-free order-statistic bound on the q-quantile ([`crate::stats::guarantee`]).

use std::collections::BTreeMap;

use prism_core::engine::{Mode, SimError, SimOptions};
use prism_core::job::Job;
use prism_core::ops::OpClass;
use rand::RngExt;

use crate::guarantee::{self, NoBound, QuantileError};
use crate::perturbation::Perturbation;
use crate::reliability::{self, RunModel};
use crate::stats;
use crate::step_model::{FastStats, Frozen, PoolSettings, Pruner, StepModel};
use crate::variability::{Dist, Variability};
use crate::{Error, Progress};

/// What `prism predict` is asked.
#[derive(Clone, Debug, PartialEq)]
pub struct PredictOptions {
    /// Tokens to train on.
    pub tokens: f64,
    /// Monte Carlo step-time samples.
    pub samples: u64,
    /// Clusters the step samples are spread over (each draws its GPUs' persistent speeds once).
    pub clusters: u64,
    /// End-to-end run samples drawn from the step-time samples.
    pub runs: u64,
    /// Probability `q` of the guarantee "P(T <= t) >= q".
    pub quantile: f64,
    /// Confidence of the guarantee's bound.
    pub confidence: f64,
    /// Seed of every draw.
    pub seed: u64,
    /// Every rank of every sample in the engine instead of the step model.
    pub per_rank: bool,
    /// Replica pruning in the step model (exact; off only for timing and checking it).
    pub prune: bool,
    /// Pooled lane races in the step model (an approximation with a stated bound, used only
    /// where a race repeats hundreds of thousands of times per sample; off for checking it).
    pub pool: bool,
}

/// The step model's shortcuts a caller may turn off ([`sample_steps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortcuts {
    /// Replica pruning (exact but for probability below 1e-17 per replica and value).
    pub prune: bool,
    /// Pooled lane races ([`crate::step_model`]'s `pool` module: exact per block, blocks of a
    /// sample sharing a pool of 65,536 exact draws).
    pub pool: bool,
}

impl Default for Shortcuts {
    fn default() -> Self {
        Shortcuts {
            prune: true,
            pool: true,
        }
    }
}

impl PredictOptions {
    /// The default cluster count of `prism explore`'s sampled objectives for `samples`
    /// samples: one cluster per 20 samples.
    pub fn default_clusters(samples: u64) -> u64 {
        (samples / 20).max(1)
    }

    /// `prism predict`'s default step samples.
    pub const DEFAULT_SAMPLES: u64 = 400;

    /// `prism predict`'s default clusters for `samples` samples and a guarantee at `quantile`
    /// and `confidence`: 1.6 times the fewest independent clusters the bound needs
    /// ([`guarantee::min_clusters`]), at least 100, at most one per sample. 100 for the
    /// default 0.95 / 0.95.
    pub fn predict_clusters(samples: u64, quantile: f64, confidence: f64) -> u64 {
        let need = guarantee::min_clusters(quantile, confidence).unwrap_or(1);
        need.saturating_mul(8)
            .div_ceil(5)
            .max(100)
            .min(samples.max(1))
    }

    /// `prism predict`'s default runs for `clusters` clusters: ten per cluster, at least 1,000.
    pub fn predict_runs(clusters: u64) -> u64 {
        clusters.saturating_mul(10).max(1000)
    }
}

/// What `prism predict` answers.
#[derive(Clone, Debug)]
pub struct Prediction {
    /// Iterations of the whole run.
    pub iterations: u64,
    /// Clusters the step samples were spread over.
    pub clusters: u64,
    /// How the step samples were made.
    pub method: String,
    /// Step times in sample order.
    pub step_samples: Vec<f64>,
    /// Step times, ascending.
    pub steps: Vec<f64>,
    /// Summary of the step times.
    pub step: stats::Summary5,
    /// Training times of the end-to-end runs, seconds, ascending.
    pub totals: Vec<f64>,
    /// Summary of the training times.
    pub total: stats::Summary5,
    /// Mean interruptions per run.
    pub interruptions: f64,
    /// Mean effective training time ratio.
    pub effective_ratio: f64,
    /// What the p95 step is made of.
    pub p95: P95Attribution,
    /// Iterations per block of a played-out run (one draw of the run sampler).
    pub block: u64,
    /// Whether a block is the exact sum of its iterations' step draws (else the central-limit
    /// approximation, used past [`EXACT_BLOCK_MAX`] iterations per block).
    pub block_exact: bool,
    /// Runs abandoned by the run model's livelock guard (failures too frequent for training to
    /// progress); the training-time summary covers the completed runs, and the guarantee counts
    /// an abandoned run as never finishing.
    pub abandoned_runs: u64,
    /// Step samples by cluster, each ascending.
    pub step_groups: Vec<Vec<f64>>,
    /// Training times of the runs by cluster (run `r` on cluster `r % clusters`), each
    /// ascending, `+inf` for an abandoned run.
    pub run_groups: Vec<Vec<f64>>,
    /// Monte Carlo error of the step time's p50, p90, p95 and p99 (cluster bootstrap; `None`
    /// with fewer than two clusters).
    pub step_error: [Option<QuantileError>; 4],
    /// The same for the training time.
    pub total_error: [Option<QuantileError>; 4],
    /// Whether anything in the job's `[variability]` is random.
    pub random: bool,
    /// The guarantee at the requested quantile and confidence.
    pub guarantee: Guarantee,
}

/// The most iterations a predicted run may have (`tokens / tokens per iteration`).
pub const MAX_ITERATIONS: u64 = 10_000_000_000;

/// The most iterations a block of a played-out run sums exactly (a run is 4,096 blocks, so up
/// to about 4.2 million iterations); longer blocks are drawn from the central-limit
/// approximation with the cluster's step mean and variance ([`reliability::clt_block`]).
pub const EXACT_BLOCK_MAX: u64 = 1024;

/// Checks `opts` and predicts: step samples, whole runs, the guarantees and the p95 critical
/// path. `progress` is called once per step sample, then once per end-to-end run.
pub fn predict(
    job: &Job,
    v: &Variability,
    opts: &PredictOptions,
    base_opts: &SimOptions,
    progress: &Progress<'_>,
) -> Result<Prediction, Error> {
    use rayon::prelude::*;
    let iterations = (opts.tokens / job.tokens_per_iteration() as f64).ceil();
    if !(iterations >= 1.0 && iterations <= MAX_ITERATIONS as f64) {
        return Err(Error::Invalid(format!(
            "tokens: {:e} tokens at {} tokens per iteration make {iterations:e} iterations; a \
             run must have between 1 and {MAX_ITERATIONS:e} iterations",
            opts.tokens,
            job.tokens_per_iteration()
        )));
    }
    let iterations = iterations as u64;
    let (seed, clusters) = (opts.seed, opts.clusters.clamp(1, opts.samples.max(1)));
    let (step_samples, method, step_model) = sample_steps(
        job,
        v,
        seed,
        opts.samples,
        clusters,
        opts.per_rank,
        Shortcuts {
            prune: opts.prune,
            pool: opts.pool,
        },
        base_opts,
        progress,
    )?;
    if let Some(t) = (step_samples.iter()).find(|t| !(t.is_finite() && **t <= MAX_STEP_S)) {
        return Err(Error::Invalid(format!(
            "[variability]: a sampled iteration takes {t} s, not a finite time within {:.1} days: \
             a time-factor distribution (gpu_speed, kernel_jitter, comm_regime or a fitted table) \
             draws factors far too large",
            MAX_STEP_S / 86400.0
        )));
    }
    let mut steps = step_samples.clone();
    steps.sort_by(f64::total_cmp);
    let step = stats::summarize(&steps);
    let p95 = p95_attribution(
        job,
        v,
        seed,
        clusters,
        &step_samples,
        step.p95,
        base_opts,
        step_model.as_ref(),
    )?;
    // Whole runs.
    // A run is played out in blocks of `block` iterations, each the exact sum of `block`
    // draws from the step-time samples (iterations rounded up to a whole number of blocks), or
    // past EXACT_BLOCK_MAX iterations per block, a central-limit draw.
    let block = iterations.div_ceil(4096).max(1);
    let block_exact = block <= EXACT_BLOCK_MAX;
    let model = RunModel {
        steps: iterations.div_ceil(block),
        gpus: job.num_gpus(),
        failures: v.failures.clone(),
        fail_slow: v.fail_slow.clone(),
    };
    // Step samples by cluster (sample i ran on cluster i mod clusters).
    let design = Design::new(opts.samples, clusters);
    let by_cluster: Vec<Vec<f64>> = (0..clusters)
        .map(|c| {
            step_samples
                .iter()
                .skip(c as usize)
                .step_by(clusters as usize)
                .copied()
                .collect()
        })
        .collect();
    let outcomes: Vec<reliability::RunOutcome> = (0..opts.runs)
        .into_par_iter()
        .map(|r| {
            let mut rng = stats::stream_rng(seed, &[3, r]);
            let own = &by_cluster[design.cluster(r) as usize];
            let one =
                |rng: &mut rand_xoshiro::Xoshiro256PlusPlus| own[rng.random_range(0..own.len())];
            if block_exact {
                let mut sampler = reliability::exact_block(one, block);
                reliability::simulate_run(&mut sampler, &model, &mut rng)
            } else {
                let n = own.len() as f64;
                let mean = own.iter().sum::<f64>() / n;
                let var = own.iter().map(|t| (t - mean) * (t - mean)).sum::<f64>() / n;
                let sd = var.sqrt();
                let mut sampler = reliability::clt_block(mean, sd, block);
                reliability::simulate_run(&mut sampler, &model, &mut rng)
            }
        })
        .inspect(|_| progress(1))
        .collect();
    let abandoned_runs = outcomes.iter().filter(|o| !o.completed).count() as u64;
    if abandoned_runs == outcomes.len() as u64 {
        return Err(Error::Invalid(format!(
            "[variability.failures]: all {} runs were abandoned: failures come too often for \
             training to progress (more than {} interruptions, or no checkpoint kept); \
             there is no training time to report. Lower rate_per_gpu_hour or shorten \
             checkpoint_interval_s",
            outcomes.len(),
            reliability::MAX_INTERRUPTIONS
        )));
    }
    let mut totals: Vec<f64> = (outcomes.iter())
        .filter(|o| o.completed)
        .map(|o| o.total_s)
        .collect();
    totals.sort_by(f64::total_cmp);
    let total = stats::summarize(&totals);
    // Runs by cluster (run r trained on cluster r mod clusters); a run that never finishes
    // counts as +inf in the guarantee.
    let mut run_groups: Vec<Vec<f64>> = vec![Vec::new(); clusters as usize];
    for (r, o) in outcomes.iter().enumerate() {
        let t = if o.completed {
            o.total_s
        } else {
            f64::INFINITY
        };
        run_groups[design.cluster(r as u64) as usize].push(t);
    }
    let mut step_groups = by_cluster;
    for g in step_groups.iter_mut().chain(run_groups.iter_mut()) {
        g.sort_by(f64::total_cmp);
    }
    let completed = || outcomes.iter().filter(|o| o.completed);
    let kept = completed().count() as f64;
    let interruptions = completed().map(|o| o.interruptions as f64).sum::<f64>() / kept;
    let effective_ratio = completed()
        .map(reliability::effective_training_ratio)
        .sum::<f64>()
        / kept;
    let errors = |groups: &[Vec<f64>], stream: u64| {
        let g: Vec<&[f64]> = groups.iter().map(Vec::as_slice).collect();
        let e = guarantee::cluster_bootstrap(&g, &REPORTED_QUANTILES, stream);
        [e[0], e[1], e[2], e[3]]
    };
    let step_error = errors(&step_groups, stats::stream_rng(seed, &[10]).random());
    let total_error = errors(&run_groups, stats::stream_rng(seed, &[11]).random());
    let random = v.is_random();
    let guarantee = guarantee_of(
        &step_groups,
        &run_groups,
        random,
        opts.quantile,
        opts.confidence,
    );
    Ok(Prediction {
        iterations,
        clusters,
        method,
        step_samples,
        steps,
        step,
        totals,
        total,
        interruptions,
        effective_ratio,
        p95,
        block,
        block_exact,
        abandoned_runs,
        step_groups,
        run_groups,
        step_error,
        total_error,
        random,
        guarantee,
    })
}

/// The quantiles every summary reports with its Monte Carlo error: p50, p90, p95, p99.
pub const REPORTED_QUANTILES: [f64; 4] = [0.5, 0.9, 0.95, 0.99];

/// A guarantee "P(T <= t) >= quantile" at `confidence`, on the training time and the step time.
#[derive(Clone, Debug, PartialEq)]
pub struct Guarantee {
    pub quantile: f64,
    pub confidence: f64,
    /// The bound on the training time, seconds, or why there is none.
    pub training_s: Result<f64, NoBound>,
    /// The bound on the step time, seconds, or why there is none.
    pub step_s: Result<f64, NoBound>,
    /// Independent clusters behind the bound.
    pub clusters: u64,
    /// The fewest clusters any bound at this quantile and confidence needs.
    pub min_clusters: Option<u64>,
    /// How the bound was made.
    pub method: &'static str,
}

/// The method line of a cluster-level bound.
pub const CLUSTER_BOUND_METHOD: &str = "distribution-free upper confidence bound over \
     independent clusters (betting test on each cluster's fraction of values below the bound)";

/// The method line of a job in which nothing varies.
pub const EXACT_METHOD: &str = "exact: nothing in [variability] is random, every sample and \
     run is the same";

impl Prediction {
    /// The guarantee at `quantile` and `confidence` from this prediction's samples and runs:
    /// the cluster-level bound of [`guarantee::cluster_quantile_bound`] (valid for the
    /// dependence the sampling creates: runs sharing a cluster's GPUs and its step samples),
    /// or, when nothing in the job varies, the one value every run takes.
    pub fn guarantee_at(&self, quantile: f64, confidence: f64) -> Guarantee {
        guarantee_of(
            &self.step_groups,
            &self.run_groups,
            self.random,
            quantile,
            confidence,
        )
    }
}

/// [`Prediction::guarantee_at`] from the grouped step samples and runs.
fn guarantee_of(
    step_groups: &[Vec<f64>],
    run_groups: &[Vec<f64>],
    random: bool,
    quantile: f64,
    confidence: f64,
) -> Guarantee {
    let bound = |groups: &[Vec<f64>]| {
        let g: Vec<&[f64]> = groups.iter().map(Vec::as_slice).collect();
        if !random && quantile > 0.0 && quantile < 1.0 {
            // A point mass: its every quantile is its value.
            let (lo, hi) = g
                .iter()
                .flat_map(|g| g.iter())
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                });
            if lo == hi && hi.is_finite() {
                return Ok(hi);
            }
        }
        guarantee::cluster_quantile_bound(&g, quantile, confidence)
    };
    Guarantee {
        quantile,
        confidence,
        training_s: bound(run_groups),
        step_s: bound(step_groups),
        clusters: step_groups.iter().filter(|g| !g.is_empty()).count() as u64,
        min_clusters: guarantee::min_clusters(quantile, confidence),
        method: if random {
            CLUSTER_BOUND_METHOD
        } else {
            EXACT_METHOD
        },
    }
}

/// The longest iteration a prediction accepts, seconds: the engine's time range.
const MAX_STEP_S: f64 = prism_core::units::TIME_LIMIT as f64 * 1e-12;

/// Applies a `prism fit` distribution table (`[variability.distributions] table`): a row named
/// after an op class (or `all`) becomes that class's kernel jitter, a row named after a kernel
/// of the job (e.g. `fc1_fwd`) that kernel's jitter on top of its class's, a row named `comm`
/// the communication regime; each duration distribution is divided by its mean, giving a time
/// factor of mean 1 around the cost model's nominal time.
pub fn with_fit_table(
    job: &Job,
    mut v: Variability,
    table: &BTreeMap<String, Dist>,
    origin: &str,
) -> Result<Variability, Error> {
    use crate::variability::{CommRegime, KernelJitter, OpJitter};
    let mut kernels = None;
    for (sig, d) in table {
        let mean = d.mean();
        if !(mean.is_finite() && mean > 0.0) {
            return Err(Error::Invalid(format!(
                "{origin}: signature `{sig}`: the distribution's mean must be positive (got {mean})"
            )));
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
                // A measured signature like `gemm_8192x8192x8192`: say which row name applies it.
                let hint = sig
                    .split(['_', '-', ':', ' '])
                    .next()
                    .filter(|c| OpClass::from_name(c).is_some())
                    .map(|c| {
                        format!(
                            "; to apply this fit to every {c} kernel, name its row `{c}` (jitter \
                             is per class or per kernel, not per shape)"
                        )
                    })
                    .unwrap_or_default();
                return Err(Error::Invalid(format!(
                    "{origin}: signature `{sig}` is neither an op class (gemm, attention, norm, \
                     softmax, elementwise, embedding, loss, router, optimizer, framework, all), \
                     nor `comm`, nor the name of a kernel of this job ({}){hint}",
                    names.iter().copied().collect::<Vec<_>>().join(", ")
                )));
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

/// Where the step samples sit: `samples` samples spread over `clusters` clusters, sample `i` on
/// cluster `i % clusters` as that cluster's `i / clusters`-th sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Design {
    /// Step samples in all.
    pub samples: u64,
    /// Clusters (at least 1, at most `samples`).
    pub clusters: u64,
}

impl Design {
    /// `samples` samples on `clusters` clusters (clamped to `1..=samples`).
    pub fn new(samples: u64, clusters: u64) -> Self {
        Design {
            samples,
            clusters: clusters.clamp(1, samples.max(1)),
        }
    }

    /// The cluster of sample `i`.
    pub fn cluster(&self, i: u64) -> u64 {
        i % self.clusters
    }

    /// How many samples cluster `k` holds.
    pub fn size(&self, k: u64) -> u64 {
        (self.samples + self.clusters - 1 - k) / self.clusters
    }

    /// The stratum of sample `i` within its cluster and the cluster's size: `(j, n)`.
    pub fn stratum(&self, i: u64) -> (u64, u64) {
        (i / self.clusters, self.size(self.cluster(i)))
    }
}

/// Draws the perturbation of sample `i` of `design`: the persistent per-GPU speeds belong to
/// the cluster (the same GPUs for every step of a run); kernel jitter and the communication
/// regime are fresh for every iteration, the regime stratified within the cluster.
pub fn draw_in(job: &Job, v: &Variability, seed: u64, i: u64, design: Design) -> Perturbation {
    let n = job.num_gpus() as usize;
    let mut rng = stats::stream_rng(seed, &[1, design.cluster(i)]);
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
        comm_factor: comm_factor(v, seed, i, design),
        seed: stats::stream_rng(seed, &[2, i]).random::<u64>(),
    }
}

/// The communication regime of sample `i`. A cluster of `n > 1` samples is stratified: its
/// `j`-th sample draws the regime's quantile at a uniform point of `[j / n, (j + 1) / n)`, so
/// that the cluster's samples, each weighted `1 / n` as its runs draw them, cover the regime's
/// law evenly. Each sample of a random cluster still has the regime's law on average over the
/// strata, and a run's mean step time, which is what the whole run sums, no longer carries
/// the noise of `n` independent regime draws (docs/predict.md, "The guarantee").
fn comm_factor(v: &Variability, seed: u64, i: u64, design: Design) -> f64 {
    let Some(c) = &v.comm_regime else {
        return 1.0;
    };
    let mut rng = stats::stream_rng(seed, &[4, i]);
    let (j, n) = design.stratum(i);
    let x = if n <= 1 {
        c.factor.sample(&mut rng)
    } else {
        let u: f64 = rng.random();
        c.factor.quantile((j as f64 + u) / n as f64)
    };
    x.max(1e-3)
}

/// The compiled step model and its fast statistics, when [`sample_steps`] used them.
pub type FastModel = (StepModel, FastStats);

/// Monte Carlo step times of `samples` iterations (sample `i` on cluster `i % clusters`), with
/// the max-plus step model when the job and the jitter allow it (unless `per_rank`), otherwise
/// with the per-rank engine; `bar` advances once per sample. Returns the samples in index
/// order, a description of the method used, and the step model it used (if any).
#[allow(clippy::too_many_arguments)]
pub fn sample_steps(
    job: &Job,
    v: &Variability,
    seed: u64,
    samples: u64,
    clusters: u64,
    per_rank: bool,
    shortcuts: Shortcuts,
    base_opts: &SimOptions,
    progress: &Progress<'_>,
) -> Result<(Vec<f64>, String, Option<FastModel>), Error> {
    sample_steps_frozen(
        job, v, seed, samples, clusters, per_rank, shortcuts, base_opts, None, progress,
    )
}

/// [`sample_steps`], compiling the step model from `frozen` (the durations of an earlier
/// deterministic run of the same job and options) when given, instead of running the engine
/// again.
#[allow(clippy::too_many_arguments)]
pub fn sample_steps_frozen(
    job: &Job,
    v: &Variability,
    seed: u64,
    samples: u64,
    clusters: u64,
    per_rank: bool,
    shortcuts: Shortcuts,
    base_opts: &SimOptions,
    frozen: Option<&Frozen>,
    progress: &Progress<'_>,
) -> Result<(Vec<f64>, String, Option<FastModel>), Error> {
    use rayon::prelude::*;
    // The max-plus step model (frozen communication durations, exact order-statistic draws)
    // when the job and the jitter allow it; otherwise every rank runs in the engine.
    let design = Design::new(samples, clusters);
    let probe = draw_in(job, v, seed, 0, design);
    // Why the step model was not used, when it was not.
    let mut why_not: Option<String> = None;
    let step_model = if per_rank {
        why_not = Some("--per-rank".into());
        None
    } else if probe.is_symmetric() {
        None
    } else {
        let model = match frozen {
            Some(f) => StepModel::with_frozen(job, f),
            None => StepModel::new(job, base_opts),
        };
        let pools = if shortcuts.pool {
            PoolSettings::default()
        } else {
            PoolSettings::OFF
        };
        match model.and_then(|m| m.fast_stats_with(&probe, pools).map(|f| (m, f))) {
            Ok(model) => Some(model),
            Err(e) => {
                why_not = Some(e.to_string());
                None
            }
        }
    };
    let method = match (&step_model, probe.is_symmetric()) {
        (_, true) => "ranks stay symmetric: one representative per stage, exact".to_string(),
        (Some((_, fast)), false) => {
            let mut m =
                "max-plus step model: every GPU, frozen communication durations".to_string();
            let pooled = fast.pooled_shapes();
            if !pooled.is_empty() {
                m += &format!(
                    "; {} lane-racing blocks per sample drawn from per-sample pools of exact draws",
                    pooled.iter().sum::<u64>()
                );
            }
            m
        }
        (None, false) => format!(
            "every rank simulated by the engine ({})",
            why_not.as_deref().unwrap_or("step model unavailable")
        ),
    };
    if let Some((m, fast)) = &step_model {
        let steps = step_model_samples(
            job,
            v,
            seed,
            samples,
            clusters,
            shortcuts.prune,
            m,
            fast,
            progress,
        )?;
        return Ok((steps, method, step_model));
    }
    // Exact shortcut: iterations that cannot differ are simulated once. A symmetric
    // perturbation (no per-kernel draws, one factor for every rank) is fixed by its rank
    // factor and its communication factor; samples that share both share the iteration.
    let keys: Vec<Option<(u64, u64)>> = (0..samples)
        .into_par_iter()
        .map(|i| symmetric_key(&draw_in(job, v, seed, i, design)))
        .collect();
    // Each distinct key: its first sample (simulated) and how many samples share it.
    let mut distinct: BTreeMap<(u64, u64), (u64, u64)> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        if let Some(k) = k {
            distinct.entry(*k).or_insert((i as u64, 0)).1 += 1;
        }
    }
    let firsts: Vec<((u64, u64), (u64, u64))> = distinct.into_iter().collect();
    let shared: BTreeMap<(u64, u64), f64> = firsts
        .par_iter()
        .map(|&(k, (i, count))| {
            let t = simulate_sample(job, v, seed, i, design, base_opts);
            progress(count);
            t.map(|t| (k, t))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| Error::sim("simulation failed", e))?;
    let steps: Vec<f64> = (0..samples)
        .into_par_iter()
        .map(|i| match keys[i as usize] {
            Some(k) => Ok(shared[&k]),
            None => {
                let t = simulate_sample(job, v, seed, i, design, base_opts);
                progress(1);
                t
            }
        })
        .collect::<Result<Vec<f64>, _>>()
        .map_err(|e| Error::sim("simulation failed", e))?;
    Ok((steps, method, step_model))
}

/// What makes a symmetric perturbation's iteration: its rank factor (the same for every rank)
/// and its communication factor, as bits; `None` for an asymmetric perturbation.
fn symmetric_key(p: &Perturbation) -> Option<(u64, u64)> {
    p.is_symmetric().then(|| {
        let rank = p.rank_factor.first().copied().unwrap_or(1.0);
        (rank.to_bits(), p.comm_factor.to_bits())
    })
}

/// Iteration time of sample `i` in the engine: one representative per stage when the sample's
/// perturbation keeps the ranks symmetric (a shared network regime only), else every rank.
fn simulate_sample(
    job: &Job,
    v: &Variability,
    seed: u64,
    i: u64,
    design: Design,
    base_opts: &SimOptions,
) -> Result<f64, SimError> {
    let p = draw_in(job, v, seed, i, design);
    let mode = if p.is_symmetric() {
        Mode::Reduced
    } else {
        Mode::Full
    };
    let opts = SimOptions {
        mode,
        ..p.options(base_opts)
    };
    prism_core::engine::simulate_or_full(job, &opts).map(|r| r.summary.iteration_time_s)
}

/// Step-model samples, cluster by cluster. With per-GPU speeds and at least three samples in
/// a cluster (and `prune`), the cluster's samples with the lowest and the highest
/// communication regime are evaluated in full as pilots, and the others skip the replicas the
/// pilots prove irrelevant ([`StepModel::sample_pruned`]): the same
/// samples, faster.
#[allow(clippy::too_many_arguments)]
fn step_model_samples(
    job: &Job,
    v: &Variability,
    seed: u64,
    samples: u64,
    clusters: u64,
    prune: bool,
    m: &StepModel,
    fast: &FastStats,
    progress: &Progress<'_>,
) -> Result<Vec<f64>, Error> {
    use rayon::prelude::*;
    let design = Design::new(samples, clusters);
    let clusters = design.clusters;
    let by_cluster = (0..clusters)
        .into_par_iter()
        .map(|k| -> Result<Vec<(u64, f64)>, SimError> {
            let idx: Vec<u64> = (k..samples).step_by(clusters as usize).collect();
            let rank_factor = draw_in(job, v, seed, k, design).rank_factor;
            let comm: Vec<f64> = idx
                .iter()
                .map(|&i| comm_factor(v, seed, i, design))
                .collect();
            // Sample j of the cluster, pruned when there is a pruner.
            let one = |j: usize, pruner: Option<&Pruner>| -> Result<(u64, f64), SimError> {
                let (i, c) = (idx[j], comm[j]);
                let t = match pruner {
                    Some(p) => {
                        m.sample_pruned(fast, p, &rank_factor, c, sample_seed(seed, i))?
                            .0
                    }
                    None => m.sample_fast(fast, &rank_factor, c, sample_seed(seed, i))?,
                };
                progress(1);
                Ok((i, t))
            };
            if !prune || rank_factor.is_empty() || idx.len() < 3 {
                return (0..idx.len())
                    .into_par_iter()
                    .map(|j| one(j, None))
                    .collect();
            }
            // The pilots: the highest regime in full, then the lowest (the first on ties)
            // pruned by the highest alone.
            let by = |better: fn(f64, f64) -> bool| {
                (0..comm.len()).fold(0, |b, j| if better(comm[j], comm[b]) { j } else { b })
            };
            let (lo, hi) = (by(|a, b| a < b), by(|a, b| a > b));
            let (th, ph) =
                m.sample_pilot(fast, &rank_factor, comm[hi], sample_seed(seed, idx[hi]))?;
            progress(1);
            let mut out = vec![(idx[hi], th)];
            let pl = match Pruner::new(m, fast, &rank_factor, &ph, None) {
                Some(flat) if lo != hi => {
                    let (tl, pl) = m.sample_pruned_pilot(
                        fast,
                        &flat,
                        &rank_factor,
                        comm[lo],
                        sample_seed(seed, idx[lo]),
                    )?;
                    progress(1);
                    out.push((idx[lo], tl));
                    Some(pl)
                }
                _ => None,
            };
            let pruner = Pruner::new(m, fast, &rank_factor, &ph, pl.as_ref());
            let rest = (0..idx.len())
                .into_par_iter()
                .filter(|&j| j != hi && (j != lo || out.len() == 1))
                .map(|j| one(j, pruner.as_ref()))
                .collect::<Result<Vec<_>, _>>()?;
            out.extend(rest);
            Ok(out)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::sim("simulation failed", e))?;
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

/// Entries printed and put in the JSON.
pub const TOP_CONTRIBUTORS: usize = 10;

/// The critical-path attribution of the Monte Carlo sample at the p95 step time.
#[derive(Clone, Debug)]
pub struct P95Attribution {
    /// Sample index and its step time.
    pub sample: u64,
    pub step_s: f64,
    /// How the path was found.
    pub method: &'static str,
    /// True when every rank is a candidate of the path (else one DP replica per stage).
    pub all_ranks: bool,
    /// Ops and collectives: (name, class, seconds), largest first.
    pub ops: Vec<(String, String, f64)>,
    /// Ranks and tensor-parallel groups: (name, kind, seconds), largest first.
    pub who: Vec<(String, String, f64)>,
    pub path_s: f64,
    pub wait_s: f64,
}

/// Attributes the sample whose step time is the smallest at or above `p95` (the first such
/// sample on ties). With the step model: the model's own critical path of that sample (the same
/// draws, every GPU). Otherwise the sample is re-simulated by the engine with the same
/// perturbation, recording every rank for jobs of up to 4096 GPUs; larger jobs record the ranks
/// of the first data-parallel replica of every stage (all its tp x cp ranks), so the path is
/// followed across stages and tensor/context groups but waits on a straggler outside that
/// replica are charged to the collective it delays.
#[allow(clippy::too_many_arguments)]
pub fn p95_attribution(
    job: &Job,
    v: &Variability,
    seed: u64,
    clusters: u64,
    samples: &[f64],
    p95: f64,
    base_opts: &SimOptions,
    step_model: Option<&FastModel>,
) -> Result<P95Attribution, Error> {
    let (i, &step_s) = samples
        .iter()
        .enumerate()
        .filter(|(_, t)| **t >= p95)
        .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(&b.0)))
        .or_else(|| samples.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)))
        .ok_or_else(|| Error::Invalid("no step-time samples".into()))?;
    let p = draw_in(
        job,
        v,
        seed,
        i as u64,
        Design::new(samples.len() as u64, clusters),
    );
    let top_ops = |by_op: &[(String, f64)], class_of: &BTreeMap<String, String>| {
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
            .map_err(|e| Error::sim("p95 critical path failed", e))?;
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
    // A symmetric perturbation keeps the ranks alike: the recorded ranks alone, with the rest
    // replayed from symmetry, give exactly the full run's timings.
    let mode = if p.is_symmetric() {
        Mode::Slice(record_ranks.clone())
    } else {
        Mode::Full
    };
    let opts = SimOptions {
        mode,
        record_ranks,
        ..p.options(base_opts)
    };
    let r = prism_core::engine::simulate_or_full(job, &opts)
        .map_err(|e| Error::sim("p95 re-simulation failed", e))?;
    let attr = crate::attribution::critical_path(&r);
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
    pub fn top(&self) -> Vec<(String, String, f64)> {
        self.ops.iter().chain(&self.who).cloned().collect()
    }

    pub fn share(&self, t: f64) -> f64 {
        if self.path_s > 0.0 {
            t / self.path_s
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::variability::{CommRegime, GpuSpeed};
    use prism_core::job::fixtures::small_job;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Step samples from `sample_steps` and, independently, one engine run per sample.
    fn shortcut_and_direct(v: &Variability, samples: u64) -> (Vec<f64>, Vec<f64>, u64) {
        let job = small_job(2, 2, 2, 16);
        let base = SimOptions::default();
        let ticks = AtomicU64::new(0);
        let (steps, _, model) = sample_steps(
            &job,
            v,
            3,
            samples,
            2,
            false,
            Shortcuts::default(),
            &base,
            &|n| {
                ticks.fetch_add(n, Ordering::Relaxed);
            },
        )
        .unwrap();
        assert!(model.is_none(), "symmetric samples use the engine");
        let direct = (0..samples)
            .map(|i| simulate_sample(&job, v, 3, i, Design::new(samples, 2), &base).unwrap())
            .collect();
        (steps, direct, ticks.into_inner())
    }

    /// Samples that cannot differ are simulated once, and every sample still gets exactly the
    /// time its own engine run gives; the progress count is one per sample either way.
    #[test]
    fn measured_signatures_are_refused_with_the_row_name_that_applies_them() {
        let job = prism_core::job::fixtures::small_job(2, 2, 2, 16);
        let mut table = BTreeMap::new();
        table.insert(
            "gemm_8192x8192x8192".to_string(),
            Dist::LogNormal {
                mu: -6.5,
                sigma: 0.04,
            },
        );
        let e = with_fit_table(&job, Variability::default(), &table, "fit.csv").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("gemm_8192x8192x8192") && msg.contains("name its row `gemm`"),
            "{msg}"
        );
        // Renamed as the error says, it applies.
        let mut renamed = BTreeMap::new();
        renamed.insert("gemm".to_string(), table["gemm_8192x8192x8192"].clone());
        assert!(with_fit_table(&job, Variability::default(), &renamed, "fit.csv").is_ok());
    }

    #[test]
    fn identical_iterations_are_simulated_once() {
        let constant = Variability {
            gpu_speed: Some(GpuSpeed {
                factor: Dist::Constant(1.1),
                outlier_fraction: 0.0,
                outlier_slowdown: 1.0,
            }),
            comm_regime: Some(CommRegime {
                factor: Dist::Constant(1.3),
            }),
            ..Variability::default()
        };
        let varying = Variability {
            comm_regime: Some(CommRegime {
                factor: Dist::LogNormal {
                    mu: 0.0,
                    sigma: 0.2,
                },
            }),
            ..Variability::default()
        };
        for (v, distinct) in [(Variability::default(), 1), (constant, 1), (varying, 9)] {
            let (steps, direct, ticks) = shortcut_and_direct(&v, 9);
            assert_eq!(steps, direct);
            assert_eq!(ticks, 9);
            let mut d = steps.clone();
            d.sort_by(f64::total_cmp);
            d.dedup();
            assert_eq!(d.len(), distinct, "{v:?}");
        }
        // A constant 1.1 on every GPU slows the iteration; nothing varies between samples.
        let (slow, _, _) = shortcut_and_direct(
            &Variability {
                gpu_speed: Some(GpuSpeed {
                    factor: Dist::Constant(1.1),
                    outlier_fraction: 0.0,
                    outlier_slowdown: 1.0,
                }),
                ..Variability::default()
            },
            3,
        );
        let (plain, _, _) = shortcut_and_direct(&Variability::default(), 3);
        assert!(slow[0] > plain[0] && slow.iter().all(|t| *t == slow[0]));
    }
}
