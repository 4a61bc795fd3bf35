//! Closed-form FLOP counts per training iteration, for MFU and HFU.
//!
//! Conventions (those of Megatron-LM's and PaLM's MFU accounting):
//!
//! * **Model FLOPs** count the matrix multiplies of the model, forward and backward, once:
//!   per layer and sequence of `s` tokens, forward:
//!   * QKV projection `2 s h (hq + 2 hkv)` (grouped-query attention: `hkv = kv_heads x head_dim`,
//!     `hq = heads x head_dim`);
//!   * attention scores and attention over values `4 s² hq` (QK^T and PV, `2 s² hq` each), **not
//!     halved for the causal mask**;
//!   * output projection `2 s hq h`;
//!   * MLP `2 s h f` per weight matrix (2 matrices for GeLU, 3 for SwiGLU); for MoE layers the
//!     router `2 s h E` plus `top_k` experts of `2 s h f_e` per matrix;
//!
//!   plus the LM head `2 s h V`. Backward is twice the forward, so model FLOPs are 3x the
//!   forward. Norms, elementwise work, softmax, the embedding lookup and the loss are not
//!   counted.
//! * **Hardware FLOPs** add the forward work recomputed in backward: with full recompute one
//!   more forward of every transformer layer (not of the LM head, which Megatron does not
//!   recompute), with selective recompute one more attention core (`4 s² hq`) per layer.
//!
//! The simulated kernels ([`crate::ops::Work::flops`]) skip the masked half of causal
//! attention; these counts deliberately do not, so that MFU is comparable with published
//! figures.

use crate::job::{Job, Recompute};

/// Forward FLOPs of transformer layer `layer` for one sequence, split into the matrix
/// multiplies with weights and the attention core (scores and attention over values; a local
/// layer counts `4 s min(w, s) hq`, the windowed analogue of the unmasked `4 s² hq`).
///
/// Multi-head latent attention counts its four projections (query down/up, joint key-value
/// down/up) and the output projection, and a core of `2 s² H (d_qk + d_v)`. MoE layers count the
/// router, `top_k` routed experts and the shared experts.
fn layer_forward_flops_at(job: &Job, layer: u32, causal: bool) -> (f64, f64) {
    let m = &job.model;
    let s = m.seq_len as f64;
    let h = m.hidden as f64;
    let mats = m.activation.mlp_matrices() as f64;
    let qkv = match &m.arch.mla {
        Some(mla) => {
            let heads = m.heads as f64;
            let (rq, rkv) = (mla.q_lora_rank as f64, mla.kv_lora_rank as f64);
            let dqk = mla.qk_head_dim() as f64;
            let q = if rq > 0.0 {
                h * rq + rq * heads * dqk
            } else {
                h * heads * dqk
            };
            let kv = h * (rkv + mla.qk_rope_head_dim as f64)
                + rkv * heads * (mla.qk_nope_head_dim as f64 + mla.v_head_dim as f64);
            2.0 * s * (q + kv)
        }
        None => {
            let hq = m.heads as f64 * m.head_dim as f64;
            let hkv = m.kv_heads as f64 * m.head_dim as f64;
            2.0 * s * h * (hq + 2.0 * hkv)
        }
    };
    let out = 2.0 * s * m.o_width() as f64 * h;
    let mlp = match &m.moe {
        Some(moe) if m.is_moe_layer(layer) => {
            2.0 * s * h * moe.experts as f64
                + moe.top_k as f64 * mats * 2.0 * s * h * moe.ffn_hidden as f64
                + mats * 2.0 * s * h * m.arch.moe_shared_ffn_hidden as f64
        }
        _ => mats * 2.0 * s * h * m.ffn_hidden as f64,
    };
    // Scores (width q_width) and attention over values (width o_width), 2 FLOPs per pair.
    let width = if m.arch.mla.is_some() {
        (m.q_width() + m.o_width()) as f64
    } else {
        2.0 * m.heads as f64 * m.head_dim as f64
    };
    let su = m.seq_len as u64;
    let core = match m.local_attention(layer) {
        None if causal => 2.0 * s * s * width * crate::ops::causal_fraction(su, su),
        None => 2.0 * s * s * width,
        Some(la) if causal => 2.0 * la.pairs(su) as f64 * width,
        Some(la) => 2.0 * s * la.unmasked_keys(su) as f64 * width,
    };
    (qkv + out + mlp, core)
}

