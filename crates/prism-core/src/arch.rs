//! Architecture features of current model families, beyond the uniform decoder of
//! [`Model`]'s plain fields: multi-head latent attention (DeepSeek-V2/V3), fine-grained MoE
//! with shared experts and leading dense layers (DeepSeek, Qwen3-MoE, Llama 4), multi-token
//! prediction (DeepSeek-V3), local attention layers (sliding window: Gemma 2/3, gpt-oss,
//! Mistral; chunked: Llama 4) and per-head query/key norms (Qwen3, Gemma 3).
//!
//! Everything lives in [`Arch`], the `arch` field of [`Model`]; `Arch::default()` is the plain
//! decoder Prism modelled before (every count, kernel and byte unchanged). The per-layer
//! queries here ([`Model::is_moe_layer`], [`Model::local_attention`], [`Model::layer_params_at`])
//! are what the FLOP counts ([`crate::flops`]), the memory model ([`crate::memory`]) and the
//! execution graph ([`crate::graph`]) follow.
//!
//! Parameter counts (no biases, as the families above have none in their GEMMs):
//!
//! * MLA attention, with `H` heads, `d_n` / `d_r` the non-rotary / rotary query-key widths,
//!   `d_v` the value width, `r_q` / `r_kv` the query / key-value LoRA ranks:
//!   `h r_q + r_q + r_q H (d_n + d_r)` (query down- and up-projection with its norm; `h H
//!   (d_n + d_r)` when `r_q = 0`) `+ h (r_kv + d_r) + r_kv + r_kv H (d_n + d_v)` (joint key-value
//!   down-projection with the shared rotary key, its norm and the up-projection) `+ H d_v h`
//!   (output projection). DeepSeek-V3: 187.1 M per layer.
//! * An MoE layer: `E` routed experts, the router `h E`, and the shared experts, one gated MLP
//!   of width `moe_shared_ffn_hidden`.
//! * Query/key norms: `2 head_dim` per layer.
//! * A multi-token-prediction module (DeepSeek-V3 Sec. 2.2): one more (MoE) layer, the
//!   projection `2h x h` of the concatenated embedding and hidden state, and three norms
//!   (`3h`); embedding and output head are shared with the main model. Counted apart from
//!   [`Model::params`] ([`Model::mtp_params`]): DeepSeek-V3's 671 B excludes its 14 B of MTP
//!   weights (the HF checkpoint's 685 B includes them, and the shared head once more).

use crate::job::{JobError, Model};

/// Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, Sec. 2.1): queries and the joint
/// key-value state are projected through low-rank latents; keys and queries are split into a
/// non-rotary part and a rotary part (the rotary key is shared by all heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the query down-projection (`q_lora_rank`); 0: queries projected directly.
    pub q_lora_rank: u32,
    /// Rank of the joint key-value down-projection (`kv_lora_rank`).
    pub kv_lora_rank: u32,
    /// Per-head width of the non-rotary query/key part (`qk_nope_head_dim`).
    pub qk_nope_head_dim: u32,
    /// Per-head width of the rotary query/key part (`qk_rope_head_dim`).
    pub qk_rope_head_dim: u32,
    /// Per-head value width (`v_head_dim`).
    pub v_head_dim: u32,
}

impl Mla {
    /// Query/key width of one head.
    pub fn qk_head_dim(&self) -> u64 {
        self.qk_nope_head_dim as u64 + self.qk_rope_head_dim as u64
    }
}

/// Kind of local attention of the layers that do not attend to the whole sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowKind {
    /// Each query sees the `window` most recent keys, itself included (Mistral, Gemma 2/3,
    /// gpt-oss).
    #[default]
    Sliding,
    /// The sequence is cut into chunks of `window` tokens; a query sees the keys of its own
    /// chunk up to itself (Llama 4's `attention_chunk_size`).
    Chunked,
}

impl WindowKind {
    /// The job-file name.
    pub fn name(self) -> &'static str {
        match self {
            WindowKind::Sliding => "sliding",
            WindowKind::Chunked => "chunked",
        }
    }
}

