//! Compute cost model: how long one compute kernel takes on one GPU of the job.
//!
//! Every kernel is priced by a roofline with shape-dependent efficiencies, plus a fixed
//! per-kernel overhead:
//!
//! ```text
//! time = max(flops / (peak * eff(shape)), bytes / (hbm_bandwidth * mem_eff)) + launch_overhead
//! ```
//!
//! * GEMMs ([`Work::Gemm`]) run at the job's precision: BF16 at the BF16 dense peak, or FP8 at the
//!   FP8 dense peak with 1-byte operands (only kernels of class [`OpClass::Gemm`]; router and
//!   other GEMM-shaped kernels stay BF16, as Transformer Engine leaves them). Their efficiency
//!   is [`ComputeModel::gemm_efficiency`]: a ceiling `eff_max` reduced by tile padding, by
//!   under-filling the streaming multiprocessors (fewer output tiles than SMs) and by the fixed
//!   prologue/epilogue cost of each tile relative to its reduction length `K`.
//! * Fused attention ([`Work::Attention`]) always runs in BF16 at the BF16 peak, with an
//!   efficiency that saturates in the number of keys each query attends to and in the head
//!   width, and is reduced when there are fewer query (forward) or key (backward) blocks than
//!   SMs.
//! * Memory-bound kernels ([`Work::Memory`]) stream their bytes at `mem_eff` of HBM bandwidth.
//!
//! A measured [`KernelTable`] entry for `(op name, shape_key, dtype)` replaces the roofline term
//! for that kernel; the launch overhead is still added, because profilers report kernel
//! durations (GPU time between kernel start and end) and not the gaps between kernels.
//!
//! All efficiencies are fields of [`ComputeParams`], one set per GPU generation, so that a
//! calibration can fit them; nothing here is a per-case factor.

use std::collections::BTreeMap;

use crate::job::{Gpu, Job, Precision};
use crate::ops::{ComputeOp, OpClass, Work, causal_fraction};
use crate::units::{SimTime, ps_from_s};

/// Physical efficiency parameters of one GPU generation.
///
/// The defaults ([`ComputeParams::for_gpu`]) are initial values taken from published
/// measurements (cited per field); a calibration task is expected to refine them.
#[derive(Clone, Debug, PartialEq)]
pub struct ComputeParams {
    /// Streaming multiprocessors on the GPU (A100: 108, H100/H200 SXM: 132, B200: 148; from the
    /// NVIDIA architecture whitepapers). One GEMM output tile or one attention block runs on one
    /// SM at a time.
    pub sm_count: u32,
    /// Rows (M) of one GEMM output tile computed by one thread block. cuBLAS/CUTLASS pick
    /// 128x256 or 256x128 tiles for large BF16/FP8 GEMMs on Ampere and Hopper.
    pub gemm_tile_m: u32,
    /// Columns (N) of one GEMM output tile.
    pub gemm_tile_n: u32,
    /// Fixed cost of one output tile, expressed as an equivalent reduction length: pipeline
    /// prologue (filling the shared-memory stages) and epilogue (converting and storing the
    /// accumulator tile). A tile with reduction length `K` runs at `K / (K + gemm_k_overhead)` of
    /// the mainloop rate. Initial estimate: about two to four 64-deep mainloop stages; cuBLAS
    /// throughput curves reach ~90% of their large-K value at K ≈ 2048 on H100.
    pub gemm_k_overhead: f64,
    /// Smallest reduction length one SM is given when a GEMM has fewer output tiles than SMs
    /// and cuBLAS splits the reduction dimension over the idle SMs (split-K / stream-K, Osama
    /// et al. PPoPP 2023). 256: four 64-deep mainloop stages of a 128x256 BF16 tile. Measured
    /// on an H100 (validation/h100): a 1024x1024x8192 GEMM (32 tiles) runs at 628 TFLOP/s,
    /// near a full-wave GEMM, not at the 32/132 of it that one tile per SM would give.
    pub gemm_split_k_min: f64,
    /// Ceiling of BF16 GEMM efficiency (fraction of the dense BF16 peak) for large, well-shaped
    /// GEMMs. H100 SXM: ~0.80 (cuBLAS large BF16 GEMMs measure ~700-800 TFLOP/s of 989, the
    /// spread being clock throttling under the 700 W limit); A100: ~0.85 (cuBLAS ~260-280
    /// TFLOP/s of 312).
    pub gemm_eff_max_bf16: f64,
    /// Ceiling of FP8 GEMM efficiency (fraction of the dense FP8 peak). H100: ~0.70 (cuBLASLt FP8
    /// GEMMs measure ~1300-1450 TFLOP/s of 1979; FP8 is more power-limited than BF16). Unused on
    /// GPUs without FP8.
    pub gemm_eff_max_fp8: f64,
    /// FP8 GEMM throughput with row-wise scaling (per-row activation and per-column weight
    /// scales) relative to tensor-wise scaling. H100: 0.883, the median over 15 GEMMs of >= 1
    /// TFLOP measured with cuBLASLt through PyTorch 2.11 (validation/h100).
    pub fp8_rowwise_rel: f64,
    /// FP8 GEMM throughput with block-wise scaling (1x128 activation tiles, 128x128 weight
    /// blocks, DeepSeek-V3's recipe) relative to tensor-wise scaling. H100: 0.914, measured as
    /// above.
    pub fp8_blockwise_rel: f64,
    /// FP8 GEMM throughput with MXFP8 block scaling relative to tensor-wise scaling (Blackwell
    /// only: the tensor cores apply the E8M0 block scales in the MMA instruction, so 1.0).
    pub fp8_mxfp8_rel: f64,
    /// Throughput of PyTorch SDPA's flash back-end (FlashAttention-2,
    /// [`crate::job::AttentionBackend::Flash2`]) relative to the cuDNN fused attention the
    /// ceilings describe, forward and backward. H100: 0.506 / 0.565, H200: 0.511 / 0.561, the
    /// medians over 11 shapes (1k-32k tokens, head widths 64-256, causal and not) measured on
    /// each GPU (validation/h100, validation/h200). A100: 1.0 (its ceilings are
    /// FlashAttention-2's).
    pub attn_flash2_rel: (f64, f64),
    /// Weight-gradient GEMMs that accumulate into FP32 main gradients (Megatron's
    /// `--gradient-accumulation-fusion`: cuBLAS with an FP32 `C` and `beta = 1`) read and write
    /// that FP32 gradient, 8 bytes per weight element, in the epilogue. The part not hidden
    /// behind the mainloop is `min(1, sqrt(t0 / tokens))` of that traffic at HBM speed, with
    /// `tokens` the GEMM's reduction length and `t0` this parameter. H100: 700, fitted to
    /// `validation/h100/wgrad.csv` (75 shapes: +80% over a BF16-output GEMM at 1,024 tokens,
    /// +30% at 2,048, +10% at 4,096, a few % from 8,192 on).
    pub wgrad_accum_hidden_tokens: f64,
    /// Ceiling of fused-attention forward efficiency (fraction of the dense BF16 peak) at long
    /// sequences and head width >= [`Self::attn_head_dim_ref`]. A100 FlashAttention-2: 0.70
    /// (Dao 2023 reports 50-73% of peak forward, the top at head dim 128 and long sequences).
    /// H100: 0.55, between FlashAttention-2 on H100 (~35-50%; Shah et al. 2024, the
    /// FlashAttention-3 paper) and FlashAttention-3 (75% in FP16 forward), which is where the
    /// cuDNN fused attention that Megatron-Core uses through Transformer Engine sits.
    pub attn_fwd_eff_max: f64,
    /// Ceiling of fused-attention backward efficiency (the backward is 2.5x the forward FLOPs
    /// and has more shared-memory traffic and atomics on dQ). A100 FlashAttention-2: ~0.60
    /// (Dao 2023: backward lower than forward, 50-63%); H100: ~0.45 (FlashAttention-3 paper,
    /// backward ~1.5-1.75x slower per FLOP than forward).
    pub attn_bwd_eff_max: f64,
    /// Rows of one attention thread block: queries per block in the forward pass, keys per
    /// block in the backward pass (FlashAttention-2/3 use 128).
    pub attn_block: u32,
    /// Keys per query at which attention reaches half its ceiling: each block iterates over the
    /// keys it attends to, and short loops are dominated by the per-block prologue and softmax
    /// rescaling epilogue. 128 reproduces the FlashAttention-2 curves (seq 512 non-causal at
    /// ~80% of the 16k figure).
    pub attn_seq_half: f64,
    /// Head width at which the head-width factor is 1 (FlashAttention-2/3 are tuned for 128;
    /// wider heads do not run faster).
    pub attn_head_dim_ref: f64,
    /// Half-saturation head width: the head-width factor is
    /// `(d / (d + half)) / (ref / (ref + half))`, capped at 1. With 32, head dim 64 runs at
    /// ~0.83 of head dim 128, as in the FlashAttention-2 forward figures.
    pub attn_head_dim_half: f64,
    /// Fraction of HBM bandwidth reached by memory-bound kernels (norms, elementwise, optimizer,
    /// and the memory roof of GEMMs and attention). STREAM-like kernels reach ~90% on A100/H100;
    /// PyTorch elementwise kernels typically 80-90%; 0.85.
    pub mem_eff: f64,
    /// Fixed time per kernel on the GPU timeline, seconds: launch latency, kernel ramp-up and
    /// tail, and the idle gap before the next kernel. CUDA launch latency is ~2-5 us; Megatron
    /// traces show gaps of a few microseconds between kernels; 4 us.
    pub launch_overhead_s: f64,
    /// Sustained tensor-core clock as a fraction of the clock the datasheet peak assumes
    /// (power and thermal limits over hours of training); scales compute, not HBM bandwidth.
    pub clock_factor: f64,
    /// Host-side framework time per layer per forward or backward pass that the GPU waits for
    /// (Python, autograd and dispatch not hidden behind kernels), seconds.
    pub layer_overhead_s: f64,
    /// Fraction of HBM bandwidth norm kernels achieve (fused LayerNorm/RMSNorm compute their
    /// statistics in FP32 and write them out: slower than a plain copy). Measured on A100
    /// (`prism calibrate --kineto`, docs/calibration.md).
    pub norm_mem_eff: f64,
    /// Fraction of HBM bandwidth unfused scale-mask-softmax kernels achieve (measured on A100).
    pub softmax_mem_eff: f64,
}

