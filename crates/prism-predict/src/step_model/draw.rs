use super::*;

/// Per-segment statistics of the fast sampler.
#[derive(Clone, Debug)]
pub(super) struct SegStats {
    /// Mean duration of each macro-op that is a segment (ps; 0 otherwise), per stage.
    pub(super) mean: Vec<Vec<f64>>,
    /// Standard deviation (ps), per stage.
    pub(super) sd: Vec<Vec<f64>>,
    /// Factor mean and standard deviation per jitter group (kernels of one class with the same
    /// op-name entries; for a group drawn per kernel: the mean, used only to weigh
    /// attribution, and 0).
    pub(super) group: Vec<(f64, f64)>,
    /// Groups whose jitter is not one normal: drawn kernel by kernel as a constant times the
    /// product of these distributions.
    pub(super) kernel: Vec<Option<KernelDraw>>,
    /// Jitter group of each kernel, per stage.
    pub(super) kgroup: Vec<Vec<u32>>,
    /// Segments (per stage) holding such a kernel.
    pub(super) pk: Vec<Vec<bool>>,
}

/// The per-kernel draw of a class whose jitter has no segment-sum shortcut: `k` times one draw
/// of the only distribution, or, when several apply, the product of their quantiles at one
/// shared uniform (as the engine draws them).
#[derive(Clone, Debug)]
pub(super) struct KernelDraw {
    pub(super) k: f64,
    pub(super) dists: Vec<Dist>,
}

impl KernelDraw {
    pub(super) fn draw(&self, rng: &mut Xoshiro256PlusPlus) -> f64 {
        match self.dists.as_slice() {
            [d] => self.k * d.sample(rng),
            ds => {
                let u: f64 = rng.random();
                self.k * ds.iter().map(|d| d.quantile(u)).product::<f64>()
            }
        }
    }

    pub(super) fn mean(&self) -> f64 {
        self.k * self.dists.iter().map(Dist::mean).product::<f64>()
    }
}

/// Quantile table of the maximum of `lanes` i.i.d. standard normals.
#[derive(Clone, Debug)]
pub(super) struct MaxTable {
    pub(super) lanes: u32,
    pub(super) q: Vec<f64>,
}

pub(super) const TABLE_POINTS: usize = 16_384;

/// Bins at either end (1% of the probability each) computed exactly instead of interpolated.
pub(super) const TABLE_EXACT_BINS: usize = 164;

impl MaxTable {
    pub(super) fn new(lanes: u32) -> Self {
        let q = (0..=TABLE_POINTS)
            .map(|k| Self::exact(lanes, k as f64 / TABLE_POINTS as f64))
            .collect();
        MaxTable { lanes, q }
    }

    pub(super) fn exact(lanes: u32, u: f64) -> f64 {
        crate::stats::std_normal_quantile(u.powf(1.0 / lanes as f64))
    }

    /// `Phi^-1(u^(1/lanes))`.
    pub(super) fn quantile(&self, u: f64) -> f64 {
        let x = u * TABLE_POINTS as f64;
        let i = x as usize;
        if !(TABLE_EXACT_BINS..TABLE_POINTS - TABLE_EXACT_BINS).contains(&i) {
            return Self::exact(self.lanes, u);
        }
        let w = x - i as f64;
        self.q[i] + w * (self.q[i + 1] - self.q[i])
    }
}

/// How a sample draws kernel times.
pub(super) enum Draw<'a> {
    /// The engine's per-kernel hash draws.
    Exact(&'a Perturbation),
    /// Per-segment draws with order-statistic shortcuts; replica `r` draws from its own stream
    /// `replica_rng(seed, r)` (the tail from `replica_rng(seed, dp)`).
    Fast {
        group: &'a [(f64, f64)],
        /// Jitter group of each kernel, per stage ([`SegStats::kgroup`]).
        kgroup: &'a [Vec<u32>],
        kernel: &'a [Option<KernelDraw>],
        /// Segments holding a kernel drawn on its own ([`SegStats::pk`]).
        pk: &'a [Vec<bool>],
        table: &'a MaxTable,
        rank_factor: &'a [f64],
        /// The sample's pools ([`super::pool`]; empty unless the program is pooled).
        pools: &'a [Vec<f64>],
        seed: u64,
        rng: Xoshiro256PlusPlus,
    },
    /// Nominal durations.
    Nominal,
}

