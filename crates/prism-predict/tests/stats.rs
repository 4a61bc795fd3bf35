//! `prism_predict::stats` against independent truth: closed-form CDFs and means, parameters of
//! synthetic samples drawn with `rand_distr` directly, the binomial coverage of the quantile
//! bound and the DKW band measured over seeded repetitions.
//!
//! Every random number comes from a fixed seed, so these tests are deterministic. Run with
//! `--nocapture` to see the measured errors and coverages.

use prism_predict::stats::{
    Fit, dkw_epsilon, fit_best, fit_gamma, fit_lognormal, fit_normal, guarantee, ks_statistic,
    quantile_lower_bound, quantile_sorted, quantile_upper_bound, stream_rng, summarize,
};
use prism_predict::variability::Dist;
use rand::{Rng, RngExt};
use rand_distr::Distribution;
use statrs::function::gamma::digamma;

/// Standard normal 0.95-quantile (tables; independent of the code under test).
const Z95: f64 = 1.644_853_626_951_472_2;

fn draw<D: Distribution<f64>>(d: D, n: usize, rng: &mut impl Rng) -> Vec<f64> {
    (0..n).map(|_| d.sample(rng)).collect()
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

fn normal_sample(mean: f64, std: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = stream_rng(seed, &[1]);
    draw(rand_distr::Normal::new(mean, std).unwrap(), n, &mut rng)
}

fn lognormal_sample(mu: f64, sigma: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = stream_rng(seed, &[2]);
    draw(rand_distr::LogNormal::new(mu, sigma).unwrap(), n, &mut rng)
}

fn gamma_sample(shape: f64, scale: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = stream_rng(seed, &[3]);
    draw(rand_distr::Gamma::new(shape, scale).unwrap(), n, &mut rng)
}

// ------------------------------------------------------------------------------------------
// Distributions
// ------------------------------------------------------------------------------------------

#[test]
fn cdf_and_quantile_match_closed_forms() {
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    // Normal: Phi(1) = 0.8413447460685429, Phi(-2) = 0.022750131948179195.
    let n = Dist::Normal {
        mean: 10.0,
        std: 2.0,
    };
    assert!(close(n.cdf(12.0), 0.841_344_746_068_542_9));
    assert!(close(n.cdf(6.0), 0.022_750_131_948_179_195));
    assert!(close(n.quantile(0.95), 10.0 + 2.0 * Z95));
    // Log-normal: P(X <= e^(mu + sigma)) = Phi(1).
    let l = Dist::LogNormal {
        mu: 0.5,
        sigma: 0.3,
    };
    assert!(close(l.cdf((0.8f64).exp()), 0.841_344_746_068_542_9));
    assert!(close(l.quantile(0.95), (0.5 + 0.3 * Z95).exp()));
    // Gamma with integer shape is Erlang: P(X <= x) = 1 - e^(-y) sum_{j<k} y^j / j!, y = x/theta.
    let g = Dist::Gamma {
        shape: 3.0,
        scale: 2.0,
    };
    for x in [0.5, 2.0, 6.0, 15.0] {
        let y: f64 = x / 2.0;
        let erlang = 1.0 - (-y).exp() * (1.0 + y + y * y / 2.0);
        assert!(close(g.cdf(x), erlang), "gamma cdf({x})");
        assert!((g.quantile(erlang) - x).abs() < 1e-7 * x, "gamma quantile");
    }
    // Gamma with shape 1/2 and scale 2 is chi-squared with 1 degree of freedom:
    // P(X <= z^2) = 2 Phi(z) - 1, so its 0.9-quantile is z_0.95^2.
    let chi1 = Dist::Gamma {
        shape: 0.5,
        scale: 2.0,
    };
    assert!((chi1.quantile(0.9) - Z95 * Z95).abs() < 1e-7);
    // Exponential.
    let e = Dist::Exponential { mean: 3.0 };
    assert!(close(e.cdf(3.0), 1.0 - (-1.0f64).exp()));
    assert!(close(e.quantile(0.5), 3.0 * 2f64.ln()));
    // Empirical: the ECDF and its inverse.
    let emp = Dist::Empirical(vec![3.0, 1.0, 2.0, 2.0]);
    assert_eq!(emp.cdf(2.0), 0.75);
    assert_eq!(emp.cdf(0.5), 0.0);
    assert_eq!(emp.quantile(0.25), 1.0);
    assert_eq!(emp.quantile(0.26), 2.0);
    assert_eq!(emp.quantile(0.75), 2.0);
    assert_eq!(emp.quantile(0.76), 3.0);
    assert_eq!(emp.quantile(0.0), 1.0);
    assert_eq!(
        Dist::Empirical(vec![1.0, 2.0, 2.0, 3.0]).quantile(0.76),
        3.0
    );
    // Constant.
    let c = Dist::Constant(1.5);
    assert_eq!((c.cdf(1.4), c.cdf(1.5), c.quantile(0.3)), (0.0, 1.0, 1.5));
    // Out of range.
    assert!(n.quantile(1.5).is_nan() && n.quantile(-0.1).is_nan() && n.cdf(f64::NAN).is_nan());
}

#[test]
fn gamma_quantile_matches_reference_values_in_both_tails() {
    // Gamma(a, 1) quantiles from mpmath (50 digits: bisection on gammainc(a, 0, x)).
    let reference = [
        (0.01, 0.5, 4.465_535_018_910_355e-31),
        (0.3, 1e-6, 6.972_699_096_409_348e-21),
        (0.5, 0.9, 1.352_771_727_047_707_5),
        (2.0, 1e-12, 1.414_214_229_040_193_8e-6),
        (2.0, 0.999_999, 16.688_420_790_829_44),
        (5.0, 0.5, 4.670_908_882_795_984),
        (400.0, 0.01, 354.948_457_126_885_3),
        (1e4, 0.99, 10_234.104_379_158_054),
    ];
    for (a, p, x) in reference {
        let d = Dist::Gamma {
            shape: a,
            scale: 1.0,
        };
        let got = d.quantile(p);
        assert!(
            rel(got, x) < 1e-9,
            "Gamma({a}) quantile({p}) = {got}, expected {x}"
        );
        // Scale only multiplies.
        let scaled = Dist::Gamma {
            shape: a,
            scale: 2.5e-4,
        };
        assert!(rel(scaled.quantile(p), 2.5e-4 * x) < 1e-9);
    }
    // Extremes stay finite and ordered.
    let d = Dist::Gamma {
        shape: 0.5,
        scale: 1.0,
    };
    assert_eq!(d.quantile(1e-300), 0.0); // below the smallest positive double
    assert_eq!((d.quantile(0.0), d.quantile(1.0)), (0.0, f64::INFINITY));
    let qs: Vec<f64> = (1..100).map(|i| d.quantile(f64::from(i) / 100.0)).collect();
    assert!(qs.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn normal_is_clamped_at_its_floor_consistently() {
    // Mean 1, std 1: 16% of the mass lies below the floor 0.001 and becomes a point mass there.
    let d = Dist::Normal {
        mean: 1.0,
        std: 1.0,
    };
    let floor = prism_predict::stats::NORMAL_FLOOR_FRACTION;
    assert_eq!(d.cdf(floor * 0.999), 0.0);
    assert!((d.cdf(floor) - 0.158_897_345_641_318_3).abs() < 1e-6); // Phi(-0.999)
    assert_eq!(d.quantile(0.1), floor);
    assert_eq!(d.quantile(0.0), floor);
    let mut rng = stream_rng(7, &[0]);
    let min = (0..10_000)
        .map(|_| d.sample(&mut rng))
        .fold(f64::INFINITY, f64::min);
    assert_eq!(min, floor);
}

#[test]
fn dist_mean_matches_the_sample_mean() {
    let cases = [
        Dist::Constant(2.5),
        Dist::Normal {
            mean: 1.0,
            std: 0.03,
        },
        // Heavily clamped: the mean of max(X, floor) differs from 1 by std * phi(...) = 0.08.
        Dist::Normal {
            mean: 1.0,
            std: 1.0,
        },
        Dist::LogNormal {
            mu: -6.0,
            sigma: 0.4,
        },
        Dist::Gamma {
            shape: 0.7,
            scale: 3.0,
        },
        Dist::Gamma {
            shape: 40.0,
            scale: 0.025,
        },
        Dist::Exponential { mean: 120.0 },
        Dist::Empirical(vec![1.0, 1.5, 4.0, 0.2]),
    ];
    let n = 200_000;
    for (i, d) in cases.iter().enumerate() {
        d.validate().unwrap();
        let mut rng = stream_rng(42, &[i as u64]);
        let x: Vec<f64> = (0..n).map(|_| d.sample(&mut rng)).collect();
        let m = x.iter().sum::<f64>() / n as f64;
        let sd = (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1) as f64).sqrt();
        let se = sd / (n as f64).sqrt();
        let diff = (m - d.mean()).abs();
        eprintln!(
            "mean {:<45} exact {:.6e} sample {:.6e} |diff|/se {:.2}",
            format!("{d:?}"),
            d.mean(),
            m,
            if se > 0.0 { diff / se } else { 0.0 }
        );
        assert!(diff <= 5.0 * se + 1e-12 * d.mean(), "{d:?}");
    }
    // The clamped-normal mean formula against an independent value: E[max(X, 0.001)] for
    // X ~ N(1, 1) = 1 + E[(0.001 - X)^+] = 1 + (a Phi(a) + phi(a)), a = -0.999.
    let a: f64 = -0.999;
    let phi = (-0.5 * a * a).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let expected = 1.0 + a * 0.158_897_345_641_318_3 + phi;
    let got = Dist::Normal {
        mean: 1.0,
        std: 1.0,
    }
    .mean();
    assert!((got - expected).abs() < 1e-6, "{got} vs {expected}");
}

#[test]
fn samples_follow_their_cdf_and_quantile_sampling_agrees() {
    // The KS distance of n draws against the true CDF is below the 5% critical value 1.36/sqrt n
    // (one seeded sample per family), both for `sample` and for inverse-transform draws
    // `quantile(U)` (how the engine draws jitter).
    let cases = [
        Dist::Normal {
            mean: 10.0,
            std: 2.0,
        },
        Dist::LogNormal {
            mu: 1.6,
            sigma: 0.5,
        },
        Dist::Gamma {
            shape: 2.0,
            scale: 3.0,
        },
        Dist::Gamma {
            shape: 0.3,
            scale: 1.0,
        },
        Dist::Exponential { mean: 2.0 },
    ];
    let n = 20_000;
    let crit = 1.36 / (n as f64).sqrt();
    for (i, d) in cases.iter().enumerate() {
        let mut rng = stream_rng(2024, &[i as u64]);
        let direct = sorted((0..n).map(|_| d.sample(&mut rng)).collect());
        let inverse = sorted((0..n).map(|_| d.quantile(rng.random::<f64>())).collect());
        let ks_direct = ks_statistic(&direct, |x| d.cdf(x));
        let ks_inverse = ks_statistic(&inverse, |x| d.cdf(x));
        eprintln!(
            "ks {:<40} sample {ks_direct:.5} quantile(U) {ks_inverse:.5} crit {crit:.5}",
            format!("{d:?}")
        );
        assert!(ks_direct < crit, "{d:?}: {ks_direct}");
        assert!(ks_inverse < crit, "{d:?}: {ks_inverse}");
    }
}

#[test]
fn ks_statistic_matches_hand_computation_and_rejects_at_its_level() {
    // Uniform(0,1) against {0.1, 0.5, 0.9}: max(1/3 - 0.1, 0.9 - 2/3, ...) = 0.2333...
    let d = ks_statistic(&[0.1, 0.5, 0.9], |x| x.clamp(0.0, 1.0));
    assert!((d - 0.7 / 3.0).abs() < 1e-15);
    // Ties: {0.5, 0.5} against Uniform: the ECDF jumps 0 -> 1 at 0.5, so D = 0.5.
    assert_eq!(ks_statistic(&[0.5, 0.5], |x| x), 0.5);
    assert!(ks_statistic(&[], |x| x).is_nan());
    // Over 1000 seeded samples of n = 500 from the true distribution, 1.36/sqrt(n) rejects
    // about 5% (asymptotic level; slightly less at finite n).
    let reps = 1000;
    let n = 500;
    let crit = 1.36 / (n as f64).sqrt();
    let truth = Dist::LogNormal {
        mu: 0.0,
        sigma: 0.5,
    };
    let mut rejected = 0;
    for r in 0..reps {
        let x = sorted(lognormal_sample(0.0, 0.5, n, 1000 + r));
        if ks_statistic(&x, |v| truth.cdf(v)) > crit {
            rejected += 1;
        }
    }
    let rate = rejected as f64 / reps as f64;
    eprintln!("ks rejection rate at the 5% critical value: {rate:.3}");
    assert!((0.025..=0.075).contains(&rate), "{rate}");
}

// ------------------------------------------------------------------------------------------
// Fits
// ------------------------------------------------------------------------------------------

fn params(f: &Fit) -> (f64, f64) {
    match f.dist {
        Dist::Normal { mean, std } => (mean, std),
        Dist::LogNormal { mu, sigma } => (mu, sigma),
        Dist::Gamma { shape, scale } => (shape, scale),
        ref d => panic!("unexpected {d:?}"),
    }
}

#[test]
fn fits_recover_the_generating_parameters() {
    let n = 20_000;
    let tol = 0.03;

    let f = fit_normal(&normal_sample(10.0, 2.0, n, 11)).unwrap();
    let (m, s) = params(&f);
    eprintln!(
        "normal(10, 2): mean {m:.4} ({:.2}%), std {s:.4} ({:.2}%), ks {:.4}",
        100.0 * rel(m, 10.0),
        100.0 * rel(s, 2.0),
        f.ks
    );
    assert!(rel(m, 10.0) < tol && rel(s, 2.0) < tol);
    assert_eq!(f.n, n);

    let mu0 = 5f64.ln();
    let f = fit_lognormal(&lognormal_sample(mu0, 0.5, n, 12)).unwrap();
    let (mu, sigma) = params(&f);
    eprintln!(
        "lognormal(ln 5, 0.5): mu {mu:.4} ({:.2}%), sigma {sigma:.4} ({:.2}%), ks {:.4}",
        100.0 * rel(mu, mu0),
        100.0 * rel(sigma, 0.5),
        f.ks
    );
    assert!(rel(mu, mu0) < tol && rel(sigma, 0.5) < tol);

    for (i, (shape0, scale0)) in [(2.0, 3.0), (0.5, 1e-3), (50.0, 2e-5)]
        .into_iter()
        .enumerate()
    {
        let x = gamma_sample(shape0, scale0, n, 13 + i as u64);
        let f = fit_gamma(&x).unwrap();
        let (k, theta) = params(&f);
        eprintln!(
            "gamma({shape0}, {scale0}): shape {k:.4} ({:.2}%), scale {theta:.4e} ({:.2}%), ks {:.4}",
            100.0 * rel(k, shape0),
            100.0 * rel(theta, scale0),
            f.ks
        );
        assert!(rel(k, shape0) < tol && rel(theta, scale0) < tol);
        // The MLE equations hold: k theta = mean, ln k - psi(k) = ln mean - mean ln x.
        let mean = x.iter().sum::<f64>() / n as f64;
        let mean_ln = x.iter().map(|v| v.ln()).sum::<f64>() / n as f64;
        assert!(rel(k * theta, mean) < 1e-12);
        let lhs = k.ln() - digamma(k);
        let rhs = mean.ln() - mean_ln;
        assert!((lhs - rhs).abs() < 1e-9 * rhs, "{lhs} vs {rhs}");
    }
}

#[test]
fn fit_best_picks_the_generating_family() {
    let n = 20_000;
    let cases: [(&str, Vec<f64>); 3] = [
        ("normal", normal_sample(10.0, 2.0, n, 21)),
        ("lognormal", lognormal_sample(5f64.ln(), 0.5, n, 22)),
        ("gamma", gamma_sample(2.0, 3.0, n, 23)),
    ];
    for (family, x) in &cases {
        let (best, all) = fit_best(x).unwrap();
        assert_eq!(all.len(), 3);
        let ks: Vec<String> = all
            .iter()
            .map(|f| format!("{} {:.4}", f.dist.family(), f.ks))
            .collect();
        eprintln!(
            "fit_best on {family} data: {} -> {}",
            ks.join(", "),
            best.dist.family()
        );
        assert_eq!(best.dist.family(), *family);
        let runner_up = all
            .iter()
            .filter(|f| f.dist.family() != *family)
            .map(|f| f.ks)
            .fold(f64::INFINITY, f64::min);
        assert!(best.ks < runner_up);
    }
}

// ------------------------------------------------------------------------------------------
// Quantiles and bounds
// ------------------------------------------------------------------------------------------

#[test]
fn quantile_upper_bound_covers_at_its_confidence() {
    // 2000 seeded repetitions of n = 200: the bound of the 0.95-quantile is at or above the
    // true one with probability exactly BinomCDF(k-1; n, p) for a continuous law, which is at
    // least `confidence`. For n = 200, p = 0.95 (computed independently in Python):
    // confidence 0.90 -> k = 195, exact coverage 0.937658; 0.95 -> k = 196, 0.973553.
    let reps = 2000;
    let n = 200;
    let p = 0.95;
    for (confidence, exact) in [(0.9, 0.937_658), (0.95, 0.973_553)] {
        // Log-normal (mu 0, sigma 0.5): true 0.95-quantile exp(0.5 z_0.95).
        let truth = (0.5 * Z95).exp();
        let mut covered = 0;
        let mut guaranteed = 0;
        let mut lower_ok = 0;
        for r in 0..reps {
            let x = sorted(lognormal_sample(0.0, 0.5, n, 5000 + r));
            let ub = quantile_upper_bound(&x, p, confidence).unwrap();
            covered += usize::from(ub >= truth);
            guaranteed += usize::from(guarantee(&x, p, confidence) == Some(ub));
            lower_ok += usize::from(quantile_lower_bound(&x, p, confidence).unwrap() <= truth);
        }
        let coverage = covered as f64 / reps as f64;
        let lower = lower_ok as f64 / reps as f64;
        eprintln!(
            "confidence {confidence}: upper-bound coverage {coverage:.4}, lower-bound coverage \
             {lower:.4} ({reps} x n={n}, p={p})"
        );
        assert_eq!(guaranteed, reps as usize);
        assert!(coverage >= confidence - 0.02, "{coverage}");
        // Standard error sqrt(c (1 - c) / 2000) < 0.0055: the measured rate is the exact one.
        assert!(
            (coverage - exact).abs() < 0.02,
            "{coverage} vs exact {exact}"
        );
        assert!(lower >= confidence - 0.02, "{lower}");
    }
    // A discrete law with ties (durations rounded to 1 us): still at least the confidence.
    let truth_discrete = {
        // Gamma(4, 2.5) 0.95-quantile rounded up to the grid; computed from a large sample.
        let big = sorted(gamma_sample(4.0, 2.5, 1_000_000, 99))
            .into_iter()
            .map(|v| v.round())
            .collect::<Vec<_>>();
        big[(0.95 * big.len() as f64).ceil() as usize - 1]
    };
    let mut covered = 0;
    for r in 0..reps {
        let x = sorted(
            gamma_sample(4.0, 2.5, n, 9000 + r)
                .into_iter()
                .map(|v| v.round())
                .collect(),
        );
        covered += usize::from(quantile_upper_bound(&x, p, 0.9).unwrap() >= truth_discrete);
    }
    let coverage = covered as f64 / reps as f64;
    eprintln!("discrete (rounded gamma) coverage at 0.9: {coverage:.4}");
    assert!(coverage >= 0.88);
}

#[test]
fn quantile_bounds_need_enough_samples() {
    let x: Vec<f64> = (1..=200).map(f64::from).collect();
    // 1 - 0.99^200 = 0.866 < 0.95: even the maximum is not a 95% bound of the 0.99-quantile.
    assert_eq!(quantile_upper_bound(&x, 0.99, 0.95), None);
    assert_eq!(guarantee(&x, 0.99, 0.95), None);
    // ... but it is an 85% bound.
    assert_eq!(quantile_upper_bound(&x, 0.99, 0.85), Some(200.0));
    assert_eq!(quantile_upper_bound(&x, 0.95, 1.0), None);
}

#[test]
fn dkw_epsilon_closed_form_and_coverage() {
    // sqrt(ln(2 / 0.05) / 200) = sqrt(ln 40 / 200).
    assert!((dkw_epsilon(100, 0.95) - (40f64.ln() / 200.0).sqrt()).abs() < 1e-15);
    assert!((dkw_epsilon(100, 0.95) - 0.135_810_5).abs() < 1e-6);
    assert!((dkw_epsilon(1000, 0.99) - (200f64.ln() / 2000.0).sqrt()).abs() < 1e-12);
    assert!(dkw_epsilon(0, 0.95).is_nan() && dkw_epsilon(10, 1.0).is_nan());
    // The band holds with probability at least 95% (Massart); at alpha = 0.05 the bound is
    // nearly tight (the Kolmogorov limit gives 1 - 2e^(-2 l^2) + 2e^(-8 l^2) ~ 0.95), so over
    // 2000 seeded samples the rate is about 0.95: allow three standard errors (0.005 each).
    let truth = Dist::Gamma {
        shape: 2.0,
        scale: 1.0,
    };
    let n = 300;
    let eps = dkw_epsilon(n, 0.95);
    let reps = 2000;
    let held = (0..reps)
        .filter(|r| {
            let x = sorted(gamma_sample(2.0, 1.0, n, 7000 + r));
            ks_statistic(&x, |v| truth.cdf(v)) <= eps
        })
        .count();
    let rate = held as f64 / reps as f64;
    eprintln!("dkw band (n={n}, 95%) held in {held}/{reps} = {rate:.4}");
    assert!(rate >= 0.935, "{rate}");
}

#[test]
fn summarize_matches_type7_quantiles() {
    let x: Vec<f64> = (0..=100).rev().map(f64::from).collect();
    let s = summarize(&x);
    assert_eq!(
        (s.mean, s.p50, s.p90, s.p95, s.p99, s.min, s.max),
        (50.0, 50.0, 90.0, 95.0, 99.0, 0.0, 100.0)
    );
    // NumPy: np.quantile([1, 2, 4, 8, 16], [0.9, 0.95]) = [12.8, 14.4]
    let s = summarize(&[16.0, 1.0, 4.0, 2.0, 8.0]);
    assert!((s.p90 - 12.8).abs() < 1e-12 && (s.p95 - 14.4).abs() < 1e-12);
    assert_eq!(quantile_sorted(&[3.0], 0.7), 3.0);
    assert!(summarize(&[]).mean.is_nan());
}

// ------------------------------------------------------------------------------------------
// Streams
// ------------------------------------------------------------------------------------------

#[test]
fn stream_rng_is_reproducible_and_streams_are_independent() {
    let seq = |seed, stream: &[u64]| {
        let mut r = stream_rng(seed, stream);
        (0..8).map(|_| r.next_u64()).collect::<Vec<_>>()
    };
    assert_eq!(seq(1, &[3, 4]), seq(1, &[3, 4]));
    let streams: [&[u64]; 7] = [&[], &[0], &[1], &[0, 0], &[0, 1], &[1, 0], &[0, 0, 0]];
    let mut firsts: Vec<Vec<u64>> = streams.iter().map(|s| seq(1, s)).collect();
    firsts.push(seq(2, &[0]));
    for i in 0..firsts.len() {
        for j in 0..i {
            assert_ne!(firsts[i][0], firsts[j][0], "streams {i} and {j} collide");
        }
    }
    // Neighbouring streams are uncorrelated: |r| < 4 / sqrt(n) for 100 stream pairs.
    let n = 10_000;
    let mut worst: f64 = 0.0;
    for s in 0..100u64 {
        let mut a = stream_rng(9, &[s]);
        let mut b = stream_rng(9, &[s + 1]);
        let xa: Vec<f64> = (0..n).map(|_| a.random::<f64>()).collect();
        let xb: Vec<f64> = (0..n).map(|_| b.random::<f64>()).collect();
        let (ma, mb) = (
            xa.iter().sum::<f64>() / n as f64,
            xb.iter().sum::<f64>() / n as f64,
        );
        assert!((ma - 0.5).abs() < 4.0 * (1.0 / 12.0f64 / n as f64).sqrt());
        let cov: f64 = xa
            .iter()
            .zip(&xb)
            .map(|(p, q)| (p - ma) * (q - mb))
            .sum::<f64>();
        let va: f64 = xa.iter().map(|p| (p - ma) * (p - ma)).sum();
        let vb: f64 = xb.iter().map(|q| (q - mb) * (q - mb)).sum();
        worst = worst.max((cov / (va * vb).sqrt()).abs());
    }
    eprintln!("stream_rng: worst |correlation| of 100 neighbouring stream pairs {worst:.4}");
    assert!(worst < 4.0 / (n as f64).sqrt());
}
