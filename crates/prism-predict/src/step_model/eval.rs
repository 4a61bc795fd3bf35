use super::*;

/// Scaling of frozen communication durations by a sample's regime. The engine rounds a scaled
/// duration to the picosecond (the exact and nominal evaluations do too); the fast sampler need
/// not.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Scale {
    pub(super) c: f64,
    pub(super) round: bool,
}

impl Scale {
    pub(super) fn new(c: f64, draw: &Draw) -> Self {
        Scale {
            c,
            round: !matches!(draw, Draw::Fast { .. }),
        }
    }

    #[inline]
    pub(super) fn of(self, d: SimTime) -> f64 {
        if self.c == 1.0 {
            d as f64
        } else if self.round {
            (d as f64 * self.c).round()
        } else {
            d as f64 * self.c
        }
    }
}

/// Scratch space of one evaluation.
#[derive(Debug)]
pub(super) struct Work {
    /// Ends of the current replica's macro-ops (see [`Tape`]).
    pub(super) vals: Vec<f64>,
    pub(super) ready: Vec<f64>,
    /// Persistent per-GPU factors of the current replica, `tp` per stage.
    pub(super) lane_fs: Vec<f64>,
    /// The slowest lane's factor per stage.
    pub(super) fmax: Vec<f64>,
    /// [`Tape::id`] of the tape whose values `vals` holds.
    pub(super) tape: u64,
}

impl Work {
    pub(super) fn new(m: &StepModel, tape: &Tape) -> Self {
        let mut w = Work {
            vals: Vec::new(),
            ready: Vec::new(),
            lane_fs: Vec::new(),
            fmax: Vec::new(),
            tape: tape.id,
        };
        w.reset(m, tape);
        w
    }

    /// Sizes and sets the arrays for an evaluation of `tape`: the per-replica ones as a fresh
    /// scratch has them, the values zeroed unless they already belong to `tape` (every
    /// evaluation writes a value before it reads it, and a value no evaluation of this tape
    /// writes is still 0).
    fn reset(&mut self, m: &StepModel, tape: &Tape) {
        if self.tape != tape.id || self.vals.len() != tape.len {
            self.vals.clear();
            self.tape = tape.id;
        }
        self.vals.resize(tape.len, 0.0);
        let l = lanes(&m.layout);
        let pp = m.layout.pp as usize;
        for (v, n, x) in [
            (&mut self.ready, l, 0.0),
            (&mut self.lane_fs, pp * l, 1.0),
            (&mut self.fmax, pp, 1.0),
        ] {
            v.clear();
            v.resize(n, x);
        }
    }

    /// A scratch for `tape`, reusing this thread's last one (it goes back when the guard is
    /// dropped): a sample's value array is tens of megabytes at thousands of GPUs, and a fresh
    /// one per sample costs more in page faults than a pruned sample itself.
    pub(super) fn reuse(m: &StepModel, tape: &Tape) -> Scratch {
        let work = match SCRATCH.take() {
            Some(mut w) => {
                w.reset(m, tape);
                w
            }
            None => Work::new(m, tape),
        };
        Scratch(Some(work))
    }
}

/// A [`Work`] borrowed from this thread's scratch slot; dropping it puts it back.
#[derive(Debug)]
pub(super) struct Scratch(Option<Work>);

impl std::ops::Deref for Scratch {
    type Target = Work;
    fn deref(&self) -> &Work {
        self.0.as_ref().expect("scratch present until drop")
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut Work {
        self.0.as_mut().expect("scratch present until drop")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        SCRATCH.set(self.0.take());
    }
}

thread_local! {
    /// This thread's evaluation scratch between samples (see [`Work::with`]).
    static SCRATCH: std::cell::Cell<Option<Work>> = const { std::cell::Cell::new(None) };
}

/// One row drawn uniformly from pool `shape` of a pooled fast sample: the region's durations,
/// `width` of them (every lane, or one time for all).
#[inline]
fn pool_row<'a>(draw: &mut Draw<'a>, shape: u32, width: usize) -> &'a [f64] {
    let Draw::Fast { pools, rng, .. } = draw else {
        unreachable!("pooled programs are drawn by the fast sampler")
    };
    let pools: &'a [Vec<f64>] = pools;
    let pool = &pools[shape as usize];
    let rows = pool.len() / width;
    let u: f64 = rng.random();
    let k = ((u * rows as f64) as usize).min(rows - 1);
    &pool[k * width..(k + 1) * width]
}

