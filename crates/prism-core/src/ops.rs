//! The vocabulary of work a GPU does: compute kernels described by their shape, and the
//! classes the reports group them by. The graph builder produces these; cost models price them.

/// Class of a compute kernel, used for breakdowns, kernel tables and variability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpClass {
    /// Dense matrix multiply (tensor cores).
    Gemm,
    /// Fused (flash) attention core.
    Attention,
    /// Layer norm / RMS norm.
    Norm,
    /// Other memory-bound elementwise work (activation, residual add, dropout, rotary).
    Elementwise,
    /// Unfused (scale-mask-)softmax over attention scores (Megatron-LM without flash attention).
    Softmax,
    /// Embedding lookup / embedding gradient.
    Embedding,
    /// Cross-entropy loss (with its softmax over the vocabulary).
    Loss,
    /// MoE router (gate GEMM and top-k; the token permutations are memory passes of their own).
    Router,
    /// Optimizer step (Adam), memory-bound.
    Optimizer,
    /// Host-side framework time per layer pass (Python, autograd, kernel dispatch) that the
    /// GPU waits for; priced by `ComputeParams::layer_overhead_s`.
    Framework,
}

impl OpClass {
    /// Every class, in declaration order (`OpClass::ALL[c as usize] == c`).
    pub const ALL: [OpClass; 10] = [
        OpClass::Gemm,
        OpClass::Attention,
        OpClass::Norm,
        OpClass::Elementwise,
        OpClass::Softmax,
        OpClass::Embedding,
        OpClass::Loss,
        OpClass::Router,
        OpClass::Optimizer,
        OpClass::Framework,
    ];

    /// The class named `name` (as [`OpClass::name`] spells it).
    pub fn from_name(name: &str) -> Option<OpClass> {
        OpClass::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Lower-case name used in reports and kernel tables.
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Gemm => "gemm",
            OpClass::Attention => "attention",
            OpClass::Norm => "norm",
            OpClass::Elementwise => "elementwise",
            OpClass::Softmax => "softmax",
            OpClass::Embedding => "embedding",
            OpClass::Loss => "loss",
            OpClass::Router => "router",
            OpClass::Optimizer => "optimizer",
            OpClass::Framework => "framework",
        }
    }
}

/// The shape of a compute kernel's work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Work {
    /// `batch` independent GEMMs of `[m x k] x [k x n]`: `2 m n k batch` FLOPs.
    Gemm {
        /// Rows of the output (tokens).
        m: u64,
        /// Columns of the output.
        n: u64,
        /// Reduction dimension.
        k: u64,
        /// Independent GEMMs (e.g. local experts).
        batch: u64,
    },
    /// Fused attention over `heads` heads of `batch` sequences.
    Attention {
        /// Sequences.
        batch: u64,
        /// Query heads on this GPU.
        heads: u64,
        /// Query length on this GPU.
        seq_q: u64,
        /// Key/value length attended to.
        seq_kv: u64,
        /// Head width.
        head_dim: u64,
        /// Causal mask (about half of the score matrix is computed).
        causal: bool,
        /// Sliding window of the causal mask, in keys (each query sees its `window` most
        /// recent keys, itself included); 0: no window. Only with `causal` and
        /// `seq_q == seq_kv`.
        window: u64,
        /// Backward pass (about 2.5x the forward FLOPs with recomputed scores).
        backward: bool,
    },
    /// Memory-bound kernel moving `bytes` through HBM (reads + writes).
    Memory {
        /// Bytes read plus bytes written.
        bytes: u64,
    },
    /// A measured segment of a recorded trace (all the work a rank did between two
    /// communication calls): it lasts exactly `ps` picoseconds, whatever the cost model says,
    /// and counts no FLOPs or HBM bytes.
    Measured {
        /// Duration, picoseconds.
        ps: u64,
    },
}