/// The local attention of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalAttention {
    /// Sliding or chunked.
    pub kind: WindowKind,
    /// Window (or chunk) length in tokens.
    pub window: u32,
}

impl LocalAttention {
    /// Query-key pairs a causal mask with this window keeps over a sequence of `s` tokens.
    pub fn pairs(&self, s: u64) -> u64 {
        let w = self.window as u64;
        match self.kind {
            WindowKind::Sliding if w >= s => s * (s + 1) / 2,
            // Queries 0..w see i + 1 keys, the remaining s - w see w each.
            WindowKind::Sliding => w * (w + 1) / 2 + (s - w) * w,
            WindowKind::Chunked => {
                let (n, r) = (s / w, s % w);
                n * (w * (w + 1) / 2) + r * (r + 1) / 2
            }
        }
    }

    /// Keys each query attends to without the causal mask's discount (the Megatron MFU
    /// convention's `s` of `4 s² hq`): `min(window, s)`.
    pub fn unmasked_keys(&self, s: u64) -> u64 {
        (self.window as u64).min(s)
    }
}

/// Architecture features beyond the plain decoder; the default is the plain decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct Arch {
    /// Multi-head latent attention instead of (grouped-query) multi-head attention.
    pub mla: Option<Mla>,
    /// Leading layers with a dense MLP (width `ffn_hidden`) in an MoE model (DeepSeek's
    /// `first_k_dense_replace`).
    pub moe_first_dense_layers: u32,
    /// Of the remaining layers, layer `l` is an MoE layer when `(l + 1) % moe_layer_step == 0`
    /// (Qwen-MoE's `decoder_sparse_step`, Llama 4's `interleave_moe_layer_step`); 1: all.
    pub moe_layer_step: u32,
    /// Width of the shared experts of each MoE layer together (DeepSeek: `n_shared_experts x
    /// moe_intermediate_size`; Llama 4: `intermediate_size`); 0: none. A gated MLP every token
    /// passes through, tensor-parallel like a dense MLP.
    pub moe_shared_ffn_hidden: u32,
    /// Tokens an expert accepts, as a multiple of its balanced share (GShard/Switch capacity
    /// factor; Megatron `--moe-expert-capacity-factor` with padding to capacity): every expert
    /// computes and exchanges exactly `factor x` its share. 0: dropless.
    pub moe_capacity_factor: f64,
    /// Dropless routing only: tokens of the busiest expert-parallel rank as a multiple of the
    /// balanced share, which sets the time of the expert GEMMs and the all-to-all (the others
    /// wait in the next collective). 1.0: perfectly balanced (DeepSeek-V3's auxiliary-loss-free
    /// balancing is reported to keep the load near balanced; measured imbalances of 1.1-1.5
    /// are common in Megatron traces without it).
    pub moe_imbalance: f64,
    /// Local attention window (tokens); 0: every layer attends to the whole sequence.
    pub attention_window: u32,
    /// Sliding window or chunks.
    pub attention_window_kind: WindowKind,
    /// Layer `l` attends globally when `(l + 1) % attention_global_every == 0` (Gemma 2 and
    /// gpt-oss: 2, Gemma 3: 6, Llama 4: 4); 0: every layer is local.
    pub attention_global_every: u32,
    /// Multi-token-prediction modules (DeepSeek-V3: 1).
    pub mtp_depth: u32,
    /// Expert groups for group-limited routing (DeepSeek's `n_group`); 0: none.
    pub moe_groups: u32,
    /// Groups one token's experts may come from (DeepSeek's `topk_group`): DeepSeek-V3's
    /// node-limited routing when each group sits on one node. With it Prism prices DeepSeek's
    /// dispatch: a token crosses the network once per distinct remote node and is forwarded
    /// over NVLink inside it ([`Arch::node_limited_nic_scale`]).
    pub moe_groups_per_token: u32,
    /// RMS norms over each query and key head (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Routed experts carry biases on both projections (gpt-oss). Their parameters are
    /// negligible; what can cost time is adding them: stacks whose grouped GEMM has no bias
    /// epilogue add them in separate kernels ([`crate::job::Stack::unfused_expert_bias_bytes`]).
    pub expert_bias: bool,
}

