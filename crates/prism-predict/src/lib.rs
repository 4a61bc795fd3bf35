//! # prism-predict
//!
//! PRISM (Golden et al., arXiv:2510.15596) on Prism's engine: training time as a distribution.
//! It is a layer over `prism-core`, not a second simulator: every sample is an iteration of the
//! same execution graph, played by the engine (through its [`Perturb`](prism_core::engine::Perturb)
//! hook) or by the max-plus step model compiled from that graph and one engine run.
//!
//! ```text
//! [variability] -> Perturbation (one sample's draws) -> step time (engine or step model)
//!     -> step-time samples -> whole runs (failures, checkpoints, fail-slow) -> guarantee
//! ```
//!
//! - [`variability`]: what varies (plain values of the job's `[variability]` section).
//! - [`stats`]: seeded streams, distributions, maximum-likelihood fits, quantile bounds.
//! - [`guarantee`]: bounds and Monte Carlo errors over independent clusters of samples.
//! - [`perturbation`]: one sample's draws, as the engine plays them.
//! - [`step_model`]: the max-plus step model, its fast sampler and replica pruning.
//! - [`attribution`]: the critical path of a recorded iteration.
//! - [`reliability`]: whole runs with failures, restarts, checkpoints and fail-slow episodes.
//! - [`predict`]: `prism predict` as a library call (step samples, runs, guarantee).
//! - [`coverage`]: `prism predict --check-coverage`, the guarantee's coverage over seeds.
//! - [`explore`]: `prism explore` as a library call (layouts ranked by mean, p95 or p99).
//!
//! ```
//! use prism_core::job::fixtures::small_job;
//! use prism_predict::perturbation::Perturbation;
//! use prism_predict::step_model::StepModel;
//! // A small GPT on 2 nodes of 8 H100: tp 2, pp 2, dp 4.
//! let job = small_job(2, 2, 2, 16);
//! let model = StepModel::new(&job, &Default::default()).unwrap();
//! // With nothing perturbed, the step model's longest path is the engine's iteration time.
//! let engine = prism_core::simulate(&job, &Default::default()).unwrap();
//! let exact = model.sample_exact(&Perturbation::default()).unwrap();
//! assert!((exact - engine.summary.iteration_time_s).abs() < 1e-9);
//! ```

pub mod attribution;
pub mod coverage;
pub mod explore;
pub mod guarantee;
pub mod perturbation;
pub mod predict;
pub mod reliability;
pub mod stats;
pub mod step_model;
pub mod variability;

/// Called with the number of units of work just finished (a progress bar's `inc`).
pub type Progress<'a> = dyn Fn(u64) + Sync + 'a;

/// What a PRISM computation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request or input that breaks a rule; the message names it.
    #[error("{0}")]
    Invalid(String),
    /// A simulation failed.
    #[error("{context}")]
    Sim {
        /// What was being simulated.
        context: String,
        /// Why it failed.
        #[source]
        source: SimError,
    },
}

impl Error {
    pub(crate) fn sim(context: impl Into<String>, source: SimError) -> Self {
        Error::Sim {
            context: context.into(),
            source,
        }
    }
}

use prism_core::engine::SimError;