impl Work {
    /// Floating-point operations the kernel performs on the GPU.
    pub fn flops(&self) -> f64 {
        match *self {
            Work::Gemm { m, n, k, batch } => 2.0 * m as f64 * n as f64 * k as f64 * batch as f64,
            Work::Attention {
                batch,
                heads,
                seq_q,
                seq_kv,
                head_dim,
                causal,
                window,
                backward,
            } => {
                // QK^T and PV: 2 GEMMs of 2 * s_q * s_kv * d each.
                let full = 4.0
                    * batch as f64
                    * heads as f64
                    * seq_q as f64
                    * seq_kv as f64
                    * head_dim as f64;
                let masked = if causal && window > 0 {
                    full * window_fraction(seq_q, window)
                } else if causal {
                    full * causal_fraction(seq_q, seq_kv)
                } else {
                    full
                };
                // Backward: dQ, dK, dV, dP (4 GEMMs) + recomputed QK^T (1) = 2.5x forward.
                if backward { 2.5 * masked } else { masked }
            }
            Work::Memory { .. } | Work::Measured { .. } => 0.0,
        }
    }

    /// Bytes moved through HBM (a lower bound used by the roofline).
    pub fn bytes(&self, bytes_per_element: f64) -> f64 {
        match *self {
            Work::Gemm { m, n, k, batch } => {
                bytes_per_element * (m * k + k * n + m * n) as f64 * batch as f64
            }
            Work::Attention {
                batch,
                heads,
                seq_q,
                seq_kv,
                head_dim,
                backward,
                ..
            } => {
                let qo = 2 * batch * heads * seq_q * head_dim;
                let kv = 2 * batch * heads * seq_kv * head_dim;
                let f = if backward { 2.0 } else { 1.0 };
                f * bytes_per_element * (qo + kv) as f64
            }
            Work::Memory { bytes } => bytes as f64,
            Work::Measured { .. } => 0.0,
        }
    }
}

/// Fraction of the `seq_q x seq_kv` score matrix a causal mask keeps when the queries are the
/// last `seq_q` positions of `seq_kv` keys.
pub fn causal_fraction(seq_q: u64, seq_kv: u64) -> f64 {
    if seq_q == 0 || seq_kv == 0 {
        return 0.0;
    }
    let q = seq_q as f64;
    let kv = seq_kv as f64;
    // Query i (0-based, offset kv - q) sees kv - q + i + 1 keys.
    ((kv - q) * q + q * (q + 1.0) / 2.0) / (q * kv)
}

/// Fraction of the `s x s` score matrix a causal sliding window of `window` keys keeps
/// (query `i` sees `min(i + 1, window)` keys).
pub fn window_fraction(s: u64, window: u64) -> f64 {
    if s == 0 || window == 0 {
        return 0.0;
    }
    let pairs = crate::arch::LocalAttention {
        kind: crate::arch::WindowKind::Sliding,
        window: window.min(u32::MAX as u64) as u32,
    }
    .pairs(s);
    pairs as f64 / (s as f64 * s as f64)
}

/// One compute kernel of an execution graph.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeOp {
    /// Kernel name, e.g. `qkv_fwd`.
    pub name: &'static str,
    /// Class for reports.
    pub class: OpClass,
    /// Shape of the work.
    pub work: Work,
    /// True when this is recomputed forward work inside backward (counts for HFU, not MFU).
    pub recompute: bool,
    /// True when the kernel runs beside a Transformer Engine userbuffers communication kernel
    /// that holds [`crate::cost::compute::UB_COMM_SMS`] SMs for the kernel's whole duration
    /// (`set_sm_margin`): the kernel gets the remaining SMs.
    pub sm_margin: bool,
}

impl ComputeOp {
    /// Whether this kernel computes a weight gradient (the graph names those `*_wgrad`). The
    /// unfused attention's `attn_scores_wgrad` and `attn_context_wgrad` are the gradients of
    /// the keys and values, activations, and are not.
    pub fn is_weight_gradient(&self) -> bool {
        self.class == OpClass::Gemm
            && self.name.ends_with("_wgrad")
            && !self.name.starts_with("attn_")
    }

    /// Whether this kernel is a GEMM of the output head (LM head; the graph names those
    /// `lm_head_*`). FP8 training keeps the head in BF16 in every stack Prism models:
    /// Megatron-Core builds it as its own `tensor_parallel.ColumnParallelLinear`, not a
    /// Transformer Engine layer (`megatron/core/models/gpt/gpt_model.py`); DeepSeek-V3 retains
    /// BF16 for "the embedding module, the output head" (arXiv:2412.19437 Sec. 3.3);
    /// torchtitan's float8 conversion skips the `output` layer.
    pub fn is_output_head(&self) -> bool {
        self.class == OpClass::Gemm && self.name.starts_with("lm_head_")
    }
}
