//! Memory model: bytes each GPU of a pipeline stage holds at its peak.
//!
//! Model and optimizer state follow Megatron-LM mixed-precision training with Adam:
//!
//! | state | bytes / parameter | sharded over |
//! |---|---|---|
//! | BF16 weights | 2 | tp (and ep for experts) |
//! | main gradients: FP32 (Megatron accumulates and reduces BF16 jobs' gradients in FP32), 16-bit where Megatron reduces in 16 bits (FP16 jobs, `grad_reduce_in_bf16`) | 4 or 2 ([`Job::grad_accum_bytes`]) | tp (ep), and with ZeRO-2/3 also dp x cp |
//! | FP32 master weights + Adam first and second moments | 4 + 4 + 4 = 12 (2 + 4 + 4 with the masters kept as remainders, [`crate::job::Training::master_weight_remainders`]) | tp (ep), and with the distributed optimizer also dp x cp (experts: dp / ep x cp) |
//!
//! A BF16 model trained without master weights ([`crate::job::Training::master_weights`] off:
//! PyTorch optimizers on a model cast to BF16) holds BF16 gradients (2) and only the moments
//! (4 + 4, or 2 + 2 in BF16) as optimizer state: [`Job::grad_accum_bytes`],
//! [`Job::optimizer_bytes_per_param`].
//!
//! Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//! Transformer Models" (Section 4), generalized per tensor to grouped-query attention and
//! gated MLPs (see [`activation_bytes_per_layer`]), times the micro-batches the pipeline
//! schedule keeps in flight (see [`in_flight_microbatches`]).
//!
//! Conventions and simplifications, all per GPU:
//! * Layer norm weights and the MoE router are replicated across tensor parallelism (as in
//!   Megatron); attention, MLP, embedding and LM head weights are split over `tp`; experts are
//!   split over `ep` and then over `tp` (Megatron-Core's default expert tensor parallel size is
//!   `tp`). The vocabulary is not padded.
//! * The input embedding lives on the first stage, the final norm and LM head on the last. With
//!   tied embeddings and more than one stage both stages hold a copy (Megatron keeps the copies
//!   in sync with an all-reduce); with one stage it is held once.
//! * FP8 training (Transformer Engine) is modelled with the same BF16 weights; its cached FP8
//!   weight copies (a weight and its transpose, 2 bytes per element, kept across micro-batches
//!   with [`crate::job::Training::fp8_weight_cache`]) are not counted.
//! * [`WORKSPACE_BYTES`] is reserved for everything not modelled tensor by tensor.
//! * DeepSeek-V3's memory savings ([`crate::job::MemorySaving`]): BF16 Adam moments (8 bytes
//!   of optimizer state per parameter), norm and MLA up-projection recomputation and FP8
//!   activation caching (see [`layer_activation_bytes_at`]).

use crate::job::{Job, Recompute, Schedule, Zero3Sync};

/// Fixed reserve per GPU for the CUDA context and cuBLAS/cuDNN workspaces (~0.5 GiB together),
/// NCCL communication buffers (a few hundred MiB with several communicators) and caching
/// allocator fragmentation: 1 GiB.
pub const WORKSPACE_BYTES: u64 = 1 << 30;
/// Bytes per parameter of the BF16 weights.
pub const WEIGHT_BYTES_PER_PARAM: u64 = 2;
/// Bytes per parameter of the optimizer state: FP32 master weights + Adam's two FP32 moments
/// (8 with BF16 moments, [`crate::job::OptimizerStateDtype::Bf16`]).
pub const OPTIMIZER_BYTES_PER_PARAM: u64 = 12;

/// Bytes one GPU holds, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// BF16 model weights.
    pub weights: u64,
    /// Main gradients (FP32, or 16-bit: [`Job::grad_accum_bytes`]).
    pub gradients: u64,
    /// Optimizer state (FP32 master weights and Adam moments), after sharding.
    pub optimizer: u64,
    /// Activations kept for the backward pass at the schedule's peak.
    pub activations: u64,
    /// Fixed reserve ([`WORKSPACE_BYTES`]).
    pub workspace: u64,
}

impl MemoryBreakdown {
    /// Sum of all kinds, bytes.
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.workspace
    }
}

/// Parameters one GPU of a stage holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageParams {
    /// Parameters whose gradients are reduced over the dense data-parallel group (`dp x cp`):
    /// attention, dense MLP, norms, router, embedding, LM head.
    pub dense: u64,
    /// Expert parameters, reduced over the expert-data-parallel group (`dp / ep x cp`).
    pub expert: u64,
}

impl StageParams {
    /// All parameters on the GPU.
    pub fn total(&self) -> u64 {
        self.dense + self.expert
    }
}

/// Parameters of transformer layer `l` (0-based, whole model) on one GPU after tensor and
/// expert parallelism: attention and norms, then a dense MLP, or a MoE layer's router and
/// shared experts (dense) and its local routed experts (expert).
pub fn layer_params_at(job: &Job, l: u32) -> StageParams {
    let m = &job.model;
    let tp = job.parallel.tp as u64;
    let h = m.hidden as u64;
    let (mlp_dense, expert) = match &m.moe {
        Some(moe) if m.is_moe_layer(l) => {
            let router = h * moe.experts as u64;
            let local_experts = moe.experts as u64 / job.parallel.ep as u64;
            (
                router + m.shared_expert_params().div_ceil(tp),
                (local_experts * m.expert_params()).div_ceil(tp),
            )
        }
        _ => (m.dense_mlp_params().div_ceil(tp), 0),
    };
    StageParams {
        dense: m.attention_params().div_ceil(tp) + 2 * h + mlp_dense,
        expert,
    }
}

/// Parameters one GPU of pipeline stage `stage` holds (see the module docs for what is split
/// how).
pub fn stage_params(job: &Job, stage: u32) -> StageParams {
    let m = &job.model;
    let p = &job.parallel;
    let tp = p.tp as u64;
    let h = m.hidden as u64;
    let layers = job.stage_layers()[stage as usize] as u64;
    // DualPipe: both end ranks hold the embedding and the head (of opposite directions).
    let dual = p.schedule == Schedule::DualPipe;
    let last = stage + 1 == p.pp || dual && stage == 0;
    let first = stage == 0 || dual && stage + 1 == p.pp;

    // (dense, expert) parameters of layer `l` on one GPU.
    let split = |l: u32| {
        let s = layer_params_at(job, l);
        (s.dense, s.expert)
    };
    let embedding = (m.vocab as u64 * h).div_ceil(tp);

    let (mut dense, mut expert) = if m.arch == crate::arch::Arch::default() {
        let (layer_dense, expert) = split(0);
        (layers * layer_dense, layers * expert)
    } else {
        job.chunk_layers(stage)
            .into_iter()
            .flatten()
            .map(split)
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    };
    if job.holds_mtp(stage) {
        // The multi-token-prediction modules (on the last stage, or where the layout's `m`
        // puts them): one more layer of the last layer's kind, the `2h x h` projection and
        // three norms each; their output head is the main model's (not counted again), and
        // so is their embedding on the last stage. A standalone MTP stage is a model chunk of
        // its own that builds a copy of the embedding (Megatron-Core's `mtp_process`), even on
        // the rank holding the input embedding, unless it is the embedding's own chunk.
        let depth = m.arch.mtp_depth as u64;
        let (layer_dense, layer_expert) = split(m.layers - 1);
        dense += depth * (layer_dense + (2 * h * h).div_ceil(tp) + 3 * h);
        expert += depth * layer_expert;
        if job.mtp_standalone() && job.mtp_virtual_stage() != 0 {
            dense += embedding;
        }
    }
    if first {
        dense += embedding;
    }
    if last {
        // Final norm, plus the LM head unless it is the (tied) input embedding on this GPU.
        dense += h;
        if !(m.tied_embeddings && p.pp == 1) {
            dense += embedding;
        }
    }
    StageParams { dense, expert }
}