/// The random stream of replica `r` of a fast sample.
pub(super) fn replica_rng(seed: u64, r: u64) -> Xoshiro256PlusPlus {
    use rand::SeedableRng;
    Xoshiro256PlusPlus::seed_from_u64(seed ^ r.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Takes `n` standard normal draws from the fast sampler's generator (the per-replica stream of
/// sample `seed`) and returns their sum, so that `prism bench` can time one draw.
pub fn normal_draws(n: u64, seed: u64) -> f64 {
    let mut rng = replica_rng(seed, 0);
    (0..n)
        .map(|_| -> f64 { StandardNormal.sample(&mut rng) })
        .sum()
}

/// The fast sampler's per-job statistics ([`StepModel::fast_stats`]).
#[derive(Clone, Debug)]
pub struct FastStats {
    pub(super) stats: SegStats,
    pub(super) table: MaxTable,
    pub(super) tape: Tape,
    /// Made with per-GPU speeds (their segments are per lane).
    pub(super) speeds: bool,
    /// What replica pruning needs ([`StepModel::sample_pruned`]); `None` when it cannot apply.
    pub(super) prune: Option<PruneWeights>,
    /// The program with its lane races pooled ([`super::pool`]); `None` when no race repeats
    /// often enough, with per-GPU speeds, or when pooling was turned off.
    pub(super) pooled: Option<Pooled>,
}

impl FastStats {
    /// The pooled shapes, each with the number of blocks one sample draws from its pool.
    pub fn pooled_shapes(&self) -> Vec<u64> {
        (self.pooled.iter())
            .flat_map(|p| p.regions.iter().map(|r| r.uses))
            .collect()
    }
}

/// How many draws one fast sample takes ([`StepModel::draws_per_sample`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrawCount {
    /// Draws of one lane's segment (or, for a jitter without the normal shortcut, kernel) time.
    pub lane: u64,
    /// Draws of a whole tensor-parallel group's slowest lane at once (order statistics).
    pub group: u64,
}

impl StepModel {
    /// The number of random draws one [`StepModel::sample_fast`] takes with these statistics
    /// (with per-GPU speeds when they were made with them, without them when pooled), counted
    /// on the compiled program: a pooled block is one draw of a whole group (its pick), and a
    /// pool is its size times its block's draws. A segment whose all-gather gate may still be
    /// running when it starts is counted at its most: one draw per lane per piece between
    /// gates.
    pub fn draws_per_sample(&self, fast: &FastStats) -> DrawCount {
        let dp = self.layout.dp as u64;
        let tape = fast.pooled.as_ref().map_or(&fast.tape, |p| &p.tape);
        let mut n = self.tape_draws(fast, tape);
        n.lane *= dp;
        n.group *= dp;
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.tail_ops {
                if matches!(st.kind[op as usize], MKind::Seg { .. }) {
                    n.lane += dp * lanes(&self.layout) as u64 * self.lane_draws(&fast.stats, s, op);
                }
            }
        }
        if let Some(pooled) = &fast.pooled {
            for region in &pooled.regions {
                let r = self.tape_draws(fast, &region.tape);
                n.lane += pooled.size as u64 * r.lane;
                n.group += pooled.size as u64 * r.group;
            }
        }
        n
    }

    /// Draws of one evaluation of `tape` (one replica, or one block of a pool).
    fn tape_draws(&self, fast: &FastStats, tape: &Tape) -> DrawCount {
        let l = lanes(&self.layout) as u64;
        let mut n = DrawCount::default();
        for ins in &tape.ins {
            match ins.code {
                Code::Seg {
                    sd,
                    collapsible,
                    g0,
                    g1,
                    pk,
                    ..
                } => {
                    if g1 > g0 || pk {
                        n.lane += l * self.lane_draws(&fast.stats, ins.stage as usize, ins.op);
                    } else if sd > 0.0 && (ins.out.lanes || collapsible) {
                        if !fast.speeds && !ins.lanes_in && collapsible {
                            n.group += 1;
                        } else {
                            n.lane += l;
                        }
                    }
                }
                Code::Run { s0, s1 } => {
                    for step in &tape.steps[s0 as usize..s1 as usize] {
                        match step.kind {
                            StepKind::Seg { sd, .. } if sd > 0.0 => {
                                if fast.speeds {
                                    n.lane += l;
                                } else {
                                    n.group += 1;
                                }
                            }
                            StepKind::Pool { .. } => n.group += 1,
                            StepKind::Seg { .. } | StepKind::Comm { .. } => {}
                        }
                    }
                }
                Code::Pool { .. } => n.group += 1,
                Code::Add { .. } | Code::Tp { .. } | Code::Cp { .. } => {}
            }
        }
        n
    }

    /// Draws of [`StepModel::seg_lane`] for segment `op` of stage `s` with every gate binding:
    /// one per piece between gates with any jitter, or, for a segment holding a kernel without
    /// the normal shortcut, one per jittered kernel.
    pub(super) fn lane_draws(&self, stats: &SegStats, s: usize, op: u32) -> u64 {
        let st = &self.stages[s];
        let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
            unreachable!("segment")
        };
        let jittered = |k: u32| {
            let c = stats.kgroup[s][k as usize] as usize;
            stats.kernel[c].is_some() || stats.group[c].1 > 0.0
        };
        if stats.pk[s][op as usize] {
            return (k0..k1).filter(|&k| jittered(k)).count() as u64;
        }
        let mut pieces = 0;
        for_each_piece(st, op, &stats.group, &stats.kgroup[s], |_, _, var| {
            pieces += u64::from(var > 0.0);
        });
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The interpolated quantile table of the maximum of 8 normals against the exact formula.
    #[test]
    pub(super) fn max_table_matches_the_exact_quantile() {
        let t = MaxTable::new(8);
        let mut worst: f64 = 0.0;
        for i in 1..200_000 {
            let u = i as f64 / 200_000.0;
            worst = worst.max((t.quantile(u) - MaxTable::exact(8, u)).abs());
        }
        assert!(worst < 1e-5, "max error {worst}");
        // Independent check through the CDF: P(max of 8 <= q(u)) = Phi(q(u))^8 = u.
        for u in [0.001, 0.05, 0.5, 0.95, 0.999] {
            let p = crate::stats::std_normal_cdf(t.quantile(u)).powi(8);
            assert!((p - u).abs() < 1e-9 + 1e-6 * u, "u {u}: {p}");
        }
    }
}