/// Where the iteration's last end was produced.
#[derive(Clone, Copy, Debug, Default)]
pub(super) enum Loc {
    /// Nothing ran.
    #[default]
    Start,
    /// Lane `lane` of value `val` of replica `r`'s program.
    Replica { r: usize, val: Val, lane: usize },
    /// Tail op `op` of stage `s`, replica `r`, lane `lane`.
    Tail {
        s: usize,
        op: u32,
        r: usize,
        lane: usize,
    },
}

/// The latest end seen so far and where it was produced (the first on ties).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Latest {
    pub(super) t: f64,
    pub(super) at: Loc,
}

impl Latest {
    #[inline]
    pub(super) fn note(&mut self, e: f64, at: Loc) {
        if e > self.t {
            *self = Latest { t: e, at };
        }
    }
}

/// Splits segment `op` of `st` at its gates and calls `f(waits, mean, var)` for each piece in
/// order: `waits`, the gates (indices into `st.gates_of(op)`) the piece waits for before it
/// starts (none for the first piece), and the sums over its kernels of the nominal time times
/// the jitter group's factor mean (`group`, by the kernels' groups `kgroup`) and of its squared
/// standard deviation.
pub(super) fn for_each_piece(
    st: &StageProg,
    op: u32,
    group: &[(f64, f64)],
    kgroup: &[u32],
    mut f: impl FnMut(std::ops::Range<usize>, f64, f64),
) {
    let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
        unreachable!("segment")
    };
    let gates = st.gates_of(op);
    let (mut waits, mut g) = (0..0, 0);
    let (mut m, mut var) = (0.0, 0.0);
    for k in k0..k1 {
        if g < gates.len() && gates[g].0 == k {
            f(waits, m, var);
            (m, var) = (0.0, 0.0);
            let first = g;
            while g < gates.len() && gates[g].0 == k {
                g += 1;
            }
            waits = first..g;
        }
        let (mu, sigma) = group[kgroup[k as usize] as usize];
        let d = st.kd[k as usize] as f64;
        m += d * mu;
        var += (d * sigma) * (d * sigma);
    }
    f(waits, m, var);
}

impl StepModel {
    /// Evaluates one iteration: every replica's program, then the tail.
    pub(super) fn evaluate(&self, tape: &Tape, draw: &mut Draw, comm_factor: f64) -> f64 {
        self.evaluate_traced(tape, draw, comm_factor, None)
    }

    /// [`StepModel::evaluate`], optionally keeping what the critical-path walk needs.
    pub(super) fn evaluate_traced(
        &self,
        tape: &Tape,
        draw: &mut Draw,
        comm_factor: f64,
        trace: Option<&mut Trace>,
    ) -> f64 {
        let scale = Scale::new(comm_factor, draw);
        let mut work = Work::reuse(self, tape);
        let mut store = self.new_store();
        let mut last = Latest::default();
        for r in 0..self.layout.dp as usize {
            self.replica_to_store(tape, r, draw, scale, &mut work, &mut store, &mut last);
        }
        self.tail(&mut store, draw, scale, &mut last);
        if let Some(t) = trace {
            t.store = store;
            t.last = last.at;
            t.scale = scale;
        }
        last.t * 1e-12
    }

    /// An empty tail store: per stage, `[replica][slot][lane]`.
    pub(super) fn new_store(&self) -> Vec<Vec<f64>> {
        let l = lanes(&self.layout);
        let dp = self.layout.dp as usize;
        (self.stages.iter())
            .map(|st| vec![0.0; dp * st.slots as usize * l])
            .collect()
    }

