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
//! ```
//! use prism_core::{job::fixtures::small_job, simulate, Mode, SimOptions};
//! // A small GPT on 2 nodes of 8 H100: tp 2, pp 2, dp 4, 16 sequences per iteration.
//! let job = small_job(2, 2, 2, 16);
//! job.validate().unwrap();
//! let full = simulate(&job, &SimOptions::default()).unwrap();
//! assert!(full.summary.iteration_time_s > 0.0 && full.summary.mfu < 1.0);
//! // One representative per pipeline stage gives exactly the same iteration time.
//! let reduced = simulate(&job, &SimOptions { mode: Mode::Reduced, ..Default::default() }).unwrap();
//! assert_eq!(full.summary.iteration_time_s, reduced.summary.iteration_time_s);
//! ```
//!

pub mod arch;
pub mod cost;
pub mod engine;
pub mod flops;
pub mod graph;
pub mod hetero;
pub mod insert;
pub mod job;
pub mod layout;
pub mod memory;
pub mod network;
pub mod ops;
pub mod pipeline_layout;
pub mod recorded;
pub mod report;
pub mod schedules;
pub mod straggler;
pub mod units;
pub mod wan;

pub use engine::{Mode, SimOptions, SimResult, simulate, simulate_with_graph};
