//! One Monte Carlo sample's random state, as the engine plays it: which GPUs are slow, how each
//! kernel deviates, how congested the network is. It implements the engine's
//! [`Perturb`] hook, so a perturbed iteration runs in the one engine of `prism-core`.

use prism_core::engine::Perturb;
use prism_core::ops::OpClass;

use crate::variability::Dist;

/// The random state of one simulated iteration. Every draw is a pure function of `seed`, the
/// rank and the op (a counter-based hash), so a sample does not depend on event order or
/// threads.
#[derive(Clone, Debug, PartialEq)]
pub struct Perturbation {
    /// Time factor of every kernel of a rank (persistent speed, fail-slow), by rank; empty
    /// means 1 everywhere.
    pub rank_factor: Vec<f64>,
    /// Per-kernel time factor by op class (`None` = every class).
    pub jitter: Vec<(Option<OpClass>, Dist)>,
    /// Per-kernel time factor of the kernels with this op name (a compute op of the execution
    /// graph, e.g. `fc1_fwd`), on top of its class's. All the entries that apply to a kernel
    /// are drawn at one shared uniform.
    pub op_jitter: Vec<(String, Dist)>,
    /// Time factor of every collective and send of this iteration (one shared draw: correlated
    /// congestion); each collective's duration is shared by all its participants.
    pub comm_factor: f64,
    /// Seed of the per-kernel draws.
    pub seed: u64,
}

impl Default for Perturbation {
    fn default() -> Self {
        Perturbation {
            rank_factor: Vec::new(),
            jitter: Vec::new(),
            op_jitter: Vec::new(),
            comm_factor: 1.0,
            seed: 0,
        }
    }
}

/// SplitMix64 finaliser: a well-mixed 64-bit hash of `x`.
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Perturbation {
    /// True when the perturbation treats every rank alike (one factor for all ranks, no
    /// per-kernel draws): the ranks of a stage stay identical and reduced or sliced runs stay
    /// exact. A communication regime is shared by every collective, so it keeps symmetry.
    pub fn is_symmetric(&self) -> bool {
        self.jitter.is_empty()
            && self.op_jitter.is_empty()
            && self.rank_factor.windows(2).all(|w| w[0] == w[1])
    }

    /// Uniform draw in (0, 1) for (rank, program op).
    fn uniform(&self, rank: u32, op: u32) -> f64 {
        let h = mix64(self.seed ^ mix64(((rank as u64) << 32) | op as u64));
        ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Time factor of kernel `op` (of `class`, named `name`) on `rank`.
    pub fn kernel_factor(&self, rank: u32, op: u32, class: OpClass, name: &str) -> f64 {
        let mut f = self.rank_factor.get(rank as usize).copied().unwrap_or(1.0);
        for (c, d) in &self.jitter {
            if c.is_none_or(|c| c == class) {
                f *= d.quantile(self.uniform(rank, op));
            }
        }
        for (n, d) in &self.op_jitter {
            if n == name {
                f *= d.quantile(self.uniform(rank, op));
            }
        }
        f
    }

    /// These simulation options with this perturbation.
    pub fn options(self, base: &prism_core::SimOptions) -> prism_core::SimOptions {
        prism_core::SimOptions {
            perturbation: Some(std::sync::Arc::new(self)),
            ..base.clone()
        }
    }
}

impl Perturb for Perturbation {
    fn kernel_factor(&self, rank: u32, op: u32, class: OpClass, name: &str) -> f64 {
        Perturbation::kernel_factor(self, rank, op, class, name)
    }

    fn comm_factor(&self) -> f64 {
        self.comm_factor
    }

    fn is_symmetric(&self) -> bool {
        Perturbation::is_symmetric(self)
    }
}