/// Transformer layers whose parameters ZeRO-3 holds gathered at once: the one computing and
/// the one prefetched behind it (FSDP's default backward prefetch, DeepSpeed's prefetch of the
/// next submodule).
pub const ZERO3_GATHERED_LAYERS: u64 = 2;

/// Activation bytes one transformer layer keeps for one micro-batch on one GPU, for the job's
/// recompute mode and sequence-parallel setting.
///
/// With `s = seq_len / cp`, `b = micro_batch`, `h = hidden`, `a` query heads, `t = tp`,
/// `hq = heads x head_dim`, `hkv = kv_heads x head_dim`, `f` the MLP width and `k` the experts
/// a token is routed to (1 for dense layers), Korthikanti's tensors (BF16 = 2 bytes, dropout
/// masks 1 byte) are, per layer and micro-batch:
///
/// | tensor | bytes | split over t without SP |
/// |---|---|---|
/// | LayerNorm 1 input | 2sbh | no |
/// | QKV projection input | 2sbh | no |
/// | Q and K (for QK^T) | 2sb(hq + hkv) | yes |
/// | softmax output | 2as²b | yes |
/// | softmax dropout mask | as²b | yes |
/// | dropout output (for attention over V) | 2as²b | yes |
/// | V | 2sb·hkv | yes |
/// | output projection input | 2sb·hq | yes |
/// | attention dropout mask | sbh | no |
/// | LayerNorm 2 input | 2sbh | no |
/// | MLP input (k routed copies in MoE) | 2sbh·k | no |
/// | activation input + output: GeLU 2sbf + 2sbf; SwiGLU gate and up 4sbf + output 2sbf (k copies in MoE) | (4 or 6)sbf·k | yes |
/// | MLP dropout mask | sbh | no |
/// | MoE router probabilities (FP32) | 4sb·E | no |
///
/// For GPT (GeLU, `f = 4h`, `hq = hkv = h`, dense) the unsplit tensors sum to `10sbh`, the split
/// ones to `24sbh`, and the attention core to `5as²b`: Korthikanti's `sbh(10 + 24/t + 5as/(ht))`
/// without sequence parallelism and `sbh/t (34 + 5as/h)` with it (every tensor split over `t`).
///
/// * [`Recompute::None`] uses Korthikanti's form as is, with the attention core (score matrix)
///   stored. (With FlashAttention the score matrix is never materialized, so for such kernels
///   `Selective` is the closer description; the job says which is modelled.)
/// * [`Recompute::Selective`] drops the `5as²b` attention-core term.
/// * [`Recompute::Full`] keeps only the layer input, `2sbh` (`2sbh/t` with SP).
///
/// Expert activations assume balanced routing: each GPU processes on average `k` copies of its
/// own tokens.
pub fn activation_bytes_per_layer(job: &Job) -> f64 {
    layer_activation_bytes(job, job.parallel.recompute)
}

/// [`activation_bytes_per_layer`] for an explicit recompute mode (of the first MoE layer
/// when the model mixes dense and MoE layers).
fn layer_activation_bytes(job: &Job, recompute: Recompute) -> f64 {
    let m = &job.model;
    let first = (0..m.layers).find(|&l| m.is_moe_layer(l)).unwrap_or(0);
    layer_activation_bytes_at(job, recompute, first)
}

/// Activation bytes layer `layer` keeps for one micro-batch on one GPU
/// ([`activation_bytes_per_layer`]'s tensors, with the layer's own MLP). Multi-head latent
/// attention keeps its query and key-value latents (`2sb(r_q + r_kv + d_r)`, replicated) and
/// Q, K, V at their MLA widths; shared experts keep their input (`2sbh`) and activation
/// tensors; routed-expert tensors scale with the MoE load factor (capacity or imbalance).
///
/// DeepSeek-V3's memory savings ([`crate::job::MemorySaving`], DeepSeek-AI 2024,
/// arXiv:2412.19437) change these tensors (with `c` = 1 byte for an FP8 activation cache, 2
/// otherwise):
///
/// | tensor | default | norm + up-projection recompute | FP8 activation cache |
/// |---|---|---|---|
/// | QKV / MLA down-projection input (norm 1 output) | 2sbh | 0 | sbh |
/// | Q, K, V (MLA up-projection outputs) | as above | 0 | unchanged |
/// | output projection input | 2sb·hq | unchanged | 1.5sb·hq (E5M6) |
/// | dense MLP input (norm 2 output) | 2sbh | 0 | sbh |
/// | shared-expert input (norm 2 output) | 2sbh | 0 | sbh |
/// | routed-expert input (k dispatched copies) | 2sbh·k | unchanged | sbh·k |
/// | MoE activation (routed and shared): SwiGLU input 4sbf, output 2sbf (GeLU 2sbf + 2sbf) | 6sbf | unchanged | 2sbf (GeLU sbf): FP8 input, output recomputed |
/// | dense activation: SwiGLU input 4sbf, output (fc2 input) 2sbf | 6sbf | unchanged | 4sbf + sbf |
///
/// The norm inputs (layer input, post-attention residual) and the MLA latents (the inputs of
/// the latent norms) stay stored in BF16: they are what the recomputation starts from. The
/// routed-expert inputs stay stored with recomputation, as recomputing them would repeat the
/// dispatch all-to-all; DeepSeek-V3 dispatches them in FP8 (Sec. 3.3.3 "Low-Precision
/// Communication") and caches them so.
pub fn layer_activation_bytes_at(job: &Job, recompute: Recompute, layer: u32) -> f64 {
    let m = &job.model;
    let p = &job.parallel;
    let saving = &job.training.memory_saving;
    let rn = saving.recomputes_norm_upproj(recompute);
    let fp8 = saving.activation_cache == crate::job::ActivationCache::Fp8;
    // Bytes per element of a cached linear-layer input, and of the out-projection input.
    let c = if fp8 { 1.0 } else { 2.0 };
    let c_o = if fp8 { 1.5 } else { 2.0 };
    let moe_layer = m.moe.is_some() && m.is_moe_layer(layer);
    let s = (m.seq_len / p.cp) as f64;
    let b = p.micro_batch as f64;
    let h = m.hidden as f64;
    let a = m.heads as f64;
    let t = p.tp as f64;
    let sp = p.sequence_parallel;
    let sb = s * b;

    if recompute == Recompute::Full {
        let input = 2.0 * sb * h;
        return if sp { input / t } else { input };
    }
    if recompute == Recompute::SelectiveOp {
        return selective_op_layer_bytes(job);
    }

    let hq = m.heads as f64 * m.head_dim as f64;
    let hkv = m.kv_heads as f64 * m.head_dim as f64;
    let (k, f, router) = match &m.moe {
        Some(moe) if m.is_moe_layer(layer) => (
            moe.top_k as f64 * m.arch.moe_load_factor(),
            moe.ffn_hidden as f64,
            4.0 * sb * moe.experts as f64,
        ),
        _ => (1.0, m.ffn_hidden as f64, 0.0),
    };
    // Activation-function bytes per width unit: MoE layers with the FP8 cache keep the FP8
    // input only; dense layers the BF16 input plus the fc2 input at `c` bytes.
    let act_in = match m.activation {
        crate::job::Activation::Gelu => 1.0,
        crate::job::Activation::SwiGlu => 2.0,
    };
    let act_f = if fp8 && moe_layer {
        act_in
    } else {
        2.0 * act_in + c
    };
    // Bytes per element of a norm output that feeds a linear layer.
    let norm_out = if rn { 0.0 } else { c };
    // Architecture extras (0 for the plain decoder): (replicated, split) bytes.
    let (extra_rep, extra_split) = {
        let (mut r, mut sp) = (0.0, 0.0);
        if let Some(mla) = &m.arch.mla {
            r += 2.0 * sb * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim) as f64;
            // Replace the GQA widths by the MLA ones; the up-projection outputs Q, K, V are
            // not stored when recomputed.
            let (q, kk, v, o) = (
                m.q_width() as f64,
                m.k_width() as f64,
                m.v_width() as f64,
                m.o_width() as f64,
            );
            let qkv = if rn { 0.0 } else { 2.0 };
            sp += qkv * sb * (q + kk) + qkv * sb * v + c_o * sb * o
                - (2.0 * sb * (hq + hkv) + 2.0 * sb * hkv + c_o * sb * hq);
        }
        if m.is_moe_layer(layer) && m.arch.moe_shared_ffn_hidden > 0 {
            r += norm_out * sb * h;
            sp += act_f * sb * m.arch.moe_shared_ffn_hidden as f64;
        }
        (r, sp)
    };
    let act_per_f = act_f;
    // The MLP input: the routed experts' dispatched copies (kept), or the dense MLP's norm
    // output.
    let mlp_in = if moe_layer {
        c * sb * h * k
    } else {
        norm_out * sb * h
    };

    let mask = if m.dropout { 1.0 } else { 0.0 };
    // Tensors replicated over the TP group unless sequence parallelism shards them.
    let replicated = 2.0 * sb * h // LayerNorm 1 input
        + norm_out * sb * h // QKV projection input
        + mask * sb * h // attention dropout mask
        + 2.0 * sb * h // LayerNorm 2 input
        + mlp_in // MLP / expert input
        + mask * sb * h // MLP dropout mask
        + router // router probabilities
        + extra_rep;
    // Tensors split over the TP group.
    let split = 2.0 * sb * (hq + hkv) // Q and K
        + 2.0 * sb * hkv // V
        + c_o * sb * hq // output projection input
        + act_per_f * sb * f * k // activation function input and output
        + extra_split;
    // Attention core: softmax output (2), its dropout mask (1), dropout output (2). Fused
    // (flash) attention never stores it and keeps the FP32 log-sum-exp per query and head.
    let core = if job.training.flash_attention {
        4.0 * a * s * b
    } else if recompute == Recompute::None {
        (if m.dropout { 5.0 } else { 2.0 }) * a * s * s * b
    } else {
        0.0
    };

    if sp {
        (replicated + split + core) / t
    } else {
        replicated + split / t + core / t
    }
}

