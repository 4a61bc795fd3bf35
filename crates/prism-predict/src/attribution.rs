//! Critical-path attribution of one simulated iteration: which ops, op classes and ranks the
//! iteration time is made of.
//!
//! # Algorithm
//!
//! The input is a [`SimResult`] with recorded timelines (`SimOptions::record_ranks`). The walk
//! starts at the recorded op that ends last (the iteration end; ties: lowest rank) and goes
//! backwards. At each op `X` of rank `r` with record `[start, end]`, the op that set `X`'s start
//! (its *predecessor*) is the one, among the candidates below, that ended latest:
//!
//! - (a) the previous op on the same stream of `r`;
//! - (b) `X`'s cross-stream dependencies (`Program::deps_of`) on `r`;
//! - (c) for a collective: every group member `m` (`layout.members(kind, layout.group_of(kind,
//!   r))`) runs the same op id (all groups lie inside one pipeline stage, hence one program);
//!   a member *arrives* when its (a)/(b) candidates are done. The collective started when the
//!   last member arrived, so the walk continues at the (a)/(b) predecessor of the member that
//!   arrived last (ties: `r` itself, then the lowest rank);
//! - (d) for a receive: the matching send on the peer stage (the send whose `slot` is this
//!   receive's mailbox slot), whose end is when the message arrived.
//!
//! Ties between (a) and the others prefer (a), which keeps the path on the same stream.
//!
//! Each step charges `end(X) - end(predecessor)` and splits it in two:
//! - the *executing* part `end - start` of `X` (kernel time, a collective's transfer from the
//!   last arrival to its end, a send's transfer) is charged to `X`: its name (kernel name, or
//!   `"tp all_reduce"`, `"dp reduce_scatter"`, `"pp send"`...), its class (the kernel class, or
//!   `"tp comm"`, `"pp comm"`...) and `r`;
//! - the *waiting* part `start - end(predecessor)` is charged to what was waited for: for a
//!   collective, to the collective itself (a straggler that is not recorded); for a receive, to
//!   the receive (a message from a rank that is not recorded); otherwise to the predecessor.
//!   A receive has no executing part: its whole span is waiting for the message.
//!
//! The walk ends at an op without predecessors; the time from 0 to its end is charged the
//! same way (with predecessor end 0).
//!
//! # Invariant
//!
//! The charges telescope: their sum is exactly (in integer picoseconds) the end time of the
//! last recorded op, which is the iteration time whenever the rank that finishes last is
//! recorded (always when every rank is recorded). With every rank recorded, every wait on the
//! path is zero up to the engine's exactness (the engine starts an op the instant its last
//! predecessor ends), so [`Attribution::wait_s`] is 0 and everything on the path is execution.
//! With only some ranks recorded, the path may end earlier than the iteration (the last rank is
//! not recorded: `path_s` < iteration time) and waits for unrecorded stragglers or senders show
//! up as waiting time charged to the collective or receive (reported in `wait_s`).

use std::collections::{BTreeMap, HashMap};

use prism_core::engine::{OpRecord, SimResult};
use prism_core::graph::{OpKind, Program, Stream};
use prism_core::layout::GroupKind;
use prism_core::units::SimTime;

/// Where the critical path of one iteration went. Every list is sorted by time, largest first
/// (ties by key), and holds only non-zero entries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attribution {
    /// Seconds on the critical path by op name (kernel name, or e.g. `"tp all_gather"`).
    pub by_op: Vec<(String, f64)>,
    /// Seconds by class (kernel class name, or `"tp comm"`, `"dp comm"`, `"pp comm"`...).
    pub by_class: Vec<(String, f64)>,
    /// Seconds by the rank the path was on.
    pub by_rank: Vec<(u32, f64)>,
    /// Length of the path: the sum over `by_op` (and over `by_class`, `by_rank`).
    pub path_s: f64,
    /// The part of `path_s` that is waiting rather than execution (0 when every rank is
    /// recorded; see the module docs).
    pub wait_s: f64,
    /// Ops on the path.
    pub ops: usize,
    /// The class of every name in `by_op`.
    pub class_of: BTreeMap<String, String>,
}

fn group_name(kind: GroupKind) -> &'static str {
    match kind {
        GroupKind::Tp => "tp",
        GroupKind::Cp => "cp",
        GroupKind::Ep => "ep",
        GroupKind::Dp => "dp",
        GroupKind::Edp => "edp",
    }
}

