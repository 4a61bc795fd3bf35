//! Execution graph: for every rank, the ordered operations on each of its streams and the
//! dependencies between them, for one training iteration.
//!
//! Ranks that do identical work share one [`Program`]: every rank of a pipeline stage runs the
//! same kernels, the same collectives (matched by order within their group) and the same sends
//! (matched by mailbox slot at the receiver). So a 16,384-GPU Llama 3 405B job with 16 stages is
//! 16 programs of a few thousand ops each, not 10^8 ops.
//!
//! Representation: struct-of-arrays indexed by `u32` op ids, dependencies in CSR form, per-stream
//! op lists. Within a stream ops run in order; `deps` only name ops on *other* streams.
//!
//! What one program contains, per micro-batch and model chunk, following Megatron-LM:
//! - forward: [recv activation] or embedding; per layer: norm, (SP all-gather), QKV GEMM,
//!   (CP all-gather of K/V), flash attention, out-projection GEMM, (TP all-reduce or SP
//!   reduce-scatter), residual, norm, (all-gather), MLP GEMMs and activation, or for MoE the
//!   router, token permutation, all-to-all dispatch, (reorder by local expert), expert GEMMs,
//!   the reverse around the all-to-all combine; (all-reduce/reduce-scatter),
//!   residual; then [send activation] or final norm, LM head, loss.
//! - backward: the reverse, with data-gradient and weight-gradient GEMMs; TP communication of
//!   the input gradient overlaps the weight-gradient GEMM (and with SP the input all-gather for
//!   the weight gradient overlaps the data-gradient GEMM), as Megatron does.
//! - recompute: `full` re-runs each layer's forward before its backward, `selective` re-runs the
//!   attention core; both are marked so HFU counts them and MFU does not.
//! - data parallel: after the last micro-batch's backward of the layers in a gradient bucket,
//!   a reduce-scatter (distributed optimizer) or all-reduce on the DP stream, overlapping the
//!   rest of backward; then the optimizer step and, with the distributed optimizer, the
//!   parameter all-gather.
//! - schedules: GPipe, 1F1B and interleaved 1F1B (Megatron's ordering).

use std::collections::BTreeMap;

use crate::arch::{LocalAttention, WindowKind};
use crate::cost::comm::Collective;
use crate::job::{
    Activation, CpCommType, Job, PipelineP2p, Precision, Recompute, Schedule, Zero3Sync,
};
use crate::layout::{GroupKind, Layout};
use crate::ops::{ComputeOp, OpClass, Work};
use crate::schedules::PipeStep;

/// A stream of a rank: ops on one stream run one after another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Stream {
    /// Kernels.
    Compute = 0,
    /// Tensor-parallel collectives.
    Tp = 1,
    /// Context-parallel collectives.
    Cp = 2,
    /// Expert-parallel all-to-alls.
    Ep = 3,
    /// Pipeline sends.
    PpSend = 4,
    /// Pipeline receives (waits for a message).
    PpRecv = 5,
    /// Data-parallel gradient and parameter collectives.
    Dp = 6,
}

/// Number of streams per rank.
pub const NUM_STREAMS: usize = 7;

/// All streams in index order.
pub const STREAMS: [Stream; NUM_STREAMS] = [
    Stream::Compute,
    Stream::Tp,
    Stream::Cp,
    Stream::Ep,
    Stream::PpSend,
    Stream::PpRecv,
    Stream::Dp,
];

impl Stream {
    /// Name used for trace threads.
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Tp => "tp comm",
            Stream::Cp => "cp comm",
            Stream::Ep => "ep comm",
            Stream::PpSend => "pp send",
            Stream::PpRecv => "pp recv",
            Stream::Dp => "dp comm",
        }
    }

    fn for_group(kind: GroupKind) -> Stream {
        match kind {
            GroupKind::Tp => Stream::Tp,
            GroupKind::Cp => Stream::Cp,
            GroupKind::Ep => Stream::Ep,
            GroupKind::Dp | GroupKind::Edp => Stream::Dp,
        }
    }
}

/// What an op does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OpKind {
    /// A kernel.
    Compute(ComputeOp),
    /// A collective over the rank's group of `group`; `bytes` as [`Collective`] defines them.
    Collective {
        /// Group kind.
        group: GroupKind,
        /// Operation.
        op: Collective,
        /// Buffer size.
        bytes: u64,
    },
    /// Send `bytes` to the rank `delta` stages away (wrapping for interleaved chunks);
    /// delivered into mailbox `slot` of the receiver.
    Send {
        /// +1 next stage, -1 previous stage.
        delta: i8,
        /// Message size.
        bytes: u64,
        /// Receiver's mailbox slot.
        slot: u32,
    },
    /// Wait until mailbox `slot` holds a message.
    Recv {
        /// Own mailbox slot.
        slot: u32,
    },
}

/// Phase of the iteration an op belongs to (trace naming and breakdowns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Recomputed forward inside backward.
    Recompute,
    /// Gradient reduction, optimizer step, parameter gather.
    Optimizer,
    /// Deferred weight gradients of a split backward (zero bubble:
    /// [`crate::schedules::PipeStep::Weight`]); a whole backward's weight gradients are
    /// [`Phase::Backward`].
    Weight,
}

/// Where an op sits in the iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpTag {
    /// Phase.
    pub phase: Phase,
    /// Micro-batch, or `u32::MAX` for per-iteration work.
    pub micro_batch: u32,
    /// Global layer index, or `u32::MAX` for non-layer work.
    pub layer: u32,
}

/// No micro-batch / no layer.
pub const NONE: u32 = u32::MAX;

/// The ops one class of ranks (one pipeline stage) runs in an iteration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    /// Op kinds, by op id.
    pub kind: Vec<OpKind>,
    /// Stream of each op.
    pub stream: Vec<Stream>,
    /// Position of each op within its stream.
    pub pos: Vec<u32>,
    /// Tags, by op id.
    pub tag: Vec<OpTag>,
    /// CSR offsets into `deps` (length ops + 1).
    pub dep_off: Vec<u32>,
    /// Cross-stream dependencies.
    pub deps: Vec<u32>,
    /// Op ids of each stream, in order.
    pub stream_ops: [Vec<u32>; NUM_STREAMS],
    /// Mailbox slots (receives) of this program.
    pub recv_slots: u32,
    /// True for ops that some op on another stream depends on.
    pub has_dependents: Vec<bool>,
    /// Bit `s` set when an op on stream `s` depends on this op.
    pub dependent_streams: Vec<u8>,
}

impl Program {
    /// Number of ops.
    pub fn len(&self) -> usize {
        self.kind.len()
    }

    /// True when the program has no ops.
    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }

    /// Dependencies of `op`.
    pub fn deps_of(&self, op: u32) -> &[u32] {
        &self.deps[self.dep_off[op as usize] as usize..self.dep_off[op as usize + 1] as usize]
    }

    /// Appends an op on `stream` after `deps` (only cross-stream dependencies are kept: a
    /// stream runs its ops in order).
    pub(crate) fn push(&mut self, kind: OpKind, stream: Stream, tag: OpTag, deps: &[u32]) -> u32 {
        let id = self.kind.len() as u32;
        if self.dep_off.is_empty() {
            self.dep_off.push(0);
        }
        self.kind.push(kind);
        self.stream.push(stream);
        self.pos.push(self.stream_ops[stream as usize].len() as u32);
        self.stream_ops[stream as usize].push(id);
        self.tag.push(tag);
        self.has_dependents.push(false);
        self.dependent_streams.push(0);
        for &d in deps {
            if self.stream[d as usize] != stream
                && !self.deps[self.dep_off[id as usize] as usize..].contains(&d)
            {
                self.deps.push(d);
                self.has_dependents[d as usize] = true;
                self.dependent_streams[d as usize] |= 1 << stream as u8;
            }
        }
        self.dep_off.push(self.deps.len() as u32);
        id
    }
}

/// The execution graph of a job: one program per pipeline stage, plus the layout that maps ranks
/// to programs and groups.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecutionGraph {
    /// Rank layout.
    pub layout: Layout,
    /// One program per pipeline stage.
    pub programs: Vec<Program>,
    /// Network bytes of each expert-parallel all-to-all relative to exchanging every routed
    /// copy: below 1 under group-limited routing ([`crate::arch::Arch::node_limited_nic_scale`]),
    /// the rest forwarded over NVLink; 1 otherwise.
    pub ep_nic_scale: f64,
}

impl ExecutionGraph {
    /// The names of the compute ops (kernels) of every stage, sorted.
    pub fn kernel_names(&self) -> std::collections::BTreeSet<&'static str> {
        (self.programs.iter())
            .flat_map(|p| p.kind.iter())
            .filter_map(|k| match k {
                OpKind::Compute(c) => Some(c.name),
                _ => None,
            })
            .collect()
    }

    /// The program `rank` runs.
    pub fn program_of(&self, rank: u32) -> &Program {
        &self.programs[self.layout.coord(rank).pp as usize]
    }

    /// Builds the graph of a validated job.
    /// Ops in every stage program together.
    pub fn total_ops(&self) -> u64 {
        self.programs.iter().map(|p| p.len() as u64).sum()
    }

    /// The op count [`ExecutionGraph::build`] would give `job` (every stage program together),
    /// without building it: a program grows by the same ops with each micro-batch (each
    /// micro-batch's forward and backward emit a fixed set of ops, whatever the order), so two
    /// small builds (`u` and `2u` micro-batches, `u = pp` for the interleaved schedule, else 1)
    /// give the line. Exact for the schedules Prism builds; a small job is simply built and
    /// counted.
    pub fn estimate_ops(job: &Job) -> u64 {
        let m = job.micro_batches();
        let unit = match job.parallel.schedule {
            crate::job::Schedule::Interleaved => job.parallel.pp as u64,
            crate::job::Schedule::OneFOneBOverlap if job.parallel.vpp > 1 => job.parallel.pp as u64,
            // DualPipe needs at least 2 pp micro-batches (and an even count).
            crate::job::Schedule::DualPipe => 2 * job.parallel.pp as u64,
            _ => 1,
        };
        // Every run of the schedule (`pipeline_rounds`) needs a whole unit.
        let unit = unit * job.parallel.pipeline_rounds.max(1) as u64;
        let (m1, m2) = (unit, 2 * unit);
        let with_micro_batches = |mb: u64| -> Option<u64> {
            let per = job.parallel.dp as u64 * job.parallel.micro_batch as u64;
            let mut j = job.clone();
            j.training.global_batch = u32::try_from(mb.checked_mul(per)?).ok()?;
            Some(Self::build(&j).total_ops())
        };
        if m > m2
            && let (Some(c1), Some(c2)) = (with_micro_batches(m1), with_micro_batches(m2))
        {
            let slope = c2.saturating_sub(c1) / (m2 - m1);
            return c1.saturating_add(slope.saturating_mul(m - m1));
        }
        Self::build(job).total_ops()
    }

    /// A lower bound of [`ExecutionGraph::estimate_ops`] that costs nothing: every layer of
    /// every micro-batch emits at least [`MIN_OPS_PER_LAYER`] ops (forward and backward).
    pub fn min_ops(job: &Job) -> u64 {
        job.micro_batches()
            .saturating_mul(job.model.layers as u64)
            .saturating_mul(MIN_OPS_PER_LAYER)
    }

    pub fn build(job: &Job) -> Self {
        let layout = Layout::new(job);
        let p = job.parallel.pp;
        let mut builders: Vec<StageBuilder> = (0..p).map(|s| StageBuilder::new(job, s)).collect();
        for b in &mut builders {
            b.build();
        }
        // Assign receive slots per stage in program order, then point sends at them.
        let mut slot_of: BTreeMap<(u32, MsgTag), u32> = BTreeMap::new();
        for b in &mut builders {
            let mut next = 0u32;
            for &(op, tag) in &b.recvs {
                slot_of.insert((b.stage, tag), next);
                b.prog.kind[op as usize] = OpKind::Recv { slot: next };
                next += 1;
            }
            b.prog.recv_slots = next;
        }
        for b in &mut builders {
            for &(op, target_stage, tag) in &b.sends {
                let slot = *slot_of.get(&(target_stage, tag)).unwrap_or_else(|| {
                    panic!("send {tag:?} from stage {} has no receiver", b.stage)
                });
                if let OpKind::Send { slot: s, .. } = &mut b.prog.kind[op as usize] {
                    *s = slot;
                }
            }
        }
        let ep_nic_scale = match &job.model.moe {
            Some(moe) if job.parallel.ep > 1 => {
                let s = crate::engine::group_shape(&layout, GroupKind::Ep, 0);
                let dedup = job.parallel.moe_dispatcher == crate::job::MoeDispatcher::DeepEp;
                (job.model.arch)
                    .node_limited_nic_scale(moe.top_k, s.nodes, s.ranks, s.per_node, dedup)
            }
            _ => 1.0,
        };
        ExecutionGraph {
            layout,
            programs: builders.into_iter().map(|b| b.prog).collect(),
            ep_nic_scale,
        }
    }
}

/// Bytes of the two kinds of token permutation around one MoE layer's experts
/// (`StageBuilder::moe_permute_bytes`).
#[derive(Clone, Copy, Debug)]
struct MoePermuteBytes {
    source: u64,
    receive: u64,
    /// DeepEP's receive-side passes are its permutations (there is no source-side one).
    deepep: bool,
}

impl MoePermuteBytes {
    /// The name of a receive-side pass: the alltoall dispatcher's chunk reorder (`sort`) or
    /// DeepEP's permutation (`permute`).
    fn receive_name(&self, sort: &'static str, permute: &'static str) -> &'static str {
        if self.deepep { permute } else { sort }
    }
}

/// Identifies a pipeline message: direction, micro-batch and the receiving model chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct MsgTag {
    backward: bool,
    micro_batch: u32,
    chunk: u32,
}

/// The most ops one job's graph may hold, every stage program together. Measured peak memory
/// is about 110 bytes per op in `simulate` and 400 in `predict` (graph, engine and step model),
/// so a job at the limit stays near 3 GB. The largest validation case (Megatron's 1T model,
/// 1,120 micro-batches over 35 stages) holds 6.8 million. Past it, `simulate` refuses the job
/// ([`size_check`]).
pub const MAX_OPS: u64 = 7_000_000;

/// Ops every layer of every micro-batch emits at least (forward and backward), whatever the
/// parallel settings: the bound [`ExecutionGraph::min_ops`] uses (checked by a test).
pub const MIN_OPS_PER_LAYER: u64 = 10;

/// Refuses a job whose graph would hold more than [`MAX_OPS`] ops, naming the keys that drive
/// its size.
pub fn size_check(job: &Job) -> Result<(), String> {
    // The free lower bound first, so that a huge job is refused before any build.
    let ops = match ExecutionGraph::min_ops(job) {
        lb if lb > MAX_OPS => lb,
        _ => ExecutionGraph::estimate_ops(job),
    };
    if ops <= MAX_OPS {
        return Ok(());
    }
    let p = &job.parallel;
    Err(format!(
        "the execution graph would hold about {ops} ops, more than the limit of {MAX_OPS}: \
         {} micro-batches per pipeline (training.global_batch {} / (parallel.dp {} x \
         parallel.micro_batch {})) x {} layers per stage (model.layers {} / parallel.pp {}); \
         raise parallel.micro_batch or parallel.dp, or lower training.global_batch",
        job.micro_batches(),
        job.training.global_batch,
        p.dp,
        p.micro_batch,
        job.model.layers.div_ceil(p.pp),
        job.model.layers,
        p.pp
    ))
}

/// One step of a pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Forward (true) or backward.
    pub forward: bool,
    /// Micro-batch.
    pub micro_batch: u32,
    /// Model chunk on this rank (0 unless interleaved).
    pub chunk: u32,
}

