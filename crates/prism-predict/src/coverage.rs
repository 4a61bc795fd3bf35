//! `prism predict --check-coverage N`: does the guarantee hold at its stated confidence for this
//! job and these settings?
//!
//! It predicts the job `N` times with seeds `seed, seed + 1, ...` and the requested settings,
//! and once more as a *reference* with ten times the clusters (at least 200), the same samples
//! per cluster and at least 20 runs per cluster, on a seed of its own. The reference's
//! q-quantile of the training time (abandoned runs count as never finishing) stands in for the
//! true one; its own Monte Carlo error (cluster bootstrap) is reported beside it. A seed
//! *covers* when its guarantee is at or above the reference quantile; the observed coverage,
//! with its exact binomial 95% interval, should not fall below the nominal confidence.

use prism_core::engine::SimOptions;
use prism_core::job::Job;
use rand::RngExt;

use crate::guarantee::{QuantileError, clopper_pearson, cluster_bootstrap};
use crate::predict::{PredictOptions, Prediction, predict};
use crate::stats::{self, quantile_sorted};
use crate::variability::Variability;
use crate::{Error, Progress};

/// The reference's clusters per requested cluster.
pub const REFERENCE_CLUSTER_FACTOR: u64 = 10;
/// The reference's fewest clusters.
pub const REFERENCE_MIN_CLUSTERS: u64 = 200;
/// The reference's fewest runs per cluster.
pub const REFERENCE_MIN_RUNS_PER_CLUSTER: u64 = 20;

/// One quantity's coverage (the training time or the step time).
#[derive(Clone, Debug)]
pub struct Covered {
    /// The reference's q-quantile.
    pub reference_quantile: f64,
    /// Its Monte Carlo error (cluster bootstrap of the reference).
    pub reference_error: Option<QuantileError>,
    /// Each seed's guarantee (`None`: no valid bound).
    pub bounds: Vec<Option<f64>>,
    /// Seeds whose guarantee is at or above the reference quantile.
    pub covered: u64,
    /// Seeds that gave no bound (counted as not covering).
    pub no_bound: u64,
    /// `covered / seeds`, and its exact binomial 95% interval.
    pub observed: f64,
    pub interval: (f64, f64),
    /// Median of `(bound - reference) / reference` over the seeds with a bound.
    pub median_margin: f64,
}

/// What `--check-coverage` answers.
#[derive(Clone, Debug)]
pub struct Coverage {
    /// Seeds tried.
    pub seeds: u64,
    /// First seed.
    pub first_seed: u64,
    /// The guarantee's quantile and nominal confidence.
    pub quantile: f64,
    pub nominal: f64,
    /// Settings of each seed's prediction and of the reference.
    pub tried: PredictOptions,
    pub reference: PredictOptions,
    /// Training-time and step-time coverage.
    pub training: Covered,
    pub step: Covered,
    /// Wall time of each seed's prediction and of the reference, seconds.
    pub seed_wall_s: Vec<f64>,
    pub reference_wall_s: f64,
}

/// The reference settings for `opts`: ten times the clusters (at least
/// [`REFERENCE_MIN_CLUSTERS`]), the same samples per cluster, at least
/// [`REFERENCE_MIN_RUNS_PER_CLUSTER`] runs per cluster, and a seed no tried seed uses.
pub fn reference_options(opts: &PredictOptions, seeds: u64) -> PredictOptions {
    let clusters = opts.clusters.clamp(1, opts.samples.max(1));
    let per_cluster = opts.samples.div_ceil(clusters);
    let ref_clusters = (clusters * REFERENCE_CLUSTER_FACTOR).max(REFERENCE_MIN_CLUSTERS);
    let runs_per = opts
        .runs
        .div_ceil(clusters)
        .max(REFERENCE_MIN_RUNS_PER_CLUSTER);
    PredictOptions {
        samples: ref_clusters * per_cluster,
        clusters: ref_clusters,
        runs: ref_clusters * runs_per,
        seed: stats::stream_rng(opts.seed, &[12, seeds]).random::<u64>(),
        ..opts.clone()
    }
}

/// Runs `seeds` predictions of `opts` (seeds `opts.seed ..`) and the reference, and measures
/// how often the guarantee covers the reference quantile. `progress` counts samples and runs;
/// `now` is the caller's clock in seconds (the library reads none), used only for the wall
/// times it reports.
pub fn check_coverage(
    job: &Job,
    v: &Variability,
    opts: &PredictOptions,
    base_opts: &SimOptions,
    seeds: u64,
    progress: &Progress<'_>,
    now: &dyn Fn() -> f64,
) -> Result<Coverage, Error> {
    if seeds == 0 {
        return Err(Error::Invalid(
            "--check-coverage: the number of seeds must be at least 1".into(),
        ));
    }
    let reference = reference_options(opts, seeds);
    let start = now();
    let r = predict(job, v, &reference, base_opts, progress)?;
    let reference_wall_s = now() - start;
    let mut tried = Vec::with_capacity(seeds as usize);
    let mut seed_wall_s = Vec::with_capacity(seeds as usize);
    for k in 0..seeds {
        let o = PredictOptions {
            seed: opts.seed.wrapping_add(k),
            ..opts.clone()
        };
        let start = now();
        tried.push(predict(job, v, &o, base_opts, progress)?);
        seed_wall_s.push(now() - start);
    }
    let q = opts.quantile;
    let training = covered(
        &r.run_groups,
        &tried,
        q,
        |p| p.guarantee.training_s.clone().ok(),
        reference.seed,
    );
    let step = covered(
        &r.step_groups,
        &tried,
        q,
        |p| p.guarantee.step_s.clone().ok(),
        reference.seed,
    );
    Ok(Coverage {
        seeds,
        first_seed: opts.seed,
        quantile: q,
        nominal: opts.confidence,
        tried: opts.clone(),
        reference,
        training,
        step,
        seed_wall_s,
        reference_wall_s,
    })
}

fn covered(
    reference_groups: &[Vec<f64>],
    tried: &[Prediction],
    q: f64,
    bound: impl Fn(&Prediction) -> Option<f64>,
    seed: u64,
) -> Covered {
    let mut pooled: Vec<f64> = reference_groups.iter().flatten().copied().collect();
    pooled.sort_by(f64::total_cmp);
    let reference_quantile = quantile_sorted(&pooled, q);
    let g: Vec<&[f64]> = reference_groups.iter().map(Vec::as_slice).collect();
    let reference_error = cluster_bootstrap(&g, &[q], seed)[0];
    let bounds: Vec<Option<f64>> = tried.iter().map(bound).collect();
    let n = bounds.len() as u64;
    let covered = (bounds.iter())
        .filter(|b| b.is_some_and(|b| b >= reference_quantile))
        .count() as u64;
    let mut margins: Vec<f64> = (bounds.iter().flatten())
        .map(|b| (b - reference_quantile) / reference_quantile)
        .collect();
    margins.sort_by(f64::total_cmp);
    Covered {
        reference_quantile,
        reference_error,
        bounds: bounds.clone(),
        covered,
        no_bound: bounds.iter().filter(|b| b.is_none()).count() as u64,
        observed: covered as f64 / n as f64,
        interval: clopper_pearson(covered, n),
        median_margin: quantile_sorted(&margins, 0.5),
    }
}
