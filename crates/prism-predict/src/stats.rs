//! Statistics for variability: seeded random streams, the [`Dist`] distributions (sampling,
//! mean, CDF, quantile), maximum-likelihood fits of measured durations, empirical quantiles and
//! distribution-free confidence bounds.
//!
//! Everything here is a pure function of its arguments: the only randomness comes from
//! generators the caller seeds ([`stream_rng`]), so a Monte Carlo draw depends on the seed and the
//! stream id alone, never on thread count or evaluation order.
//!
//! # Conventions
//!
//! * **Normal is truncated.** A [`Dist::Normal`] describes a positive quantity, so values below
//!   `NORMAL_FLOOR_FRACTION * mean` (one thousandth of the mean) are raised to that floor. The
//!   floor is relative, so it does not depend on the unit. [`Dist::sample`], [`Dist::cdf`],
//!   [`Dist::quantile`] and [`Dist::mean`] all describe this clamped distribution (a point mass
//!   at the floor); for the usual `std << mean` the difference from the plain normal is
//!   negligible (below `Phi(-5)` for a coefficient of variation of 0.2).
//! * **Empirical** draws one of its values uniformly; its CDF is the empirical CDF and its
//!   quantile the inverse empirical CDF (smallest value whose ECDF reaches `p`), so that
//!   `quantile(U)` for `U ~ Uniform(0,1)` has the same law as [`Dist::sample`].
//! * Methods on a distribution that fails [`Dist::validate`] return NaN; they never panic.
//!
//! # Fitting
//!
//! [`fit_normal`], [`fit_lognormal`] and [`fit_gamma`] are maximum-likelihood fits; each
//! reports the Kolmogorov-Smirnov distance between the fitted CDF and the sample.
//! [`fit_best`] fits all three and picks the smallest KS distance. With parameters estimated
//! from the same sample the usual KS critical values are conservative (Lilliefors 1967), so the
//! KS distance here is a ranking and a goodness indication, not a formal test.
//!
//! # Quantile bounds
//!
//! [`quantile_upper_bound`] and [`guarantee`] use the binomial law of order statistics
//! (David & Nagaraja, *Order Statistics*, 3rd ed., 2003, sec. 7.1), which holds for any
//! distribution; [`dkw_epsilon`] is the Dvoretzky-Kiefer-Wolfowitz band with Massart's (1990)
//! tight constant.

use rand::RngExt;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp1, StandardNormal};
use rand_xoshiro::Xoshiro256PlusPlus;
use statrs::distribution::{Binomial, DiscreteCDF};
use statrs::function::erf::{erfc, erfc_inv};
use statrs::function::gamma::{checked_gamma_lr, checked_gamma_ur, digamma, ln_gamma};

use crate::variability::Dist;

/// Draws of a [`Dist::Normal`] below this fraction of its mean are raised to
/// `NORMAL_FLOOR_FRACTION * mean`.
pub const NORMAL_FLOOR_FRACTION: f64 = 1e-3;

// ------------------------------------------------------------------------------------------
// Seeded streams
// ------------------------------------------------------------------------------------------

/// SplitMix64 finaliser (Steele, Lea & Flood 2014): a bijective, well-mixed hash of `x`.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// An independent generator for stream `stream` of run `seed`.
///
/// The stream id is a path of integers (e.g. `[sample, rank, kind]`); it is hashed with `seed`
/// by SplitMix64 (`h = mix(seed ^ TAG); h = mix(h ^ mix(id))` for every id, then
/// `h = mix(h ^ len)`), and the hash seeds a Xoshiro256++ (whose `seed_from_u64` expands it
/// with SplitMix64). Draws therefore depend only on `(seed, stream)`: not on how many threads
/// run or in which order streams are created. Different ids (including ids that differ only by
/// length, such as `[]` and `[0]`) give unrelated sequences; equal ids give equal sequences.
/// The derivation is fixed: changing it changes every seeded result.
pub fn stream_rng(seed: u64, stream: &[u64]) -> Xoshiro256PlusPlus {
    const TAG: u64 = 0x5052_4953_4D5F_5354; // "PRISM_ST"
    let mut h = splitmix64(seed ^ TAG);
    for &id in stream {
        h = splitmix64(h ^ splitmix64(id));
    }
    h = splitmix64(h ^ stream.len() as u64);
    Xoshiro256PlusPlus::seed_from_u64(h)
}

// ------------------------------------------------------------------------------------------
// Distributions
// ------------------------------------------------------------------------------------------

