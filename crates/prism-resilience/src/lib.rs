//! # prism-resilience
//!
//! ResiHP (arXiv 2605.06374) on Prism's engine: a workload-aware detector of fail-slow and
//! fail-stop devices ([`detect`], [`predictor`]), logs with injected faults generated from the
//! engine ([`generate`]), a scheduler that adapts tensor-parallel group sizes, pipeline
//! partitions and micro-batch routing together, with baselines and an exhaustive oracle
//! ([`plan`]), and hours of training with faults ([`scenario`]). No simulator of its own:
//! every iteration is played out by `prism_core::hetero` on the engine.

pub mod detect;
pub mod generate;
pub mod plan;
pub mod predictor;
pub mod scenario;
pub mod workload;