/// FP8 (tensor-wise scaled) GEMM ceiling over the BF16 one on the H100, measured: the ratio at
/// which the model's median BF16 / FP8 time ratio over the 15 GEMM shapes of at least 1 TFLOP
/// that `validation/h100/kernels.csv` times in both equals the measured median (1.809;
/// cuBLASLt, 700 W SXM). With each tile's fixed cost priced at the same time in both precisions
/// ([`ComputeModel`]'s `k_overhead`) that takes a ceiling ratio of 0.933, a large-k speed-up of
/// 1.87, as the k sweep of `validation/h100/moe_fp8.json` shows at k = 4,096 (0.904 before,
/// when FP8 shared BF16's overhead in reduction-length units). The H100 FP8 ceiling follows the
/// calibrated BF16 one by this ratio instead of being fitted on its own (`prism calibrate` ties
/// them), so that the published FP8 runs cannot move it against the kernels; checked by
/// `cargo test -p prism-io --test h100_measured`.
pub const H100_FP8_GEMM_EFF_REL_BF16: f64 = 0.933;

/// The GPU generation whose compute parameters apply, decided as
/// [`ComputeParams::for_gpu`] documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generation {
    /// A100, A800, and unnamed GPUs below 600 TFLOP/s.
    Ampere,
    /// H100, H800, GH200, and unnamed GPUs from 600 TFLOP/s.
    Hopper,
    /// H200.
    H200,
    /// B100, B200, GB200, B300, and unnamed GPUs from 1500 TFLOP/s.
    Blackwell,
}

impl Generation {
    /// The generation of `gpu`, by name, else by its dense BF16 peak.
    pub fn of(gpu: &Gpu) -> Self {
        let name = gpu.name.to_ascii_uppercase();
        let has = |s: &str| name.contains(s);
        if has("B200") || has("B100") || has("B300") {
            Generation::Blackwell
        } else if has("H200") {
            Generation::H200
        } else if has("H100") || has("H800") || has("GH200") {
            Generation::Hopper
        } else if has("A100") || has("A800") {
            Generation::Ampere
        } else if gpu.peak_tflops_bf16 >= 1500.0 {
            Generation::Blackwell
        } else if gpu.peak_tflops_bf16 >= 600.0 {
            Generation::Hopper
        } else {
            Generation::Ampere
        }
    }
}

impl ComputeParams {
    /// NVIDIA A100 (SXM4, 108 SMs, BF16 312 TFLOP/s dense).
    pub fn a100() -> Self {
        // Calibrated (docs/calibration.md, `prism calibrate --gpu a100 --kineto ...`):
        // GEMM shape efficiency, norm and softmax bandwidth from the Megatron A100 Kineto
        // trace's kernels; clock, elementwise bandwidth, launch and framework overhead from the
        // 29 published A100 runs (Megatron-LM 2020/2021, Korthikanti et al. 2022).
        ComputeParams {
            sm_count: 108,
            gemm_tile_m: 128,
            gemm_tile_n: 256,
            gemm_k_overhead: 240.0,
            gemm_split_k_min: 256.0,
            gemm_eff_max_bf16: 0.89,
            gemm_eff_max_fp8: 0.70,
            fp8_rowwise_rel: 1.0,
            fp8_blockwise_rel: 1.0,
            fp8_mxfp8_rel: 1.0,
            attn_flash2_rel: (1.0, 1.0),
            wgrad_accum_hidden_tokens: 700.0,
            attn_fwd_eff_max: 0.70,
            attn_bwd_eff_max: 0.60,
            attn_block: 128,
            attn_seq_half: 128.0,
            attn_head_dim_ref: 128.0,
            attn_head_dim_half: 32.0,
            mem_eff: 0.949,
            launch_overhead_s: 1.96e-6,
            clock_factor: 0.848,
            layer_overhead_s: 92.1e-6,
            norm_mem_eff: 0.483,
            softmax_mem_eff: 0.619,
        }
    }

    /// NVIDIA H100 (SXM5, 132 SMs, BF16 989 TFLOP/s dense, FP8 1979 TFLOP/s dense).
    pub fn h100() -> Self {
        let gemm_eff_max_bf16 = 0.758;
        // Calibrated on 32 published H100/H800 runs (Megatron-Core 2024 with its interleaved
        // schedule, NeMo 24.07 FP8, Nemotron-4 15B, DeepSeek-V3, NeMo AutoModel) with the
        // cross-entropy passes, FP32 gradient accumulation and the userbuffers SM margin in
        // the graph; docs/calibration.md, "Interleaved Megatron-Core runs and the userbuffers
        // SM margin (2026-11-25)". Norm and softmax bandwidth are measured on an H100
        // (validation/h100: F.rms_norm 2.05 TB/s, softmax 1.02 TB/s of 3.35); those
        // measurements check every other parameter too (the `h100_measured` test).
        ComputeParams {
            sm_count: 132,
            gemm_tile_m: 128,
            gemm_tile_n: 256,
            gemm_k_overhead: 256.0,
            gemm_split_k_min: 256.0,
            gemm_eff_max_bf16,
            gemm_eff_max_fp8: H100_FP8_GEMM_EFF_REL_BF16 * gemm_eff_max_bf16,
            fp8_rowwise_rel: 0.883,
            fp8_blockwise_rel: 0.914,
            fp8_mxfp8_rel: 1.0,
            attn_flash2_rel: (0.506, 0.565),
            wgrad_accum_hidden_tokens: 700.0,
            attn_fwd_eff_max: 0.712,
            attn_bwd_eff_max: 0.497,
            attn_block: 128,
            attn_seq_half: 128.0,
            attn_head_dim_ref: 128.0,
            attn_head_dim_half: 32.0,
            mem_eff: 0.846,
            launch_overhead_s: 5.17e-6,
            clock_factor: 0.868,
            layer_overhead_s: 5.2e-6,
            norm_mem_eff: 0.611,
            softmax_mem_eff: 0.305,
        }
    }