/// Forward FLOPs of one transformer layer for one sequence, split into the matrix multiplies
/// with weights and the attention core (scores and attention over values).
fn layer_forward_flops_per_sequence(job: &Job) -> (f64, f64) {
    layer_forward_flops_at(job, 0, false)
}

/// The model is the plain decoder (every layer alike): the closed forms below apply as
/// written, `layers x` one layer.
fn uniform(job: &Job) -> bool {
    job.model.arch == crate::arch::Arch::default()
}

/// Sum over the layers (grouped by kind) of `f(count, gemm, core)` with the layer's forward
/// FLOPs, the multi-token-prediction layers included (each one more layer of the last layer's
/// kind).
fn sum_layers(job: &Job, causal: bool, f: impl Fn(f64, f64, f64) -> f64) -> f64 {
    let m = &job.model;
    let mut total = 0.0;
    for (n, l) in m.layer_kinds() {
        let (gemm, core) = layer_forward_flops_at(job, l, causal);
        total += f(n as f64, gemm, core);
    }
    let mtp = m.arch.mtp_depth as f64;
    if mtp > 0.0 {
        let (gemm, core) = layer_forward_flops_at(job, m.layers - 1, causal);
        total += f(mtp, gemm, core);
    }
    total
}

/// Forward FLOPs per sequence of the multi-token-prediction modules outside their layers:
/// the `2h x h` projection and one more LM head each (not recomputed).
fn mtp_extra_forward_flops(job: &Job) -> f64 {
    let m = &job.model;
    let s = m.seq_len as f64;
    let h = m.hidden as f64;
    m.arch.mtp_depth as f64 * (2.0 * s * 2.0 * h * h + lm_head_forward_flops_per_sequence(job))
}

/// Forward FLOPs of the LM head for one sequence.
fn lm_head_forward_flops_per_sequence(job: &Job) -> f64 {
    let m = &job.model;
    2.0 * m.seq_len as f64 * m.hidden as f64 * m.vocab as f64
}

/// Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
/// Using Megatron-LM"), equation 3:
/// `F = 96 B s l h² (1 + s / (6h) + V / (16 l h))` FLOPs per iteration, with `B` the global
/// batch in sequences.
///
/// It assumes a GPT layer (multi-head attention, GeLU MLP of width `4h`) and **full
/// recomputation** (4 forward-equivalents per layer: forward, recomputed forward, backward =
/// 2x), with the LM head counted 3x (not recomputed): `96 B s l h² + 16 B s² l h` for the
/// layers plus `6 B s h V` for the head. For other models it is only the GPT approximation.
pub fn narayanan_eq3(job: &Job) -> f64 {
    let m = &job.model;
    let b = job.training.global_batch as f64;
    let s = m.seq_len as f64;
    let l = m.layers as f64;
    let h = m.hidden as f64;
    let v = m.vocab as f64;
    96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
}

/// Model FLOPs per iteration: 3 x (forward matrix multiplies of every layer, attention core
/// not causal-discounted, and the LM head) for every sequence of the global batch. See the
/// module documentation for the exact terms.
///
/// For GPT this is `72 B s l h² (1 + s / (6h) + V / (12 l h))`, i.e. `3/4` of
/// [`narayanan_eq3`] plus `1.5 B s h V` (eq. 3 counts the LM head 3x, not 4x).
pub fn model_flops_per_iteration(job: &Job) -> f64 {
    let b = job.training.global_batch as f64;
    if !uniform(job) {
        let layers = sum_layers(job, false, |n, gemm, core| n * (gemm + core))
            + mtp_extra_forward_flops(job);
        return 3.0 * b * (layers + lm_head_forward_flops_per_sequence(job));
    }
    let (gemm, core) = layer_forward_flops_per_sequence(job);
    let layers = job.model.layers as f64;
    3.0 * b * (layers * (gemm + core) + lm_head_forward_flops_per_sequence(job))
}