/// The order in which pipeline stage `stage` of `p` runs forward and backward steps of `m`
/// micro-batches over `v` model chunks (Megatron-LM's schedules).
pub fn schedule(kind: Schedule, stage: u32, p: u32, m: u32, v: u32) -> Vec<Step> {
    let total = m * v;
    let mut out = Vec::with_capacity(2 * total as usize);
    if let Some(steps) = crate::schedules::pipe_steps(kind, stage, p, m, v) {
        // The overlapping schedules, each overlapped pair as its forward then its backward.
        for st in steps {
            let (f, b) = match st {
                PipeStep::Forward(mb, c) => (Some((mb, c)), None),
                PipeStep::Backward(mb, c) | PipeStep::BackwardInput(mb, c) => (None, Some((mb, c))),
                PipeStep::ForwardBackward(f, b) => (Some(f), Some(b)),
                // A deferred weight gradient is no step of its own here.
                PipeStep::Weight(..) => (None, None),
            };
            for (forward, x) in [(true, f), (false, b)] {
                if let Some((micro_batch, chunk)) = x {
                    out.push(Step {
                        forward,
                        micro_batch,
                        chunk,
                    });
                }
            }
        }
        return out;
    }
    match kind {
        Schedule::GPipe => {
            out.extend((0..m).map(|i| Step {
                forward: true,
                micro_batch: i,
                chunk: 0,
            }));
            out.extend((0..m).map(|i| Step {
                forward: false,
                micro_batch: i,
                chunk: 0,
            }));
        }
        Schedule::DualPipe | Schedule::OneFOneBOverlap => unreachable!("handled above"),
        Schedule::OneFOneB | Schedule::Interleaved => {
            use crate::schedules::{one_f_one_b_order, one_f_one_b_warmup};
            let step = |k: u32, forward: bool| {
                let (micro_batch, chunk) = one_f_one_b_order(k, p, v, forward);
                Step {
                    forward,
                    micro_batch,
                    chunk,
                }
            };
            let warmup = one_f_one_b_warmup(stage, p, v).min(total);
            for k in 0..warmup {
                out.push(step(k, true));
            }
            for j in 0..total - warmup {
                out.push(step(warmup + j, true));
                out.push(step(j, false));
            }
            for j in total - warmup..total {
                out.push(step(j, false));
            }
        }
    }
    out
}

const ACT_BYTES: u64 = 2; // bf16 activations
/// Splits of a GEMM whose reduce-scatter Transformer Engine's userbuffers `pipeline` method
/// overlaps (`num_splits = 4`, the `initialize_ub` default).
const UB_PIPELINE_SPLITS: u64 = 4;
const GRAD_BYTES: u64 = 4; // fp32 gradient reduction (Megatron accumulates and reduces in fp32 for bf16)
const PARAM_BYTES: u64 = 2; // bf16 parameters gathered by the distributed optimizer

struct StageBuilder<'a> {
    job: &'a Job,
    stage: u32,
    prog: Program,
    /// (recv op, tag) in program order.
    recvs: Vec<(u32, MsgTag)>,
    /// (send op, target stage, tag).
    sends: Vec<(u32, u32, MsgTag)>,
    /// Global layer range of each local chunk.
    chunk_layers: Vec<std::ops::Range<u32>>,
    /// Last op of the final backward of each local layer (grad ready), by global layer.
    grad_ready: BTreeMap<u32, u32>,
    lm_head_grad_ready: Option<u32>,
    /// The last per-micro-batch gradient reduce-scatter (sharded gradients, ZeRO-2 and 3):
    /// the optimizer step waits for it.
    last_micro_batch_reduce: Option<u32>,
    embedding_grad_ready: Option<u32>,
    /// Sends the next compute op waits for (blocking pipeline messages: plain 1F1B and
    /// GPipe, and the interleaved schedule with [`PipelineP2p::Blocking`]).
    blocking: Vec<u32>,
    /// [`PipelineP2p::SteadyState`]: the last forward's sends, which the next forward waits
    /// for, and the last backward's, which the next backward waits for.
    forward_sends: Vec<u32>,
    backward_sends: Vec<u32>,
    /// Gradient / parameter buckets of this stage.
    buckets: Vec<Bucket>,
    /// The last compute op of every backward step, in schedule order, and the index there of
    /// each chunk's last micro-batch (Megatron-Core's aligned gradient reduction).
    backward_ends: Vec<u32>,
    chunk_last_backward: BTreeMap<u32, usize>,
    /// Parameter all-gather each layer's forward waits for (overlapped param gather).
    param_ready: BTreeMap<u32, u32>,
    embedding_param_ready: Option<u32>,
    lm_head_param_ready: Option<u32>,
    /// ZeRO-3: the gather the next layer computation (forward, recompute or backward) waits
    /// for; taken by that layer's first op.
    zero3_ready: Option<u32>,
    /// Zero-bubble split: the weight-gradient ops of the backward being built are recorded
    /// in `pending_w` instead of emitted.
    defer_w: bool,
    pending_w: Vec<DeferredW>,
    /// An overlapped pair's backward receive, posted before its forward: (tag, recv op).
    pre_recv: Option<(MsgTag, u32)>,
    /// The op the next compute op waits for besides its own inputs (an overlapped pair's
    /// backward receive, for the pair's first kernel).
    pair_gate: Option<u32>,
    /// While an overlapped pair is built: its sends, (delta, tag, op tag, output op), held
    /// until the pair is done.
    held_sends: Option<Vec<HeldSend>>,
    /// An op every send waits for besides its output (an overlapped pair's last kernel).
    send_after: Option<u32>,
    /// Recorded weight-gradient ops of each split backward, by (micro-batch, chunk), until
    /// its [`PipeStep::Weight`] emits them.
    deferred_w: BTreeMap<(u32, u32), Vec<DeferredW>>,
}

/// A send held back while an overlapped pair is built: (delta, message, op tag, output op).
type HeldSend = (i8, MsgTag, OpTag, Option<u32>);

/// A weight-gradient op of a split backward, recorded by its input-gradient step and
/// emitted by its weight step.
#[derive(Clone, Debug)]
enum DeferredW {
    /// A compute op (a weight-gradient GEMM, or a recomputation only it needs).
    Compute {
        name: &'static str,
        class: OpClass,
        work: Work,
        tag: OpTag,
        deps: Vec<u32>,
    },
    /// A weight-gradient GEMM whose sequence-parallel input is all-gathered over TP first
    /// (`bytes` gathered once `input` exists).
    Gathered {
        name: &'static str,
        work: Work,
        tag: OpTag,
        bytes: u64,
        input: u32,
    },
}

/// Sizes every op of one layer needs, per rank.
struct Dims {
    /// Tokens per rank (micro_batch x seq_len / cp).
    t: u64,
    /// Tokens in sequence-parallel regions (t / tp with SP).
    t_sp: u64,
    h: u64,
    tp: u64,
    q_local: u64,
    kv_local: u64,
    ffn_local: u64,
    sp: bool,
    /// Attention output width per rank (the output projection's input): `q_local` unless MLA.
    o_local: u64,
}

impl<'a> StageBuilder<'a> {
    fn new(job: &'a Job, stage: u32) -> Self {
        let chunk_layers = job.chunk_layers(stage);
        StageBuilder {
            job,
            stage,
            prog: Program::default(),
            recvs: Vec::new(),
            sends: Vec::new(),
            chunk_layers,
            grad_ready: BTreeMap::new(),
            lm_head_grad_ready: None,
            last_micro_batch_reduce: None,
            embedding_grad_ready: None,
            blocking: Vec::new(),
            forward_sends: Vec::new(),
            backward_sends: Vec::new(),
            buckets: Vec::new(),
            backward_ends: Vec::new(),
            chunk_last_backward: BTreeMap::new(),
            param_ready: BTreeMap::new(),
            embedding_param_ready: None,
            lm_head_param_ready: None,
            zero3_ready: None,
            defer_w: false,
            pending_w: Vec::new(),
            pre_recv: None,
            pair_gate: None,
            held_sends: None,
            send_after: None,
            deferred_w: BTreeMap::new(),
        }
    }

    fn dims(&self) -> Dims {
        let j = self.job;
        let par = &j.parallel;
        let m = &j.model;
        let t = par.micro_batch as u64 * m.seq_len as u64 / par.cp as u64;
        let tp = par.tp as u64;
        let sp = par.splits_sequence();
        Dims {
            t,
            t_sp: if sp { t / tp } else { t },
            h: m.hidden as u64,
            tp,
            q_local: m.heads as u64 / tp * m.head_dim as u64,
            kv_local: m.kv_heads as u64 / tp * m.head_dim as u64,
            ffn_local: m.ffn_hidden as u64 / tp,
            sp,
            o_local: m.o_width() / tp,
        }
    }

    fn is_first_chunk(&self, chunk: u32) -> bool {
        if self.dualpipe() {
            // Forward direction enters at rank 0, the reverse at the last rank.
            return (self.stage == 0 && chunk == 0)
                || (self.stage == self.job.parallel.pp - 1 && chunk == 1);
        }
        self.stage == 0 && chunk == 0
    }

    fn is_last_chunk(&self, chunk: u32) -> bool {
        if self.dualpipe() {
            return (self.stage == self.job.parallel.pp - 1 && chunk == 0)
                || (self.stage == 0 && chunk == 1);
        }
        self.stage == self.job.parallel.pp - 1 && chunk == self.job.parallel.vpp - 1
    }

    fn dualpipe(&self) -> bool {
        self.job.parallel.schedule == Schedule::DualPipe
    }

    /// True when micro-batch `mb`'s backward of `chunk` is that chunk's last of the iteration.
    fn is_last_backward(&self, mb: u32, chunk: u32, m: u32) -> bool {
        if self.dualpipe() {
            // Direction `chunk` runs micro-batches chunk x m/2 .. (chunk + 1) x m/2.
            return mb == (chunk + 1) * (m / 2) - 1;
        }
        mb == m - 1
    }

    fn build(&mut self) {
        let j = self.job;
        let par = &j.parallel;
        // `m` covers the whole iteration (the last backward triggers the gradient sync); each
        // of the `pipeline_rounds` runs of the schedule covers `mr` of them, numbered on.
        let m = j.micro_batches() as u32;
        let rounds = par.pipeline_rounds.max(1);
        let mr = m / rounds;
        self.buckets = self.plan_buckets();
        self.param_gather_at_start();
        for round in 0..rounds {
            let off = round * mr;
            if let Some(steps) =
                crate::schedules::pipe_steps(par.schedule, self.stage, par.pp, mr, par.vpp)
            {
                for st in steps {
                    self.pipe_step(st.shifted(off), m);
                }
            } else {
                // Megatron's blocking interleaved steady state exchanges once after each
                // forward and its paired backward. With every forward in the warm-up
                // (Megatron's `all_warmup_microbatches`) nothing pairs: each forward sends at
                // once.
                let pairs = par.schedule == Schedule::Interleaved
                    && par.pipeline_p2p == PipelineP2p::Blocking
                    && crate::schedules::one_f_one_b_warmup(self.stage, par.pp, par.vpp)
                        < mr * par.vpp;
                let mut steps = schedule(par.schedule, self.stage, par.pp, mr, par.vpp)
                    .into_iter()
                    .peekable();
                while let Some(step) = steps.next() {
                    if !step.forward {
                        self.backward_step(step.micro_batch + off, step.chunk, m);
                    } else if let Some(b) = steps.next_if(|b| pairs && !b.forward) {
                        self.held_sends = Some(Vec::new());
                        self.forward_step(step.micro_batch + off, step.chunk, m);
                        self.backward_step(b.micro_batch + off, b.chunk, m);
                        self.release_held_sends();
                    } else {
                        self.forward_step(step.micro_batch + off, step.chunk, m);
                    }
                }
            }
        }
        // Megatron's cool-down sends block (`wait_on_reqs`): the optimizer step waits for the
        // last backward's; a forward's unawaited handles are left to complete.
        let last = std::mem::take(&mut self.backward_sends);
        self.blocking.extend(last);
        self.forward_sends.clear();
        self.optimizer();
    }

    /// One step of an overlapping schedule (DualPipe, 1F1B with EP overlap).
    fn pipe_step(&mut self, st: PipeStep, m: u32) {
        match st {
            PipeStep::Forward(mb, c) => self.forward_step(mb, c, m),
            PipeStep::Backward(mb, c) => self.backward_step(mb, c, m),
            PipeStep::BackwardInput(mb, c) => self.backward_input_step(mb, c, m),
            PipeStep::Weight(mb, c) => self.weight_step(mb, c, m),
            PipeStep::ForwardBackward(f, b) => {
                // As the reference's `_forward_backward_chunk`, the pair's compute starts once
                // both chunks' inputs are received: the backward's receive is posted first and
                // gates the forward's first kernel. Its sends are issued once the pair's
                // compute is done (they are committed with the next chunk's transfers).
                self.pair_gate = self.pre_recv_gradient(b.0, b.1);
                self.held_sends = Some(Vec::new());
                let start = self.prog.len() as u32;
                self.forward_step(f.0, f.1, m);
                let mid = self.prog.len() as u32;
                self.backward_step(b.0, b.1, m);
                self.interleave(start, mid);
                self.release_held_sends();
            }
        }
    }

    /// Issues the sends held while a pair of chunks was built, after the pair's last kernel.
    fn release_held_sends(&mut self) {
        let held = self.held_sends.take().unwrap_or_default();
        self.send_after = self.prog.stream_ops[Stream::Compute as usize]
            .last()
            .copied();
        for (delta, tag, optag, cur) in held {
            self.send(delta, tag, optag, cur);
        }
        self.send_after = None;
    }

    /// How the computation waits for this job's pipeline sends: plain 1F1B and GPipe block
    /// (Megatron turns the overlap off without interleaving), the interleaved schedule as
    /// `parallel.pipeline_p2p` says, and the overlapping schedules (DualPipe, 1F1B with EP
    /// overlap) hold their sends back themselves and never wait for them.
    fn message_waits(&self) -> PipelineP2p {
        match self.job.parallel.schedule {
            Schedule::OneFOneB | Schedule::GPipe => PipelineP2p::Blocking,
            Schedule::Interleaved => self.job.parallel.pipeline_p2p,
            Schedule::DualPipe | Schedule::OneFOneBOverlap => PipelineP2p::Async,
        }
    }

    /// Overlaps the ops `start..mid` (a forward chunk) with `mid..` (a backward chunk, built
    /// after it): each is cut into segments before every compute op that waits for one of its
    /// own communication ops, and the segments alternate (forward first). Every stream then
    /// runs its ops of the two chunks in that merged order, a topological order of both (they
    /// share no dependency), so no stream can wait on another in a cycle.
    fn interleave(&mut self, start: u32, mid: u32) {
        let end = self.prog.len() as u32;
        let segments = |prog: &Program, lo: u32, hi: u32| -> Vec<std::ops::Range<u32>> {
            let mut cuts = vec![lo];
            for op in lo + 1..hi {
                if prog.stream[op as usize] == Stream::Compute
                    && prog
                        .deps_of(op)
                        .iter()
                        .any(|&d| d >= lo && d < hi && prog.stream[d as usize] != Stream::Compute)
                {
                    cuts.push(op);
                }
            }
            cuts.push(hi);
            cuts.windows(2).map(|w| w[0]..w[1]).collect()
        };
        let f = segments(&self.prog, start, mid);
        let b = segments(&self.prog, mid, end);
        let mut rank = vec![0u32; (end - start) as usize];
        let mut next = 0u32;
        for i in 0..f.len().max(b.len()) {
            for seg in [f.get(i), b.get(i)].into_iter().flatten() {
                for op in seg.clone() {
                    rank[(op - start) as usize] = next;
                    next += 1;
                }
            }
        }
        let prog = &mut self.prog;
        for s in 0..NUM_STREAMS {
            let list = &mut prog.stream_ops[s];
            let k = list.partition_point(|&op| op < start);
            list[k..].sort_by_key(|&op| rank[(op - start) as usize]);
            for (i, &op) in list.iter().enumerate().skip(k) {
                prog.pos[op as usize] = i as u32;
            }
        }
    }

    fn tag(phase: Phase, mb: u32, layer: u32) -> OpTag {
        OpTag {
            phase,
            micro_batch: mb,
            layer,
        }
    }

    fn compute(
        &mut self,
        name: &'static str,
        class: OpClass,
        work: Work,
        tag: OpTag,
        deps: &[u32],
    ) -> u32 {
        let mut deps = self.with_blocking(deps);
        deps.extend(self.pair_gate.take());
        let recompute = tag.phase == Phase::Recompute;
        self.prog.push(
            OpKind::Compute(ComputeOp {
                name,
                class,
                work,
                recompute,
                sm_margin: false,
            }),
            Stream::Compute,
            tag,
            &deps,
        )
    }

    /// A GEMM that runs beside a userbuffers communication kernel holding SMs for its whole
    /// duration ([`ComputeOp::sm_margin`]) when `beside_ub`, else a plain [`Self::compute`].
    fn gemm_beside_ub(
        &mut self,
        name: &'static str,
        work: Work,
        tag: OpTag,
        deps: &[u32],
        beside_ub: bool,
    ) -> u32 {
        let id = self.compute(name, OpClass::Gemm, work, tag, deps);
        if let OpKind::Compute(op) = &mut self.prog.kind[id as usize] {
            op.sm_margin = beside_ub;
        }
        id
    }

    /// `deps` and the sends the next kernel must wait for (`blocking`), which it takes.
    fn with_blocking(&mut self, deps: &[u32]) -> Vec<u32> {
        let mut v = deps.to_vec();
        v.append(&mut self.blocking);
        v
    }

    fn collective(
        &mut self,
        group: GroupKind,
        op: Collective,
        bytes: u64,
        tag: OpTag,
        deps: &[u32],
    ) -> Option<u32> {
        if self.job_group_size(group) <= 1 || bytes == 0 {
            return None;
        }
        let kind = OpKind::Collective { group, op, bytes };
        Some(self.prog.push(kind, Stream::for_group(group), tag, deps))
    }

