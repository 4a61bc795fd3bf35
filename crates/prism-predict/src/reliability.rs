//! Reliability of a whole training run: fail-stop failures with checkpoint / restart, and
//! fail-slow episodes, played out over the run's wall time with seeded randomness.
//!
//! The model (see `docs/reliability.md` for the derivations and the sources):
//!
//! * **Steps.** The run is `RunModel::steps` calls of a step-time sampler. A call may return the
//!   time of one iteration or of a block of `B` iterations (then `steps` = iterations / `B`); the
//!   sampler owns that choice. [`exact_block`] sums `B` per-iteration draws exactly;
//!   [`clt_block`] draws a block from the normal approximation `N(B mean, B var)` (central limit
//!   theorem; cheap but approximate, see its docs). Checkpoints and roll-backs happen at sampler
//!   boundaries, so a block should be short next to the checkpoint interval.
//! * **Checkpoints.** After a step, when the nominal training time since the last checkpoint
//!   reaches `checkpoint_interval_s` (a fixed number of steps, as frameworks checkpoint every N
//!   iterations), a checkpoint is written; training stalls for `checkpoint_write_s` (a blocking
//!   write). The checkpoint counts once the write completes.
//! * **Fail-stop failures** arrive as a Poisson process in wall time with rate
//!   `gpus x rate_per_gpu_hour / 3600` per second, over the whole run: during training, checkpoint
//!   writes and restarts alike. A failure loses everything since the last completed checkpoint
//!   (the steps, a partial step, a partial write), then the job restarts for `restart_s`; a
//!   failure during a restart starts the restart over (and counts as an interruption).
//! * **Fail-slow episodes** arrive as a Poisson process in wall time with rate
//!   `gpus x rate_per_gpu_hour / 3600` and last a drawn `duration_s` of wall time each. While at
//!   least one episode is active, training runs `slowdown` times slower: a synchronous job runs at
//!   the pace of its slowest GPU, so overlapping episodes do not compound (every episode has the
//!   same slowdown), and one slow GPU slows the whole job. Checkpoint writes and restarts are not
//!   slowed. Episodes are a property of the hardware and go on across restarts.
//!
//! Accounting: `total_s = productive_s + checkpoint_s + lost_s + restart_s_total + slow_s`
//! (up to rounding), where `productive_s` is the nominal (unslowed) time of the steps that make
//! it into the final model, `slow_s` the stretch those steps suffered, and `lost_s` everything
//! rolled back by failures.
//!
//! Published failure figures convert to the per-GPU rate with [`rate_per_gpu_hour_from_mttf`]
//! (a job MTTF at a job size), [`rate_per_gpu_hour_from_node_days`] (a rate per node-day) and
//! [`MttfScaling`] (a power law `MTTF(n) = a n^-b` through two job sizes).
//!
//! The core does no I/O; all randomness comes from the caller's generator.

use rand::RngExt;
use rand_distr::{Distribution, Gamma, LogNormal, Normal};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::variability::{Dist, FailSlow, Failures};

/// One training run to play out.
#[derive(Clone, Debug, PartialEq)]
pub struct RunModel {
    /// Calls of the step-time sampler that make up the run (iterations, or blocks of them).
    pub steps: u64,
    /// GPUs in the job (failure and fail-slow rates are per GPU).
    pub gpus: u64,
    /// Fail-stop failures and checkpointing; `None`: no failures and no checkpoints.
    pub failures: Option<Failures>,
    /// Fail-slow episodes; `None`: none.
    pub fail_slow: Option<FailSlow>,
}

/// What happened in one simulated run. All times in seconds of wall time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOutcome {
    /// Wall time from start to the last step.
    pub total_s: f64,
    /// Nominal time of the steps kept in the final model (useful training).
    pub productive_s: f64,
    /// Fail-stop interruptions (including failures during a restart).
    pub interruptions: u64,
    /// Checkpoints completed.
    pub checkpoints: u64,
    /// Time stalled writing the completed checkpoints.
    pub checkpoint_s: f64,
    /// Wall time rolled back by failures: steps since the last checkpoint, partial steps and
    /// partial checkpoint writes.
    pub lost_s: f64,
    /// Time spent restarting (complete and interrupted restarts).
    pub restart_s_total: f64,
    /// Extra time of the kept steps caused by fail-slow episodes.
    pub slow_s: f64,
    /// Sampler calls made, including steps redone after failures.
    pub steps_run: u64,
    /// `false` when the run was abandoned by the livelock guard (failures so frequent that it
    /// made no progress: more than `1000 x steps + 1e6` sampler calls or [`MAX_INTERRUPTIONS`]
    /// interruptions); the figures then cover the time simulated so far.
    pub completed: bool,
}

