//! Stragglers: the expected iteration time when every GPU has its own persistent speed.
//!
//! PRISM's premise (Zhang et al., see `docs/predict.md`): GPUs of one SKU differ in speed, and
//! a synchronous job runs at the pace of its slowest GPU. The slowest GPU slows its
//! tensor-parallel group at every collective, that group's pipeline stage, that pipeline, and
//! at the data-parallel synchronisation every other pipeline. With per-GPU time factors
//! `1 + cv Z_i`, `Z_i` independent standard normals, the iteration's compute is stretched by
//! the largest of the `N` factors, so to first order
//!
//! `E[T] = T_nominal + compute x cv x E[max of N standard normals]`,
//!
//! where `compute` is the per-GPU compute time of the nominal run (communication and the
//! idle time of the other stages do not stretch). `prism predict` with a
//! `[variability] gpu_speed` section samples the same effect through the engine; a test in
//! `prism-predict` checks the two agree.
//!
//! The default spread, [`DEFAULT_GPU_SPEED_CV`] = 1.1%, comes from Sinha et al., "Not All GPUs
//! Are Created Equal" (SC22): an average performance variation (max-min over the median) of 8%
//! across same-SKU GPUs of production clusters of a few thousand GPUs, whose expected normal
//! range `2 E[max of n]` is about 7.2 standard deviations at n = 4,000 (8% / 7.2 = 1.1%).

use statrs::function::erf::erfc;

/// Default coefficient of variation of per-GPU speed (`cluster.gpu_speed_cv`).
pub const DEFAULT_GPU_SPEED_CV: f64 = 0.011;

/// Largest accepted per-GPU speed spread (`cluster.gpu_speed_cv`).
pub const MAX_GPU_SPEED_CV: f64 = 0.5;

/// Whether `cv` is an accepted per-GPU speed spread: finite, from 0 to [`MAX_GPU_SPEED_CV`].
pub fn is_valid_gpu_speed_cv(cv: f64) -> bool {
    cv.is_finite() && (0.0..=MAX_GPU_SPEED_CV).contains(&cv)
}

/// `ln Phi(x)` for the standard normal CDF, accurate in both tails.
fn ln_phi(x: f64) -> f64 {
    if x < 0.0 {
        (0.5 * erfc(-x / std::f64::consts::SQRT_2)).ln()
    } else {
        (-0.5 * erfc(x / std::f64::consts::SQRT_2)).ln_1p()
    }
}

/// `E[max(Z_1..Z_n)]` for `n` independent standard normals (0 for `n <= 1`), from
/// `E[M] = int_0^inf (1 - Phi(x)^n) dx - int_-inf^0 Phi(x)^n dx` by Simpson's rule on
/// `[-12, 12]` (error below 1e-9 for any `n` up to 10^9).
///
/// The quadrature costs about 2 ms and every simulated iteration's summary asks for it (one
/// per Monte Carlo sample in `prism predict`), always with the job's GPU count, so results are
/// kept per `n` for the life of the process (a pure function: the cache changes no output).
pub fn expected_max_standard_normal(n: u64) -> f64 {
    use std::collections::BTreeMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<BTreeMap<u64, f64>>> = OnceLock::new();
    if n <= 1 {
        return 0.0;
    }
    let cache = CACHE.get_or_init(|| Mutex::new(BTreeMap::new()));
    if let Some(&e) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&n) {
        return e;
    }
    let e = expected_max_quadrature(n);
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(n, e);
    e
}

fn expected_max_quadrature(n: u64) -> f64 {
    let nf = n as f64;
    // The upper half integrates 1 - Phi(x)^n, the lower half -Phi(x)^n (at x = -u).
    let f = |x: f64, upper: bool| {
        let pn = nf * ln_phi(x); // ln Phi(x)^n
        if upper { -pn.exp_m1() } else { -pn.exp() }
    };
    let (a, b, steps) = (0.0f64, 12.0f64, 24_000usize);
    let h = (b - a) / steps as f64;
    let simpson = |upper: bool| {
        let sign = if upper { 1.0 } else { -1.0 };
        let mut s = f(sign * a, upper) + f(sign * b, upper);
        for i in 1..steps {
            let w = if i % 2 == 1 { 4.0 } else { 2.0 };
            s += w * f(sign * (a + i as f64 * h), upper);
        }
        s * h / 3.0
    };
    simpson(true) + simpson(false)
}

/// The expected iteration time of a run with `nominal_s` seconds per iteration, `compute_s`
/// seconds of compute per GPU, on `gpus` GPUs whose speeds spread with coefficient of
/// variation `cv` (see the module docs).
pub fn expected_iteration_time(nominal_s: f64, compute_s: f64, gpus: u64, cv: f64) -> f64 {
    nominal_s + compute_s * cv * expected_max_standard_normal(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Closed forms: E[max of 2] = 1/sqrt(pi), E[max of 3] = 3/(2 sqrt(pi)); tabulated values
    /// (Harter 1961): n = 5: 1.162964, n = 10: 1.538753, n = 100: 2.507594; and large-n
    /// values from the asymptotic expansion checked against a brute-force quadrature.
    #[test]
    fn order_statistic_closed_forms() {
        let pi = std::f64::consts::PI;
        let e2 = expected_max_standard_normal(2);
        assert!(
            (e2 - 1.0 / pi.sqrt()).abs() < 1e-9,
            "{e2} vs {}",
            1.0 / pi.sqrt()
        );
        assert!((expected_max_standard_normal(3) - 1.5 / pi.sqrt()).abs() < 1e-9);
        for (n, want) in [(5u64, 1.162964), (10, 1.538753), (100, 2.507594)] {
            let got = expected_max_standard_normal(n);
            assert!((got - want).abs() < 2e-6, "n {n}: {got} vs {want}");
        }
        assert_eq!(expected_max_standard_normal(1), 0.0);
        // Monotone in n, and slower than sqrt(2 ln n) (its leading asymptote from above).
        let mut prev = 0.0;
        for n in [2u64, 8, 64, 1024, 16_384, 131_072, 1 << 20] {
            let e = expected_max_standard_normal(n);
            assert!(e > prev, "not increasing at {n}");
            assert!(e < (2.0 * (n as f64).ln()).sqrt(), "n {n}: {e}");
            prev = e;
        }
    }

    #[test]
    fn expected_time_grows_with_scale_and_spread() {
        let t = |n, cv| expected_iteration_time(10.0, 8.0, n, cv);
        assert_eq!(t(16_384, 0.0), 10.0);
        assert_eq!(t(1, 0.05), 10.0);
        assert!(t(16_384, 0.01) > t(256, 0.01));
        assert!(t(256, 0.02) > t(256, 0.01));
        let want = 10.0 + 8.0 * 0.01 * expected_max_standard_normal(256);
        assert!((t(256, 0.01) - want).abs() < 1e-12);
    }
}
