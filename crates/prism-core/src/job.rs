//! The validated job: model, cluster, parallel layout settings and training settings.
//!
//! These are plain values. The edge (`prism-io`) parses job files into them and then calls
//! [`Job::validate`], which checks every cross-field rule and names the offending key.
//! Everything downstream (layout, graph, cost models, engine) may assume a validated job.

use std::fmt;

/// Upper bound on the number of GPUs a job may describe. Beyond it the per-rank state of the
/// engine would no longer fit a workstation; the limit is checked before anything is allocated.
pub const MAX_GPUS: u64 = 1 << 20;
/// Upper bound on transformer layers (a sanity bound, far above any published model).
pub const MAX_LAYERS: u32 = 4096;
/// Upper bound on micro-batches per iteration per pipeline (bounds graph size).
pub const MAX_MICRO_BATCHES: u64 = 1 << 16;

/// Feed-forward activation of the MLP block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Gated SiLU (Llama, Mistral, Qwen): three weight matrices of `hidden x ffn_hidden`.
    SwiGlu,
    /// Plain GeLU (GPT-3, Megatron GPT): two weight matrices.
    Gelu,
}

impl Activation {
    /// Number of `hidden x ffn` weight matrices in one MLP.
    pub fn mlp_matrices(self) -> u64 {
        match self {
            Activation::SwiGlu => 3,
            Activation::Gelu => 2,
        }
    }
}

/// Mixture-of-experts settings of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Number of routed experts per MoE layer.
    pub experts: u32,
    /// Experts each token is routed to.
    pub top_k: u32,
    /// Hidden size of one expert's MLP.
    pub ffn_hidden: u32,
}

/// A decoder-only transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// Display name.
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Model (residual) width.
    pub hidden: u32,
    /// Dense MLP hidden size (unused in MoE layers).
    pub ffn_hidden: u32,
    /// Attention (query) heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention); equal to `heads` for multi-head attention.
    pub kv_heads: u32,
    /// Width of one attention head (usually `hidden / heads`).
    pub head_dim: u32,
    /// Vocabulary size.
    pub vocab: u32,
    /// Training sequence length in tokens.
    pub seq_len: u32,
    /// MLP activation.
    pub activation: Activation,
    /// Mixture-of-experts settings; `None` for a dense model.
    pub moe: Option<Moe>,
    /// Input embedding and LM head share one matrix.
    pub tied_embeddings: bool,
    /// The model trains with dropout (GPT-3 / Megatron GPT: yes; Llama, Mistral, Nemotron-4:
    /// no). Dropout masks are stored activations.
    pub dropout: bool,
    /// Architecture features of current families (MLA, shared experts, local attention,
    /// multi-token prediction); the default is the plain decoder. See [`crate::arch`].
    pub arch: crate::arch::Arch,
}

impl Model {
    /// Parameters of one attention block (QKV + output projection), no biases; with
    /// multi-head latent attention its projections and latent norms ([`crate::arch`]), with
    /// query/key norms their weights.
    pub fn attention_params(&self) -> u64 {
        let h = self.hidden as u64;
        if let Some(mla) = &self.arch.mla {
            let heads = self.heads as u64;
            let (rq, rkv) = (mla.q_lora_rank as u64, mla.kv_lora_rank as u64);
            let q = if rq > 0 {
                h * rq + rq + rq * heads * mla.qk_head_dim()
            } else {
                h * heads * mla.qk_head_dim()
            };
            let kv = h * (rkv + mla.qk_rope_head_dim as u64)
                + rkv
                + rkv * heads * (mla.qk_nope_head_dim as u64 + mla.v_head_dim as u64);
            return q + kv + heads * mla.v_head_dim as u64 * h;
        }
        let qk_norm = if self.arch.qk_norm {
            2 * self.head_dim as u64
        } else {
            0
        };
        let q = self.heads as u64 * self.head_dim as u64;
        let kv = self.kv_heads as u64 * self.head_dim as u64;
        h * (q + 2 * kv) + q * h + qk_norm
    }

    /// Parameters of one dense MLP.
    pub fn dense_mlp_params(&self) -> u64 {
        self.activation.mlp_matrices() * self.hidden as u64 * self.ffn_hidden as u64
    }

    /// Parameters of one expert MLP (0 for dense models).
    pub fn expert_params(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| {
            self.activation.mlp_matrices() * self.hidden as u64 * m.ffn_hidden as u64
        })
    }

    /// Parameters of one transformer layer (attention + MLP or all experts + router + shared
    /// experts + norms); for a model with dense and MoE layers, of an MoE layer
    /// ([`Model::layer_params_at`] gives any layer's).
    pub fn layer_params(&self) -> u64 {
        let h = self.hidden as u64;
        let mlp = match &self.moe {
            None => self.dense_mlp_params(),
            Some(m) => {
                m.experts as u64 * self.expert_params()
                    + h * m.experts as u64
                    + self.shared_expert_params()
            }
        };
        self.attention_params() + mlp + 2 * h
    }

    /// Embedding parameters (input embedding, plus the LM head when untied).
    pub fn embedding_params(&self) -> u64 {
        let e = self.vocab as u64 * self.hidden as u64;
        if self.tied_embeddings { e } else { 2 * e }
    }

    /// Total parameters (without multi-token-prediction modules, [`Model::mtp_params`]).
    pub fn params(&self) -> u64 {
        let layers: u64 = self
            .layer_kinds()
            .iter()
            .map(|&(n, l)| n as u64 * self.layer_params_at(l))
            .sum();
        layers + self.embedding_params() + self.hidden as u64
    }

    /// Parameters a token actually uses (top-k experts instead of all experts).
    pub fn active_params(&self) -> u64 {
        match &self.moe {
            None => self.params(),
            Some(m) => {
                self.params()
                    - self.moe_layers() as u64 * (m.experts - m.top_k) as u64 * self.expert_params()
            }
        }
    }

    /// [`Model::active_params`] without the input embedding (a table lookup, no matrix
    /// multiply), the convention DeepSeek and OpenAI publish active counts in (DeepSeek-V3's
    /// "37B activated", gpt-oss's 5.13B). A tied embedding is also the output head and stays.
    pub fn active_params_without_input_embedding(&self) -> u64 {
        let input = if self.tied_embeddings {
            0
        } else {
            self.vocab as u64 * self.hidden as u64
        };
        self.active_params() - input
    }
}

/// A GPU model.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// Name, e.g. `H100-SXM5-80GB`.
    pub name: String,
    /// Dense BF16 tensor-core peak, TFLOP/s.
    pub peak_tflops_bf16: f64,
    /// Dense FP8 tensor-core peak, TFLOP/s; `None` where the GPU has no FP8.
    pub peak_tflops_fp8: Option<f64>,
    /// HBM capacity, GiB.
    pub hbm_gib: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tbps: f64,
}

/// Scale-out network topology.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// Nodes under one leaf switch of each rail (rail-optimized fat tree). Traffic between GPUs of
    /// the same rail whose nodes share a leaf group crosses only that leaf; anything else goes up
    /// to the spine.
    pub rail_group_nodes: u32,
    /// Leaf-to-spine oversubscription ratio (1.0 = non-blocking).
    pub oversubscription: f64,
    /// Nodes per pod, the block of the fabric inside which the spine is the top tier; above it
    /// an aggregation tier joins the pods (a three-tier Clos, as Meta's 24K-GPU RoCE clusters:
    /// pods of 3,072 GPUs, Dubey et al. 2024 Sec. 3.3.1). 0: one pod holds the whole cluster.
    pub pod_nodes: u32,
    /// Pod-to-aggregation oversubscription ratio (Meta: 1:7, so 7.0); 1.0 = non-blocking.
    pub pod_oversubscription: f64,
    /// ECMP on the pod uplinks: flows each connection is split into, each hashed onto one
    /// port (RoCE queue pairs; Meta's E-ECMP: 16). 0: traffic spread ideally (no collisions).
    pub ecmp_flows: u32,
    /// Datacenters and the WAN joining them ([`crate::wan`]); the default is one datacenter.
    pub wan: crate::wan::Wan,
}

/// A cluster of identical nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// Display name.
    pub name: String,
    /// The GPU model.
    pub gpu: Gpu,
    /// GPUs per node (one NVLink domain).
    pub gpus_per_node: u32,
    /// Number of nodes.
    pub nodes: u32,
    /// NVLink bandwidth per GPU per direction, Gb/s (gigabits).
    pub nvlink_gbps: f64,
    /// Scale-out NIC bandwidth per GPU per direction, Gb/s (gigabits).
    pub nic_gbps: f64,
    /// One-way latency of one scale-out hop, microseconds.
    pub nic_latency_us: f64,
    /// One-way latency of one NVLink hop, microseconds.
    pub nvlink_latency_us: f64,
    /// Scale-out topology.
    /// Coefficient of variation of per-GPU speed (persistent, independent across GPUs), for
    /// the expected iteration time with stragglers ([`crate::straggler`]).
    pub gpu_speed_cv: f64,
    pub topology: Topology,
}

impl Cluster {
    /// Total GPUs.
    pub fn num_gpus(&self) -> u64 {
        self.gpus_per_node as u64 * self.nodes as u64
    }
}

/// Pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards.
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush).
    OneFOneB,
    /// Interleaved 1F1B over `vpp` virtual stages per rank.
    Interleaved,
    /// DeepSeek's DualPipe (DeepSeek-V3 report Sec. 3.2.1; github.com/deepseek-ai/DualPipe):
    /// two pipelines in opposite directions, each rank holding stage `r` of one and stage
    /// `pp - 1 - r` of the other (two copies of the parameters), half the micro-batches fed from
    /// each end, and in steady state a forward chunk of one direction overlapped with a
    /// backward chunk of the other ([`crate::schedules`]).
    DualPipe,
    /// Megatron-Core's 1F1B with expert-parallel communication overlap (combined 1F1B,
    /// `--overlap-moe-expert-parallel-comm`): in steady state each forward is overlapped with
    /// the backward of another micro-batch, so that one's all-to-alls run under the other's
    /// compute ([`crate::schedules`]).
    OneFOneBOverlap,
}

/// Order of the parallel dimensions over the ranks, fastest first (Megatron-Core's
/// `RankGenerator` order). Tensor parallel is always fastest, so TP groups stay in a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RankOrder {
    /// `tp-cp-ep-dp-pp`, Megatron-Core's default: a pipeline stage is one contiguous block of
    /// ranks, data-parallel replicas of a stage are neighbours.
    #[default]
    TpCpEpDpPp,
    /// `tp-cp-ep-pp-dp` (Megatron `--use-tp-pp-dp-mapping`; the Llama 3 order [TP, CP, PP, DP],
    /// Dubey et al. 2024 Sec. 3.3.2): a whole pipeline is one contiguous block of ranks and
    /// data parallelism is outermost.
    TpCpEpPpDp,
}

impl RankOrder {
    /// The order as Megatron-Core writes it.
    pub fn name(self) -> &'static str {
        match self {
            RankOrder::TpCpEpDpPp => "tp-cp-ep-dp-pp",
            RankOrder::TpCpEpPpDp => "tp-cp-ep-pp-dp",
        }
    }
}

