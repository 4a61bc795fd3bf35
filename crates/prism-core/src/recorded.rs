//! The engine's "graph from recorded traces" entry point: an [`ExecutionGraph`] built from what
//! ranks of a tensor/pipeline/data-parallel job did, instead of from a [`Job`](crate::job::Job).
//!
//! A recorded rank is a sequence of communication calls in program order, each preceded by the
//! compute the rank did since the previous call returned, and followed by the compute after the
//! last call ([`RecordedRank`]). The traces name explicit groups of global ranks; building the
//! graph maps each group onto the [`Layout`]'s group kinds (TP, DP, and CP/EP where those are
//! larger than one) and each send or receive onto a neighbouring stage (+1 / -1, wrapping as
//! interleaved pipelines do), and refuses anything else with an error naming the rank, the op
//! index and the group.
//!
//! Program of a rank with calls `0..n` (the op ids are fixed, so a real rank's call `k` is op
//! `2k + 1` of its stage's program):
//! - op `2k`: [`Work::Measured`] segment, the compute before call `k` (named `segment`);
//! - op `2k + 1`: call `k` (a collective on its group kind's stream, a send, a receive);
//! - op `2n`: the compute after the last call (named `tail`).
//!
//! Each op depends on the one before it: a rank blocks in each call, as a recorded rank did.
//!
//! Ranks of one pipeline stage are one symmetry class and share one program: one trace per
//! stage suffices (its *representative*), and every other rank of the stage is the same program
//! on its own groups (what slicing calls instantiating the trace). When several traces of a
//! stage are given, each must map to the same program up to compute durations (collectives,
//! groups, sizes, peers, order); the durations of the lowest-numbered rank are kept.
//!
//! Matching: a collective is joined by order within its group (the `k`-th call on a TP group at
//! every member is one collective), as in the job graphs. The `k`-th send from a rank to a
//! neighbour is the `k`-th receive of that neighbour from the rank, and both must name the same
//! size.
//!
//! Pricing of the calls the cost model has no operation for: a broadcast of `S` bytes is priced
//! as an all-gather of `S` bytes (a ring moves `(n-1)/n S` through every rank either way); a
//! barrier is an all-reduce of 0 bytes (its latency only).

use std::collections::BTreeMap;

use crate::cost::comm::Collective;
use crate::graph::{ExecutionGraph, NONE, OpKind, OpTag, Phase, Program, Stream};
use crate::layout::{GroupKind, Layout};
use crate::ops::{ComputeOp, OpClass, Work};
use crate::units::SimTime;

/// What a recorded call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    /// Reduce everywhere; `bytes` is the buffer.
    AllReduce,
    /// Reduce and shard; `bytes` is the rank's full (unsharded) input.
    ReduceScatter,
    /// Gather shards; `bytes` is the rank's own shard (the output is `group size x bytes`).
    AllGather,
    /// Personalised exchange; `bytes` is what the rank sends in total.
    AllToAll,
    /// From the root (`peer`) to every member; `bytes` is the buffer.
    Broadcast,
    /// Synchronisation only.
    Barrier,
    /// Point-to-point send of `bytes` to `peer`.
    Send,
    /// Point-to-point receive of `bytes` from `peer`.
    Recv,
}

impl CallKind {
    /// Lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::AllReduce => "all-reduce",
            CallKind::ReduceScatter => "reduce-scatter",
            CallKind::AllGather => "all-gather",
            CallKind::AllToAll => "all-to-all",
            CallKind::Broadcast => "broadcast",
            CallKind::Barrier => "barrier",
            CallKind::Send => "send",
            CallKind::Recv => "recv",
        }
    }

    /// True for send and receive.
    pub fn is_p2p(self) -> bool {
        matches!(self, CallKind::Send | CallKind::Recv)
    }
}

/// One recorded communication call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedCall {
    /// Operation.
    pub kind: CallKind,
    /// Global ranks of the group in group-rank order (empty for send and receive).
    pub group: Vec<u32>,
    /// Peer of a send or receive, root of a broadcast (ignored otherwise).
    pub peer: u32,
    /// Bytes, as [`CallKind`] defines them.
    pub bytes: u64,
    /// Compute since the previous call returned (or since the start), ps.
    pub compute_ps: SimTime,
}

/// The recorded calls of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedRank {
    /// Global rank.
    pub rank: u32,
    /// Calls in program order.
    pub calls: Vec<RecordedCall>,
    /// Compute after the last call, ps.
    pub tail_ps: SimTime,
}

