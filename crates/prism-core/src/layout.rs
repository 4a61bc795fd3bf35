//! Rank <-> (tp, cp, dp, pp) coordinates and process groups, in Megatron-Core's default order
//! `tp-cp-ep-dp-pp` (tensor parallel varies fastest, pipeline parallel slowest) or in
//! `tp-cp-ep-pp-dp` (`parallel.order`; data parallel slowest, as Llama 3 was trained).
//!
//! Expert parallelism is folded inside data parallelism as in Megatron-Core: the expert-parallel
//! rank of a GPU is `dp % ep` and its expert-data-parallel rank is `dp / ep`.
//!
//! ```
//! use prism_core::{job::fixtures::small_job, layout::{GroupKind, Layout}};
//! let job = small_job(4, 2, 2, 64); // 32 GPUs: tp 2, pp 2, dp 8
//! let l = Layout::new(&job);
//! let c = l.coord(13);
//! assert_eq!((c.tp, c.dp, c.pp), (1, 6, 0));
//! assert_eq!(l.rank(c), 13);
//! assert_eq!(l.members(GroupKind::Tp, l.group_of(GroupKind::Tp, 13)).collect::<Vec<_>>(), vec![12, 13]);
//! ```

use crate::job::{Job, RankOrder};

/// A GPU's position in the parallel layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Coord {
    /// Tensor-parallel rank.
    pub tp: u32,
    /// Context-parallel rank.
    pub cp: u32,
    /// Data-parallel rank.
    pub dp: u32,
    /// Pipeline stage.
    pub pp: u32,
}

/// Kinds of process groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// Tensor parallel: same (cp, dp, pp).
    Tp,
    /// Context parallel: same (tp, dp, pp).
    Cp,
    /// Expert parallel: same (tp, cp, pp, dp / ep).
    Ep,
    /// Dense-gradient data parallel (with context parallel folded in, as Megatron's `dp_cp`
    /// group): same (tp, pp).
    Dp,
    /// Expert-gradient data parallel: same (tp, pp, dp % ep), over cp and dp / ep.
    Edp,
}

/// All group kinds, in a fixed order.
pub const GROUP_KINDS: [GroupKind; 5] = [
    GroupKind::Tp,
    GroupKind::Cp,
    GroupKind::Ep,
    GroupKind::Dp,
    GroupKind::Edp,
];

/// The layout of a validated job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Tensor parallel size.
    pub tp: u32,
    /// Context parallel size.
    pub cp: u32,
    /// Data parallel size.
    pub dp: u32,
    /// Pipeline parallel size.
    pub pp: u32,
    /// Expert parallel size.
    pub ep: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Order of the dimensions over the ranks.
    pub order: RankOrder,
}

impl Layout {
    /// Layout of a validated job.
    pub fn new(job: &Job) -> Self {
        let p = &job.parallel;
        Layout {
            tp: p.tp,
            cp: p.cp,
            dp: p.dp,
            pp: p.pp,
            ep: p.ep,
            gpus_per_node: job.cluster.gpus_per_node,
            order: p.order,
        }
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> u32 {
        self.tp * self.cp * self.dp * self.pp
    }

    /// Coordinates of `rank`.
    pub fn coord(&self, rank: u32) -> Coord {
        debug_assert!(rank < self.num_ranks());
        let tp = rank % self.tp;
        let r = rank / self.tp;
        let cp = r % self.cp;
        let r = r / self.cp;
        let (dp, pp) = match self.order {
            RankOrder::TpCpEpDpPp => (r % self.dp, r / self.dp),
            RankOrder::TpCpEpPpDp => (r / self.pp, r % self.pp),
        };
        Coord { tp, cp, dp, pp }
    }

    /// Rank at `c`.
    pub fn rank(&self, c: Coord) -> u32 {
        debug_assert!(c.tp < self.tp && c.cp < self.cp && c.dp < self.dp && c.pp < self.pp);
        let outer = match self.order {
            RankOrder::TpCpEpDpPp => c.dp + self.dp * c.pp,
            RankOrder::TpCpEpPpDp => c.pp + self.pp * c.dp,
        };
        c.tp + self.tp * (c.cp + self.cp * outer)
    }

    /// The lowest rank of pipeline stage `stage` (its first tensor-, context- and
    /// data-parallel position).
    pub fn first_rank_of_stage(&self, stage: u32) -> u32 {
        self.rank(Coord {
            tp: 0,
            cp: 0,
            dp: 0,
            pp: stage,
        })
    }

    /// The ranks of pipeline stage `stage`, ascending.
    pub fn stage_ranks(&self, stage: u32) -> impl Iterator<Item = u32> + '_ {
        let l = *self;
        let inner = self.tp * self.cp;
        (0..self.dp).flat_map(move |dp| {
            let base = l.rank(Coord {
                tp: 0,
                cp: 0,
                dp,
                pp: stage,
            });
            base..base + inner
        })
    }

