//! Variability and reliability of a job: how GPU speed, kernel durations and communication vary,
//! and how devices slow down or fail (the `[variability]` section of a job file).
//!
//! Plain values, validated like the rest of the job. The Monte Carlo (`crate::stochastic`) draws
//! from them with seeded generators only.

/// A probability distribution of a positive quantity (a factor or a duration).
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    /// Always this value.
    Constant(f64),
    /// Normal with mean and standard deviation (draws are truncated at a small positive value).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Log-normal: `exp(N(mu, sigma))`.
    LogNormal {
        /// Mean of the logarithm.
        mu: f64,
        /// Standard deviation of the logarithm.
        sigma: f64,
    },
    /// Gamma with shape `k` and scale `theta` (mean `k theta`).
    Gamma {
        /// Shape.
        shape: f64,
        /// Scale.
        scale: f64,
    },
    /// Exponential with this mean.
    Exponential {
        /// Mean.
        mean: f64,
    },
    /// Draw uniformly from these observed values.
    Empirical(Vec<f64>),
}

/// Persistent per-GPU speed: each GPU's kernels take `factor` times their nominal time for the
/// whole run (silicon lottery, cooling, power capping).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuSpeed {
    /// Time factor of a typical GPU (e.g. normal with mean 1.0, std 0.03).
    pub factor: Dist,
    /// Fraction of GPUs that are outliers.
    pub outlier_fraction: f64,
    /// Time factor of an outlier (e.g. 1.2 = 20% slower).
    pub outlier_slowdown: f64,
}

/// Per-kernel temporal jitter: every kernel of a class multiplies its time by a fresh draw.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelJitter {
    /// Op class name (`gemm`, `attention`, `norm`, `elementwise`, ... or `all`).
    pub class: String,
    /// Time factor distribution (mean near 1).
    pub factor: Dist,
}

/// Per-kernel jitter of the kernels with one op name of the execution graph (e.g. `fc1_fwd`),
/// on top of their class's: a fit table's signature that names an op.
#[derive(Clone, Debug, PartialEq)]
pub struct OpJitter {
    /// Op name, as in the attribution's `by_op` and the trace.
    pub op: String,
    /// Time factor distribution (mean near 1).
    pub factor: Dist,
}

/// Per-step communication regime: one draw per iteration, shared by every collective and send
/// of that iteration (correlated congestion); multiplies communication time.
#[derive(Clone, Debug, PartialEq)]
pub struct CommRegime {
    /// Time factor of communication in one iteration.
    pub factor: Dist,
}

/// Fail-slow episodes: a GPU runs slower for a while.
#[derive(Clone, Debug, PartialEq)]
pub struct FailSlow {
    /// Episodes per GPU-hour.
    pub rate_per_gpu_hour: f64,
    /// Episode duration, seconds.
    pub duration_s: Dist,
    /// Time factor while slow (e.g. 2.0 = half speed).
    pub slowdown: f64,
}

/// Fail-stop failures, checkpointing and restarts.
#[derive(Clone, Debug, PartialEq)]
pub struct Failures {
    /// Unexpected interruptions per GPU-hour (Llama 3: 419 in 54 days on 16,384 GPUs is about
    /// 1.97e-5 per GPU-hour).
    pub rate_per_gpu_hour: f64,
    /// Seconds between checkpoints.
    pub checkpoint_interval_s: f64,
    /// Seconds one checkpoint write stalls training.
    pub checkpoint_write_s: f64,
    /// Seconds from a failure to training again (detection, rescheduling, loading the checkpoint).
    pub restart_s: f64,
}

/// Everything that varies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Variability {
    /// Persistent per-GPU speed.
    pub gpu_speed: Option<GpuSpeed>,
    /// Per-kernel jitter by op class.
    pub kernel_jitter: Vec<KernelJitter>,
    /// Per-kernel jitter by op name (from a fit table).
    pub op_jitter: Vec<OpJitter>,
    /// Per-step communication regime.
    pub comm_regime: Option<CommRegime>,
    /// Fail-slow episodes.
    pub fail_slow: Option<FailSlow>,
    /// Fail-stop failures and checkpoints.
    pub failures: Option<Failures>,
}

impl Dist {
    /// Whether draws can differ (not a constant, nor an empirical table of one value).
    pub fn is_random(&self) -> bool {
        match self {
            Dist::Constant(_) => false,
            Dist::Empirical(v) => v.iter().any(|x| *x != v[0]),
            _ => true,
        }
    }
}

impl Variability {
    /// Whether anything varies between samples or runs: a non-constant distribution, GPU
    /// outliers, or failures or fail-slow episodes at a positive rate.
    pub fn is_random(&self) -> bool {
        let gpu = self.gpu_speed.as_ref().is_some_and(|g| {
            g.factor.is_random()
                || (g.outlier_fraction > 0.0
                    && g.outlier_fraction < 1.0
                    && g.outlier_slowdown != 1.0)
        });
        gpu || self.kernel_jitter.iter().any(|j| j.factor.is_random())
            || self.op_jitter.iter().any(|j| j.factor.is_random())
            || self
                .comm_regime
                .as_ref()
                .is_some_and(|c| c.factor.is_random())
            || self
                .fail_slow
                .as_ref()
                .is_some_and(|f| f.rate_per_gpu_hour > 0.0)
            || self
                .failures
                .as_ref()
                .is_some_and(|f| f.rate_per_gpu_hour > 0.0)
    }
}
