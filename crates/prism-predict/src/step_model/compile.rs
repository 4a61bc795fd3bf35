use super::*;

/// What a macro-op does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum MKind {
    /// Kernels `k0..k1` of the compute stream (indices into the stage's kernel arrays).
    Seg { k0: u32, k1: u32, collapsible: bool },
    /// Tensor-parallel collective of frozen duration `d` (starts at the latest lane of its
    /// group: the lanes of the same context-parallel rank).
    Tp { d: SimTime },
    /// Context-parallel collective of frozen duration `d` (starts at the latest lane of its
    /// group: the lanes of the same tensor-parallel rank).
    Cp { d: SimTime },
    /// Collective of a group of one, or a data-parallel collective that every replica reaches
    /// at the same time: lane-local, duration `d`.
    Local { d: SimTime },
    /// Data-parallel collective of the tail (maximum over replicas).
    Dp { d: SimTime },
    /// Pipeline send of duration `d` to the stage `delta` away, into mailbox `slot`.
    Send { d: SimTime, delta: i8, slot: u32 },
    /// Pipeline receive from mailbox `slot`.
    Recv { slot: u32 },
}

/// One stage's program as macro-ops (op ids are a topological order).
#[derive(Clone, Debug, Default)]
pub(super) struct StageProg {
    pub(super) kind: Vec<MKind>,
    pub(super) stream: Vec<u8>,
    pub(super) pos: Vec<u32>,
    pub(super) dep_off: Vec<u32>,
    pub(super) deps: Vec<u32>,
    pub(super) stream_ops: [Vec<u32>; NUM_STREAMS],
    /// Evaluated in the tail (after every replica's pipeline).
    pub(super) tail: Vec<bool>,
    /// Slot in the tail store (boundary and tail ops), `u32::MAX` otherwise.
    pub(super) slot: Vec<u32>,
    pub(super) slots: u32,
    pub(super) tail_ops: Vec<u32>,
    pub(super) boundary_ops: Vec<u32>,
    pub(super) recv_slots: u32,
    /// Kernels of the compute stream in order: nominal ps, class and original op id.
    pub(super) kd: Vec<SimTime>,
    pub(super) kclass: Vec<OpClass>,
    pub(super) kname: Vec<&'static str>,
    pub(super) kop: Vec<u32>,
    /// Original op id of each macro-op (a segment's first kernel).
    pub(super) orig_op: Vec<u32>,
    /// Gates of each segment (CSR): (kernel index, op) where a kernel inside the segment also
    /// waits for a parameter all-gather that is the same on every lane and replica.
    pub(super) gate_off: Vec<u32>,
    pub(super) gates: Vec<(u32, u32)>,
    /// Streams to re-check once an op is done (its own and those of its dependents).
    pub(super) wake: Vec<u8>,
}

impl StageProg {
    pub(super) fn deps_of(&self, op: u32) -> &[u32] {
        &self.deps[self.dep_off[op as usize] as usize..self.dep_off[op as usize + 1] as usize]
    }

    pub(super) fn gates_of(&self, op: u32) -> &[(u32, u32)] {
        &self.gates[self.gate_off[op as usize] as usize..self.gate_off[op as usize + 1] as usize]
    }

    /// The op before `op` on its stream.
    pub(super) fn stream_pred(&self, op: u32) -> Option<u32> {
        let p = self.pos[op as usize];
        (p > 0).then(|| self.stream_ops[self.stream[op as usize] as usize][p as usize - 1])
    }

    /// Index of `op` (a boundary or tail op) of replica `r`, lane `lane`, in the tail store.
    pub(super) fn tail_at(&self, r: usize, op: u32, lane: usize, l: usize) -> usize {
        (r * self.slots as usize + self.slot[op as usize] as usize) * l + lane
    }

