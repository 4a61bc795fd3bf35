//! Slicing: an execution graph of the target scale from one recorded trace per symmetry class.
//!
//! A recorded trace ([`RankTrace`], `docs/emulate.md`) is a file of protocol frames: `Hello`, one
//! `Call` per communication call, `Bye`. For a tensor/pipeline/data-parallel job the classes are
//! the pipeline stages: every rank of a stage runs the same program on its own groups. Slicing
//! ([`slice`]) keeps the lowest-numbered trace of every stage (checking any others of the stage
//! against it), and the graph is built by the engine's recorded-trace entry point
//! ([`prism_core::recorded::graph_from_traces`]), which instantiates each class for every rank
//! of its stage and joins collectives (by order within their group) and send/receive pairs.
//! [`instantiate`] spells a class trace out for one rank: the calls that rank makes.

use std::path::{Path, PathBuf};

use prism_core::engine::{GraphOptions, Mode, SimError, simulate_graph};
use prism_core::graph::{ExecutionGraph, OpKind};
use prism_core::job::Cluster;
use prism_core::layout::{GroupKind, Layout};
use prism_core::recorded::{CallKind, RecordedCall, RecordedRank, graph_from_traces};
use prism_core::units::TIME_LIMIT;

use crate::graph_file::{ClassCall, ClassTrace, ClusterSpec, FORMAT, LayoutSpec, SlicedGraph};
use crate::protocol::{Body, Bye, Call, Hello, Op, read_frame, write_frame};

/// The largest trace file read (1 GiB).
pub const MAX_TRACE_BYTES: u64 = 1 << 30;

/// One rank's recorded trace.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    /// Where it came from (a file name), for messages.
    pub origin: String,
    /// The first frame.
    pub hello: Hello,
    /// Calls in program order (`seq` 0, 1, 2, ...).
    pub calls: Vec<Call>,
    /// The last frame.
    pub bye: Bye,
}

/// Seconds to picoseconds, refusing what the engine cannot hold.
pub fn ps_from_secs(s: f64) -> Result<u64, String> {
    if !s.is_finite() || s < 0.0 {
        return Err(format!("compute_s {s} is not a finite non-negative number"));
    }
    let ps = (s * 1e12).round();
    if ps >= TIME_LIMIT as f64 {
        return Err(format!("compute_s {s} exceeds the engine's time range"));
    }
    Ok(ps as u64)
}

impl RankTrace {
    /// Parses a trace from its frames; `origin` names it in errors.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Self, String> {
        let mut r = bytes;
        let mut frame = 0usize;
        let mut next = |r: &mut &[u8]| -> Result<Option<Body>, String> {
            let f = frame;
            frame += 1;
            read_frame(r).map_err(|e| format!("{origin}: frame {f}: {e}"))
        };
        let hello = match next(&mut r)? {
            Some(Body::Hello(h)) => h,
            Some(other) => {
                return Err(format!(
                    "{origin}: frame 0 is {}, a trace starts with Hello",
                    body_name(&other)
                ));
            }
            None => return Err(format!("{origin}: empty trace (no Hello)")),
        };
        let rank = hello.rank;
        if rank >= hello.world_size {
            return Err(format!(
                "{origin}: Hello names rank {rank} of a world of {}",
                hello.world_size
            ));
        }
        let mut calls = Vec::new();
        loop {
            match next(&mut r)? {
                Some(Body::Call(c)) => {
                    let k = calls.len() as u64;
                    if c.seq != k {
                        return Err(format!(
                            "{origin}: rank {rank}, op {k}: the call says seq {}; calls are \
                             numbered 0, 1, 2, ... in program order",
                            c.seq
                        ));
                    }
                    c.validate(rank).map_err(|e| format!("{origin}: {e}"))?;
                    if let Some(&m) = c.group.iter().find(|&&m| m >= hello.world_size) {
                        return Err(format!(
                            "{origin}: rank {rank}, op {k}: group {:?} names rank {m} of a world \
                             of {}",
                            c.group, hello.world_size
                        ));
                    }
                    ps_from_secs(c.compute_s)
                        .map_err(|e| format!("{origin}: rank {rank}, op {k}: {e}"))?;
                    calls.push(c);
                }
                Some(Body::Bye(b)) => {
                    ps_from_secs(b.compute_s)
                        .map_err(|e| format!("{origin}: rank {rank}, Bye: {e}"))?;
                    if let Some(extra) = next(&mut r)? {
                        return Err(format!(
                            "{origin}: rank {rank}: {} after Bye; Bye is the last frame",
                            body_name(&extra)
                        ));
                    }
                    return Ok(RankTrace {
                        origin: origin.into(),
                        hello,
                        calls,
                        bye: b,
                    });
                }
                Some(other) => {
                    return Err(format!(
                        "{origin}: rank {rank}, op {}: {} in a trace (only Call and Bye follow \
                         Hello)",
                        calls.len(),
                        body_name(&other)
                    ));
                }
                None => {
                    return Err(format!(
                        "{origin}: rank {rank}: the trace ends after {} calls without Bye",
                        calls.len()
                    ));
                }
            }
        }
    }

    /// Reads a trace file.
    pub fn read(path: &Path) -> Result<Self, String> {
        let origin = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| format!("{origin}: {e}"))?;
        if meta.len() > MAX_TRACE_BYTES {
            return Err(format!(
                "{origin}: {} bytes, more than the {MAX_TRACE_BYTES}-byte limit of a trace",
                meta.len()
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| format!("{origin}: {e}"))?;
        Self::parse(&bytes, &origin)
    }

    /// The trace's frames.
    pub fn write(&self, w: &mut impl std::io::Write) -> Result<(), String> {
        let mut put = |b: Body| write_frame(w, &b).map_err(|e| e.to_string());
        put(Body::Hello(self.hello.clone()))?;
        for c in &self.calls {
            put(Body::Call(c.clone()))?;
        }
        put(Body::Bye(self.bye.clone()))
    }

    /// The trace as a file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out).expect("writing to memory");
        out
    }
}

