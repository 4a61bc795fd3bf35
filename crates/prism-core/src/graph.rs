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
//!   router, all-to-all dispatch, expert GEMMs, all-to-all combine; (all-reduce/reduce-scatter),
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

use crate::cost::comm::Collective;
use crate::job::{Activation, Job, Recompute, Schedule};
use crate::layout::{GroupKind, Layout};
use crate::ops::{ComputeOp, OpClass, Work};

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
#[derive(Clone, Debug, Default)]
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

    fn push(&mut self, kind: OpKind, stream: Stream, tag: OpTag, deps: &[u32]) -> u32 {
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
#[derive(Clone, Debug)]
pub struct ExecutionGraph {
    /// Rank layout.
    pub layout: Layout,
    /// One program per pipeline stage.
    pub programs: Vec<Program>,
}

impl ExecutionGraph {
    /// The program `rank` runs.
    pub fn program_of(&self, rank: u32) -> &Program {
        &self.programs[self.layout.coord(rank).pp as usize]
    }

    /// Builds the graph of a validated job.
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
        ExecutionGraph {
            layout,
            programs: builders.into_iter().map(|b| b.prog).collect(),
        }
    }
}

/// Identifies a pipeline message: direction, micro-batch and the receiving model chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct MsgTag {
    backward: bool,
    micro_batch: u32,
    chunk: u32,
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
    let fwd = |k: u32| Step {
        forward: true,
        micro_batch: (k / (p * v)) * p + k % p,
        chunk: (k % (p * v)) / p,
    };
    let bwd = |k: u32| Step {
        forward: false,
        micro_batch: (k / (p * v)) * p + k % p,
        chunk: v - 1 - (k % (p * v)) / p,
    };
    let mut out = Vec::with_capacity(2 * total as usize);
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
        Schedule::OneFOneB | Schedule::Interleaved => {
            let warmup = if v == 1 {
                (p - stage - 1).min(m)
            } else {
                ((p - stage - 1) * 2 + (v - 1) * p).min(total)
            };
            type StepFn<'a> = Box<dyn Fn(u32) -> Step + 'a>;
            let (fwd, bwd): (StepFn, StepFn) = if v == 1 {
                (
                    Box::new(|k| Step {
                        forward: true,
                        micro_batch: k,
                        chunk: 0,
                    }),
                    Box::new(|k| Step {
                        forward: false,
                        micro_batch: k,
                        chunk: 0,
                    }),
                )
            } else {
                (Box::new(fwd), Box::new(bwd))
            };
            for k in 0..warmup {
                out.push(fwd(k));
            }
            for j in 0..total - warmup {
                out.push(fwd(warmup + j));
                out.push(bwd(j));
            }
            for j in total - warmup..total {
                out.push(bwd(j));
            }
        }
    }
    out
}

const ACT_BYTES: u64 = 2; // bf16 activations
const GRAD_BYTES: u64 = 4; // fp32 gradient reduction (Megatron accumulates and reduces in fp32 for bf16)
const PARAM_BYTES: u64 = 2; // bf16 parameters gathered by the distributed optimizer
const ADAM_BYTES_PER_PARAM: u64 = 30; // read grad 4, r/w master 8, r/w m 8, r/w v 8, write bf16 param 2

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
    embedding_grad_ready: Option<u32>,
    /// Last op issued that a following send must wait for (blocking P2P of plain 1F1B).
    blocking_send: Option<u32>,
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
}

impl<'a> StageBuilder<'a> {
    fn new(job: &'a Job, stage: u32) -> Self {
        let p = job.parallel.pp;
        let v = job.parallel.vpp;
        let stage_layers = job.stage_layers();
        let chunk_layers = if v == 1 {
            let start: u32 = stage_layers[..stage as usize].iter().sum();
            std::iter::once(start..start + stage_layers[stage as usize]).collect()
        } else {
            let per = job.model.layers / (p * v);
            (0..v)
                .map(|c| (c * p + stage) * per..(c * p + stage + 1) * per)
                .collect()
        };
        StageBuilder {
            job,
            stage,
            prog: Program::default(),
            recvs: Vec::new(),
            sends: Vec::new(),
            chunk_layers,
            grad_ready: BTreeMap::new(),
            lm_head_grad_ready: None,
            embedding_grad_ready: None,
            blocking_send: None,
        }
    }