/// Interruptions after which a run is abandoned (`RunOutcome::completed = false`).
pub const MAX_INTERRUPTIONS: u64 = 10_000_000;

/// Expected fail-stop interruptions in `wall_s` seconds on `gpus` GPUs:
/// `rate_per_gpu_hour x gpus x wall_s / 3600` (a Poisson process in wall time).
pub fn expected_interruptions(failures: &Failures, gpus: u64, wall_s: f64) -> f64 {
    failures.rate_per_gpu_hour * gpus as f64 * wall_s / 3600.0
}

/// Mean time between interruptions of the whole job, seconds (`inf` when the rate is zero).
pub fn job_mtbf_s(failures: &Failures, gpus: u64) -> f64 {
    let per_s = per_second(failures.rate_per_gpu_hour, gpus);
    if per_s > 0.0 {
        1.0 / per_s
    } else {
        f64::INFINITY
    }
}

/// Why a failure rate could not be derived from published figures.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum RateError {
    /// An input (an MTTF, a GPU count, a rate) is zero, negative or not finite.
    #[error("{what} must be positive and finite, got {value}")]
    NotPositive {
        /// Which input.
        what: &'static str,
        /// Its value.
        value: f64,
    },
    /// A two-point fit was given the same GPU count twice.
    #[error("a two-point fit needs two different GPU counts, got {0} twice")]
    SameGpuCount(u64),
    /// The inputs are valid but the result overflows or underflows (is not a positive finite
    /// number).
    #[error("the derived {0} is out of range (overflow or underflow)")]
    OutOfRange(&'static str),
}

fn positive(what: &'static str, value: f64) -> Result<f64, RateError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(RateError::NotPositive { what, value })
    }
}

fn positive_count(what: &'static str, n: u64) -> Result<f64, RateError> {
    positive(what, n as f64)
}

fn in_range(what: &'static str, value: f64) -> Result<f64, RateError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(RateError::OutOfRange(what))
    }
}

/// Per-GPU-hour failure rate implied by a job-level mean time to failure: a synchronous job
/// stops when any of its GPUs fails, so with `gpus` independent GPUs of rate `r` the job rate is
/// `gpus x r` and `r = 1 / (mttf_hours x gpus)`.
///
/// Kokolis et al. (arXiv:2410.21680): MTTF 7.9 h at 1,024 GPUs gives `1 / 8089.6` = 1.236e-4
/// per GPU-hour. Errors when an input is not positive and finite.
pub fn rate_per_gpu_hour_from_mttf(mttf_hours: f64, gpus: u64) -> Result<f64, RateError> {
    let m = positive("MTTF (hours)", mttf_hours)?;
    let n = positive_count("GPU count", gpus)?;
    in_range("rate per GPU-hour", 1.0 / (m * n))
}

/// Failures per node-day implied by a job-level MTTF, for nodes of `gpus_per_node` GPUs:
/// `24 x gpus_per_node / (mttf_hours x gpus)` (the inverse is the per-node MTBF in days).
///
/// MTTF 7.9 h at 1,024 GPUs with 8 GPUs per node: 0.0237 per node-day (23.7 per 1000
/// node-days), a per-node MTBF of 42.1 days. Errors when an input is not positive and finite.
pub fn failures_per_node_day_from_mttf(
    mttf_hours: f64,
    gpus: u64,
    gpus_per_node: u64,
) -> Result<f64, RateError> {
    let r = rate_per_gpu_hour_from_mttf(mttf_hours, gpus)?;
    let g = positive_count("GPUs per node", gpus_per_node)?;
    in_range("failures per node-day", r * 24.0 * g)
}