    fn job_group_size(&self, group: GroupKind) -> u32 {
        let p = &self.job.parallel;
        match group {
            GroupKind::Tp => p.tp,
            GroupKind::Cp => p.cp,
            GroupKind::Ep => p.ep,
            GroupKind::Dp => p.dp * p.cp,
            GroupKind::Edp => p.dp / p.ep * p.cp,
        }
    }

    /// DeepSeek-V3's FP8 activation cache: MoE activation outputs are recomputed in backward.
    fn fp8_act_cache(&self) -> bool {
        self.job.training.memory_saving.activation_cache == crate::job::ActivationCache::Fp8
    }

    fn mem(bytes: u64) -> Work {
        Work::Memory { bytes }
    }

    fn gemm(m: u64, n: u64, k: u64) -> Work {
        Work::Gemm { m, n, k, batch: 1 }
    }

    fn forward_step(&mut self, mb: u32, chunk: u32, m: u32) {
        // Megatron-Core's overlapped interleaved schedule waits for the previous forward's
        // messages before this forward's first kernel.
        let waits = std::mem::take(&mut self.forward_sends);
        self.blocking.extend(waits);
        let d = self.dims();
        let tag = Self::tag(Phase::Forward, mb, NONE);
        let mut cur: Option<u32>;
        if self.is_first_chunk(chunk) {
            // Vocab-parallel embedding lookup, then TP reduction (all-reduce, or reduce-scatter with SP).
            let e = self.compute(
                "embedding_fwd",
                OpClass::Embedding,
                Self::mem(2 * d.t * d.h * ACT_BYTES),
                tag,
                &[],
            );
            cur = Some(e);
            let op = if d.sp {
                Collective::ReduceScatter
            } else {
                Collective::AllReduce
            };
            if let Some(c) = self.collective(GroupKind::Tp, op, d.t * d.h * ACT_BYTES, tag, &[e]) {
                cur = Some(c);
            }
        } else {
            let r = self.recv(
                MsgTag {
                    backward: false,
                    micro_batch: mb,
                    chunk,
                },
                tag,
            );
            cur = Some(r);
        }
        let layers: Vec<u32> = self.chunk_layers[chunk as usize].clone().collect();
        let mut gathers = Zero3Gathers::default();
        // Parameters kept since the sync span's first forward need no gather.
        let gather =
            self.job.parallel.reshard_after_forward || self.zero3_span_ends(mb, chunk, m).0;
        for (i, &layer) in layers.iter().enumerate() {
            if gather {
                self.zero3_prefetch(&mut gathers, &layers, i, tag, cur);
            }
            cur = Some(self.layer_forward(mb, layer, cur, Phase::Forward));
        }
        if self.is_last_chunk(chunk) {
            self.lm_head_forward(mb, cur);
            if self.job.mtp_standalone() {
                // The MTP modules ran upstream; their hidden states came with this input.
                for _ in 0..self.job.model.arch.mtp_depth {
                    self.lm_head_forward(mb, cur);
                }
            } else {
                self.mtp_forward(mb, cur);
            }
        } else {
            if self.runs_standalone_mtp(chunk) {
                cur = Some(self.mtp_modules_forward(mb, cur));
            }
            self.send_activation(mb, chunk, cur);
        }
    }

    /// True when `chunk` of this rank is the virtual stage that runs the multi-token-prediction
    /// modules ahead of the loss stage ([`Job::mtp_standalone`]).
    fn runs_standalone_mtp(&self, chunk: u32) -> bool {
        self.job.mtp_standalone()
            && chunk * self.job.parallel.pp + self.stage == self.job.mtp_virtual_stage()
    }

    /// How many hidden states one pipeline message of `tag` to rank `target` carries: `1 +
    /// mtp_depth` between a standalone MTP stage and the loss stage (Megatron-Core concatenates
    /// the MTP modules' outputs to the main one), else 1.
    fn message_states(&self, target: u32, tag: MsgTag) -> u64 {
        if !self.job.mtp_standalone() || self.dualpipe() {
            return 1;
        }
        let receiver = tag.chunk * self.job.parallel.pp + target;
        let ms = self.job.mtp_virtual_stage();
        // Forward: into a stage after the MTP stage; backward: into the MTP stage or later.
        let carries = if tag.backward {
            receiver >= ms
        } else {
            receiver > ms
        };
        if carries {
            1 + self.job.model.arch.mtp_depth as u64
        } else {
            1
        }
    }

    /// One multi-token-prediction module's forward (depth `k`): the projection of the
    /// concatenated hidden state and next-token embedding (`[t x 2h] x [2h x h]`, row-parallel
    /// over TP) and one transformer layer (global index `layers + k`, the last layer's kind).
    /// Returns the layer's output.
    fn mtp_module_forward(&mut self, mb: u32, k: u32, input: Option<u32>) -> u32 {
        let layers = self.job.model.layers;
        let d = self.dims();
        let tag = Self::tag(Phase::Forward, mb, layers + k);
        let proj = self.reduced_gemm(
            "mtp_proj_fwd",
            Self::gemm(d.t, d.h, 2 * d.h / d.tp),
            tag,
            &Self::deps(input),
        );
        let p = proj[0];
        self.layer_forward(mb, layers + k, Some(p), Phase::Forward)
    }

    /// Every MTP module's forward on a standalone MTP stage, each feeding the next; returns the
    /// deepest module's output (the message to the loss stage follows it).
    fn mtp_modules_forward(&mut self, mb: u32, input: Option<u32>) -> u32 {
        let mut cur = input;
        for k in 0..self.job.model.arch.mtp_depth {
            cur = Some(self.mtp_module_forward(mb, k, cur));
        }
        cur.expect("a standalone MTP stage follows a layer or receive")
    }

    /// Multi-token-prediction modules (DeepSeek-V3 Sec. 2.2) on the last stage, after the main
    /// LM head: per depth `d`, the projection of the concatenated hidden state and next-token
    /// embedding (`[t x 2h] x [2h x h]`, row-parallel over TP), one transformer layer (global
    /// index `layers + d`, the last layer's kind) and the shared output head with its loss.
    fn mtp_forward(&mut self, mb: u32, input: Option<u32>) {
        let mut cur = input;
        for k in 0..self.job.model.arch.mtp_depth {
            let out = self.mtp_module_forward(mb, k, cur);
            self.lm_head_forward(mb, Some(out));
            cur = Some(out);
        }
    }

    /// Backward of the multi-token-prediction modules, deepest first (each: head, layer,
    /// projection).
    fn mtp_backward(&mut self, mb: u32, last_mb: bool) {
        for k in (0..self.job.model.arch.mtp_depth).rev() {
            let head = self.lm_head_backward(mb, false);
            self.mtp_module_backward(mb, k, head, last_mb);
        }
    }

    /// What the job's recompute mode replays of layer `layer`'s forward before its backward
    /// (`input`: the op the backward starts from): the whole layer under full recompute,
    /// torchtitan's unsaved ops under per-op checkpointing, nothing otherwise (selective
    /// recompute rebuilds the attention core inside the layer's backward).
    fn recompute_before_backward(&mut self, mb: u32, layer: u32, input: Option<u32>) {
        match self.job.parallel.recompute {
            Recompute::Full => {
                self.layer_forward(mb, layer, input, Phase::Recompute);
            }
            Recompute::SelectiveOp => self.selective_op_recompute(mb, layer, input),
            Recompute::None | Recompute::Selective => {}
        }
    }

    /// torchtitan's per-op selective checkpointing ([`Recompute::SelectiveOp`]): before layer
    /// `layer`'s backward, the forward ops whose outputs its backward needs and the policy did
    /// not save run again, in forward order: the first norm, the K projection (its input
    /// gathered again with SP), the output projection when no reduce-scatter follows it (with
    /// its all-reduce without SP), the residual, the second norm, a SwiGLU's up projection and
    /// the activation function; an FP8 job casts their inputs (and, without the cache or FP8
    /// gathers, their weights) again.
    fn selective_op_recompute(&mut self, mb: u32, layer: u32, input: Option<u32>) {
        let d = self.dims();
        let swiglu = self.job.model.activation == Activation::SwiGlu;
        let tag = Self::tag(Phase::Recompute, mb, layer);
        let n1 = self.compute(
            "norm1_recompute",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &Self::deps(input),
        );
        let k = self.gathered_gemm(
            "k_recompute",
            Self::gemm(d.t, d.kv_local, d.h),
            tag,
            n1,
            d.sp,
        );
        // With SP (`d.sp`: TP > 1) a reduce-scatter, whose output is saved, follows the
        // output projection.
        let scattered = d.sp;
        let proj = if scattered {
            k
        } else {
            self.reduced_gemm(
                "out_proj_recompute",
                Self::gemm(d.t, d.h, d.o_local),
                tag,
                &k,
            )
        };
        let res1 = self.compute(
            "residual1_recompute",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &proj,
        );
        let n2 = self.compute(
            "norm2_recompute",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[res1],
        );
        let mut cur = if swiglu {
            self.gathered_gemm(
                "fc1_up_recompute",
                Self::gemm(d.t, d.ffn_local, d.h),
                tag,
                n2,
                d.sp,
            )
        } else {
            vec![n2]
        };
        let act_in = if swiglu { 2 * d.ffn_local } else { d.ffn_local };
        let act = self.compute(
            "act_recompute",
            OpClass::Elementwise,
            Self::mem((act_in + d.ffn_local) * d.t * ACT_BYTES),
            tag,
            &cur,
        );
        cur = vec![act];
        if self.job.training.precision == Precision::Fp8 {
            // The recomputed GEMMs' inputs are cast to FP8 again (read BF16, write FP8), and
            // their weights where neither the cache nor FP8 gathers keep them in FP8.
            let up = if swiglu { d.ffn_local } else { 0 };
            let o = if scattered { 0 } else { d.o_local };
            let mut bytes = 3 * d.t * (d.h + o + if swiglu { d.h } else { 0 });
            let par = &self.job.parallel;
            if !self.job.training.fp8_weight_cache && !par.fp8_param_gather {
                bytes += 3 * d.h * (d.kv_local + o + up);
            }
            self.compute(
                "fp8_cast_recompute",
                OpClass::Elementwise,
                Self::mem(bytes),
                tag,
                &cur,
            );
        }
    }

    /// One MTP module's backward (depth `k`) from the gradient op `grad`: its layer (recomputed
    /// first under full recompute), then the projection. Returns the projection's input
    /// gradient.
    fn mtp_module_backward(&mut self, mb: u32, k: u32, grad: u32, last_mb: bool) -> u32 {
        let layer = self.job.model.layers + k;
        let d = self.dims();
        let tag = Self::tag(Phase::Backward, mb, layer);
        self.recompute_before_backward(mb, layer, Some(grad));
        let (g, wg) = self.layer_backward(mb, layer, Some(grad));
        if last_mb {
            self.mark_grad_ready(layer, wg);
        }
        let (dg, proj_wg) = self.linear_backward_in(
            ("mtp_proj_dgrad", "mtp_proj_wgrad"),
            Self::gemm(d.t, 2 * d.h / d.tp, d.h),
            Self::gemm(2 * d.h / d.tp, d.h, d.t),
            tag,
            g,
            d.t * d.h * ACT_BYTES,
        );
        if last_mb {
            // The projection's weight gradient belongs to the module's bucket too.
            self.mark_grad_ready(layer, proj_wg);
        }
        dg
    }

    fn deps(cur: Option<u32>) -> Vec<u32> {
        cur.into_iter().collect()
    }

    fn recv(&mut self, tag: MsgTag, optag: OpTag) -> u32 {
        let op = self
            .prog
            .push(OpKind::Recv { slot: u32::MAX }, Stream::PpRecv, optag, &[]);
        self.recvs.push((op, tag));
        op
    }

    fn send(&mut self, delta: i8, tag: MsgTag, optag: OpTag, cur: Option<u32>) {
        if let Some(held) = self.held_sends.as_mut() {
            held.push((delta, tag, optag, cur));
            return;
        }
        let d = self.dims();
        let p = self.job.parallel.pp;
        let target = ((self.stage + p) as i64 + delta as i64) as u32 % p;
        // Activations (or their gradients) of one micro-batch: [t_sp x h] per rank with SP,
        // [t x h] without (Megatron's scatter-gather optimisation sends 1/tp of it and
        // all-gathers over NVLink; we model the SP-sharded size, which is what crosses the NIC).
        let split = if self.job.parallel.pp_scatter_gather {
            d.tp.max(1)
        } else {
            1
        };
        let bytes = d.t / split * d.h * ACT_BYTES;
        let bytes = if d.sp {
            d.t_sp * d.h * ACT_BYTES
        } else {
            bytes
        } * self.message_states(target, tag);
        let op = self.prog.push(
            OpKind::Send {
                delta,
                bytes,
                slot: u32::MAX,
            },
            Stream::PpSend,
            optag,
            &Self::deps(cur)
                .into_iter()
                .chain(self.send_after)
                .collect::<Vec<_>>(),
        );
        self.sends.push((op, target, tag));
        // Blocking: the next kernel waits for it; Megatron-Core's overlap: the next step of
        // the same direction does.
        match self.message_waits() {
            PipelineP2p::Blocking => self.blocking.push(op),
            PipelineP2p::SteadyState if tag.backward => self.backward_sends.push(op),
            PipelineP2p::SteadyState => self.forward_sends.push(op),
            PipelineP2p::Async => {}
        }
    }

    fn send_activation(&mut self, mb: u32, chunk: u32, cur: Option<u32>) {
        let p = self.job.parallel.pp;
        if self.dualpipe() {
            // Each direction stays in its chunk: forward to the next rank, reverse to the
            // previous one.
            let tag = MsgTag {
                backward: false,
                micro_batch: mb,
                chunk,
            };
            let delta = if chunk == 0 { 1 } else { -1 };
            self.send(delta, tag, Self::tag(Phase::Forward, mb, NONE), cur);
            return;
        }
        let next_chunk = if self.stage == p - 1 {
            chunk + 1
        } else {
            chunk
        };
        let tag = MsgTag {
            backward: false,
            micro_batch: mb,
            chunk: next_chunk,
        };
        self.send(1, tag, Self::tag(Phase::Forward, mb, NONE), cur);
    }

    fn send_gradient(&mut self, mb: u32, chunk: u32, cur: Option<u32>) {
        if self.dualpipe() {
            let tag = MsgTag {
                backward: true,
                micro_batch: mb,
                chunk,
            };
            let delta = if chunk == 0 { -1 } else { 1 };
            self.send(delta, tag, Self::tag(Phase::Backward, mb, NONE), cur);
            return;
        }
        let prev_chunk = if self.stage == 0 { chunk - 1 } else { chunk };
        let tag = MsgTag {
            backward: true,
            micro_batch: mb,
            chunk: prev_chunk,
        };
        self.send(-1, tag, Self::tag(Phase::Backward, mb, NONE), cur);
    }

    /// True when TP all-gathers / reduce-scatters run concurrently with their GEMMs.
    fn tp_overlap(&self) -> bool {
        self.job.parallel.tp_comm_overlap && self.dims().sp
    }

    /// A GEMM fed by a TP all-gather of `input` (SP). Without overlap the GEMM waits for the
    /// gather; with `tp_comm_overlap` the two run together and the returned "done" list holds
    /// both, for the next op to wait on.
    fn gathered_gemm(
        &mut self,
        name: &'static str,
        work: Work,
        tag: OpTag,
        input: u32,
        gather: bool,
    ) -> Vec<u32> {
        let act = self.dims().t * self.dims().h * self.tp_gather_bytes();
        let ag = if gather {
            self.collective(GroupKind::Tp, Collective::AllGather, act, tag, &[input])
        } else {
            None
        };
        if self.tp_overlap() {
            let g = self.compute(name, OpClass::Gemm, work, tag, &[input]);
            std::iter::once(g).chain(ag).collect()
        } else {
            vec![self.compute(name, OpClass::Gemm, work, tag, &[ag.unwrap_or(input)])]
        }
    }

    /// Bytes per element of the sequence-parallel all-gathers into a transformer layer's
    /// GEMMs: the norm outputs gathered for the column-parallel GEMMs (forward and, again, for
    /// their weight gradients) and the output gradients gathered for the row-parallel GEMMs'
    /// backward. An FP8 job gathers them in FP8: Transformer Engine's norm kernels emit FP8
    /// and the gather moves that tensor, and backward casts the output gradient to FP8 before
    /// gathering it (`gather_along_first_dim` in TE 1.x; a quantized all-gather in 2.x). The
    /// reduce-scatters of GEMM outputs stay BF16.
    fn tp_gather_bytes(&self) -> u64 {
        if self.job.training.precision == Precision::Fp8 {
            1
        } else {
            ACT_BYTES
        }
    }