/// Why recorded traces do not make a graph. Every message names the rank and, where one is at
/// fault, the op index (the call's position in the rank's trace) and its group.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// A call's group or peer is not one of the layout's.
    #[error("rank {rank}, op {op}: {detail}")]
    Unmapped {
        /// Rank.
        rank: u32,
        /// Op index.
        op: usize,
        /// What is wrong, naming the group.
        detail: String,
    },
    /// Two traces of one stage differ.
    #[error(
        "rank {rank}, op {op}: the trace differs from rank {other}'s of the same stage {stage} \
         ({detail}); ranks of a stage must run the same program"
    )]
    Asymmetric {
        /// Rank.
        rank: u32,
        /// Rank it was compared with.
        other: u32,
        /// Stage.
        stage: u32,
        /// Op index.
        op: usize,
        /// Which difference.
        detail: String,
    },
    /// Sends and receives between two stages do not pair up.
    #[error("{0}")]
    Unmatched(String),
    /// A stage has no trace, or a trace names a rank outside the layout.
    #[error("{0}")]
    Missing(String),
}

/// The program a recorded rank runs, in layout terms; ops as the module documents.
fn program_of(layout: &Layout, t: &RecordedRank) -> Result<(Program, Vec<(i8, u64)>), TraceError> {
    let mut prog = Program::default();
    let tag = OpTag {
        phase: Phase::Forward,
        micro_batch: NONE,
        layer: NONE,
    };
    let mut prev: Option<u32> = None;
    let mut recvs: Vec<(i8, u64)> = Vec::new();
    let push = |prog: &mut Program, kind: OpKind, stream: Stream, prev: &mut Option<u32>| {
        let deps: Vec<u32> = prev.iter().copied().collect();
        *prev = Some(prog.push(kind, stream, tag, &deps));
    };
    for (k, c) in t.calls.iter().enumerate() {
        push(
            &mut prog,
            segment("segment", c.compute_ps),
            Stream::Compute,
            &mut prev,
        );
        let (mut kind, stream) = map_call(layout, t.rank, k, c)?;
        if let OpKind::Recv { slot } = &mut kind {
            // Receives take mailbox slots in program order.
            *slot = recvs.len() as u32;
            recvs.push((stage_delta(layout, t.rank, k, c)?, c.bytes));
        }
        push(&mut prog, kind, stream, &mut prev);
    }
    push(
        &mut prog,
        segment("tail", t.tail_ps),
        Stream::Compute,
        &mut prev,
    );
    prog.recv_slots = recvs.len() as u32;
    Ok((prog, recvs))
}

fn segment(name: &'static str, ps: SimTime) -> OpKind {
    OpKind::Compute(ComputeOp {
        name,
        class: OpClass::Framework,
        work: Work::Measured { ps },
        recompute: false,
        sm_margin: false,
    })
}

/// The stage offset (+1 / -1, wrapping) of a send's or receive's peer.
fn stage_delta(layout: &Layout, rank: u32, op: usize, c: &RecordedCall) -> Result<i8, TraceError> {
    let err = |detail: String| TraceError::Unmapped { rank, op, detail };
    if c.peer >= layout.num_ranks() {
        return Err(err(format!(
            "{} peer {} is not a rank of the {}-rank layout",
            c.kind.name(),
            c.peer,
            layout.num_ranks()
        )));
    }
    let (me, other) = (layout.coord(rank), layout.coord(c.peer));
    let p = layout.pp;
    if (me.tp, me.cp, me.dp) != (other.tp, other.cp, other.dp) || me.pp == other.pp {
        return Err(err(format!(
            "{} peer {} is not the rank's pipeline neighbour (same tp/dp position, another stage)",
            c.kind.name(),
            c.peer
        )));
    }
    if other.pp == me.pp + 1 {
        Ok(1)
    } else if other.pp + 1 == me.pp {
        Ok(-1)
    } else if (me.pp + 1) % p == other.pp {
        Ok(1)
    } else if (other.pp + 1) % p == me.pp {
        Ok(-1)
    } else {
        Err(err(format!(
            "{} peer {} is in stage {}, not next to stage {}",
            c.kind.name(),
            c.peer,
            other.pp,
            me.pp
        )))
    }
}