/// Activation recomputation mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Keep all activations.
    None,
    /// Recompute the attention core (softmax, dropout, scores) only (Korthikanti et al. 2022).
    Selective,
    /// Keep only each layer's input; recompute the whole layer forward in backward.
    Full,
    /// torchtitan's per-op selective activation checkpointing (`[activation_checkpoint]
    /// mode = "selective"`, `selective_ac_option = "op"`, the default of its Llama 3
    /// configs): inside each layer the outputs of the attention kernel, of every
    /// reduce-scatter and of every other matrix multiply (the 1st, 3rd, 5th, ... in forward
    /// order: Q, V, the first MLP projection, and a SwiGLU's down projection) are saved with
    /// the layer input; the backward recomputes what it needs of the rest (the norms, the K
    /// projection, the output projection unless a reduce-scatter follows it, the residual,
    /// SwiGLU's up projection, the activation). Dense layers with standard attention only
    /// ([`Job::validate`]).
    SelectiveOp,
}

impl Recompute {
    /// Job-file names (Megatron's `--recompute-granularity` values, and torchtitan's per-op
    /// policy).
    pub const NAMES: [(&'static str, Recompute); 4] = [
        ("none", Recompute::None),
        ("selective", Recompute::Selective),
        ("full", Recompute::Full),
        ("selective-op", Recompute::SelectiveOp),
    ];

    /// The job-file spelling.
    pub fn name(self) -> &'static str {
        spelling(&Self::NAMES, self)
    }
}

/// Numeric precision of the GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// BF16 GEMMs, BF16 activations.
    Bf16,
    /// FP16 GEMMs and activations with loss scaling (Megatron `--fp16`). The tensor cores run
    /// FP16 at the BF16 rate on every GPU Prism knows (A100, H100, H200, B200: the datasheets'
    /// dense FP16 and BF16 peaks are equal). What differs is Megatron's gradient type: only
    /// BF16 forces FP32 gradient accumulation and reduction (`megatron/training/arguments.py`:
    /// "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"), so FP16
    /// jobs accumulate and reduce gradients in FP16 unless `grad_reduce_in_bf16 = false`
    /// (Megatron `--accumulate-allreduce-grads-in-fp32`) says otherwise.
    Fp16,
    /// FP8 GEMMs (transformer-engine style), BF16 elsewhere.
    Fp8,
}

impl Precision {
    /// Job-file names.
    pub const NAMES: [(&'static str, Precision); 3] = [
        ("bf16", Precision::Bf16),
        ("fp16", Precision::Fp16),
        ("fp8", Precision::Fp8),
    ];

    /// The job-file spelling.
    pub fn name(self) -> &'static str {
        spelling(&Self::NAMES, self)
    }
}

/// The name of `value` in a job-file spelling table (`(name, value)` pairs, as
/// [`Precision::NAMES`]); a value missing from its table is a bug.
pub fn spelling<T: PartialEq + Copy>(names: &[(&'static str, T)], value: T) -> &'static str {
    names
        .iter()
        .find(|(_, v)| *v == value)
        .map(|(n, _)| *n)
        .expect("every variant is named")
}

/// Parallel layout settings, Megatron-LM style.
#[derive(Clone, Debug, PartialEq)]
pub struct Parallel {
    /// Tensor parallel size.
    pub tp: u32,
    /// Pipeline parallel size.
    pub pp: u32,
    /// Context parallel size.
    pub cp: u32,
    /// Expert parallel size (inside the data-parallel dimension, as in Megatron-Core).
    pub ep: u32,
    /// Data parallel size.
    pub dp: u32,
    /// Virtual pipeline stages per pipeline rank.
    pub vpp: u32,
    /// Sequences per micro-batch.
    pub micro_batch: u32,
    /// Sequence parallelism for the TP regions.
    pub sequence_parallel: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// ZeRO-1 style distributed optimizer (sharded optimizer state, reduce-scatter + all-gather).
    pub distributed_optimizer: bool,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Layers on the first pipeline stage when the split is uneven
    /// (Megatron `decoder_first_pipeline_num_layers`).
    pub first_stage_layers: Option<u32>,
    /// Layers on the last pipeline stage when the split is uneven
    /// (Megatron `decoder_last_pipeline_num_layers`).
    pub last_stage_layers: Option<u32>,
    /// A custom layout of layers over the virtual pipeline stages (Megatron-Core
    /// `--pipeline-model-parallel-layout`); sets `vpp` to its stage count / `pp`.
    pub pipeline_layout: Option<crate::pipeline_layout::PipelineLayout>,
    /// Free each model chunk's received input after its forward (the Llama 3 stack, Dubey et
    /// al. 2024 Sec. 3.3.2); see [`crate::memory::in_flight_activations`].
    pub deallocate_stage_input: bool,
    /// Gradient bucket size for the data-parallel reduction, in millions of parameters
    /// (Megatron-Core's default bucket is 40 M parameters).
    pub dp_bucket_mparams: f64,
    /// Split the gradients of every model chunk of every pipeline stage into buckets of
    /// `dp_bucket_mparams`. `false` is Megatron-Core's rule: only the first stage's first chunk
    /// is split; every other chunk reduces (and gathers) its parameters as one bucket, once
    /// backward has finished all of them (`DistributedDataParallel`: `bucket_size = None` when
    /// `pp_rank > 0` or for model chunks after the first, September 2023 on).
    pub dp_buckets_every_stage: bool,
    /// Megatron-Core's `--align-grad-reduce` (`--delay-grad-reduce` until August 2024, on by
    /// default in both): with the interleaved schedule and Megatron-Core's buckets, each
    /// chunk's gradients are reduced together after its last backward, and stage `r` launches
    /// that reduction `r` backward steps later, at the same time across the pipeline.
    pub align_grad_reduce: bool,
    /// Reduce each gradient bucket as soon as backward has finished it, overlapping the rest of
    /// backward (Megatron `--overlap-grad-reduce`). `false`: one reduction after backward.
    pub overlap_grad_reduce: bool,
    /// Distributed optimizer only: gather each parameter bucket at the start of the iteration
    /// and let forward wait only for its own bucket (Megatron `--overlap-param-gather`).
    /// `false`: gather everything after the optimizer step.
    pub overlap_param_gather: bool,
    /// Overlap tensor-parallel all-gathers/reduce-scatters with the GEMMs that consume or
    /// produce them (Megatron `--tp-comm-overlap`, Transformer Engine userbuffers).
    pub tp_comm_overlap: bool,
    /// Streaming multiprocessors each GPU reserves for communication kernels that run beside
    /// the computation (DeepSeek-V3's all-to-all kernels: 20 of the H800's 132, Sec. 3.2.2);
    /// compute kernels run on the rest. 0: communication takes no compute SMs (NCCL's copy
    /// engines and its own short-lived kernels, as the calibration assumes).
    pub comm_sms: u32,
    /// How the expert all-to-alls move tokens ([`MoeDispatcher`]).
    pub moe_dispatcher: MoeDispatcher,
    /// How context-parallel ranks exchange keys and values ([`CpCommType`]).
    pub cp_comm_type: CpCommType,
    /// Order of the parallel dimensions over the ranks.
    pub order: RankOrder,
    /// ZeRO stage of the data-parallel dimension (Rajbhandari et al. 2020): 0 nothing sharded,
    /// 1 optimizer state sharded (Megatron's distributed optimizer), 2 also gradients, 3 also
    /// parameters (DeepSpeed ZeRO-3, PyTorch FSDP full sharding: every layer's parameters are
    /// all-gathered before its forward and again before its backward, and its gradients
    /// reduce-scattered after its backward, in every micro-batch). Always
    /// `distributed_optimizer == (zero_stage >= 1)`; set both with
    /// [`Parallel::set_zero_stage`].
    pub zero_stage: u8,
    /// Reduce data-parallel gradients in 16 bits (Megatron `--grad-reduce-in-bf16`, or FP16
    /// gradients of an FP16 job; DeepSpeed's FP16/BF16 communication data type) instead of
    /// FP32: half the bytes. Megatron keeps its main gradients in the reduction's type, so
    /// for the Megatron stacks this is also the accumulation type ([`Job::grad_accum_bytes`]).
    pub grad_reduce_in_bf16: bool,
    /// Weight-gradient GEMMs add into the main gradients in their epilogue (Megatron's
    /// `gradient_accumulation_fusion`, `--no-gradient-accumulation-fusion` to turn it off);
    /// `false`: each weight gradient is written in 16 bits and a separate elementwise kernel
    /// adds it to the main gradient (Megatron-LM before February 2022, and with FP16
    /// gradients before September 2022). Only the stacks with main gradients
    /// ([`Stack::accumulates_main_grads`]) charge either.
    pub gradient_accumulation_fusion: bool,
    /// Times the pipeline schedule runs per iteration, each over `micro_batches / pipeline_rounds`
    /// micro-batches with its own warm-up and cool-down, gradients accumulated across them and
    /// synchronised after the last (gradient accumulation outside the schedule, as
    /// torch.distributed.pipelining runs it in torchtitan and NeMo AutoModel). 1: one schedule
    /// over all micro-batches (Megatron). No effect without pipeline parallelism.
    pub pipeline_rounds: u32,
    /// Pipeline messages split over the TP ranks and gathered over NVLink on arrival
    /// (Megatron's scatter/gather optimisation, Narayanan et al. 2021 Sec. 4.1); without it
    /// every TP rank sends the whole activation. No effect with sequence parallelism (the
    /// activation is already split).
    pub pp_scatter_gather: bool,
    /// ZeRO-3: a layer's gathered parameters are freed after its forward and gathered again
    /// for its backward (PyTorch FSDP2 `reshard_after_forward = True`, DeepSpeed ZeRO-3).
    /// `false` keeps them from the forward to the backward: one gather per micro-batch
    /// instead of two, every layer of the stage held whole in between. No effect below
    /// ZeRO-3.
    pub reshard_after_forward: bool,
    /// ZeRO-3: when a layer's gradients are reduce-scattered ([`Zero3Sync`]).
    pub zero3_grad_sync: Zero3Sync,
    /// FP8 jobs with sharded parameters (ZeRO-3, or the distributed optimizer): the
    /// transformer layers' weights are gathered in FP8, 1 byte per parameter instead of 2
    /// (torchtitan `float8.enable_fsdp_float8_all_gather`, Megatron `--fp8-param-gather`).
    /// Each rank casts its own shard before the gather; the gathered FP8 weight is only
    /// transposed for the backward (read and write 1 byte per element) instead of cast from
    /// BF16. The embedding and output head stay BF16.
    pub fp8_param_gather: bool,
    /// How the interleaved schedule's pipeline sends overlap the computation
    /// ([`PipelineP2p`]). Plain 1F1B and GPipe always block on their sends (Megatron turns
    /// the overlap off without interleaving); DualPipe and 1F1B with EP overlap have their own.
    pub pipeline_p2p: PipelineP2p,
}

/// How an interleaved pipeline schedule's sends and receives overlap the computation, as
/// Megatron's `p2p_communication` and `schedules.py` run them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PipelineP2p {
    /// Every step's messages complete before the next step computes, and a steady-state
    /// step sends its forward's output together with its backward's gradient after both
    /// (one batched `send_forward_backward_recv_forward_backward`, then
    /// `torch.cuda.synchronize()`): Megatron-LM until October 2023, `overlap_p2p_comm =
    /// false` (`--no-overlap-p2p-communication`) since.
    Blocking,
    /// Megatron-Core's `overlap_p2p_comm` (the default from October 2023, 4eeff55d): each
    /// forward waits for the previous forward's sends and receives, each backward for the
    /// previous backward's. In the steady state the opposite direction's computation runs
    /// in between; in the warm-up and the cool-down nothing does, so each step waits for its
    /// predecessor's messages (`overlap_p2p_comm_warmup_flush = false`).
    #[default]
    SteadyState,
    /// Nothing waits for a send: Megatron-Core's `overlap_p2p_comm_warmup_flush` (November
    /// 2024), torch.distributed.pipelining, the asynchronous sends of Meta's Llama 3 runs.
    Async,
}

/// When ZeRO-3 (FSDP) reduce-scatters a layer's gradients, and so how long its gathered
/// parameters may stay whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Zero3Sync {
    /// After every micro-batch's backward (FSDP's default, DeepSpeed ZeRO-3); the
    /// parameters are resharded after each backward.
    #[default]
    MicroBatch,
    /// After a stage's last backward of each run of the pipeline schedule
    /// (`parallel.pipeline_rounds`): torch.distributed.pipelining turns FSDP's gradient sync
    /// and resharding off for every other backward (`backward_maybe_with_nosync`).
    ScheduleRun,
    /// After the last backward of the iteration (FSDP2 `set_requires_gradient_sync(False)`
    /// over the accumulation; NeMo AutoModel's `enable_fsdp_optimizations`).
    Iteration,
}

impl Zero3Sync {
    /// Job-file names.
    pub const NAMES: [(&'static str, Zero3Sync); 3] = [
        ("micro-batch", Zero3Sync::MicroBatch),
        ("schedule-run", Zero3Sync::ScheduleRun),
        ("iteration", Zero3Sync::Iteration),
    ];

    /// The job-file spelling.
    pub fn name(self) -> &'static str {
        spelling(&Self::NAMES, self)
    }
}

impl Parallel {
    /// Sets the ZeRO stage and keeps `distributed_optimizer` consistent with it.
    pub fn set_zero_stage(&mut self, stage: u8) {
        self.zero_stage = stage;
        self.distributed_optimizer = stage >= 1;
    }

    /// Turns the distributed optimizer on (ZeRO stage at least 1) or off (stage 0).
    pub fn set_distributed_optimizer(&mut self, on: bool) {
        let stage = if on { self.zero_stage.max(1) } else { 0 };
        self.set_zero_stage(stage);
    }

    /// True when sequence parallelism splits the TP group's norm and dropout regions (it is
    /// on and `tp > 1`): the TP reductions are reduce-scatters and the inputs of the
    /// column-parallel GEMMs are all-gathered.
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.tp > 1
    }

    /// True when parameters are sharded over data parallelism (ZeRO-3 / FSDP).
    pub fn shards_params(&self) -> bool {
        self.zero_stage >= 3
    }

    /// True when gradients are sharded over data parallelism (ZeRO-2 and 3). A rank then
    /// keeps only its shard of the accumulated gradients, so every micro-batch's gradients
    /// must be reduce-scattered as its backward produces them, not once after the last
    /// micro-batch (DeepSpeed's maintainers: "for zero stage 2 (and 3), gradient reduction
    /// is required after every backward because of gradient partitioning", DeepSpeed issue
    /// #2252; PyTorch FSDP likewise outside `no_sync`).
    pub fn shards_grads(&self) -> bool {
        self.zero_stage >= 2
    }
}