fn body_name(b: &Body) -> &'static str {
    match b {
        Body::Hello(_) => "Hello",
        Body::Welcome(_) => "Welcome",
        Body::Call(_) => "Call",
        Body::Done(_) => "Done",
        Body::Fault(_) => "Fault",
        Body::Bye(_) => "Bye",
    }
}

/// The trace files named by `inputs`: files as given, directories' regular files (not
/// recursive) in name order.
pub fn trace_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for p in inputs {
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("{}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file())
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(format!("{}: no trace files in the directory", p.display()));
            }
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    if out.is_empty() {
        return Err("no trace files given".into());
    }
    Ok(out)
}

/// The engine's view of a protocol op.
pub fn call_kind(op: Op) -> Option<CallKind> {
    Some(match op {
        Op::AllReduce => CallKind::AllReduce,
        Op::ReduceScatter => CallKind::ReduceScatter,
        Op::AllGather => CallKind::AllGather,
        Op::AllToAll => CallKind::AllToAll,
        Op::Broadcast => CallKind::Broadcast,
        Op::Barrier => CallKind::Barrier,
        Op::Send => CallKind::Send,
        Op::Recv => CallKind::Recv,
        Op::Unspecified => return None,
    })
}

impl ClassTrace {
    /// The class trace of a recorded rank (data dropped, times in ps).
    pub fn from_trace(t: &RankTrace, stage: u32) -> Result<Self, String> {
        let mut calls = Vec::with_capacity(t.calls.len());
        for c in &t.calls {
            let ps = ps_from_secs(c.compute_s)?;
            calls.push(
                ClassCall::from_call(c, ps).map_err(|e| {
                    format!("{}: rank {}, op {}: {e}", t.origin, t.hello.rank, c.seq)
                })?,
            );
        }
        Ok(ClassTrace {
            stage,
            rank: t.hello.rank,
            client: t.hello.client.clone(),
            peak_memory_bytes: t.bye.peak_memory_bytes,
            tail_ps: ps_from_secs(t.bye.compute_s)?,
            calls,
        })
    }

    /// The engine's recorded rank.
    pub fn recorded(&self) -> Result<RecordedRank, String> {
        let mut calls = Vec::with_capacity(self.calls.len());
        for (k, c) in self.calls.iter().enumerate() {
            let op = c
                .op()
                .map_err(|e| format!("rank {}, op {k}: {e}", self.rank))?;
            calls.push(RecordedCall {
                kind: call_kind(op).expect("a specified op"),
                group: c.group.clone(),
                peer: c.peer,
                bytes: c.bytes,
                compute_ps: c.compute_ps,
            });
        }
        Ok(RecordedRank {
            rank: self.rank,
            calls,
            tail_ps: self.tail_ps,
        })
    }
}

