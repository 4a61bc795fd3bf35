use super::*;

/// The boundary values of one replica (what the tail reads) as replica pruning sees them.
/// A value is *shared* when no path to it crosses a segment (a chain of collectives only: the
/// same on every replica); the others are *varying*, each with `lip`, its Lipschitz constant
/// in the sample's standard normal draws with every per-GPU factor 1 (ps): the square root of
/// the largest sum of segment variances along a path to it.
#[derive(Clone, Debug)]
pub(super) struct PruneWeights {
    /// Varying values: (stage, index `slot * lanes + lane` within a replica's part of the
    /// stage's tail store).
    pub(super) varying: Vec<(u32, u32)>,
    pub(super) lip: Vec<f64>,
    /// Shared values, the same way.
    pub(super) shared: Vec<(u32, u32)>,
}

/// Twice the concentration margin of replica pruning, in Lipschitz constants: each bound
/// (the pilot's mean, the sample's deviation from it) holds but for probability
/// `exp(-9^2 / 2) = 2.6e-18`.
pub(super) const PRUNE_T2: f64 = 18.0;

/// Every replica's boundary values in one fast sample ([`StepModel::sample_pilot`]), or those
/// of the replicas a pruned sample evaluated ([`StepModel::sample_pruned_pilot`]).
#[derive(Clone, Debug)]
pub struct Pilot {
    pub(super) comm_factor: f64,
    pub(super) store: Vec<Vec<f64>>,
    /// The replicas whose values `store` holds (empty: every replica).
    pub(super) evaluated: Vec<bool>,
}

impl Pilot {
    fn has(&self, r: usize) -> bool {
        self.evaluated.is_empty() || self.evaluated[r]
    }
}

/// Upper bounds on every replica's boundary values for samples of one cluster (fixed per-GPU
/// speeds) with a communication regime at most that of the cluster's higher pilot.
///
/// A boundary value `F` is a longest path through segments of normal duration: a convex,
/// non-decreasing function of the communication factor `c` and, in the sample's standard
/// normal draws `z`, Lipschitz with constant `L` (a path's gradient is its segments' standard
/// deviations; `L` is the largest root sum of squares, scaled by the replica's slowest GPU).
/// Gaussian concentration (Tsirelson-Ibragimov-Sudakov) gives `F <= E F + 9 L` and, for each
/// independent pilot, `E F <= F_pilot + 9 L`, but for probability `2.6e-18` each; `E F` is
/// convex in `c`, so at `c` between the pilots' `c0 <= c1` it is below the chord. The bound
/// is the chord of the pilots plus `18 L` (and a rounding allowance of 1e-9 relative). Below
/// `c0`, `E F` is at most its value at `c0` (it is non-decreasing), so the bound at `c0` holds.
/// A replica that the lower pilot did not evaluate (a pilot that was itself a pruned sample)
/// is bounded by the higher pilot alone, flat: `E F(c) <= E F(c1)` for every `c <= c1`.
#[derive(Clone, Debug)]
pub struct Pruner {
    pub(super) c0: f64,
    pub(super) c1: f64,
    /// Per replica and varying value (replica-major): the bound at `c0` (margins included) and
    /// its increase to `c1`.
    pub(super) base: Vec<f64>,
    pub(super) slope: Vec<f64>,
}