/// Training settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Training {
    /// Sequences per iteration.
    pub global_batch: u32,
    /// GEMM precision.
    pub precision: Precision,
    /// Fused (flash) attention: the score matrix is never stored (FlashAttention-2/3, cuDNN
    /// fused attention). `false` models the unfused attention of Megatron-LM 2021-2022.
    pub flash_attention: bool,
    /// The training software the job runs on; it sets the defaults of the settings that
    /// differ between stacks ([`Stack`]) and its own rules.
    pub stack: Stack,
    /// DeepSeek-V3's memory-saving techniques (all off by default).
    pub memory_saving: MemorySaving,
    /// How FP8 GEMM operands are scaled (only with [`Precision::Fp8`]).
    pub fp8_recipe: Fp8Recipe,
    /// Which fused-attention kernels run ([`AttentionBackend`]; only with `flash_attention`).
    pub attention_backend: AttentionBackend,
    /// Which cross-entropy kernels the Megatron stacks run ([`CrossEntropyFusion`]).
    pub cross_entropy_fusion: CrossEntropyFusion,
    /// FP8 weights kept from the first micro-batch of an iteration to the last (only with
    /// [`Precision::Fp8`]): Megatron-Core flags each model chunk's first micro-batch
    /// (`set_is_first_microbatch`, `pipeline_parallel/schedules.py`) and Transformer Engine casts
    /// and transposes a weight to FP8 only then (`update_fp8_weights = is_first_microbatch is
    /// None or is_first_microbatch`), unless `disable_parameter_transpose_cache`. `false`: every
    /// micro-batch casts the weights in forward and again, transposed, in backward.
    pub fp8_weight_cache: bool,
    /// FP32 master weights beside the 16-bit ones (mixed-precision training: Megatron's
    /// optimizers, DeepSpeed, torchtitan's FP32 model under FSDP2's BF16 compute policy).
    /// `false`: the model itself is BF16 and the optimizer updates it in place, as PyTorch's
    /// optimizers do on a model cast to BF16 (NeMo AutoModel's recipes, whose
    /// `initialize_weights` ends with `self.to(torch.bfloat16)`): no FP32 copy, gradients
    /// held in BF16, and the Adam moments created like the parameters (the job file's
    /// default `optimizer_state_dtype` is then `"bf16"`). See
    /// [`Job::optimizer_bytes_per_param`] and [`Job::adam_step_bytes_per_param`].
    pub master_weights: bool,
    /// The FP32 master weights stored as remainders: only the 16 low bits of each master
    /// weight are kept, the 16 high bits being the BF16 weight itself, 2 bytes per parameter
    /// instead of 4. Apex's `DistributedFusedAdam` with `store_param_remainders` (NeMo 1.x sets
    /// it for a BF16 model under `megatron_amp_O2` with `distributed_fused_adam` and an FP32
    /// optimizer, `megatron_base_model.py` since October 2022) and Transformer Engine's
    /// `FusedAdam` under Megatron-Core's `--use-precision-aware-optimizer` (its
    /// `store_param_remainders` is on by default since February 2025). Needs
    /// [`Training::master_weights`], BF16 weights (not FP16, not FP8 ones) and ZeRO below
    /// stage 3. See [`Job::optimizer_bytes_per_param`] and [`Job::adam_step_bytes_per_param`].
    pub master_weight_remainders: bool,
}

/// How expert-parallel tokens are exchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MoeDispatcher {
    /// NCCL all-to-all (Megatron's `alltoall` dispatcher): every routed copy of a token bound for
    /// another node crosses the network on its own.
    #[default]
    AllToAll,
    /// DeepEP's dispatch and combine (Megatron's `flex` dispatcher, NeMo AutoModel's
    /// `dispatcher: deepep`): a token crosses the network once per distinct remote node, to
    /// the GPU with its own local index, and is forwarded over NVLink to the experts there
    /// (DeepSeek-V3 report Sec. 3.2.2; the kernels DeepSeek released as DeepEP). Group-limited
    /// routing (`model.moe_groups`) implies it.
    DeepEp,
}

/// How context-parallel attention moves keys and values between the `cp` ranks of a group
/// (Megatron-Core `--cp-comm-type`, Transformer Engine's `cp_comm_type`). Each rank holds two
/// chunks of `seq_len / (2 cp)` tokens (the first and the mirrored last, so that causal work is
/// balanced).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpCommType {
    /// Ring attention, Transformer Engine's default (`AttnFuncWithCPAndKVP2P`): `cp` steps; at
    /// each the rank computes its queries against the keys and values it holds (the causal
    /// diagonal of its own chunks first, then one unmasked `2c x c` block per step) while it
    /// passes them on to the next rank of the ring and receives the next ones. Backward runs
    /// the same ring with the key and value gradients travelling beside the keys and values.
    /// Communication hides under the attention of the step it overlaps.
    #[default]
    P2p,
    /// All-gather the keys and values of the whole sequence before the attention (one
    /// kernel over them) and reduce-scatter their gradients after its backward, not
    /// overlapped (`all_gather`).
    AllGather,
    /// Ulysses-style head exchange (`a2a`, Transformer Engine's `AttnFuncWithCPAndQKVOA2A`):
    /// an all-to-all turns the rank's queries, keys and values of `seq_len / cp` tokens on all
    /// its heads into the whole sequence on `1 / cp` of its heads, one attention kernel runs
    /// over the whole causal sequence (local windows included), and a second all-to-all
    /// returns the output to the rank's tokens; backward exchanges the output and its
    /// gradient before the kernel and the query, key and value gradients after it. Needs the
    /// query and key/value heads of a tensor-parallel rank divisible by `cp`. Not overlapped.
    A2a,
}

impl CpCommType {
    /// Job-file names (Megatron-Core's spellings).
    pub const NAMES: [(&'static str, CpCommType); 3] = [
        ("p2p", CpCommType::P2p),
        ("all_gather", CpCommType::AllGather),
        ("a2a", CpCommType::A2a),
    ];

    /// The job-file name.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, t)| *t == self)
            .map(|(n, _)| *n)
            .expect("every form is named")
    }
}

/// Scaling granularity of FP8 GEMM operands. Finer scales keep more precision and cost GEMM
/// throughput on Hopper (more scale loads and multiplies per tile; measured in
/// `validation/h100`, docs/calibration.md); Blackwell's tensor cores apply MXFP8 block scales
/// natively.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Recipe {
    /// One scale per tensor (Transformer Engine's delayed or current scaling).
    #[default]
    Tensorwise,
    /// One scale per row of the activations and per column of the weights.
    Rowwise,
    /// DeepSeek-V3's fine-grained quantization (arXiv:2412.19437 Sec. 3.3.2): 1x128 tiles of the
    /// activations, 128x128 blocks of the weights (Transformer Engine's `Float8BlockScaling`).
    Blockwise,
    /// OCP microscaling: one E8M0 scale per 32 consecutive elements, in the tensor cores of
    /// Blackwell GPUs only (Transformer Engine's `MXFP8BlockScaling`).
    Mxfp8,
}

impl Fp8Recipe {
    /// Job-file names.
    pub const NAMES: [(&'static str, Fp8Recipe); 4] = [
        ("tensorwise", Fp8Recipe::Tensorwise),
        ("rowwise", Fp8Recipe::Rowwise),
        ("blockwise", Fp8Recipe::Blockwise),
        ("mxfp8", Fp8Recipe::Mxfp8),
    ];
}

/// The fused-attention kernels a job runs. The calibrated attention ceilings
/// ([`crate::cost::compute::ComputeParams::attn_fwd_eff_max`]) are those of the cuDNN fused
/// attention that Megatron-Core runs through Transformer Engine on Hopper; the other kernels
/// are priced relative to it, as measured on the same GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionBackend {
    /// cuDNN fused attention: Transformer Engine's `DotProductAttention` (Megatron-Core, NeMo
    /// AutoModel's `attn: te`) and PyTorch SDPA's cuDNN back-end (torchtitan's first choice
    /// from 2026; on B200 since May 2025).
    #[default]
    Cudnn,
    /// PyTorch SDPA's flash back-end, the FlashAttention-2 kernels (torchtitan's first choice
    /// on Hopper until 2026: `ScaledDotProductAttention._init_backend` at commit e7c0cae,
    /// June 2025, puts cuDNN first on B200 only). On an H100 it runs at 0.506 (forward) and
    /// 0.565 (backward) of cuDNN's throughput, median of 11 shapes (validation/h100), 0.511 and
    /// 0.561 on an H200 (validation/h200).
    Flash2,
}