/// Activation bytes a dense layer keeps per micro-batch on one GPU under torchtitan's per-op
/// selective checkpointing ([`Recompute::SelectiveOp`]). The checkpoint keeps the layer input
/// and the outputs its policy saves (`_save_list` in torchtitan's `parallelize_llama.py`):
///
/// | tensor | bytes | split over t |
/// |---|---|---|
/// | layer input | 2sbh | with SP |
/// | Q projection output (1st matrix multiply) | 2sb·hq | yes |
/// | V projection output (3rd) | 2sb·hkv | yes |
/// | attention output and FP32 log-sum-exp | 2sb·hq + 4sba | yes |
/// | first MLP projection output (5th) | 2sbf | yes |
/// | SwiGLU down projection output (7th; before the TP reduction, so whole) | 2sbh | no |
/// | reduce-scatter outputs with SP (after the output projection and the MLP) | 2 x 2sbh | yes |
///
/// K (2nd), the output projection (4th) and the up or second MLP projection (6th) are
/// recomputed; so are the norms, the residual and the activation function.
fn selective_op_layer_bytes(job: &Job) -> f64 {
    let m = &job.model;
    let p = &job.parallel;
    let sb = (m.seq_len / p.cp) as f64 * p.micro_batch as f64;
    let h = m.hidden as f64;
    let t = p.tp as f64;
    let sp = p.splits_sequence();
    let hq = (m.heads * m.head_dim) as f64;
    let hkv = (m.kv_heads * m.head_dim) as f64;
    let f = m.ffn_hidden as f64;
    let input = if sp { 2.0 * sb * h / t } else { 2.0 * sb * h };
    let split = (2.0 * sb * (hq + hkv + hq + f) + 4.0 * sb * m.heads as f64) / t;
    let down = if m.activation == crate::job::Activation::SwiGlu {
        2.0 * sb * h
    } else {
        0.0
    };
    let scattered = if sp { 2.0 * 2.0 * sb * h / t } else { 0.0 };
    input + split + down + scattered
}

/// Micro-batches whose activations stage `stage` (0-based) holds at its peak, in units of the
/// stage's full layer set (per the job's schedule), with `p` stages and `m` micro-batches:
///
/// * GPipe: `m` (all forwards run before any backward);
/// * 1F1B: `min(p - stage, m)` (warm-up forwards plus the first steady-state forward);
/// * interleaved with `v` model chunks: Megatron's warm-up count plus one,
///   `min(2 (p - stage - 1) + (v - 1) p + 1, m v)` chunk forwards, each chunk holding `1/v` of
///   the stage's layers, so the result is that count divided by `v`. On the first stage this is
///   `p (1 + (p - 1) / (p v))`, Korthikanti's (and Narayanan's) figure.
pub fn in_flight_microbatches(job: &Job, stage: u32) -> f64 {
    let p = job.parallel.pp as u64;
    let i = stage as u64;
    let m = job.round_micro_batches();
    let v = job.parallel.vpp as u64;
    match job.parallel.schedule {
        Schedule::GPipe => m as f64,
        Schedule::OneFOneB => (p - i).min(m) as f64,
        // Combined 1F1B on one stage: a forward runs before the previous backward.
        Schedule::OneFOneBOverlap if v == 1 => (p - i + 1).min(m) as f64,
        // DualPipe keeps `PP + 1` micro-batches' activations of one stage at its peak
        // (DeepSeek-V3 report, Table 2); a rank holds two stages, so `(PP + 1) / 2` of them
        // on average (per chunk: [`dualpipe_chunk_in_flight`], which the memory model uses).
        Schedule::DualPipe => (p + 1) as f64 / 2.0,
        Schedule::Interleaved | Schedule::OneFOneBOverlap => {
            let extra = warmup_extra(job);
            let chunks = (2 * (p - i - 1) + (v - 1) * p + 1 + extra).min(m * v);
            chunks as f64 / v as f64
        }
    }
}

/// Chunk forwards the schedule's warm-up runs beyond Megatron's interleaved (or plain 1F1B)
/// count: one for the combined 1F1B of `"1f1b-overlap"`, so that a steady-state pair never
/// holds a forward and its own backward ([`crate::schedules::overlapped_1f1b_steps`]).
fn warmup_extra(job: &Job) -> u64 {
    (job.parallel.schedule == Schedule::OneFOneBOverlap) as u64
}