impl Default for Arch {
    fn default() -> Self {
        Arch {
            mla: None,
            moe_first_dense_layers: 0,
            moe_layer_step: 1,
            moe_shared_ffn_hidden: 0,
            moe_capacity_factor: 0.0,
            moe_imbalance: 1.0,
            attention_window: 0,
            attention_window_kind: WindowKind::Sliding,
            attention_global_every: 0,
            mtp_depth: 0,
            qk_norm: false,
            moe_groups: 0,
            moe_groups_per_token: 0,
            expert_bias: false,
        }
    }
}

impl Arch {
    /// Network bytes of an expert-parallel dispatch or combine under group-limited routing,
    /// relative to exchanging every one of a token's `top_k` copies (1 without group limits or
    /// inside one node).
    ///
    /// The EP group has `ranks` GPUs on `nodes` nodes, `per_node` on each, experts in `groups`
    /// contiguous groups (each on `max(1, nodes / groups)` nodes). A token's experts lie on
    /// `r = min(nodes, per_token x max(1, nodes / groups))` nodes; with its `k = top_k` experts
    /// spread evenly over them it reaches `r (1 - (1 - 1/r)^k)` distinct nodes, of which
    /// `(nodes - 1) / nodes` are remote, and each remote node receives the token once
    /// (DeepSeek-V3, Sec. 3.2.2: at most 4 nodes over InfiniBand, then NVLink forwarding).
    /// Without the limit every copy bound elsewhere crosses: `k (ranks - per_node) / ranks`.
    ///
    /// `dedup` (DeepEP's dispatch, [`crate::job::MoeDispatcher::DeepEp`]) prices the one copy
    /// per distinct remote node without a group limit: the token's experts may lie on every
    /// node, `r = nodes`.
    pub fn node_limited_nic_scale(
        &self,
        top_k: u32,
        nodes: u32,
        ranks: u32,
        per_node: u32,
        dedup: bool,
    ) -> f64 {
        if (self.moe_groups == 0 && !dedup) || nodes <= 1 || ranks <= per_node {
            return 1.0;
        }
        let n = nodes as f64;
        let (groups, per_token) = if self.moe_groups == 0 {
            (1.0, 1.0)
        } else {
            (self.moe_groups as f64, self.moe_groups_per_token as f64)
        };
        let reach = (per_token * (n / groups).max(1.0)).min(n).max(1.0);
        let k = top_k.max(1) as f64;
        let distinct = reach * (1.0 - (1.0 - 1.0 / reach).powf(k));
        let with_limit = distinct * (n - 1.0) / n;
        let without = k * (ranks - per_node) as f64 / ranks as f64;
        (with_limit / without).min(1.0)
    }

    /// Load of the busiest expert relative to a balanced share: the capacity factor when one
    /// is set (padded to capacity), else the imbalance.
    pub fn moe_load_factor(&self) -> f64 {
        if self.moe_capacity_factor > 0.0 {
            self.moe_capacity_factor
        } else {
            self.moe_imbalance
        }
    }
}

impl Model {
    /// True when layer `layer` (0-based) has routed experts.
    pub fn is_moe_layer(&self, layer: u32) -> bool {
        let a = &self.arch;
        self.moe.is_some()
            && layer >= a.moe_first_dense_layers
            && (layer + 1).is_multiple_of(a.moe_layer_step.max(1))
    }

    /// Layers with routed experts.
    pub fn moe_layers(&self) -> u32 {
        (0..self.layers).filter(|&l| self.is_moe_layer(l)).count() as u32
    }

    /// The local attention of layer `layer`, or `None` when it attends to the whole sequence
    /// (or the window covers the training sequence).
    pub fn local_attention(&self, layer: u32) -> Option<LocalAttention> {
        let a = &self.arch;
        if a.attention_window == 0 || a.attention_window >= self.seq_len {
            return None;
        }
        if a.attention_global_every > 0 && (layer + 1).is_multiple_of(a.attention_global_every) {
            return None;
        }
        Some(LocalAttention {
            kind: a.attention_window_kind,
            window: a.attention_window,
        })
    }

