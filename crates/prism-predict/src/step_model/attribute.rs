use super::*;

/// What [`StepModel::evaluate_traced`] keeps for the critical-path walk.
#[derive(Debug, Default)]
pub(super) struct Trace {
    pub(super) store: Vec<Vec<f64>>,
    pub(super) last: Loc,
    pub(super) scale: Scale,
}

/// Who a part of the critical path is charged to.
#[derive(Clone, Copy, Debug)]
pub(super) enum Who {
    /// One GPU's own work.
    Rank(u32),
    /// A tensor-parallel group (by its first rank): its collectives, and segments drawn as the
    /// maximum over its lanes.
    Group(u32),
    /// A data-parallel collective (every replica).
    Nobody,
}

/// Critical-path charges in picoseconds (ordered maps: the output does not depend on hashing).
#[derive(Default)]
pub(super) struct Charges {
    pub(super) by_op: BTreeMap<String, f64>,
    pub(super) by_class: BTreeMap<String, f64>,
    pub(super) class_of: BTreeMap<String, String>,
    pub(super) by_rank: BTreeMap<u32, f64>,
    pub(super) by_group: BTreeMap<u32, f64>,
    pub(super) path: f64,
}

impl Charges {
    pub(super) fn finish(self, step_s: f64) -> StepAttribution {
        fn sorted<K: Ord + Clone>(m: BTreeMap<K, f64>) -> Vec<(K, f64)> {
            let mut v: Vec<(K, f64)> = m
                .into_iter()
                .filter(|(_, t)| *t > 0.0)
                .map(|(k, t)| (k, t * 1e-12))
                .collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            v
        }
        StepAttribution {
            step_s,
            by_op: sorted(self.by_op),
            by_class: sorted(self.by_class),
            class_of: self.class_of,
            by_rank: sorted(self.by_rank),
            by_tp_group: sorted(self.by_group),
            path_s: self.path * 1e-12,
        }
    }
}

/// Where the critical path of one step-model sample went ([`StepModel::attribute_fast`]).
/// Lists are sorted by time, largest first, and hold only non-zero entries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepAttribution {
    /// The sample's step time, seconds.
    pub step_s: f64,
    /// Seconds by op name (kernel name, or e.g. `"tp all_gather"`, `"dp reduce_scatter"`).
    pub by_op: Vec<(String, f64)>,
    /// Seconds by class (kernel class, or `"tp comm"`, `"dp comm"`, `"pp comm"`).
    pub by_class: Vec<(String, f64)>,
    /// The class of every name in `by_op`.
    pub class_of: BTreeMap<String, String>,
    /// Seconds of one GPU's own work (a lane drawn on its own), by rank.
    pub by_rank: Vec<(u32, f64)>,
    /// Seconds charged to a whole tensor-parallel group, by its first rank: its collectives,
    /// and segments drawn at once as the slowest of its lanes (which lane is not drawn).
    pub by_tp_group: Vec<(u32, f64)>,
    /// Length of the path: equals `step_s` (the charges telescope).
    pub path_s: f64,
}