    fn dims(&self) -> Dims {
        let j = self.job;
        let par = &j.parallel;
        let m = &j.model;
        let t = par.micro_batch as u64 * m.seq_len as u64 / par.cp as u64;
        let tp = par.tp as u64;
        let sp = par.sequence_parallel && tp > 1;
        Dims {
            t,
            t_sp: if sp { t / tp } else { t },
            h: m.hidden as u64,
            tp,
            q_local: m.heads as u64 / tp * m.head_dim as u64,
            kv_local: m.kv_heads as u64 / tp * m.head_dim as u64,
            ffn_local: m.ffn_hidden as u64 / tp,
            sp,
        }
    }

    fn is_first_chunk(&self, chunk: u32) -> bool {
        self.stage == 0 && chunk == 0
    }

    fn is_last_chunk(&self, chunk: u32) -> bool {
        self.stage == self.job.parallel.pp - 1 && chunk == self.job.parallel.vpp - 1
    }

    fn build(&mut self) {
        let j = self.job;
        let par = &j.parallel;
        let m = j.micro_batches() as u32;
        let steps = schedule(par.schedule, self.stage, par.pp, m, par.vpp);
        for step in steps {
            if step.forward {
                self.forward_step(step.micro_batch, step.chunk, m);
            } else {
                self.backward_step(step.micro_batch, step.chunk, m);
            }
        }
        self.optimizer();
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
        let deps = self.with_blocking(deps);
        let recompute = tag.phase == Phase::Recompute;
        self.prog.push(
            OpKind::Compute(ComputeOp {
                name,
                class,
                work,
                recompute,
            }),
            Stream::Compute,
            tag,
            &deps,
        )
    }