    /// Ready time of tail op `op` on replica `r`, lane `lane`: the latest end among its
    /// predecessors in the tail store, and that predecessor (the first on ties).
    pub(super) fn tail_ready(
        &self,
        store: &[f64],
        r: usize,
        op: u32,
        lane: usize,
        l: usize,
    ) -> (f64, u32) {
        let mut best = (0.0f64, u32::MAX);
        for p in self.preds(op) {
            let e = store[self.tail_at(r, p, lane, l)];
            if best.1 == u32::MAX || e > best.0 {
                best = (e, p);
            }
        }
        best
    }

    /// Everything `op` waits for: its stream predecessor and its dependencies.
    pub(super) fn preds(&self, op: u32) -> impl Iterator<Item = u32> + '_ {
        self.stream_pred(op)
            .into_iter()
            .chain(self.deps_of(op).iter().copied())
    }
}

/// Where a macro-op's end lives in a replica's value array: one time shared by every lane of
/// the stage, or one per lane (`lanes` consecutive values).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Val {
    pub(super) at: u32,
    pub(super) lanes: bool,
}

impl Val {
    /// Values it occupies with `l` lanes per stage.
    pub(super) fn width(self, l: usize) -> usize {
        if self.lanes { l } else { 1 }
    }
}

/// What an instruction of the replica program computes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Code {
    /// Ends at its latest input plus `d` (times the communication regime): a collective of a
    /// group of one, a head data-parallel collective, a send, or (`d = 0`) a receive.
    Add { d: SimTime },
    /// A tensor-parallel collective: starts at the latest input over the lanes of its group
    /// (every lane when `cp = 1`).
    Tp { d: SimTime },
    /// A context-parallel collective: starts at the latest input over the lanes of its group.
    Cp { d: SimTime },
    /// A segment: nominal time `m` (ps), standard deviation `sd` of its fast draw, gates in
    /// `Tape::gates[g0..g1]`.
    Seg {
        m: f64,
        sd: f64,
        collapsible: bool,
        g0: u32,
        g1: u32,
        /// Drawn kernel by kernel (a jitter without the normal shortcut).
        pk: bool,
    },
    /// A fused run of one-time-for-every-lane steps `Tape::steps[s0..s1]`, each starting when
    /// the previous one ends (see [`Tape::fuse`]).
    Run { s0: u32, s1: u32 },
    /// A pooled region ([`super::pool`]): its exits `Tape::pool_outs[o0..o1]` are its entry (the
    /// only input) plus a row drawn uniformly from pool `shape` of the sample.
    Pool { shape: u32, o0: u32, o1: u32 },
}

/// One step of a fused run: a duration added to the running time, whose end is written to
/// value `out`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Step {
    pub(super) out: u32,
    pub(super) kind: StepKind,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum StepKind {
    /// A collective (or receive) of frozen duration `d`, scaled by the communication regime.
    Comm { d: SimTime },
    /// A segment whose lanes start together and of which only the latest lane is observable
    /// (or whose lanes are all alike): nominal `m`, standard deviation `sd`.
    Seg { m: f64, sd: f64 },
    /// A pooled region: a duration drawn uniformly from pool `shape` of the sample.
    Pool { shape: u32 },
}

/// One instruction: macro-op `op` of stage `stage`.
#[derive(Clone, Debug)]
pub(super) struct Ins {
    pub(super) code: Code,
    pub(super) stage: u32,
    pub(super) op: u32,
    pub(super) out: Val,
    /// Inputs in `Tape::inputs[i0..i1]`; `lanes_in`: at least one holds per-lane times.
    pub(super) i0: u32,
    pub(super) i1: u32,
    pub(super) lanes_in: bool,
}

