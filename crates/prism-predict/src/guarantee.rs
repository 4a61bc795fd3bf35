//! Bounds and Monte Carlo errors that respect how `prism predict` samples.
//!
//! `prism predict` draws its randomness in *clusters*: a cluster draws every GPU's persistent
//! speed once, its step samples all run on those GPUs, and the end-to-end runs assigned to it
//! draw their iterations from its step samples (and their failures, checkpoints and fail-slow
//! episodes from streams of their own). Two values of one cluster are therefore dependent,
//! while two clusters are independent and identically distributed: each is a function of its
//! own random streams only. The independent unit is the cluster, never the single run.
//!
//! - [`cluster_quantile_bound`]: an upper confidence bound of a quantile of the pooled law
//!   (the law of one value of a random cluster), valid for any dependence inside a cluster and
//!   any law across clusters. It needs at least [`min_clusters`] clusters.
//! - [`cluster_bootstrap`]: the standard error and a 95% interval of the reported quantiles,
//!   resampling whole clusters.
//!
//! # The bound
//!
//! For a threshold `t`, let `Y_c(t)` be the fraction of cluster `c`'s values at or below `t`.
//! The `Y_c(t)` are independent, lie in `[0, 1]` and have mean `F(t)`, the pooled CDF. The
//! bound certifies `F(t) >= q` by testing the hypothesis `F(t) <= q` with a bet (Waudby-Smith &
//! Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2024): wealth
//! starts at 1 and is multiplied by `1 + lambda_c (Y_c - q)` for each cluster in index order,
//! `lambda_c >= 0` chosen from the clusters before `c` only (a plug-in of their mean and
//! variance, capped at `BET_CAP / q`). Under the hypothesis the wealth is a non-negative
//! supermartingale, so it reaches `1 / alpha` with probability at most `alpha` (Ville's
//! inequality). The bound is found by stepping down the candidate thresholds (the values
//! themselves) from the largest and stopping at the first that fails the test; it is the last
//! that passed.
//!
//! Why it holds: let `xi` be the true `q`-quantile. If the bound were below `xi`, every
//! candidate from the bound up passed, in particular the largest candidate below `xi`, whose
//! fractions `Y_c` equal the fractions of values strictly below `xi`. Their mean is
//! `P(T < xi) <= q`, so that one test passes with probability at most `alpha`. Hence
//! `P(bound >= xi) >= 1 - alpha = confidence`, whatever the law inside or across clusters.
//!
//! With every cluster's values below `t`, each bet multiplies the wealth by at most `1 / q`, so
//! no threshold passes with fewer than about `ln(1 / alpha) / ln(1 / q)` clusters (59 for the
//! 0.95 quantile at 95%, 299 for the 0.99 quantile); [`min_clusters`] is the exact count for
//! this test.

use rand::RngExt;

use crate::stats::{quantile_sorted, stream_rng};

/// Largest bet as a fraction of `1 / q`: a cluster with every value above the threshold keeps
/// `1 - BET_CAP` of the wealth instead of losing all of it.
const BET_CAP: f64 = 0.95;

/// The plug-in's prior: one pseudo-cluster with mean 1 and variance 0.05 (it only steers the
/// first bets; the bound is valid for any prior).
const PRIOR_MEAN: f64 = 1.0;
const PRIOR_VAR: f64 = 0.05;

/// Log-wealth of the bet on "mean of `ys` > q" (see the module documentation).
fn log_wealth(ys: impl Iterator<Item = f64>, q: f64) -> f64 {
    let (mut n, mut sum, mut ss, mut log_w) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for y in ys {
        let mean = (PRIOR_MEAN + sum) / (1.0 + n);
        let var = (PRIOR_VAR + ss) / (1.0 + n);
        let edge = mean - q;
        let lambda = (edge / (var + edge * edge)).clamp(0.0, BET_CAP / q);
        log_w += (lambda * (y - q)).ln_1p();
        n += 1.0;
        sum += y;
        let m = (PRIOR_MEAN + sum) / (1.0 + n);
        ss += (y - m) * (y - m);
    }
    log_w
}

fn args_ok(q: f64, confidence: f64) -> bool {
    q > 0.0 && q < 1.0 && confidence > 0.0 && confidence < 1.0
}

/// The most clusters [`min_clusters`] looks through.
pub const MAX_MIN_CLUSTERS: u64 = 100_000_000;