/// Name and class of `op` of `prog`, as the attribution reports them.
pub fn op_label(prog: &Program, op: u32) -> (String, String) {
    match prog.kind[op as usize] {
        OpKind::Compute(c) => (c.name.to_string(), c.class.name().to_string()),
        OpKind::Collective { group, op, .. } => (
            format!("{} {}", group_name(group), op.name()),
            format!("{} comm", group_name(group)),
        ),
        OpKind::Send { .. } => ("pp send".into(), "pp comm".into()),
        OpKind::Recv { .. } => ("pp recv".into(), "pp comm".into()),
    }
}

/// Lookup of recorded ops by (rank, op id), built lazily per rank.
struct Index<'a> {
    result: &'a SimResult,
    timeline_of: HashMap<u32, usize>,
    by_op: Vec<Option<Vec<u32>>>,
    /// (program, delta, slot) -> send op.
    sends: HashMap<(usize, i8, u32), u32>,
}

impl<'a> Index<'a> {
    fn new(result: &'a SimResult) -> Self {
        let timeline_of = result
            .timelines
            .iter()
            .enumerate()
            .map(|(i, t)| (t.rank, i))
            .collect();
        let mut sends = HashMap::new();
        for (pi, p) in result.graph.programs.iter().enumerate() {
            for &op in &p.stream_ops[Stream::PpSend as usize] {
                if let OpKind::Send { delta, slot, .. } = p.kind[op as usize] {
                    sends.insert((pi, delta, slot), op);
                }
            }
        }
        Index {
            result,
            timeline_of,
            by_op: vec![None; result.timelines.len()],
            sends,
        }
    }

    fn recorded(&self, rank: u32) -> bool {
        self.timeline_of.contains_key(&rank)
    }

    fn rec(&mut self, rank: u32, op: u32) -> Option<OpRecord> {
        let &t = self.timeline_of.get(&rank)?;
        let tl = &self.result.timelines[t];
        let map = self.by_op[t].get_or_insert_with(|| {
            let n = self.result.graph.program_of(rank).len();
            let mut m = vec![u32::MAX; n];
            for (i, r) in tl.ops.iter().enumerate() {
                m[r.op as usize] = i as u32;
            }
            m
        });
        match map.get(op as usize) {
            Some(&i) if i != u32::MAX => Some(tl.ops[i as usize]),
            _ => None,
        }
    }

    /// The latest-ending of (a) the previous op on the same stream and (b) the cross-stream
    /// dependencies of `op` on `rank` (ties prefer (a)): `(op, end)`.
    fn local_pred(&mut self, rank: u32, op: u32) -> Option<(u32, SimTime)> {
        let g = &self.result.graph;
        let p = g.program_of(rank);
        let s = p.stream[op as usize] as usize;
        let pos = p.pos[op as usize] as usize;
        let mut best: Option<(u32, SimTime)> = None;
        if pos > 0 {
            let prev = p.stream_ops[s][pos - 1];
            if let Some(r) = self.rec(rank, prev) {
                best = Some((prev, r.end));
            }
        }
        for &d in p.deps_of(op) {
            if let Some(r) = self.rec(rank, d)
                && best.is_none_or(|(_, e)| r.end > e)
            {
                best = Some((d, r.end));
            }
        }
        best
    }

    /// The send on a neighbouring stage that fills mailbox `slot` of `rank`: `(peer, op)`.
    fn matching_send(&self, rank: u32, slot: u32) -> Option<(u32, u32)> {
        let l = &self.result.graph.layout;
        if l.pp < 2 {
            return None;
        }
        let c = l.coord(rank);
        for delta in [1i8, -1] {
            // The sender is `delta` stages before `rank` (wrapping, as the engine does).
            let pp = ((c.pp + l.pp) as i64 - delta as i64) as u32 % l.pp;
            let peer = l.rank(prism_core::layout::Coord { pp, ..c });
            if let Some(&op) = self.sends.get(&(pp as usize, delta, slot)) {
                return Some((peer, op));
            }
        }
        None
    }
}

#[derive(Default)]
struct Acc {
    by_op: HashMap<String, SimTime>,
    by_class: HashMap<String, SimTime>,
    by_rank: HashMap<u32, SimTime>,
    class_of: BTreeMap<String, String>,
}

impl Acc {
    fn charge(&mut self, prog: &Program, rank: u32, op: u32, t: SimTime) {
        if t == 0 {
            return;
        }
        let (name, class) = op_label(prog, op);
        *self.by_op.entry(name.clone()).or_default() += t;
        *self.by_class.entry(class.clone()).or_default() += t;
        self.class_of.entry(name.clone()).or_insert(class);
        *self.by_rank.entry(rank).or_default() += t;
    }
}

