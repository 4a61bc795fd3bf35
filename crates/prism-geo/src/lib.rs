//! # prism-geo
//!
//! Training across datacenters on Prism's engine (`prism-core`), after ATLAS and BUBBLETEA
//! (Gandhi et al., arXiv 2411.14458; only the abstract is public, see docs/geo.md):
//!
//! - [`plan`]: ATLAS placement (pipeline stages across DCs, DP and TP inside a DC, DCs largest
//!   first, search over pp, dp, micro-batch and DC order) with temporal WAN sharing and several
//!   TCP connections per transfer, against three baselines;
//! - [`bubbles`]: BUBBLETEA, inference prefill admitted into the pipeline bubbles of the
//!   simulated schedule without slowing training (checked by re-simulation);
//! - [`sweep`]: scenario sweeps over WAN bandwidth, RTT, datacenter count and model size.
//!
//! Every number comes from the engine: candidates are simulated (one representative per
//! pipeline stage, exact for these symmetric placements), never estimated by a formula.

pub mod bubbles;
pub mod plan;
pub mod sweep;