/// The fewest independent clusters with which [`cluster_quantile_bound`] can certify the
/// `q`-quantile at `confidence` at all: the smallest `K` for which `K` clusters with every
/// value at or below a threshold pass the test (62 for 0.95 / 0.95, 24 for 0.90 / 0.90, 315
/// for 0.99 / 0.95). `None` for arguments outside (0, 1) or past [`MAX_MIN_CLUSTERS`].
pub fn min_clusters(q: f64, confidence: f64) -> Option<u64> {
    if !args_ok(q, confidence) {
        return None;
    }
    let need = (1.0 / (1.0 - confidence)).ln();
    // Wealth with all fractions 1 grows with every cluster: bisect on K.
    let passes = |k: u64| log_wealth((0..k).map(|_| 1.0), q) >= need;
    let mut hi = 1u64;
    while !passes(hi) {
        if hi >= MAX_MIN_CLUSTERS {
            return None;
        }
        hi = (hi * 2).min(MAX_MIN_CLUSTERS);
    }
    let mut lo = hi / 2 + 1;
    if hi == 1 {
        return Some(1);
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if passes(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// Why a cluster bound is missing.
#[derive(Clone, Debug, PartialEq)]
pub enum NoBound {
    /// Fewer independent clusters than any threshold could pass with.
    TooFewClusters {
        /// Clusters with at least one value.
        clusters: u64,
        /// The fewest that could do ([`min_clusters`]).
        needed: u64,
    },
    /// Enough clusters, but even the largest finite value does not pass (too many values
    /// beyond it, such as runs that never finish, or too much spread between clusters).
    NotReached,
    /// `q` or the confidence is not strictly between 0 and 1.
    BadArguments,
}

impl std::fmt::Display for NoBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoBound::TooFewClusters { clusters, needed } => write!(
                f,
                "{clusters} independent clusters of GPUs; a bound at this quantile and \
                 confidence needs at least {needed} (raise --clusters, and --samples with it)"
            ),
            NoBound::NotReached => write!(
                f,
                "even the largest sampled value is not a valid bound (too many runs beyond it or \
                 too much spread between clusters); raise --clusters"
            ),
            NoBound::BadArguments => write!(f, "quantile and confidence must be in (0, 1)"),
        }
    }
}

/// The upper confidence bound of the `q`-quantile of the pooled law of `groups` (one slice a
/// cluster, each sorted ascending, `+inf` for a value that never ends), valid at `confidence`
/// for independent clusters (module documentation). Empty groups are left out.
pub fn cluster_quantile_bound(groups: &[&[f64]], q: f64, confidence: f64) -> Result<f64, NoBound> {
    if !args_ok(q, confidence) {
        return Err(NoBound::BadArguments);
    }
    let groups: Vec<&[f64]> = groups.iter().copied().filter(|g| !g.is_empty()).collect();
    let k = groups.len() as u64;
    let needed = min_clusters(q, confidence).ok_or(NoBound::BadArguments)?;
    if k < needed {
        return Err(NoBound::TooFewClusters {
            clusters: k,
            needed,
        });
    }
    let need = (1.0 / (1.0 - confidence)).ln();
    let mut candidates: Vec<f64> = (groups.iter())
        .flat_map(|g| g.iter().copied())
        .filter(|x| x.is_finite())
        .collect();
    candidates.sort_by(|a, b| b.total_cmp(a));
    candidates.dedup();
    let passes = |t: f64| {
        let ys = (groups.iter()).map(|g| g.partition_point(|x| *x <= t) as f64 / g.len() as f64);
        log_wealth(ys, q) >= need
    };
    let mut best = None;
    for t in candidates {
        if passes(t) {
            best = Some(t);
        } else {
            break;
        }
    }
    best.ok_or(NoBound::NotReached)
}

/// Monte Carlo error of one reported quantile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantileError {
    /// Standard error (standard deviation over the bootstrap resamples).
    pub se: f64,
    /// 95% interval: the 2.5% and 97.5% points of the resampled quantile.
    pub lo: f64,
    pub hi: f64,
}

/// Resamples of [`cluster_bootstrap`].
pub const BOOTSTRAP_RESAMPLES: u64 = 400;

/// The Monte Carlo error of the type-7 quantiles `probs` of the pooled values of `groups` (one
/// slice a cluster; non-finite values are left out, as in the reported summaries): a cluster
/// bootstrap (Davison & Hinkley 1997, sec. 3.8), drawing whole clusters with replacement, so
/// that the dependence inside a cluster counts. Seeded by `seed` (its own streams); `None` for
/// each quantile when fewer than two clusters hold values.
pub fn cluster_bootstrap(
    groups: &[&[f64]],
    probs: &[f64],
    seed: u64,
) -> Vec<Option<QuantileError>> {
    use rayon::prelude::*;
    let groups: Vec<Vec<f64>> = (groups.iter())
        .map(|g| {
            g.iter()
                .copied()
                .filter(|x| x.is_finite())
                .collect::<Vec<f64>>()
        })
        .filter(|g| !g.is_empty())
        .collect();
    let k = groups.len();
    if k < 2 {
        return vec![None; probs.len()];
    }
    let resampled: Vec<Vec<f64>> = (0..BOOTSTRAP_RESAMPLES)
        .into_par_iter()
        .map(|b| {
            let mut rng = stream_rng(seed, &[9, b]);
            let mut pool = Vec::new();
            for _ in 0..k {
                pool.extend_from_slice(&groups[rng.random_range(0..k)]);
            }
            probs
                .iter()
                .map(|&p| quantile_select(&mut pool, p))
                .collect()
        })
        .collect();
    (0..probs.len())
        .map(|i| {
            let mut xs: Vec<f64> = resampled.iter().map(|r| r[i]).collect();
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            let se = (xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)).sqrt();
            xs.sort_by(f64::total_cmp);
            Some(QuantileError {
                se,
                lo: quantile_sorted(&xs, 0.025),
                hi: quantile_sorted(&xs, 0.975),
            })
        })
        .collect()
}