impl Pruner {
    /// The pruner of a cluster from one or two of its pilots (in any order), made with the
    /// cluster's `rank_factor` (empty: every factor 1). `None` when the statistics do not allow
    /// pruning.
    pub fn new(
        model: &StepModel,
        fast: &FastStats,
        rank_factor: &[f64],
        a: &Pilot,
        b: Option<&Pilot>,
    ) -> Option<Pruner> {
        let w = fast.prune.as_ref()?;
        let b = b.unwrap_or(a);
        let (lo, hi) = if a.comm_factor <= b.comm_factor {
            (a, b)
        } else {
            (b, a)
        };
        // The higher pilot bounds every replica; it must hold them all.
        if !hi.evaluated.is_empty() {
            return None;
        }
        let layout = &model.layout;
        let l = lanes(layout);
        let n = w.varying.len();
        let dp = layout.dp as usize;
        let mut base = Vec::with_capacity(dp * n);
        let mut slope = Vec::with_capacity(dp * n);
        for r in 0..dp {
            // The replica's slowest GPU scales every standard deviation at most by its factor.
            let fmax = (0..layout.pp)
                .flat_map(|s| (0..l as u32).map(move |lane| (s, lane)))
                .map(|(s, lane)| {
                    if rank_factor.is_empty() {
                        1.0
                    } else {
                        lane_factor(layout, rank_factor, r as u32, s, lane)
                    }
                })
                .fold(0.0, f64::max);
            for (&(s, j), &lip) in w.varying.iter().zip(&w.lip) {
                let stride = model.stages[s as usize].slots as usize * l;
                let i = r * stride + j as usize;
                let p1 = hi.store[s as usize][i];
                let p0 = if lo.has(r) {
                    lo.store[s as usize][i]
                } else {
                    p1
                };
                // Concentration margin, and 1e-9 relative (plus 1 ps) for rounding.
                let margin = PRUNE_T2 * fmax * lip + 1e-9 * p0.abs().max(p1.abs()) + 1.0;
                base.push(p0 + margin);
                slope.push(p1 - p0);
            }
        }
        Some(Pruner {
            c0: lo.comm_factor,
            c1: hi.comm_factor,
            base,
            slope,
        })
    }
}