/// [`model_flops_per_iteration`] with the attention core counted only where the causal mask
/// lets a query see a key (`causal_fraction(s, s)` = `(s + 1) / 2s` of it): the convention of
/// FlashAttention's and torchtitan's FLOP counters, and of the simulated kernels. MFU on it
/// (`Summary::mfu_causal`) is lower than Megatron's at long sequences.
pub fn model_flops_per_iteration_causal(job: &Job) -> f64 {
    let b = job.training.global_batch as f64;
    if !uniform(job) {
        let layers =
            sum_layers(job, true, |n, gemm, core| n * (gemm + core)) + mtp_extra_forward_flops(job);
        return 3.0 * b * (layers + lm_head_forward_flops_per_sequence(job));
    }
    let (gemm, core) = layer_forward_flops_per_sequence(job);
    let s = job.model.seq_len as u64;
    let core = core * crate::ops::causal_fraction(s, s);
    let layers = job.model.layers as f64;
    3.0 * b * (layers * (gemm + core) + lm_head_forward_flops_per_sequence(job))
}

/// The PaLM (Chowdhery et al. 2022, Appendix B) estimate per iteration:
/// `6 N T + 12 l hq s T + 6 V h T`, with `T` tokens per iteration, `N` the active
/// non-embedding parameters (every transformer layer with top-k experts, norms and router;
/// without the embedding, LM head and final norm), `hq = heads x head_dim`.
///
/// It differs from [`model_flops_per_iteration`] only by the norm weights (`6 x 2h` per layer
/// and token), which the 6N rule counts as if they were matrix weights.
pub fn six_n_plus_attention(job: &Job) -> f64 {
    let m = &job.model;
    let t = job.tokens_per_iteration() as f64;
    let n = (m.active_params() - m.embedding_params() - m.hidden as u64) as f64;
    let hq = m.heads as f64 * m.head_dim as f64;
    let attention = 12.0 * m.layers as f64 * hq * m.seq_len as f64;
    let head = 6.0 * m.vocab as f64 * m.hidden as f64;
    (6.0 * n + attention + head) * t
}

/// Hardware FLOPs per iteration: [`model_flops_per_iteration`] plus the recomputed forward
/// work (full recompute: one forward of every transformer layer; selective: the attention core
/// of every layer; none: nothing), plus the MLA up-projections when
/// `training.recompute_norm_upproj` recomputes them in backward (the norms are memory-bound).
pub fn hardware_flops_per_iteration(job: &Job) -> f64 {
    recomputed_forward_flops(job) + upproj_recompute_flops(job)
}

/// Forward FLOPs the MLA query and key-value up-projections repeat in backward under
/// DeepSeek-V3's norm and up-projection recomputation (0 without it or without MLA):
/// `2 a (d_nope + d_rope) r_q + 2 a (d_nope + d_v) r_kv` per token and layer.
fn upproj_recompute_flops(job: &Job) -> f64 {
    let m = &job.model;
    let saving = &job.training.memory_saving;
    match m.arch.mla {
        Some(mla) if saving.recomputes_norm_upproj(job.parallel.recompute) => {
            let a = m.heads as f64;
            let q = if mla.q_lora_rank > 0 {
                2.0 * a * mla.qk_head_dim() as f64 * mla.q_lora_rank as f64
            } else {
                0.0
            };
            let kv =
                2.0 * a * (mla.qk_nope_head_dim + mla.v_head_dim) as f64 * mla.kv_lora_rank as f64;
            job.tokens_per_iteration() as f64 * m.layers as f64 * (q + kv)
        }
        _ => 0.0,
    }
}