    /// NVIDIA H200 (SXM, same GH100 die and clocks as H100; larger, faster HBM3e, which the
    /// model takes from the job's `hbm_tbps`). Same efficiencies as H100 until calibrated.
    pub fn h200() -> Self {
        ComputeParams {
            attn_flash2_rel: (0.511, 0.561),
            ..Self::h100()
        }
    }

    /// NVIDIA B200 (148 SMs, BF16 ~2250 TFLOP/s dense). Provisional: there are few published
    /// kernel measurements yet, so the Hopper efficiencies are used, with a larger per-tile
    /// overhead (faster tensor cores against a similar epilogue) and slightly lower GEMM
    /// ceilings (power-limited at the higher peak).
    pub fn b200() -> Self {
        ComputeParams {
            sm_count: 148,
            gemm_k_overhead: 384.0,
            gemm_eff_max_bf16: 0.75,
            gemm_eff_max_fp8: 0.70,
            ..Self::h100()
        }
    }

    /// Defaults for a GPU, chosen by its name (`A100`/`A800`, `H100`/`H800`/`GH200`, `H200`,
    /// `B200`/`B100`/`GB200`/`B300`) or, failing that, by its dense BF16 peak (>= 1500 TFLOP/s:
    /// Blackwell; >= 600: Hopper; else Ampere).
    pub fn for_gpu(gpu: &Gpu) -> Self {
        match Generation::of(gpu) {
            Generation::Blackwell => Self::b200(),
            Generation::H200 => Self::h200(),
            Generation::Hopper => Self::h100(),
            Generation::Ampere => Self::a100(),
        }
    }

    /// Checks every field; the error names the field and the rule.
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(format!("{name} must be in (0, 1] (got {v})"))
            }
        };
        let nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "{name} must be a non-negative finite number (got {v})"
                ))
            }
        };
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a positive finite number (got {v})"))
            }
        };
        for (name, v) in [
            ("sm_count", self.sm_count),
            ("gemm_tile_m", self.gemm_tile_m),
            ("gemm_tile_n", self.gemm_tile_n),
            ("attn_block", self.attn_block),
        ] {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        unit("gemm_eff_max_bf16", self.gemm_eff_max_bf16)?;
        unit("gemm_eff_max_fp8", self.gemm_eff_max_fp8)?;
        unit("fp8_rowwise_rel", self.fp8_rowwise_rel)?;
        unit("fp8_blockwise_rel", self.fp8_blockwise_rel)?;
        unit("fp8_mxfp8_rel", self.fp8_mxfp8_rel)?;
        unit("attn_flash2_rel.0", self.attn_flash2_rel.0)?;
        unit("attn_flash2_rel.1", self.attn_flash2_rel.1)?;
        nonneg("wgrad_accum_hidden_tokens", self.wgrad_accum_hidden_tokens)?;
        unit("attn_fwd_eff_max", self.attn_fwd_eff_max)?;
        unit("attn_bwd_eff_max", self.attn_bwd_eff_max)?;
        unit("mem_eff", self.mem_eff)?;
        unit("norm_mem_eff", self.norm_mem_eff)?;
        unit("clock_factor", self.clock_factor)?;
        unit("softmax_mem_eff", self.softmax_mem_eff)?;
        nonneg("gemm_k_overhead", self.gemm_k_overhead)?;
        nonneg("gemm_split_k_min", self.gemm_split_k_min)?;
        nonneg("attn_seq_half", self.attn_seq_half)?;
        nonneg("attn_head_dim_half", self.attn_head_dim_half)?;
        positive("attn_head_dim_ref", self.attn_head_dim_ref)?;
        nonneg("launch_overhead_s", self.launch_overhead_s)?;
        Ok(())
    }
}

/// Measured kernel durations: `(op name, shape key, dtype) -> seconds`.
///
/// The op name is [`ComputeOp::name`], the shape key is [`shape_key`] of the op's work and the
/// dtype is `"bf16"` or `"fp8"` (the precision the model would run the kernel at). Ordered
/// (`BTreeMap`), so iteration and any output derived from it are deterministic.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelTable {
    /// op name -> shape key -> dtype -> seconds (nested so lookups borrow `&str`).
    entries: BTreeMap<String, BTreeMap<String, BTreeMap<String, f64>>>,
    len: usize,
}

impl KernelTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts (or replaces) the duration of one kernel, in seconds.
    pub fn insert(&mut self, op: &str, shape: &str, dtype: &str, seconds: f64) {
        let old = self
            .entries
            .entry(op.to_owned())
            .or_default()
            .entry(shape.to_owned())
            .or_default()
            .insert(dtype.to_owned(), seconds);
        if old.is_none() {
            self.len += 1;
        }
    }

    /// The measured duration, seconds, if the table has this kernel.
    pub fn get(&self, op: &str, shape: &str, dtype: &str) -> Option<f64> {
        self.entries.get(op)?.get(shape)?.get(dtype).copied()
    }

    /// True when the table has at least one entry for kernels named `op`.
    pub fn has_op(&self, op: &str) -> bool {
        self.entries.contains_key(op)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The table's op names that are neither in `known` (the kernel names of a job's graph) nor
    /// the class row [`GEMM_CLASS_ROW`]: rows no op of the job can ever use.
    pub fn unknown_ops(&self, known: &std::collections::BTreeSet<&str>) -> Vec<&str> {
        (self.entries.keys())
            .map(String::as_str)
            .filter(|o| *o != GEMM_CLASS_ROW && !known.contains(o))
            .collect()
    }

    /// Entries in key order: `(op, shape, dtype, seconds)`.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, &str, f64)> {
        self.entries.iter().flat_map(|(o, shapes)| {
            shapes.iter().flat_map(move |(s, dtypes)| {
                dtypes
                    .iter()
                    .map(move |(d, &t)| (o.as_str(), s.as_str(), d.as_str(), t))
            })
        })
    }
}

/// The op name of a kernel-table row that prices every GEMM of its shape whose own name has no
/// row (what `prism profile import` writes: a trace knows shapes, not layer ops).
pub const GEMM_CLASS_ROW: &str = "gemm";

/// Canonical shape key of a kernel's work, used by [`KernelTable`]:
///
/// * GEMM: `"{M}x{N}x{K}"`, or `"{B}x{M}x{N}x{K}"` when `batch > 1`;
/// * attention: `"b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c|n}"` (`c` causal, `n` not; the
///   op name tells forward from backward);
/// * memory-bound: `"{bytes}B"`.
pub fn shape_key(work: &Work) -> String {
    match *work {
        Work::Gemm { m, n, k, batch } => {
            if batch > 1 {
                format!("{batch}x{m}x{n}x{k}")
            } else {
                format!("{m}x{n}x{k}")
            }
        }
        Work::Attention {
            batch,
            heads,
            seq_q,
            seq_kv,
            head_dim,
            causal,
            window,
            ..
        } => {
            let c = if causal { 'c' } else { 'n' };
            if window > 0 {
                return format!("b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c}w{window}");
            }
            format!("b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c}")
        }
        Work::Memory { bytes } => format!("{bytes}B"),
        Work::Measured { ps } => format!("{ps}ps"),
    }
}

/// SMs a Transformer Engine userbuffers communication kernel holds beside a GEMM it overlaps
/// with the `pipeline` (forward reduce-scatter, split in 4) and `bulk` (backward all-gather and
/// reduce-scatter) methods: TE's `initialize_ub` defaults are `num_sm = 16` with
/// `set_sm_margin`, so the GEMM is launched on the other SMs (132 - 16 = 116 on an H100). The
/// `ring_exchange` method moves data with copy engines and holds no SMs.
pub const UB_COMM_SMS: u32 = 16;

/// How a stack's weight gradients reach the main gradients it accumulates over micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GradAccum {
    /// No main gradients (torchtitan: autograd accumulates, not charged).
    None,
    /// The weight-gradient GEMM adds into main gradients of `main_bytes` per element in its
    /// epilogue (Megatron's `gradient_accumulation_fusion`).
    Fused { main_bytes: u64 },
    /// The GEMM writes a 16-bit gradient and a separate kernel adds it to main gradients of
    /// `main_bytes` per element.
    Separate { main_bytes: u64 },
}

impl GradAccum {
    fn of(job: &Job) -> Self {
        let main_bytes = job.grad_accum_bytes();
        if !job.training.stack.accumulates_main_grads() {
            GradAccum::None
        } else if job.parallel.gradient_accumulation_fusion {
            GradAccum::Fused { main_bytes }
        } else {
            GradAccum::Separate { main_bytes }
        }
    }
}

