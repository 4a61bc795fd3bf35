//! # prism-core
//!
//! The pure core of Prism: it turns a validated [`job::Job`] into the work every GPU does in one
//! training iteration and plays that work out in simulated time.
//!
//! Data flow, one module per box:
//!
//! ```text
//! job (validated values) -> layout (ranks, groups) -> graph (per-rank programs)
//!     -> cost (compute, communication, memory) -> engine (discrete events, network flows)
//!     -> report (iteration summary)
//! ```
//!
//! The core does no I/O: no files, no clocks, no environment, no global randomness. Formats live
//! in `prism-io`; the command line in `prism-cli`.
//!

pub mod cost;
pub mod engine;
pub mod flops;
pub mod graph;
pub mod job;
pub mod layout;
pub mod memory;
pub mod network;
pub mod ops;
pub mod report;
pub mod units;

pub use engine::{Mode, SimOptions, SimResult, simulate};