/// Forward GEMM FLOPs per sequence that [`Recompute::SelectiveOp`] repeats in one layer: the
/// K projection, the output projection unless a reduce-scatter (whose output the policy
/// saves) follows it, and a SwiGLU's up projection. (A GeLU MLP's second projection is
/// recomputed by an eager replay but nothing in the backward reads its output.)
pub fn selective_op_gemm_flops_per_sequence(job: &Job) -> f64 {
    let m = &job.model;
    let p = &job.parallel;
    let s = m.seq_len as f64;
    let h = m.hidden as f64;
    let hq = (m.heads * m.head_dim) as f64;
    let hkv = (m.kv_heads * m.head_dim) as f64;
    let k = 2.0 * s * h * hkv;
    let o = if p.splits_sequence() {
        0.0
    } else {
        2.0 * s * hq * h
    };
    let up = if m.activation == crate::job::Activation::SwiGlu {
        2.0 * s * h * m.ffn_hidden as f64
    } else {
        0.0
    };
    k + o + up
}

/// [`model_flops_per_iteration`] plus the forward work the job's `parallel.recompute` repeats.
fn recomputed_forward_flops(job: &Job) -> f64 {
    let b = job.training.global_batch as f64;
    if !uniform(job) {
        let recompute = sum_layers(job, false, |n, gemm, core| {
            n * match job.parallel.recompute {
                Recompute::None => 0.0,
                Recompute::Selective => core,
                Recompute::Full => gemm + core,
                Recompute::SelectiveOp => selective_op_gemm_flops_per_sequence(job),
            }
        });
        return model_flops_per_iteration(job) + b * recompute;
    }
    let (gemm, core) = layer_forward_flops_per_sequence(job);
    let layers = job.model.layers as f64;
    let recompute = match job.parallel.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => core,
        Recompute::Full => gemm + core,
        Recompute::SelectiveOp => selective_op_gemm_flops_per_sequence(job),
    };
    model_flops_per_iteration(job) + b * layers * recompute
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Moe;
    use crate::job::fixtures::{gpt3_175b_model, llama3_405b_job, small_job};

    fn rel(a: f64, b: f64) -> f64 {
        (a / b - 1.0).abs()
    }

    fn gpt3_job(recompute: Recompute) -> Job {
        let mut job = small_job(64, 8, 8, 1536);
        job.model = gpt3_175b_model();
        job.parallel.recompute = recompute;
        job.validate().unwrap();
        job
    }

    #[test]
    fn causal_convention_removes_the_masked_half_of_attention() {
        let job = llama3_405b_job();
        let m = &job.model;
        let (b, l, s) = (
            job.training.global_batch as f64,
            m.layers as f64,
            m.seq_len as f64,
        );
        let hq = m.heads as f64 * m.head_dim as f64;
        // The masked part of the attention core: 3 x B x l x 4 s^2 hq x (1 - (s + 1) / 2s).
        let masked = 3.0 * b * l * 4.0 * s * s * hq * (1.0 - (s + 1.0) / (2.0 * s));
        let diff = model_flops_per_iteration(&job) - model_flops_per_iteration_causal(&job);
        assert!((diff - masked).abs() <= 1e-9 * masked, "{diff} vs {masked}");
    }

    #[test]
    fn full_recompute_hardware_flops_equal_eq3() {
        for job in [gpt3_job(Recompute::Full), {
            let mut j = small_job(1, 1, 1, 8);
            j.parallel.recompute = Recompute::Full;
            j
        }] {
            let hw = hardware_flops_per_iteration(&job);
            let eq3 = narayanan_eq3(&job);
            assert!(rel(hw, eq3) < 1e-9, "{hw} vs {eq3}");
        }
    }

    #[test]
    fn model_flops_are_eq3_without_recompute() {
        let job = gpt3_job(Recompute::None);
        let m = &job.model;
        let (b, s, l, h, v) = (
            job.training.global_batch as f64,
            m.seq_len as f64,
            m.layers as f64,
            m.hidden as f64,
            m.vocab as f64,
        );
        let mf = model_flops_per_iteration(&job);
        // 3/4 of eq. 3, plus the LM head term eq. 3 counts 3x instead of 4x.
        assert!(rel(mf, 0.75 * narayanan_eq3(&job) + 1.5 * b * s * h * v) < 1e-9);
        assert!(
            rel(
                mf,
                72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
            ) < 1e-9
        );
        assert_eq!(hardware_flops_per_iteration(&job), mf);
        // Selective recompute adds exactly one attention core forward per layer: 4 B s² h l.
        let sel = gpt3_job(Recompute::Selective);
        let extra = hardware_flops_per_iteration(&sel) - model_flops_per_iteration(&sel);
        assert!(rel(extra, 4.0 * b * s * s * h * l) < 1e-9);
    }

    #[test]
    fn six_n_close_to_model_flops_gpt3() {
        let job = gpt3_job(Recompute::None);
        let a = six_n_plus_attention(&job);
        let b = model_flops_per_iteration(&job);
        assert!(rel(a, b) < 0.01, "{a} vs {b}");
        // The only difference: norm weights, 6 x 2h per layer and token.
        let t = job.tokens_per_iteration() as f64;
        let norms = 6.0 * 2.0 * 12288.0 * 96.0 * t;
        assert!(rel(a - b, norms) < 1e-6);
    }

    #[test]
    fn llama405b_per_token() {
        // Llama 3 405B (Dubey et al. 2024), 16384 GPUs: tp 8, pp 16, dp 128.
        let job = llama3_405b_job();
        job.validate().unwrap();
        let per_token = model_flops_per_iteration(&job) / job.tokens_per_iteration() as f64;
        // By hand, forward per token and layer (h 16384, hq 16384, hkv 1024, f 53248, s 8192):
        //   QKV       2 * 16384 * (16384 + 2048) =   603,979,776
        //   out       2 * 16384 * 16384          =   536,870,912
        //   MLP   3 * 2 * 16384 * 53248          = 5,234,491,392
        //   attention 4 * 8192 * 16384           =   536,870,912
        //   layer total                          = 6,912,212,992
        // x 126 layers = 870,938,836,992; LM head 2 * 16384 * 128256 = 4,202,692,608;
        // forward 875,141,529,600; x 3 = 2,625,424,588,800 FLOPs per token.
        assert_eq!(per_token, 2_625_424_588_800.0);
        // 6 N (N = 405.9e9 total parameters) + 12 l hq s: within 2%.
        let n = job.model.params() as f64;
        let palm = 6.0 * n + 12.0 * 126.0 * 16384.0 * 8192.0;
        assert!(rel(per_token, palm) < 0.02, "{per_token} vs {palm}");
    }

    #[test]
    fn moe_counts_top_k_experts() {
        let mut job = small_job(1, 1, 1, 8);
        let dense = model_flops_per_iteration(&job);
        // Top-1 of 4 experts with the dense width: the dense count plus the router.
        job.model.moe = Some(Moe {
            experts: 4,
            top_k: 1,
            ffn_hidden: 4096,
        });
        let router = 3.0 * 8.0 * 8.0 * 2.0 * 2048.0 * 1024.0 * 4.0;
        assert!(rel(model_flops_per_iteration(&job), dense + router) < 1e-12);
        job.model.moe = Some(Moe {
            experts: 4,
            top_k: 2,
            ffn_hidden: 4096,
        });
        assert!(model_flops_per_iteration(&job) > dense + router);
        assert!(rel(six_n_plus_attention(&job), model_flops_per_iteration(&job)) < 0.01);
    }
}