/// Prices compute kernels for one job.
#[derive(Clone, Debug)]
pub struct ComputeModel {
    params: ComputeParams,
    table: Option<KernelTable>,
    precision: Precision,
    /// Dense BF16 peak, FLOP/s.
    peak_bf16: f64,
    /// Dense peak for GEMMs at the job's precision, FLOP/s.
    peak_gemm: f64,
    /// FP8 GEMM throughput of the job's scaling recipe relative to tensor-wise scaling.
    fp8_recipe_rel: f64,
    /// The job's attention kernels relative to cuDNN's (forward, backward).
    attn_rel: (f64, f64),
    /// How weight gradients reach the main gradients (the stack's and the job's).
    grad_accum: GradAccum,
    /// The same model with [`UB_COMM_SMS`] fewer SMs, pricing kernels with
    /// [`ComputeOp::sm_margin`].
    margin: Option<Box<ComputeModel>>,
    /// HBM bandwidth, bytes/s.
    hbm_bytes_per_s: f64,
}

impl ComputeModel {
    /// A model for `job`'s GPU with `params` and an optional measured kernel table.
    ///
    /// # Panics
    /// If `params` fails [`ComputeParams::validate`] (callers validate parameters they read).
    pub fn new(job: &Job, params: ComputeParams, table: Option<KernelTable>) -> Self {
        Self::with_extra_sms(job, params, table, 0)
    }

    /// [`ComputeModel::new`] with `extra` SMs held by communication kernels on top of the
    /// job's own (`parallel.comm_sms`, and the userbuffers margin): the engine prices kernels
    /// that start beside NCCL kernels with it.
    ///
    /// # Panics
    /// As [`ComputeModel::new`].
    pub fn with_extra_sms(
        job: &Job,
        params: ComputeParams,
        table: Option<KernelTable>,
        extra: u32,
    ) -> Self {
        if let Err(e) = params.validate() {
            panic!("invalid compute parameters: {e}");
        }
        let reserved = job.parallel.comm_sms.saturating_add(extra);
        let margin = job.parallel.tp_comm_overlap.then(|| {
            let held = reserved.saturating_add(UB_COMM_SMS);
            Box::new(Self::with_reserved_sms(
                job,
                params.clone(),
                table.clone(),
                held,
            ))
        });
        Self {
            margin,
            ..Self::with_reserved_sms(job, params, table, reserved)
        }
    }

    /// The model with `reserved` SMs held by communication kernels for the whole run.
    fn with_reserved_sms(
        job: &Job,
        params: ComputeParams,
        table: Option<KernelTable>,
        reserved: u32,
    ) -> Self {
        let mut params = params;
        // SMs reserved for communication kernels leave the rest to compute: tiles fill fewer
        // SMs and the tensor-core peak shrinks in proportion (HBM bandwidth does not).
        let reserved = reserved.min(params.sm_count.saturating_sub(1));
        let sm_share = (params.sm_count - reserved) as f64 / params.sm_count as f64;
        params.sm_count -= reserved;
        let gpu = &job.cluster.gpu;
        let peak_bf16 = gpu.peak_tflops_bf16 * 1e12 * params.clock_factor * sm_share;
        let precision = job.training.precision;
        let peak_gemm = match precision {
            Precision::Bf16 | Precision::Fp16 => peak_bf16,
            Precision::Fp8 => gpu
                .peak_tflops_fp8
                .map_or(peak_bf16, |t| t * 1e12 * params.clock_factor * sm_share),
        };
        let fp8_recipe_rel = match job.training.fp8_recipe {
            crate::job::Fp8Recipe::Tensorwise => 1.0,
            crate::job::Fp8Recipe::Rowwise => params.fp8_rowwise_rel,
            crate::job::Fp8Recipe::Blockwise => params.fp8_blockwise_rel,
            crate::job::Fp8Recipe::Mxfp8 => params.fp8_mxfp8_rel,
        };
        let attn_rel = match job.training.attention_backend {
            crate::job::AttentionBackend::Cudnn => (1.0, 1.0),
            crate::job::AttentionBackend::Flash2 => params.attn_flash2_rel,
        };
        ComputeModel {
            attn_rel,
            params,
            table,
            precision,
            peak_bf16,
            peak_gemm,
            fp8_recipe_rel,
            grad_accum: GradAccum::of(job),
            hbm_bytes_per_s: gpu.hbm_tbps * 1e12,
            margin: None,
        }
    }

    /// The parameters in use.
    pub fn params(&self) -> &ComputeParams {
        &self.params
    }

    /// Duration of `op`, picoseconds; at least 1 ps, and including the launch overhead.
    pub fn time_ps(&self, op: &ComputeOp) -> SimTime {
        if let Work::Measured { ps } = op.work {
            return ps;
        }
        ps_from_s(self.time_s(op)).max(1)
    }

    /// Duration of `op`, seconds, including the launch overhead.
    pub fn time_s(&self, op: &ComputeOp) -> f64 {
        if let Work::Measured { ps } = op.work {
            return ps as f64 * 1e-12;
        }
        if op.sm_margin
            && let Some(m) = self.margin.as_deref()
        {
            let plain = ComputeOp {
                sm_margin: false,
                ..*op
            };
            return m.time_s(&plain);
        }
        let fp8 = self.runs_fp8(op);
        let dtype = if fp8 { "fp8" } else { "bf16" };
        if let Some(table) = self.table.as_ref() {
            // The kernel's own row, else (a GEMM) the class row `gemm` of the same shape: a
            // profiler trace knows a GEMM's shape but not which layer op launched it.
            let key = || shape_key(&op.work);
            let own = (table.has_op(op.name))
                .then(|| table.get(op.name, &key(), dtype))
                .flatten();
            let class = || {
                (op.class == OpClass::Gemm && table.has_op(GEMM_CLASS_ROW))
                    .then(|| table.get(GEMM_CLASS_ROW, &key(), dtype))
                    .flatten()
            };
            if let Some(t) = own.or_else(class) {
                return t + self.params.launch_overhead_s;
            }
        }
        if op.class == OpClass::Framework {
            return self.params.layer_overhead_s;
        }
        let mem_eff = match op.class {
            OpClass::Norm => self.params.norm_mem_eff,
            OpClass::Softmax => self.params.softmax_mem_eff,
            _ => self.params.mem_eff,
        };
        self.roofline_s(&op.work, fp8, mem_eff)
            + self.wgrad_accum_s(op)
            + self.params.launch_overhead_s
    }

    /// Time a weight-gradient GEMM adds by accumulating into the main gradients: the exposed
    /// part of its epilogue's read and write of them when fused (see
    /// [`ComputeParams::wgrad_accum_hidden_tokens`]), or the separate elementwise add (read
    /// the 16-bit gradient, read and write the main gradient, one launch) when not; 0 for
    /// every other kernel and for stacks without main gradients.
    fn wgrad_accum_s(&self, op: &ComputeOp) -> f64 {
        let Work::Gemm { m, n, k, batch } = op.work else {
            return 0.0;
        };
        if !op.is_weight_gradient() {
            return 0.0;
        }
        let elements = m as f64 * n as f64 * batch as f64;
        let bw = self.hbm_bytes_per_s * self.params.mem_eff;
        match self.grad_accum {
            GradAccum::None => 0.0,
            GradAccum::Fused { main_bytes } => {
                let exposed = (self.params.wgrad_accum_hidden_tokens / k.max(1) as f64)
                    .sqrt()
                    .min(1.0);
                2.0 * main_bytes as f64 * elements / bw * exposed
            }
            GradAccum::Separate { main_bytes } => {
                (2.0 + 2.0 * main_bytes as f64) * elements / bw + self.params.launch_overhead_s
            }
        }
    }

    /// Whether `op` runs on FP8 tensor cores: GEMM-class kernels of an FP8 job, except the
    /// output head's ([`ComputeOp::is_output_head`]).
    fn runs_fp8(&self, op: &ComputeOp) -> bool {
        self.precision == Precision::Fp8
            && op.class == OpClass::Gemm
            && matches!(op.work, Work::Gemm { .. })
            && !op.is_output_head()
            && self.peak_gemm != self.peak_bf16
    }