    /// Node hosting `rank`.
    pub fn node(&self, rank: u32) -> u32 {
        rank / self.gpus_per_node
    }

    /// Index of `rank` inside its node (its rail).
    pub fn local(&self, rank: u32) -> u32 {
        rank % self.gpus_per_node
    }

    /// Ranks per pipeline stage.
    pub fn stage_size(&self) -> u32 {
        self.tp * self.cp * self.dp
    }

    /// The same-position rank `delta` stages away (`delta` = +1 next stage, -1 previous).
    pub fn pp_peer(&self, rank: u32, delta: i32) -> Option<u32> {
        let c = self.coord(rank);
        let pp = c.pp as i64 + delta as i64;
        if pp < 0 || pp >= self.pp as i64 {
            None
        } else {
            Some(self.rank(Coord { pp: pp as u32, ..c }))
        }
    }

    /// Members in a group of `kind`.
    pub fn group_size(&self, kind: GroupKind) -> u32 {
        match kind {
            GroupKind::Tp => self.tp,
            GroupKind::Cp => self.cp,
            GroupKind::Ep => self.ep,
            GroupKind::Dp => self.dp * self.cp,
            GroupKind::Edp => self.dp / self.ep * self.cp,
        }
    }

    /// Number of groups of `kind`.
    pub fn group_count(&self, kind: GroupKind) -> u32 {
        self.num_ranks() / self.group_size(kind)
    }

    /// Index of the group of `kind` containing `rank` (dense in `0..group_count(kind)`).
    pub fn group_of(&self, kind: GroupKind, rank: u32) -> u32 {
        let c = self.coord(rank);
        match kind {
            GroupKind::Tp => c.cp + self.cp * (c.dp + self.dp * c.pp),
            GroupKind::Cp => c.tp + self.tp * (c.dp + self.dp * c.pp),
            GroupKind::Ep => {
                let outer = c.dp / self.ep;
                c.tp + self.tp * (c.cp + self.cp * (outer + (self.dp / self.ep) * c.pp))
            }
            GroupKind::Dp => c.tp + self.tp * c.pp,
            GroupKind::Edp => c.tp + self.tp * ((c.dp % self.ep) + self.ep * c.pp),
        }
    }

    /// Position of `rank` inside its group of `kind` (its ring position).
    pub fn index_in_group(&self, kind: GroupKind, rank: u32) -> u32 {
        let c = self.coord(rank);
        match kind {
            GroupKind::Tp => c.tp,
            GroupKind::Cp => c.cp,
            GroupKind::Ep => c.dp % self.ep,
            GroupKind::Dp => c.cp + self.cp * c.dp,
            GroupKind::Edp => c.cp + self.cp * (c.dp / self.ep),
        }
    }