impl AttentionBackend {
    /// Job-file names.
    pub const NAMES: [(&'static str, AttentionBackend); 2] = [
        ("cudnn", AttentionBackend::Cudnn),
        ("flash2", AttentionBackend::Flash2),
    ];
}

impl Training {
    /// HBM bytes the job's cross-entropy loss moves per logit element, forward and backward:
    /// the fused kernels it names on Megatron-Core, else its stack's own loss.
    pub fn loss_bytes_per_logit(&self) -> (u64, u64) {
        self.cross_entropy_fusion.loss_bytes_per_logit(self.stack)
    }
}

/// The cross-entropy kernels of the Megatron stacks (Megatron-Core `--cross-entropy-loss-fusion`
/// and `--cross-entropy-fusion-impl`), priced by the HBM bytes they move per logit element (one
/// token times one vocabulary entry of this GPU), forward and backward
/// ([`Stack::loss_bytes_per_logit`] for the unfused ones).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CrossEntropyFusion {
    /// The stack's own loss (Megatron's unfused vocab-parallel cross entropy: 38 and 14 bytes).
    #[default]
    None,
    /// Megatron-Core's `fused_vocab_parallel_cross_entropy`
    /// (`megatron/core/fusions/fused_cross_entropy.py`, `--cross-entropy-fusion-impl native`):
    /// fused JIT functions over the FP32 logits. Forward: the cast and row maximum (read 2, write
    /// 4), the shifted exponentials (read 4, write 4) and their in-place division by the sum (8):
    /// 22 bytes. Backward: the stored softmax read and the BF16 gradient written (4 + 2): 6.
    Native,
    /// Transformer Engine's Triton cross entropy (`transformer_engine/common/triton/cross_entropy.py`,
    /// `--cross-entropy-fusion-impl te`, Megatron-Bridge's recipes): an online-softmax pass over
    /// the BF16 logits (read 2), then a second pass that writes the gradient in place of the
    /// logits (read 2, write 2): 6 bytes. Backward scales that gradient in place (read 2, write
    /// 2): 4.
    Te,
}

impl CrossEntropyFusion {
    /// Job-file names.
    pub const NAMES: [(&'static str, CrossEntropyFusion); 3] = [
        ("none", CrossEntropyFusion::None),
        ("native", CrossEntropyFusion::Native),
        ("te", CrossEntropyFusion::Te),
    ];

    /// HBM bytes per logit element, forward and backward, on `stack` (the fused kernels are
    /// Megatron-Core's; a stack without them keeps its own loss).
    pub fn loss_bytes_per_logit(self, stack: Stack) -> (u64, u64) {
        match (self, stack) {
            (CrossEntropyFusion::Native, Stack::MegatronCore) => (22, 6),
            (CrossEntropyFusion::Te, Stack::MegatronCore) => (6, 4),
            _ => stack.loss_bytes_per_logit(),
        }
    }
}

/// Memory-saving techniques of the DeepSeek-V3 technical report (DeepSeek-AI 2024,
/// arXiv:2412.19437, Sec. 3.2.3 and 3.3.3). Each is independent; the default (all off) is the
/// plain Megatron-style accounting. Their effect on stored activations is spelled out tensor by
/// tensor in [`crate::memory::layer_activation_bytes_at`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemorySaving {
    /// Recompute every transformer-layer RMSNorm and, with multi-head latent attention, the
    /// query and key-value up-projections during backward (Sec. 3.2.3), so their outputs are
    /// not stored. Ignored with [`Recompute::Full`], which recomputes the whole layer anyway.
    pub recompute_norm_upproj: bool,
    /// Storage format of the activations cached for the backward of linear layers.
    pub activation_cache: ActivationCache,
    /// Storage format of the AdamW first and second moments.
    pub optimizer_state: OptimizerStateDtype,
}

impl MemorySaving {
    /// Whether the norm and up-projection recomputation is in effect for `recompute`.
    pub fn recomputes_norm_upproj(&self, recompute: Recompute) -> bool {
        self.recompute_norm_upproj && !matches!(recompute, Recompute::Full | Recompute::SelectiveOp)
    }
}

/// Storage format of the activations cached for the weight-gradient GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationCache {
    /// BF16 (2 bytes per element), as the GEMMs produce them.
    #[default]
    Bf16,
    /// DeepSeek-V3's FP8 caching (Sec. 3.3.3 "Low-Precision Activation"): linear-layer inputs
    /// in FP8 (1 byte), the input of the linear after attention in the 12-bit E5M6 format
    /// (1.5 bytes), and in MoE layers the SwiGLU input in FP8 with its output recomputed in
    /// backward. Needs FP8 GEMMs ([`Precision::Fp8`]).
    Fp8,
}

/// Storage format of the AdamW first and second moments; the master weights and gradients are
/// FP32 either way with [`Training::master_weights`] (BF16 without them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerStateDtype {
    /// FP32 moments: 4 + 4 bytes per parameter (12 with the FP32 master weights).
    #[default]
    Fp32,
    /// BF16 moments (DeepSeek-V3, Sec. 3.3.3 "Low-Precision Optimizer States"): 2 + 2 bytes
    /// per parameter (8 with the FP32 master weights).
    Bf16,
}

impl OptimizerStateDtype {
    /// Bytes per parameter of the two moments: 4 + 4 in FP32, 2 + 2 in BF16.
    pub fn moment_bytes(self) -> u64 {
        match self {
            OptimizerStateDtype::Fp32 => 8,
            OptimizerStateDtype::Bf16 => 4,
        }
    }

    /// Bytes per parameter of the optimizer state with FP32 master weights: the master weight
    /// plus the two moments, 12 or 8 ([`Job::optimizer_bytes_per_param`] also covers jobs
    /// without).
    pub fn bytes_per_param(self) -> u64 {
        4 + self.moment_bytes()
    }

    /// Bytes the AdamW step reads and writes per parameter with FP32 master weights: the FP32
    /// gradient (4), the FP32 master weight (read and write, 8), both moments (read and write)
    /// and the BF16 weight written (2): 30 with FP32 moments, 22 with BF16 ones.
    pub fn step_bytes_per_param(self) -> u64 {
        4 + 8 + 2 + 2 * self.moment_bytes()
    }
}

/// A training software stack. Each differs physically in which communication overlaps exist,
/// which kernels are fused, how pipeline messages are sized and how the data-parallel state
/// is sharded; [`Stack::defaults`] lists the job settings it implies (a job may still set any
/// of them explicitly).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stack {
    /// Megatron-Core (2024 on): distributed optimizer, gradient reduce-scatter and parameter
    /// all-gather overlapped per bucket, sequence parallelism, fused (flash) attention,
    /// FP32 gradient reduction, pipeline messages split over TP ranks.
    #[default]
    MegatronCore,
    /// Megatron-LM of 2021-2023 (Narayanan et al. 2021, Korthikanti et al. 2022): one FP32
    /// gradient all-reduce after backward, no distributed optimizer, no sequence parallelism,
    /// unfused attention (fused scale-mask-softmax), scatter/gather pipeline messages.
    MegatronLm2021,
    /// DeepSpeed with its pipeline engine and ZeRO (Megatron-DeepSpeed): ZeRO-1 optimizer
    /// sharding, gradients reduced after the last micro-batch's backward in the model's
    /// 16-bit type, blocking pipeline messages of the full activation on every TP rank, plain
    /// 1F1B only (the engine has no interleaved schedule), unfused attention.
    DeepSpeed,
    /// torchtitan (FSDP2 + DTensor TP + torch.distributed.pipelining): parameters,
    /// gradients and optimizer state fully sharded (ZeRO-3), per-layer gathers prefetched,
    /// FP32 gradient reduce-scatter, sequence parallelism with TP, SDPA flash attention.
    TorchTitan,
}

/// HBM bytes per element of the routed experts' bias adds run as kernels of their own
/// ([`Stack::unfused_expert_bias_bytes`]): per element of the fc1 output (`tokens x n_fc1`)
/// or of the fc2 output (`tokens x hidden`), forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertBiasBytes {
    /// fc1's bias add, forward.
    pub fc1_fwd: u64,
    /// fc2's bias add, forward.
    pub fc2_fwd: u64,
    /// fc1's bias gradient, backward.
    pub fc1_bwd: u64,
    /// fc2's bias gradient and casts, backward.
    pub fc2_bwd: u64,
}

/// The settings a [`Stack`] implies for a job that does not set them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackDefaults {
    /// ZeRO stage (0: no distributed optimizer).
    pub zero_stage: u8,
    /// Gradient reduction overlapped with backward, per bucket.
    pub overlap_grad_reduce: bool,
    /// Parameter all-gather overlapped with the next forward.
    pub overlap_param_gather: bool,
    /// Sequence parallelism when `tp > 1`.
    pub sequence_parallel: bool,
    /// Fused (flash) attention.
    pub flash_attention: bool,
    /// Data-parallel gradients reduced in 16 bits.
    pub grad_reduce_in_bf16: bool,
    /// Weight-gradient GEMMs accumulate into the main gradients in their epilogue.
    pub gradient_accumulation_fusion: bool,
    /// Pipeline messages split over the TP ranks (Megatron's scatter/gather).
    pub pp_scatter_gather: bool,
    /// FP8 weights cast once per iteration and kept across micro-batches
    /// ([`Training::fp8_weight_cache`]).
    pub fp8_weight_cache: bool,
    /// How the interleaved schedule's pipeline messages overlap the computation.
    pub pipeline_p2p: PipelineP2p,
    /// Gradient buckets on every chunk of every pipeline stage
    /// ([`Parallel::dp_buckets_every_stage`]); `false` for Megatron-Core.
    pub dp_buckets_every_stage: bool,
}

impl Stack {
    /// Every stack, in documentation order.
    pub const ALL: [Stack; 4] = [
        Stack::MegatronCore,
        Stack::MegatronLm2021,
        Stack::DeepSpeed,
        Stack::TorchTitan,
    ];