/// Per-GPU-hour rate from a rate per node-day: `per_node_day / (24 x gpus_per_node)` (failures
/// of a node are charged evenly to its GPUs; for a whole-node job the split does not matter).
///
/// 6.50 per 1000 node-days with 8 GPUs per node: 3.39e-5 per GPU-hour. Errors when an input is
/// not positive and finite.
pub fn rate_per_gpu_hour_from_node_days(
    failures_per_node_day: f64,
    gpus_per_node: u64,
) -> Result<f64, RateError> {
    let r = positive("failures per node-day", failures_per_node_day)?;
    let g = positive_count("GPUs per node", gpus_per_node)?;
    in_range("rate per GPU-hour", r / (24.0 * g))
}

/// Job MTTF as a power law of the job size: `MTTF(n) = a x n^-b` hours for a job of `n` GPUs.
///
/// `b = 1` is the independent-failure model of [`rate_per_gpu_hour_from_mttf`] (the job rate
/// grows linearly with its size, the per-GPU rate is constant); `b > 1` means large jobs fail
/// more often per GPU than small ones (e.g. more network components per GPU, or failures
/// that spread), `b < 1` less often. The per-GPU rate is `n^(b-1) / a`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MttfScaling {
    /// MTTF of a one-GPU job, hours (the prefactor).
    pub a: f64,
    /// Exponent: how fast the MTTF falls with the job size.
    pub b: f64,
}

impl MttfScaling {
    /// The independent-failure model (`b = 1`) through one point: `a = mttf_hours x gpus`.
    /// Errors when an input is not positive and finite.
    pub fn independent(mttf_hours: f64, gpus: u64) -> Result<Self, RateError> {
        let r = rate_per_gpu_hour_from_mttf(mttf_hours, gpus)?;
        Ok(MttfScaling { a: 1.0 / r, b: 1.0 })
    }

    /// The power law through two `(GPUs, MTTF in hours)` points:
    /// `b = ln(m1 / m2) / ln(n2 / n1)`, `a = m1 x n1^b`.
    ///
    /// Kokolis et al. (arXiv:2410.21680, Fig. 7): (8 GPUs, 47.7 days = 1144.8 h) and
    /// (1024 GPUs, 7.9 h) give `b = 1.0256`, close to independent failures. Errors when a GPU
    /// count or MTTF is not positive and finite, when both counts are equal, or when the fit
    /// overflows.
    pub fn fit_two_points(
        (n1, mttf1_hours): (u64, f64),
        (n2, mttf2_hours): (u64, f64),
    ) -> Result<Self, RateError> {
        let x1 = positive_count("GPU count", n1)?;
        let x2 = positive_count("GPU count", n2)?;
        let m1 = positive("MTTF (hours)", mttf1_hours)?;
        let m2 = positive("MTTF (hours)", mttf2_hours)?;
        if n1 == n2 {
            return Err(RateError::SameGpuCount(n1));
        }
        let b = (m1.ln() - m2.ln()) / (x2.ln() - x1.ln());
        if !b.is_finite() {
            return Err(RateError::OutOfRange("exponent"));
        }
        let a = in_range("prefactor", (m1.ln() + b * x1.ln()).exp())?;
        Ok(MttfScaling { a, b })
    }

    /// Predicted MTTF of a job of `gpus` GPUs, hours: `a x gpus^-b` (`inf` for 0 GPUs when
    /// `b > 0`).
    pub fn mttf_hours(&self, gpus: u64) -> f64 {
        self.a * (gpus as f64).powf(-self.b)
    }

    /// Predicted per-GPU-hour failure rate at `gpus` GPUs: `1 / (MTTF(gpus) x gpus)` =
    /// `gpus^(b-1) / a`, usable as [`Failures::rate_per_gpu_hour`] for a job of that size.
    pub fn rate_per_gpu_hour(&self, gpus: u64) -> f64 {
        (gpus as f64).powf(self.b - 1.0) / self.a
    }

    /// Expected failures of a `gpus`-GPU job in `hours` of wall time: `hours / MTTF(gpus)`.
    pub fn expected_failures(&self, gpus: u64, hours: f64) -> f64 {
        hours / self.mttf_hours(gpus)
    }
}

