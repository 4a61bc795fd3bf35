//! PrismLLM (arXiv 2605.15617): hybrid emulation. A few *real* ranks run the real training
//! program while every other rank of the target job is replayed on Prism's engine as a
//! *virtual* participant; the coordinator answers each communication call of a real rank when
//! the call completes in emulated time.
//!
//! The crate will drive `prism-core`'s engine like the other capabilities (no simulator of its
//! own). So far it holds the wire protocol between real ranks and the coordinator
//! ([`protocol`], specified in `docs/emulate.md`); slicing, the coordinator and the clients are
//! to be built on it.

pub mod comm;
pub mod protocol;
pub mod validate;
pub mod worker;
pub mod workload;