    /// With plain 1F1B, Megatron's P2P is blocking: the next kernel waits for the last send.
    fn with_blocking(&mut self, deps: &[u32]) -> Vec<u32> {
        let mut v = deps.to_vec();
        if let Some(s) = self.blocking_send.take() {
            v.push(s);
        }
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

    fn mem(bytes: u64) -> Work {
        Work::Memory { bytes }
    }

    fn gemm(m: u64, n: u64, k: u64) -> Work {
        Work::Gemm { m, n, k, batch: 1 }
    }

    fn forward_step(&mut self, mb: u32, chunk: u32, _m: u32) {
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
        let layers = self.chunk_layers[chunk as usize].clone();
        for layer in layers {
            cur = Some(self.layer_forward(mb, layer, cur, Phase::Forward));
        }
        if self.is_last_chunk(chunk) {
            self.lm_head_forward(mb, cur);
        } else {
            self.send_activation(mb, chunk, cur);
        }
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
        let d = self.dims();
        let p = self.job.parallel.pp;
        let target = ((self.stage + p) as i64 + delta as i64) as u32 % p;
        // Activations (or their gradients) of one micro-batch: [t_sp x h] per rank with SP,
        // [t x h] without (Megatron's scatter-gather optimisation sends 1/tp of it and
        // all-gathers over NVLink; we model the SP-sharded size, which is what crosses the NIC).
        let bytes = d.t / d.tp.max(1) * d.h * ACT_BYTES;
        let bytes = if d.sp {
            d.t_sp * d.h * ACT_BYTES
        } else {
            bytes
        };
        let op = self.prog.push(
            OpKind::Send {
                delta,
                bytes,
                slot: u32::MAX,
            },
            Stream::PpSend,
            optag,
            &Self::deps(cur),
        );
        self.sends.push((op, target, tag));
        if self.job.parallel.schedule != Schedule::Interleaved {
            self.blocking_send = Some(op);
        }
    }

    fn send_activation(&mut self, mb: u32, chunk: u32, cur: Option<u32>) {
        let p = self.job.parallel.pp;
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
        let prev_chunk = if self.stage == 0 { chunk - 1 } else { chunk };
        let tag = MsgTag {
            backward: true,
            micro_batch: mb,
            chunk: prev_chunk,
        };
        self.send(-1, tag, Self::tag(Phase::Backward, mb, NONE), cur);
    }

    /// Forward of one transformer layer; returns the op producing its output.
    fn layer_forward(&mut self, mb: u32, layer: u32, input: Option<u32>, phase: Phase) -> u32 {
        let d = self.dims();
        let m = &self.job.model;
        let tag = Self::tag(phase, mb, layer);
        let tp_in = if d.sp {
            Some(Collective::AllGather)
        } else {
            None
        };
        let tp_out = if d.tp > 1 {
            Some(if d.sp {
                Collective::ReduceScatter
            } else {
                Collective::AllReduce
            })
        } else {
            None
        };
        let act = d.t * d.h * ACT_BYTES;
        // Attention block.
        let n1 = self.compute(
            "norm1_fwd",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &Self::deps(input),
        );
        let mut cur = n1;
        if let Some(op) = tp_in {
            cur = self
                .collective(GroupKind::Tp, op, act, tag, &[cur])
                .unwrap_or(cur);
        }
        let qkv = self.compute(
            "qkv_fwd",
            OpClass::Gemm,
            Self::gemm(d.t, d.q_local + 2 * d.kv_local, d.h),
            tag,
            &[cur],
        );
        cur = qkv;
        let cp = self.job.parallel.cp as u64;
        if cp > 1 {
            let kv_bytes = self.job.parallel.micro_batch as u64
                * m.seq_len as u64
                * 2
                * d.kv_local
                * ACT_BYTES;
            cur = self
                .collective(GroupKind::Cp, Collective::AllGather, kv_bytes, tag, &[cur])
                .unwrap_or(cur);
        }
        let attn = self.compute(
            "attention_fwd",
            OpClass::Attention,
            self.attention_work(false),
            tag,
            &[cur],
        );
        let proj = self.compute(
            "out_proj_fwd",
            OpClass::Gemm,
            Self::gemm(d.t, d.h, d.q_local),
            tag,
            &[attn],
        );
        cur = proj;
        if let Some(op) = tp_out {
            cur = self
                .collective(GroupKind::Tp, op, act, tag, &[cur])
                .unwrap_or(cur);
        }
        let res1 = self.compute(
            "residual1_fwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[cur],
        );
        let n2 = self.compute(
            "norm2_fwd",
            OpClass::Norm,
            Self::mem(2 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[res1],
        );
        cur = n2;
        // MLP block.
        if let Some(moe) = &self.job.model.moe {
            let ep = self.job.parallel.ep as u64;
            let local_experts = moe.experts as u64 / ep;
            let pairs = d.t_sp * moe.top_k as u64;
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
                &[cur],
            );
            let a2a_bytes = pairs * d.h * ACT_BYTES;
            cur = self
                .collective(
                    GroupKind::Ep,
                    Collective::AllToAll,
                    a2a_bytes,
                    tag,
                    &[router],
                )
                .unwrap_or(router);
            let fc1 = self.compute(
                "expert_fc1_fwd",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: n_fc1,
                    k: d.h,
                    batch: local_experts,
                },
                tag,
                &[cur],
            );
            let _ = fc1;
            self.compute(
                "expert_act_fwd",
                OpClass::Elementwise,
                Self::mem(3 * pairs * fe * ACT_BYTES),
                tag,
                &[],
            );
            let fc2 = self.compute(
                "expert_fc2_fwd",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: d.h,
                    k: fe,
                    batch: local_experts,
                },
                tag,
                &[],
            );
            cur = self
                .collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[fc2])
                .unwrap_or(fc2);
        } else {
            if let Some(op) = tp_in {
                cur = self
                    .collective(GroupKind::Tp, op, act, tag, &[cur])
                    .unwrap_or(cur);
            }
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * d.ffn_local
            } else {
                d.ffn_local
            };
            self.compute(
                "fc1_fwd",
                OpClass::Gemm,
                Self::gemm(d.t, n_fc1, d.h),
                tag,
                &[cur],
            );
            self.compute(
                "act_fwd",
                OpClass::Elementwise,
                Self::mem((n_fc1 + d.ffn_local) * d.t * ACT_BYTES),
                tag,
                &[],
            );
            let fc2 = self.compute(
                "fc2_fwd",
                OpClass::Gemm,
                Self::gemm(d.t, d.h, d.ffn_local),
                tag,
                &[],
            );
            cur = fc2;
            if let Some(op) = tp_out {
                cur = self
                    .collective(GroupKind::Tp, op, act, tag, &[cur])
                    .unwrap_or(cur);
            }
        }
        self.compute(
            "residual2_fwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[cur],
        )
    }

    fn attention_work(&self, backward: bool) -> Work {
        let m = &self.job.model;
        let par = &self.job.parallel;
        let cp = par.cp as u64;
        let s = m.seq_len as u64;
        // With load-balanced context parallelism each rank computes 1/cp of the causal score
        // matrix: s/cp queries against s/2 keys on average (no mask), the same FLOPs.
        let (seq_kv, causal) = if cp > 1 { (s / 2, false) } else { (s, true) };
        Work::Attention {
            batch: par.micro_batch as u64,
            heads: m.heads as u64 / par.tp as u64,
            seq_q: s / cp,
            seq_kv,
            head_dim: m.head_dim as u64,
            causal,
            backward,
        }
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
        // Vocab-parallel cross entropy: max and sum-exp all-reduces of one float per token.
        let loss = self.compute(
            "loss_fwd",
            OpClass::Loss,
            Self::mem(3 * d.t * v_local * 4),
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

    fn backward_step(&mut self, mb: u32, chunk: u32, m: u32) {
        let d = self.dims();
        let tag = Self::tag(Phase::Backward, mb, NONE);
        let last_mb = mb == m - 1;
        let mut cur: Option<u32>;
        if self.is_last_chunk(chunk) {
            let v_local = self.job.model.vocab as u64 / d.tp;
            let lb = self.compute(
                "loss_bwd",
                OpClass::Loss,
                Self::mem(2 * d.t * v_local * 4),
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
                let wg = self.compute(
                    "lm_head_wgrad",
                    OpClass::Gemm,
                    Self::gemm(v_local, d.h, d.t),
                    tag,
                    &[],
                );
                c = op.unwrap_or(wg);
                wg
            } else {
                self.compute(
                    "lm_head_wgrad",
                    OpClass::Gemm,
                    Self::gemm(v_local, d.h, d.t),
                    tag,
                    &[],
                )
            };
            if last_mb {
                self.lm_head_grad_ready = Some(wg);
            }
            let nb = self.compute(
                "final_norm_bwd",
                OpClass::Norm,
                Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
                tag,
                &[c],
            );
            cur = Some(nb);
        } else {
            cur = Some(self.recv(
                MsgTag {
                    backward: true,
                    micro_batch: mb,
                    chunk,
                },
                tag,
            ));
        }
        let layers = self.chunk_layers[chunk as usize].clone();
        for layer in layers.rev() {
            if self.job.parallel.recompute == Recompute::Full {
                self.layer_forward(mb, layer, cur, Phase::Recompute);
            }
            let out = self.layer_backward(mb, layer, cur);
            cur = Some(out.0);
            if last_mb {
                self.grad_ready.insert(layer, out.1);
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
    }

    /// Backward of a TP-sharded linear layer whose input was gathered (SP) or replicated:
    /// data-gradient GEMM, then the input-gradient reduction overlapping the weight-gradient
    /// GEMM. Returns (op producing the input gradient, weight-gradient op).
    #[allow(clippy::too_many_arguments)]
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
        if d.sp {
            // Megatron: all-gather the SP input for the weight gradient while the data gradient runs,
            // then reduce-scatter the input gradient while the weight gradient runs.
            let ag = self.collective(
                GroupKind::Tp,
                Collective::AllGather,
                reduce_bytes,
                tag,
                &[grad_in],
            );
            let dg = self.compute(names.0, OpClass::Gemm, dgrad, tag, &[grad_in]);
            let rs = self.collective(
                GroupKind::Tp,
                Collective::ReduceScatter,
                reduce_bytes,
                tag,
                &[dg],
            );
            let ag_dep: Vec<u32> = ag.into_iter().collect();
            let wg = self.compute(names.1, OpClass::Gemm, wgrad, tag, &ag_dep);
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
            let wg = self.compute(names.1, OpClass::Gemm, wgrad, tag, &[]);
            (ar.unwrap_or(wg), wg)
        }
    }

    /// Backward of one layer; returns (op producing the input gradient, last weight-gradient op).
    fn layer_backward(&mut self, mb: u32, layer: u32, grad: Option<u32>) -> (u32, u32) {
        let d = self.dims();
        let m = &self.job.model;
        let tag = Self::tag(Phase::Backward, mb, layer);
        let act = d.t * d.h * ACT_BYTES;
        let r2 = self.compute(
            "residual2_bwd",
            OpClass::Elementwise,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &Self::deps(grad),
        );
        let mut cur = r2;
        let last_wgrad;
        // MLP block.
        if let Some(moe) = &self.job.model.moe {
            let ep = self.job.parallel.ep as u64;
            let local_experts = moe.experts as u64 / ep;
            let pairs = d.t_sp * moe.top_k as u64;
            let per_expert = (pairs * ep).div_ceil(moe.experts as u64);
            let fe = moe.ffn_hidden as u64;
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * fe
            } else {
                fe
            };
            let a2a_bytes = pairs * d.h * ACT_BYTES;
            cur = self
                .collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[cur])
                .unwrap_or(cur);
            self.compute(
                "expert_fc2_dgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: fe,
                    k: d.h,
                    batch: local_experts,
                },
                tag,
                &[cur],
            );
            self.compute(
                "expert_fc2_wgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: fe,
                    n: d.h,
                    k: per_expert,
                    batch: local_experts,
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
            let dg = self.compute(
                "expert_fc1_dgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: per_expert,
                    n: d.h,
                    k: n_fc1,
                    batch: local_experts,
                },
                tag,
                &[],
            );
            let a2a = self.collective(GroupKind::Ep, Collective::AllToAll, a2a_bytes, tag, &[dg]);
            let wg = self.compute(
                "expert_fc1_wgrad",
                OpClass::Gemm,
                Work::Gemm {
                    m: n_fc1,
                    n: d.h,
                    k: per_expert,
                    batch: local_experts,
                },
                tag,
                &[],
            );
            let rb = self.compute(
                "router_bwd",
                OpClass::Router,
                Self::gemm(d.t_sp, d.h, moe.experts as u64),
                tag,
                &Self::deps(a2a),
            );
            last_wgrad = wg;
            cur = rb;
        } else {
            if d.sp {
                cur = self
                    .collective(GroupKind::Tp, Collective::AllGather, act, tag, &[cur])
                    .unwrap_or(cur);
            }
            let n_fc1 = if m.activation == Activation::SwiGlu {
                2 * d.ffn_local
            } else {
                d.ffn_local
            };
            self.compute(
                "fc2_dgrad",
                OpClass::Gemm,
                Self::gemm(d.t, d.ffn_local, d.h),
                tag,
                &[cur],
            );
            self.compute(
                "fc2_wgrad",
                OpClass::Gemm,
                Self::gemm(d.ffn_local, d.h, d.t),
                tag,
                &[],
            );
            let ab = self.compute(
                "act_bwd",
                OpClass::Elementwise,
                Self::mem((2 * n_fc1 + d.ffn_local) * d.t * ACT_BYTES),
                tag,
                &[],
            );
            let (g, wg) = self.linear_backward_in(
                ("fc1_dgrad", "fc1_wgrad"),
                Self::gemm(d.t, d.h, n_fc1),
                Self::gemm(n_fc1, d.h, d.t),
                tag,
                ab,
                act,
            );
            last_wgrad = wg;
            cur = g;
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
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[nb2],
        );
        cur = r1;
        // Attention block.
        if d.sp {
            cur = self
                .collective(GroupKind::Tp, Collective::AllGather, act, tag, &[cur])
                .unwrap_or(cur);
        }
        self.compute(
            "out_proj_dgrad",
            OpClass::Gemm,
            Self::gemm(d.t, d.q_local, d.h),
            tag,
            &[cur],
        );
        let opw = self.compute(
            "out_proj_wgrad",
            OpClass::Gemm,
            Self::gemm(d.q_local, d.h, d.t),
            tag,
            &[],
        );
        let _ = opw;
        if self.job.parallel.recompute == Recompute::Selective {
            let rtag = Self::tag(Phase::Recompute, mb, layer);
            self.compute(
                "attention_recompute",
                OpClass::Attention,
                self.attention_work(false),
                rtag,
                &[],
            );
        }
        let ab = self.compute(
            "attention_bwd",
            OpClass::Attention,
            self.attention_work(true),
            tag,
            &[],
        );
        let mut after_attn = ab;
        let cp = self.job.parallel.cp as u64;
        if cp > 1 {
            let kv_bytes = self.job.parallel.micro_batch as u64
                * m.seq_len as u64
                * 2
                * d.kv_local
                * ACT_BYTES;
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
        let (g, qkv_wg) = self.linear_backward_in(
            ("qkv_dgrad", "qkv_wgrad"),
            Self::gemm(d.t, d.h, d.q_local + 2 * d.kv_local),
            Self::gemm(d.q_local + 2 * d.kv_local, d.h, d.t),
            tag,
            after_attn,
            act,
        );
        let _ = last_wgrad;
        let nb1 = self.compute(
            "norm1_bwd",
            OpClass::Norm,
            Self::mem(3 * d.t_sp * d.h * ACT_BYTES),
            tag,
            &[g],
        );
        // The layer's gradients are complete once both its last weight-gradient GEMM and the
        // norm backward ran; the norm runs after it on the compute stream.
        let _ = qkv_wg;
        (nb1, nb1)
    }

    /// Gradient buckets in the order backward completes them, then optimizer and parameter gather.
    fn optimizer(&mut self) {
        let j = self.job;
        let m = &j.model;
        let par = &j.parallel;
        let tp = par.tp as u64;
        let tag = Self::tag(Phase::Optimizer, NONE, NONE);
        let bucket_params = (par.dp_bucket_mparams * 1e6).max(1.0) as u64;
        let dense_layer = (m.layer_params()
            - m.moe
                .as_ref()
                .map_or(0, |e| e.experts as u64 * m.expert_params()))
            / tp;
        let expert_layer = m
            .moe
            .as_ref()
            .map_or(0, |e| e.experts as u64 / par.ep as u64 * m.expert_params());
        let emb = m.vocab as u64 * m.hidden as u64 / tp;
        // (ready op, dense params, expert params), in the order gradients become final.
        let mut items: Vec<(u32, u64, u64)> = Vec::new();
        if let Some(op) = self.lm_head_grad_ready {
            let lm = if m.tied_embeddings && par.pp == 1 {
                0
            } else {
                emb
            };
            items.push((op, lm, 0));
        }
        // Backward visits chunks from last to first and layers from last to first.
        for (&_layer, &op) in self.grad_ready.iter().rev() {
            items.push((op, dense_layer, expert_layer));
        }
        if let Some(op) = self.embedding_grad_ready {
            items.push((op, emb, 0));
        }
        items.sort_by_key(|&(op, _, _)| op);
        let reduce = if par.distributed_optimizer {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        let mut dp_ops: Vec<u32> = Vec::new();
        let mut buckets: Vec<(u64, u64)> = Vec::new();
        let (mut acc_d, mut acc_e) = (0u64, 0u64);
        let n = items.len();
        for (i, &(op, dense, expert)) in items.iter().enumerate() {
            acc_d += dense;
            acc_e += expert;
            if acc_d + acc_e >= bucket_params || i == n - 1 {
                if let Some(c) =
                    self.collective(GroupKind::Dp, reduce, acc_d * GRAD_BYTES, tag, &[op])
                {
                    dp_ops.push(c);
                }
                if let Some(c) =
                    self.collective(GroupKind::Edp, reduce, acc_e * GRAD_BYTES, tag, &[op])
                {
                    dp_ops.push(c);
                }
                buckets.push((acc_d, acc_e));
                acc_d = 0;
                acc_e = 0;
            }
        }
        let local_dense: u64 = buckets.iter().map(|b| b.0).sum();
        let local_expert: u64 = buckets.iter().map(|b| b.1).sum();
        let (shard_d, shard_e) = if par.distributed_optimizer {
            let dpcp = (par.dp * par.cp) as u64;
            let edp = (par.dp / par.ep * par.cp) as u64;
            (local_dense.div_ceil(dpcp), local_expert.div_ceil(edp))
        } else {
            (local_dense, local_expert)
        };
        let opt = self.compute(
            "optimizer_step",
            OpClass::Optimizer,
            Self::mem((shard_d + shard_e) * ADAM_BYTES_PER_PARAM),
            tag,
            &dp_ops,
        );
        if par.distributed_optimizer {
            for &(bd, be) in &buckets {
                self.collective(
                    GroupKind::Dp,
                    Collective::AllGather,
                    bd * PARAM_BYTES,
                    tag,
                    &[opt],
                );
                self.collective(
                    GroupKind::Edp,
                    Collective::AllGather,
                    be * PARAM_BYTES,
                    tag,
                    &[opt],
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::small_job;

    fn count(steps: &[Step], fwd: bool) -> usize {
        steps.iter().filter(|s| s.forward == fwd).count()
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
}