/// Whether the job's ranks run Megatron's interleaved order over several model chunks (the
/// interleaved schedule, and 1F1B with EP overlap on an interleaved pipeline).
fn interleaved_order(job: &Job) -> bool {
    match job.parallel.schedule {
        Schedule::Interleaved => true,
        Schedule::OneFOneBOverlap => job.parallel.vpp > 1,
        _ => false,
    }
}

/// Micro-batches of each of DualPipe's two chunks that pipeline rank `stage` holds at its
/// peak, `[chunk 0, chunk 1]` (chunk 0 = stage `stage` of the forward-direction pipeline,
/// chunk 1 = stage `pp - 1 - stage` of the reverse one; [`Job::chunk_layers`]), found by
/// walking the rank's schedule ([`crate::schedules::dualpipe_steps`]): each forward adds a
/// micro-batch of its chunk, each backward frees one, an overlapped forward-backward pair
/// runs its forward first. Both chunks reach their maxima at the same step, `pp - stage` and
/// `stage + 1` micro-batches, `pp + 1` together (DeepSeek-V3 report, Table 2); so the stage
/// holding the input embedding keeps `pp` micro-batches in flight and the one holding the
/// output head one, as with 1F1B.
pub fn dualpipe_chunk_in_flight(job: &Job, stage: u32) -> [f64; 2] {
    use crate::schedules::{PipeStep, dualpipe_steps};
    let m = job.micro_batches().min(u32::MAX as u64) as u32;
    let (mut live, mut peak) = ([0i64; 2], [0i64; 2]);
    let mut best = -1i64;
    let mut forward = |c: u32, live: &mut [i64; 2]| {
        live[c as usize] += 1;
        if live[0] + live[1] > best {
            best = live[0] + live[1];
            peak = *live;
        }
    };
    for step in dualpipe_steps(stage, job.parallel.pp, m) {
        match step {
            PipeStep::Forward(_, c) => forward(c, &mut live),
            // A split backward frees its micro-batch here too: counting the inputs its
            // deferred weight gradient still reads until that runs gives the same peak (test
            // `zero_bubble_split_keeps_the_activation_peak` in `schedules.rs`).
            PipeStep::Backward(_, c) | PipeStep::BackwardInput(_, c) => live[c as usize] -= 1,
            PipeStep::Weight(..) => {}
            PipeStep::ForwardBackward((_, f), (_, b)) => {
                forward(f, &mut live);
                live[b as usize] -= 1;
            }
        }
    }
    [peak[0] as f64, peak[1] as f64]
}