/// The group kind whose group of `rank` is `group`, in ring order; TP, CP, EP, DP in that order
/// of preference (EDP groups equal DP groups when `ep` is 1).
pub fn group_kind(layout: &Layout, rank: u32, group: &[u32]) -> Option<GroupKind> {
    [GroupKind::Tp, GroupKind::Cp, GroupKind::Ep, GroupKind::Dp]
        .into_iter()
        .filter(|&k| layout.group_size(k) as usize == group.len())
        .find(|&k| {
            layout
                .members(k, layout.group_of(k, rank))
                .eq(group.iter().copied())
        })
}

/// Maps call `op` of `rank` onto an op kind (mailbox slots left 0: set once stages pair up).
fn map_call(
    layout: &Layout,
    rank: u32,
    op: usize,
    c: &RecordedCall,
) -> Result<(OpKind, Stream), TraceError> {
    let err = |detail: String| TraceError::Unmapped { rank, op, detail };
    match c.kind {
        CallKind::Send => {
            let delta = stage_delta(layout, rank, op, c)?;
            Ok((
                OpKind::Send {
                    delta,
                    bytes: c.bytes,
                    slot: 0,
                },
                Stream::PpSend,
            ))
        }
        CallKind::Recv => {
            stage_delta(layout, rank, op, c)?;
            Ok((OpKind::Recv { slot: 0 }, Stream::PpRecv))
        }
        kind => {
            if let Some(&r) = c.group.iter().find(|&&r| r >= layout.num_ranks()) {
                return Err(err(format!(
                    "{} group {:?} names rank {r}, outside the {}-rank layout",
                    kind.name(),
                    c.group,
                    layout.num_ranks()
                )));
            }
            let Some(g) = group_kind(layout, rank, &c.group) else {
                return Err(err(format!(
                    "{} group {:?} is none of the rank's groups of the layout (tp {} pp {} dp {}: \
                     TP group {:?}, DP group {:?})",
                    kind.name(),
                    c.group,
                    layout.tp,
                    layout.pp,
                    layout.dp,
                    layout
                        .members(GroupKind::Tp, layout.group_of(GroupKind::Tp, rank))
                        .collect::<Vec<_>>(),
                    layout
                        .members(GroupKind::Dp, layout.group_of(GroupKind::Dp, rank))
                        .collect::<Vec<_>>(),
                )));
            };
            if kind == CallKind::Broadcast && !c.group.contains(&c.peer) {
                return Err(err(format!(
                    "broadcast root {} is not in its group {:?}",
                    c.peer, c.group
                )));
            }
            let n = c.group.len() as u64;
            let (coll, bytes) = match kind {
                CallKind::AllReduce => (Collective::AllReduce, c.bytes),
                CallKind::ReduceScatter => (Collective::ReduceScatter, c.bytes),
                CallKind::AllGather => (
                    Collective::AllGather,
                    c.bytes.checked_mul(n).ok_or_else(|| {
                        err(format!(
                            "all-gather of {} bytes over group {:?} overflows",
                            c.bytes, c.group
                        ))
                    })?,
                ),
                CallKind::AllToAll => (Collective::AllToAll, c.bytes),
                CallKind::Broadcast => (Collective::AllGather, c.bytes),
                CallKind::Barrier => (Collective::AllReduce, 0),
                CallKind::Send | CallKind::Recv => unreachable!("handled above"),
            };
            let stream = match g {
                GroupKind::Tp => Stream::Tp,
                GroupKind::Cp => Stream::Cp,
                GroupKind::Ep => Stream::Ep,
                GroupKind::Dp | GroupKind::Edp => Stream::Dp,
            };
            Ok((
                OpKind::Collective {
                    group: g,
                    op: coll,
                    bytes,
                },
                stream,
            ))
        }
    }
}