    /// A GEMM whose output is reduced over TP (reduce-scatter with SP, all-reduce without).
    ///
    /// With `tp_comm_overlap` the reduce-scatter is pipelined with the GEMM as Transformer
    /// Engine's userbuffers `pipeline` method runs it: the GEMM is split in
    /// [`UB_PIPELINE_SPLITS`] along its rows and launched beside the communication kernel's SMs
    /// ([`ComputeOp::sm_margin`]); each split's reduce-scatter overlaps the next split's GEMM,
    /// so all but the last split's share of the bytes moves under the GEMM and the last split's
    /// reduce-scatter follows it.
    fn reduced_gemm(
        &mut self,
        name: &'static str,
        work: Work,
        tag: OpTag,
        input: &[u32],
    ) -> Vec<u32> {
        let d = self.dims();
        let act = d.t * d.h * ACT_BYTES;
        let op = if d.sp {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        if self.tp_overlap() {
            let tail = act / UB_PIPELINE_SPLITS;
            let body = self.collective(GroupKind::Tp, op, act - tail, tag, input);
            let g = self.gemm_beside_ub(name, work, tag, input, true);
            let mut deps = vec![g];
            deps.extend(body);
            let last = self.collective(GroupKind::Tp, op, tail, tag, &deps);
            deps.extend(last);
            deps
        } else {
            let g = self.compute(name, OpClass::Gemm, work, tag, input);
            let r = if d.tp > 1 {
                self.collective(GroupKind::Tp, op, act, tag, &[g])
            } else {
                None
            };
            vec![r.unwrap_or(g)]
        }
    }

    /// Bytes of one dropout mask over `elems` elements (1 byte each), 0 without dropout.
    fn mask_bytes(&self, elems: u64) -> u64 {
        if self.job.model.dropout { elems } else { 0 }
    }

    /// Forward of one transformer layer; returns the op producing its output.
    fn layer_forward(&mut self, mb: u32, layer: u32, input: Option<u32>, phase: Phase) -> u32 {
        let d = self.dims();
        let m = &self.job.model;
        let tag = Self::tag(phase, mb, layer);
        let mut deps = Self::deps(input);
        if phase == Phase::Forward {
            deps.extend(self.param_ready.get(&layer).copied());
        }
        deps.extend(self.zero3_ready.take());
        // Host-side framework time of the layer, then the attention block.
        let fw = self.compute(
            "framework_fwd",
            OpClass::Framework,
            Self::mem(0),
            tag,
            &deps,
        );
        let n1 = self.compute(
            "norm1_fwd",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[fw],
        );
        let qkv = if self.job.model.arch.mla.is_some() {
            self.mla_forward(tag, n1)
        } else {
            self.gathered_gemm(
                "qkv_fwd",
                Self::gemm(d.t, d.q_local + 2 * d.kv_local, d.h),
                tag,
                n1,
                d.sp,
            )
        };
        let mut cur = qkv.clone();
        if self.cp_gathers(layer) {
            let kv_bytes = self.sequence_kv_bytes();
            if let Some(c) =
                self.collective(GroupKind::Cp, Collective::AllGather, kv_bytes, tag, &cur)
            {
                cur = vec![c];
            }
        }
        let attn = self.attention_forward(tag, &cur, false);
        let proj = self.reduced_gemm(
            "out_proj_fwd",
            Self::gemm(d.t, d.h, d.o_local),
            tag,
            &[attn],
        );
        let res1 = self.compute(
            "residual1_fwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES + self.mask_bytes(d.t_sp * d.h)),
            tag,
            &proj,
        );
        let n2 = self.compute(
            "norm2_fwd",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[res1],
        );
        let mut cur = vec![n2];
        // MLP block.
        if let Some(moe) = &self.job.model.moe
            && m.is_moe_layer(layer)
        {
            let ep = self.job.parallel.ep as u64;
            let local_experts = moe.experts as u64 / ep;
            let pairs = self.routed_pairs(d.t_sp, moe.top_k);
            let per_expert = (pairs * ep).div_ceil(moe.experts as u64);
            let fe = moe.ffn_hidden as u64;
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * fe
            } else {
                fe
            };
            let router = self.compute(
                "router_fwd",
                OpClass::Router,
                Self::gemm(d.t_sp, moe.experts as u64, d.h),
                tag,
                &cur,
            );
            let a2a_bytes = pairs * d.h * ACT_BYTES;
            let perm = self.moe_permute_bytes(d.t_sp, moe.top_k, pairs);
            let permuted = self.optional_pass("moe_permute_fwd", perm.source, tag, router);
            let c = self
                .collective(
                    GroupKind::Ep,
                    Collective::AllToAll,
                    a2a_bytes,
                    tag,
                    &[permuted],
                )
                .unwrap_or(permuted);
            let c = self.optional_pass(
                perm.receive_name("moe_sort_fwd", "moe_permute_fwd"),
                perm.receive,
                tag,
                c,
            );
            let batch = local_experts;
            self.compute(
                "expert_fc1_fwd",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: n_fc1,
                    k: d.h,
                    batch,
                },
                tag,
                &[c],
            );
            let bias = self.unfused_expert_bias();
            if let Some(b) = bias {
                self.compute(
                    "expert_fc1_bias_fwd",
                    OpClass::Elementwise,
                    Self::mem(b.fc1_fwd * pairs * n_fc1),
                    tag,
                    &[],
                );
            }
            self.compute(
                "expert_act_fwd",
                OpClass::Elementwise,
                Self::mem(3 * pairs * fe * ACT_BYTES),
                tag,
                &[],
            );
            let mut fc2 = self.compute(
                "expert_fc2_fwd",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: d.h,
                    k: fe,
                    batch,
                },
                tag,
                &[],
            );
            if let Some(b) = bias {
                fc2 = self.compute(
                    "expert_fc2_bias_fwd",
                    OpClass::Elementwise,
                    Self::mem(b.fc2_fwd * pairs * d.h),
                    tag,
                    &[],
                );
            }
            let fc2 = self.optional_pass(
                perm.receive_name("moe_unsort_fwd", "moe_unpermute_fwd"),
                perm.receive,
                tag,
                fc2,
            );
            let combined = self
                .collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[fc2])
                .unwrap_or(fc2);
            // Shared experts: a tensor-parallel gated MLP on every token, run while the
            // combine all-to-all is in flight (issued before the un-permutation, which waits
            // for the combine).
            let shared = if m.arch.moe_shared_ffn_hidden > 0 {
                self.shared_expert_forward(tag, n2, fc2)
            } else {
                Vec::new()
            };
            cur = vec![self.optional_pass("moe_unpermute_fwd", perm.source, tag, combined)];
            cur.extend(shared);
        } else {
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * d.ffn_local
            } else {
                d.ffn_local
            };
            let fc1 = self.gathered_gemm("fc1_fwd", Self::gemm(d.t, n_fc1, d.h), tag, n2, d.sp);
            let act = self.compute(
                "act_fwd",
                OpClass::Elementwise,
                Self::mem((n_fc1 + d.ffn_local) * d.t * ACT_BYTES),
                tag,
                &fc1,
            );
            cur = self.reduced_gemm("fc2_fwd", Self::gemm(d.t, d.h, d.ffn_local), tag, &[act]);
        }
        if self.job.training.precision == Precision::Fp8 {
            // The inputs of the out-projection and FC2 GEMMs are cast (LayerNorm and activation
            // kernels emit FP8 themselves), and the weights as the cache allows.
            let bytes =
                self.fp8_weight_cast_bytes(layer, tag) + 3 * d.t * (d.o_local + d.ffn_local);
            let c = self.compute(
                "fp8_cast_fwd",
                OpClass::Elementwise,
                Self::mem(bytes),
                tag,
                &cur,
            );
            cur = vec![c];
        }
        self.compute(
            "residual2_fwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES + self.mask_bytes(d.t_sp * d.h)),
            tag,
            &cur,
        )
    }

    /// Weights of layer `layer` held by this rank.
    fn layer_weights_local(&self, layer: u32) -> u64 {
        let (dense, expert) = self.layer_param_split(layer);
        dense + expert
    }

    /// Bytes the FP8 cast kernels of the pass `tag` move for `layer`'s weights. With the
    /// weight cache (Transformer Engine under Megatron-Core, `Training::fp8_weight_cache`) the
    /// weights are cast and transposed together (read BF16, write FP8 twice) on the forward
    /// of the micro-batch that opens the iteration and kept for every other pass; without it
    /// they are cast (read BF16, write FP8) in every forward, recomputed forward included, and
    /// again, transposed, in every backward.
    ///
    /// With FP8 gathers (`fp8_param_gather`) the weights arrive in FP8: each rank casts only
    /// its shard (read BF16, write FP8: 3 bytes per shard element) before the gather, and the
    /// gathered weight is transposed for the backward (read and write FP8: 2 bytes per
    /// element), once per iteration with the cache.
    fn fp8_weight_cast_bytes(&self, layer: u32, tag: OpTag) -> u64 {
        let weights = self.layer_weights_local(layer);
        let par = &self.job.parallel;
        if par.fp8_param_gather {
            let shards = (par.dp * par.cp) as u64;
            let cache = self.job.training.fp8_weight_cache;
            return match tag.phase {
                Phase::Forward if !cache || tag.micro_batch == 0 => {
                    3 * weights.div_ceil(shards) + if cache { 2 * weights } else { 0 }
                }
                Phase::Backward if !cache => 2 * weights,
                _ => 0,
            };
        }
        if !self.job.training.fp8_weight_cache {
            3 * weights
        } else if tag.phase == Phase::Forward && tag.micro_batch == 0 {
            4 * weights
        } else {
            0
        }
    }

    /// Attention core forward: one fused (flash) kernel, or Megatron's unfused sequence of
    /// batched score GEMM, fused scale-mask-softmax, dropout and context GEMM. Returns its last op.
    fn attention_forward(&mut self, tag: OpTag, deps: &[u32], recompute_core: bool) -> u32 {
        let tag = if recompute_core {
            OpTag {
                phase: Phase::Recompute,
                ..tag
            }
        } else {
            tag
        };
        if self.job.training.flash_attention {
            let name = if recompute_core {
                "attention_recompute"
            } else {
                "attention_fwd"
            };
            if self.cp_ring(tag.layer) {
                return self.ring_attention(name, tag, deps, false);
            }
            if self.cp_a2a() {
                return self.a2a_attention(name, tag, deps, false);
            }
            return self.compute(
                name,
                OpClass::Attention,
                self.attention_work(false, tag.layer),
                tag,
                deps,
            );
        }
        let u = self.unfused();
        let scores = self.compute(
            "attn_scores_fwd",
            OpClass::Gemm,
            Work::Gemm {
                m: u.sq,
                n: u.skv,
                k: u.dh,
                batch: u.bh,
            },
            tag,
            deps,
        );
        let _ = scores;
        self.compute(
            "softmax_fwd",
            OpClass::Softmax,
            Self::mem(2 * u.scores * ACT_BYTES),
            tag,
            &[],
        );
        let mut last = None;
        if self.job.model.dropout {
            last = Some(self.compute(
                "attn_dropout_fwd",
                OpClass::Elementwise,
                Self::mem(2 * u.scores * ACT_BYTES + u.scores),
                tag,
                &[],
            ));
        }
        if recompute_core {
            // Selective recompute re-creates the probabilities; the context GEMM is not redone.
            return last.unwrap_or(scores);
        }
        self.compute(
            "attn_context_fwd",
            OpClass::Gemm,
            Work::Gemm {
                m: u.sq,
                n: u.dh,
                k: u.skv,
                batch: u.bh,
            },
            tag,
            &[],
        )
    }

    /// Attention core backward (fused flash backward, or the unfused kernels' gradients).
    fn attention_backward(&mut self, tag: OpTag, deps: &[u32]) -> u32 {
        if self.job.training.flash_attention {
            if self.cp_ring(tag.layer) {
                return self.ring_attention("attention_bwd", tag, deps, true);
            }
            if self.cp_a2a() {
                return self.a2a_attention("attention_bwd", tag, deps, true);
            }
            return self.compute(
                "attention_bwd",
                OpClass::Attention,
                self.attention_work(true, tag.layer),
                tag,
                deps,
            );
        }
        let u = self.unfused();
        // dP = dO V^T and dV = P^T dO.
        self.compute(
            "attn_context_dgrad",
            OpClass::Gemm,
            Work::Gemm {
                m: u.sq,
                n: u.skv,
                k: u.dh,
                batch: u.bh,
            },
            tag,
            deps,
        );
        self.compute(
            "attn_context_wgrad",
            OpClass::Gemm,
            Work::Gemm {
                m: u.skv,
                n: u.dh,
                k: u.sq,
                batch: u.bh,
            },
            tag,
            &[],
        );
        if self.job.model.dropout {
            self.compute(
                "attn_dropout_bwd",
                OpClass::Elementwise,
                Self::mem(2 * u.scores * ACT_BYTES + u.scores),
                tag,
                &[],
            );
        }
        self.compute(
            "softmax_bwd",
            OpClass::Softmax,
            Self::mem(3 * u.scores * ACT_BYTES),
            tag,
            &[],
        );
        // dQ = dS K and dK = dS^T Q.
        self.compute(
            "attn_scores_dgrad",
            OpClass::Gemm,
            Work::Gemm {
                m: u.sq,
                n: u.dh,
                k: u.skv,
                batch: u.bh,
            },
            tag,
            &[],
        );
        self.compute(
            "attn_scores_wgrad",
            OpClass::Gemm,
            Work::Gemm {
                m: u.skv,
                n: u.dh,
                k: u.sq,
                batch: u.bh,
            },
            tag,
            &[],
        )
    }

    /// Whether `layer`'s attention runs as Transformer Engine's ring over the context-parallel
    /// group ([`CpCommType::P2p`]): fused attention over the whole sequence. Layers with a
    /// local window, and unfused attention, gather the keys and values instead.
    fn cp_ring(&self, layer: u32) -> bool {
        let p = &self.job.parallel;
        p.cp > 1
            && p.cp_comm_type == CpCommType::P2p
            && self.job.training.flash_attention
            && self.job.model.local_attention(layer).is_none()
    }

    /// Whether attention runs as Transformer Engine's all-to-all form ([`CpCommType::A2a`]):
    /// every layer, local windows included, since each rank then holds the whole sequence.
    fn cp_a2a(&self) -> bool {
        let p = &self.job.parallel;
        p.cp > 1 && p.cp_comm_type == CpCommType::A2a && self.job.training.flash_attention
    }

    /// Whether `layer` gathers the whole sequence's keys and values before its attention and
    /// reduce-scatters their gradients after it (context parallelism in neither the ring nor
    /// the all-to-all form).
    fn cp_gathers(&self, layer: u32) -> bool {
        self.job.parallel.cp > 1 && !self.cp_ring(layer) && !self.cp_a2a()
    }

    /// Keys and values of the whole sequence of a micro-batch on this rank's heads: what the
    /// gathered form of context parallelism collects, and `cp` times what a ring step passes on.
    fn sequence_kv_bytes(&self) -> u64 {
        self.job.parallel.micro_batch as u64
            * self.job.model.seq_len as u64
            * 2
            * self.dims().kv_local
            * ACT_BYTES
    }

    /// Ring attention ([`CpCommType::P2p`]), forward (`backward == false`, also the recomputed
    /// forward) or backward, as Transformer Engine's `AttnFuncWithCPAndKVP2P` runs it: `cp`
    /// steps, each an attention kernel on the keys and values the rank holds (step 0 the causal
    /// diagonal of its own two chunks, `2c x 2c`; every later step one unmasked `2c x c` block,
    /// `c = seq_len / (2 cp)`) beside a ring exchange that passes them on to the next rank.
    /// Double buffering makes the exchange started at step `i` wait for step `i - 1`'s kernel
    /// and step `i + 1`'s kernel wait for that exchange, so a step costs the longer of the
    /// two. In backward the key and value gradients travel with the keys and values (twice the
    /// bytes; the first step sends no gradients and the last only the gradients, home to their
    /// owner). The per-step outputs (forward) or query, key and value gradients (backward) are
    /// merged by elementwise kernels. Returns the op the next one waits for.
    fn ring_attention(
        &mut self,
        name: &'static str,
        tag: OpTag,
        deps: &[u32],
        backward: bool,
    ) -> u32 {
        let d = self.dims();
        let m = &self.job.model;
        let p = &self.job.parallel;
        let cp = p.cp as u64;
        let mb = p.micro_batch as u64;
        let s = m.seq_len as u64;
        let heads = m.heads as u64 / p.tp as u64;
        let head_dim = m.core_head_dim();
        let kv = self.sequence_kv_bytes() / cp;
        let step_work = |first: bool| Work::Attention {
            batch: mb,
            heads,
            seq_q: s / cp,
            seq_kv: if first { s / cp } else { s / (2 * cp) },
            head_dim,
            causal: first,
            window: 0,
            backward,
        };
        // The exchange that delivered this step's keys (none before the first step), and the
        // previous step's kernel. After the loop `held` is backward's last exchange, the one
        // that brings the key and value gradients home (forward's last step sends nothing).
        let mut held: Option<u32> = None;
        let mut prev: Option<u32> = None;
        for i in 0..cp {
            let bytes = match (backward, i) {
                (false, i) if i + 1 < cp => kv,
                (false, _) => 0,
                (true, 0) => kv,
                (true, i) if i + 1 < cp => 2 * kv,
                (true, _) => kv,
            };
            let ready: Vec<u32> = match held {
                Some(x) => vec![x],
                None => deps.to_vec(),
            };
            let xdeps: Vec<u32> = ready.iter().copied().chain(prev).collect();
            // A collective of no bytes is no op: forward's last step sends nothing.
            let x = self.collective(GroupKind::Cp, Collective::RingExchange, bytes, tag, &xdeps);
            prev = Some(self.compute(name, OpClass::Attention, step_work(i == 0), tag, &ready));
            held = x;
        }
        // Merging, in the activations' 16-bit type as Transformer Engine does it: forward,
        // every step's output is rescaled into the output (read both, write it back); backward,
        // every step's query gradients and the travelling key and value gradients are added
        // likewise.
        let t = mb * (s / cp);
        let merged = if backward {
            t * (d.q_local + 2 * d.kv_local)
        } else {
            t * d.q_local
        };
        let mdeps: Vec<u32> = prev.into_iter().chain(held).collect();
        self.compute(
            if backward {
                "cp_merge_bwd"
            } else {
                "cp_merge_fwd"
            },
            OpClass::Elementwise,
            Self::mem(cp * merged * 3 * ACT_BYTES),
            tag,
            &mdeps,
        )
    }

    /// Attention in the all-to-all form ([`CpCommType::A2a`]), forward (`backward == false`,
    /// also the recomputed forward) or backward, as Transformer Engine's
    /// `AttnFuncWithCPAndQKVOA2A` runs it (`flash_attn_a2a_communicate`): the tensors to send
    /// are packed head-group first (one copy), exchanged by an all-to-all over the CP group and
    /// put back in sequence order (one copy); forward exchanges the queries, keys and values
    /// before the kernel and its output after it, backward the output and its gradient before
    /// the kernel and the query, key and value gradients after it. The kernel runs over the
    /// whole sequence on `1 / cp` of the rank's heads. Nothing overlaps the exchanges. Returns
    /// the op the next one waits for.
    fn a2a_attention(
        &mut self,
        name: &'static str,
        tag: OpTag,
        deps: &[u32],
        backward: bool,
    ) -> u32 {
        let d = self.dims();
        let qkv = d.t * (d.q_local + 2 * d.kv_local) * ACT_BYTES;
        let out = d.t * d.o_local * ACT_BYTES;
        let (before, after) = if backward { (2 * out, qkv) } else { (qkv, out) };
        let (pack, unpack) = if backward {
            ("cp_a2a_pack_bwd", "cp_a2a_unpack_bwd")
        } else {
            ("cp_a2a_pack_fwd", "cp_a2a_unpack_fwd")
        };
        let exchange = |b: &mut Self, bytes: u64, deps: &[u32]| -> u32 {
            let packed = b.compute(pack, OpClass::Elementwise, Self::mem(2 * bytes), tag, deps);
            let sent = b.collective(GroupKind::Cp, Collective::AllToAll, bytes, tag, &[packed]);
            let ready: Vec<u32> = sent.into_iter().chain([packed]).collect();
            b.compute(
                unpack,
                OpClass::Elementwise,
                Self::mem(2 * bytes),
                tag,
                &ready,
            )
        };
        let inputs = exchange(self, before, deps);
        let work = self.attention_work(backward, tag.layer);
        let kernel = self.compute(name, OpClass::Attention, work, tag, &[inputs]);
        exchange(self, after, &[kernel])
    }

    fn unfused(&self) -> Unfused {
        let m = &self.job.model;
        let par = &self.job.parallel;
        let s = m.seq_len as u64;
        let sq = s / par.cp as u64;
        let bh = par.micro_batch as u64 * (m.heads / par.tp) as u64;
        Unfused {
            sq,
            skv: s,
            dh: m.head_dim as u64,
            bh,
            scores: bh * sq * s,
        }
    }

    fn attention_work(&self, backward: bool, layer: u32) -> Work {
        let m = &self.job.model;
        let par = &self.job.parallel;
        // The all-to-all form splits the heads instead of the sequence.
        let (cp, head_split) = if self.cp_a2a() {
            (1, par.cp as u64)
        } else {
            (par.cp as u64, 1)
        };
        let s = m.seq_len as u64;
        // With load-balanced context parallelism each rank computes 1/cp of the causal score
        // matrix: s/cp queries against s/2 keys on average (no mask), the same FLOPs.
        let (seq_kv, causal) = if cp > 1 { (s / 2, false) } else { (s, true) };
        let mut batch = par.micro_batch as u64;
        let (mut seq_q, mut seq_kv, mut window) = (s / cp, seq_kv, 0);
        match m.local_attention(layer) {
            None => {}
            // Chunks are independent causal sequences (validated: the chunk divides seq_len).
            Some(LocalAttention {
                kind: WindowKind::Chunked,
                window: c,
            }) => {
                let c = c as u64;
                batch *= s / c;
                (seq_q, seq_kv) = (c, c);
            }
            Some(LocalAttention {
                kind: WindowKind::Sliding,
                window: w,
            }) => window = w as u64,
        }
        Work::Attention {
            batch,
            heads: m.heads as u64 / par.tp as u64 / head_split,
            seq_q,
            seq_kv,
            head_dim: m.core_head_dim(),
            causal,
            window,
            backward,
        }
    }

    /// Bytes of the token permutations around one MoE layer's experts on this rank, each way
    /// (forward, and mirrored in backward). The grouped expert GEMMs need each expert's tokens
    /// contiguous, so routed copies are gathered into expert order and the expert outputs
    /// scattered back, each a streaming pass over the routed copies, priced at the copy
    /// bandwidth, as one fused kernel each runs them (Megatron-Core's `moe_permute_fusion`;
    /// measured on an H100 with stand-in Triton kernels, `validation/h100/permute.json`: the
    /// weighted un-permutation and the reorder within 2% of the price, the gathering
    /// permutation 20% slower; PyTorch's unfused eager kernels, `moe_host.json`, slower still).
    /// Megatron-Core's `token_dispatcher.py` runs:
    /// - `source`: with Megatron-Core's alltoall dispatcher (or without expert parallelism),
    ///   the permutation of the `tokens x top_k` copies into destination order before the
    ///   dispatch (reading the tokens, writing the copies), and the weighted un-permutation after
    ///   the combine (reading the copies, writing the tokens);
    /// - `receive`: the reordering of the received copies from source-rank order into
    ///   local-expert order after the dispatch and back before the combine (Megatron-Core's
    ///   `sort_chunks_by_idxs` with more than one local expert; with DeepEP, the permutation of
    ///   its receive buffer into expert order, whose combine kernel does the weighted sum).
    fn moe_permute_bytes(&self, tokens: u64, top_k: u32, pairs: u64) -> MoePermuteBytes {
        let j = self.job;
        let h = self.dims().h;
        let ep = j.parallel.ep as u64;
        let local = j.model.moe.as_ref().map_or(1, |m| m.experts as u64 / ep);
        let deepep = ep > 1 && j.parallel.moe_dispatcher == crate::job::MoeDispatcher::DeepEp;
        let copies = tokens * top_k as u64;
        MoePermuteBytes {
            source: if deepep {
                0
            } else {
                (tokens + copies) * h * ACT_BYTES
            },
            receive: if deepep {
                // DeepEP delivers a token once per destination rank: a uniformly random set
                // of k of the E experts misses a rank's L experts with probability
                // C(E - L, k) / C(E, k), so it reaches ep (1 - that) ranks on average.
                let experts = local * ep;
                let miss: f64 = (0..top_k as u64)
                    .map(|i| experts.saturating_sub(local + i) as f64 / (experts - i) as f64)
                    .product();
                let unique = (tokens as f64 * ep as f64 * (1.0 - miss)).ceil() as u64;
                (unique.min(pairs) + pairs) * h * ACT_BYTES
            } else if ep > 1 && local > 1 {
                2 * pairs * h * ACT_BYTES
            } else {
                0
            },
            deepep,
        }
    }

    /// A memory-bound pass of `bytes` (none when zero) after op `after`; returns the op that
    /// what follows waits for.
    fn optional_pass(&mut self, name: &'static str, bytes: u64, tag: OpTag, after: u32) -> u32 {
        if bytes == 0 {
            return after;
        }
        self.compute(name, OpClass::Elementwise, Self::mem(bytes), tag, &[after])
    }

    /// Routed (token, expert) pairs of `tokens` tokens on this rank at the busiest expert:
    /// `tokens x top_k`, times the capacity factor or the load imbalance when one is set.
    fn routed_pairs(&self, tokens: u64, top_k: u32) -> u64 {
        let pairs = tokens * top_k as u64;
        let load = self.job.model.arch.moe_load_factor();
        if load == 1.0 {
            pairs
        } else {
            (pairs as f64 * load).ceil() as u64
        }
    }

    /// Multi-head latent attention projections, forward: the joint down-projection of the
    /// (gathered) input to the query and key-value latents and the shared rotary key, then the
    /// column-parallel up-projections. Returns the ops the attention core waits for.
    fn mla_forward(&mut self, tag: OpTag, input: u32) -> Vec<u32> {
        let d = self.dims();
        let (down, q_up, kv_up) = self.mla_shapes();
        let first =
            self.gathered_gemm("mla_down_fwd", Self::gemm(d.t, down, d.h), tag, input, d.sp);
        let mut out = Vec::new();
        if let Some((n, k)) = q_up {
            out.push(self.compute(
                "q_up_fwd",
                OpClass::Gemm,
                Self::gemm(d.t, n, k),
                tag,
                &first,
            ));
        }
        let (n, k) = kv_up;
        out.push(self.compute(
            "kv_up_fwd",
            OpClass::Gemm,
            Self::gemm(d.t, n, k),
            tag,
            &first,
        ));
        out
    }

    /// MLA GEMM sizes per rank: the down-projection's output width, the query
    /// up-projection `(n, k)` (none without a query LoRA) and the key-value up-projection.
    fn mla_shapes(&self) -> (u64, Option<(u64, u64)>, (u64, u64)) {
        let m = &self.job.model;
        let mla = m.arch.mla.expect("MLA model");
        let heads = m.heads as u64 / self.job.parallel.tp as u64;
        let (rq, rkv) = (mla.q_lora_rank as u64, mla.kv_lora_rank as u64);
        let q_cols = heads * mla.qk_head_dim();
        let kv_cols = heads * (mla.qk_nope_head_dim as u64 + mla.v_head_dim as u64);
        let kv_down = rkv + mla.qk_rope_head_dim as u64;
        if rq > 0 {
            (rq + kv_down, Some((q_cols, rq)), (kv_cols, rkv))
        } else {
            (q_cols + kv_down, None, (kv_cols, rkv))
        }
    }

    /// MLA projections, backward: data and weight gradients of the up-projections, then of
    /// the down-projection with the input-gradient reduction over TP. Returns the op
    /// producing the input gradient.
    fn mla_backward(&mut self, tag: OpTag, grad: u32) -> u32 {
        let d = self.dims();
        let (down, q_up, kv_up) = self.mla_shapes();
        let (n, k) = kv_up;
        let mut last = self.compute(
            "kv_up_dgrad",
            OpClass::Gemm,
            Self::gemm(d.t, k, n),
            tag,
            &[grad],
        );
        if let Some(w) = self.wgrad("kv_up_wgrad", Self::gemm(n, k, d.t), tag, &[]) {
            last = w;
        }
        if let Some((n, k)) = q_up {
            last = self.compute("q_up_dgrad", OpClass::Gemm, Self::gemm(d.t, k, n), tag, &[]);
            if let Some(w) = self.wgrad("q_up_wgrad", Self::gemm(n, k, d.t), tag, &[]) {
                last = w;
            }
        }
        let act = d.t * d.h * ACT_BYTES;
        let (g, _wg) = self.linear_backward_in(
            ("mla_down_dgrad", "mla_down_wgrad"),
            Self::gemm(d.t, d.h, down),
            Self::gemm(down, d.h, d.t),
            tag,
            last,
            act,
        );
        g
    }

    /// Shared experts forward: a gated MLP of width `moe_shared_ffn_hidden / tp` on the
    /// layer's (gathered) normed input, its output reduced over TP. `after` orders it on the
    /// compute stream behind the routed experts. Returns the ops the residual waits for.
    fn shared_expert_forward(&mut self, tag: OpTag, input: u32, after: u32) -> Vec<u32> {
        let d = self.dims();
        let m = &self.job.model;
        let f = m.arch.moe_shared_ffn_hidden as u64 / d.tp;
        let n_fc1 = if m.activation == Activation::SwiGlu {
            2 * f
        } else {
            f
        };
        let mut fc1 = self.gathered_gemm(
            "shared_fc1_fwd",
            Self::gemm(d.t, n_fc1, d.h),
            tag,
            input,
            d.sp,
        );
        fc1.push(after);
        let act = self.compute(
            "shared_act_fwd",
            OpClass::Elementwise,
            Self::mem((n_fc1 + f) * d.t * ACT_BYTES),
            tag,
            &fc1,
        );
        self.reduced_gemm("shared_fc2_fwd", Self::gemm(d.t, d.h, f), tag, &[act])
    }

    /// Shared experts backward; returns the op producing their input gradient.
    fn shared_expert_backward(&mut self, tag: OpTag, grad: u32) -> u32 {
        let d = self.dims();
        let f = self.job.model.arch.moe_shared_ffn_hidden as u64 / d.tp;
        if self.fp8_act_cache() {
            // The SwiGLU output is not cached: recompute it from the FP8-cached input.
            let n_fc1 = if self.job.model.activation == Activation::SwiGlu {
                2 * f
            } else {
                f
            };
            // Only the fc2 weight gradient reads it.
            self.w_only(
                "shared_act_recompute",
                OpClass::Elementwise,
                Self::mem((n_fc1 + f) * d.t * ACT_BYTES),
                OpTag {
                    phase: Phase::Recompute,
                    ..tag
                },
                &[],
            );
        }
        self.mlp_backward(
            [
                "shared_fc2_dgrad",
                "shared_fc2_wgrad",
                "shared_act_bwd",
                "shared_fc1_dgrad",
                "shared_fc1_wgrad",
            ],
            f,
            tag,
            grad,
        )
    }

    /// Backward of one dense MLP of local width `f` (fc2 data and weight gradients, the
    /// activation, fc1 gradients with the TP reduction of its input gradient), under the op
    /// names `names` (fc2 dgrad, fc2 wgrad, activation, fc1 dgrad, fc1 wgrad); returns the op
    /// producing the MLP's input gradient.
    fn mlp_backward(&mut self, names: [&'static str; 5], f: u64, tag: OpTag, grad: u32) -> u32 {
        let d = self.dims();
        let n_fc1 = if self.job.model.activation == Activation::SwiGlu {
            2 * f
        } else {
            f
        };
        let (dg_deps, after) = self.gathered_grad(tag, grad);
        self.compute(
            names[0],
            OpClass::Gemm,
            Self::gemm(d.t, f, d.h),
            tag,
            &dg_deps,
        );
        self.wgrad(names[1], Self::gemm(f, d.h, d.t), tag, &after);
        let ab = self.compute(
            names[2],
            OpClass::Elementwise,
            Self::mem((2 * n_fc1 + f) * d.t * ACT_BYTES),
            tag,
            &[],
        );
        let (g, _wg) = self.linear_backward_in(
            (names[3], names[4]),
            Self::gemm(d.t, d.h, n_fc1),
            Self::gemm(n_fc1, d.h, d.t),
            tag,
            ab,
            d.t * d.h * ACT_BYTES,
        );
        g
    }

    fn lm_head_forward(&mut self, mb: u32, input: Option<u32>) {
        let d = self.dims();
        let v_local = self.job.model.vocab as u64 / d.tp;
        let tag = Self::tag(Phase::Forward, mb, NONE);
        let norm = self.compute(
            "final_norm_fwd",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &Self::deps(input),
        );
        let mut cur = norm;
        if d.sp {
            cur = self
                .collective(
                    GroupKind::Tp,
                    Collective::AllGather,
                    d.t * d.h * ACT_BYTES,
                    tag,
                    &[cur],
                )
                .unwrap_or(cur);
        }
        self.compute(
            "lm_head_fwd",
            OpClass::Gemm,
            Self::gemm(d.t, v_local, d.h),
            tag,
            &[cur],
        );
        // Vocab-parallel cross entropy: the passes of the stack's loss or of the fused kernels
        // over the logits (`Training::loss_bytes_per_logit`); max and sum-exp all-reduces of
        // one float per token.
        let (loss_fwd_bytes, _) = self.job.training.loss_bytes_per_logit();
        let loss = self.compute(
            "loss_fwd",
            OpClass::Loss,
            Self::mem(loss_fwd_bytes * d.t * v_local),
            tag,
            &[],
        );
        self.collective(
            GroupKind::Tp,
            Collective::AllReduce,
            2 * d.t * 4,
            tag,
            &[loss],
        );
    }

    /// A compute op that only the weight gradients need: emitted now, or recorded for the
    /// weight step while a split backward is built (then `None`).
    fn w_only(
        &mut self,
        name: &'static str,
        class: OpClass,
        work: Work,
        tag: OpTag,
        deps: &[u32],
    ) -> Option<u32> {
        if self.defer_w {
            self.pending_w.push(DeferredW::Compute {
                name,
                class,
                work,
                tag,
                deps: deps.to_vec(),
            });
            return None;
        }
        Some(self.compute(name, class, work, tag, deps))
    }

    /// A weight-gradient GEMM ([`StageBuilder::w_only`]).
    fn wgrad(&mut self, name: &'static str, work: Work, tag: OpTag, deps: &[u32]) -> Option<u32> {
        self.w_only(name, OpClass::Gemm, work, tag, deps)
    }

    /// Marks `op` as (a candidate for) the op after which `layer`'s gradients are final: the
    /// latest in program order wins (the compute stream runs them in that order).
    fn mark_grad_ready(&mut self, layer: u32, op: u32) {
        let e = self.grad_ready.entry(layer).or_insert(op);
        *e = (*e).max(op);
    }

    /// The input-gradient part of a split backward (zero bubble): the backward with its
    /// weight-gradient ops recorded for [`StageBuilder::weight_step`] instead of emitted, so
    /// the input gradient is sent downstream without waiting for them.
    fn backward_input_step(&mut self, mb: u32, chunk: u32, m: u32) {
        self.defer_w = true;
        self.backward_step(mb, chunk, m);
        self.defer_w = false;
        let ops = std::mem::take(&mut self.pending_w);
        self.deferred_w.insert((mb, chunk), ops);
    }

    /// The deferred weight gradients of `(mb, chunk)`'s split backward, in the order the
    /// backward recorded them (last layer first), tagged [`Phase::Weight`] (recomputations
    /// keep their tag). They follow their input-gradient step on the compute stream (their
    /// inputs, the saved activations and the output gradients, exist by then); each layer's
    /// last one marks its gradients final for the data-parallel reduction, and with ZeRO-3
    /// the layer's per-micro-batch gradient reduce-scatter follows it.
    fn weight_step(&mut self, mb: u32, chunk: u32, m: u32) {
        let ops = self
            .deferred_w
            .remove(&(mb, chunk))
            .expect("a weight step after its input-gradient step");
        let retag = |tag: OpTag| match tag.phase {
            Phase::Backward => OpTag {
                phase: Phase::Weight,
                ..tag
            },
            _ => tag,
        };
        let mut last_of_layer: BTreeMap<u32, u32> = BTreeMap::new();
        for op in ops {
            let (id, layer) = match op {
                DeferredW::Compute {
                    name,
                    class,
                    work,
                    tag,
                    deps,
                } => (
                    self.compute(name, class, work, retag(tag), &deps),
                    tag.layer,
                ),
                DeferredW::Gathered {
                    name,
                    work,
                    tag,
                    bytes,
                    input,
                } => {
                    let t = retag(tag);
                    let ag =
                        self.collective(GroupKind::Tp, Collective::AllGather, bytes, t, &[input]);
                    let deps: Vec<u32> = ag.into_iter().collect();
                    (self.compute(name, OpClass::Gemm, work, t, &deps), tag.layer)
                }
            };
            last_of_layer.insert(layer, id);
        }
        for (&layer, &op) in &last_of_layer {
            if layer == NONE {
                // The LM head's (and the MTP heads' shared) weight gradient.
                self.lm_head_grad_ready = Some(self.lm_head_grad_ready.map_or(op, |x| x.max(op)));
            } else {
                self.mark_grad_ready(layer, op);
            }
        }
        if self.reduces_gradients(mb, chunk, m) {
            let layers: Vec<u32> = self.chunk_layers[chunk as usize].clone().rev().collect();
            for layer in layers {
                if let Some(&op) = last_of_layer.get(&layer) {
                    self.micro_batch_reduce_scatter(mb, layer, op);
                }
            }
        }
    }

    /// Bytes per element of the routed experts' bias adds where the stack runs them as
    /// kernels of their own ([`crate::job::Stack::unfused_expert_bias_bytes`]).
    fn unfused_expert_bias(&self) -> Option<crate::job::ExpertBiasBytes> {
        let j = self.job;
        if !j.model.arch.expert_bias {
            return None;
        }
        j.training.stack.unfused_expert_bias_bytes()
    }

    /// Whether micro-batch `mb` opens (its forward) and closes (its backward) `chunk`'s ZeRO-3
    /// sync span ([`Zero3Sync`]): the parameters gathered at the span's first forward are
    /// kept, unless resharded after each forward, and the gradients reduced at its last
    /// backward. A span of one micro-batch (or no ZeRO-3) both opens and closes at every one.
    fn zero3_span_ends(&self, mb: u32, chunk: u32, m: u32) -> (bool, bool) {
        let par = &self.job.parallel;
        let span = match par.zero3_grad_sync {
            _ if !par.shards_params() => return (true, true),
            Zero3Sync::MicroBatch => return (true, true),
            Zero3Sync::ScheduleRun => m / par.pipeline_rounds.max(1),
            Zero3Sync::Iteration => m,
        };
        let off = mb - mb % span;
        // DualPipe: direction `chunk` runs micro-batches chunk x span/2 .. (chunk + 1) x span/2.
        let (first, count) = if self.dualpipe() {
            (off + chunk * (span / 2), span / 2)
        } else {
            (off, span)
        };
        (mb == first, mb == first + count - 1)
    }

    /// Whether micro-batch `mb`'s backward of `chunk` reduce-scatters its layers' gradients:
    /// every micro-batch's with sharded gradients (ZeRO-2 and 3), or, where ZeRO-3 syncs once
    /// per schedule run or iteration, the last backward of the chunk in the span only.
    fn reduces_gradients(&self, mb: u32, chunk: u32, m: u32) -> bool {
        self.job.parallel.shards_grads() && self.zero3_span_ends(mb, chunk, m).1
    }

    /// ZeRO-2 and 3 (sharded gradients): micro-batch `mb`'s gradients of `layer` are
    /// reduce-scattered as soon as its weight gradients exist (`after`, the last of them).
    fn micro_batch_reduce_scatter(&mut self, mb: u32, layer: u32, after: u32) {
        let (dense, expert) = self.layer_param_split(layer);
        let bytes = self.grad_bytes();
        let optag = Self::tag(Phase::Optimizer, mb, layer);
        let (d, e) = self.data_parallel(
            Collective::ReduceScatter,
            dense,
            expert,
            bytes,
            optag,
            &[after],
        );
        self.last_micro_batch_reduce = e.or(d).or(self.last_micro_batch_reduce);
    }

    /// Posts the receive of `(mb, chunk)`'s output gradient ahead of its backward (kept in
    /// `pre_recv` for [`StageBuilder::backward_step`]); `None` on the chunk that computes
    /// the loss.
    fn pre_recv_gradient(&mut self, mb: u32, chunk: u32) -> Option<u32> {
        if self.is_last_chunk(chunk) {
            return None;
        }
        let msg = MsgTag {
            backward: true,
            micro_batch: mb,
            chunk,
        };
        let op = self.recv(msg, Self::tag(Phase::Backward, mb, NONE));
        self.pre_recv = Some((msg, op));
        Some(op)
    }

    fn backward_step(&mut self, mb: u32, chunk: u32, m: u32) {
        let waits = std::mem::take(&mut self.backward_sends);
        self.blocking.extend(waits);
        let d = self.dims();
        let tag = Self::tag(Phase::Backward, mb, NONE);
        let last_mb = self.is_last_backward(mb, chunk, m);
        let mut cur: Option<u32>;
        if self.is_last_chunk(chunk) {
            if self.job.mtp_standalone() {
                // The MTP heads' backward (their modules run upstream), then the main head's;
                // the message upstream carries every hidden state's gradient.
                for _ in 0..self.job.model.arch.mtp_depth {
                    self.lm_head_backward(mb, false);
                }
            } else {
                // The MTP modules' backward runs first on the compute stream; the main head's
                // backward follows it there.
                self.mtp_backward(mb, last_mb);
            }
            cur = Some(self.lm_head_backward(mb, last_mb));
        } else {
            let msg = MsgTag {
                backward: true,
                micro_batch: mb,
                chunk,
            };
            cur = Some(match self.pre_recv.take() {
                Some((t, op)) if t == msg => op,
                _ => self.recv(msg, tag),
            });
            if self.runs_standalone_mtp(chunk) {
                // Deepest module first; the main hidden state's gradient is complete after the
                // first module's projection.
                let grad = cur.expect("received gradient");
                let mut g = grad;
                for k in (0..self.job.model.arch.mtp_depth).rev() {
                    g = self.mtp_module_backward(mb, k, grad, last_mb);
                }
                cur = Some(g);
            }
        }
        let layers: Vec<u32> = self.chunk_layers[chunk as usize].clone().rev().collect();
        let mut gathers = Zero3Gathers::default();
        // Without resharding after the forward, the forward's gather serves the backward
        // (and the recomputed forward).
        let gather = self.job.parallel.reshard_after_forward;
        let reduce = self.reduces_gradients(mb, chunk, m);
        for (i, &layer) in layers.iter().enumerate() {
            if gather {
                self.zero3_prefetch(&mut gathers, &layers, i, tag, cur);
            }
            self.recompute_before_backward(mb, layer, cur);
            let out = self.layer_backward(mb, layer, cur);
            cur = Some(out.0);
            if last_mb {
                self.mark_grad_ready(layer, out.1);
            }
            // (With the split, the weight step reduces the layer's gradients.)
            if reduce && !self.defer_w {
                self.micro_batch_reduce_scatter(mb, layer, out.1);
            }
        }
        if self.is_first_chunk(chunk) {
            let mut c = cur;
            if d.sp {
                c = self
                    .collective(
                        GroupKind::Tp,
                        Collective::AllGather,
                        d.t * d.h * ACT_BYTES,
                        tag,
                        &Self::deps(c),
                    )
                    .or(c);
            }
            let e = self.compute(
                "embedding_bwd",
                OpClass::Embedding,
                Self::mem(2 * d.t * d.h * 4),
                tag,
                &Self::deps(c),
            );
            if last_mb {
                self.embedding_grad_ready = Some(e);
            }
        } else {
            self.send_gradient(mb, chunk, cur);
        }
        let end = self.prog.stream_ops[Stream::Compute as usize]
            .last()
            .copied();
        if let Some(end) = end.filter(|_| self.aligned_grad_reduce()) {
            if last_mb {
                self.chunk_last_backward
                    .insert(chunk, self.backward_ends.len());
            }
            self.backward_ends.push(end);
        }
    }

    /// The loss and LM head backward of one micro-batch on the last stage; returns the final
    /// norm's backward (the gradient into the last hidden state). On the last micro-batch the
    /// head's weight gradient marks its bucket ready (when `mark_ready`).
    fn lm_head_backward(&mut self, mb: u32, last_mb: bool) -> u32 {
        let d = self.dims();
        let tag = Self::tag(Phase::Backward, mb, NONE);
        let v_local = self.job.model.vocab as u64 / d.tp;
        let (_, loss_bwd_bytes) = self.job.training.loss_bytes_per_logit();
        let lb = self.compute(
            "loss_bwd",
            OpClass::Loss,
            Self::mem(loss_bwd_bytes * d.t * v_local),
            tag,
            &[],
        );
        let _ = lb;
        let dg = self.compute(
            "lm_head_dgrad",
            OpClass::Gemm,
            Self::gemm(d.t, d.h, v_local),
            tag,
            &[],
        );
        let mut c = dg;
        let wg = if d.sp {
            let op = self.collective(
                GroupKind::Tp,
                Collective::ReduceScatter,
                d.t * d.h * ACT_BYTES,
                tag,
                &[dg],
            );
            let wg = self.wgrad("lm_head_wgrad", Self::gemm(v_local, d.h, d.t), tag, &[]);
            c = op.or(wg).unwrap_or(dg);
            wg
        } else {
            self.wgrad("lm_head_wgrad", Self::gemm(v_local, d.h, d.t), tag, &[])
        };
        // (Deferred: the weight step marks it.)
        if last_mb && let Some(wg) = wg {
            self.lm_head_grad_ready = Some(wg);
        }
        self.compute(
            "final_norm_bwd",
            OpClass::Norm,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[c],
        )
    }

    /// Sequence parallelism: the data-gradient GEMM `name` of `grad_in` and the TP
    /// reduce-scatter of its output (`bytes`). Returns (GEMM, reduce-scatter if TP > 1).
    fn reduce_scattered_dgrad(
        &mut self,
        name: &'static str,
        dgrad: Work,
        tag: OpTag,
        grad_in: u32,
        bytes: u64,
        beside_ub: bool,
    ) -> (u32, Option<u32>) {
        let dg = self.gemm_beside_ub(name, dgrad, tag, &[grad_in], beside_ub);
        let rs = self.collective(GroupKind::Tp, Collective::ReduceScatter, bytes, tag, &[dg]);
        (dg, rs)
    }

    /// Backward of a TP-sharded linear layer whose input was gathered (SP) or replicated:
    /// data-gradient GEMM, then the input-gradient reduction overlapping the weight-gradient
    /// GEMM. Returns (op producing the input gradient, weight-gradient op).
    fn linear_backward_in(
        &mut self,
        names: (&'static str, &'static str),
        dgrad: Work,
        wgrad: Work,
        tag: OpTag,
        grad_in: u32,
        reduce_bytes: u64,
    ) -> (u32, u32) {
        let d = self.dims();
        // The SP input the weight gradient reads is gathered in the layer's gather type.
        let gather_bytes = reduce_bytes / ACT_BYTES * self.tp_gather_bytes();
        if d.sp && self.defer_w {
            // Split backward: the input gradient is reduce-scattered now; the all-gather of
            // the SP input, which only the weight gradient reads, moves with it.
            let (dg, rs) =
                self.reduce_scattered_dgrad(names.0, dgrad, tag, grad_in, reduce_bytes, false);
            self.pending_w.push(DeferredW::Gathered {
                name: names.1,
                work: wgrad,
                tag,
                bytes: gather_bytes,
                input: grad_in,
            });
            return (rs.unwrap_or(dg), dg);
        }
        if d.sp {
            // Megatron: all-gather the SP input for the weight gradient while the data gradient runs,
            // then reduce-scatter the input gradient while the weight gradient runs. With
            // `tp_comm_overlap` these are Transformer Engine's `bulk` overlaps, whose
            // communication kernels hold SMs beside both GEMMs.
            let ub = self.tp_overlap();
            let ag = self.collective(
                GroupKind::Tp,
                Collective::AllGather,
                gather_bytes,
                tag,
                &[grad_in],
            );
            let (_, rs) =
                self.reduce_scattered_dgrad(names.0, dgrad, tag, grad_in, reduce_bytes, ub);
            let ag_dep: Vec<u32> = ag.into_iter().collect();
            let wg = self.gemm_beside_ub(names.1, wgrad, tag, &ag_dep, ub);
            (rs.unwrap_or(wg), wg)
        } else {
            let dg = self.compute(names.0, OpClass::Gemm, dgrad, tag, &[grad_in]);
            let ar = if d.tp > 1 {
                self.collective(
                    GroupKind::Tp,
                    Collective::AllReduce,
                    reduce_bytes,
                    tag,
                    &[dg],
                )
            } else {
                None
            };
            let wg = self.wgrad(names.1, wgrad, tag, &[]).unwrap_or(dg);
            (ar.unwrap_or(wg), wg)
        }
    }

    /// The gradient of a reduced GEMM's output arriving over TP: an all-gather with SP (the
    /// backward of the forward reduce-scatter). With `tp_comm_overlap` the data-gradient GEMM
    /// is pipelined with it. Returns the deps for the data-gradient GEMM and for the op after it.
    fn gathered_grad(&mut self, tag: OpTag, grad: u32) -> (Vec<u32>, Vec<u32>) {
        let d = self.dims();
        if !d.sp {
            return (vec![grad], vec![]);
        }
        let act = d.t * d.h * self.tp_gather_bytes();
        let ag = self.collective(GroupKind::Tp, Collective::AllGather, act, tag, &[grad]);
        match ag {
            Some(a) if self.tp_overlap() => (vec![grad], vec![a]),
            Some(a) => (vec![a], vec![]),
            None => (vec![grad], vec![]),
        }
    }

    /// Backward of one layer; returns (op producing the input gradient, last op of the layer's
    /// weight gradients).
    fn layer_backward(&mut self, mb: u32, layer: u32, grad: Option<u32>) -> (u32, u32) {
        let d = self.dims();
        let m = &self.job.model;
        let tag = Self::tag(Phase::Backward, mb, layer);
        let act = d.t * d.h * ACT_BYTES;
        let mut deps = Self::deps(grad);
        deps.extend(self.zero3_ready.take());
        let fw = self.compute(
            "framework_bwd",
            OpClass::Framework,
            Self::mem(0),
            tag,
            &deps,
        );
        let r2 = self.compute(
            "residual2_bwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES + self.mask_bytes(d.t_sp * d.h)),
            tag,
            &[fw],
        );
        let mut cur = r2;
        let rn = self
            .job
            .training
            .memory_saving
            .recomputes_norm_upproj(self.job.parallel.recompute);
        let rtag = OpTag {
            phase: Phase::Recompute,
            ..tag
        };
        if rn {
            // DeepSeek-V3 (Sec. 3.2.3): the second norm's output (the MLP / router / shared
            // expert input) is rebuilt before the MLP backward.
            cur = self.compute(
                "norm2_recompute",
                OpClass::Norm,
                Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
                rtag,
                &[cur],
            );
        }
        if self.job.training.precision == Precision::Fp8 {
            // Transformer Engine casts and transposes every GEMM's output gradient to FP8 (read
            // BF16, write FP8 twice), and the weights for the data gradients as the cache
            // allows.
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * d.ffn_local
            } else {
                d.ffn_local
            };
            let grads = d.t * (d.q_local + 2 * d.kv_local + d.h + n_fc1 + d.h);
            let bytes = 4 * grads + self.fp8_weight_cast_bytes(layer, tag);
            cur = self.compute(
                "fp8_cast_transpose_bwd",
                OpClass::Elementwise,
                Self::mem(bytes),
                tag,
                &[cur],
            );
        }
        // MLP block.
        if let Some(moe) = &self.job.model.moe
            && m.is_moe_layer(layer)
        {
            let ep = self.job.parallel.ep as u64;
            let batch = moe.experts as u64 / ep;
            let pairs = self.routed_pairs(d.t_sp, moe.top_k);
            let per_expert = (pairs * ep).div_ceil(moe.experts as u64);
            let fe = moe.ffn_hidden as u64;
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * fe
            } else {
                fe
            };
            let a2a_bytes = pairs * d.h * ACT_BYTES;
            let shared_in = cur;
            let perm = self.moe_permute_bytes(d.t_sp, moe.top_k, pairs);
            cur = self.optional_pass("moe_unpermute_bwd", perm.source, tag, cur);
            cur = self
                .collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[cur])
                .unwrap_or(cur);
            // Shared experts' backward runs while the gradient all-to-all is in flight (issued
            // before the reorder, which waits for it).
            let shared = (m.arch.moe_shared_ffn_hidden > 0)
                .then(|| self.shared_expert_backward(tag, shared_in));
            cur = self.optional_pass(
                perm.receive_name("moe_unsort_bwd", "moe_unpermute_bwd"),
                perm.receive,
                tag,
                cur,
            );
            if self.fp8_act_cache() {
                // DeepSeek-V3 (Sec. 3.3.3): only the SwiGLU input is cached (in FP8); its
                // output, the fc2 weight-gradient input, is recomputed.
                self.w_only(
                    "expert_act_recompute",
                    OpClass::Elementwise,
                    Self::mem(3 * pairs * fe * ACT_BYTES),
                    OpTag {
                        phase: Phase::Recompute,
                        ..tag
                    },
                    &[],
                );
            }
            let bias = self.unfused_expert_bias();
            if let Some(b) = bias {
                cur = self.compute(
                    "expert_fc2_bias_bwd",
                    OpClass::Elementwise,
                    Self::mem(b.fc2_bwd * pairs * d.h),
                    tag,
                    &[cur],
                );
            }
            self.compute(
                "expert_fc2_dgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: fe,
                    k: d.h,
                    batch,
                },
                tag,
                &[cur],
            );
            self.wgrad(
                "expert_fc2_wgrad",
                Work::Gemm {
                    m: fe,
                    n: d.h,
                    k: per_expert,
                    batch,
                },
                tag,
                &[],
            );
            self.compute(
                "expert_act_bwd",
                OpClass::Elementwise,
                Self::mem(4 * pairs * fe * ACT_BYTES),
                tag,
                &[],
            );
            if let Some(b) = bias {
                self.compute(
                    "expert_fc1_bias_bwd",
                    OpClass::Elementwise,
                    Self::mem(b.fc1_bwd * pairs * n_fc1),
                    tag,
                    &[],
                );
            }
            let dg = self.compute(
                "expert_fc1_dgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: d.h,
                    k: n_fc1,
                    batch,
                },
                tag,
                &[],
            );
            let dg = self.optional_pass(
                perm.receive_name("moe_sort_bwd", "moe_permute_bwd"),
                perm.receive,
                tag,
                dg,
            );
            let a2a = self.collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[dg]);
            self.wgrad(
                "expert_fc1_wgrad",
                Work::Gemm {
                    m: n_fc1,
                    n: d.h,
                    k: per_expert,
                    batch,
                },
                tag,
                &[],
            );
            let mut router_deps = Self::deps(a2a);
            if perm.source > 0 {
                let after = a2a.unwrap_or(dg);
                router_deps = vec![self.optional_pass("moe_permute_bwd", perm.source, tag, after)];
            }
            router_deps.extend(shared);
            cur = self.compute(
                "router_bwd",
                OpClass::Router,
                Self::gemm(d.t_sp, d.h, moe.experts as u64),
                tag,
                &router_deps,
            );
        } else {
            cur = self.mlp_backward(
                [
                    "fc2_dgrad",
                    "fc2_wgrad",
                    "act_bwd",
                    "fc1_dgrad",
                    "fc1_wgrad",
                ],
                d.ffn_local,
                tag,
                cur,
            );
        }
        let nb2 = self.compute(
            "norm2_bwd",
            OpClass::Norm,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[cur],
        );
        let r1 = self.compute(
            "residual1_bwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES + self.mask_bytes(d.t_sp * d.h)),
            tag,
            &[nb2],
        );
        // Attention block.
        let (dg_deps, after) = self.gathered_grad(tag, r1);
        let opd = self.compute(
            "out_proj_dgrad",
            OpClass::Gemm,
            Self::gemm(d.t, d.o_local, d.h),
            tag,
            &dg_deps,
        );
        let opw = self
            .wgrad(
                "out_proj_wgrad",
                Self::gemm(d.o_local, d.h, d.t),
                tag,
                &after,
            )
            .unwrap_or(opd);
        if self.job.parallel.recompute == Recompute::Selective {
            self.attention_forward(tag, &[opw], true);
        }
        if rn {
            // The first norm's output (the QKV / MLA down-projection input) and, with MLA, the
            // up-projections' outputs (Q, K, V) are rebuilt before the attention backward.
            let n1 = self.compute(
                "norm1_recompute",
                OpClass::Norm,
                Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
                rtag,
                &[opw],
            );
            if self.job.model.arch.mla.is_some() {
                let (_, q_up, kv_up) = self.mla_shapes();
                if let Some((n, k)) = q_up {
                    self.compute(
                        "q_up_recompute",
                        OpClass::Gemm,
                        Self::gemm(d.t, n, k),
                        rtag,
                        &[n1],
                    );
                }
                let (n, k) = kv_up;
                self.compute(
                    "kv_up_recompute",
                    OpClass::Gemm,
                    Self::gemm(d.t, n, k),
                    rtag,
                    &[n1],
                );
            }
        }
        let ab = self.attention_backward(tag, &[]);
        let mut after_attn = ab;
        if self.cp_gathers(tag.layer) {
            let kv_bytes = self.sequence_kv_bytes();
            after_attn = self
                .collective(
                    GroupKind::Cp,
                    Collective::ReduceScatter,
                    kv_bytes,
                    tag,
                    &[ab],
                )
                .unwrap_or(ab);
        }
        let g = if self.job.model.arch.mla.is_some() {
            self.mla_backward(tag, after_attn)
        } else {
            self.linear_backward_in(
                ("qkv_dgrad", "qkv_wgrad"),
                Self::gemm(d.t, d.h, d.q_local + 2 * d.kv_local),
                Self::gemm(d.q_local + 2 * d.kv_local, d.h, d.t),
                tag,
                after_attn,
                act,
            )
            .0
        };
        // The norm backward runs after the last weight-gradient GEMM on the compute stream, so
        // once it is done every gradient of the layer is final.
        let nb1 = self.compute(
            "norm1_bwd",
            OpClass::Norm,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[g],
        );
        (nb1, nb1)
    }

    /// Gradient buckets: the layers (and embedding / LM head) of this stage grouped in the
    /// order backward finishes their gradients (last layer first), each bucket at least
    /// `dp_bucket_mparams` parameters, as Megatron-Core forms them.
    fn plan_buckets(&self) -> Vec<Bucket> {
        let j = self.job;
        let m = &j.model;
        let par = &j.parallel;
        let tp = par.tp as u64;
        let bucket_params = (par.dp_bucket_mparams * 1e6).max(1.0) as u64;
        let emb = m.vocab as u64 * m.hidden as u64 / tp;
        let mut items: Vec<(Item, u64, u64)> = Vec::new();
        if self.is_last_chunk_on_stage() {
            let lm = if m.tied_embeddings && par.pp == 1 {
                0
            } else {
                emb
            };
            items.push((Item::LmHead, lm, 0));
        }
        let mut layers: Vec<u32> = self.chunk_layers.iter().flat_map(|r| r.clone()).collect();
        if j.holds_mtp(self.stage) {
            // Multi-token-prediction layers (numbered after the model's layers) finish their
            // gradients first.
            layers.extend(m.layers..m.layers + m.arch.mtp_depth);
        }
        if par.shards_params() {
            // ZeRO-3 reduces its layers' gradients itself (`reduces_gradients`) and gathers
            // each layer's parameters itself.
            layers.clear();
        }
        layers.sort_unstable_by(|a, b| b.cmp(a));
        for l in layers {
            let (dense_layer, expert_layer) = self.layer_param_split(l);
            items.push((Item::Layer(l), dense_layer, expert_layer));
        }
        if self.stage == 0 || self.dualpipe() && self.stage == par.pp - 1 {
            items.push((Item::Embedding, emb, 0));
        }
        let mut out = Vec::new();
        let mut cur = Bucket::default();
        let n = items.len();
        // Megatron-Core (`dp_buckets_every_stage = false`): one data-parallel module per model
        // chunk, so no bucket spans two chunks, and only the first stage's first chunk is split
        // into buckets. (Its parameters are gathered bucket by bucket; with the interleaved
        // schedule its gradients are reduced together once its backward is done:
        // `aligned_grad_reduce`.)
        let every = par.dp_buckets_every_stage;
        let mut cur_chunk = None;
        for (i, (item, dense, expert)) in items.into_iter().enumerate() {
            let chunk = self.item_chunk(&item);
            if !every && cur_chunk.is_some_and(|c| c != chunk) && !cur.items.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            cur_chunk = Some(chunk);
            cur.items.push(item);
            cur.dense += dense;
            cur.expert += expert;
            let split = every || self.stage == 0 && chunk == 0;
            if split && cur.dense + cur.expert >= bucket_params || i == n - 1 {
                out.push(std::mem::take(&mut cur));
            }
        }
        out
    }

    /// The local model chunk that holds a bucket item (MTP layers: the last).
    fn item_chunk(&self, item: &Item) -> usize {
        let last = self.chunk_layers.len().saturating_sub(1);
        match *item {
            Item::LmHead => last,
            Item::Embedding => 0,
            Item::Layer(l) => self
                .chunk_layers
                .iter()
                .position(|r| r.contains(&l))
                .unwrap_or(last),
        }
    }

    /// Megatron-Core's interleaved schedule with its default `align_grad_reduce`
    /// (`delay_grad_reduce` until August 2024): each chunk's gradients are reduced together
    /// once its last micro-batch's backward is done, `pp_rank` backward steps later still,
    /// "at the same time across the pipeline-parallel group" (`schedules.py`,
    /// `backward_step_helper`).
    fn aligned_grad_reduce(&self) -> bool {
        let par = &self.job.parallel;
        !par.dp_buckets_every_stage
            && par.align_grad_reduce
            && par.schedule == Schedule::Interleaved
    }

    /// Parameters of one transformer layer on this GPU: (dense, expert), after tensor and
    /// expert parallelism.
    fn layer_param_split(&self, layer: u32) -> (u64, u64) {
        let m = &self.job.model;
        let par = &self.job.parallel;
        let experts = match &m.moe {
            Some(e) if m.is_moe_layer(layer) => e.experts as u64 * m.expert_params(),
            _ => 0,
        };
        (
            (m.layer_params_at(layer) - experts) / par.tp as u64,
            experts / par.ep as u64,
        )
    }

    /// Bytes per gradient element in the data-parallel reduction.
    fn grad_bytes(&self) -> u64 {
        if self.job.parallel.grad_reduce_in_bf16 {
            2
        } else {
            GRAD_BYTES
        }
    }

    /// ZeRO-3: before computing layer `layers[i]` of a step (layers in compute order, `input`
    /// the op its input comes from), make sure its parameters are being gathered and prefetch
    /// the next layer's once the input is there, i.e. once the previous layer is done: at
    /// most two layers are gathered at a time (FSDP's and DeepSpeed's one-layer prefetch;
    /// [`crate::memory::ZERO3_GATHERED_LAYERS`]). The gather of `layers[i]` becomes the
    /// dependency of that layer's first op.
    fn zero3_prefetch(
        &mut self,
        g: &mut Zero3Gathers,
        layers: &[u32],
        i: usize,
        tag: OpTag,
        input: Option<u32>,
    ) {
        if !self.job.parallel.shards_params() {
            return;
        }
        let optag = Self::tag(Phase::Optimizer, tag.micro_batch, NONE);
        if i == 0 {
            g.next = self.zero3_gather(layers[0], optag, &[]);
        }
        let current = g.next.take();
        if i + 1 < layers.len() {
            g.next = self.zero3_gather(layers[i + 1], optag, &Self::deps(input));
        }
        self.zero3_ready = current;
    }

    /// All-gathers one layer's parameters (dense over DP, experts over expert-DP); the later
    /// of the two, or `None` when nothing needs gathering.
    fn zero3_gather(&mut self, layer: u32, tag: OpTag, deps: &[u32]) -> Option<u32> {
        let (dense, expert) = self.layer_param_split(layer);
        let tag = OpTag { layer, ..tag };
        let bytes = self.layer_param_gather_bytes();
        let (d, e) = self.data_parallel(Collective::AllGather, dense, expert, bytes, tag, deps);
        e.or(d)
    }

    /// Bytes per transformer-layer parameter in the data-parallel parameter gathers: 1 with
    /// FP8 gathers (`fp8_param_gather`), else BF16.
    fn layer_param_gather_bytes(&self) -> u64 {
        if self.job.parallel.fp8_param_gather {
            1
        } else {
            PARAM_BYTES
        }
    }

    /// The parameter all-gather of one distributed-optimizer bucket (dense over DP, experts
    /// over expert-DP): its layers at [`Self::layer_param_gather_bytes`], the embedding and
    /// LM head in BF16. Returns the later of the two ops.
    fn bucket_param_gather(&mut self, b: &Bucket, tag: OpTag, deps: &[u32]) -> Option<u32> {
        let saved = PARAM_BYTES - self.layer_param_gather_bytes();
        let (ld, le) = self.bucket_layer_params(b);
        let dense = b.dense * PARAM_BYTES - ld * saved;
        let expert = b.expert * PARAM_BYTES - le * saved;
        // Sizes in bytes already: one byte per "element".
        let (d, e) = self.data_parallel(Collective::AllGather, dense, expert, 1, tag, deps);
        e.or(d)
    }

    /// The transformer-layer parameters (dense, expert) among a bucket's items.
    fn bucket_layer_params(&self, b: &Bucket) -> (u64, u64) {
        b.items
            .iter()
            .filter_map(|item| match item {
                Item::Layer(l) => Some(self.layer_param_split(*l)),
                Item::Embedding | Item::LmHead => None,
            })
            .fold((0, 0), |(d, e), (ld, le)| (d + ld, e + le))
    }

    /// One data-parallel collective of `dense` and `expert` parameters' worth of `bytes_per`
    /// bytes each: the dense part over DP (x CP), then the expert part over expert-DP, both on
    /// the DP stream. Returns the ops (`None` where a part is empty or its group has one rank).
    fn data_parallel(
        &mut self,
        op: Collective,
        dense: u64,
        expert: u64,
        bytes_per: u64,
        tag: OpTag,
        deps: &[u32],
    ) -> (Option<u32>, Option<u32>) {
        let d = self.collective(GroupKind::Dp, op, dense * bytes_per, tag, deps);
        let e = self.collective(GroupKind::Edp, op, expert * bytes_per, tag, deps);
        (d, e)
    }

    fn is_last_chunk_on_stage(&self) -> bool {
        self.stage == self.job.parallel.pp - 1 || self.dualpipe() && self.stage == 0
    }

    /// With the distributed optimizer and `overlap_param_gather`, the iteration starts by
    /// gathering every parameter bucket (in forward order); each layer's first forward waits
    /// for its own bucket only.
    fn param_gather_at_start(&mut self) {
        let par = &self.job.parallel;
        if !(par.distributed_optimizer && par.overlap_param_gather) {
            return;
        }
        let tag = Self::tag(Phase::Optimizer, NONE, NONE);
        for b in self.buckets.clone().iter().rev() {
            // The later of the two (both on the DP stream) marks the bucket ready.
            if let Some(op) = self.bucket_param_gather(b, tag, &[]) {
                for item in &b.items {
                    match item {
                        Item::Layer(l) => {
                            self.param_ready.insert(*l, op);
                        }
                        Item::Embedding => self.embedding_param_ready = Some(op),
                        Item::LmHead => self.lm_head_param_ready = Some(op),
                    }
                }
            }
        }
    }

    /// Gradient reduction per bucket (overlapped with backward, or after it), optimizer step,
    /// and the parameter all-gather when it is not overlapped with the next forward.
    fn optimizer(&mut self) {
        let par = &self.job.parallel;
        let tag = Self::tag(Phase::Optimizer, NONE, NONE);
        let reduce = if par.distributed_optimizer {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        // A stage may run no kernel at all (an empty virtual stage of a layout on a rank
        // without embedding or loss); then it has no bucket either.
        let last_backward = self.prog.stream_ops[Stream::Compute as usize]
            .last()
            .copied();
        let mut dp_ops: Vec<u32> = self.last_micro_batch_reduce.into_iter().collect();
        for b in self.buckets.clone() {
            // The bucket is ready when its last item's gradient is final.
            let ready = b
                .items
                .iter()
                .map(|it| match it {
                    Item::Layer(l) => self.grad_ready[l],
                    Item::Embedding => self.embedding_grad_ready.expect("embedding backward"),
                    Item::LmHead => self.lm_head_grad_ready.expect("LM head backward"),
                })
                .max()
                .expect("non-empty bucket");
            // Aligned: the end of the backward step `stage` steps after the chunk's last one
            // (or the stage's last backward).
            let aligned = b.items.first().filter(|_| self.aligned_grad_reduce());
            let ready = match aligned.and_then(|item| {
                self.chunk_last_backward
                    .get(&(self.item_chunk(item) as u32))
            }) {
                Some(&k) => {
                    let at = (k + self.stage as usize).min(self.backward_ends.len() - 1);
                    ready.max(self.backward_ends[at])
                }
                None => ready,
            };
            let dep = match last_backward {
                Some(last) if !par.overlap_grad_reduce => last,
                _ => ready,
            };
            // With sharded gradients (ZeRO-2) the layers' gradients were reduce-scattered in
            // every micro-batch; what is left is the embedding's and LM head's. (ZeRO-3's
            // buckets hold no layers.)
            let (mut dense, mut expert) = (b.dense, b.expert);
            if par.shards_grads() {
                let (ld, le) = self.bucket_layer_params(&b);
                dense -= ld;
                expert -= le;
                if dense + expert == 0 {
                    continue;
                }
            }
            let bytes = self.grad_bytes();
            let (d, e) = self.data_parallel(reduce, dense, expert, bytes, tag, &[dep]);
            dp_ops.extend(d.into_iter().chain(e));
        }
        // The optimizer updates every parameter of the stage (the memory model's count), the
        // layers too under ZeRO-3 (whose buckets hold none).
        let held = crate::memory::stage_params(self.job, self.stage);
        let (local_dense, local_expert) = (held.dense, held.expert);
        let (shard_d, shard_e) = if par.distributed_optimizer {
            let dpcp = (par.dp * par.cp) as u64;
            let edp = (par.dp / par.ep * par.cp) as u64;
            (local_dense.div_ceil(dpcp), local_expert.div_ceil(edp))
        } else {
            (local_dense, local_expert)
        };
        // BF16 moments (DeepSeek-V3) move 8 bytes less per parameter, a BF16 model without
        // master weights 8 less again.
        let adam_bytes = self.job.adam_step_bytes_per_param();
        let opt = self.compute(
            "optimizer_step",
            OpClass::Optimizer,
            Self::mem((shard_d + shard_e) * adam_bytes),
            tag,
            &dp_ops,
        );
        if par.distributed_optimizer && !par.overlap_param_gather {
            for b in self.buckets.clone() {
                self.bucket_param_gather(&b, tag, &[opt]);
            }
        }
    }
}