/// Peak number of micro-batches of one model chunk in flight on pipeline rank `rank` under
/// Megatron's interleaved 1F1B order: forward `k` runs chunk `(k mod pv) / p`, backward `k`
/// chunk `v - 1 - (k mod pv) / p`; `2 (p - rank - 1) + (v - 1) p + extra` warm-up forwards
/// (`extra` = 1 for the combined 1F1B of `"1f1b-overlap"`), then forward/backward pairs, then
/// the remaining backwards.
fn interleaved_chunk_peak(
    p: u64,
    v: u64,
    m: u64,
    rank: u64,
    chunk: Option<u64>,
    extra: u64,
) -> u64 {
    let weights: Vec<f64> = (0..v)
        .map(|c| {
            if chunk.is_none_or(|x| x == c) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    // Sums of 0/1 weights: exact in f64.
    interleaved_weighted_peak(p, v, m, rank, &weights, extra) as u64
}

/// Bytes of transformer-layer activations pipeline rank `stage` holds at its peak: the
/// stage's layers x [`activation_bytes_per_layer`] x [`in_flight_microbatches`] when its model
/// chunks hold equal layers; with uneven chunks (a pipeline layout), the peak over Megatron's
/// interleaved order of every chunk's bytes times that chunk's micro-batches in flight.
///
/// With `parallel.deallocate_stage_input` (the Llama 3 stack, Dubey et al. 2024 Sec. 3.3.2:
/// "we proactively deallocate ... the input and output tensors of each pipeline stage"), each
/// model chunk's received input is freed after its forward: a chunk keeps `2sbh` (`/t` with SP)
/// less than its layers' sum, the first layer's norm input (an RMSNorm backward needs only its
/// saved output and reciprocal RMS). Not with full recompute, whose checkpoint that input is.
pub fn in_flight_activations(job: &Job, stage: u32) -> f64 {
    let p = &job.parallel;
    let per_layer = activation_bytes_per_layer(job);
    let input = if p.deallocate_stage_input && p.recompute != Recompute::Full {
        let m = &job.model;
        let sb = (m.seq_len / p.cp) as f64 * p.micro_batch as f64;
        let sp_div = if p.sequence_parallel {
            p.tp as f64
        } else {
            1.0
        };
        2.0 * sb * m.hidden as f64 / sp_div
    } else {
        0.0
    };
    let chunks = job.chunk_layers(stage);
    let layers: u32 = chunks.iter().map(|r| r.len() as u32).sum();
    if job.model.arch != crate::arch::Arch::default() {
        // Layers differ (dense and MoE): each chunk's bytes are the sum of its layers'.
        let weights: Vec<f64> = chunks
            .iter()
            .map(|r| {
                if r.is_empty() {
                    return 0.0;
                }
                let sum: f64 = r
                    .clone()
                    .map(|l| layer_activation_bytes_at(job, p.recompute, l))
                    .sum();
                sum - input
            })
            .collect();
        if p.schedule == Schedule::DualPipe {
            let n = dualpipe_chunk_in_flight(job, stage);
            return weights[0] * n[0] + weights[1] * n[1];
        }
        if !interleaved_order(job) {
            return weights.iter().sum::<f64>() * in_flight_microbatches(job, stage);
        }
        return interleaved_weighted_peak(
            p.pp as u64,
            p.vpp as u64,
            job.round_micro_batches(),
            stage as u64,
            &weights,
            warmup_extra(job),
        );
    }
    let chunk_bytes = |n: usize| {
        if n == 0 {
            0.0
        } else {
            n as f64 * per_layer - input
        }
    };
    if p.schedule == Schedule::DualPipe {
        let n = dualpipe_chunk_in_flight(job, stage);
        return chunk_bytes(chunks[0].len()) * n[0] + chunk_bytes(chunks[1].len()) * n[1];
    }
    let even = chunks.iter().all(|r| r.len() == chunks[0].len());
    if even && input == 0.0 {
        return layers as f64 * in_flight_microbatches(job, stage) * per_layer;
    }
    if !interleaved_order(job) {
        return chunk_bytes(layers as usize) * in_flight_microbatches(job, stage);
    }
    let weights: Vec<f64> = chunks.iter().map(|r| chunk_bytes(r.len())).collect();
    interleaved_weighted_peak(
        p.pp as u64,
        p.vpp as u64,
        job.round_micro_batches(),
        stage as u64,
        &weights,
        warmup_extra(job),
    )
}

/// Peak of `sum over chunks c of weights[c] x (micro-batches of chunk c in flight)` on pipeline
/// rank `rank` under Megatron's interleaved 1F1B order (the order [`interleaved_chunk_peak`]
/// describes).
fn interleaved_weighted_peak(
    p: u64,
    v: u64,
    m: u64,
    rank: u64,
    weights: &[f64],
    extra: u64,
) -> f64 {
    let total = m * v;
    let warmup = (2 * (p - rank - 1) + (v - 1) * p + extra).min(total);
    let fwd_chunk = |k: u64| ((k % (p * v)) / p) as usize;
    let bwd_chunk = |k: u64| (v - 1 - (k % (p * v)) / p) as usize;
    let (mut live, mut peak) = (0.0f64, 0.0f64);
    for k in 0..total {
        live += weights[fwd_chunk(k)];
        peak = peak.max(live);
        if k >= warmup {
            live -= weights[bwd_chunk(k - warmup)];
        }
    }
    peak
}

/// Micro-batches for which the first (`first = true`) or last model chunk of `stage` holds its
/// per-micro-batch extras (embedding dropout mask; LM head and loss tensors) at the peak.
fn extras_in_flight(job: &Job, stage: u32, first: bool) -> f64 {
    if job.parallel.schedule == Schedule::DualPipe {
        // The chunk holding pipeline stage 0 (embedding) or `pp - 1` (head): chunk 0 on the
        // rank of that stage, chunk 1 on the mirrored rank.
        let target = if first { 0 } else { job.parallel.pp - 1 };
        let chunk = if stage == target { 0 } else { 1 };
        return dualpipe_chunk_in_flight(job, stage)[chunk];
    }
    if !interleaved_order(job) {
        return in_flight_microbatches(job, stage);
    }
    let p = job.parallel.pp as u64;
    let v = job.parallel.vpp as u64;
    let chunk = if first { 0 } else { v - 1 };
    let m = job.round_micro_batches();
    interleaved_chunk_peak(p, v, m, stage as u64, Some(chunk), warmup_extra(job)) as f64
}

/// Weights a stage holds whole (below ZeRO-3): 2 bytes per parameter, except that with
/// `fp8_param_gather` the transformer layers' weights are FP8 (1 byte). Megatron-Core's
/// `--fp8-param-gather` keeps the compute parameters in FP8 (Transformer Engine's
/// `fp8_model_init`; the FP32 master copies are the distributed optimizer's), and gathers them
/// in FP8; the embedding and output layer stay BF16.
fn unsharded_weight_bytes(job: &Job, stage: u32, params: StageParams) -> u64 {
    if !job.parallel.fp8_param_gather {
        return WEIGHT_BYTES_PER_PARAM * params.total();
    }
    let layers: u64 = (job.chunk_layers(stage).into_iter().flatten())
        .map(|l| layer_params_at(job, l).total())
        .sum();
    WEIGHT_BYTES_PER_PARAM * (params.total() - layers) + layers
}

/// Memory of one GPU of pipeline stage `stage` at its peak.
///
/// Activations = `stage layers x activation_bytes_per_layer x in_flight_microbatches`, plus:
/// * with full recompute, the layer being recomputed during backward: one layer's
///   selective-level activations (less the input it already counts). The attention-core
///   tensors rebuilt inside a recomputed layer are treated as transient, as Korthikanti treats
///   them for selective recompute;
/// * on the first stage, per in-flight micro-batch, the input-embedding dropout mask `sbh`
///   (1 byte; `/t` with SP). The embedding output itself is the first layer's input, already
///   counted as that layer's LayerNorm input;
/// * on the last stage, per in-flight micro-batch, the final LayerNorm input `2sbh` and the LM
///   head input `2sbh` (`/t` with SP; a norm output, so `sbh` with the FP8 activation cache and
///   0 with norm recomputation, as are the MTP projection inputs), and the FP32 logits kept by the vocab-parallel cross
///   entropy for its backward, `4sbV/t` (the output-layer terms of Korthikanti et al.).
pub fn stage_memory(job: &Job, stage: u32) -> MemoryBreakdown {
    let p = &job.parallel;
    let params = stage_params(job, stage);
    let dp_cp = p.dp as u64 * p.cp as u64;
    let edp_cp = (p.dp / p.ep) as u64 * p.cp as u64;
    let sharded = |bytes_per_param: u64, ps: StageParams| {
        (bytes_per_param * ps.dense).div_ceil(dp_cp)
            + (bytes_per_param * ps.expert).div_ceil(edp_cp)
    };
    // ZeRO-3 shards the transformer layers' weights and, resharding after each forward,
    // gathers at most two layers at a time; the embedding and LM head stay gathered for the
    // whole iteration (see graph.rs). ZeRO-2 and 3 shard the layers' gradients, each
    // micro-batch's (or each sync span's) being reduce-scattered as backward produces them:
    // one layer's unsharded gradients are held while it is reduced, and the embedding's and
    // LM head's are reduced once, after the last micro-batch. Layers
    // may differ (dense first layers of a MoE model): the stage's own layers are summed and
    // the gathered window is its largest layers.
    // Main gradients: FP32, or 16-bit where Megatron reduces in 16 bits (Job::grad_accum_bytes).
    let grad_bytes = job.grad_accum_bytes();
    // A stage without transformer layers (an embedding- or loss-only stage of a pipeline
    // layout) holds its weights and gradients whole, as the graph reduces them.
    let (weights, gradients) = if p.shards_grads() {
        let mut each: Vec<StageParams> = (job.chunk_layers(stage).into_iter().flatten())
            .map(|l| layer_params_at(job, l))
            .collect();
        let layer_part = each
            .iter()
            .fold(StageParams::default(), |a, b| StageParams {
                dense: a.dense + b.dense,
                expert: a.expert + b.expert,
            });
        each.sort_by_key(|x| std::cmp::Reverse(x.total()));
        let rest = params.total() - layer_part.total();
        // Every layer's shard at `bytes` per parameter, plus the `n` largest layers gathered
        // whole beside their shards (FSDP's unsharded buffers; a part whose group has one rank
        // is never gathered: its shard is the whole).
        let whole_as = |n: usize, gathered_bytes: u64, bytes: u64| {
            let gathered: u64 = each
                .iter()
                .take(n)
                .map(|x| {
                    (if dp_cp > 1 { x.dense } else { 0 }) + (if edp_cp > 1 { x.expert } else { 0 })
                })
                .sum();
            gathered_bytes * gathered + sharded(bytes, layer_part)
        };
        let whole = |n: usize, bytes: u64| whole_as(n, bytes, bytes);
        // Without resharding after the forward every layer of the stage is gathered between
        // its forward and backward; with a deferred sync (`Zero3Sync`) the stage's layers
        // stay gathered, and their gradients unreduced, over the whole span.
        let deferred = p.shards_params() && p.zero3_grad_sync != Zero3Sync::MicroBatch;
        let weights = if p.shards_params() {
            let window = if p.reshard_after_forward {
                ZERO3_GATHERED_LAYERS as usize
            } else {
                each.len()
            };
            // FP8 gathers (`fp8_param_gather`) hold the gathered layers in 1 byte.
            let gathered = if p.fp8_param_gather {
                1
            } else {
                WEIGHT_BYTES_PER_PARAM
            };
            WEIGHT_BYTES_PER_PARAM * rest + whole_as(window, gathered, WEIGHT_BYTES_PER_PARAM)
        } else {
            unsharded_weight_bytes(job, stage, params)
        };
        let unreduced = if deferred { each.len() } else { 1 };
        (weights, grad_bytes * rest + whole(unreduced, grad_bytes))
    } else {
        (
            unsharded_weight_bytes(job, stage, params),
            grad_bytes * params.total(),
        )
    };
    let opt_bytes = job.optimizer_bytes_per_param();
    let optimizer = if p.distributed_optimizer {
        sharded(opt_bytes, params)
    } else {
        opt_bytes * params.total()
    };

    let m = &job.model;
    let s = (m.seq_len / p.cp) as f64;
    let sb = s * p.micro_batch as f64;
    let h = m.hidden as f64;
    let t = p.tp as f64;
    let sp_div = if p.sequence_parallel { t } else { 1.0 };
    let layers = job.stage_layers()[stage as usize] as f64;

    let mut act = in_flight_activations(job, stage);
    if p.recompute == Recompute::Full && layers > 0.0 {
        // Norm and up-projection recomputation is ignored under full recompute (see
        // `MemorySaving::recompute_norm_upproj`), also for the layer being recomputed.
        let selective = if job.training.memory_saving.recompute_norm_upproj {
            let mut plain = job.clone();
            plain.training.memory_saving.recompute_norm_upproj = false;
            layer_activation_bytes(&plain, Recompute::Selective)
        } else {
            layer_activation_bytes(job, Recompute::Selective)
        };
        act += selective - activation_bytes_per_layer(job);
    }
    if p.recompute == Recompute::SelectiveOp && layers > 0.0 {
        // The tensors one layer's backward recomputes, held while it runs: the two norm
        // outputs, K, the residual, the output projection's output (when no reduce-scatter
        // follows it) and the MLP's recomputed up projection and activation output.
        let hkv = (m.kv_heads * m.head_dim) as f64;
        let f = m.ffn_hidden as f64;
        let sp = p.splits_sequence();
        let o = if sp { 0.0 } else { 2.0 * sb * h };
        let mlp = if m.activation == crate::job::Activation::SwiGlu {
            2.0 * 2.0 * sb * f / t
        } else {
            2.0 * sb * f / t
        };
        act += 3.0 * 2.0 * sb * h / sp_div + 2.0 * sb * hkv / t + o + mlp;
    }
    // DualPipe: both end ranks hold an embedding and a head (of opposite directions).
    let dual = p.schedule == Schedule::DualPipe;
    if stage == 0 || dual && stage + 1 == p.pp {
        act += sb * h / sp_div * extras_in_flight(job, stage, true);
    }
    // The LM head input and the MTP projection inputs are norm outputs: not stored when norms
    // are recomputed, FP8 with the FP8 activation cache.
    let saving = &job.training.memory_saving;
    let norm_out = if saving.recomputes_norm_upproj(p.recompute) {
        0.0
    } else if saving.activation_cache == crate::job::ActivationCache::Fp8 {
        1.0
    } else {
        2.0
    };
    if stage + 1 == p.pp || dual && stage == 0 {
        let per_mb = (2.0 + norm_out) * sb * h / sp_div + 4.0 * sb * m.vocab as f64 / t;
        act += per_mb * extras_in_flight(job, stage, false);
        if m.arch.mtp_depth > 0 {
            // Multi-token prediction: per module one more head (norm and head inputs, logits).
            act += m.arch.mtp_depth as f64 * per_mb * extras_in_flight(job, stage, false);
        }
    }
    if job.holds_mtp(stage) {
        // ... and, where the modules run (the last stage, or a standalone MTP stage: in both
        // cases the rank's last model chunk), one more layer (the last layer's kind) and the
        // projection's input `[t x 2h]`.
        let layer = layer_activation_bytes_at(job, p.recompute, m.layers - 1);
        let proj = 2.0 * norm_out * sb * h / sp_div;
        act += m.arch.mtp_depth as f64 * (layer + proj) * extras_in_flight(job, stage, false);
    }

    MemoryBreakdown {
        weights,
        gradients,
        optimizer,
        activations: act.ceil() as u64,
        workspace: WORKSPACE_BYTES,
    }
}

/// The stage with the largest total memory per GPU (the first one on ties) and its breakdown.
pub fn peak_memory(job: &Job) -> (u32, MemoryBreakdown) {
    (0..job.parallel.pp)
        .map(|s| (s, stage_memory(job, s)))
        .fold(
            None,
            |best: Option<(u32, MemoryBreakdown)>, (s, mb)| match best {
                Some((bs, bm)) if bm.total() >= mb.total() => Some((bs, bm)),
                _ => Some((s, mb)),
            },
        )
        .expect("a validated job has at least one stage")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Precision;
    use crate::job::fixtures::{gpt3_175b_model, llama3_405b_job, small_job};

    use crate::units::GIB;

    /// GPT-3 175B (Brown et al. 2020) as in Korthikanti et al. Table 3: 96 layers, h 12288,
    /// 96 heads, s 2048, t 8, b 1; here on 512 GPUs (tp 8, pp 8, dp 8), 8 micro-batches.
    fn gpt3_job(sp: bool, recompute: Recompute) -> Job {
        let mut job = small_job(64, 8, 8, 64);
        job.model = gpt3_175b_model();
        job.parallel.sequence_parallel = sp;
        job.parallel.recompute = recompute;
        // Korthikanti et al. measured Megatron's unfused attention with dropout.
        job.training.flash_attention = false;
        job.validate().unwrap();
        job
    }

    /// Llama 3 405B (Dubey et al. 2024, Table 3) on 16384 H100s: tp 8, pp 16 (first and last
    /// stage 7 layers, others 8), dp 128, micro-batch 1, seq 8192, SP, no recompute,
    /// distributed optimizer, global batch 2048 sequences (16M tokens).
    fn llama405b_job() -> Job {
        let mut job = llama3_405b_job();
        job.parallel.sequence_parallel = true;
        job.parallel.recompute = Recompute::None;
        job.parallel.set_distributed_optimizer(true);
        job.training.precision = Precision::Bf16;
        job.validate().unwrap();
        assert_eq!(job.parallel.dp, 128);
        job
    }

    /// torchtitan's per-op checkpointing, executed: walk the forward ops of a Llama block as
    /// torchtitan's TP plan runs them (norm, [all-gather], wq, wk, wv, RoPE, SDPA, wo,
    /// [reduce-scatter or all-reduce], residual, norm, [all-gather], w1, SiLU, w3, mul, w2,
    /// [reduce-scatter or all-reduce], residual) with each output's bytes, apply the policy of
    /// `parallelize_llama.py` (save outputs of mm, SDPA and reduce-scatter, except every
    /// second mm) and add the checkpoint's input: the closed form must agree, with and
    /// without tensor parallelism and sequence parallelism, for SwiGLU and GeLU MLPs.
    #[test]
    fn selective_op_memory_is_torchtitans_policy_executed() {
        #[derive(PartialEq)]
        enum Op {
            Mm,
            Sdpa,
            ReduceScatter,
            Other,
        }
        for (tp, sp, swiglu) in [
            (1, false, true),
            (8, true, true),
            (8, false, true),
            (4, true, false),
            (1, false, false),
        ] {
            let mut job = llama405b_job();
            job.parallel.tp = tp;
            job.parallel.dp = 16384 / (tp * 16);
            job.parallel.sequence_parallel = sp;
            job.parallel.recompute = Recompute::SelectiveOp;
            if !swiglu {
                job.model.activation = crate::job::Activation::Gelu;
            }
            job.validate().unwrap();
            let m = &job.model;
            let sb = (m.seq_len * job.parallel.micro_batch) as f64;
            let t = tp as f64;
            let (h, f) = (m.hidden as f64, m.ffn_hidden as f64);
            let hq = (m.heads * m.head_dim) as f64;
            let hkv = (m.kv_heads * m.head_dim) as f64;
            let seq_t = if sp { t } else { 1.0 };
            let reduce = |ops: &mut Vec<(Op, f64)>| {
                if t > 1.0 {
                    if sp {
                        ops.push((Op::ReduceScatter, 2.0 * sb * h / t));
                    } else {
                        ops.push((Op::Other, 2.0 * sb * h)); // all-reduce: not saved
                    }
                }
            };
            let gather = |ops: &mut Vec<(Op, f64)>| {
                if sp && t > 1.0 {
                    ops.push((Op::Other, 2.0 * sb * h));
                }
            };
            let mut ops = vec![(Op::Other, 2.0 * sb * h / seq_t)]; // attention norm
            gather(&mut ops);
            ops.push((Op::Mm, 2.0 * sb * hq / t)); // wq
            ops.push((Op::Mm, 2.0 * sb * hkv / t)); // wk
            ops.push((Op::Mm, 2.0 * sb * hkv / t)); // wv
            ops.push((Op::Other, 2.0 * sb * (hq + hkv) / t)); // RoPE
            // SDPA: output and FP32 log-sum-exp per query and head.
            ops.push((Op::Sdpa, (2.0 * sb * hq + 4.0 * sb * m.heads as f64) / t));
            ops.push((Op::Mm, 2.0 * sb * h)); // wo: partial sums, whole
            reduce(&mut ops);
            ops.push((Op::Other, 2.0 * sb * h / seq_t)); // residual
            ops.push((Op::Other, 2.0 * sb * h / seq_t)); // ffn norm
            gather(&mut ops);
            ops.push((Op::Mm, 2.0 * sb * f / t)); // w1
            ops.push((Op::Other, 2.0 * sb * f / t)); // activation
            if swiglu {
                ops.push((Op::Mm, 2.0 * sb * f / t)); // w3
                ops.push((Op::Other, 2.0 * sb * f / t)); // mul
            }
            ops.push((Op::Mm, 2.0 * sb * h)); // w2: partial sums, whole
            reduce(&mut ops);
            ops.push((Op::Other, 2.0 * sb * h / seq_t)); // residual
            let mut mm = 0;
            let mut saved = 2.0 * sb * h / seq_t; // the checkpoint's input
            for (op, bytes) in ops {
                if op == Op::Mm {
                    mm += 1;
                }
                let keep = op != Op::Other && !(op == Op::Mm && mm % 2 == 0);
                if keep {
                    saved += bytes;
                }
            }
            let model = activation_bytes_per_layer(&job);
            assert!(
                (model - saved).abs() < 1e-6 * saved,
                "tp {tp} sp {sp} swiglu {swiglu}: {model} vs {saved}"
            );
        }
    }

    /// Saving more means recomputing less: per-op checkpointing sits between keeping every
    /// activation and keeping only the layer input, in memory and in time.
    #[test]
    fn selective_op_lies_between_none_and_full() {
        let mut bytes = Vec::new();
        let mut times = Vec::new();
        for r in [Recompute::None, Recompute::SelectiveOp, Recompute::Full] {
            let mut job = small_job(2, 2, 2, 16);
            job.model.activation = crate::job::Activation::SwiGlu;
            job.parallel.recompute = r;
            job.validate().unwrap();
            bytes.push(activation_bytes_per_layer(&job));
            let res = crate::simulate(&job, &crate::SimOptions::default()).unwrap();
            times.push(res.summary.iteration_time_s);
        }
        assert!(bytes[0] > bytes[1] && bytes[1] > bytes[2], "{bytes:?}");
        assert!(times[0] < times[1] && times[1] < times[2], "{times:?}");
    }

    /// Megatron keeps an FP16 job's main gradients in FP16: the gradient memory halves and
    /// nothing else changes (weights, optimizer state and activations are the same bytes).
    #[test]
    fn fp16_main_gradients_take_two_bytes_per_parameter() {
        let bf16 = small_job(2, 2, 2, 64);
        let mut fp16 = bf16.clone();
        fp16.training.precision = Precision::Fp16;
        fp16.parallel.grad_reduce_in_bf16 = true;
        for stage in 0..2 {
            let (a, b) = (stage_memory(&bf16, stage), stage_memory(&fp16, stage));
            let params = stage_params(&bf16, stage).total();
            assert_eq!(a.gradients, 4 * params);
            assert_eq!(b.gradients, 2 * params);
            assert_eq!(
                (a.weights, a.optimizer, a.activations),
                (b.weights, b.optimizer, b.activations)
            );
        }
    }

    #[test]
    fn korthikanti_closed_forms_gpt3() {
        let (s, b, h, a, t) = (2048.0, 1.0, 12288.0, 96.0, 8.0);
        let sbh = s * b * h;
        let cases = [
            (
                false,
                Recompute::None,
                sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)),
            ),
            (true, Recompute::None, sbh / t * (34.0 + 5.0 * a * s / h)),
            (false, Recompute::Selective, sbh * (10.0 + 24.0 / t)),
            (true, Recompute::Selective, 34.0 * sbh / t),
            (false, Recompute::Full, 2.0 * sbh),
            (true, Recompute::Full, 2.0 * sbh / t),
        ];
        for (sp, rc, expect) in cases {
            let got = activation_bytes_per_layer(&gpt3_job(sp, rc));
            assert_eq!(got, expect, "sp {sp}, {rc:?}");
        }
        // Korthikanti Table 2 in GB-ish units for the record: SP + selective = 34 sbh / t.
        assert_eq!(
            activation_bytes_per_layer(&gpt3_job(true, Recompute::Selective)),
            106_954_752.0
        );
    }

    #[test]
    fn gqa_and_swiglu_generalization() {
        // Llama-405B layer with SP and dropout (unfused attention), selective:
        // 10 + 2(1 + 1/16) + 2/16 + 2 + 6 * 3.25 = 33.75 (in units of sbh/t).
        let mut job = llama405b_job();
        job.model.dropout = true;
        job.training.flash_attention = false;
        job.parallel.recompute = Recompute::Selective;
        let sbh = 8192.0 * 16384.0;
        assert_eq!(activation_bytes_per_layer(&job), 33.75 * sbh / 8.0);
        // The attention core adds 5 a s / h = 320 (in units of sbh/t).
        job.parallel.recompute = Recompute::None;
        assert_eq!(
            activation_bytes_per_layer(&job),
            (33.75 + 320.0) * sbh / 8.0
        );
        // Without dropout the two sbh masks go; flash attention stores no score matrix, only the
        // FP32 log-sum-exp of each query and head: 4 a s b bytes = 4 * 128 / 16384 sbh.
        job.model.dropout = false;
        job.training.flash_attention = true;
        let lse = 4.0 * 128.0 / 16384.0;
        assert_eq!(activation_bytes_per_layer(&job), (31.75 + lse) * sbh / 8.0);
    }

    #[test]
    fn one_f_one_b_in_flight() {
        let job = gpt3_job(true, Recompute::Selective);
        let p = job.parallel.pp;
        assert_eq!(job.micro_batches(), 8);
        assert_eq!(in_flight_microbatches(&job, 0), p as f64);
        assert_eq!(in_flight_microbatches(&job, p - 1), 1.0);
        for i in 0..p {
            assert_eq!(in_flight_microbatches(&job, i), (p - i) as f64);
        }
        // Fewer micro-batches than stages caps the count.
        let mut few = job.clone();
        few.training.global_batch = 3;
        few.parallel.dp = 1;
        assert_eq!(in_flight_microbatches(&few, 0), 3.0);
        let mut gpipe = job.clone();
        gpipe.parallel.schedule = Schedule::GPipe;
        assert_eq!(in_flight_microbatches(&gpipe, p - 1), 8.0);
    }

    #[test]
    fn interleaved_in_flight_matches_korthikanti_and_simulation() {
        for (p, v, m) in [
            (4u64, 2u64, 8u64),
            (8, 3, 16),
            (4, 4, 4),
            (16, 2, 32),
            (2, 2, 2),
        ] {
            let mut job = gpt3_job(true, Recompute::Selective);
            job.parallel.pp = p as u32;
            job.parallel.vpp = v as u32;
            job.parallel.schedule = Schedule::Interleaved;
            job.parallel.dp = (64 / p) as u32;
            job.training.global_batch = (m * 64 / p) as u32;
            job.validate().unwrap();
            assert_eq!(job.micro_batches(), m);
            let pf = p as f64;
            let first = in_flight_microbatches(&job, 0);
            if m * v > 2 * (p - 1) + (v - 1) * p {
                assert!((first - pf * (1.0 + (pf - 1.0) / (pf * v as f64))).abs() < 1e-12);
            }
            for r in 0..p {
                let sim = interleaved_chunk_peak(p, v, m, r, None, 0) as f64 / v as f64;
                assert_eq!(
                    in_flight_microbatches(&job, r as u32),
                    sim,
                    "p {p} v {v} m {m} r {r}"
                );
            }
            // The last chunk of the last rank holds at most 2 micro-batches at a time.
            assert!(interleaved_chunk_peak(p, v, m, p - 1, Some(v - 1), 0) <= 2);
        }
    }

    #[test]
    fn distributed_optimizer_divides_by_dp() {
        let job = gpt3_job(true, Recompute::Selective);
        let mut plain = job.clone();
        plain.parallel.set_distributed_optimizer(false);
        for s in 0..job.parallel.pp {
            let on = stage_memory(&job, s);
            let off = stage_memory(&plain, s);
            assert_eq!(off.optimizer, 12 * stage_params(&job, s).total());
            assert_eq!(on.optimizer, off.optimizer.div_ceil(job.parallel.dp as u64));
            assert_eq!(off.optimizer % job.parallel.dp as u64, 0);
            assert_eq!(on.optimizer * job.parallel.dp as u64, off.optimizer);
            assert_eq!((on.weights, on.gradients), (off.weights, off.gradients));
        }
    }

    #[test]
    fn params_sum_to_model() {
        // With tp = 1 and no ties, the stages hold exactly the model's parameters.
        let mut job = small_job(1, 1, 4, 8);
        job.parallel.tp = 1;
        job.parallel.sequence_parallel = false;
        job.validate().unwrap();
        let total: u64 = (0..4).map(|s| stage_params(&job, s).total()).sum();
        assert_eq!(total, job.model.params());
        // Tied: the last stage holds a second copy of the embedding.
        job.model.tied_embeddings = true;
        let total: u64 = (0..4).map(|s| stage_params(&job, s).total()).sum();
        assert_eq!(
            total,
            job.model.params() + job.model.vocab as u64 * job.model.hidden as u64
        );
        // One stage, tied: held once.
        let mut one = small_job(1, 1, 1, 8);
        one.model.tied_embeddings = true;
        assert_eq!(stage_params(&one, 0).total(), one.model.params());
    }

    #[test]
    fn moe_params_and_optimizer_sharding() {
        let mut job = small_job(2, 1, 1, 16); // 16 GPUs, dp 16
        job.model.moe = Some(crate::job::Moe {
            experts: 8,
            top_k: 2,
            ffn_hidden: 1024,
        });
        job.parallel.ep = 4;
        job.parallel.tp = 1;
        job.parallel.sequence_parallel = false;
        job.validate().unwrap();
        let sp = stage_params(&job, 0);
        let m = &job.model;
        // 8 layers x 2 local experts (8 experts / ep 4).
        assert_eq!(sp.expert, 8 * 2 * m.expert_params());
        assert_eq!(sp.total() + 8 * 6 * m.expert_params(), m.params());
        let mem = stage_memory(&job, 0);
        assert_eq!(
            mem.optimizer,
            (12 * sp.dense).div_ceil(16) + (12 * sp.expert).div_ceil(4)
        );
    }

    #[test]
    fn recompute_orders_memory() {
        for sp in [false, true] {
            let none = stage_memory(&gpt3_job(sp, Recompute::None), 0).activations;
            let sel = stage_memory(&gpt3_job(sp, Recompute::Selective), 0).activations;
            let full = stage_memory(&gpt3_job(sp, Recompute::Full), 0).activations;
            assert!(none > sel && sel > full, "{none} {sel} {full}");
        }
    }

    #[test]
    fn llama405b_peak() {
        let job = llama405b_job();
        assert_eq!(job.stage_layers()[0], 7);
        assert_eq!(job.stage_layers()[1], 8);
        let (stage, mb) = peak_memory(&job);
        let gib = |b: u64| b as f64 / GIB;
        println!(
            "llama3-405b, no recompute: peak stage {stage}: total {:.1} GiB = weights {:.2} + grads {:.2} + optimizer {:.2} + activations {:.1} + workspace {:.2}",
            gib(mb.total()),
            gib(mb.weights),
            gib(mb.gradients),
            gib(mb.optimizer),
            gib(mb.activations),
            gib(mb.workspace)
        );
        for rc in [Recompute::Selective, Recompute::Full] {
            let mut j = job.clone();
            j.parallel.recompute = rc;
            let (s, m) = peak_memory(&j);
            println!(
                "llama3-405b, {rc:?}: peak stage {s}: total {:.1} GiB (activations {:.1})",
                gib(m.total()),
                gib(m.activations)
            );
        }
        for s in [0, 1, 15] {
            let m = stage_memory(&job, s);
            println!("  stage {s}: {:.1} GiB", gib(m.total()));
        }
        // With flash attention and no dropout (Llama), no recompute fits an 80 GiB H100, barely.
        assert!(mb.total() as f64 > 75.0 * GIB && (mb.total() as f64) < 80.0 * GIB);
        // Model state on a middle stage: 8 layers x 3.188e9 params / 8 = 3.19e9 params.
        let mid = stage_params(&job, 1);
        let layer = job.model.layer_params();
        assert_eq!(mid.total(), 8 * ((layer - 2 * 16384) / 8 + 2 * 16384));
    }

    /// `fp8_param_gather` below ZeRO-3 keeps the layers' weights in FP8: a middle stage (only
    /// transformer layers) holds exactly half its weight bytes; the first stage keeps its
    /// embedding in BF16, so it saves exactly one byte per layer parameter.
    #[test]
    fn fp8_param_gather_keeps_layer_weights_in_fp8() {
        let mut job = llama405b_job();
        job.training.precision = Precision::Fp8;
        job.cluster.gpu.peak_tflops_fp8 = Some(1979.0);
        job.validate().unwrap();
        let mut f8 = job.clone();
        f8.parallel.fp8_param_gather = true;
        f8.validate().unwrap();
        let mid = stage_memory(&job, 1);
        let mid8 = stage_memory(&f8, 1);
        assert_eq!(mid8.weights * 2, mid.weights);
        assert_eq!(
            (mid8.gradients, mid8.optimizer, mid8.activations),
            (mid.gradients, mid.optimizer, mid.activations)
        );
        let first = stage_memory(&job, 0);
        let first8 = stage_memory(&f8, 0);
        let layer_params: u64 = (job.chunk_layers(0).into_iter().flatten())
            .map(|l| layer_params_at(&job, l).total())
            .sum();
        assert!(layer_params > 0 && layer_params < stage_params(&job, 0).total());
        assert_eq!(first.weights - first8.weights, layer_params);
    }
}