/// Builds the execution graph of `layout` from recorded traces: at least one per pipeline
/// stage (several of one stage must agree, see the module docs). Every call is mapped onto the
/// layout's groups and neighbours, sends are paired with receives, and every rank of a stage
/// runs the stage's program.
pub fn graph_from_traces(
    layout: Layout,
    traces: &[RecordedRank],
) -> Result<ExecutionGraph, TraceError> {
    let n = layout.num_ranks();
    // Stage -> traces of the stage, lowest rank first.
    let mut by_stage: BTreeMap<u32, Vec<&RecordedRank>> = BTreeMap::new();
    for t in traces {
        if t.rank >= n {
            return Err(TraceError::Missing(format!(
                "a trace of rank {} for a layout of {n} ranks (tp {} pp {} dp {})",
                t.rank, layout.tp, layout.pp, layout.dp
            )));
        }
        by_stage.entry(layout.coord(t.rank).pp).or_default().push(t);
    }
    let mut programs = Vec::with_capacity(layout.pp as usize);
    let mut recvs = Vec::with_capacity(layout.pp as usize);
    let mut reps = Vec::with_capacity(layout.pp as usize);
    for s in 0..layout.pp {
        let Some(list) = by_stage.get_mut(&s) else {
            return Err(TraceError::Missing(format!(
                "no trace of pipeline stage {s} (e.g. rank {}); give one rank of every stage",
                layout.first_rank_of_stage(s)
            )));
        };
        list.sort_by_key(|t| t.rank);
        if let Some(w) = list.windows(2).find(|w| w[0].rank == w[1].rank) {
            return Err(TraceError::Missing(format!(
                "two traces of rank {}",
                w[0].rank
            )));
        }
        let (prog, rv) = program_of(&layout, list[0])?;
        for other in &list[1..] {
            let (p2, _) = program_of(&layout, other)?;
            compare(&prog, &p2, list[0].rank, other.rank, s)?;
        }
        programs.push(prog);
        recvs.push(rv);
        reps.push(list[0].rank);
    }
    pair_sends(&layout, &mut programs, &recvs, &reps)?;
    Ok(ExecutionGraph {
        layout,
        programs,
        ep_nic_scale: 1.0,
    })
}

/// Checks that `b` (of rank `rb`) is `a` (of rank `ra`, same stage) up to compute durations.
fn compare(a: &Program, b: &Program, ra: u32, rb: u32, stage: u32) -> Result<(), TraceError> {
    let call = |op: usize| op.saturating_sub(1) / 2;
    let diff = |op: usize, detail: String| TraceError::Asymmetric {
        rank: rb,
        other: ra,
        stage,
        op,
        detail,
    };
    let (na, nb) = (a.len() / 2, b.len() / 2);
    if na != nb {
        return Err(diff(na.min(nb), format!("{nb} calls against {na}")));
    }
    for (op, (ka, kb)) in a.kind.iter().zip(&b.kind).enumerate() {
        let same = match (ka, kb) {
            (OpKind::Compute(x), OpKind::Compute(y)) => x.name == y.name,
            (x, y) => x == y,
        };
        if !same {
            return Err(diff(call(op), format!("{kb:?} against {ka:?}")));
        }
    }
    Ok(())
}

/// Points every send at the mailbox slot of its receive: the `k`-th send of stage `s` in
/// direction `d` is the `k`-th receive of stage `s + d` from direction `-d` (with two stages,
/// stage 0 always says +1 and stage 1 always -1, so this holds there too).
fn pair_sends(
    layout: &Layout,
    programs: &mut [Program],
    recvs: &[Vec<(i8, u64)>],
    reps: &[u32],
) -> Result<(), TraceError> {
    let p = layout.pp;
    for s in 0..p {
        for d in [1i8, -1] {
            let target = ((s + p) as i64 + d as i64) as u32 % p;
            // Receives of `target` from direction -d: (slot, bytes), in order.
            let slots: Vec<(u32, u64)> = recvs[target as usize]
                .iter()
                .enumerate()
                .filter(|(_, (dir, _))| *dir == -d)
                .map(|(slot, &(_, b))| (slot as u32, b))
                .collect();
            let prog = &mut programs[s as usize];
            let sends: Vec<usize> = (0..prog.len())
                .filter(|&op| matches!(prog.kind[op], OpKind::Send { delta, .. } if delta == d))
                .collect();
            if sends.len() != slots.len() {
                return Err(TraceError::Unmatched(format!(
                    "rank {} (stage {s}) sends {} messages to stage {target}, and rank {} \
                     (stage {target}) receives {} from stage {s}",
                    reps[s as usize],
                    sends.len(),
                    reps[target as usize],
                    slots.len()
                )));
            }
            for (k, &op) in sends.iter().enumerate() {
                let (slot, rbytes) = slots[k];
                if let OpKind::Send {
                    bytes, slot: sl, ..
                } = &mut prog.kind[op]
                {
                    if *bytes != rbytes {
                        return Err(TraceError::Unmatched(format!(
                            "rank {}, op {}: send {k} to stage {target} has {} bytes, and its \
                             receive (rank {}, receive {k} from stage {s}) expects {rbytes}",
                            reps[s as usize],
                            op / 2,
                            bytes,
                            reps[target as usize]
                        )));
                    }
                    *sl = slot;
                }
            }
        }
    }
    Ok(())
}