/// Slices recorded traces for `layout`: the lowest-numbered trace of every stage becomes its
/// class; every trace must be of the target world size; the global graph must build (every
/// group maps onto the layout, every send pairs with a receive, traces of one stage agree).
pub fn slice(
    traces: &[RankTrace],
    layout: LayoutSpec,
    cluster: ClusterSpec,
) -> Result<SlicedGraph, String> {
    let n = layout.world_size()?;
    let mut sorted: Vec<&RankTrace> = traces.iter().collect();
    sorted.sort_by_key(|t| t.hello.rank);
    for t in &sorted {
        if t.hello.world_size != n {
            return Err(format!(
                "{}: rank {} recorded a world of {} ranks; layout tp {} pp {} dp {} has {n}",
                t.origin, t.hello.rank, t.hello.world_size, layout.tp, layout.pp, layout.dp
            ));
        }
    }
    if let Some(w) = sorted
        .windows(2)
        .find(|w| w[0].hello.rank == w[1].hello.rank)
    {
        return Err(format!(
            "{} and {}: two traces of rank {}",
            w[0].origin, w[1].origin, w[0].hello.rank
        ));
    }
    let stage_size = layout.tp * layout.dp;
    let mut all = Vec::with_capacity(sorted.len());
    for t in &sorted {
        all.push(ClassTrace::from_trace(t, t.hello.rank / stage_size)?);
    }
    // The engine checks the whole set (mapping, pairing, agreement within a stage).
    let recorded = (all.iter())
        .map(ClassTrace::recorded)
        .collect::<Result<Vec<_>, _>>()?;
    graph_from_traces(layout.layout(1), &recorded).map_err(|e| {
        // Name the file of the rank at fault.
        let msg = e.to_string();
        match sorted
            .iter()
            .find(|t| msg.starts_with(&format!("rank {},", t.hello.rank)))
        {
            Some(t) => format!("{}: {msg}", t.origin),
            None => msg,
        }
    })?;
    let mut classes: Vec<ClassTrace> = Vec::with_capacity(layout.pp as usize);
    for c in all {
        if classes.last().is_none_or(|l| l.stage != c.stage) {
            classes.push(c);
        }
    }
    Ok(SlicedGraph {
        format: FORMAT.into(),
        version: crate::graph_file::VERSION,
        layout,
        cluster,
        classes,
    })
}

impl SlicedGraph {
    /// The global execution graph on nodes of `gpus_per_node` GPUs.
    pub fn graph(&self, gpus_per_node: u32) -> Result<ExecutionGraph, String> {
        let recorded = (self.classes.iter())
            .map(ClassTrace::recorded)
            .collect::<Result<Vec<_>, _>>()?;
        graph_from_traces(self.layout.layout(gpus_per_node), &recorded).map_err(|e| e.to_string())
    }

    /// The class (stage) trace of `rank`.
    pub fn class_of(&self, rank: u32) -> &ClassTrace {
        &self.classes[(rank / (self.layout.tp * self.layout.dp)) as usize]
    }
}

/// The calls `rank` makes: its class's trace with every group replaced by the rank's own group
/// of the same kind, every send/receive peer by the rank's neighbour in the same direction, a
/// broadcast root by the member at the same group position (the `peer` of other collectives is
/// kept as recorded). (`seq` numbered, no data.)
pub fn instantiate(g: &SlicedGraph, rank: u32) -> Result<Vec<Call>, String> {
    let n = g.layout.world_size()?;
    if rank >= n {
        return Err(format!("rank {rank} is not in the {n}-rank layout"));
    }
    if g.classes.len() != g.layout.pp as usize {
        return Err(format!(
            "{} classes for {} pipeline stages",
            g.classes.len(),
            g.layout.pp
        ));
    }
    let layout = g.layout.layout(1);
    let class = g.class_of(rank);
    let rep = class.rank;
    let mut out = Vec::with_capacity(class.calls.len());
    for (k, c) in class.calls.iter().enumerate() {
        let mut call = c.to_call(k as u64)?;
        let at = |d: String| format!("rank {rep}, op {k}: {d}");
        match c.op()? {
            Op::Send | Op::Recv => {
                call.peer = translate_peer(&layout, rep, rank, c.peer).map_err(at)?;
            }
            _ => {
                let kind = prism_core::recorded::group_kind(&layout, rep, &c.group)
                    .ok_or_else(|| at(format!("group {:?} is not a layout group", c.group)))?;
                let pos = c.group.iter().position(|&m| m == c.peer);
                call.group = layout.members(kind, layout.group_of(kind, rank)).collect();
                // Only a broadcast names a rank in `peer` (its root); other collectives keep
                // whatever the recording said (the field means nothing for them).
                if c.op()? == Op::Broadcast {
                    let p = pos.ok_or_else(|| {
                        at(format!(
                            "broadcast root {} is not in its group {:?}",
                            c.peer, c.group
                        ))
                    })?;
                    call.peer = call.group[p];
                }
            }
        }
        out.push(call);
    }
    Ok(out)
}