/// Sizes of Megatron's unfused attention on one rank.
struct Unfused {
    /// Query positions.
    sq: u64,
    /// Key positions.
    skv: u64,
    /// Head width.
    dh: u64,
    /// Batched (sequence, head) pairs.
    bh: u64,
    /// Elements of the score matrix.
    scores: u64,
}

/// What a gradient bucket holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    Layer(u32),
    Embedding,
    LmHead,
}

/// ZeRO-3 gathers of one pipeline step in flight.
#[derive(Debug, Default)]
struct Zero3Gathers {
    /// The gather of the layer about to be computed.
    next: Option<u32>,
}

/// A gradient (and parameter) bucket of one stage.
#[derive(Clone, Debug, Default)]
struct Bucket {
    items: Vec<Item>,
    dense: u64,
    expert: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::small_job;

    fn count(steps: &[Step], fwd: bool) -> usize {
        steps.iter().filter(|s| s.forward == fwd).count()
    }

    /// Per-op checkpointing: the GEMMs the built graph recomputes (summed over one rank of
    /// every TP, CP and DP position) equal the closed form's recomputed FLOPs (hardware minus
    /// model FLOPs), with and without sequence parallelism; nothing else is recomputed as a
    /// GEMM, and the attention kernel never is.
    #[test]
    fn selective_op_recomputes_the_gemms_the_flop_count_says() {
        use crate::job::{Activation, Recompute};
        for (tp, sp, act) in [
            (1, false, Activation::SwiGlu),
            (2, true, Activation::SwiGlu),
            (2, false, Activation::SwiGlu),
            (2, true, Activation::Gelu),
        ] {
            let mut job = small_job(2, tp, 1, 32);
            job.model.activation = act;
            job.parallel.sequence_parallel = sp;
            job.parallel.recompute = Recompute::SelectiveOp;
            job.validate().unwrap();
            let g = ExecutionGraph::build(&job);
            let prog = &g.programs[0];
            let mut flops = 0.0;
            for (k, t) in prog.kind.iter().zip(&prog.tag) {
                if let OpKind::Compute(c) = k {
                    if t.phase != Phase::Recompute {
                        continue;
                    }
                    assert_ne!(c.class, OpClass::Attention, "{}", c.name);
                    if let Work::Gemm { m, n, k, batch } = c.work {
                        flops += 2.0 * (m * n * k * batch) as f64;
                    }
                }
            }
            let p = &job.parallel;
            let ranks = (p.tp * p.cp * p.dp) as f64;
            let expected = crate::flops::hardware_flops_per_iteration(&job)
                - crate::flops::model_flops_per_iteration(&job);
            assert!(
                expected > 0.0 && (flops * ranks - expected).abs() < 1e-9 * expected,
                "tp {tp} sp {sp} {act:?}: graph {} vs closed form {expected}",
                flops * ranks
            );
        }
    }