    /// Evaluates replica `r`, notes its sinks in `last` and saves its boundary ops (what the
    /// tail reads) in `store`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn replica_to_store(
        &self,
        tape: &Tape,
        r: usize,
        draw: &mut Draw,
        scale: Scale,
        work: &mut Work,
        store: &mut [Vec<f64>],
        last: &mut Latest,
    ) {
        let l = lanes(&self.layout);
        self.replica(tape, r, draw, scale, work);
        let vals = &work.vals;
        for v in &tape.sinks {
            let n = v.width(l);
            for lane in 0..n {
                last.note(
                    vals[v.at as usize + lane],
                    Loc::Replica { r, val: *v, lane },
                );
            }
        }
        for (s, st) in self.stages.iter().enumerate() {
            for &op in &st.boundary_ops {
                let v = tape.val[s][op as usize].expect("boundary op evaluated");
                let base = (r * st.slots as usize + st.slot[op as usize] as usize) * l;
                for lane in 0..l {
                    store[s][base + lane] = vals[v.at as usize + if v.lanes { lane } else { 0 }];
                }
            }
        }
    }

    /// The tail: the data-parallel collectives and what follows them, all replicas together,
    /// from the boundary ops in `store` (the tail ops' own slots are overwritten). Draws from
    /// the tail's stream `replica_rng(seed, dp)`, restarted here: two tails of one sample take
    /// the same draws.
    pub(super) fn tail(
        &self,
        store: &mut [Vec<f64>],
        draw: &mut Draw,
        scale: Scale,
        last: &mut Latest,
    ) {
        let l = lanes(&self.layout);
        let (tp, cp) = (self.layout.tp as usize, self.layout.cp as usize);
        let dp = self.layout.dp as usize;
        if let Draw::Fast { seed, rng, .. } = draw {
            *rng = replica_rng(*seed, dp as u64);
        }
        for (s, st) in self.stages.iter().enumerate() {
            let store = &mut store[s];
            for &op in &st.tail_ops {
                let at = |r: usize, lane: usize| st.tail_at(r, op, lane, l);
                // The predecessors' slots, so that a ready time is a few loads.
                let preds: Vec<usize> =
                    st.preds(op).map(|p| st.slot[p as usize] as usize).collect();
                let slots = st.slots as usize;
                let ready = |store: &[f64], r: usize, lane: usize| {
                    (preds.iter())
                        .map(|&p| store[(r * slots + p) * l + lane])
                        .fold(0.0, mx)
                };
                let mut note = |e: f64, r: usize, lane: usize| {
                    last.note(e, Loc::Tail { s, op, r, lane });
                };
                match st.kind[op as usize] {
                    MKind::Dp { d } => {
                        // The group: every replica's lanes of the same TP rank (CP folded in).
                        for head in group_heads(tp, cp, false) {
                            let start = (0..dp)
                                .flat_map(|r| group(tp, cp, false, head).map(move |k| (r, k)))
                                .map(|(r, k)| ready(store, r, k))
                                .fold(0.0, f64::max);
                            for r in 0..dp {
                                for k in group(tp, cp, false, head) {
                                    store[at(r, k)] = start + scale.of(d);
                                }
                            }
                            note(start + scale.of(d), 0, head);
                        }
                    }
                    MKind::Tp { d } | MKind::Cp { d } => {
                        let tp_group = matches!(st.kind[op as usize], MKind::Tp { .. });
                        for r in 0..dp {
                            for head in group_heads(tp, cp, tp_group) {
                                let start = group(tp, cp, tp_group, head)
                                    .map(|k| ready(store, r, k))
                                    .fold(0.0, f64::max);
                                for k in group(tp, cp, tp_group, head) {
                                    store[at(r, k)] = start + scale.of(d);
                                }
                                note(start + scale.of(d), r, head);
                            }
                        }
                    }
                    MKind::Local { d } => {
                        for r in 0..dp {
                            for lane in 0..l {
                                let e = ready(store, r, lane) + scale.of(d);
                                store[at(r, lane)] = e;
                                note(e, r, lane);
                            }
                        }
                    }
                    MKind::Seg { .. } => {
                        for r in 0..dp {
                            for lane in 0..l {
                                let t0 = ready(store, r, lane);
                                let e = self.seg_lane(
                                    st,
                                    s as u32,
                                    r as u32,
                                    lane as u32,
                                    op,
                                    t0,
                                    &[],
                                    draw,
                                );
                                store[at(r, lane)] = e;
                                note(e, r, lane);
                            }
                        }
                    }
                    MKind::Send { .. } | MKind::Recv { .. } => {
                        unreachable!("pipeline messages in the tail are rejected at compile time")
                    }
                }
            }
        }
    }

    /// Evaluates replica `r`'s program into `work.vals`, drawing from the replica's own stream.
    pub(super) fn replica(
        &self,
        tape: &Tape,
        r: usize,
        draw: &mut Draw,
        scale: Scale,
        work: &mut Work,
    ) {
        // The common lane counts as compile-time constants (unrolled lane loops).
        match lanes(&self.layout) {
            1 => self.run_replica::<1>(tape, r, draw, scale, work),
            2 => self.run_replica::<2>(tape, r, draw, scale, work),
            4 => self.run_replica::<4>(tape, r, draw, scale, work),
            8 => self.run_replica::<8>(tape, r, draw, scale, work),
            16 => self.run_replica::<16>(tape, r, draw, scale, work),
            32 => self.run_replica::<32>(tape, r, draw, scale, work),
            _ => self.run_replica::<0>(tape, r, draw, scale, work),
        }
    }

    /// [`StepModel::replica`] with `L` lanes (`L = 0`: the layout's count, not a constant).
    pub(super) fn run_replica<const L: usize>(
        &self,
        tape: &Tape,
        r: usize,
        draw: &mut Draw,
        scale: Scale,
        work: &mut Work,
    ) {
        let l = if L == 0 { lanes(&self.layout) } else { L };
        debug_assert_eq!(l, lanes(&self.layout));
        let tp = self.layout.tp as usize;
        let Work {
            vals,
            ready,
            lane_fs,
            fmax,
            ..
        } = work;
        let ready = &mut ready[..l];
        if let Draw::Fast {
            rank_factor,
            seed,
            rng,
            ..
        } = draw
        {
            *rng = replica_rng(*seed, r as u64);
            if !rank_factor.is_empty() {
                for (i, f) in lane_fs.iter_mut().enumerate() {
                    *f = lane_factor(
                        &self.layout,
                        rank_factor,
                        r as u32,
                        (i / l) as u32,
                        (i % l) as u32,
                    );
                }
                for (s, f) in fmax.iter_mut().enumerate() {
                    *f = lane_fs[s * l..(s + 1) * l].iter().copied().fold(0.0, mx);
                }
            }
        }
        for ins in &tape.ins {
            let inputs = &tape.inputs[ins.i0 as usize..ins.i1 as usize];
            let mut t = 0.0f64;
            if ins.lanes_in {
                ready.fill(0.0);
                for v in inputs {
                    let a = v.at as usize;
                    if v.lanes {
                        for (x, &y) in ready.iter_mut().zip(&vals[a..a + l]) {
                            *x = mx(*x, y);
                        }
                    } else {
                        let y = vals[a];
                        ready.iter_mut().for_each(|x| *x = mx(*x, y));
                    }
                }
            } else {
                for v in inputs {
                    t = mx(t, vals[v.at as usize]);
                }
            }
            let out = ins.out.at as usize;
            match ins.code {
                Code::Tp { d } | Code::Cp { d } => {
                    let d = scale.of(d);
                    if ins.out.lanes {
                        // One start per group: the latest of its lanes.
                        let tp_group = matches!(ins.code, Code::Tp { .. });
                        let cp = l / tp;
                        for head in group_heads(tp, cp, tp_group) {
                            let start = group(tp, cp, tp_group, head)
                                .map(|k| ready[k])
                                .fold(0.0, mx);
                            for k in group(tp, cp, tp_group, head) {
                                vals[out + k] = start + d;
                            }
                        }
                    } else {
                        if ins.lanes_in {
                            t = ready.iter().copied().fold(0.0, mx);
                        }
                        vals[out] = t + d;
                    }
                }
                Code::Add { d } => {
                    let d = scale.of(d);
                    if ins.lanes_in {
                        for (x, &y) in vals[out..out + l].iter_mut().zip(ready.iter()) {
                            *x = y + d;
                        }
                    } else {
                        vals[out] = t + d;
                    }
                }
                Code::Run { s0, s1 } => {
                    let lane_f = &lane_fs[ins.stage as usize * l..(ins.stage as usize + 1) * l];
                    let fmax = fmax[ins.stage as usize];
                    for step in &tape.steps[s0 as usize..s1 as usize] {
                        t += match step.kind {
                            StepKind::Comm { d } => scale.of(d),
                            StepKind::Seg { m, sd } => match draw {
                                Draw::Fast {
                                    table,
                                    rank_factor,
                                    rng,
                                    ..
                                } => {
                                    if sd == 0.0 {
                                        fmax * m
                                    } else if rank_factor.is_empty() {
                                        // Only the slowest of the i.i.d. lanes is observable:
                                        // draw the maximum.
                                        let u: f64 = rng.random();
                                        mx(m + sd * table.quantile(u), 0.0)
                                    } else {
                                        let mut d = 0.0f64;
                                        for &f in lane_f {
                                            let z: f64 = StandardNormal.sample(rng);
                                            d = mx(d, f * (m + sd * z));
                                        }
                                        d
                                    }
                                }
                                _ => m,
                            },
                            StepKind::Pool { shape } => pool_row(draw, shape, 1)[0],
                        };
                        vals[step.out as usize] = t;
                    }
                }
                Code::Pool { shape, o0, o1 } => {
                    let outs = &tape.pool_outs[o0 as usize..o1 as usize];
                    let row = pool_row(draw, shape, row_width(outs, l));
                    let mut k = 0;
                    for v in outs {
                        let (at, w) = (v.at as usize, v.width(l));
                        for (x, &d) in vals[at..at + w].iter_mut().zip(&row[k..k + w]) {
                            *x = t + d;
                        }
                        k += w;
                    }
                }
                Code::Seg { .. } => {
                    let lane_f = &lane_fs[ins.stage as usize * l..(ins.stage as usize + 1) * l];
                    self.eval_seg::<L>(tape, ins, r as u32, t, ready, lane_f, vals, draw);
                }
            }
        }
    }

    /// Evaluates segment instruction `ins` of replica `r`: the input is `t` (one time for every
    /// lane) or `ready` (per lane, when `ins.lanes_in`); writes the end into `vals`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn eval_seg<const L: usize>(
        &self,
        tape: &Tape,
        ins: &Ins,
        r: u32,
        t: f64,
        ready: &mut [f64],
        lane_f: &[f64],
        vals: &mut [f64],
        draw: &mut Draw,
    ) {
        let Code::Seg {
            m,
            sd,
            collapsible,
            g0,
            g1,
            pk,
        } = ins.code
        else {
            unreachable!("segment")
        };
        let l = if L == 0 { ready.len() } else { L };
        let ready = &mut ready[..l];
        let out = ins.out;
        let at = out.at as usize;
        if !ins.lanes_in {
            ready.fill(t);
        }
        // A gate that ends before the segment starts changes nothing.
        let gates = &tape.gates[g0 as usize..g1 as usize];
        let gated = !gates.is_empty() && {
            let rmin = ready.iter().copied().fold(f64::INFINITY, f64::min);
            gates.iter().any(|&(_, g)| vals[g.at as usize] > rmin)
        };
        let per_kernel = gated || pk || matches!(draw, Draw::Exact(_));
        if !per_kernel {
            match draw {
                Draw::Nominal => {
                    if out.lanes {
                        for (x, &y) in vals[at..at + l].iter_mut().zip(ready.iter()) {
                            *x = y + m;
                        }
                    } else {
                        // Collapsible (the latest lane) or every lane alike.
                        vals[at] = ready.iter().copied().fold(0.0, mx) + m;
                    }
                    return;
                }
                Draw::Fast {
                    table,
                    rank_factor,
                    rng,
                    ..
                } => {
                    if rank_factor.is_empty() && !ins.lanes_in && collapsible {
                        // Only the slowest of the i.i.d. lanes is observable: draw the maximum.
                        let dur = if sd > 0.0 {
                            let u: f64 = rng.random();
                            m + sd * table.quantile(u)
                        } else {
                            m
                        };
                        vals[at] = t + mx(dur, 0.0);
                        return;
                    }
                    if !out.lanes && !collapsible {
                        // Every lane alike and no jitter.
                        vals[at] = t + m;
                        return;
                    }
                    // Lanes in chunks: the draws first, then the arithmetic (a loop without
                    // the sampler's branches; the same draws in the same order).
                    const CHUNK: usize = 16;
                    let mut z = [0.0f64; CHUNK];
                    for (c, xs) in ready.chunks_mut(CHUNK).enumerate() {
                        let z = &mut z[..xs.len()];
                        let fs = (!rank_factor.is_empty())
                            .then(|| &lane_f[c * CHUNK..c * CHUNK + xs.len()]);
                        if sd > 0.0 {
                            for z in z.iter_mut() {
                                *z = StandardNormal.sample(rng);
                            }
                            match fs {
                                Some(fs) => {
                                    for ((x, &z), &f) in xs.iter_mut().zip(z.iter()).zip(fs) {
                                        *x += mx(f * (m + sd * z), 0.0);
                                    }
                                }
                                None => {
                                    for (x, &z) in xs.iter_mut().zip(z.iter()) {
                                        *x += mx(m + sd * z, 0.0);
                                    }
                                }
                            }
                        } else {
                            match fs {
                                Some(fs) => {
                                    for (x, &f) in xs.iter_mut().zip(fs) {
                                        *x += f * m;
                                    }
                                }
                                None => xs.iter_mut().for_each(|x| *x += m),
                            }
                        }
                    }
                    if out.lanes {
                        vals[at..at + l].copy_from_slice(ready);
                    } else {
                        vals[at] = ready.iter().copied().fold(0.0, mx);
                    }
                    return;
                }
                Draw::Exact(_) => unreachable!("per kernel"),
            }
        }
        let gate_end: Vec<f64> = gates.iter().map(|&(_, g)| vals[g.at as usize]).collect();
        let st = &self.stages[ins.stage as usize];
        let mut max_end = 0.0f64;
        for (lane, x) in ready.iter_mut().enumerate() {
            *x = self.seg_lane(st, ins.stage, r, lane as u32, ins.op, *x, &gate_end, draw);
            max_end = mx(max_end, *x);
        }
        if out.lanes {
            vals[at..at + l].copy_from_slice(ready);
        } else {
            // Collapsible, or every lane alike.
            vals[at] = max_end;
        }
    }

    /// End of segment `op` on one lane started at `start`, kernel by kernel: each kernel waits
    /// for its gate (`gate_end`, by position in `st.gates_of(op)`) and takes its own draw. With
    /// the fast sampler and normal jitter the kernels between two gates take one draw, of their
    /// sum (itself normal).
    #[allow(clippy::too_many_arguments)]
    #[inline(never)] // The rare path: kept out of the replica loop's registers.
    pub(super) fn seg_lane(
        &self,
        st: &StageProg,
        stage: u32,
        replica: u32,
        lane: u32,
        op: u32,
        start: f64,
        gate_end: &[f64],
        draw: &mut Draw,
    ) -> f64 {
        let MKind::Seg { k0, k1, .. } = st.kind[op as usize] else {
            unreachable!("segment")
        };
        let gates = st.gates_of(op);
        let mut g = 0;
        let mut t = start;
        let rank = lane_rank(&self.layout, replica, stage, lane);
        if let Draw::Fast {
            group,
            kgroup,
            pk,
            rank_factor,
            rng,
            ..
        } = draw
            && !pk[stage as usize][op as usize]
        {
            let f = if rank_factor.is_empty() {
                1.0
            } else {
                rank_factor[rank as usize]
            };
            let mut piece = |m: f64, var: f64| {
                if var > 0.0 {
                    let z: f64 = StandardNormal.sample(rng);
                    mx(f * (m + var.sqrt() * z), 0.0)
                } else {
                    f * m
                }
            };
            for_each_piece(st, op, group, &kgroup[stage as usize], |waits, m, var| {
                for &e in &gate_end[waits] {
                    t = mx(t, e);
                }
                t += piece(m, var);
            });
            return t;
        }
        for k in k0..k1 {
            while g < gates.len() && gates[g].0 == k {
                t = t.max(gate_end[g]);
                g += 1;
            }
            let d = st.kd[k as usize];
            t += match draw {
                Draw::Nominal => d as f64,
                Draw::Exact(p) => {
                    let f = p.kernel_factor(
                        rank,
                        st.kop[k as usize],
                        st.kclass[k as usize],
                        st.kname[k as usize],
                    );
                    (d as f64 * f).round().max(1.0)
                }
                Draw::Fast {
                    group,
                    kgroup,
                    kernel,
                    rank_factor,
                    rng,
                    ..
                } => {
                    let c = kgroup[stage as usize][k as usize] as usize;
                    let jf = match &kernel[c] {
                        Some(kd) => kd.draw(rng),
                        None => {
                            let (mu, sigma) = group[c];
                            if sigma > 0.0 {
                                let z: f64 = StandardNormal.sample(rng);
                                mu + sigma * z
                            } else {
                                mu
                            }
                        }
                    };
                    let f = if rank_factor.is_empty() {
                        1.0
                    } else {
                        rank_factor[rank as usize]
                    };
                    (f * d as f64 * jf).max(0.0)
                }
            };
        }
        t
    }
}