/// A replica's macro-ops as a straight-line program: the dataflow order is the same for every
/// replica and sample, so it is found once (a static sweep of the stages) and every sample only
/// replays it. Whether a value is per lane is decided statically too: a segment whose lanes
/// may differ (jitter, per-GPU speeds) makes its successors per lane until a tensor-parallel
/// collective joins them again.
#[derive(Clone, Debug, Default)]
pub(super) struct Tape {
    pub(super) ins: Vec<Ins>,
    pub(super) inputs: Vec<Val>,
    pub(super) steps: Vec<Step>,
    /// The instructions before fusion, and the one producing each value (critical paths).
    pub(super) orig: Vec<Ins>,
    pub(super) producer: Vec<u32>,
    /// (kernel index, value of the gating all-gather).
    pub(super) gates: Vec<(u32, Val)>,
    /// Exits of the pooled regions ([`Code::Pool`]).
    pub(super) pool_outs: Vec<Val>,
    /// Values per replica.
    pub(super) len: usize,
    /// Value of each macro-op of each stage (`None` for tail ops).
    pub(super) val: Vec<Vec<Option<Val>>>,
    /// Ends that nothing outside the tail waits for: their maximum is the replica's last end
    /// (every duration is non-negative).
    pub(super) sinks: Vec<Val>,
    /// Identity of this compiled program (unique per compilation, shared by clones): a reused
    /// evaluation scratch keeps its values only for the tape it last served.
    pub(super) id: u64,
}

/// Source of [`Tape::id`].
pub(super) static NEXT_TAPE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Tape {
    /// Fuses chains of instructions into runs: an instruction whose inputs and output are one
    /// time for every lane joins the run that produced one of its inputs when every other input
    /// is an ancestor of the run's last instruction (so it ends no later; every duration is
    /// non-negative). A run is evaluated as one loop where it starts; the instructions it
    /// absorbed were placed later, but everything they read is computed by the run or before it.
    /// Works on the unfused list `orig` (with `producer` set) and replaces `ins`.
    pub(super) fn fuse(&mut self) {
        let old = &self.orig;
        // Open runs by the value of their last step: (index in the new list, last old index).
        let mut open: std::collections::BTreeMap<u32, (usize, u32)> = Default::default();
        let mut new: Vec<Ins> = Vec::with_capacity(old.len());
        let mut steps: Vec<Vec<Step>> = Vec::new();
        for (i, ins) in old.iter().enumerate() {
            let inputs = &self.inputs[ins.i0 as usize..ins.i1 as usize];
            let kind = match ins.code {
                _ if ins.lanes_in || ins.out.lanes => None,
                Code::Tp { d } | Code::Cp { d } | Code::Add { d } => Some(StepKind::Comm { d }),
                Code::Seg {
                    m,
                    sd,
                    g0,
                    g1,
                    pk: false,
                    ..
                } if g0 == g1 => Some(StepKind::Seg { m, sd }),
                Code::Pool { shape, o0, o1 } if o1 == o0 + 1 => Some(StepKind::Pool { shape }),
                _ => None,
            };
            let Some(kind) = kind else {
                new.push(ins.clone());
                continue;
            };
            let step = Step {
                out: ins.out.at,
                kind,
            };
            // A run this instruction can join.
            let join = inputs.iter().find_map(|v| {
                let &(run, last) = open.get(&v.at)?;
                let others_earlier = inputs
                    .iter()
                    .filter(|w| w.at != v.at)
                    .all(|w| self.is_ancestor(self.producer[w.at as usize], last));
                others_earlier.then_some((v.at, run))
            });
            match join {
                Some((at, run)) => {
                    open.remove(&at);
                    let Code::Run { s0, .. } = new[run].code else {
                        unreachable!("open runs are runs")
                    };
                    steps[s0 as usize].push(step);
                    open.insert(ins.out.at, (run, i as u32));
                }
                None => {
                    let id = steps.len() as u32;
                    steps.push(vec![step]);
                    open.insert(ins.out.at, (new.len(), i as u32));
                    new.push(Ins {
                        code: Code::Run { s0: id, s1: 0 },
                        ..ins.clone()
                    });
                }
            }
        }
        // Lay the runs' steps out contiguously.
        let mut flat = Vec::with_capacity(old.len());
        for ins in &mut new {
            if let Code::Run { s0, .. } = ins.code {
                let run = &steps[s0 as usize];
                let start = flat.len() as u32;
                flat.extend_from_slice(run);
                ins.code = Code::Run {
                    s0: start,
                    s1: flat.len() as u32,
                };
            }
        }
        self.steps = flat;
        self.ins = new;
    }

    /// Whether unfused instruction `a` is an ancestor of `b` (`a == b` included), by a bounded
    /// backward search over inputs; "no" when unsure.
    pub(super) fn is_ancestor(&self, a: u32, b: u32) -> bool {
        const LIMIT: usize = 64;
        if a == u32::MAX {
            return false;
        }
        let mut stack = vec![b];
        let mut seen = 0;
        while let Some(x) = stack.pop() {
            if x == a {
                return true;
            }
            seen += 1;
            if seen > LIMIT {
                return false;
            }
            // Inputs are produced earlier in the old order; `a` cannot be reached from below it.
            if x < a {
                continue;
            }
            let ins = &self.orig[x as usize];
            for v in &self.inputs[ins.i0 as usize..ins.i1 as usize] {
                let p = self.producer[v.at as usize];
                if p != u32::MAX && p >= a {
                    stack.push(p);
                }
            }
        }
        false
    }
}