    /// The job-file name.
    pub fn name(self) -> &'static str {
        match self {
            Stack::MegatronCore => "megatron-core",
            Stack::MegatronLm2021 => "megatron-lm-2021",
            Stack::DeepSpeed => "deepspeed",
            Stack::TorchTitan => "torchtitan",
        }
    }

    /// HBM bytes the stack's cross-entropy loss moves per logit element (one token times one
    /// vocabulary entry on this GPU), forward and backward.
    ///
    /// * Megatron (Core, the LM of 2021-2023 and Megatron-DeepSpeed) run the unfused
    ///   vocab-parallel cross entropy (`megatron/core/tensor_parallel/cross_entropy.py`): the
    ///   BF16 logits are cast to FP32 (read 2, write 4), then separate kernels take the row
    ///   maximum (read 4), subtract it in place (8), exponentiate in place (8), sum (4) and
    ///   divide in place (8): 38 bytes. Backward multiplies the stored softmax by the incoming
    ///   gradient in place (8) and autograd casts the gradient back to BF16 (6): 14.
    /// * torchtitan calls `F.cross_entropy` on FP32 logits: the cast (6) and one log-softmax
    ///   kernel (8; a row stays in L2 across its passes), then a zero-filled gradient (4), the
    ///   log-softmax backward (12) and the cast back (6): 14 and 22. On the H100 step of
    ///   `validation/h100` this gives 52 ms of loss kernels against 50.3 ms measured.
    pub fn loss_bytes_per_logit(self) -> (u64, u64) {
        match self {
            Stack::MegatronCore | Stack::MegatronLm2021 | Stack::DeepSpeed => (38, 14),
            Stack::TorchTitan => (14, 22),
        }
    }

    /// Whether ZeRO-3 frees a layer's gathered parameters after its forward unless the job
    /// says otherwise: torchtitan's `reshard_after_forward_policy = "default"` does without
    /// pipeline parallelism and does not with it ("to avoid per-microbatch all-gathers");
    /// DeepSpeed's ZeRO-3 always does.
    pub fn reshard_after_forward(self, pp: u32) -> bool {
        !(self == Stack::TorchTitan && pp > 1)
    }

    /// When the stack's ZeRO-3 reduce-scatters gradients unless the job says otherwise:
    /// torchtitan's pipeline schedules (torch.distributed.pipelining) sync once per schedule
    /// run, every other ZeRO-3 after each micro-batch.
    pub fn zero3_grad_sync(self, pp: u32) -> Zero3Sync {
        if self == Stack::TorchTitan && pp > 1 {
            Zero3Sync::ScheduleRun
        } else {
            Zero3Sync::MicroBatch
        }
    }

    /// HBM bytes per element that adding routed experts' biases ([`crate::arch::Arch::expert_bias`])
    /// moves outside the grouped GEMMs ([`ExpertBiasBytes`]); `None` where the bias is added
    /// in the GEMM's epilogue (Megatron-Core's Transformer Engine `GroupedLinear`, the
    /// Megatron stacks).
    ///
    /// torchtitan's stack prices NeMo AutoModel's `GroupedExpertsDeepEP._apply_bias` (the
    /// code of the 2025-10-06 performance summary): the output is split per local expert, each
    /// piece gets `t + b` and the pieces are concatenated, so fc1 reads and writes its output
    /// twice (8 bytes); fc2 adds `b x p` with the FP32 routing weight, which promotes the sum
    /// to FP32 (read 2, write 4), concatenates it (4 + 4) and casts it back to BF16 (4 + 2): 20.
    /// Backward: fc1's bias gradient sums its output gradient (2); fc2 casts the gradient to
    /// FP32 (2 + 4), back to BF16 for the GEMM (4 + 2) and sums the FP32 one for its bias (4): 16.
    pub fn unfused_expert_bias_bytes(self) -> Option<ExpertBiasBytes> {
        match self {
            Stack::TorchTitan => Some(ExpertBiasBytes {
                fc1_fwd: 8,
                fc2_fwd: 20,
                fc1_bwd: 2,
                fc2_bwd: 16,
            }),
            Stack::MegatronCore | Stack::MegatronLm2021 | Stack::DeepSpeed => None,
        }
    }

    /// Whether the stack keeps main gradients that every micro-batch's weight gradient is
    /// added into, fused into the GEMM or not (Megatron-Core, the Megatron-LM of 2021-2023,
    /// Megatron-DeepSpeed). torchtitan's FSDP2 keeps gradients in the parameters and leaves
    /// accumulation to autograd, which Prism does not charge.
    pub fn accumulates_main_grads(self) -> bool {
        !matches!(self, Stack::TorchTitan)
    }

    /// Whether the stack is Megatron (Core or the LM of 2021-2023), whose gradient type
    /// follows the training precision: FP32 for BF16, the parameters' FP16 for FP16.
    fn is_megatron(self) -> bool {
        matches!(self, Stack::MegatronCore | Stack::MegatronLm2021)
    }

    /// Gradient bucket size (millions of parameters) unless the job sets one: Megatron-Core
    /// sizes its buckets by the data-parallel group, `max(40 M, 1 M x dp)` parameters
    /// (`DistributedDataParallel`, April 2024 on), "so that chunks used in NCCL ring-reduce
    /// implementations remain bandwidth-bound"; the other stacks 40 M.
    pub fn dp_bucket_mparams(self, dp: u32) -> f64 {
        match self {
            Stack::MegatronCore => 40f64.max(dp as f64),
            _ => 40.0,
        }
    }

    /// What the stack does unless the job says otherwise, for BF16 or FP8 training
    /// ([`Stack::defaults_for`] with the precision).
    pub fn defaults(self) -> StackDefaults {
        let core = StackDefaults {
            zero_stage: 1,
            overlap_grad_reduce: true,
            overlap_param_gather: true,
            sequence_parallel: true,
            flash_attention: true,
            grad_reduce_in_bf16: false,
            gradient_accumulation_fusion: true,
            pp_scatter_gather: true,
            fp8_weight_cache: true,
            pipeline_p2p: PipelineP2p::SteadyState,
            dp_buckets_every_stage: false,
        };
        match self {
            Stack::MegatronCore => core,
            // The Narayanan et al. 2021 runs predate the fusion (Megatron-LM commit 83b1e42f,
            // February 2022; FP16 main gradients only from 07916bf2, September 2022).
            Stack::MegatronLm2021 => StackDefaults {
                zero_stage: 0,
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                sequence_parallel: false,
                flash_attention: false,
                gradient_accumulation_fusion: false,
                fp8_weight_cache: false,
                // `p2p_communication._communicate` waits for every batched send and receive,
                // then `torch.cuda.synchronize()` (Megatron-LM until October 2023).
                pipeline_p2p: PipelineP2p::Blocking,
                dp_buckets_every_stage: true,
                ..core
            },
            Stack::DeepSpeed => StackDefaults {
                zero_stage: 1,
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                sequence_parallel: false,
                flash_attention: false,
                grad_reduce_in_bf16: true,
                gradient_accumulation_fusion: true,
                pp_scatter_gather: false,
                fp8_weight_cache: false,
                pipeline_p2p: PipelineP2p::Blocking,
                dp_buckets_every_stage: true,
            },
            Stack::TorchTitan => StackDefaults {
                zero_stage: 3,
                gradient_accumulation_fusion: false,
                // torchao's Float8Linear casts the weight in every forward and backward.
                fp8_weight_cache: false,
                // torch.distributed.pipelining's schedules are priced with asynchronous sends
                // (their receives still gate the chunk that needs them).
                pipeline_p2p: PipelineP2p::Async,
                dp_buckets_every_stage: true,
                ..core
            },
        }
    }

    /// [`Stack::defaults`] for a job trained in `precision`: Megatron reduces (and keeps) the
    /// gradients of an FP16 job in FP16, because only BF16 forces FP32
    /// (`accumulate_allreduce_grads_in_fp32`, Megatron-LM `arguments.py` from 2021 to
    /// Megatron-Core r0.8; before 2021 the local DDP all-reduced the FP16 gradients unless
    /// `--fp32-allreduce`).
    pub fn defaults_for(self, precision: Precision) -> StackDefaults {
        let d = self.defaults();
        StackDefaults {
            grad_reduce_in_bf16: d.grad_reduce_in_bf16
                || (precision == Precision::Fp16 && self.is_megatron()),
            ..d
        }
    }
}

/// A complete job.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// Display name.
    pub name: String,
    /// The model.
    pub model: Model,
    /// The cluster.
    pub cluster: Cluster,
    /// Parallel settings.
    pub parallel: Parallel,
    /// Training settings.
    pub training: Training,
}

/// A rule a job broke, with the key that broke it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {rule}")]
pub struct JobError {
    /// Dotted job-file key, e.g. `parallel.tp`.
    pub key: String,
    /// What rule was broken, with the values involved.
    pub rule: String,
}

impl JobError {
    /// Builds an error for `key`.
    pub fn new(key: impl Into<String>, rule: impl Into<String>) -> Self {
        JobError {
            key: key.into(),
            rule: rule.into(),
        }
    }
}

fn positive(key: &str, v: u64) -> Result<(), JobError> {
    if v == 0 {
        Err(JobError::new(key, "must be at least 1"))
    } else {
        Ok(())
    }
}

fn positive_f(key: &str, v: f64) -> Result<(), JobError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(JobError::new(
            key,
            format!("must be a positive finite number (got {v})"),
        ))
    }
}

/// A finite number in `[lo, hi]` (a documented physical bound), else an error naming the key
/// and the bound.
fn within(key: &str, v: f64, lo: f64, hi: f64, unit: &str) -> Result<(), JobError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        Err(JobError::new(
            key,
            format!("must be a finite number between {lo} and {hi} {unit} (got {v})"),
        ))
    }
}

impl Job {
    /// Number of GPUs.
    pub fn num_gpus(&self) -> u64 {
        self.cluster.num_gpus()
    }

    /// Micro-batches each pipeline runs per iteration.
    pub fn micro_batches(&self) -> u64 {
        self.training.global_batch as u64
            / (self.parallel.dp as u64 * self.parallel.micro_batch as u64)
    }

    /// Micro-batches of one run of the pipeline schedule: [`Job::micro_batches`] over
    /// `parallel.pipeline_rounds`.
    pub fn round_micro_batches(&self) -> u64 {
        self.micro_batches() / self.parallel.pipeline_rounds.max(1) as u64
    }

    /// Tokens per iteration.
    pub fn tokens_per_iteration(&self) -> u64 {
        self.training.global_batch as u64 * self.model.seq_len as u64
    }

    /// Bytes per element of the gradients a rank accumulates over micro-batches and holds
    /// until the optimizer step: Megatron keeps its main gradients in the data-parallel
    /// reduction's type (`grad_reduce_in_fp32` sets the buffer dtype in Megatron-Core's
    /// `DistributedDataParallel`; the local DDP of 2021 likewise), so 2 when reducing in 16
    /// bits and 4 otherwise; DeepSpeed and torchtitan keep FP32 gradients whatever they
    /// communicate in. Without [`Training::master_weights`] every stack holds the BF16
    /// parameters' own gradients: 2.
    pub fn grad_accum_bytes(&self) -> u64 {
        if !self.training.master_weights
            || self.training.stack.is_megatron() && self.parallel.grad_reduce_in_bf16
        {
            2
        } else {
            4
        }
    }

    /// Bytes per parameter of the optimizer state a rank keeps for the parameters it updates:
    /// Adam's two moments (4 + 4 in FP32, 2 + 2 in BF16) and, with
    /// [`Training::master_weights`], the FP32 master weight (4), or its low half (2) with
    /// [`Training::master_weight_remainders`].
    pub fn optimizer_bytes_per_param(&self) -> u64 {
        let t = &self.training;
        let state = t.memory_saving.optimizer_state;
        match (t.master_weights, t.master_weight_remainders) {
            (false, _) => state.moment_bytes(),
            (true, false) => state.bytes_per_param(),
            (true, true) => 2 + state.moment_bytes(),
        }
    }

    /// HBM bytes the Adam step reads and writes per parameter it updates. With master weights:
    /// [`OptimizerStateDtype::step_bytes_per_param`] (the FP32 gradient, the master weight
    /// read and written, both moments read and written, the BF16 weight written: 30, or 22
    /// with BF16 moments). Without: the BF16 gradient (2), the BF16 weight read and written
    /// (4) and both moments read and written (16 in FP32, 8 in BF16): 22 or 14.
    ///
    /// With [`Training::master_weight_remainders`] the step rebuilds each FP32 master weight
    /// from the BF16 weight and its remainder and splits it again: the FP32 gradient (4), the
    /// BF16 weight and the remainder each read and written (8) and both moments: 28, or 20
    /// with BF16 moments (Apex's `multi_tensor_fused_adam_with_param_remainders`).
    pub fn adam_step_bytes_per_param(&self) -> u64 {
        let t = &self.training;
        let state = t.memory_saving.optimizer_state;
        match (t.master_weights, t.master_weight_remainders) {
            (false, _) => 2 + 4 + 2 * state.moment_bytes(),
            (true, false) => state.step_bytes_per_param(),
            (true, true) => 4 + 8 + 2 * state.moment_bytes(),
        }
    }