    /// Width of the queries (and of the keys each head uses) over all heads.
    pub fn q_width(&self) -> u64 {
        match &self.arch.mla {
            Some(mla) => self.heads as u64 * mla.qk_head_dim(),
            None => self.heads as u64 * self.head_dim as u64,
        }
    }

    /// Width of the keys as stored for the attention core (MLA: expanded per head).
    pub fn k_width(&self) -> u64 {
        match &self.arch.mla {
            Some(mla) => self.heads as u64 * mla.qk_head_dim(),
            None => self.kv_heads as u64 * self.head_dim as u64,
        }
    }

    /// Width of the values (and of the attention output) over all heads.
    pub fn v_width(&self) -> u64 {
        match &self.arch.mla {
            Some(mla) => self.heads as u64 * mla.v_head_dim as u64,
            None => self.kv_heads as u64 * self.head_dim as u64,
        }
    }

    /// Width of the attention output fed to the output projection.
    pub fn o_width(&self) -> u64 {
        match &self.arch.mla {
            Some(mla) => self.heads as u64 * mla.v_head_dim as u64,
            None => self.heads as u64 * self.head_dim as u64,
        }
    }

    /// Head width the attention core is priced with: the mean of the query-key and value
    /// widths, so that `4 s² heads x width` is exactly the core's FLOPs (`2 s² H d_qk` for
    /// the scores, `2 s² H d_v` for attention over values).
    pub fn core_head_dim(&self) -> u64 {
        match &self.arch.mla {
            Some(mla) => (mla.qk_head_dim() + mla.v_head_dim as u64).div_ceil(2),
            None => self.head_dim as u64,
        }
    }

    /// Parameters of the shared experts of one MoE layer.
    pub fn shared_expert_params(&self) -> u64 {
        self.activation.mlp_matrices() * self.hidden as u64 * self.arch.moe_shared_ffn_hidden as u64
    }

    /// Parameters of layer `layer`: attention, its MLP (dense, or routed experts + router +
    /// shared experts) and its two norms.
    pub fn layer_params_at(&self, layer: u32) -> u64 {
        let h = self.hidden as u64;
        let mlp = match &self.moe {
            Some(m) if self.is_moe_layer(layer) => {
                m.experts as u64 * self.expert_params()
                    + h * m.experts as u64
                    + self.shared_expert_params()
            }
            _ => self.dense_mlp_params(),
        };
        self.attention_params() + mlp + 2 * h
    }

    /// Parameters of layer `layer` one token uses (top-k routed experts).
    pub fn active_layer_params_at(&self, layer: u32) -> u64 {
        match &self.moe {
            Some(m) if self.is_moe_layer(layer) => {
                self.layer_params_at(layer) - (m.experts - m.top_k) as u64 * self.expert_params()
            }
            _ => self.layer_params_at(layer),
        }
    }

    /// Parameters of the multi-token-prediction modules (not part of [`Model::params`]).
    pub fn mtp_params(&self) -> u64 {
        let h = self.hidden as u64;
        let layer = self.layer_params_at(self.layers.saturating_sub(1));
        self.arch.mtp_depth as u64 * (layer + 2 * h * h + 3 * h)
    }

    /// Active parameters of the multi-token-prediction modules.
    pub fn mtp_active_params(&self) -> u64 {
        let h = self.hidden as u64;
        let layer = self.active_layer_params_at(self.layers.saturating_sub(1));
        self.arch.mtp_depth as u64 * (layer + 2 * h * h + 3 * h)
    }

    /// Groups of identical layers, `(count, first layer of the group)`, in first-layer order:
    /// layers differ only by being MoE or dense and by their local attention.
    pub fn layer_kinds(&self) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = Vec::new();
        let key = |l: u32| (self.is_moe_layer(l), self.local_attention(l));
        for l in 0..self.layers {
            match out.iter_mut().find(|(_, first)| key(*first) == key(l)) {
                Some(g) => g.0 += 1,
                None => out.push((1, l)),
            }
        }
        out
    }
}