    #[test]
    fn op_estimate_equals_the_built_graph() {
        use crate::job::{Recompute, Schedule};
        // 2 nodes: dp 4 at tp 2 pp 2; micro-batches = global_batch / 4.
        for (sched, vpp, recompute, gb) in [
            (Schedule::OneFOneB, 1, Recompute::None, 4 * 37),
            (Schedule::GPipe, 1, Recompute::Full, 4 * 21),
            (Schedule::Interleaved, 2, Recompute::Selective, 4 * 24),
            (Schedule::OneFOneB, 1, Recompute::None, 4 * 3),
        ] {
            let mut job = small_job(2, 2, 2, gb);
            job.parallel.schedule = sched;
            job.parallel.vpp = vpp;
            job.parallel.recompute = recompute;
            job.validate().unwrap();
            let built = ExecutionGraph::build(&job).total_ops();
            assert_eq!(ExecutionGraph::estimate_ops(&job), built, "{sched:?}");
        }
        // The free lower bound holds on the leanest layouts.
        for (tp, pp) in [(1, 1), (1, 4), (2, 2), (8, 2)] {
            let mut job = small_job(2, tp, pp, 16 * 12);
            job.parallel.sequence_parallel = false;
            job.model.dropout = false;
            job.validate().unwrap();
            let built = ExecutionGraph::build(&job).total_ops();
            assert!(ExecutionGraph::min_ops(&job) <= built, "tp {tp} pp {pp}");
            assert_eq!(ExecutionGraph::estimate_ops(&job), built, "tp {tp} pp {pp}");
        }
        // The limit names the keys that drive the size.
        let mut big = small_job(2, 2, 2, 4 * 60_000);
        big.validate().unwrap();
        let e = size_check(&big).unwrap_err();
        assert!(
            e.contains("training.global_batch") && e.contains("parallel.micro_batch"),
            "{e}"
        );
        big.training.global_batch = 4 * 64;
        assert!(size_check(&big).is_ok());
    }