    /// Dense peak of the job's precision family, FLOP/s per GPU.
    pub fn peak_flops(&self) -> f64 {
        let tf = match self.training.precision {
            Precision::Bf16 | Precision::Fp16 => self.cluster.gpu.peak_tflops_bf16,
            Precision::Fp8 => self
                .cluster
                .gpu
                .peak_tflops_fp8
                .unwrap_or(self.cluster.gpu.peak_tflops_bf16),
        };
        tf * 1e12
    }

    /// Decoder layers on each virtual pipeline stage, in virtual-stage order (`pp x vpp`
    /// entries; virtual stage `s` is model chunk `s / pp` of pipeline rank `s % pp`).
    ///
    /// A [`PipelineLayout`](crate::pipeline_layout::PipelineLayout) gives them as written;
    /// `first_stage_layers` / `last_stage_layers` (vpp 1) fix the first and last stage and
    /// split the rest evenly; otherwise every virtual stage holds `layers / (pp x vpp)`.
    /// Only valid on a validated job.
    pub fn virtual_stage_layers(&self) -> Vec<u32> {
        let p = &self.parallel;
        if let Some(l) = &p.pipeline_layout {
            return l.stages.clone();
        }
        let pp = p.pp as usize;
        if p.vpp > 1 || pp == 1 {
            let n = pp * p.vpp as usize;
            return vec![self.model.layers / n as u32; n];
        }
        let first = p.first_stage_layers;
        let last = p.last_stage_layers;
        let fixed = first.unwrap_or(0) + last.unwrap_or(0);
        let middle_stages = pp as u32 - first.is_some() as u32 - last.is_some() as u32;
        let rest = self.model.layers - fixed;
        let per = rest.checked_div(middle_stages).unwrap_or(0);
        (0..pp)
            .map(|i| match (i, first, last) {
                (0, Some(f), _) => f,
                (i, _, Some(l)) if i == pp - 1 => l,
                _ => per,
            })
            .collect()
    }

    /// The virtual pipeline stage that runs the multi-token-prediction modules: the one the
    /// layout marks with `m`, else the last (with the loss). Only meaningful when
    /// `model.mtp_depth > 0`; not used by DualPipe (whose head ranks hold them).
    pub fn mtp_virtual_stage(&self) -> u32 {
        let p = &self.parallel;
        match p.pipeline_layout.as_ref().and_then(|l| l.mtp_stage) {
            Some(s) => s as u32,
            None => p.pp * p.vpp - 1,
        }
    }

    /// True when the multi-token-prediction modules run on a virtual stage before the loss's
    /// (Megatron-Core's "standalone" MTP): their hidden states then travel to the loss stage
    /// with the main one.
    pub fn mtp_standalone(&self) -> bool {
        let p = &self.parallel;
        self.model.arch.mtp_depth > 0 && self.mtp_virtual_stage() + 1 != p.pp * p.vpp
    }

    /// True when pipeline rank `stage` holds the multi-token-prediction modules (DualPipe:
    /// both ranks that hold a head).
    pub fn holds_mtp(&self, stage: u32) -> bool {
        let p = &self.parallel;
        if self.model.arch.mtp_depth == 0 {
            return false;
        }
        if p.schedule == Schedule::DualPipe {
            return stage + 1 == p.pp || stage == 0;
        }
        self.mtp_virtual_stage() % p.pp == stage
    }

    /// Global layer range of each model chunk of pipeline rank `stage` (`vpp` ranges; layers
    /// are numbered in virtual-stage order, as Megatron-Core numbers them).
    ///
    /// Only valid on a validated job.
    pub fn chunk_layers(&self, stage: u32) -> Vec<std::ops::Range<u32>> {
        let pp = self.parallel.pp as usize;
        let virt = self.virtual_stage_layers();
        if self.parallel.schedule == Schedule::DualPipe {
            // Chunk 0: stage `stage` of the forward-direction pipeline; chunk 1: stage
            // `pp - 1 - stage` (the reverse direction's stage on this rank).
            let range = |s: usize| {
                let start: u32 = virt[..s].iter().sum();
                start..start + virt[s]
            };
            return vec![range(stage as usize), range(pp - 1 - stage as usize)];
        }
        let mut start = 0u32;
        let mut out = Vec::with_capacity(self.parallel.vpp as usize);
        for (s, &n) in virt.iter().enumerate() {
            if s % pp == stage as usize {
                out.push(start..start + n);
            }
            start += n;
        }
        out
    }

    /// Layers held by each pipeline rank, in stage order (sum = `model.layers`).
    ///
    /// Only valid on a validated job.
    pub fn stage_layers(&self) -> Vec<u32> {
        let pp = self.parallel.pp as usize;
        if self.parallel.schedule == Schedule::DualPipe {
            let virt = self.virtual_stage_layers();
            return (0..pp).map(|s| virt[s] + virt[pp - 1 - s]).collect();
        }
        let mut out = vec![0u32; pp];
        for (s, n) in self.virtual_stage_layers().into_iter().enumerate() {
            out[s % pp] += n;
        }
        out
    }