/// The type-7 `p`-quantile of `xs` (any order; reordered), as [`quantile_sorted`] gives it on
/// the sorted values, by selection instead of a sort.
pub fn quantile_select(xs: &mut [f64], p: f64) -> f64 {
    let n = xs.len();
    if n == 0 || !(0.0..=1.0).contains(&p) {
        return f64::NAN;
    }
    let h = (n - 1) as f64 * p;
    let lo = h.floor() as usize;
    let (_, &mut a, above) = xs.select_nth_unstable_by(lo, f64::total_cmp);
    if lo + 1 >= n {
        return a;
    }
    let b = above.iter().copied().fold(f64::INFINITY, f64::min);
    a + (h - lo as f64) * (b - a)
}

/// The exact binomial (Clopper-Pearson) 95% interval of a proportion `k / n`.
pub fn clopper_pearson(k: u64, n: u64) -> (f64, f64) {
    use statrs::distribution::{Beta, ContinuousCDF};
    if n == 0 {
        return (0.0, 1.0);
    }
    let (kf, nf) = (k as f64, n as f64);
    let lo = if k == 0 {
        0.0
    } else {
        Beta::new(kf, nf - kf + 1.0).map_or(0.0, |b| b.inverse_cdf(0.025))
    };
    let hi = if k == n {
        1.0
    } else {
        Beta::new(kf + 1.0, nf - kf).map_or(1.0, |b| b.inverse_cdf(0.975))
    };
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_clusters_matches_the_all_below_case() {
        // The order-statistic floor ln(1/alpha) / ln(1/q) is a lower limit for any such test.
        for (q, c) in [(0.9, 0.9), (0.95, 0.95), (0.99, 0.95)] {
            let k = min_clusters(q, c).unwrap();
            let floor = (1.0 / (1.0 - c)).ln() / (1.0 / q).ln();
            assert!(k as f64 >= floor, "{q} {c}: {k} < {floor}");
            assert!((k as f64) < 1.2 * floor + 10.0, "{q} {c}: {k} vs {floor}");
            // One fewer cluster, all below: no bound.
            let ones: Vec<Vec<f64>> = (0..k - 1).map(|_| vec![1.0]).collect();
            let g: Vec<&[f64]> = ones.iter().map(|v| v.as_slice()).collect();
            assert!(matches!(
                cluster_quantile_bound(&g, q, c),
                Err(NoBound::TooFewClusters { .. })
            ));
            let ones: Vec<Vec<f64>> = (0..k).map(|_| vec![1.0]).collect();
            let g: Vec<&[f64]> = ones.iter().map(|v| v.as_slice()).collect();
            assert_eq!(cluster_quantile_bound(&g, q, c), Ok(1.0));
        }
    }

    #[test]
    fn selection_quantile_equals_the_sorted_one() {
        let mut rng = stream_rng(5, &[1]);
        for n in [1usize, 2, 3, 10, 101] {
            let xs: Vec<f64> = (0..n).map(|_| rng.random::<f64>()).collect();
            let mut sorted = xs.clone();
            sorted.sort_by(f64::total_cmp);
            for p in [0.0, 0.1, 0.5, 0.95, 0.99, 1.0] {
                let mut v = xs.clone();
                assert_eq!(
                    quantile_select(&mut v, p),
                    quantile_sorted(&sorted, p),
                    "{n} {p}"
                );
            }
        }
    }

    #[test]
    fn clopper_pearson_known_values() {
        // 18 of 20: the exact interval is (0.6830, 0.9877).
        let (lo, hi) = clopper_pearson(18, 20);
        assert!(
            (lo - 0.6830).abs() < 1e-4 && (hi - 0.9877).abs() < 1e-4,
            "{lo} {hi}"
        );
        assert_eq!(clopper_pearson(0, 10).0, 0.0);
        assert_eq!(clopper_pearson(10, 10).1, 1.0);
    }
}