    /// Roofline time of `work` without the launch overhead, seconds.
    fn roofline_s(&self, work: &Work, fp8: bool, mem_eff: f64) -> f64 {
        let bw = self.hbm_bytes_per_s * mem_eff;
        let flops = work.flops();
        match *work {
            Work::Gemm { m, n, k, batch } => {
                let bytes = if fp8 {
                    // FP8 operands (1 B), BF16 output (2 B).
                    (m as f64 * k as f64 + k as f64 * n as f64 + 2.0 * m as f64 * n as f64)
                        * batch as f64
                } else {
                    work.bytes(2.0)
                };
                let compute = if flops > 0.0 {
                    let (peak, eff_max) = self.gemm_ceiling(fp8);
                    self.gemm_compute_s(m, n, k, batch, peak * eff_max, self.k_overhead(fp8))
                } else {
                    0.0
                };
                compute.max(bytes / bw)
            }
            Work::Attention { .. } => {
                let compute = if flops > 0.0 {
                    flops / (self.peak_bf16 * self.attention_efficiency(work))
                } else {
                    0.0
                };
                compute.max(work.bytes(2.0) / bw)
            }
            Work::Memory { bytes } => bytes as f64 / bw,
            Work::Measured { ps } => ps as f64 * 1e-12,
        }
    }

    /// GEMM efficiency (fraction of the dense peak of the job's GEMM precision) of one
    /// `[m x k] x [k x n]` GEMM; in (0, 1].
    ///
    /// `eff_max * padding * fill * k / (k + gemm_k_overhead)`, where, with `tiles` the number
    /// of `gemm_tile_m x gemm_tile_n` output tiles:
    /// * `padding = m n / (tiles * tile_m * tile_n)`: the share of computed tile area that is
    ///   real output;
    /// * fewer tiles than SMs: cuBLAS splits the reduction over the idle SMs (split-K /
    ///   stream-K), each SM taking at least `gemm_split_k_min` of `k` and paying one tile's
    ///   fixed cost; only when `k` is too short to split do SMs stay idle. Partial last waves
    ///   are not charged either: stream-K balances them, so beyond one wave throughput is
    ///   proportional to work.
    ///
    /// The resulting time is
    /// `∝ tile_m tile_n sm_count (max(tiles k / sm_count, min(k, k_min)) + max(tiles / sm_count, 1) k_overhead)`:
    /// `tile_m tile_n tiles (k + k_overhead)` from one full wave on, never decreasing in any
    /// dimension.
    pub fn gemm_efficiency(&self, m: u64, n: u64, k: u64) -> f64 {
        let fp8 = self.precision == Precision::Fp8 && self.peak_gemm != self.peak_bf16;
        let (_, eff_max) = self.gemm_ceiling(fp8);
        self.gemm_eff(m, n, k, 1, eff_max, self.k_overhead(fp8))
    }

    /// Peak and efficiency ceiling of a GEMM on FP8 (the scaling recipe's share of the FP8
    /// ceiling) or on BF16 tensor cores.
    fn gemm_ceiling(&self, fp8: bool) -> (f64, f64) {
        if fp8 {
            (
                self.peak_gemm,
                self.params.gemm_eff_max_fp8 * self.fp8_recipe_rel,
            )
        } else {
            (self.peak_bf16, self.params.gemm_eff_max_bf16)
        }
    }

    /// A tile's fixed cost (`gemm_k_overhead`) in reduction-length units of the GEMM's own
    /// mainloop. The prologue and the epilogue (converting and storing the BF16 output tile)
    /// take the same time in either precision, while FP8's mainloop covers the reduction
    /// `rate_fp8 / rate_bf16` (about 1.8) times faster, so in FP8 the same time is worth that
    /// many times the reduction length. Measured on an H100 (`validation/h100/moe_fp8.json`):
    /// FP8's speed-up over BF16 grows from 1.15 at k = 256 to 1.5 at 1,024 and 1.6-1.7 at
    /// 2,048-2,880, which a shared `gemm_k_overhead` (a constant 1.8) does not follow.
    fn k_overhead(&self, fp8: bool) -> f64 {
        if !fp8 {
            return self.params.gemm_k_overhead;
        }
        let ((peak, eff), (peak16, eff16)) = (self.gemm_ceiling(true), self.gemm_ceiling(false));
        self.params.gemm_k_overhead * (peak * eff) / (peak16 * eff16)
    }

    /// Compute time of a GEMM at `rate` = peak x eff_max FLOP/s: equal to
    /// `flops / (peak * gemm_eff(..))`, written as
    /// `2 tile_m tile_n sm_count (k_per_sm + waves k_overhead) / rate` (see
    /// [`Self::gemm_efficiency`]) so that it is exactly monotone in floating point too.
    fn gemm_compute_s(&self, m: u64, n: u64, k: u64, batch: u64, rate: f64, ovh: f64) -> f64 {
        let p = &self.params;
        let tm = p.gemm_tile_m as u64;
        let tn = p.gemm_tile_n as u64;
        let tiles =
            m.max(1).div_ceil(tm) as f64 * n.max(1).div_ceil(tn) as f64 * batch.max(1) as f64;
        2.0 * (tm * tn) as f64 * self.gemm_sm_work(tiles, k.max(1) as f64, ovh) / rate
    }

    /// Work of a GEMM with `tiles` output tiles of reduction length `k`, in tile-K units summed
    /// over every SM's busy-or-idle time: `tiles (k + k_overhead)` from one full wave on
    /// (stream-K balances partial waves); below one wave, each SM runs `tiles k / sm_count` of
    /// the reduction (but at least one tile's `k` or `gemm_split_k_min`, whichever is
    /// shorter) and pays one fixed cost. Both branches agree at `tiles = sm_count`.
    fn gemm_sm_work(&self, tiles: f64, k: f64, ovh: f64) -> f64 {
        let p = &self.params;
        let sms = p.sm_count as f64;
        if tiles >= sms {
            tiles * (k + ovh)
        } else {
            sms * ((tiles * k / sms).max(k.min(p.gemm_split_k_min)) + ovh)
        }
    }

    fn gemm_eff(&self, m: u64, n: u64, k: u64, batch: u64, eff_max: f64, ovh: f64) -> f64 {
        let p = &self.params;
        let (m, n, k, batch) = (m.max(1), n.max(1), k.max(1), batch.max(1));
        let tm = p.gemm_tile_m as u64;
        let tn = p.gemm_tile_n as u64;
        let tiles_m = m.div_ceil(tm);
        let tiles_n = n.div_ceil(tn);
        let padding = (m as f64 / (tiles_m * tm) as f64) * (n as f64 / (tiles_n * tn) as f64);
        let tiles = tiles_m as f64 * tiles_n as f64 * batch as f64;
        let k = k as f64;
        // Useful tile work over the work every SM's time is worth (from one wave on, exactly
        // `k / (k + k_overhead)`).
        let work = if tiles >= p.sm_count as f64 {
            k / (k + ovh)
        } else {
            tiles * k / self.gemm_sm_work(tiles, k, ovh)
        };
        eff_max * padding * work
    }