fn sorted<K: Ord + Clone>(m: HashMap<K, SimTime>) -> Vec<(K, f64)> {
    let mut v: Vec<(K, SimTime)> = m.into_iter().filter(|(_, t)| *t > 0).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.into_iter().map(|(k, t)| (k, t as f64 * 1e-12)).collect()
}

/// Walks the critical path of `result`'s recorded timelines backwards from the op that ends
/// last and attributes its length to ops, classes and ranks (see the module docs). Returns an
/// empty attribution when nothing was recorded.
pub fn critical_path(result: &SimResult) -> Attribution {
    let mut idx = Index::new(result);
    let g = &result.graph;
    let layout = g.layout;
    // The op that ends last (ties: lowest rank, then first recorded).
    let mut cur: Option<(u32, u32)> = None;
    let mut last_end: SimTime = 0;
    for tl in &result.timelines {
        for r in &tl.ops {
            let better = match cur {
                None => true,
                Some((cr, _)) => r.end > last_end || (r.end == last_end && tl.rank < cr),
            };
            if better {
                cur = Some((tl.rank, r.op));
                last_end = r.end;
            }
        }
    }
    let mut acc = Acc::default();
    let mut wait: SimTime = 0;
    let mut total: SimTime = 0;
    let mut steps = 0usize;
    let limit: usize = result.timelines.iter().map(|t| t.ops.len()).sum::<usize>() + 1;
    while let Some((rank, op)) = cur {
        steps += 1;
        assert!(steps <= limit, "critical path walk did not terminate");
        let prog = g.program_of(rank);
        let rec = idx.rec(rank, op).expect("op on the path is recorded");
        let (next, pred_end) = match prog.kind[op as usize] {
            OpKind::Collective { group, .. } => {
                // The member that arrived last set the start.
                let mut best: Option<(SimTime, u32, Option<u32>)> = None;
                let members: Vec<u32> = layout
                    .members(group, layout.group_of(group, rank))
                    .filter(|&m| idx.recorded(m))
                    .collect();
                for m in members {
                    let p = idx.local_pred(m, op);
                    let arrival = p.map_or(0, |(_, e)| e);
                    let better = match best {
                        None => true,
                        Some((a, bm, _)) => {
                            arrival > a || (arrival == a && bm != rank && (m == rank || m < bm))
                        }
                    };
                    if better {
                        best = Some((arrival, m, p.map(|(o, _)| o)));
                    }
                }
                let (arrival, m, p) = best.unwrap_or((0, rank, None));
                let arrival = arrival.min(rec.start);
                acc.charge(prog, rank, op, rec.end - rec.start);
                // Waiting for unrecorded stragglers: charged to the collective.
                acc.charge(prog, rank, op, rec.start - arrival);
                wait += rec.start - arrival;
                (p.map(|o| (m, o)), arrival)
            }
            OpKind::Recv { slot } => {
                let mut best = idx.local_pred(rank, op).map(|(o, e)| ((rank, o), e));
                if let Some((peer, sop)) = idx.matching_send(rank, slot)
                    && let Some(sr) = idx.rec(peer, sop)
                    && sr.end <= rec.end
                    && best.is_none_or(|(_, e)| sr.end > e)
                {
                    best = Some(((peer, sop), sr.end));
                }
                let pred_end = best.map_or(0, |(_, e)| e).min(rec.end);
                // Waiting for a message from an unrecorded rank: charged to the receive.
                acc.charge(prog, rank, op, rec.end - pred_end);
                wait += rec.end - pred_end;
                (best.map(|(k, _)| k), pred_end)
            }
            OpKind::Compute(_) | OpKind::Send { .. } => {
                let p = idx.local_pred(rank, op);
                let pred_end = p.map_or(0, |(_, e)| e).min(rec.start);
                acc.charge(prog, rank, op, rec.end - rec.start);
                let gap = rec.start - pred_end;
                match p {
                    Some((o, _)) => acc.charge(prog, rank, o, gap),
                    None => acc.charge(prog, rank, op, gap),
                }
                wait += gap;
                (p.map(|(o, _)| (rank, o)), pred_end)
            }
        };
        total += rec.end - pred_end;
        cur = next;
    }
    Attribution {
        by_op: sorted(acc.by_op),
        by_class: sorted(acc.by_class),
        by_rank: sorted(acc.by_rank),
        path_s: total as f64 * 1e-12,
        wait_s: wait as f64 * 1e-12,
        ops: steps,
        class_of: acc.class_of,
    }
}
