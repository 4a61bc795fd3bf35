//! PrismLLM (arXiv 2605.15617): hybrid emulation. A few *real* ranks run the real training
//! program while every other rank of the target job is replayed on Prism's engine as a
//! *virtual* participant; the coordinator answers each communication call of a real rank when
//! the call completes in emulated time.
//!
//! The crate drives `prism-core`'s engine like the other capabilities (no simulator of its
//! own): [`protocol`] is the wire protocol between real ranks and the coordinator; [`slice`]
//! and [`graph_file`] turn recorded traces into a target-scale graph (the engine's
//! recorded-trace entry point, `prism_core::recorded`); [`coordinator`] plays the virtual ranks
//! on the engine while real ranks connect; [`comm`], [`workload`], [`worker`] and [`validate`]
//! are the clients, the reference workload and the all-real validation; [`replay`] and
//! [`synth`] are a scripted rank and synthetic traces for tests and benchmarks. See
//! `docs/emulate.md`.

pub mod comm;
mod conn;
pub mod coordinator;
pub mod graph_file;
pub mod protocol;
pub mod replay;
pub mod slice;
pub mod synth;
pub mod validate;
pub mod worker;
pub mod workload;