    /// Efficiency of a fused-attention kernel (fraction of the dense BF16 peak); in (0, 1].
    ///
    /// `eff_max(fwd|bwd) * fill * seq_factor * head_factor`:
    /// * `fill = min(1, blocks / sm_count)`, blocks = `batch * heads * ceil(seq / attn_block)`
    ///   over queries in the forward pass and over keys in the backward pass (FlashAttention-2
    ///   parallelizes the backward over key blocks);
    /// * `seq_factor = L / (L + attn_seq_half)` with `L` the average number of keys a query
    ///   attends to (`seq_kv`, times the causal fraction under a causal mask);
    /// * `head_factor = min(1, (d / (d + half)) / (ref / (ref + half)))`.
    ///
    /// Memory-bound and non-attention work return 1.
    pub fn attention_efficiency(&self, work: &Work) -> f64 {
        let p = &self.params;
        let Work::Attention {
            batch,
            heads,
            seq_q,
            seq_kv,
            head_dim,
            causal,
            window,
            backward,
        } = *work
        else {
            return 1.0;
        };
        let (batch, heads, seq_q, seq_kv, head_dim) = (
            batch.max(1),
            heads.max(1),
            seq_q.max(1),
            seq_kv.max(1),
            head_dim.max(1),
        );
        let eff_max = if backward {
            p.attn_bwd_eff_max * self.attn_rel.1
        } else {
            p.attn_fwd_eff_max * self.attn_rel.0
        };
        let par_seq = if backward { seq_kv } else { seq_q };
        let blocks = batch as f64 * heads as f64 * par_seq.div_ceil(p.attn_block as u64) as f64;
        let fill = (blocks / p.sm_count as f64).min(1.0);
        let keys = if causal && window > 0 {
            seq_kv as f64 * crate::ops::window_fraction(seq_q, window)
        } else if causal {
            seq_kv as f64 * causal_fraction(seq_q, seq_kv)
        } else {
            seq_kv as f64
        };
        let seq_factor = keys / (keys + p.attn_seq_half);
        let d = head_dim as f64;
        let r = p.attn_head_dim_ref;
        let half = p.attn_head_dim_half;
        let head_factor = ((d / (d + half)) / (r / (r + half))).min(1.0);
        eff_max * fill * seq_factor * head_factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::small_job;

    fn h100_job() -> Job {
        small_job(1, 1, 1, 8)
    }

    fn gemm(m: u64, n: u64, k: u64) -> ComputeOp {
        ComputeOp {
            name: "fc1_fwd",
            class: OpClass::Gemm,
            work: Work::Gemm { m, n, k, batch: 1 },
            recompute: false,
            sm_margin: false,
        }
    }

    fn model(job: &Job) -> ComputeModel {
        ComputeModel::new(job, ComputeParams::for_gpu(&job.cluster.gpu), None)
    }

    #[test]
    fn for_gpu_picks_generation() {
        let mut gpu = h100_job().cluster.gpu;
        assert_eq!(ComputeParams::for_gpu(&gpu), ComputeParams::h100());
        gpu.name = "A100-SXM4-80GB".into();
        assert_eq!(ComputeParams::for_gpu(&gpu), ComputeParams::a100());
        gpu.name = "NVIDIA B200".into();
        assert_eq!(ComputeParams::for_gpu(&gpu), ComputeParams::b200());
        gpu.name = "mystery".into();
        gpu.peak_tflops_bf16 = 312.0;
        assert_eq!(ComputeParams::for_gpu(&gpu), ComputeParams::a100());
        gpu.peak_tflops_bf16 = 2250.0;
        assert_eq!(ComputeParams::for_gpu(&gpu), ComputeParams::b200());
        for p in [
            ComputeParams::a100(),
            ComputeParams::h100(),
            ComputeParams::h200(),
            ComputeParams::b200(),
        ] {
            p.validate().unwrap();
        }
        let bad = ComputeParams {
            mem_eff: 1.5,
            ..ComputeParams::h100()
        };
        assert!(bad.validate().unwrap_err().contains("mem_eff"));
    }

    #[test]
    fn huge_square_gemm_reaches_eff_max() {
        let job = h100_job();
        let cm = model(&job);
        let p = ComputeParams::h100();
        let n = 65536u64;
        let t = cm.time_s(&gemm(n, n, n));
        let ideal = 2.0 * (n as f64).powi(3) / (989e12 * p.clock_factor * p.gemm_eff_max_bf16);
        assert!((t / ideal - 1.0).abs() < 0.01, "t = {t}, ideal = {ideal}");
        assert!(t >= ideal);
    }

    #[test]
    fn gemm_time_is_roofline_of_gemm_efficiency() {
        let job = h100_job();
        let cm = model(&job);
        for (m, n, k) in [
            (1, 1, 1),
            (8192, 2304, 16384),
            (4096, 128, 64),
            (300, 7000, 5000),
        ] {
            let w = Work::Gemm { m, n, k, batch: 1 };
            let p = ComputeParams::h100();
            let compute = w.flops() / (989e12 * p.clock_factor * cm.gemm_efficiency(m, n, k));
            let memory = w.bytes(2.0) / (3.35e12 * p.mem_eff);
            let expect = compute.max(memory) + p.launch_overhead_s;
            assert!(
                (cm.time_s(&gemm(m, n, k)) / expect - 1.0).abs() < 1e-12,
                "{m}x{n}x{k}"
            );
        }
        // Tiny GEMMs are memory- or overhead-bound, large ones compute-bound.
        let w = Work::Gemm {
            m: 8192,
            n: 8192,
            k: 8192,
            batch: 1,
        };
        assert!(
            w.flops() / (989e12 * cm.gemm_efficiency(8192, 8192, 8192)) > w.bytes(2.0) / 2.8e12
        );
    }

    #[test]
    fn memory_op_is_exact_roofline() {
        let job = h100_job();
        let cm = model(&job);
        let bytes = 1u64 << 30;
        let op = ComputeOp {
            name: "rmsnorm_fwd",
            class: OpClass::Norm,
            work: Work::Memory { bytes },
            recompute: false,
            sm_margin: false,
        };
        // Norm kernels run at their own measured fraction of HBM bandwidth.
        let p = ComputeParams::h100();
        let expect = bytes as f64 / (3.35e12 * p.norm_mem_eff) + p.launch_overhead_s;
        assert_eq!(cm.time_s(&op), expect);
        assert_eq!(cm.time_ps(&op), ps_from_s(expect));
    }

    #[test]
    fn zero_work_costs_the_launch_overhead() {
        let job = h100_job();
        let cm = model(&job);
        let op = ComputeOp {
            name: "x",
            class: OpClass::Elementwise,
            work: Work::Memory { bytes: 0 },
            recompute: false,
            sm_margin: false,
        };
        let p = ComputeParams::h100();
        assert_eq!(cm.time_ps(&op), ps_from_s(p.launch_overhead_s));
        assert_eq!(cm.time_s(&gemm(0, 0, 0)), p.launch_overhead_s);
        let no_overhead = ComputeParams {
            launch_overhead_s: 0.0,
            ..ComputeParams::h100()
        };
        let cm = ComputeModel::new(&job, no_overhead, None);
        assert!(cm.time_ps(&gemm(1, 1, 1)) >= 1);
    }

    #[test]
    fn only_weight_gradients_pay_the_fp32_accumulation_epilogue() {
        let fused = h100_job(); // Megatron-Core: fused FP32 gradient accumulation
        let mut plain = fused.clone();
        plain.training.stack = crate::job::Stack::TorchTitan;
        let (f, p) = (model(&fused), model(&plain));
        let op = |name: &'static str, batch: u64| ComputeOp {
            name,
            class: OpClass::Gemm,
            work: Work::Gemm {
                m: 4096,
                n: 1024,
                k: 2048,
                batch,
            },
            recompute: false,
            sm_margin: false,
        };
        // A weight gradient (dense, or batched over local experts) reads and writes its FP32
        // gradient: 8 m n batch bytes, sqrt(700 / 2048) of them exposed.
        for (name, batch) in [("fc1_wgrad", 1), ("expert_fc1_wgrad", 4)] {
            let extra = f.time_s(&op(name, batch)) - p.time_s(&op(name, batch));
            let params = f.params();
            let want = 8.0 * 4096.0 * 1024.0 * batch as f64
                / (fused.cluster.gpu.hbm_tbps * 1e12 * params.mem_eff)
                * (params.wgrad_accum_hidden_tokens / 2048.0).sqrt();
            assert!((extra - want).abs() < 1e-12, "{name}: {extra} vs {want}");
        }
        // The unfused attention's key and value gradients are activations: no epilogue.
        for name in ["attn_scores_wgrad", "attn_context_wgrad", "fc1_dgrad"] {
            assert_eq!(f.time_s(&op(name, 8)), p.time_s(&op(name, 8)), "{name}");
        }
    }