/// Standard normal CDF `Phi(z) = erfc(-z / sqrt 2) / 2`.
pub(crate) fn std_normal_cdf(z: f64) -> f64 {
    0.5 * erfc(-z / std::f64::consts::SQRT_2)
}

/// Standard normal quantile `Phi^-1(p) = -sqrt 2 erfc^-1(2p)`, for `p` in `[0, 1]`.
pub fn std_normal_quantile(p: f64) -> f64 {
    if p <= 0.0 {
        f64::NEG_INFINITY
    } else if p >= 1.0 {
        f64::INFINITY
    } else {
        -std::f64::consts::SQRT_2 * erfc_inv(2.0 * p)
    }
}

/// Standard normal density.
fn std_normal_pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// Inverse empirical CDF of sorted values: `sorted[ceil(p n) - 1]` (at least the first).
fn inverse_ecdf(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let k = ((p * n as f64).ceil() as usize).clamp(1, n);
    sorted[k - 1]
}

/// Quantile of Gamma(shape `a`, scale 1) for `p` in `(0, 1)`.
///
/// Start: Wilson-Hilferty for `a > 1`, the start of Numerical Recipes' `invgammp` (3rd ed.,
/// sec. 6.2.1) for `a <= 1`; below the median, raised to the power-law lower bound
/// `(p Gamma(a + 1))^(1/a)` (never above the quantile, since `P(a, x) <= x^a / Gamma(a + 1)`).
/// Then Newton
/// steps in log space on the tail that holds the answer: `ln P(a, x) = ln p` in `ln x` for
/// `p <= 1/2`, `ln Q(a, x) = ln(1 - p)` in `x` above, so both tails keep their relative
/// precision. A bracket of the root turns any step that leaves it into a bisection.
fn gamma_unit_quantile(a: f64, p: f64) -> f64 {
    let gln = ln_gamma(a);
    let upper = p > 0.5;
    let q = 1.0 - p; // exact for p >= 1/2 (Sterbenz)
    let target = if upper { q.ln() } else { p.ln() };
    let (mut lo, mut hi) = (0.0_f64, f64::INFINITY);
    let mut x = if a > 1.0 {
        let z = std_normal_quantile(p);
        a * (1.0 - 1.0 / (9.0 * a) + z / (3.0 * a.sqrt()))
            .max(0.0)
            .powi(3)
    } else {
        let t = 1.0 - a * (0.253 + a * 0.12);
        if p < t {
            ((p / t).ln() / a).exp()
        } else {
            1.0 - (-(p - t) / (1.0 - t)).ln_1p()
        }
    };
    if !upper {
        let power_law = ((p.ln() + ln_gamma(a + 1.0)) / a).exp();
        if power_law == 0.0 {
            // The quantile is below the smallest positive double (P(a, x) ~ x^a / Gamma(a+1)).
            return 0.0;
        }
        lo = power_law;
        x = x.max(power_law);
    }
    if !(x > 0.0 && x.is_finite()) {
        x = a;
    }
    for _ in 0..100 {
        let ln_pdf = -x + (a - 1.0) * x.ln() - gln;
        // f increases with x and vanishes at the quantile; `next` is the Newton step.
        let (f, next) = if upper {
            let ln_tail = gamma_ur(a, x).ln();
            let f = target - ln_tail;
            (f, x - f / (ln_pdf - ln_tail).exp())
        } else {
            let ln_tail = gamma_lr(a, x).ln();
            let f = ln_tail - target;
            (f, (x.ln() - f / (ln_pdf + x.ln() - ln_tail).exp()).exp())
        };
        if f.is_nan() {
            return f64::NAN;
        }
        if f == 0.0 {
            return x;
        }
        if f > 0.0 {
            hi = hi.min(x);
        } else {
            lo = lo.max(x);
        }
        let next = if next.is_finite() && next > lo && next < hi {
            next
        } else if !hi.is_finite() {
            2.0 * x.max(lo) + 1.0
        } else if upper || lo <= 0.0 {
            // Arithmetic bisection; from 0 on the lower tail, shrink geometrically instead.
            if lo > 0.0 { 0.5 * (lo + hi) } else { hi / 16.0 }
        } else {
            (lo * hi).sqrt()
        };
        // Newton converges quadratically: a relative step of 1e-12 leaves an error far below
        // the accuracy of the incomplete gamma function itself (about 1e-14 to 1e-10).
        if (next - x).abs() <= 1e-12 * x || lo >= hi {
            return next;
        }
        x = next;
    }
    x
}