    /// Checks every rule a job must satisfy; the first broken rule is returned with its key.
    pub fn validate(&self) -> Result<(), JobError> {
        let m = &self.model;
        let c = &self.cluster;
        let p = &self.parallel;
        let t = &self.training;

        if t.memory_saving.activation_cache == ActivationCache::Fp8 && t.precision != Precision::Fp8
        {
            return Err(JobError::new(
                "training.activation_cache",
                "\"fp8\" caches the FP8 inputs of FP8 GEMMs; it needs training.precision = \"fp8\"",
            ));
        }

        if p.recompute == Recompute::SelectiveOp {
            let why = if m.moe.is_some() {
                Some(
                    "a mixture-of-experts model (its expert GEMMs are not matrix multiplies the policy counts)",
                )
            } else if m.arch.mla.is_some() {
                Some("multi-head latent attention")
            } else if !t.flash_attention {
                Some("unfused attention (the policy saves the fused attention kernel's output)")
            } else if t.memory_saving.recompute_norm_upproj
                || t.memory_saving.activation_cache != ActivationCache::Bf16
            {
                Some(
                    "DeepSeek-V3's memory savings (training.recompute_norm_upproj, training.activation_cache)",
                )
            } else {
                None
            };
            if let Some(why) = why {
                return Err(JobError::new(
                    "parallel.recompute",
                    format!(
                        "\"selective-op\" (torchtitan's per-op checkpointing) is modelled for dense \
                         layers with fused attention; not with {why}"
                    ),
                ));
            }
        }
        if t.master_weight_remainders {
            let why = if !t.master_weights {
                Some("training.master_weights = false: there is no master weight to split")
            } else if t.precision == Precision::Fp16 {
                Some(
                    "training.precision = \"fp16\": an FP16 weight is not the high half of an \
                     FP32 one (only BF16 is)",
                )
            } else if p.fp8_param_gather {
                Some(
                    "parallel.fp8_param_gather: the weights are FP8, so the master weight is kept \
                     whole",
                )
            } else if p.zero_stage >= 3 {
                Some(
                    "parallel.zero_stage = 3: no BF16 weight shard is held beside the master \
                     shard to rebuild it from",
                )
            } else {
                None
            };
            if let Some(why) = why {
                return Err(JobError::new(
                    "training.master_weight_remainders",
                    format!(
                        "keeps the low 16 bits of each FP32 master weight beside its BF16 weight; \
                         not with {why}"
                    ),
                ));
            }
        }
        if p.fp8_param_gather {
            if t.precision != Precision::Fp8 {
                return Err(JobError::new(
                    "parallel.fp8_param_gather",
                    "gathers FP8 weights; it needs training.precision = \"fp8\"",
                ));
            }
            if p.zero_stage == 0 {
                return Err(JobError::new(
                    "parallel.fp8_param_gather",
                    "gathers sharded parameters; it needs the distributed optimizer or ZeRO \
                     (parallel.zero_stage >= 1)",
                ));
            }
        }

        // Model sizes.
        for (k, v) in [
            ("model.layers", m.layers),
            ("model.hidden", m.hidden),
            ("model.ffn_hidden", m.ffn_hidden),
            ("model.heads", m.heads),
            ("model.kv_heads", m.kv_heads),
            ("model.head_dim", m.head_dim),
            ("model.vocab", m.vocab),
            ("model.seq_len", m.seq_len),
        ] {
            positive(k, v as u64)?;
        }
        // Size bounds far above any published model keep every derived count (parameters,
        // FLOPs, bytes) inside u64 and f64 precision.
        for (k, v, max) in [
            ("model.layers", m.layers, MAX_LAYERS),
            ("model.hidden", m.hidden, 1 << 17),
            ("model.ffn_hidden", m.ffn_hidden, 1 << 20),
            ("model.heads", m.heads, 1 << 14),
            ("model.head_dim", m.head_dim, 1 << 14),
            ("model.vocab", m.vocab, 1 << 24),
            ("model.seq_len", m.seq_len, 1 << 24),
        ] {
            if v > max {
                return Err(JobError::new(k, format!("must be at most {max} (got {v})")));
            }
        }
        if let Some(moe) = &m.moe {
            if moe.experts > 4096 {
                return Err(JobError::new(
                    "model.moe_experts",
                    format!("must be at most 4096 (got {})", moe.experts),
                ));
            }
            if moe.ffn_hidden > 1 << 20 {
                return Err(JobError::new(
                    "model.moe_ffn_hidden",
                    format!("must be at most {} (got {})", 1 << 20, moe.ffn_hidden),
                ));
            }
        }
        if !m.heads.is_multiple_of(m.kv_heads) {
            return Err(JobError::new(
                "model.kv_heads",
                format!(
                    "must divide model.heads ({} % {} != 0)",
                    m.heads, m.kv_heads
                ),
            ));
        }
        if let Some(moe) = &m.moe {
            positive("model.moe_experts", moe.experts as u64)?;
            positive("model.moe_top_k", moe.top_k as u64)?;
            positive("model.moe_ffn_hidden", moe.ffn_hidden as u64)?;
            if moe.top_k > moe.experts {
                return Err(JobError::new(
                    "model.moe_top_k",
                    format!(
                        "must not exceed model.moe_experts ({} > {})",
                        moe.top_k, moe.experts
                    ),
                ));
            }
        }

        // Cluster.
        positive("cluster.gpus_per_node", c.gpus_per_node as u64)?;
        positive("cluster.nodes", c.nodes as u64)?;
        if c.num_gpus() > MAX_GPUS {
            return Err(JobError::new(
                "cluster.nodes",
                format!(
                    "nodes x gpus_per_node = {} GPUs exceeds the supported maximum of {MAX_GPUS}",
                    c.num_gpus()
                ),
            ));
        }
        // Physical bounds (docs/job-file.md): far outside any real machine, and keeping every
        // cost inside the engine's time range.
        within(
            "cluster.peak_tflops_bf16",
            c.gpu.peak_tflops_bf16,
            0.01,
            1e6,
            "TFLOP/s",
        )?;
        if let Some(f8) = c.gpu.peak_tflops_fp8 {
            within("cluster.peak_tflops_fp8", f8, 0.01, 1e6, "TFLOP/s")?;
        }
        within("cluster.hbm_gib", c.gpu.hbm_gib, 0.01, 1e6, "GiB")?;
        within("cluster.hbm_tbps", c.gpu.hbm_tbps, 0.001, 1e4, "TB/s")?;
        within("cluster.nvlink_gbps", c.nvlink_gbps, 0.01, 1e6, "Gb/s")?;
        within("cluster.nic_gbps", c.nic_gbps, 0.01, 1e6, "Gb/s")?;
        within("cluster.nic_latency_us", c.nic_latency_us, 0.0, 1e6, "us")?;
        within(
            "cluster.nvlink_latency_us",
            c.nvlink_latency_us,
            0.0,
            1e6,
            "us",
        )?;
        within(
            "cluster.gpu_speed_cv",
            c.gpu_speed_cv,
            0.0,
            crate::straggler::MAX_GPU_SPEED_CV,
            "(a fraction)",
        )?;
        positive(
            "cluster.rail_group_nodes",
            c.topology.rail_group_nodes as u64,
        )?;
        if c.topology.pod_nodes > 0
            && !c
                .topology
                .pod_nodes
                .is_multiple_of(c.topology.rail_group_nodes)
        {
            return Err(JobError::new(
                "cluster.pod_nodes",
                format!(
                    "must be a multiple of cluster.rail_group_nodes = {} (a pod holds whole leaf \
                     groups; got {})",
                    c.topology.rail_group_nodes, c.topology.pod_nodes
                ),
            ));
        }
        if c.topology.ecmp_flows > 0 && c.topology.pod_nodes == 0 {
            return Err(JobError::new(
                "cluster.ecmp_flows",
                "needs cluster.pod_nodes: ECMP collisions are modelled on the pod uplinks",
            ));
        }
        if c.topology.ecmp_flows > 256 {
            return Err(JobError::new(
                "cluster.ecmp_flows",
                format!("must be at most 256 (got {})", c.topology.ecmp_flows),
            ));
        }
        c.topology.wan.validate(c.nodes)?;
        for (key, v) in [
            ("cluster.oversubscription", c.topology.oversubscription),
            (
                "cluster.pod_oversubscription",
                c.topology.pod_oversubscription,
            ),
        ] {
            if !(v.is_finite() && v >= 1.0) {
                return Err(JobError::new(
                    key,
                    format!("must be a finite number >= 1 (got {v})"),
                ));
            }
        }

        // Parallel sizes.
        for (k, v) in [
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.cp", p.cp),
            ("parallel.ep", p.ep),
            ("parallel.dp", p.dp),
            ("parallel.vpp", p.vpp),
            ("parallel.micro_batch", p.micro_batch),
        ] {
            positive(k, v as u64)?;
        }
        positive_f("parallel.dp_bucket_mparams", p.dp_bucket_mparams)?;
        if p.zero_stage > 3 {
            return Err(JobError::new(
                "parallel.zero_stage",
                format!("must be 0, 1, 2 or 3 (got {})", p.zero_stage),
            ));
        }
        if p.distributed_optimizer != (p.zero_stage >= 1) {
            return Err(JobError::new(
                "parallel.zero_stage",
                format!(
                    "ZeRO stage {} contradicts parallel.distributed_optimizer = {} (stage 1 and \
                     above shard the optimizer state: the distributed optimizer)",
                    p.zero_stage, p.distributed_optimizer
                ),
            ));
        }
        if !m.heads.is_multiple_of(p.tp) {
            return Err(JobError::new(
                "parallel.tp",
                format!("must divide model.heads ({} % {} != 0)", m.heads, p.tp),
            ));
        }
        if !m.kv_heads.is_multiple_of(p.tp) {
            return Err(JobError::new(
                "parallel.tp",
                format!(
                    "must divide model.kv_heads ({} % {} != 0)",
                    m.kv_heads, p.tp
                ),
            ));
        }
        if p.tp > c.gpus_per_node {
            return Err(JobError::new(
                "parallel.tp",
                format!(
                    "tensor parallelism must stay inside one node: tp ({}) > cluster.gpus_per_node ({})",
                    p.tp, c.gpus_per_node
                ),
            ));
        }
        if !c.gpus_per_node.is_multiple_of(p.tp) {
            return Err(JobError::new(
                "parallel.tp",
                format!(
                    "must divide cluster.gpus_per_node so TP groups stay inside a node ({} % {} != 0)",
                    c.gpus_per_node, p.tp
                ),
            ));
        }
        // Each factor is at most 2^32, so the product of four fits in u128.
        let product = p.tp as u128 * p.pp as u128 * p.cp as u128 * p.dp as u128;
        if product != c.num_gpus() as u128 {
            return Err(JobError::new(
                "parallel.dp",
                format!(
                    "tp x pp x cp x dp = {} x {} x {} x {} = {product} must equal the GPU count \
                     nodes x gpus_per_node = {} x {} = {}",
                    p.tp,
                    p.pp,
                    p.cp,
                    p.dp,
                    c.nodes,
                    c.gpus_per_node,
                    c.num_gpus()
                ),
            ));
        }
        if !p.dp.is_multiple_of(p.ep) {
            return Err(JobError::new(
                "parallel.ep",
                format!("must divide parallel.dp ({} % {} != 0)", p.dp, p.ep),
            ));
        }
        match &m.moe {
            Some(moe) => {
                if !moe.experts.is_multiple_of(p.ep) {
                    return Err(JobError::new(
                        "parallel.ep",
                        format!(
                            "must divide model.moe_experts ({} % {} != 0)",
                            moe.experts, p.ep
                        ),
                    ));
                }
            }
            None => {
                if p.ep != 1 {
                    return Err(JobError::new(
                        "parallel.ep",
                        "must be 1 for a dense model (set model.moe_experts for a mixture of experts)",
                    ));
                }
            }
        }
        if p.cp > 1 && !m.seq_len.is_multiple_of(2 * p.cp) {
            return Err(JobError::new(
                "parallel.cp",
                format!(
                    "model.seq_len must be divisible by 2 x cp for load-balanced context parallelism \
                     ({} % {} != 0)",
                    m.seq_len,
                    2 * p.cp
                ),
            ));
        }
        if p.cp > 1 && p.cp_comm_type == CpCommType::A2a {
            // Transformer Engine asserts it: each rank ends up with `1 / cp` of the heads.
            let (q, kv) = (m.heads / p.tp, m.kv_heads / p.tp);
            if !q.is_multiple_of(p.cp) || !kv.is_multiple_of(p.cp) {
                return Err(JobError::new(
                    "parallel.cp",
                    format!(
                        "with cp_comm_type = \"a2a\" cp must divide the query and key/value \
                         heads of a tensor-parallel rank ({q} and {kv} with tp {}; cp {})",
                        p.tp, p.cp
                    ),
                ));
            }
        }
        if p.splits_sequence() && !(m.seq_len / p.cp).is_multiple_of(p.tp) {
            return Err(JobError::new(
                "parallel.sequence_parallel",
                format!(
                    "needs the per-rank sequence (seq_len / cp = {}) divisible by tp ({})",
                    m.seq_len / p.cp,
                    p.tp
                ),
            ));
        }

        // Schedule and virtual stages.
        match p.schedule {
            Schedule::Interleaved => {
                if p.vpp < 2 {
                    return Err(JobError::new(
                        "parallel.vpp",
                        format!("the interleaved schedule needs vpp >= 2 (got {})", p.vpp),
                    ));
                }
                if p.pp < 2 {
                    return Err(JobError::new(
                        "parallel.schedule",
                        "the interleaved schedule needs pp >= 2",
                    ));
                }
            }
            Schedule::DualPipe => crate::schedules::validate_dualpipe(self)?,
            Schedule::OneFOneBOverlap => crate::schedules::validate_overlapped_1f1b(self)?,
            Schedule::OneFOneB | Schedule::GPipe => {
                if p.vpp != 1 {
                    return Err(JobError::new(
                        "parallel.vpp",
                        format!(
                            "vpp > 1 needs schedule = \"interleaved\" (got vpp = {} with another schedule)",
                            p.vpp
                        ),
                    ));
                }
            }
        }

        // Layer split.
        let uneven = p.first_stage_layers.is_some() || p.last_stage_layers.is_some();
        if let Some(l) = &p.pipeline_layout {
            let key = "parallel.pipeline_layout";
            if uneven {
                let k = if p.first_stage_layers.is_some() {
                    "parallel.first_stage_layers"
                } else {
                    "parallel.last_stage_layers"
                };
                return Err(JobError::new(
                    k,
                    "cannot be combined with parallel.pipeline_layout (the layout already places \
                     every layer)",
                ));
            }
            let stages = l.stages.len() as u64;
            if !stages.is_multiple_of(p.pp as u64) {
                return Err(JobError::new(
                    key,
                    format!(
                        "has {stages} stages, which is not a multiple of parallel.pp ({})",
                        p.pp
                    ),
                ));
            }
            if stages / p.pp as u64 != p.vpp as u64 {
                return Err(JobError::new(
                    "parallel.vpp",
                    format!(
                        "must equal the layout's stages / pp = {stages} / {} = {} (got {})",
                        p.pp,
                        stages / p.pp as u64,
                        p.vpp
                    ),
                ));
            }
            if l.decoder_layers() != m.layers as u64 {
                return Err(JobError::new(
                    key,
                    format!(
                        "places {} decoder layers ('t'), but model.layers is {}",
                        l.decoder_layers(),
                        m.layers
                    ),
                ));
            }
            if let Some(ms) = l.mtp_stage {
                if l.mtp_layers != m.arch.mtp_depth {
                    return Err(JobError::new(
                        key,
                        format!(
                            "places {} multi-token-prediction layers ('m'), but model.mtp_depth \
                             is {}",
                            l.mtp_layers, m.arch.mtp_depth
                        ),
                    ));
                }
                let chunk = ms as u64 / p.pp as u64;
                if chunk + 1 != p.vpp as u64 {
                    return Err(JobError::new(
                        key,
                        format!(
                            "places the multi-token-prediction layers ('m') on virtual stage {ms}, \
                             model chunk {chunk} of pipeline rank {}; Megatron-Core requires the \
                             last model chunk of a rank (chunk {})",
                            ms as u64 % p.pp as u64,
                            p.vpp - 1
                        ),
                    ));
                }
            }
        } else if uneven {
            if p.pp < 2 {
                return Err(JobError::new(
                    "parallel.first_stage_layers",
                    "an uneven pipeline split needs pp >= 2",
                ));
            }
            if p.vpp != 1 {
                return Err(JobError::new(
                    "parallel.first_stage_layers",
                    "first/last stage layers need vpp = 1; with vpp > 1 give the split as \
                     parallel.pipeline_layout (Megatron's --pipeline-model-parallel-layout)",
                ));
            }
            let fixed =
                p.first_stage_layers.unwrap_or(0) as u64 + p.last_stage_layers.unwrap_or(0) as u64;
            if fixed > m.layers as u64 {
                let key = if p.first_stage_layers.is_some() {
                    "parallel.first_stage_layers"
                } else {
                    "parallel.last_stage_layers"
                };
                return Err(JobError::new(
                    key,
                    format!(
                        "first + last stage layers ({fixed}) exceed model.layers ({})",
                        m.layers
                    ),
                ));
            }
            let fixed = fixed as u32;
            let middle =
                p.pp - p.first_stage_layers.is_some() as u32 - p.last_stage_layers.is_some() as u32;
            let key = if p.first_stage_layers.is_some() {
                "parallel.first_stage_layers"
            } else {
                "parallel.last_stage_layers"
            };
            if fixed > m.layers {
                return Err(JobError::new(
                    key,
                    format!(
                        "first + last stage layers ({fixed}) exceed model.layers ({})",
                        m.layers
                    ),
                ));
            }
            let rest = m.layers - fixed;
            if middle == 0 && rest != 0 || middle > 0 && !rest.is_multiple_of(middle) {
                return Err(JobError::new(
                    key,
                    format!(
                        "the remaining {rest} layers must split evenly over the {middle} other pipeline stages"
                    ),
                ));
            }
            if middle > 0 && rest / middle == 0 {
                return Err(JobError::new(
                    key,
                    "every pipeline stage needs at least one layer",
                ));
            }
            for (k, v) in [
                ("parallel.first_stage_layers", p.first_stage_layers),
                ("parallel.last_stage_layers", p.last_stage_layers),
            ] {
                if v == Some(0) {
                    return Err(JobError::new(k, "must be at least 1"));
                }
            }
        } else if !(m.layers as u64).is_multiple_of(p.pp as u64 * p.vpp as u64) {
            return Err(JobError::new(
                "parallel.pp",
                format!(
                    "model.layers ({}) must be divisible by pp x vpp ({} x {}) unless an uneven split \
                     (parallel.first_stage_layers / parallel.last_stage_layers) is given",
                    m.layers, p.pp, p.vpp
                ),
            ));
        }

        // Batch.
        positive("training.global_batch", t.global_batch as u64)?;
        let per_step = p.dp as u64 * p.micro_batch as u64;
        if !(t.global_batch as u64).is_multiple_of(per_step) {
            return Err(JobError::new(
                "training.global_batch",
                format!(
                    "must be divisible by dp x micro_batch = {} x {} = {per_step} (got {})",
                    p.dp, p.micro_batch, t.global_batch
                ),
            ));
        }
        let mbs = self.micro_batches();
        if mbs > MAX_MICRO_BATCHES {
            return Err(JobError::new(
                "training.global_batch",
                format!(
                    "gives {mbs} micro-batches per pipeline, above the limit {MAX_MICRO_BATCHES}"
                ),
            ));
        }
        if t.stack == Stack::DeepSpeed && p.schedule == Schedule::Interleaved {
            return Err(JobError::new(
                "parallel.schedule",
                "DeepSpeed's pipeline engine runs plain 1F1B only (training.stack = \"deepspeed\" \
                 has no interleaved schedule)",
            ));
        }
        if t.stack == Stack::DeepSpeed && p.zero_stage >= 2 && p.pp > 1 {
            return Err(JobError::new(
                "parallel.zero_stage",
                "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only (stages 2 and 3 \
                 need pp = 1 with training.stack = \"deepspeed\")",
            ));
        }
        let rounds = p.pipeline_rounds as u64;
        if rounds == 0 || !mbs.is_multiple_of(rounds) {
            return Err(JobError::new(
                "parallel.pipeline_rounds",
                format!(
                    "must be at least 1 and divide the micro-batch count ({mbs}); got {rounds}"
                ),
            ));
        }
        if rounds > 1 && p.schedule == Schedule::DualPipe {
            return Err(JobError::new(
                "parallel.pipeline_rounds",
                "DualPipe runs its schedule once per iteration (pipeline_rounds must be 1)",
            ));
        }
        let per_round = mbs / rounds;
        if p.schedule == Schedule::Interleaved && !per_round.is_multiple_of(p.pp as u64) {
            return Err(JobError::new(
                "training.global_batch",
                format!(
                    "the interleaved schedule needs the micro-batch count ({per_round} per \
                     schedule run) divisible by pp ({})",
                    p.pp
                ),
            ));
        }
        if t.fp8_recipe != Fp8Recipe::Tensorwise && t.precision != Precision::Fp8 {
            return Err(JobError::new(
                "training.fp8_recipe",
                "an FP8 scaling recipe needs training.precision = \"fp8\"".to_string(),
            ));
        }
        if t.fp8_recipe == Fp8Recipe::Mxfp8
            && crate::cost::compute::Generation::of(&c.gpu)
                != crate::cost::compute::Generation::Blackwell
        {
            return Err(JobError::new(
                "training.fp8_recipe",
                format!(
                    "\"mxfp8\" needs Blackwell tensor cores (B100/B200/B300/GB200; {} has none)",
                    c.gpu.name
                ),
            ));
        }
        if t.precision == Precision::Fp8 && c.gpu.peak_tflops_fp8.is_none() {
            return Err(JobError::new(
                "training.precision",
                format!(
                    "\"fp8\" needs a GPU with FP8 tensor cores ({} has none)",
                    c.gpu.name
                ),
            ));
        }
        crate::arch::validate(self)?;
        Ok(())
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Test and example fixtures: small, valid jobs built in code.
pub mod fixtures {
    use super::*;

    /// An H100 node type with the figures of `shared/validation/hardware.csv`.
    pub fn h100_cluster(nodes: u32) -> Cluster {
        Cluster {
            name: "dgx-h100".into(),
            gpu: Gpu {
                name: "H100-SXM5-80GB".into(),
                peak_tflops_bf16: 989.0,
                peak_tflops_fp8: Some(1979.0),
                hbm_gib: 80.0,
                hbm_tbps: 3.35,
            },
            gpus_per_node: 8,
            nodes,
            nvlink_gbps: 3600.0,
            nic_gbps: 400.0,
            nic_latency_us: 5.0,
            nvlink_latency_us: 1.0,
            gpu_speed_cv: crate::straggler::DEFAULT_GPU_SPEED_CV,
            topology: Topology {
                rail_group_nodes: 32,
                oversubscription: 1.0,
                pod_nodes: 0,
                pod_oversubscription: 1.0,
                ecmp_flows: 0,
                wan: Default::default(),
            },
        }
    }

    /// A small GPT-style model (8 layers, hidden 1024).
    pub fn small_model() -> Model {
        Model {
            name: "gpt-small".into(),
            layers: 8,
            hidden: 1024,
            ffn_hidden: 4096,
            heads: 16,
            kv_heads: 16,
            head_dim: 64,
            vocab: 32000,
            seq_len: 2048,
            activation: Activation::Gelu,
            moe: None,
            tied_embeddings: false,
            dropout: false,
            arch: Default::default(),
        }
    }

    /// GPT-3 175B (Brown et al. 2020) as Megatron-LM and Korthikanti et al. 2022 train it: 96
    /// layers, hidden 12288, FFN 4h, 96 heads of 128, vocab 51200, sequence 2048, GeLU, tied
    /// embeddings, dropout.
    pub fn gpt3_175b_model() -> Model {
        Model {
            name: "gpt3-175b".into(),
            layers: 96,
            hidden: 12288,
            ffn_hidden: 4 * 12288,
            heads: 96,
            kv_heads: 96,
            head_dim: 128,
            vocab: 51200,
            seq_len: 2048,
            activation: Activation::Gelu,
            moe: None,
            tied_embeddings: true,
            dropout: true,
            arch: Default::default(),
        }
    }

    /// Llama 3 405B (Dubey et al. 2024, Table 3: 126 layers, hidden 16384, FFN 53248, 128 heads,
    /// 8 KV heads, vocab 128256, sequence 8192, no dropout) on 16,384 H100: tp 8, pp 16 with
    /// 7 layers on the first and the last stage, dp 128, 2048 sequences per iteration.
    pub fn llama3_405b_job() -> Job {
        let mut job = small_job(2048, 8, 16, 2048);
        job.name = "llama3-405b".into();
        job.model = Model {
            name: "llama3-405b".into(),
            layers: 126,
            hidden: 16384,
            ffn_hidden: 53248,
            heads: 128,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128256,
            seq_len: 8192,
            activation: Activation::SwiGlu,
            moe: None,
            tied_embeddings: false,
            dropout: false,
            arch: Default::default(),
        };
        job.parallel.first_stage_layers = Some(7);
        job.parallel.last_stage_layers = Some(7);
        job
    }

    /// A small job: `small_model` on `nodes` H100 nodes with the given tp/pp, dp derived.
    pub fn small_job(nodes: u32, tp: u32, pp: u32, global_batch: u32) -> Job {
        let cluster = h100_cluster(nodes);
        let dp = (cluster.num_gpus() / (tp as u64 * pp as u64)) as u32;
        Job {
            name: "small".into(),
            model: small_model(),
            cluster,
            parallel: Parallel {
                tp,
                pp,
                cp: 1,
                ep: 1,
                dp,
                vpp: 1,
                micro_batch: 1,
                sequence_parallel: tp > 1,
                recompute: Recompute::None,
                distributed_optimizer: true,
                schedule: Schedule::OneFOneB,
                first_stage_layers: None,
                last_stage_layers: None,
                pipeline_layout: None,
                deallocate_stage_input: false,
                dp_bucket_mparams: 40.0,
                dp_buckets_every_stage: false,
                align_grad_reduce: true,
                overlap_grad_reduce: true,
                overlap_param_gather: true,
                tp_comm_overlap: false,
                comm_sms: 0,
                moe_dispatcher: MoeDispatcher::AllToAll,
                cp_comm_type: CpCommType::P2p,
                order: RankOrder::TpCpEpDpPp,
                zero_stage: 1,
                grad_reduce_in_bf16: false,
                gradient_accumulation_fusion: true,
                pipeline_rounds: 1,
                pp_scatter_gather: true,
                reshard_after_forward: true,
                zero3_grad_sync: Zero3Sync::MicroBatch,
                fp8_param_gather: false,
                pipeline_p2p: PipelineP2p::SteadyState,
            },
            training: Training {
                global_batch,
                precision: Precision::Bf16,
                flash_attention: true,
                stack: Stack::MegatronCore,
                memory_saving: MemorySaving::default(),
                fp8_recipe: Fp8Recipe::Tensorwise,
                attention_backend: AttentionBackend::Cudnn,
                cross_entropy_fusion: CrossEntropyFusion::None,
                fp8_weight_cache: true,
                master_weights: true,
                master_weight_remainders: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::small_job;
    use proptest::prelude::*;

    fn any_size() -> impl Strategy<Value = u32> {
        prop_oneof![
            0u32..=16,
            Just(u32::MAX),
            Just(u32::MAX / 2),
            1u32..=1 << 20
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// `validate` never panics, whatever the sizes; a job it accepts has a consistent
        /// layer split and at least one micro-batch per pipeline.
        #[test]
        fn validate_is_total(
            layers in any_size(), hidden in any_size(), heads in any_size(), kv in any_size(),
            tp in any_size(), pp in any_size(), cp in any_size(), dp in any_size(), vpp in any_size(),
            nodes in any_size(), gb in any_size(), first in proptest::option::of(any_size()),
            last in proptest::option::of(any_size()),
        ) {
            let mut job = small_job(2, 2, 2, 16);
            job.model.layers = layers;
            job.model.hidden = hidden;
            job.model.heads = heads;
            job.model.kv_heads = kv;
            job.parallel.tp = tp;
            job.parallel.pp = pp;
            job.parallel.cp = cp;
            job.parallel.dp = dp;
            job.parallel.vpp = vpp;
            job.parallel.first_stage_layers = first;
            job.parallel.last_stage_layers = last;
            job.cluster.nodes = nodes;
            job.training.global_batch = gb;
            if job.validate().is_ok() {
                prop_assert_eq!(job.stage_layers().iter().map(|&l| l as u64).sum::<u64>(), layers as u64);
                prop_assert!(job.stage_layers().iter().all(|&l| l >= 1));
                prop_assert!(job.micro_batches() >= 1);
            }
        }
    }

    #[test]
    fn errors_name_the_key() {
        let mut job = small_job(2, 2, 2, 16);
        job.parallel.tp = 3;
        assert_eq!(job.validate().unwrap_err().key, "parallel.tp");
        let mut job = small_job(2, 2, 2, 16);
        job.training.global_batch = 15;
        let e = job.validate().unwrap_err();
        assert_eq!(e.key, "training.global_batch");
        assert!(e.rule.contains("divisible by dp x micro_batch"), "{e}");
        let mut job = small_job(2, 2, 2, 16);
        job.model.hidden = 1 << 20;
        assert_eq!(job.validate().unwrap_err().key, "model.hidden");
    }
}