    /// The accumulation's traffic follows the main gradients' type and the fusion: a fused
    /// epilogue into 16-bit main gradients (an FP16 Megatron job) moves half the bytes of an
    /// FP32 one with the same exposed fraction; unfused, a separate kernel reads the 16-bit
    /// gradient and reads and writes the main gradient (2 + 2 x 4 or 2 + 2 x 2 bytes per
    /// element), all of it exposed, plus one launch.
    #[test]
    fn gradient_accumulation_follows_main_gradient_type_and_fusion() {
        use crate::job::{Precision, Stack};
        let base = h100_job(); // Megatron-Core, BF16: fused, FP32 main gradients
        let variant = |fp16: bool, fused: bool| {
            let mut j = base.clone();
            if fp16 {
                j.training.precision = Precision::Fp16;
                j.parallel.grad_reduce_in_bf16 = true; // the FP16 default (Stack::defaults_for)
            }
            j.parallel.gradient_accumulation_fusion = fused;
            j
        };
        let mut none = base.clone();
        none.training.stack = Stack::TorchTitan;
        let plain = model(&none);
        let wgrad = ComputeOp {
            name: "fc1_wgrad",
            class: OpClass::Gemm,
            work: Work::Gemm {
                m: 4096,
                n: 1024,
                k: 2048,
                batch: 1,
            },
            recompute: false,
            sm_margin: false,
        };
        let extra = |j: &Job| model(j).time_s(&wgrad) - plain.time_s(&wgrad);
        let p = model(&base).params().clone();
        let bw = base.cluster.gpu.hbm_tbps * 1e12 * p.mem_eff;
        let elements = 4096.0 * 1024.0;
        let exposed = (p.wgrad_accum_hidden_tokens / 2048.0).sqrt();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * b.max(1e-9);
        assert!(close(
            extra(&variant(false, true)),
            8.0 * elements / bw * exposed
        ));
        assert!(close(
            extra(&variant(true, true)),
            4.0 * elements / bw * exposed
        ));
        let sep = |main: f64| (2.0 + 2.0 * main) * elements / bw + p.launch_overhead_s;
        assert!(close(extra(&variant(false, false)), sep(4.0)));
        assert!(close(extra(&variant(true, false)), sep(2.0)));
        // The FP16 GEMM itself runs at the BF16 rate.
        let fp16 = model(&variant(true, true));
        let g = gemm(8192, 8192, 8192);
        assert_eq!(fp16.time_s(&g), model(&base).time_s(&g));
    }

    #[test]
    fn sms_kept_for_communication_slow_compute_in_proportion() {
        let job = h100_job();
        let mut reserved = job.clone();
        reserved.parallel.comm_sms = 20;
        let (full, part) = (model(&job), model(&reserved));
        let launch = full.params().launch_overhead_s;
        // A GEMM of many waves: compute time scales with 132 / 112 (tiles spread over fewer
        // SMs at the same per-SM rate).
        let g = gemm(16384, 16384, 8192);
        let ratio = (part.time_s(&g) - launch) / (full.time_s(&g) - launch);
        assert!((ratio - 132.0 / 112.0).abs() < 1e-9, "{ratio}");
        // Memory-bound kernels keep the HBM bandwidth.
        let mem = ComputeOp {
            name: "add",
            class: OpClass::Elementwise,
            work: Work::Memory { bytes: 1 << 30 },
            recompute: false,
            sm_margin: false,
        };
        assert_eq!(part.time_s(&mem), full.time_s(&mem));
        assert_eq!(part.params().sm_count, 112);
    }

    #[test]
    fn under_filled_gemms_split_the_reduction_over_idle_sms() {
        let job = h100_job();
        let cm = model(&job);
        let p = cm.params().clone();
        let (sms, ovh, kmin) = (p.sm_count as f64, p.gemm_k_overhead, p.gemm_split_k_min);
        let eff_max = p.gemm_eff_max_bf16;
        // 1024 x 1024 x 8192: 8 x 4 = 32 tiles on 132 SMs. Split-K: each SM runs 32 x 8192 /
        // 132 of the reduction and pays one fixed cost.
        let want = eff_max * 32.0 * 8192.0 / (sms * (32.0 * 8192.0 / sms + ovh));
        assert!((cm.gemm_efficiency(1024, 1024, 8192) - want).abs() < 1e-12);
        // Too short to split (k <= k_min): one tile per SM, the rest idle.
        let want = eff_max * 32.0 / sms * 128.0 / (128.0 + ovh);
        assert!((cm.gemm_efficiency(1024, 1024, 128) - want).abs() < 1e-12);
        // Long enough for slices but too little work to give every SM k_min: slices of k_min.
        let want = eff_max * 32.0 * 512.0 / (sms * (kmin + ovh));
        assert!((cm.gemm_efficiency(1024, 1024, 512) - want).abs() < 1e-12);
        // One full wave: the split is gone and both branches agree.
        let tiles_m = 132 / 2; // 132 tiles = 66 x 2 (n = 512)
        let e_full = cm.gemm_efficiency(128 * tiles_m, 512, 8192);
        assert!((e_full - eff_max * 8192.0 / (8192.0 + ovh)).abs() < 1e-12);
        // Time: the split GEMM is faster than one tile per SM would be, by up to the idle share.
        let t_split = cm.time_s(&gemm(1024, 1024, 8192));
        let one_tile_per_sm = 2.0 * 128.0 * 256.0 * sms * (8192.0 + ovh)
            / (job.cluster.gpu.peak_tflops_bf16 * 1e12 * p.clock_factor * eff_max)
            + p.launch_overhead_s;
        assert!(
            t_split < one_tile_per_sm / 3.0,
            "{t_split} vs {one_tile_per_sm}"
        );
    }

    #[test]
    fn gemm_efficiency_bounds_and_monotone_on_tile_multiples() {
        let job = h100_job();
        let cm = model(&job);
        let dims: Vec<u64> = (1..=40)
            .map(|i| i * 128)
            .chain([8192, 16384, 53248])
            .collect();
        let dims_n: Vec<u64> = (1..=40)
            .map(|i| i * 256)
            .chain([8192, 16384, 53248])
            .collect();
        for &m in &dims {
            for &n in &dims_n {
                for k in [64u64, 256, 1024, 4096, 16384] {
                    let e = cm.gemm_efficiency(m, n, k);
                    assert!(e > 0.0 && e <= 1.0);
                    assert!(cm.gemm_efficiency(m + 128, n, k) >= e);
                    assert!(cm.gemm_efficiency(m, n + 256, k) >= e);
                    assert!(cm.gemm_efficiency(m, n, k + 1) >= e);
                }
            }
        }
        // Arbitrary (non-multiple) shapes stay in (0, 1].
        for (m, n, k) in [
            (1, 1, 1),
            (7, 13, 3),
            (8191, 1, 100000),
            (u32::MAX as u64, 3, 5),
        ] {
            let e = cm.gemm_efficiency(m, n, k);
            assert!(e > 0.0 && e <= 1.0, "{m}x{n}x{k}: {e}");
        }
    }

    #[test]
    fn bigger_gemm_is_never_faster() {
        let job = h100_job();
        let cm = model(&job);
        let dims = [
            1u64, 7, 64, 127, 128, 129, 255, 256, 1000, 1024, 2304, 4096, 8192, 16896,
        ];
        for &m in &dims {
            for &n in &dims {
                for &k in &dims {
                    let t = cm.time_s(&gemm(m, n, k));
                    for (dm, dn, dk) in [(1, 0, 0), (0, 1, 0), (0, 0, 1), (128, 0, 0), (0, 256, 0)]
                    {
                        let t2 = cm.time_s(&gemm(m + dm, n + dn, k + dk));
                        assert!(t2 >= t, "{m}x{n}x{k} + ({dm},{dn},{dk}): {t2} < {t}");
                    }
                }
            }
        }
        // Batched: more GEMMs never faster.
        let b = |batch| ComputeOp {
            name: "expert_fc1_fwd",
            class: OpClass::Gemm,
            work: Work::Gemm {
                m: 512,
                n: 1024,
                k: 4096,
                batch,
            },
            recompute: false,
            sm_margin: false,
        };
        for batch in 1..40 {
            assert!(cm.time_s(&b(batch + 1)) >= cm.time_s(&b(batch)));
        }
    }