/// `P(a, x)` without the panics of `statrs::function::gamma::gamma_lr` (`a > 0` assumed).
fn gamma_lr(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        0.0
    } else if x == f64::INFINITY {
        1.0
    } else {
        checked_gamma_lr(a, x).unwrap_or(f64::NAN)
    }
}

/// `Q(a, x) = 1 - P(a, x)` without panics (`a > 0` assumed).
fn gamma_ur(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        1.0
    } else if x == f64::INFINITY {
        0.0
    } else {
        checked_gamma_ur(a, x).unwrap_or(f64::NAN)
    }
}

impl Dist {
    /// The distribution of `k X` for `k > 0` (same family; e.g. a duration distribution divided
    /// by its mean becomes a time-factor distribution of mean 1).
    pub fn scaled(&self, k: f64) -> Dist {
        assert!(
            k.is_finite() && k > 0.0,
            "scale factor must be positive and finite"
        );
        match self {
            Dist::Constant(c) => Dist::Constant(c * k),
            Dist::Normal { mean, std } => Dist::Normal {
                mean: mean * k,
                std: std * k,
            },
            Dist::LogNormal { mu, sigma } => Dist::LogNormal {
                mu: mu + k.ln(),
                sigma: *sigma,
            },
            Dist::Gamma { shape, scale } => Dist::Gamma {
                shape: *shape,
                scale: scale * k,
            },
            Dist::Exponential { mean } => Dist::Exponential { mean: mean * k },
            Dist::Empirical(v) => Dist::Empirical(v.iter().map(|x| x * k).collect()),
        }
    }