impl StepModel {
    /// The weights replica pruning needs, from two longest-path evaluations of `tape` with
    /// every communication duration 0: segments weighted by their variance (the Lipschitz
    /// constants), then by their mean (which values no segment reaches). `None` when a value
    /// could escape the bounds: a jitter that is not normal (no Gaussian concentration), or an
    /// op outside the tail that nothing waits for (a sink, read without the tail store). Made
    /// only with per-GPU speeds: without them the replicas are alike and none can be skipped.
    pub(super) fn prune_weights(&self, tape: &Tape, stats: &SegStats) -> Option<PruneWeights> {
        if stats.kernel.iter().any(Option::is_some) || !tape.sinks.is_empty() {
            return None;
        }
        let l = lanes(&self.layout);
        let weigh = |w: &dyn Fn(f64, f64) -> f64| -> Vec<Vec<f64>> {
            let mut t = tape.clone();
            for ins in &mut t.ins {
                ins.code = match ins.code {
                    Code::Seg {
                        m, sd, collapsible, ..
                    } => Code::Seg {
                        m: w(m, sd),
                        sd: 0.0,
                        collapsible,
                        g0: 0,
                        g1: 0,
                        pk: false,
                    },
                    Code::Tp { .. } => Code::Tp { d: 0 },
                    Code::Cp { .. } => Code::Cp { d: 0 },
                    Code::Add { .. } => Code::Add { d: 0 },
                    Code::Run { .. } | Code::Pool { .. } => ins.code,
                };
            }
            for step in &mut t.steps {
                step.kind = match step.kind {
                    StepKind::Comm { .. } => StepKind::Comm { d: 0 },
                    StepKind::Seg { m, sd } => StepKind::Seg {
                        m: w(m, sd),
                        sd: 0.0,
                    },
                    StepKind::Pool { .. } => unreachable!("pruning never sees a pooled program"),
                };
            }
            // Replica 0's boundary values: the first `slots x lanes` of each stage's store.
            let mut work = Work::new(self, &t);
            let mut draw = Draw::Nominal;
            let scale = Scale::new(1.0, &draw);
            let mut store = self.new_store();
            let mut last = Latest::default();
            self.replica_to_store(&t, 0, &mut draw, scale, &mut work, &mut store, &mut last);
            store
        };
        let var = weigh(&|_, sd| sd * sd);
        let mean = weigh(&|m, sd| m + sd);
        let mut w = PruneWeights {
            varying: Vec::new(),
            lip: Vec::new(),
            shared: Vec::new(),
        };
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.boundary_ops {
                for lane in 0..l {
                    let j = st.slot[op as usize] as usize * l + lane;
                    let at = (s as u32, j as u32);
                    if mean[s][j] == 0.0 {
                        w.shared.push(at);
                    } else {
                        w.varying.push(at);
                        w.lip.push(var[s][j].sqrt());
                    }
                }
            }
        }
        Some(w)
    }

    /// A fast sample (exactly [`StepModel::sample_fast`]) that also returns every replica's
    /// boundary values: a pilot for [`Pruner::new`].
    pub fn sample_pilot(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<(f64, Pilot), SimError> {
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let mut trace = Trace::default();
        let step = self.evaluate_traced(&fast.tape, &mut draw, comm_factor, Some(&mut trace));
        Ok((
            step,
            Pilot {
                comm_factor,
                store: trace.store,
                evaluated: Vec::new(),
            },
        ))
    }

    /// [`StepModel::sample_pruned`] that also returns the boundary values of the replicas it
    /// evaluated: a lower pilot for [`Pruner::new`] at the cost of a pruned sample, the
    /// replicas it skipped then bounded by the higher pilot alone.
    pub fn sample_pruned_pilot(
        &self,
        fast: &FastStats,
        pruner: &Pruner,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<(f64, Pilot), SimError> {
        let (t, _, kept) = self.pruned(fast, pruner, rank_factor, comm_factor, seed, true)?;
        let (store, evaluated) = kept.expect("kept on request");
        Ok((
            t,
            Pilot {
                comm_factor,
                store,
                evaluated,
            },
        ))
    }

    /// [`StepModel::sample_fast`] evaluating only the replicas that can matter, with the same
    /// draws and, but for an event of probability below 1e-17 per replica and boundary value,
    /// the same result to the bit. Returns the step time and how many replicas were evaluated.
    ///
    /// The pruner's pilots bound every replica's boundary values from above (see [`Pruner`]).
    /// The replicas with the highest bound of some value are evaluated first, then every
    /// replica whose bound exceeds the largest evaluated value at some boundary value, until
    /// none does. The skipped replicas' boundary values are then certified irrelevant: the
    /// tail (monotone in them, with its own draws) is evaluated twice, with each skipped value
    /// at its upper bound and at 0; equal ends mean the true values, in between, give that end
    /// too. If the ends differ, the skipped replicas are evaluated after all. Without per-GPU
    /// speeds, or with a regime above the higher pilot's, every replica is evaluated.
    pub fn sample_pruned(
        &self,
        fast: &FastStats,
        pruner: &Pruner,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<(f64, usize), SimError> {
        let (t, k, _) = self.pruned(fast, pruner, rank_factor, comm_factor, seed, false)?;
        Ok((t, k))
    }

    /// [`StepModel::sample_pruned`], returning with `keep` the store and the evaluated
    /// replicas (an empty list: every replica, when it could not prune and evaluated them all
    /// as a full pilot does); `None` without `keep`.
    #[allow(clippy::type_complexity)]
    fn pruned(
        &self,
        fast: &FastStats,
        pruner: &Pruner,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
        keep: bool,
    ) -> Result<(f64, usize, Option<(Vec<Vec<f64>>, Vec<bool>)>), SimError> {
        let dp = self.layout.dp as usize;
        let w = match &fast.prune {
            Some(w)
                if comm_factor <= pruner.c1
                    && pruner.base.len() == dp * w.varying.len()
                    && !rank_factor.is_empty() =>
            {
                w
            }
            _ if keep => {
                let (t, p) = self.sample_pilot(fast, rank_factor, comm_factor, seed)?;
                return Ok((t, dp, Some((p.store, p.evaluated))));
            }
            _ => {
                let t = self.sample_fast(fast, rank_factor, comm_factor, seed)?;
                return Ok((t, dp, None));
            }
        };
        let l = lanes(&self.layout);
        let n = w.varying.len();
        let tape = &fast.tape;
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let scale = Scale::new(comm_factor, &draw);
        let lam = if pruner.c1 > pruner.c0 {
            ((comm_factor - pruner.c0) / (pruner.c1 - pruner.c0)).max(0.0)
        } else {
            0.0
        };
        let stride: Vec<usize> = self.stages.iter().map(|st| st.slots as usize * l).collect();
        // Upper bounds of replica r's varying values.
        let hi = |r: usize| {
            let (b, sl) = (
                &pruner.base[r * n..(r + 1) * n],
                &pruner.slope[r * n..(r + 1) * n],
            );
            b.iter().zip(sl).map(move |(&b, &s)| b + lam * s)
        };
        let at = |r: usize, (s, j): (u32, u32)| (s as usize, r * stride[s as usize] + j as usize);
        let mut work = Work::reuse(self, tape);
        let mut store = self.new_store();
        let mut last = Latest::default();
        let mut done = vec![false; dp];
        // First the replicas with the highest bound of some value.
        let mut best = vec![(f64::NEG_INFINITY, 0); n];
        for r in 0..dp {
            for (b, h) in best.iter_mut().zip(hi(r)) {
                if h > b.0 {
                    *b = (h, r);
                }
            }
        }
        let mut want = vec![false; dp];
        for &(_, r) in &best {
            want[r] = true;
        }
        // Then every replica whose bound exceeds the largest evaluated value somewhere.
        let mut top = vec![f64::NEG_INFINITY; n];
        loop {
            let mut any = false;
            for r in 0..dp {
                if want[r] && !done[r] {
                    self.replica_to_store(
                        tape, r, &mut draw, scale, &mut work, &mut store, &mut last,
                    );
                    done[r] = true;
                    any = true;
                    for (t, &v) in top.iter_mut().zip(&w.varying) {
                        let (s, i) = at(r, v);
                        *t = mx(*t, store[s][i]);
                    }
                }
            }
            if !any {
                break;
            }
            for r in 0..dp {
                want[r] = !done[r] && hi(r).zip(&top).any(|(h, &t)| h > t);
            }
        }
        let evaluated = done.iter().filter(|&&d| d).count();
        if evaluated < dp {
            // The skipped replicas' values: shared ones as on an evaluated replica, varying ones
            // at their upper bound, then at 0; equal tails certify the end.
            let r0 = done.iter().position(|&d| d).expect("one replica evaluated");
            for r in (0..dp).filter(|&r| !done[r]) {
                for &v in &w.shared {
                    let ((s, i), (_, i0)) = (at(r, v), at(r0, v));
                    store[s][i] = store[s][i0];
                }
                for (h, &v) in hi(r).zip(&w.varying) {
                    let (s, i) = at(r, v);
                    store[s][i] = h;
                }
            }
            let (mut a, mut b) = (last, last);
            self.tail(&mut store, &mut draw, scale, &mut a);
            for r in (0..dp).filter(|&r| !done[r]) {
                for &v in &w.varying {
                    let (s, i) = at(r, v);
                    store[s][i] = 0.0;
                }
            }
            self.tail(&mut store, &mut draw, scale, &mut b);
            if a.t == b.t {
                return Ok((a.t * 1e-12, evaluated, keep.then_some((store, done))));
            }
            for (r, d) in done.iter_mut().enumerate().filter(|(_, d)| !**d) {
                self.replica_to_store(tape, r, &mut draw, scale, &mut work, &mut store, &mut last);
                *d = true;
            }
        }
        self.tail(&mut store, &mut draw, scale, &mut last);
        Ok((last.t * 1e-12, dp, keep.then_some((store, done))))
    }
}