    #[test]
    fn higher_peak_is_never_slower() {
        let job = h100_job();
        let mut fast = job.clone();
        fast.cluster.gpu.peak_tflops_bf16 *= 1.5;
        fast.cluster.gpu.hbm_tbps *= 1.2;
        let slow = model(&job);
        // Same parameters for both, so only the peaks differ.
        let quick = ComputeModel::new(&fast, ComputeParams::h100(), None);
        let attn = |backward, causal| ComputeOp {
            name: "attn",
            class: OpClass::Attention,
            work: Work::Attention {
                batch: 1,
                heads: 16,
                seq_q: 4096,
                seq_kv: 4096,
                head_dim: 128,
                causal,
                window: 0,
                backward,
            },
            recompute: false,
            sm_margin: false,
        };
        let mem = ComputeOp {
            name: "add",
            class: OpClass::Elementwise,
            work: Work::Memory { bytes: 12345678 },
            recompute: false,
            sm_margin: false,
        };
        let mut ops = vec![mem, attn(false, true), attn(true, true), attn(false, false)];
        for &(m, n, k) in &[
            (1, 1, 1),
            (8192, 2304, 16384),
            (128, 256, 64),
            (2048, 50000, 1024),
        ] {
            ops.push(gemm(m, n, k));
        }
        for op in &ops {
            assert!(quick.time_s(op) <= slow.time_s(op), "{op:?}");
        }
    }

    #[test]
    fn table_override_wins() {
        let job = h100_job();
        let op = gemm(4096, 4096, 4096);
        let mut table = KernelTable::new();
        table.insert("fc1_fwd", "4096x4096x4096", "bf16", 1.5e-3);
        table.insert("fc1_fwd", "4096x4096x4096", "fp8", 0.5e-3);
        table.insert("fc2_fwd", "4096x4096x4096", "bf16", 9.0);
        assert_eq!(table.len(), 3);
        let cm = ComputeModel::new(&job, ComputeParams::h100(), Some(table.clone()));
        let launch = ComputeParams::h100().launch_overhead_s;
        assert_eq!(cm.time_s(&op), 1.5e-3 + launch);
        // A shape missing from the table falls back to the roofline.
        assert_eq!(
            cm.time_s(&gemm(4096, 4096, 2048)),
            model(&job).time_s(&gemm(4096, 4096, 2048))
        );
        let mut f8 = job.clone();
        f8.training.precision = Precision::Fp8;
        let cm = ComputeModel::new(&f8, ComputeParams::h100(), Some(table));
        assert_eq!(cm.time_s(&op), 0.5e-3 + launch);
    }

    #[test]
    fn fp8_gemm_is_faster_on_h100_but_attention_router_and_head_are_not() {
        let job = h100_job();
        let mut f8 = job.clone();
        f8.training.precision = Precision::Fp8;
        let bf = model(&job);
        let f8m = model(&f8);
        // A large compute-bound GEMM speeds up by the ratio of the two mainloop rates, less
        // the tile's fixed cost, which takes the same time in both precisions (so FP8 pays it
        // as `rate ratio` times the reduction length).
        let p = ComputeParams::h100();
        let k = 32768.0;
        let op = gemm(32768, 32768, k as u64);
        assert!(f8m.time_s(&op) < bf.time_s(&op));
        let rates = (989.0 * p.gemm_eff_max_bf16) / (1979.0 * p.gemm_eff_max_fp8);
        let ovh = p.gemm_k_overhead;
        let expect = rates * (k + ovh / rates) / (k + ovh);
        let got = (f8m.time_s(&op) - p.launch_overhead_s) / (bf.time_s(&op) - p.launch_overhead_s);
        assert!((got / expect - 1.0).abs() < 1e-9, "{got} vs {expect}");
        let attn = ComputeOp {
            name: "attn_fwd",
            class: OpClass::Attention,
            work: Work::Attention {
                batch: 1,
                heads: 8,
                seq_q: 8192,
                seq_kv: 8192,
                head_dim: 128,
                causal: true,
                window: 0,
                backward: false,
            },
            recompute: false,
            sm_margin: false,
        };
        assert_eq!(f8m.time_s(&attn), bf.time_s(&attn));
        // A router GEMM stays BF16.
        let router = ComputeOp {
            class: OpClass::Router,
            ..op
        };
        assert_eq!(f8m.time_s(&router), bf.time_s(&router));
        // So do the output head's three GEMMs (Megatron-Core's own ColumnParallelLinear,
        // DeepSeek-V3's BF16 head, torchtitan's float8 filter on `output`).
        for name in ["lm_head_fwd", "lm_head_dgrad", "lm_head_wgrad"] {
            let head = ComputeOp { name, ..op };
            assert!(head.is_output_head());
            assert_eq!(f8m.time_s(&head), bf.time_s(&head), "{name}");
        }
        assert!(!op.is_output_head());
    }

    #[test]
    fn attention_efficiency_shape() {
        let job = h100_job();
        let cm = model(&job);
        let w = |seq: u64, d: u64, causal, backward| Work::Attention {
            batch: 1,
            heads: 64,
            seq_q: seq,
            seq_kv: seq,
            head_dim: d,
            causal,
            window: 0,
            backward,
        };
        // Long non-causal, head dim 128: close to the ceiling.
        let ceiling = ComputeParams::h100().attn_fwd_eff_max;
        let e = cm.attention_efficiency(&w(65536, 128, false, false));
        assert!((e / ceiling - 1.0).abs() < 0.01, "{e}");
        // Saturating in sequence length, lower for causal, backward and narrow heads.
        let mut prev = 0.0;
        for s in [256, 512, 1024, 2048, 4096, 8192, 16384] {
            let e = cm.attention_efficiency(&w(s, 128, true, false));
            assert!(e > prev && e < ceiling);
            assert!(e < cm.attention_efficiency(&w(s, 128, false, false)));
            assert!(cm.attention_efficiency(&w(s, 128, true, true)) < e);
            assert!(cm.attention_efficiency(&w(s, 64, true, false)) < e);
            prev = e;
        }
        assert_eq!(
            cm.attention_efficiency(&w(4096, 256, false, false)),
            cm.attention_efficiency(&w(4096, 128, false, false))
        );
    }

    #[test]
    fn attention_time_is_roofline() {
        let job = h100_job();
        let cm = model(&job);
        let work = Work::Attention {
            batch: 1,
            heads: 16,
            seq_q: 8192,
            seq_kv: 8192,
            head_dim: 128,
            causal: true,
            window: 0,
            backward: true,
        };
        let op = ComputeOp {
            name: "attn_bwd",
            class: OpClass::Attention,
            work,
            recompute: false,
            sm_margin: false,
        };
        let p = ComputeParams::h100();
        let expect = work.flops() / (989e12 * p.clock_factor * cm.attention_efficiency(&work))
            + p.launch_overhead_s;
        assert!((cm.time_s(&op) / expect - 1.0).abs() < 1e-12);
    }

    #[test]
    fn shape_keys() {
        assert_eq!(
            shape_key(&Work::Gemm {
                m: 8192,
                n: 2304,
                k: 16384,
                batch: 1
            }),
            "8192x2304x16384"
        );
        assert_eq!(
            shape_key(&Work::Gemm {
                m: 512,
                n: 64,
                k: 32,
                batch: 8
            }),
            "8x512x64x32"
        );
        assert_eq!(
            shape_key(&Work::Attention {
                batch: 1,
                heads: 16,
                seq_q: 4096,
                seq_kv: 8192,
                head_dim: 128,
                causal: true,
                window: 0,
                backward: false
            }),
            "b1h16q4096k8192d128c"
        );
        assert_eq!(shape_key(&Work::Memory { bytes: 1024 }), "1024B");
    }

    #[test]
    fn table_lookup_and_iteration() {
        let mut t = KernelTable::new();
        assert!(t.is_empty());
        t.insert("b", "1B", "bf16", 2.0);
        t.insert("a", "1B", "bf16", 1.0);
        t.insert("a", "1B", "fp8", 3.0);
        t.insert("a", "1B", "bf16", 4.0);
        assert_eq!(t.len(), 3);
        assert_eq!(t.get("a", "1B", "bf16"), Some(4.0));
        assert_eq!(t.get("a", "1B", "fp8"), Some(3.0));
        assert_eq!(t.get("a", "2B", "bf16"), None);
        assert_eq!(t.get("c", "1B", "bf16"), None);
        let v: Vec<_> = t.iter().collect();
        assert_eq!(
            v,
            vec![
                ("a", "1B", "bf16", 4.0),
                ("a", "1B", "fp8", 3.0),
                ("b", "1B", "bf16", 2.0)
            ]
        );
    }
}