/// Compiles stage `s`'s program with the recorded durations `dur` (by original op id).
pub(super) fn compile_stage(
    graph: &ExecutionGraph,
    s: u32,
    dur: &[SimTime],
    layout: &Layout,
) -> Result<StageProg, SimError> {
    let p = &graph.programs[s as usize];
    let n = p.len();
    // Macro-op of each original op.
    let mut macro_of = vec![u32::MAX; n];
    let mut out = StageProg {
        recv_slots: p.recv_slots,
        dep_off: vec![0],
        ..Default::default()
    };
    let compute = &p.stream_ops[Stream::Compute as usize];
    let mut kernel_index = vec![u32::MAX; n];
    for (i, &op) in compute.iter().enumerate() {
        kernel_index[op as usize] = i as u32;
        let OpKind::Compute(c) = p.kind[op as usize] else {
            return Err(unsupported("a non-kernel op on the compute stream"));
        };
        out.kd.push(dur[op as usize]);
        out.kclass.push(c.class);
        out.kname.push(c.name);
        out.kop.push(op);
    }
    // Head data-parallel collectives of the original program: they wait for nothing but
    // earlier head collectives, so every lane and replica reaches them at the same time.
    let mut head_orig = vec![false; n];
    for o in 0..n {
        if let OpKind::Collective {
            group: GroupKind::Dp,
            ..
        } = p.kind[o]
        {
            let pos = p.pos[o] as usize;
            let pred = (pos > 0).then(|| p.stream_ops[p.stream[o] as usize][pos - 1]);
            head_orig[o] = pred
                .into_iter()
                .chain(p.deps_of(o as u32).iter().copied())
                .all(|q| head_orig[q as usize]);
        }
    }
    let mut pending_deps: Vec<u32> = Vec::new();
    // Gates by segment (original op ids until every op is mapped).
    let mut seg_gates: Vec<Vec<(u32, u32)>> = Vec::new();
    let mut op = 0u32;
    while (op as usize) < n {
        let stream = p.stream[op as usize];
        let mut gates_here: Vec<(u32, u32)> = Vec::new();
        let kind = match p.kind[op as usize] {
            OpKind::Compute(_) => {
                // Extend while nothing outside the compute stream can observe the boundary; a
                // later kernel may wait for a head all-gather (a gate, same on every lane).
                let mut last = op;
                loop {
                    let k = kernel_index[last as usize] as usize;
                    let Some(&next) = compute.get(k + 1) else {
                        break;
                    };
                    if p.has_dependents[last as usize]
                        || !p.deps_of(next).iter().all(|&d| head_orig[d as usize])
                    {
                        break;
                    }
                    for &d in p.deps_of(next) {
                        gates_here.push((kernel_index[next as usize], d));
                    }
                    last = next;
                }
                let k0 = kernel_index[op as usize];
                let k1 = kernel_index[last as usize] + 1;
                MKind::Seg {
                    k0,
                    k1,
                    collapsible: false,
                }
            }
            OpKind::Collective { group, .. } => {
                let d = dur[op as usize];
                let size = layout.group_size(group);
                match group {
                    _ if size == 1 => MKind::Local { d },
                    GroupKind::Tp => MKind::Tp { d },
                    GroupKind::Cp => MKind::Cp { d },
                    // A head collective is reached at the same time on every lane and replica.
                    GroupKind::Dp if head_orig[op as usize] => MKind::Local { d },
                    GroupKind::Dp => MKind::Dp { d },
                    other => {
                        return Err(unsupported(format!(
                            "{other:?} collectives are not supported"
                        )));
                    }
                }
            }
            OpKind::Send { delta, slot, .. } => MKind::Send {
                d: dur[op as usize],
                delta,
                slot,
            },
            OpKind::Recv { slot } => MKind::Recv { slot },
        };
        let id = out.kind.len() as u32;
        out.orig_op.push(op);
        out.kind.push(kind);
        out.stream.push(stream as u8);
        out.pos.push(out.stream_ops[stream as usize].len() as u32);
        out.stream_ops[stream as usize].push(id);
        pending_deps.clear();
        for &d in p.deps_of(op) {
            let m = macro_of[d as usize];
            debug_assert!(m != u32::MAX, "dependency on a later op");
            if !pending_deps.contains(&m) {
                pending_deps.push(m);
            }
        }
        out.deps.extend_from_slice(&pending_deps);
        out.dep_off.push(out.deps.len() as u32);
        seg_gates.push(gates_here);
        // Map every original op of the macro-op (kernels of a segment are consecutive on the
        // compute stream but not in id order).
        if let MKind::Seg { k0, k1, .. } = kind {
            for k in k0..k1 {
                macro_of[compute[k as usize] as usize] = id;
            }
        } else {
            macro_of[op as usize] = id;
        }
        // Next unmapped op.
        op += 1;
        while (op as usize) < n && macro_of[op as usize] != u32::MAX {
            op += 1;
        }
    }
    out.gate_off.push(0);
    for g in &seg_gates {
        for &(k, d) in g {
            out.gates.push((k, macro_of[d as usize]));
        }
        out.gate_off.push(out.gates.len() as u32);
    }
    let m = out.kind.len();
    // The tail: data-parallel collectives that are not head collectives (those became `Local`
    // above), and everything after them.
    let mut tail = vec![false; m];
    for i in 0..m as u32 {
        tail[i as usize] = matches!(out.kind[i as usize], MKind::Dp { .. })
            || out.preds(i).any(|q| tail[q as usize]);
    }
    // Boundary ops (non-tail inputs of tail ops) and the tail store's slots.
    out.slot = vec![u32::MAX; m];
    for i in 0..m as u32 {
        if !tail[i as usize] {
            continue;
        }
        if matches!(
            out.kind[i as usize],
            MKind::Send { .. } | MKind::Recv { .. }
        ) {
            return Err(unsupported(
                "pipeline messages after a data-parallel collective",
            ));
        }
        if !out.gates_of(i).is_empty() {
            return Err(unsupported(
                "a parameter gather gating kernels after the gradient reduction",
            ));
        }
        out.tail_ops.push(i);
        let preds: Vec<u32> = out.preds(i).collect();
        for q in preds {
            if !tail[q as usize] && out.slot[q as usize] == u32::MAX {
                out.slot[q as usize] = out.slots;
                out.slots += 1;
                out.boundary_ops.push(q);
            }
        }
    }
    for &i in &out.tail_ops {
        out.slot[i as usize] = out.slots;
        out.slots += 1;
    }
    // Streams stop at their first tail op: every later op on the stream must be tail too.
    for ops in &out.stream_ops {
        if let Some(first) = ops.iter().position(|&o| tail[o as usize])
            && ops[first..].iter().any(|&o| !tail[o as usize])
        {
            return Err(unsupported(
                "a stream continues after a data-parallel collective",
            ));
        }
    }
    out.tail = tail;
    // Collapsible segments: only a TP collective observes the end, and the next kernel waits
    // for that collective (so every lane's next step starts after the slowest lane).
    let mut dependents: Vec<Vec<u32>> = vec![Vec::new(); m];
    for i in 0..m as u32 {
        for &d in out.deps_of(i) {
            dependents[d as usize].push(i);
        }
    }
    // (With context parallelism a TP collective sees only its group's lanes: none is.)
    let cops = out.stream_ops[Stream::Compute as usize].clone();
    for (k, &i) in cops.iter().enumerate() {
        if layout.cp > 1 {
            break;
        }
        if out.tail[i as usize] || out.slot[i as usize] != u32::MAX {
            continue;
        }
        let deps_i = &dependents[i as usize];
        if deps_i.is_empty()
            || !deps_i
                .iter()
                .all(|&t| matches!(out.kind[t as usize], MKind::Tp { .. }))
        {
            continue;
        }
        let Some(&next) = cops.get(k + 1) else {
            continue;
        };
        let gated = out.deps_of(next).iter().any(|d| deps_i.contains(d));
        if gated && let MKind::Seg { collapsible, .. } = &mut out.kind[i as usize] {
            *collapsible = true;
        }
    }
    out.wake = (0..m)
        .map(|i| {
            let mut w = 1u8 << out.stream[i];
            for &t in &dependents[i] {
                w |= 1 << out.stream[t as usize];
            }
            w
        })
        .collect();
    // A gate's all-gather wakes the compute stream too.
    for &(_, g) in &out.gates {
        out.wake[g as usize] |= 1 << Stream::Compute as u8;
    }
    Ok(out)
}