    /// The family name: `constant`, `normal`, `lognormal`, `gamma`, `exponential` or
    /// `empirical` (the names of the distribution table, see `prism_io::samples`).
    pub fn family(&self) -> &'static str {
        match self {
            Dist::Constant(_) => "constant",
            Dist::Normal { .. } => "normal",
            Dist::LogNormal { .. } => "lognormal",
            Dist::Gamma { .. } => "gamma",
            Dist::Exponential { .. } => "exponential",
            Dist::Empirical(_) => "empirical",
        }
    }

    /// Checks the parameters: every value and mean positive and finite, standard deviations
    /// finite and non-negative, `mu` finite, an empirical list non-empty. The message names the
    /// family, the parameter and the value.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Dist::Constant(c) => {
                if !positive(*c) {
                    return Err(format!(
                        "constant value must be positive and finite (got {c})"
                    ));
                }
            }
            Dist::Normal { mean, std } => {
                if !positive(*mean) {
                    return Err(format!(
                        "normal mean must be positive and finite (got {mean})"
                    ));
                }
                if !non_negative(*std) {
                    return Err(format!("normal std must be finite and >= 0 (got {std})"));
                }
            }
            Dist::LogNormal { mu, sigma } => {
                if !mu.is_finite() {
                    return Err(format!("lognormal mu must be finite (got {mu})"));
                }
                if !non_negative(*sigma) {
                    return Err(format!(
                        "lognormal sigma must be finite and >= 0 (got {sigma})"
                    ));
                }
            }
            Dist::Gamma { shape, scale } => {
                if !positive(*shape) {
                    return Err(format!(
                        "gamma shape must be positive and finite (got {shape})"
                    ));
                }
                if !positive(*scale) {
                    return Err(format!(
                        "gamma scale must be positive and finite (got {scale})"
                    ));
                }
            }
            Dist::Exponential { mean } => {
                if !positive(*mean) {
                    return Err(format!(
                        "exponential mean must be positive and finite (got {mean})"
                    ));
                }
            }
            Dist::Empirical(values) => {
                if values.is_empty() {
                    return Err("empirical distribution needs at least one value".into());
                }
                if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !positive(**v)) {
                    return Err(format!(
                        "empirical value {} must be positive and finite (got {v})",
                        i + 1
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`Dist::validate`] without building a message (for the guards of the hot methods).
    fn is_valid(&self) -> bool {
        match self {
            Dist::Constant(c) => positive(*c),
            Dist::Normal { mean, std } => positive(*mean) && non_negative(*std),
            Dist::LogNormal { mu, sigma } => mu.is_finite() && non_negative(*sigma),
            Dist::Gamma { shape, scale } => positive(*shape) && positive(*scale),
            Dist::Exponential { mean } => positive(*mean),
            Dist::Empirical(v) => !v.is_empty() && v.iter().all(|x| positive(*x)),
        }
    }

    /// One draw. Normal draws are raised to `NORMAL_FLOOR_FRACTION * mean` (see the module
    /// docs); log-normal is `exp(mu + sigma Z)`, gamma uses Marsaglia-Tsang (`rand_distr`),
    /// exponential `mean * Exp(1)`, empirical a uniformly chosen value. NaN when the
    /// distribution is invalid.
    pub fn sample<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        if !self.is_valid() {
            return f64::NAN;
        }
        match self {
            Dist::Constant(c) => *c,
            Dist::Normal { mean, std } => {
                let z: f64 = StandardNormal.sample(rng);
                (mean + std * z).max(NORMAL_FLOOR_FRACTION * mean)
            }
            Dist::LogNormal { mu, sigma } => {
                let z: f64 = StandardNormal.sample(rng);
                (mu + sigma * z).exp()
            }
            Dist::Gamma { shape, scale } => match rand_distr::Gamma::new(*shape, *scale) {
                Ok(g) => g.sample(rng),
                Err(_) => f64::NAN,
            },
            Dist::Exponential { mean } => {
                let e: f64 = Exp1.sample(rng);
                mean * e
            }
            Dist::Empirical(values) => values[rng.random_range(0..values.len())],
        }
    }

    /// The mean of the distribution as sampled (for a normal, of the clamped normal:
    /// `mean + std (a Phi(a) + phi(a))` with `a = (floor - mean) / std`).
    pub fn mean(&self) -> f64 {
        if !self.is_valid() {
            return f64::NAN;
        }
        match self {
            Dist::Constant(c) => *c,
            Dist::Normal { mean, std } => {
                let floor = NORMAL_FLOOR_FRACTION * mean;
                if *std == 0.0 {
                    return mean.max(floor);
                }
                let a = (floor - mean) / std;
                mean + std * (a * std_normal_cdf(a) + std_normal_pdf(a))
            }
            Dist::LogNormal { mu, sigma } => (mu + 0.5 * sigma * sigma).exp(),
            Dist::Gamma { shape, scale } => shape * scale,
            Dist::Exponential { mean } => *mean,
            Dist::Empirical(values) => values.iter().sum::<f64>() / values.len() as f64,
        }
    }

    /// `P(X <= x)` for the distribution as sampled (clamped normal, empirical CDF). Uses the
    /// complementary error function and the regularized incomplete gamma function of `statrs`.
    pub fn cdf(&self, x: f64) -> f64 {
        if !self.is_valid() || x.is_nan() {
            return f64::NAN;
        }
        let step = |at: f64| if x >= at { 1.0 } else { 0.0 };
        match self {
            Dist::Constant(c) => step(*c),
            Dist::Normal { mean, std } => {
                let floor = NORMAL_FLOOR_FRACTION * mean;
                if x < floor {
                    0.0
                } else if *std == 0.0 {
                    step(*mean)
                } else {
                    std_normal_cdf((x - mean) / std)
                }
            }
            Dist::LogNormal { mu, sigma } => {
                if x <= 0.0 {
                    0.0
                } else if *sigma == 0.0 {
                    step(mu.exp())
                } else {
                    std_normal_cdf((x.ln() - mu) / sigma)
                }
            }
            Dist::Gamma { shape, scale } => gamma_lr(*shape, x / scale),
            Dist::Exponential { mean } => {
                if x <= 0.0 {
                    0.0
                } else {
                    -(-x / mean).exp_m1()
                }
            }
            Dist::Empirical(values) => {
                values.iter().filter(|v| **v <= x).count() as f64 / values.len() as f64
            }
        }
    }

    /// The `p`-quantile `inf { x : cdf(x) >= p }` for `p` in `[0, 1]` (NaN outside). For
    /// `U ~ Uniform(0, 1)`, `quantile(U)` has the law of [`Dist::sample`] (inverse-transform
    /// sampling). The gamma quantile inverts the regularized incomplete gamma function of
    /// `statrs` numerically (Halley steps from the Numerical Recipes start, relative accuracy
    /// about 1e-13); an empirical quantile costs O(n) unless its values are
    /// sorted (then O(1) after an O(n) sortedness check).
    pub fn quantile(&self, p: f64) -> f64 {
        if !self.is_valid() || !(0.0..=1.0).contains(&p) {
            return f64::NAN;
        }
        match self {
            Dist::Constant(c) => *c,
            Dist::Normal { mean, std } => {
                let floor = NORMAL_FLOOR_FRACTION * mean;
                if p == 0.0 {
                    return floor;
                }
                (mean + std * std_normal_quantile(p)).max(floor)
            }
            Dist::LogNormal { mu, sigma } => {
                if p == 0.0 {
                    return 0.0;
                }
                (mu + sigma * std_normal_quantile(p)).exp()
            }
            Dist::Gamma { shape, scale } => {
                if p == 0.0 {
                    return 0.0;
                }
                if p == 1.0 {
                    return f64::INFINITY;
                }
                gamma_unit_quantile(*shape, p) * scale
            }
            Dist::Exponential { mean } => -mean * (-p).ln_1p(),
            Dist::Empirical(values) => {
                if values.is_sorted() {
                    inverse_ecdf(values, p)
                } else {
                    let n = values.len();
                    let k = ((p * n as f64).ceil() as usize).clamp(1, n);
                    let mut copy = values.clone();
                    *copy.select_nth_unstable_by(k - 1, f64::total_cmp).1
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Fitting
// ------------------------------------------------------------------------------------------

/// A fitted distribution and how well it matches the sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The fitted distribution (normal, log-normal or gamma).
    pub dist: Dist,
    /// Kolmogorov-Smirnov distance `sup_x |F_n(x) - F(x)|` between the sample and `dist`.
    pub ks: f64,
    /// Sample size.
    pub n: usize,
}

/// Kolmogorov-Smirnov distance `D_n = sup_x |F_n(x) - F(x)|` between the empirical CDF of a
/// sample sorted ascending and a continuous `cdf`:
/// `max_i max(i/n - F(x_(i)), F(x_(i)) - (i-1)/n)` (exact for ties too). NaN when empty.
pub fn ks_statistic(sorted: &[f64], cdf: impl Fn(f64) -> f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    let nf = n as f64;
    let mut d: f64 = 0.0;
    for (i, &x) in sorted.iter().enumerate() {
        let f = cdf(x);
        if f.is_nan() {
            return f64::NAN;
        }
        d = d.max((i + 1) as f64 / nf - f).max(f - i as f64 / nf);
    }
    d
}

/// Checks a sample for fitting and returns it sorted.
fn fit_input(x: &[f64], family: &str, need_positive: bool) -> Result<Vec<f64>, String> {
    if x.len() < 2 {
        return Err(format!(
            "{family} fit needs at least 2 observations (got {})",
            x.len()
        ));
    }
    if let Some(v) = x.iter().find(|v| !v.is_finite()) {
        return Err(format!("{family} fit needs finite observations (got {v})"));
    }
    if need_positive && let Some(v) = x.iter().find(|v| **v <= 0.0) {
        return Err(format!(
            "{family} fit needs positive observations (got {v})"
        ));
    }
    if x.iter().all(|v| *v == x[0]) {
        return Err(format!(
            "{family} fit needs observations that are not all equal (all are {})",
            x[0]
        ));
    }
    let mut sorted = x.to_vec();
    sorted.sort_by(f64::total_cmp);
    Ok(sorted)
}

fn finish(dist: Dist, sorted: &[f64]) -> Result<Fit, String> {
    dist.validate()
        .map_err(|e| format!("fit produced an invalid distribution: {e}"))?;
    let ks = ks_statistic(sorted, |v| dist.cdf(v));
    Ok(Fit {
        dist,
        ks,
        n: sorted.len(),
    })
}

/// Maximum-likelihood normal fit: `mean = (1/n) sum x`, `std = sqrt((1/n) sum (x - mean)^2)`.
/// Needs at least two finite observations, not all equal, with a positive mean.
pub fn fit_normal(x: &[f64]) -> Result<Fit, String> {
    let sorted = fit_input(x, "normal", false)?;
    let n = sorted.len() as f64;
    let mean = sorted.iter().sum::<f64>() / n;
    let var = sorted.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    finish(
        Dist::Normal {
            mean,
            std: var.sqrt(),
        },
        &sorted,
    )
}

/// Maximum-likelihood log-normal fit: `mu = (1/n) sum ln x`,
/// `sigma = sqrt((1/n) sum (ln x - mu)^2)`. Needs at least two positive finite observations,
/// not all equal.
pub fn fit_lognormal(x: &[f64]) -> Result<Fit, String> {
    let sorted = fit_input(x, "lognormal", true)?;
    let n = sorted.len() as f64;
    let mu = sorted.iter().map(|v| v.ln()).sum::<f64>() / n;
    let var = sorted
        .iter()
        .map(|v| (v.ln() - mu) * (v.ln() - mu))
        .sum::<f64>()
        / n;
    finish(
        Dist::LogNormal {
            mu,
            sigma: var.sqrt(),
        },
        &sorted,
    )
}

/// Trigamma `psi'(x)` for `x > 0`: recurrence `psi'(x) = psi'(x+1) + 1/x^2` up to `x >= 10`,
/// then the asymptotic series (Abramowitz & Stegun 6.4.12), absolute error below 1e-12.
fn trigamma(mut x: f64) -> f64 {
    let mut acc = 0.0;
    while x < 10.0 {
        acc += 1.0 / (x * x);
        x += 1.0;
    }
    let r = 1.0 / x;
    let r2 = r * r;
    acc + r
        + 0.5 * r2
        + r * r2 * (1.0 / 6.0 - r2 * (1.0 / 30.0 - r2 * (1.0 / 42.0 - r2 * (1.0 / 30.0))))
}

/// Maximum-likelihood gamma fit. With `m` the sample mean and `s = ln m - (1/n) sum ln x`
/// (computed as `-(1/n) sum ln(x/m)`; `s > 0` by Jensen), the shape `k` solves
/// `ln k - psi(k) = s`: Minka's (2002) closed-form start
/// `k0 = (3 - s + sqrt((s - 3)^2 + 24 s)) / (12 s)` refined by Newton steps
/// `k <- k - (ln k - psi(k) - s) / (1/k - psi'(k))` to relative change 1e-12; then
/// `scale = m / k`. Needs at least two positive finite observations, not all equal.
pub fn fit_gamma(x: &[f64]) -> Result<Fit, String> {
    let sorted = fit_input(x, "gamma", true)?;
    let n = sorted.len() as f64;
    let m = sorted.iter().sum::<f64>() / n;
    let s = -sorted.iter().map(|v| (v / m).ln()).sum::<f64>() / n;
    if !(s > 0.0 && s.is_finite()) {
        return Err(format!(
            "gamma fit: the observations are too close to equal (ln mean - mean ln = {s:e})"
        ));
    }
    let mut k = (3.0 - s + ((s - 3.0) * (s - 3.0) + 24.0 * s).sqrt()) / (12.0 * s);
    for _ in 0..100 {
        let f = k.ln() - digamma(k) - s;
        let df = 1.0 / k - trigamma(k);
        let mut next = k - f / df;
        if !(next > 0.0 && next.is_finite()) {
            next = 0.5 * k;
        }
        let done = (next - k).abs() <= 1e-12 * k;
        k = next;
        if done {
            break;
        }
    }
    finish(
        Dist::Gamma {
            shape: k,
            scale: m / k,
        },
        &sorted,
    )
}

/// Fits normal, log-normal and gamma (in that order) and returns the one with the smallest KS
/// distance (the first on ties) and every family that could be fitted. An error only when no
/// family fits (it then lists every family's reason).
pub fn fit_best(x: &[f64]) -> Result<(Fit, Vec<Fit>), String> {
    if x.len() < 2 {
        return Err(format!(
            "fitting needs at least 2 observations (got {})",
            x.len()
        ));
    }
    let mut fits = Vec::new();
    let mut errors = Vec::new();
    for r in [fit_normal(x), fit_lognormal(x), fit_gamma(x)] {
        match r {
            Ok(f) => fits.push(f),
            Err(e) => errors.push(e),
        }
    }
    let best = fits
        .iter()
        .fold(None::<&Fit>, |best, f| match best {
            Some(b) if b.ks <= f.ks => Some(b),
            _ => Some(f),
        })
        .cloned();
    match best {
        Some(b) => Ok((b, fits)),
        None => Err(errors.join("; ")),
    }
}

// ------------------------------------------------------------------------------------------
// Empirical quantiles and bounds
// ------------------------------------------------------------------------------------------

/// The `p`-quantile of a sample sorted ascending, Hyndman & Fan (1996) type 7 (the default of R
/// and NumPy): with `h = (n - 1) p`, `x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h])`
/// (0-based). NaN when the sample is empty or `p` is outside `[0, 1]`.
pub fn quantile_sorted(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    if n == 0 || !(0.0..=1.0).contains(&p) {
        return f64::NAN;
    }
    let h = (n - 1) as f64 * p;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

fn bound_args_ok(n: usize, p: f64, confidence: f64) -> bool {
    n > 0 && p > 0.0 && p < 1.0 && confidence > 0.0 && confidence < 1.0
}

/// Distribution-free upper confidence bound of the `p`-quantile `xi_p = inf{x : F(x) >= p}`
/// from a sample sorted ascending: the order statistic `x_(k)` (1-based) with the smallest `k`
/// such that `BinomCDF(k - 1; n, p) >= confidence`.
///
/// For `n` i.i.d. draws from any distribution, `P(x_(k) >= xi_p) >= BinomCDF(k - 1; n, p)`
/// (equality for a continuous distribution): `x_(k) < xi_p` needs at least `k` draws below
/// `xi_p`, and each draw is below `xi_p` with probability at most `p`. So the returned bound
/// is at or above the true `p`-quantile with probability at least `confidence`.
///
/// `None` when even the maximum is not enough (`1 - p^n < confidence`, i.e.
/// `n < ln(1 - confidence) / ln p`: 59 draws for the 0.95-quantile at 95%), when the sample is
/// empty, or when `p` or `confidence` is not strictly between 0 and 1.
pub fn quantile_upper_bound(sorted: &[f64], p: f64, confidence: f64) -> Option<f64> {
    let n = sorted.len();
    if !bound_args_ok(n, p, confidence) {
        return None;
    }
    let bin = Binomial::new(p, n as u64).ok()?;
    // cdf(j) = P(Bin <= j), non-decreasing in j; find the smallest j in 0..n with
    // cdf(j) >= confidence, then k = j + 1.
    if bin.cdf((n - 1) as u64) < confidence {
        return None;
    }
    let (mut lo, mut hi) = (0usize, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if bin.cdf(mid as u64) >= confidence {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(sorted[lo])
}

/// Distribution-free lower confidence bound of the `p`-quantile: the order statistic `x_(k)`
/// with the largest `k` such that `1 - BinomCDF(k - 1; n, p) >= confidence`, so that
/// `P(x_(k) <= xi_p) >= confidence` for any distribution. `None` when even the minimum is not
/// enough (`1 - (1 - p)^n < confidence`) or the arguments are out of range.
pub fn quantile_lower_bound(sorted: &[f64], p: f64, confidence: f64) -> Option<f64> {
    let n = sorted.len();
    if !bound_args_ok(n, p, confidence) {
        return None;
    }
    let bin = Binomial::new(p, n as u64).ok()?;
    // sf(j) = P(Bin > j) = P(Bin >= j + 1), non-increasing; find the largest j in 0..n with
    // sf(j) >= confidence, then k = j + 1.
    if bin.sf(0) < confidence {
        return None;
    }
    let (mut lo, mut hi) = (0usize, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if bin.sf(mid as u64) >= confidence {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(sorted[lo])
}

/// The Dvoretzky-Kiefer-Wolfowitz half-width `eps = sqrt(ln(2 / alpha) / (2 n))`,
/// `alpha = 1 - confidence`: with probability at least `confidence`,
/// `sup_x |F_n(x) - F(x)| <= eps` (Massart 1990: valid for every `n` and every `F`). NaN when
/// `n == 0` or `confidence` is not strictly between 0 and 1.
pub fn dkw_epsilon(n: usize, confidence: f64) -> f64 {
    if n == 0 || !(confidence > 0.0 && confidence < 1.0) {
        return f64::NAN;
    }
    ((2.0 / (1.0 - confidence)).ln() / (2.0 * n as f64)).sqrt()
}

/// The time `t` that a fresh run `T` stays within with probability at least `q`, guaranteed
/// with the given confidence:
///
/// if `sorted` holds `n` i.i.d. observations of `T` (ascending), then with probability at
/// least `confidence` over those observations, the returned `t` satisfies `P(T <= t) >= q`.
///
/// It is the upper confidence bound of the `q`-quantile ([`quantile_upper_bound`]): on the
/// event `t >= xi_q` we have `P(T <= t) >= F(xi_q) >= q`. Distribution-free (no fitted
/// family); `None` when the sample is too small for the requested `q` and confidence.
pub fn guarantee(sorted: &[f64], q: f64, confidence: f64) -> Option<f64> {
    quantile_upper_bound(sorted, q, confidence)
}

/// Summary of a sample: mean, type-7 quantiles, extremes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary5 {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

/// Mean, p50, p90, p95, p99 ([`quantile_sorted`], type 7), min and max of `samples` (any
/// order; NaNs sort last by `total_cmp`). Every field is NaN for an empty sample.
pub fn summarize(samples: &[f64]) -> Summary5 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let q = |p| quantile_sorted(&sorted, p);
    Summary5 {
        mean: if sorted.is_empty() {
            f64::NAN
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        },
        p50: q(0.5),
        p90: q(0.9),
        p95: q(0.95),
        p99: q(0.99),
        min: sorted.first().copied().unwrap_or(f64::NAN),
        max: sorted.last().copied().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod scaled_tests {
    use super::*;

    #[test]
    fn scaling_scales_mean_and_quantiles() {
        for d in [
            Dist::Constant(2.0),
            Dist::Normal {
                mean: 3.0,
                std: 0.2,
            },
            Dist::LogNormal {
                mu: 0.3,
                sigma: 0.4,
            },
            Dist::Gamma {
                shape: 2.5,
                scale: 0.7,
            },
            Dist::Exponential { mean: 4.0 },
            Dist::Empirical(vec![1.0, 2.0, 5.0]),
        ] {
            let k = 1.0 / d.mean();
            let s = d.scaled(k);
            assert!((s.mean() - 1.0).abs() < 1e-9, "{d:?}");
            for p in [0.1, 0.5, 0.9] {
                assert!(
                    (s.quantile(p) - k * d.quantile(p)).abs() < 1e-9 * (1.0 + d.quantile(p)),
                    "{d:?} {p}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_trigamma_matches_known_values() {
        // psi'(1) = pi^2 / 6, psi'(1/2) = pi^2 / 2, psi'(10) = 0.105166335681...
        let pi2 = std::f64::consts::PI.powi(2);
        assert!((trigamma(1.0) - pi2 / 6.0).abs() < 1e-10);
        assert!((trigamma(0.5) - pi2 / 2.0).abs() < 1e-10);
        assert!((trigamma(10.0) - 0.105_166_335_681_685_4).abs() < 1e-10);
    }

    #[test]
    fn stats_quantile_sorted_type7() {
        let x = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile_sorted(&x, 0.0), 1.0);
        assert_eq!(quantile_sorted(&x, 1.0), 4.0);
        assert!((quantile_sorted(&x, 0.5) - 2.5).abs() < 1e-15);
        // NumPy: np.quantile([1,2,3,4], 0.9) = 3.7
        assert!((quantile_sorted(&x, 0.9) - 3.7).abs() < 1e-12);
        assert!(quantile_sorted(&[], 0.5).is_nan());
        assert!(quantile_sorted(&x, 1.5).is_nan());
    }

    #[test]
    fn stats_upper_bound_index_is_binomial() {
        // n = 59, p = 0.95, confidence 0.95: 1 - 0.95^59 = 0.9515 >= 0.95, so the maximum.
        let x: Vec<f64> = (1..=59).map(f64::from).collect();
        assert_eq!(quantile_upper_bound(&x, 0.95, 0.95), Some(59.0));
        // n = 58 is one short.
        assert_eq!(quantile_upper_bound(&x[..58], 0.95, 0.95), None);
        // Median with n = 10 at 0.9: P(Bin(10, .5) <= 6) = 0.828, <= 7: 0.945 -> k = 8.
        let y: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile_upper_bound(&y, 0.5, 0.9), Some(8.0));
        // Lower bound mirrors it: P(Bin >= 3) = 0.945 >= 0.9, P(Bin >= 4) = 0.828 -> k = 3.
        assert_eq!(quantile_lower_bound(&y, 0.5, 0.9), Some(3.0));
        assert_eq!(quantile_upper_bound(&y, 0.0, 0.9), None);
        assert_eq!(quantile_upper_bound(&[], 0.5, 0.9), None);
    }

    #[test]
    fn stats_invalid_dist_gives_nan_not_panic() {
        let bad = [
            Dist::Gamma {
                shape: -1.0,
                scale: 1.0,
            },
            Dist::Normal {
                mean: 1.0,
                std: f64::NAN,
            },
            Dist::Empirical(vec![]),
            Dist::Constant(0.0),
        ];
        let mut rng = stream_rng(1, &[]);
        for d in &bad {
            assert!(d.validate().is_err());
            assert!(d.sample(&mut rng).is_nan());
            assert!(d.mean().is_nan());
            assert!(d.cdf(1.0).is_nan());
            assert!(d.quantile(0.5).is_nan());
        }
    }

    #[test]
    fn stats_fit_rejects_bad_input() {
        assert!(fit_normal(&[1.0]).is_err());
        assert!(fit_normal(&[2.0, 2.0, 2.0]).is_err());
        assert!(fit_lognormal(&[1.0, 0.0, 2.0]).is_err());
        assert!(fit_gamma(&[1.0, f64::NAN]).is_err());
        assert!(fit_best(&[1.0]).is_err());
        // Zeros: only the normal fits.
        let (best, all) = fit_best(&[0.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(best.dist.family(), "normal");
        assert_eq!(all.len(), 1);
    }
}