/// Checks the architecture settings of a model (called by [`crate::job::Job::validate`]).
pub fn validate(job: &crate::job::Job) -> Result<(), JobError> {
    let m = &job.model;
    let a = &m.arch;
    if let Some(mla) = &a.mla {
        for (k, v) in [
            ("model.mla_kv_lora_rank", mla.kv_lora_rank),
            ("model.mla_qk_nope_head_dim", mla.qk_nope_head_dim),
            ("model.mla_qk_rope_head_dim", mla.qk_rope_head_dim),
            ("model.mla_v_head_dim", mla.v_head_dim),
        ] {
            if v == 0 {
                return Err(JobError::new(k, "must be at least 1"));
            }
            if v > 1 << 16 {
                return Err(JobError::new(k, format!("must be at most 65536 (got {v})")));
            }
        }
        if mla.q_lora_rank > 1 << 16 {
            return Err(JobError::new(
                "model.mla_q_lora_rank",
                format!("must be at most 65536 (got {})", mla.q_lora_rank),
            ));
        }
    }
    if a.moe_groups > 0 || a.moe_groups_per_token > 0 {
        let Some(moe) = &m.moe else {
            return Err(JobError::new(
                "model.moe_groups",
                "needs model.moe_experts (the number of experts)",
            ));
        };
        if a.moe_groups == 0 || !moe.experts.is_multiple_of(a.moe_groups) {
            return Err(JobError::new(
                "model.moe_groups",
                format!(
                    "must divide model.moe_experts ({}) and be at least 1 with moe_groups_per_token (got {})",
                    moe.experts, a.moe_groups
                ),
            ));
        }
        if a.moe_groups_per_token == 0 || a.moe_groups_per_token > a.moe_groups {
            return Err(JobError::new(
                "model.moe_groups_per_token",
                format!(
                    "must be between 1 and model.moe_groups ({}) (got {})",
                    a.moe_groups, a.moe_groups_per_token
                ),
            ));
        }
    }
    if a.moe_layer_step == 0 {
        return Err(JobError::new("model.moe_layer_step", "must be at least 1"));
    }
    if a.moe_shared_ffn_hidden > 1 << 20 {
        return Err(JobError::new(
            "model.moe_shared_ffn_hidden",
            format!(
                "must be at most {} (got {})",
                1 << 20,
                a.moe_shared_ffn_hidden
            ),
        ));
    }
    if m.moe.is_none() {
        for (k, set) in [
            ("model.moe_first_dense_layers", a.moe_first_dense_layers > 0),
            ("model.moe_layer_step", a.moe_layer_step != 1),
            ("model.moe_shared_ffn_hidden", a.moe_shared_ffn_hidden > 0),
            ("model.moe_capacity_factor", a.moe_capacity_factor != 0.0),
            ("model.moe_imbalance", a.moe_imbalance != 1.0),
        ] {
            if set {
                return Err(JobError::new(
                    k,
                    "needs model.moe_experts (a mixture-of-experts model)",
                ));
            }
        }
    } else if m.moe_layers() == 0 {
        return Err(JobError::new(
            "model.moe_first_dense_layers",
            "leaves no MoE layer (every layer would be dense)",
        ));
    }
    if !(a.moe_capacity_factor == 0.0
        || a.moe_capacity_factor.is_finite() && (0.01..=64.0).contains(&a.moe_capacity_factor))
    {
        return Err(JobError::new(
            "model.moe_capacity_factor",
            format!(
                "must be 0 (dropless) or between 0.01 and 64 (got {})",
                a.moe_capacity_factor
            ),
        ));
    }
    if !(a.moe_imbalance.is_finite() && (1.0..=64.0).contains(&a.moe_imbalance)) {
        return Err(JobError::new(
            "model.moe_imbalance",
            format!(
                "must be between 1 (balanced) and 64 (got {})",
                a.moe_imbalance
            ),
        ));
    }
    if a.moe_capacity_factor > 0.0 && a.moe_imbalance != 1.0 {
        return Err(JobError::new(
            "model.moe_imbalance",
            "applies to dropless routing only; with model.moe_capacity_factor every expert is \
             padded to its capacity",
        ));
    }
    if a.mtp_depth > 16 {
        return Err(JobError::new(
            "model.mtp_depth",
            format!("must be at most 16 (got {})", a.mtp_depth),
        ));
    }
    let local = (0..m.layers).any(|l| m.local_attention(l).is_some());
    // Transformer Engine's all-to-all form holds the whole sequence on its heads, so a window
    // applies as on one rank; the ring's and the gathered form's chunking of a window is not
    // modelled, nor unfused attention's (which gathers under every form).
    let a2a = job.parallel.cp_comm_type == crate::job::CpCommType::A2a;
    if local && job.parallel.cp > 1 && !(a2a && job.training.flash_attention) {
        return Err(JobError::new(
            "parallel.cp",
            "context parallelism over local-attention layers (model.attention_window shorter \
             than seq_len) is modelled with cp_comm_type = \"a2a\" and fused attention only; \
             use them or cp = 1",
        ));
    }
    if a.attention_window_kind == WindowKind::Chunked
        && a.attention_window > 0
        && a.attention_window < m.seq_len
        && !m.seq_len.is_multiple_of(a.attention_window)
    {
        return Err(JobError::new(
            "model.attention_window",
            format!(
                "a chunked-attention chunk ({}) must divide model.seq_len ({})",
                a.attention_window, m.seq_len
            ),
        ));
    }
    if a.mla.is_some() && job.parallel.cp > 1 {
        return Err(JobError::new(
            "parallel.cp",
            "context parallelism with multi-head latent attention is not modelled; use cp = 1",
        ));
    }
    Ok(())
}