/// Young's (1974) optimum checkpoint interval, first order: `sqrt(2 x write x MTBF)`.
pub fn young_interval_s(checkpoint_write_s: f64, mtbf_s: f64) -> f64 {
    (2.0 * checkpoint_write_s * mtbf_s).sqrt()
}

/// Daly's (2006) higher-order optimum checkpoint interval:
/// `sqrt(2 d M) [1 + sqrt(d / 2M) / 3 + (d / 2M) / 9] - d` for `d < 2M`, else `M`
/// (`d` the write time, `M` the MTBF).
pub fn daly_interval_s(checkpoint_write_s: f64, mtbf_s: f64) -> f64 {
    let d = checkpoint_write_s;
    let m = mtbf_s;
    if d >= 2.0 * m {
        return m;
    }
    let r = d / (2.0 * m);
    (2.0 * d * m).sqrt() * (1.0 + r.sqrt() / 3.0 + r / 9.0) - d
}

/// First-order effective training ratio of checkpoint / restart:
/// `tau / (tau + d) x (1 - lambda ((tau + d) / 2 + R))`, clamped to `[0, 1]`
/// (`tau` interval, `d` write, `R` restart, `lambda` job failure rate). Each failure loses on
/// average half a checkpoint period plus a restart; of the remaining time a fraction
/// `tau / (tau + d)` trains. Valid when `lambda (tau + d + R)` is small.
pub fn first_order_ettr(failures: &Failures, gpus: u64) -> f64 {
    let lambda = per_second(failures.rate_per_gpu_hour, gpus);
    let tau = failures.checkpoint_interval_s;
    let d = failures.checkpoint_write_s;
    let r = failures.restart_s;
    let ratio = tau / (tau + d) * (1.0 - lambda * ((tau + d) / 2.0 + r));
    if ratio.is_nan() {
        0.0
    } else {
        ratio.clamp(0.0, 1.0)
    }
}

/// Long-run fraction of wall time during which at least one fail-slow episode is active:
/// `1 - exp(-lambda E[duration])` (the busy probability of an M/G/infinity queue).
pub fn expected_slow_fraction(fail_slow: &FailSlow, gpus: u64) -> f64 {
    let lambda = per_second(fail_slow.rate_per_gpu_hour, gpus);
    1.0 - (-lambda * dist_mean(&fail_slow.duration_s)).exp()
}

/// Productive time over total time (`0` for an empty run).
pub fn effective_training_ratio(o: &RunOutcome) -> f64 {
    if o.total_s > 0.0 {
        o.productive_s / o.total_s
    } else {
        0.0
    }
}

/// A sampler of blocks of `block` iterations that sums `block` draws of `step` (exact).
pub fn exact_block<'a>(
    mut step: impl FnMut(&mut Xoshiro256PlusPlus) -> f64 + 'a,
    block: u64,
) -> impl FnMut(&mut Xoshiro256PlusPlus) -> f64 + 'a {
    move |rng| (0..block).map(|_| step(rng)).sum()
}

/// A sampler of blocks of `block` i.i.d. iterations of mean `mean_s` and standard deviation
/// `std_s`, drawn from the central-limit approximation `N(block x mean, block x std^2)` and
/// truncated at 0. The mean and variance of a block are exact; its shape is approximate (a
/// skewed step-time distribution gives a less skewed block), which matters little once a block
/// holds tens of iterations. Use [`exact_block`] when the step distribution's shape matters.
pub fn clt_block(
    mean_s: f64,
    std_s: f64,
    block: u64,
) -> impl FnMut(&mut Xoshiro256PlusPlus) -> f64 {
    let b = block as f64;
    let normal = Normal::new(mean_s * b, std_s.abs() * b.sqrt()).ok();
    move |rng| match &normal {
        Some(n) => n.sample(rng).max(0.0),
        None => (mean_s * b).max(0.0),
    }
}