    /// The members of group `group` of `kind`, in ring order.
    pub fn members(&self, kind: GroupKind, group: u32) -> impl Iterator<Item = u32> + '_ {
        let size = self.group_size(kind);
        // Recover a representative coordinate from the group index, then vary the group axis.
        let l = *self;
        let base = match kind {
            GroupKind::Tp => {
                let g = group / l.cp;
                Coord {
                    tp: 0,
                    cp: group % l.cp,
                    dp: g % l.dp,
                    pp: g / l.dp,
                }
            }
            GroupKind::Cp => {
                let tp = group % l.tp;
                let g = group / l.tp;
                Coord {
                    tp,
                    cp: 0,
                    dp: g % l.dp,
                    pp: g / l.dp,
                }
            }
            GroupKind::Ep => {
                let tp = group % l.tp;
                let g = group / l.tp;
                let cp = g % l.cp;
                let g = g / l.cp;
                let outer = g % (l.dp / l.ep);
                Coord {
                    tp,
                    cp,
                    dp: outer * l.ep,
                    pp: g / (l.dp / l.ep),
                }
            }
            GroupKind::Dp => Coord {
                tp: group % l.tp,
                cp: 0,
                dp: 0,
                pp: group / l.tp,
            },
            GroupKind::Edp => {
                let tp = group % l.tp;
                let g = group / l.tp;
                Coord {
                    tp,
                    cp: 0,
                    dp: g % l.ep,
                    pp: g / l.ep,
                }
            }
        };
        (0..size).map(move |i| {
            let c = match kind {
                GroupKind::Tp => Coord { tp: i, ..base },
                GroupKind::Cp => Coord { cp: i, ..base },
                GroupKind::Ep => Coord {
                    dp: base.dp + i,
                    ..base
                },
                GroupKind::Dp => Coord {
                    cp: i % l.cp,
                    dp: i / l.cp,
                    ..base
                },
                GroupKind::Edp => Coord {
                    cp: i % l.cp,
                    dp: base.dp + (i / l.cp) * l.ep,
                    ..base
                },
            };
            l.rank(c)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::small_job;

    fn layout(tp: u32, cp: u32, dp: u32, pp: u32, ep: u32) -> Layout {
        Layout {
            tp,
            cp,
            dp,
            pp,
            ep,
            gpus_per_node: 8,
            order: RankOrder::TpCpEpDpPp,
        }
    }

    #[test]
    fn coord_roundtrip_and_groups_partition_ranks() {
        let pp_dp = |l: Layout| Layout {
            order: RankOrder::TpCpEpPpDp,
            ..l
        };
        for l in [
            layout(2, 2, 4, 3, 2),
            layout(8, 1, 4, 2, 1),
            layout(1, 3, 6, 1, 3),
            pp_dp(layout(2, 2, 4, 3, 2)),
            pp_dp(layout(8, 1, 4, 2, 1)),
        ] {
            for r in 0..l.num_ranks() {
                assert_eq!(l.rank(l.coord(r)), r);
            }
            for kind in GROUP_KINDS {
                let mut seen = vec![false; l.num_ranks() as usize];
                for g in 0..l.group_count(kind) {
                    let members: Vec<u32> = l.members(kind, g).collect();
                    assert_eq!(members.len() as u32, l.group_size(kind));
                    for (i, &m) in members.iter().enumerate() {
                        assert!(!seen[m as usize], "{kind:?}: rank {m} in two groups");
                        seen[m as usize] = true;
                        assert_eq!(l.group_of(kind, m), g, "{kind:?} group_of({m})");
                        assert_eq!(l.index_in_group(kind, m) as usize, i);
                    }
                }
                assert!(seen.iter().all(|&s| s));
            }
            for s in 0..l.pp {
                let ranks: Vec<u32> = l.stage_ranks(s).collect();
                assert_eq!(ranks.len() as u32, l.stage_size());
                assert!(ranks.windows(2).all(|w| w[0] < w[1]));
                assert!(ranks.iter().all(|&r| l.coord(r).pp == s));
                assert_eq!(ranks[0], l.first_rank_of_stage(s));
            }
        }
    }

    #[test]
    fn tp_pp_dp_order_keeps_a_pipeline_contiguous() {
        // tp 8, pp 16, dp 4 in the Llama 3 order [TP, CP, PP, DP]: ranks 0..128 are one whole
        // pipeline (data-parallel replica 0), stage s of it at 8s..8s+8.
        let l = Layout {
            order: RankOrder::TpCpEpPpDp,
            ..layout(8, 1, 4, 16, 1)
        };
        assert_eq!(
            l.coord(8 * 5 + 3),
            Coord {
                tp: 3,
                cp: 0,
                dp: 0,
                pp: 5
            }
        );
        assert_eq!(l.coord(128).dp, 1);
        assert_eq!(l.pp_peer(3, 1), Some(11));
        let dp: Vec<u32> = l
            .members(GroupKind::Dp, l.group_of(GroupKind::Dp, 3))
            .collect();
        assert_eq!(dp, vec![3, 131, 259, 387]);
    }

    #[test]
    fn megatron_order_tp_fastest_pp_slowest() {
        let job = small_job(4, 2, 2, 64);
        let l = Layout::new(&job);
        assert_eq!(
            l.coord(1),
            Coord {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 0
            }
        );
        assert_eq!(
            l.coord(2),
            Coord {
                tp: 0,
                cp: 0,
                dp: 1,
                pp: 0
            }
        );
        assert_eq!(
            l.coord(16),
            Coord {
                tp: 0,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
        assert_eq!(l.pp_peer(3, 1), Some(19));
        assert_eq!(l.pp_peer(3, -1), None);
        // TP groups never straddle a node.
        for r in 0..l.num_ranks() {
            let g: Vec<u32> = l
                .members(GroupKind::Tp, l.group_of(GroupKind::Tp, r))
                .collect();
            assert!(g.iter().all(|&m| l.node(m) == l.node(r)));
        }
    }
}
