//! The workload-aware predictor (ResiHP): a stage's compute time in an iteration is
//! `a x tokens + b x sum(len^2)` over the micro-batches it ran, with `a` and `b` fitted online
//! by least squares on healthy iterations. Expected iteration times compose the per-stage
//! predictions through the pipeline schedule on the engine ([`expected_iteration_s`]).

use prism_core::hetero::{HeteroError, HeteroPipeline, LayerCost, simulate_hetero};
use prism_core::job::Cluster;

/// Online least squares for `y = a x1 + b x2` (no intercept), from running sums of the normal
/// equations; numerically scaled by the first observation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OnlineFit {
    n: u64,
    s11: f64,
    s12: f64,
    s22: f64,
    s1y: f64,
    s2y: f64,
    scale: (f64, f64),
}

impl OnlineFit {
    /// Adds one observation.
    pub fn add(&mut self, x1: f64, x2: f64, y: f64) {
        if self.n == 0 {
            self.scale = (x1.abs().max(1e-300), x2.abs().max(1e-300));
        }
        let (u, v) = (x1 / self.scale.0, x2 / self.scale.1);
        self.n += 1;
        self.s11 += u * u;
        self.s12 += u * v;
        self.s22 += v * v;
        self.s1y += u * y;
        self.s2y += v * y;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// The fitted `(a, b)`; when the two regressors are (nearly) collinear, the one-parameter
    /// fit `y = a x1` with `b = 0`. `None` before any observation.
    pub fn coefficients(&self) -> Option<(f64, f64)> {
        if self.n == 0 || self.s11 <= 0.0 {
            return None;
        }
        let det = self.s11 * self.s22 - self.s12 * self.s12;
        if det > 1e-9 * self.s11 * self.s22 {
            let a = (self.s1y * self.s22 - self.s2y * self.s12) / det;
            let b = (self.s2y * self.s11 - self.s1y * self.s12) / det;
            Some((a / self.scale.0, b / self.scale.1))
        } else {
            Some((self.s1y / self.s11 / self.scale.0, 0.0))
        }
    }

    /// Predicted `y` at `(x1, x2)`.
    pub fn predict(&self, x1: f64, x2: f64) -> Option<f64> {
        self.coefficients().map(|(a, b)| a * x1 + b * x2)
    }
}

/// The expected iteration time of `pipeline` when every stage's per-layer costs are `fitted`
/// (forward `token_s`, `sq_s` as fitted from healthy stage times): the per-stage predictions
/// composed through the schedule by the engine.
pub fn expected_iteration_s(
    pipeline: &HeteroPipeline,
    fitted: LayerCost,
    cluster: &Cluster,
) -> Result<f64, HeteroError> {
    let mut p = pipeline.clone();
    p.cost = fitted;
    Ok(simulate_hetero(&p, cluster, false)?.iteration_s)
}

/// Per-layer forward coefficients from a stage's fitted busy-time coefficients: a stage of
/// `layers` layers on `tp` devices at `speed` spends `(1 + backward_factor) x layers x (a'
/// tokens + b' sum len^2) / (tp speed)` (tensor-parallel communication folded into `a'`).
pub fn per_layer(
    a: f64,
    b: f64,
    layers: u32,
    tp: u32,
    speed: f64,
    backward_factor: f64,
) -> (f64, f64) {
    let k = (1.0 + backward_factor) * layers as f64 / (tp as f64 * speed);
    (a / k, b / k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;
    use prism_core::hetero::{Device, MicroBatch, Replica, Stage, backward_s, forward_s};
    use prism_core::job::Schedule;
    use prism_core::job::fixtures::{h100_cluster, small_job};
    use prism_predict::stats::stream_rng;
    use rand_distr::{Distribution, Normal};

    /// The fit recovers the generating coefficients from noisy stage times of long-tailed
    /// packed micro-batches (1% noise), and exactly without noise.
    #[test]
    fn fit_recovers_generating_coefficients() {
        let (a, b) = (4.2e-7, 1.3e-11);
        let w = Workload {
            median_len: 600.0,
            sigma: 1.3,
            capacity: 16384,
        };
        let mut rng = stream_rng(7, &[]);
        let noise = Normal::new(1.0, 0.01).unwrap();
        let (mut exact, mut noisy) = (OnlineFit::default(), OnlineFit::default());
        for _ in 0..400 {
            let mbs = w.micro_batches(8, &mut rng);
            let t: f64 = mbs.iter().map(|m| m.tokens as f64).sum();
            let q: f64 = mbs.iter().map(|m| m.sum_sq_len as f64).sum();
            let y = a * t + b * q;
            exact.add(t, q, y);
            noisy.add(t, q, y * noise.sample(&mut rng));
        }
        let (ea, eb) = exact.coefficients().unwrap();
        assert!(
            (ea / a - 1.0).abs() < 1e-9 && (eb / b - 1.0).abs() < 1e-9,
            "{ea} {eb}"
        );
        let (na, nb) = noisy.coefficients().unwrap();
        assert!((na / a - 1.0).abs() < 0.01, "a {na} vs {a}");
        assert!((nb / b - 1.0).abs() < 0.05, "b {nb} vs {b}");
    }

    /// Fitting the stage times of an engine run and composing the fit through the engine
    /// predicts the iteration of a new workload.
    #[test]
    fn composed_prediction_matches_engine() {
        let job = small_job(1, 1, 1, 8);
        let cost = LayerCost::from_job(&job, 16);
        let cl = h100_cluster(1);
        let stages: Vec<Stage> = (0..2)
            .map(|s| Stage {
                layers: 4,
                devices: (0..2).map(|i| Device::healthy(2 * s + i)).collect(),
            })
            .collect();
        let w = Workload {
            median_len: 500.0,
            sigma: 1.0,
            capacity: 4096,
        };
        let mut rng = stream_rng(3, &[]);
        let mut fit = OnlineFit::default();
        for _ in 0..40 {
            let mbs = w.micro_batches(4, &mut rng);
            let busy: f64 = (mbs.iter())
                .map(|m| {
                    forward_s(&stages[0], m, &cost, &cl) + backward_s(&stages[0], m, &cost, &cl)
                })
                .sum();
            let t: f64 = mbs.iter().map(|m| m.tokens as f64).sum();
            let q: f64 = mbs.iter().map(|m| m.sum_sq_len as f64).sum();
            fit.add(t, q, busy);
        }
        let (a, b) = fit.coefficients().unwrap();
        let (la, lb) = per_layer(a, b, 4, 2, 1.0, 2.0);
        let mut fitted = cost;
        // TP communication is linear in tokens: folded into the fitted token cost.
        fitted.token_s = la;
        fitted.sq_s = lb;
        fitted.tp_bytes_per_token = 0.0;
        let p = HeteroPipeline {
            replicas: vec![Replica {
                stages,
                micro_batches: vec![
                    MicroBatch::packed(&[3000, 1000]),
                    MicroBatch::packed(&[200; 20]),
                ],
            }],
            schedule: Schedule::OneFOneB,
            cost,
        };
        let truth = simulate_hetero(&p, &cl, false).unwrap().iteration_s;
        let pred = expected_iteration_s(&p, fitted, &cl).unwrap();
        assert!((pred / truth - 1.0).abs() < 1e-6, "{pred} vs {truth}");
    }
}