impl StepModel {
    /// Finds the dataflow order of one replica by a static sweep of its stages and compiles it
    /// into a [`Tape`]. `vary(stage, op)`: whether segment `op` may end at different times on
    /// different lanes that started together.
    pub(super) fn compile_tape(
        &self,
        vary: &dyn Fn(usize, u32) -> bool,
        stats: Option<&SegStats>,
        fuse: bool,
    ) -> Result<Tape, SimError> {
        let l = lanes(&self.layout) as u32;
        let (tp, cp) = (self.layout.tp, self.layout.cp);
        let pp = self.layout.pp as usize;
        let mut pc = vec![[0u32; NUM_STREAMS]; pp];
        let mut mail: Vec<Vec<Option<Val>>> = self
            .stages
            .iter()
            .map(|st| vec![None; st.recv_slots as usize])
            .collect();
        let mut tape = Tape {
            val: self
                .stages
                .iter()
                .map(|st| vec![None; st.kind.len()])
                .collect(),
            id: NEXT_TAPE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ..Tape::default()
        };
        loop {
            let mut moved = false;
            for s in 0..pp {
                let st = &self.stages[s];
                let mut mask: u8 = (1u16 << NUM_STREAMS) as u8 - 1;
                while mask != 0 {
                    let sidx = mask.trailing_zeros() as usize;
                    mask &= mask - 1;
                    while let Some(&op) = st.stream_ops[sidx].get(pc[s][sidx] as usize) {
                        let vals = &tape.val[s];
                        if st.tail[op as usize]
                            || !st.deps_of(op).iter().all(|&d| vals[d as usize].is_some())
                            || !st
                                .gates_of(op)
                                .iter()
                                .all(|&(_, g)| vals[g as usize].is_some())
                        {
                            break;
                        }
                        let mail_in = match st.kind[op as usize] {
                            MKind::Recv { slot } => match mail[s][slot as usize] {
                                Some(v) => Some(v),
                                None => break,
                            },
                            _ => None,
                        };
                        let i0 = tape.inputs.len() as u32;
                        for p in st.preds(op) {
                            tape.inputs.push(vals[p as usize].expect("evaluated input"));
                        }
                        tape.inputs.extend(mail_in);
                        let lanes_in = tape.inputs[i0 as usize..].iter().any(|v| v.lanes);
                        let (code, lanes) = match st.kind[op as usize] {
                            // A group collective is one time per group: per lane unless the
                            // group spans every lane or every input is one time for all.
                            MKind::Tp { d } => (Code::Tp { d }, lanes_in && cp > 1),
                            MKind::Cp { d } => (Code::Cp { d }, lanes_in && tp > 1),
                            MKind::Local { d } | MKind::Send { d, .. } => {
                                (Code::Add { d }, lanes_in)
                            }
                            MKind::Recv { .. } => (Code::Add { d: 0 }, lanes_in),
                            MKind::Seg {
                                k0,
                                k1,
                                collapsible,
                            } => {
                                let g0 = tape.gates.len() as u32;
                                for &(k, g) in st.gates_of(op) {
                                    tape.gates.push((k, vals[g as usize].expect("gate")));
                                }
                                let (m, sd, pk) = match stats {
                                    Some(f) => (
                                        f.mean[s][op as usize],
                                        f.sd[s][op as usize],
                                        f.pk[s][op as usize],
                                    ),
                                    None => (
                                        (k0..k1).map(|k| st.kd[k as usize]).sum::<SimTime>() as f64,
                                        0.0,
                                        false,
                                    ),
                                };
                                let code = Code::Seg {
                                    m,
                                    sd,
                                    pk,
                                    collapsible,
                                    g0,
                                    g1: tape.gates.len() as u32,
                                };
                                (code, !collapsible && (lanes_in || vary(s, op)))
                            }
                            MKind::Dp { .. } => unreachable!("tail ops stop the sweep"),
                        };
                        let out = Val {
                            at: tape.len as u32,
                            lanes,
                        };
                        tape.len += out.width(l as usize);
                        tape.val[s][op as usize] = Some(out);
                        tape.ins.push(Ins {
                            code,
                            stage: s as u32,
                            op,
                            out,
                            i0,
                            i1: tape.inputs.len() as u32,
                            lanes_in,
                        });
                        if let MKind::Send { delta, slot, .. } = st.kind[op as usize] {
                            let peer = (s as i64 + delta as i64).rem_euclid(pp as i64) as usize;
                            mail[peer][slot as usize] = Some(out);
                        }
                        pc[s][sidx] += 1;
                        mask |= st.wake[op as usize] & !(1 << sidx);
                        moved = true;
                    }
                }
            }
            if !moved {
                break;
            }
        }
        for (s, st) in self.stages.iter().enumerate() {
            // Every stream must have reached its end or the tail.
            for (sidx, (ops, &at)) in st.stream_ops.iter().zip(&pc[s]).enumerate() {
                if let Some(&op) = ops.get(at as usize)
                    && !st.tail[op as usize]
                {
                    return Err(SimError::Deadlock {
                        rank: self.layout.rank(Coord {
                            tp: 0,
                            cp: 0,
                            dp: 0,
                            pp: s as u32,
                        }),
                        stream: prism_core::graph::STREAMS[sidx].name(),
                        detail: format!("max-plus model stuck at macro-op {op}"),
                    });
                }
            }
            // Sinks: ops that no op waits for (sends feed a receive, gates a segment).
            let mut waited = vec![false; st.kind.len()];
            for op in 0..st.kind.len() as u32 {
                for p in st.preds(op) {
                    waited[p as usize] = true;
                }
                for &(_, g) in st.gates_of(op) {
                    waited[g as usize] = true;
                }
            }
            for (op, kind) in st.kind.iter().enumerate() {
                if !waited[op]
                    && !matches!(kind, MKind::Send { .. })
                    && let Some(v) = tape.val[s][op]
                {
                    tape.sinks.push(v);
                }
            }
        }
        tape.orig = tape.ins.clone();
        tape.producer = vec![u32::MAX; tape.len];
        for (i, ins) in tape.orig.iter().enumerate() {
            tape.producer[ins.out.at as usize] = i as u32;
        }
        if fuse {
            tape.fuse();
        }
        Ok(tape)
    }
}