/// Plays out one run. `step_time` returns the nominal time of one step (one iteration or one
/// block of them) and may draw from `rng`; non-finite or negative times count as 0. The run
/// ends when `model.steps` steps are kept (or the livelock guard fires, see
/// [`RunOutcome::completed`]).
pub fn simulate_run(
    step_time: &mut dyn FnMut(&mut Xoshiro256PlusPlus) -> f64,
    model: &RunModel,
    rng: &mut Xoshiro256PlusPlus,
) -> RunOutcome {
    let mut o = RunOutcome {
        completed: true,
        ..Default::default()
    };
    if model.steps == 0 {
        return o;
    }
    let (fail_rate, interval, write, restart) = match &model.failures {
        Some(f) => (
            per_second(f.rate_per_gpu_hour, model.gpus),
            f.checkpoint_interval_s,
            nonneg(f.checkpoint_write_s),
            nonneg(f.restart_s),
        ),
        None => (0.0, f64::INFINITY, 0.0, 0.0),
    };
    let mut slow = SlowState::new(model.fail_slow.as_ref(), model.gpus, rng);
    let max_steps = model.steps.saturating_mul(1000).saturating_add(1_000_000);

    let mut t = 0.0_f64;
    let mut next_fail = exp_after(t, fail_rate, rng);
    // Steps kept so far, and at the last completed checkpoint.
    let mut done = 0u64;
    let mut ckpt_done = 0u64;
    // The current segment (since the last checkpoint or restart): its start, nominal time and
    // fail-slow stretch.
    let mut seg_start = 0.0_f64;
    let mut seg_work = 0.0_f64;
    let mut seg_extra = 0.0_f64;

    while done < model.steps {
        if o.steps_run >= max_steps || o.interruptions >= MAX_INTERRUPTIONS {
            o.completed = false;
            break;
        }
        let d = nonneg(step_time(rng));
        o.steps_run += 1;
        let extra = slow.advance(t, d, rng);
        let end = t + d + extra;
        let mut failed_at = None;
        if next_fail < end {
            failed_at = Some(next_fail);
        } else {
            t = end;
            done += 1;
            seg_work += d;
            seg_extra += extra;
            if seg_work >= interval {
                let wend = t + write;
                if next_fail < wend {
                    failed_at = Some(next_fail);
                } else {
                    t = wend;
                    o.productive_s += seg_work;
                    o.slow_s += seg_extra;
                    o.checkpoint_s += write;
                    o.checkpoints += 1;
                    ckpt_done = done;
                    seg_start = t;
                    seg_work = 0.0;
                    seg_extra = 0.0;
                }
            }
        }
        if let Some(tf) = failed_at {
            o.interruptions += 1;
            o.lost_s += tf - seg_start;
            t = tf;
            done = ckpt_done;
            seg_work = 0.0;
            seg_extra = 0.0;
            // Restart; a failure during it starts it over.
            loop {
                next_fail = exp_after(t, fail_rate, rng);
                if next_fail < t + restart {
                    o.restart_s_total += next_fail - t;
                    t = next_fail;
                    o.interruptions += 1;
                    if o.interruptions >= MAX_INTERRUPTIONS {
                        break;
                    }
                } else {
                    o.restart_s_total += restart;
                    t += restart;
                    break;
                }
            }
            seg_start = t;
        }
    }
    if o.completed {
        o.productive_s += seg_work;
        o.slow_s += seg_extra;
    } else {
        o.lost_s += t - seg_start;
    }
    o.total_s = t;
    o
}

/// Job-wide events per second from a per-GPU-hour rate (0 when not a positive finite rate).
fn per_second(rate_per_gpu_hour: f64, gpus: u64) -> f64 {
    let r = rate_per_gpu_hour * gpus as f64 / 3600.0;
    if r.is_finite() && r > 0.0 { r } else { 0.0 }
}

fn nonneg(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 { x } else { 0.0 }
}

/// A standard exponential draw (mean 1).
fn exp1(rng: &mut Xoshiro256PlusPlus) -> f64 {
    // random::<f64>() is in [0, 1), so 1 - u is in (0, 1] and the logarithm is finite.
    -(1.0 - rng.random::<f64>()).ln()
}