impl StepModel {
    /// The critical path of the fast sample `(rank_factor, comm_factor, seed)` (the same draws
    /// as [`StepModel::sample_fast`]): walked backwards from the op that ends last, through the
    /// tail (the latest replica at each data-parallel collective) into that replica's program,
    /// re-evaluated with its own random stream. At each op the input that ended last set its
    /// start (ties: the stream predecessor); the op's end minus that start is charged to it, so
    /// the charges add up to the step time. A segment's charge is split over its kernels by
    /// their mean times.
    pub fn attribute_fast(
        &self,
        fast: &FastStats,
        rank_factor: &[f64],
        comm_factor: f64,
        seed: u64,
    ) -> Result<StepAttribution, SimError> {
        let tape = &fast.tape;
        let mut draw = self.fast_draw(fast, rank_factor, comm_factor, seed)?;
        let mut trace = Trace::default();
        let step_s = self.evaluate_traced(tape, &mut draw, comm_factor, Some(&mut trace));
        let l = lanes(&self.layout);
        let (tp, cp) = (self.layout.tp as usize, self.layout.cp as usize);
        let dp = self.layout.dp as usize;
        let rank =
            |r: usize, s: u32, lane: usize| lane_rank(&self.layout, r as u32, s, lane as u32);
        let mut acc = Charges::default();
        // The tail, back to the boundary op of the replica that was latest.
        let mut entry: Option<(usize, Val, usize)> = None;
        let mut loc = trace.last;
        loop {
            match loc {
                Loc::Start => break,
                Loc::Replica { r, val, lane } => {
                    entry = Some((r, val, lane));
                    break;
                }
                Loc::Tail { s, op, r, lane } => {
                    let st = &self.stages[s];
                    let store = &trace.store[s];
                    let end = store[st.tail_at(r, op, lane, l)];
                    let ready = |r: usize, lane: usize| st.tail_ready(store, r, op, lane, l);
                    let kind = st.kind[op as usize];
                    let ((start, pred), r, lane) = match kind {
                        MKind::Dp { .. } => latest(
                            (0..dp)
                                .flat_map(|r| group(tp, cp, false, lane).map(move |k| (r, k)))
                                .map(|(r, k)| (ready(r, k), r, k)),
                        )
                        .expect("replicas"),
                        MKind::Tp { .. } | MKind::Cp { .. } => {
                            let tp_group = matches!(kind, MKind::Tp { .. });
                            latest(group(tp, cp, tp_group, lane).map(|k| (ready(r, k), r, k)))
                                .expect("lanes")
                        }
                        _ => (ready(r, lane), r, lane),
                    };
                    let who = match kind {
                        MKind::Dp { .. } | MKind::Cp { .. } => Who::Nobody,
                        MKind::Tp { .. } => Who::Group(rank(r, s as u32, lane / tp * tp)),
                        _ => Who::Rank(rank(r, s as u32, lane)),
                    };
                    self.charge(&mut acc, &fast.stats, s, op, who, end - start);
                    if pred == u32::MAX {
                        break;
                    }
                    if st.tail[pred as usize] {
                        loc = Loc::Tail {
                            s,
                            op: pred,
                            r,
                            lane,
                        };
                    } else {
                        let val = tape.val[s][pred as usize].expect("boundary op evaluated");
                        entry = Some((r, val, lane));
                        break;
                    }
                }
            }
        }
        // The replica's program, re-evaluated with the same draws.
        if let Some((r, mut val, mut lane)) = entry {
            let mut work = Work::new(self, tape);
            self.replica(tape, r, &mut draw, trace.scale, &mut work);
            let vals = &work.vals;
            let at = |v: Val, lane: usize| vals[v.at as usize + if v.lanes { lane } else { 0 }];
            loop {
                let ins = &tape.orig[tape.producer[val.at as usize] as usize];
                let end = at(val, lane);
                let mut best: Option<(f64, Val, usize)> = None;
                let coll = match ins.code {
                    Code::Tp { .. } => Some(true),
                    Code::Cp { .. } => Some(false),
                    _ => None,
                };
                for &v in &tape.inputs[ins.i0 as usize..ins.i1 as usize] {
                    let latest_of = |it: &mut dyn Iterator<Item = usize>| {
                        it.map(|k| (at(v, k), k))
                            .fold((f64::NEG_INFINITY, 0), |b, c| if c.0 > b.0 { c } else { b })
                    };
                    let (e, ln) = match coll {
                        // One start per group: after the group's latest lane.
                        Some(tp_group) if v.lanes && ins.out.lanes => {
                            latest_of(&mut group(tp, cp, tp_group, lane))
                        }
                        // One end for every lane: it started after the latest lane.
                        _ if v.lanes && !ins.out.lanes => latest_of(&mut (0..l)),
                        _ => (at(v, lane), lane),
                    };
                    if best.is_none_or(|b| e > b.0) {
                        best = Some((e, v, ln));
                    }
                }
                let start = best.map_or(0.0, |b| b.0);
                let who = match coll {
                    Some(true) => Who::Group(rank(r, ins.stage, lane / tp * tp)),
                    Some(false) => Who::Nobody,
                    None if ins.out.lanes => Who::Rank(rank(r, ins.stage, lane)),
                    None => Who::Group(rank(r, ins.stage, 0)),
                };
                self.charge(
                    &mut acc,
                    &fast.stats,
                    ins.stage as usize,
                    ins.op,
                    who,
                    end - start,
                );
                match best {
                    Some((_, v, ln)) => {
                        val = v;
                        lane = ln;
                    }
                    None => break,
                }
            }
        }
        Ok(acc.finish(step_s))
    }

    /// Charges `t` ps of the critical path to macro-op `op` of stage `s` (a segment's kernels
    /// by their mean times) and to `who`.
    pub(super) fn charge(
        &self,
        acc: &mut Charges,
        stats: &SegStats,
        s: usize,
        op: u32,
        who: Who,
        t: f64,
    ) {
        if t <= 0.0 {
            return;
        }
        let st = &self.stages[s];
        let prog = &self.graph.programs[s];
        match who {
            Who::Rank(r) => *acc.by_rank.entry(r).or_default() += t,
            Who::Group(r) => *acc.by_group.entry(r).or_default() += t,
            Who::Nobody => {}
        }
        acc.path += t;
        let mut add = |orig: u32, x: f64| {
            let (name, class) = crate::attribution::op_label(prog, orig);
            *acc.by_op.entry(name.clone()).or_default() += x;
            *acc.by_class.entry(class.clone()).or_default() += x;
            acc.class_of.entry(name).or_insert(class);
        };
        if let MKind::Seg { k0, k1, .. } = st.kind[op as usize] {
            let w = |k: u32| {
                st.kd[k as usize] as f64 * stats.group[stats.kgroup[s][k as usize] as usize].0
            };
            let total: f64 = (k0..k1).map(w).sum();
            for k in k0..k1 {
                let share = if total > 0.0 {
                    w(k) / total
                } else {
                    1.0 / (k1 - k0) as f64
                };
                add(st.kop[k as usize], t * share);
            }
        } else {
            add(st.orig_op[op as usize], t);
        }
    }
}