/// Small jobs with the features above, for tests and examples.
pub mod fixtures {
    use super::*;
    use crate::job::fixtures::small_job;
    use crate::job::{Activation, Job, Moe};

    /// A small DeepSeek-style model on `small_job`'s layout: 8 layers of hidden 1024, the
    /// first dense (FFN 4096), the others 8 routed experts of 512 (top-2) plus one shared
    /// expert of 512, multi-head latent attention (16 heads; ranks 256 / 128, widths 64 + 32,
    /// values 64), expert parallelism `ep`.
    pub fn small_deepseek_job(nodes: u32, tp: u32, pp: u32, global_batch: u32, ep: u32) -> Job {
        let mut job = small_job(nodes, tp, pp, global_batch);
        let m = &mut job.model;
        m.name = "deepseek-small".into();
        m.activation = Activation::SwiGlu;
        m.moe = Some(Moe {
            experts: 8,
            top_k: 2,
            ffn_hidden: 512,
        });
        m.arch = Arch {
            mla: Some(Mla {
                q_lora_rank: 256,
                kv_lora_rank: 128,
                qk_nope_head_dim: 64,
                qk_rope_head_dim: 32,
                v_head_dim: 64,
            }),
            moe_first_dense_layers: 1,
            moe_shared_ffn_hidden: 512,
            ..Arch::default()
        };
        job.parallel.ep = ep;
        job
    }

    /// A small Gemma-style model on `small_job`'s layout: sliding window of 512 tokens on
    /// every layer but every second (sequence 2048), query/key norms, tied embeddings.
    pub fn small_gemma_job(nodes: u32, tp: u32, pp: u32, global_batch: u32) -> Job {
        let mut job = small_job(nodes, tp, pp, global_batch);
        let m = &mut job.model;
        m.name = "gemma-small".into();
        m.activation = Activation::SwiGlu;
        m.tied_embeddings = true;
        m.arch = Arch {
            attention_window: 512,
            attention_global_every: 2,
            qk_norm: true,
            ..Arch::default()
        };
        job
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_pairs_closed_forms() {
        // Brute force over small sequences.
        for s in 1..40u64 {
            for w in 1..45u32 {
                for kind in [WindowKind::Sliding, WindowKind::Chunked] {
                    let la = LocalAttention { kind, window: w };
                    let mut n = 0;
                    for q in 0..s {
                        for k in 0..=q {
                            let ok = match kind {
                                WindowKind::Sliding => q - k < w as u64,
                                WindowKind::Chunked => q / w as u64 == k / w as u64,
                            };
                            n += ok as u64;
                        }
                    }
                    assert_eq!(la.pairs(s), n, "{kind:?} s {s} w {w}");
                }
            }
        }
    }
}