/// `t` plus an exponential gap of rate `rate` per second (`inf` when the rate is 0).
fn exp_after(t: f64, rate: f64, rng: &mut Xoshiro256PlusPlus) -> f64 {
    if rate > 0.0 {
        t + exp1(rng) / rate
    } else {
        f64::INFINITY
    }
}

/// The mean of a distribution (`0` for an empty empirical one).
fn dist_mean(d: &Dist) -> f64 {
    match d {
        Dist::Constant(v) => *v,
        Dist::Normal { mean, .. } => *mean,
        Dist::LogNormal { mu, sigma } => (mu + 0.5 * sigma * sigma).exp(),
        Dist::Gamma { shape, scale } => shape * scale,
        Dist::Exponential { mean } => *mean,
        Dist::Empirical(v) if v.is_empty() => 0.0,
        Dist::Empirical(v) => v.iter().sum::<f64>() / v.len() as f64,
    }
}

/// One draw of a non-negative quantity (a duration): normal draws are truncated at 0; invalid
/// parameters give the mean (or 0).
fn draw(d: &Dist, rng: &mut Xoshiro256PlusPlus) -> f64 {
    let x = match d {
        Dist::Constant(v) => *v,
        Dist::Normal { mean, std } => match Normal::new(*mean, *std) {
            Ok(n) => n.sample(rng),
            Err(_) => *mean,
        },
        Dist::LogNormal { mu, sigma } => match LogNormal::new(*mu, *sigma) {
            Ok(n) => n.sample(rng),
            Err(_) => dist_mean(d),
        },
        Dist::Gamma { shape, scale } => match Gamma::new(*shape, *scale) {
            Ok(g) => g.sample(rng),
            Err(_) => dist_mean(d),
        },
        Dist::Exponential { mean } => mean * exp1(rng),
        Dist::Empirical(v) if v.is_empty() => 0.0,
        Dist::Empirical(v) => v[rng.random_range(0..v.len())],
    };
    nonneg(x)
}

/// Fail-slow episodes in wall time: the next arrival and the end of the current slow spell.
struct SlowState<'a> {
    rate: f64,
    slowdown: f64,
    duration: Option<&'a Dist>,
    next_arrival: f64,
    slow_until: f64,
}

impl<'a> SlowState<'a> {
    fn new(fs: Option<&'a FailSlow>, gpus: u64, rng: &mut Xoshiro256PlusPlus) -> Self {
        let off = SlowState {
            rate: 0.0,
            slowdown: 1.0,
            duration: None,
            next_arrival: f64::INFINITY,
            slow_until: f64::NEG_INFINITY,
        };
        let Some(fs) = fs else {
            return off;
        };
        let rate = per_second(fs.rate_per_gpu_hour, gpus);
        if rate <= 0.0 || !(fs.slowdown.is_finite() && fs.slowdown > 0.0) {
            return off;
        }
        SlowState {
            rate,
            slowdown: fs.slowdown,
            duration: Some(&fs.duration_s),
            next_arrival: exp_after(0.0, rate, rng),
            slow_until: f64::NEG_INFINITY,
        }
    }

    /// Runs `work` seconds of nominal training from wall time `t`; returns the extra wall time
    /// the fail-slow spells added (0 when none overlaps).
    fn advance(&mut self, t: f64, work: f64, rng: &mut Xoshiro256PlusPlus) -> f64 {
        let mut now = t;
        let mut work = work;
        let mut extra = 0.0;
        loop {
            while self.next_arrival <= now {
                let dur = self.duration.map_or(0.0, |d| draw(d, rng));
                self.slow_until = self.slow_until.max(self.next_arrival + dur);
                self.next_arrival = exp_after(self.next_arrival, self.rate, rng);
            }
            if now < self.slow_until {
                let piece_end = self.slow_until.min(self.next_arrival);
                let cap = (piece_end - now) / self.slowdown;
                if work <= cap {
                    return extra + work * (self.slowdown - 1.0);
                }
                extra += cap * (self.slowdown - 1.0);
                work -= cap;
                now = piece_end;
            } else {
                let cap = self.next_arrival - now;
                if work <= cap {
                    return extra;
                }
                work -= cap;
                now = self.next_arrival;
            }
        }
    }
}