    #[test]
    fn schedules_cover_every_micro_batch_and_chunk_once() {
        for (kind, v) in [
            (Schedule::GPipe, 1),
            (Schedule::OneFOneB, 1),
            (Schedule::Interleaved, 2),
            (Schedule::Interleaved, 3),
        ] {
            for p in [1u32, 2, 4] {
                if kind == Schedule::Interleaved && p < 2 {
                    continue;
                }
                for stage in 0..p {
                    let m = 2 * p;
                    let s = schedule(kind, stage, p, m, v);
                    assert_eq!(count(&s, true), (m * v) as usize);
                    assert_eq!(count(&s, false), (m * v) as usize);
                    let mut seen = std::collections::BTreeSet::new();
                    for st in &s {
                        assert!(
                            seen.insert((st.forward, st.micro_batch, st.chunk)),
                            "{kind:?} duplicate {st:?}"
                        );
                        if !st.forward {
                            // A backward step never precedes its own forward.
                            let fpos = s
                                .iter()
                                .position(|x| {
                                    x.forward
                                        && x.micro_batch == st.micro_batch
                                        && x.chunk == st.chunk
                                })
                                .unwrap();
                            let bpos = s.iter().position(|x| x == st).unwrap();
                            assert!(fpos < bpos);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_warmup_depth() {
        let s = schedule(Schedule::OneFOneB, 0, 4, 8, 1);
        // Stage 0 of 4 runs 3 warmup forwards, then alternates.
        assert!(s[..4].iter().all(|x| x.forward));
        assert!(!s[4].forward);
        let last = schedule(Schedule::OneFOneB, 3, 4, 8, 1);
        assert!(last[0].forward && !last[1].forward);
    }

    #[test]
    fn every_send_has_a_receive_and_stages_share_programs() {
        let job = small_job(2, 2, 4, 16);
        let g = ExecutionGraph::build(&job);
        assert_eq!(g.programs.len(), 4);
        let sends: usize = g
            .programs
            .iter()
            .map(|p| p.stream_ops[Stream::PpSend as usize].len())
            .sum();
        let recvs: usize = g.programs.iter().map(|p| p.recv_slots as usize).sum();
        assert_eq!(sends, recvs);
        // Dependencies point backwards (the program is a DAG in op order).
        for p in &g.programs {
            for op in 0..p.len() as u32 {
                assert!(p.deps_of(op).iter().all(|&d| d < op));
            }
        }
    }

    /// DualPipe jobs exercising every deferred weight-gradient path: MLA, routed and shared
    /// experts, the LM head; tensor parallel with sequence parallelism (gathered weight
    /// gradients), with TP communication overlap, with ZeRO-3.
    fn dualpipe_variants() -> Vec<Job> {
        let mut out = Vec::new();
        for (tp, overlap, zero) in [(1, false, 1), (2, false, 1), (2, true, 1), (2, false, 3)] {
            let mut job = crate::arch::fixtures::small_deepseek_job(4, tp, 4, 8 * 16 / tp, 2);
            job.parallel.schedule = Schedule::DualPipe;
            job.parallel.tp_comm_overlap = overlap;
            job.parallel.set_zero_stage(zero);
            job.model.arch.mtp_depth = 1;
            job.validate()
                .unwrap_or_else(|e| panic!("tp {tp} zero {zero}: {e}"));
            out.push(job);
        }
        out
    }

    /// Truth (the split's data dependencies): on every stage of a DualPipe job, each deferred
    /// weight-gradient op (`Phase::Weight`) comes after every backward op of its micro-batch
    /// and layer (its input-gradient step) and depends on nothing later; the op a layer's
    /// gradient bucket waits for (`grad_ready`) comes after every backward and weight op of
    /// that layer on the compute stream, and the LM head's after every `lm_head_wgrad`, so the
    /// data-parallel reduction waits for all weight gradients; with ZeRO-3 each layer's
    /// per-micro-batch reduce-scatter waits for the layer's last weight op of that
    /// micro-batch.
    #[test]
    fn deferred_weight_gradients_keep_their_dependencies() {
        for job in dualpipe_variants() {
            let p = job.parallel.pp;
            for stage in 0..p {
                let mut b = StageBuilder::new(&job, stage);
                b.build();
                let prog = &b.prog;
                let compute = |op: u32| prog.stream[op as usize] == Stream::Compute;
                let mut weights = 0;
                for op in 0..prog.len() as u32 {
                    let t = prog.tag[op as usize];
                    if t.phase != Phase::Weight {
                        continue;
                    }
                    weights += 1;
                    let last_b = (0..op)
                        .filter(|&x| {
                            let u = prog.tag[x as usize];
                            u.phase == Phase::Backward
                                && (u.micro_batch, u.layer) == (t.micro_batch, t.layer)
                        })
                        .max();
                    assert!(last_b.is_some(), "stage {stage} op {op}: a W before its B");
                    assert!(
                        (op + 1..prog.len() as u32).all(|x| {
                            let u = prog.tag[x as usize];
                            !(u.phase == Phase::Backward
                                && (u.micro_batch, u.layer) == (t.micro_batch, t.layer))
                        }),
                        "stage {stage}: backward after its weight gradient"
                    );
                }
                assert!(weights > 0, "stage {stage}: no deferred weight gradient");
                for (&layer, &ready) in &b.grad_ready {
                    assert!(compute(ready));
                    let last = (0..prog.len() as u32)
                        .filter(|&x| {
                            let u = prog.tag[x as usize];
                            compute(x)
                                && u.layer == layer
                                && matches!(u.phase, Phase::Backward | Phase::Weight)
                        })
                        .max()
                        .unwrap();
                    assert!(
                        ready >= last,
                        "stage {stage} layer {layer}: {ready} < {last}"
                    );
                }
                if let Some(ready) = b.lm_head_grad_ready {
                    for x in 0..prog.len() as u32 {
                        if let OpKind::Compute(c) = &prog.kind[x as usize]
                            && c.name == "lm_head_wgrad"
                        {
                            assert!(ready >= x, "stage {stage}: LM head");
                        }
                    }
                }
                if job.parallel.shards_params() {
                    // Every per-micro-batch gradient reduce-scatter of a layer waits for
                    // that micro-batch's last compute op of the layer.
                    for x in 0..prog.len() as u32 {
                        let u = prog.tag[x as usize];
                        if u.phase != Phase::Optimizer || u.layer == NONE || u.micro_batch == NONE {
                            continue;
                        }
                        if !matches!(
                            prog.kind[x as usize],
                            OpKind::Collective {
                                op: Collective::ReduceScatter,
                                ..
                            }
                        ) {
                            continue;
                        }
                        let last = (0..x)
                            .filter(|&y| {
                                let v = prog.tag[y as usize];
                                compute(y)
                                    && (v.micro_batch, v.layer) == (u.micro_batch, u.layer)
                                    && matches!(v.phase, Phase::Backward | Phase::Weight)
                            })
                            .max();
                        let w_after = (x + 1..prog.len() as u32).any(|y| {
                            let v = prog.tag[y as usize];
                            v.phase == Phase::Weight
                                && (v.micro_batch, v.layer) == (u.micro_batch, u.layer)
                        });
                        assert!(last.is_some() && !w_after, "stage {stage} op {x}");
                        assert!(
                            prog.deps_of(x).contains(&last.unwrap()),
                            "stage {stage} op {x}"
                        );
                    }
                }
            }
        }
    }
}