fn translate_peer(layout: &Layout, rep: u32, rank: u32, peer: u32) -> Result<u32, String> {
    if peer >= layout.num_ranks() {
        return Err(format!("peer {peer} is outside the layout"));
    }
    let (a, b) = (layout.coord(rep), layout.coord(peer));
    let c = layout.coord(rank);
    Ok(layout.rank(prism_core::layout::Coord { pp: b.pp, ..c })).and_then(|r| {
        if (a.tp, a.cp, a.dp) == (b.tp, b.cp, b.dp) {
            Ok(r)
        } else {
            Err(format!("peer {peer} is not a pipeline neighbour"))
        }
    })
}

/// What `prism emulate slice` prints.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Ranks of the target job.
    pub ranks: u32,
    /// Symmetry classes (stages).
    pub classes: u32,
    /// Per class: (stage, representative, ops of its program, calls, peak memory bytes).
    pub per_class: Vec<ClassStats>,
    /// Collectives of the whole job (each counted once, not once per member).
    pub collectives: u64,
    /// Point-to-point messages of the whole job.
    pub sends: u64,
    /// Ops of the global graph (every rank's program together).
    pub global_ops: u64,
    /// Simulated iteration (session) time, seconds.
    pub iteration_s: f64,
    /// The engine mode that produced it (`reduced`, or `full` for an asymmetric placement).
    pub mode: &'static str,
}

/// Per-class statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassStats {
    /// Stage.
    pub stage: u32,
    /// Representative rank.
    pub rank: u32,
    /// Ops of the class program (segments and calls).
    pub ops: u64,
    /// Communication calls.
    pub calls: u64,
    /// Collective calls.
    pub collectives: u64,
    /// Sends.
    pub sends: u64,
    /// Compute of one rank of the class, seconds.
    pub compute_s: f64,
    /// Recorded peak memory, bytes.
    pub peak_memory_bytes: u64,
}

/// Statistics of a sliced graph, and its simulated time on `cluster` (reduced mode; every rank
/// when the placement is not symmetric).
pub fn stats(g: &SlicedGraph, cluster: &Cluster) -> Result<Stats, String> {
    let graph = g.graph(cluster.gpus_per_node)?;
    let layout = graph.layout;
    let mut per_class = Vec::new();
    let (mut collectives, mut sends) = (0u64, 0u64);
    for (s, p) in graph.programs.iter().enumerate() {
        let mut cs = ClassStats {
            stage: s as u32,
            rank: g.classes[s].rank,
            ops: p.len() as u64,
            calls: g.classes[s].calls.len() as u64,
            collectives: 0,
            sends: 0,
            compute_s: 0.0,
            peak_memory_bytes: g.classes[s].peak_memory_bytes,
        };
        for k in &p.kind {
            match k {
                OpKind::Collective { group, .. } => {
                    cs.collectives += 1;
                    collectives += layout.stage_size() as u64 / layout.group_size(*group) as u64;
                    let _: GroupKind = *group;
                }
                OpKind::Send { .. } => {
                    cs.sends += 1;
                    sends += layout.stage_size() as u64;
                }
                OpKind::Compute(c) => {
                    if let prism_core::ops::Work::Measured { ps } = c.work {
                        cs.compute_s += ps as f64 * 1e-12;
                    }
                }
                OpKind::Recv { .. } => {}
            }
        }
        per_class.push(cs);
    }
    let (res, mode) = run_offline(&graph, cluster)?;
    Ok(Stats {
        ranks: layout.num_ranks(),
        classes: layout.pp,
        per_class,
        collectives,
        sends,
        global_ops: graph.total_ops() * layout.stage_size() as u64,
        iteration_s: res.iteration_ps as f64 * 1e-12,
        mode,
    })
}

/// Runs a graph without real ranks: reduced mode, or every rank when the placement is not
/// symmetric.
pub fn run_offline(
    graph: &ExecutionGraph,
    cluster: &Cluster,
) -> Result<(prism_core::engine::GraphResult, &'static str), String> {
    let opts = GraphOptions {
        mode: Mode::Reduced,
        ..Default::default()
    };
    match simulate_graph(graph, cluster, &opts, None) {
        Ok(r) => Ok((r, "reduced")),
        Err(SimError::Asymmetric(_)) => {
            let full = GraphOptions::default();
            simulate_graph(graph, cluster, &full, None)
                .map(|r| (r, "full"))
                .map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}
