//! DeepSeek-V3's memory-saving techniques (`prism_core::job::MemorySaving`; DeepSeek-AI 2024,
//! arXiv:2412.19437, Sec. 3.2.3 and 3.3.3) against hand-computed closed forms: per-layer
//! activation bytes with and without each technique, the recomputed work added to backward
//! against the forward work it repeats, the optimizer-state bytes, and the defaults.

use prism_core::arch::fixtures::small_deepseek_job;
use prism_core::flops::{hardware_flops_per_iteration, model_flops_per_iteration};
use prism_core::graph::{ExecutionGraph, OpKind, Phase};
use prism_core::job::{
    ActivationCache, Job, MemorySaving, OptimizerStateDtype, Precision, Recompute,
};
use prism_core::memory::{self, layer_activation_bytes_at};
use prism_core::ops::Work;
use prism_core::report::graph_flops;
use prism_core::{SimOptions, simulate};

fn valid(job: Job) -> Job {
    job.validate()
        .unwrap_or_else(|e| panic!("invalid test job: {e}"));
    job
}

/// The small DeepSeek-style model (MLA, 8 experts top-2 + 1 shared expert, layer 0 dense) on
/// one GPU per stage without tensor parallelism, FP8 GEMMs, flash attention, no dropout.
fn ds_job(saving: MemorySaving) -> Job {
    let mut job = small_deepseek_job(1, 1, 1, 8, 1);
    job.model.dropout = false;
    job.training.flash_attention = true;
    job.training.precision = Precision::Fp8;
    job.training.memory_saving = saving;
    valid(job)
}

fn saving(rn: bool, fp8: bool) -> MemorySaving {
    MemorySaving {
        recompute_norm_upproj: rn,
        activation_cache: if fp8 {
            ActivationCache::Fp8
        } else {
            ActivationCache::Bf16
        },
        optimizer_state: OptimizerStateDtype::Fp32,
    }
}

/// Truth: the tensor table of `layer_activation_bytes_at` evaluated by hand for the small
/// model (h 1024, 16 heads, MLA q/kv ranks 256/128, nope 64, rope 32, v 64; experts 512 wide,
/// top-2 of 8, one shared expert of 512; dense FFN 4096; SwiGLU), in units of `sb` bytes.
#[test]
fn per_layer_bytes_closed_forms() {
    let (h, a) = (1024.0, 16.0);
    let (rq, rkv, dn, dr, dv) = (256.0, 128.0, 64.0, 32.0, 64.0);
    let (q, kk, v, o) = (a * (dn + dr), a * (dn + dr), a * dv, a * dv);
    let (e, k, fe, fs, fd) = (8.0, 2.0, 512.0, 512.0, 4096.0);
    let latents = 2.0 * (rq + rkv + dr);
    let lse = 4.0 * a; // flash attention's FP32 log-sum-exp
    let router = 4.0 * e;
    // (recompute, fp8) -> (MoE layer, dense layer), bytes per token.
    let cases = [
        (
            (false, false),
            // LN1 in, QKV in, LN2 in, expert in (k copies), router, latents, shared in;
            // Q K, V, O, routed act (6f k), shared act (6f); LSE.
            2.0 * h
                + 2.0 * h
                + 2.0 * h
                + 2.0 * h * k
                + router
                + latents
                + 2.0 * h
                + 2.0 * (q + kk)
                + 2.0 * v
                + 2.0 * o
                + 6.0 * fe * k
                + 6.0 * fs
                + lse,
            2.0 * h
                + 2.0 * h
                + 2.0 * h
                + 2.0 * h
                + latents
                + 2.0 * (q + kk)
                + 2.0 * v
                + 2.0 * o
                + 6.0 * fd
                + lse,
        ),
        (
            // Norm outputs (QKV in, shared in, dense MLP in) and Q, K, V are not stored.
            (true, false),
            2.0 * h
                + 2.0 * h
                + 2.0 * h * k
                + router
                + latents
                + 2.0 * o
                + 6.0 * fe * k
                + 6.0 * fs
                + lse,
            2.0 * h + 2.0 * h + latents + 2.0 * o + 6.0 * fd + lse,
        ),
        (
            // Linear inputs at 1 byte, O in E5M6 (1.5), MoE SwiGLU input only, in FP8 (2f);
            // the dense SwiGLU keeps its BF16 input (4f) and its output at 1 byte (f).
            (false, true),
            2.0 * h
                + h
                + 2.0 * h
                + h * k
                + router
                + latents
                + h
                + 2.0 * (q + kk)
                + 2.0 * v
                + 1.5 * o
                + 2.0 * fe * k
                + 2.0 * fs
                + lse,
            2.0 * h
                + h
                + 2.0 * h
                + h
                + latents
                + 2.0 * (q + kk)
                + 2.0 * v
                + 1.5 * o
                + 5.0 * fd
                + lse,
        ),
        (
            (true, true),
            2.0 * h + 2.0 * h + h * k + router + latents + 1.5 * o + 2.0 * fe * k + 2.0 * fs + lse,
            2.0 * h + 2.0 * h + latents + 1.5 * o + 5.0 * fd + lse,
        ),
    ];
    for ((rn, fp8), moe, dense) in cases {
        let job = ds_job(saving(rn, fp8));
        let sb = job.model.seq_len as f64 * job.parallel.micro_batch as f64;
        assert!(job.model.is_moe_layer(1) && !job.model.is_moe_layer(0));
        let got_moe = layer_activation_bytes_at(&job, Recompute::None, 1);
        let got_dense = layer_activation_bytes_at(&job, Recompute::None, 0);
        assert_eq!(got_moe, moe * sb, "MoE layer, recompute {rn}, fp8 {fp8}");
        assert_eq!(
            got_dense,
            dense * sb,
            "dense layer, recompute {rn}, fp8 {fp8}"
        );
    }
    // Full recompute keeps the layer input only, whatever the saving settings.
    let mut full = ds_job(saving(true, true));
    full.parallel.recompute = Recompute::Full;
    let sb = full.model.seq_len as f64;
    assert_eq!(
        layer_activation_bytes_at(&full, Recompute::Full, 1),
        2.0 * sb * h
    );
}

/// Truth: the last stage's head tensors lose the LM head input (a norm output, `2sbh`) per
/// in-flight micro-batch with norm recomputation and keep half of it with the FP8 cache; the
/// stored layer bytes change as the per-layer closed forms say.
#[test]
fn head_input_follows_the_norm_rule() {
    let base = ds_job(saving(false, false));
    let sb = base.model.seq_len as f64;
    let h = base.model.hidden as f64;
    let layers_bytes = |job: &Job| memory::in_flight_activations(job, 0);
    let act = |job: &Job| memory::stage_memory(job, 0).activations as f64;
    for (rn, fp8, head_in) in [(true, false, 0.0), (false, true, 1.0), (true, true, 0.0)] {
        let job = ds_job(saving(rn, fp8));
        // One stage: one micro-batch in flight.
        let want = act(&base) - layers_bytes(&base) + layers_bytes(&job) - (2.0 - head_in) * sb * h;
        assert!((act(&job) - want).abs() <= 1.0, "rn {rn} fp8 {fp8}");
    }
}

/// Truth: the work the recomputation adds to backward is exactly the forward work it repeats:
/// per layer and micro-batch the two norms (their HBM bytes) and the MLA up-projections
/// (FLOPs `2 T a (d_nope + d_rope) r_q + 2 T a (d_nope + d_v) r_kv` over all GPUs for `T`
/// tokens), and the simulated iteration gets longer.
#[test]
fn recompute_work_equals_forward_work() {
    let mut base = small_deepseek_job(2, 2, 2, 16, 4);
    base.training.precision = Precision::Fp8;
    let base = valid(base);
    let mut rn = base.clone();
    rn.training.memory_saving.recompute_norm_upproj = true;
    let rn = valid(rn);

    let g0 = ExecutionGraph::build(&base);
    let g1 = ExecutionGraph::build(&rn);
    // FLOPs: closed form over the whole iteration.
    let m = &rn.model;
    let mla = m.arch.mla.unwrap();
    let a = m.heads as f64;
    let per_token =
        2.0 * a * (mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f64 * mla.q_lora_rank as f64
            + 2.0 * a * (mla.qk_nope_head_dim + mla.v_head_dim) as f64 * mla.kv_lora_rank as f64;
    let want = rn.tokens_per_iteration() as f64 * m.layers as f64 * per_token;
    let added = graph_flops(&g1, true) - graph_flops(&g1, false);
    assert!(
        (added - want).abs() <= 1e-9 * want,
        "added {added} want {want}"
    );
    // The reported hardware FLOPs count the same recomputation.
    let hw_added = hardware_flops_per_iteration(&rn) - model_flops_per_iteration(&rn);
    assert!(
        (hw_added - want).abs() <= 1e-9 * want,
        "hardware FLOPs add {hw_added}, want {want}"
    );
    assert_eq!(
        hardware_flops_per_iteration(&base),
        model_flops_per_iteration(&base)
    );
    // Without the option nothing is recomputed, and the model FLOPs are the same.
    assert_eq!(graph_flops(&g0, true), graph_flops(&g0, false));
    assert_eq!(graph_flops(&g0, false), graph_flops(&g1, false));

    // Per program: the recompute ops mirror the forward ops, op for op.
    for (p0, p1) in g0.programs.iter().zip(&g1.programs) {
        let works = |p: &prism_core::graph::Program, phase: Phase, names: &[&str]| {
            let mut v: Vec<(u32, u32, String, Work)> = Vec::new();
            for (i, k) in p.kind.iter().enumerate() {
                if let OpKind::Compute(op) = k
                    && p.tag[i].phase == phase
                    && names.contains(&op.name)
                {
                    let base_name = op.name.rsplit_once('_').unwrap().0.to_string();
                    v.push((p.tag[i].micro_batch, p.tag[i].layer, base_name, op.work));
                }
            }
            v.sort_by(|x, y| (x.0, x.1, &x.2).cmp(&(y.0, y.1, &y.2)));
            v
        };
        let fwd = works(
            p1,
            Phase::Forward,
            &["norm1_fwd", "norm2_fwd", "q_up_fwd", "kv_up_fwd"],
        );
        let rec = works(
            p1,
            Phase::Recompute,
            &[
                "norm1_recompute",
                "norm2_recompute",
                "q_up_recompute",
                "kv_up_recompute",
            ],
        );
        assert!(!fwd.is_empty());
        assert_eq!(fwd, rec);
        assert!(
            works(
                p0,
                Phase::Recompute,
                &["norm1_recompute", "kv_up_recompute"]
            )
            .is_empty()
        );
    }

    let t0 = simulate(&base, &SimOptions::default()).unwrap();
    let t1 = simulate(&rn, &SimOptions::default()).unwrap();
    assert!(t1.summary.iteration_time_s > t0.summary.iteration_time_s);
}

/// Truth: with the FP8 cache every routed- and shared-expert SwiGLU output is recomputed in
/// backward: one recompute op per forward activation op, with the same HBM bytes.
#[test]
fn fp8_cache_recomputes_moe_swiglu_output() {
    let mut job = small_deepseek_job(2, 1, 2, 16, 4);
    job.training.precision = Precision::Fp8;
    job.training.memory_saving.activation_cache = ActivationCache::Fp8;
    let job = valid(job);
    let g = ExecutionGraph::build(&job);
    for p in &g.programs {
        let sum = |name: &str, phase: Phase| {
            let mut n = 0u64;
            let mut bytes = 0u64;
            for (i, k) in p.kind.iter().enumerate() {
                if let OpKind::Compute(op) = k
                    && op.name == name
                    && p.tag[i].phase == phase
                {
                    n += 1;
                    if let Work::Memory { bytes: b } = op.work {
                        bytes += b;
                    }
                }
            }
            (n, bytes)
        };
        for (f, r) in [
            ("expert_act_fwd", "expert_act_recompute"),
            ("shared_act_fwd", "shared_act_recompute"),
        ] {
            let fwd = sum(f, Phase::Forward);
            assert!(fwd.0 > 0);
            assert_eq!(fwd, sum(r, Phase::Recompute), "{f}");
        }
    }
    // The FP8 cache needs FP8 GEMMs.
    let mut bad = job.clone();
    bad.training.precision = Precision::Bf16;
    let err = bad.validate().unwrap_err();
    assert_eq!(err.key, "training.activation_cache");
}

/// Truth: BF16 moments make the optimizer state 4 + 2 + 2 = 8 bytes per parameter instead of
/// 4 + 4 + 4 = 12, sharded the same way; nothing else changes.
#[test]
fn bf16_optimizer_state_bytes() {
    let mut job = small_deepseek_job(2, 1, 2, 16, 4);
    job.parallel.set_distributed_optimizer(false);
    let job = valid(job);
    let mut bf = job.clone();
    bf.training.memory_saving.optimizer_state = OptimizerStateDtype::Bf16;
    for s in 0..job.parallel.pp {
        let params = memory::stage_params(&job, s).total();
        let a = memory::stage_memory(&job, s);
        let b = memory::stage_memory(&bf, s);
        assert_eq!(a.optimizer, 12 * params);
        assert_eq!(b.optimizer, 8 * params);
        assert_eq!(
            (a.weights, a.gradients, a.activations),
            (b.weights, b.gradients, b.activations)
        );
    }
}

/// Truth: the default settings are the plain accounting: an explicit all-off `MemorySaving`
/// and the norm recomputation under full recompute change nothing.
#[test]
fn defaults_and_full_recompute_change_nothing() {
    let mut job = small_deepseek_job(2, 2, 2, 16, 4);
    job.parallel.recompute = Recompute::Full;
    let job = valid(job);
    let mut rn = job.clone();
    rn.training.memory_saving.recompute_norm_upproj = true;
    for s in 0..2 {
        assert_eq!(memory::stage_memory(&job, s), memory::stage_memory(&rn, s));
    }
    let (g0, g1) = (ExecutionGraph::build(&job), ExecutionGraph::build(&rn));
    assert_eq!(g0.total_ops(), g1.total_ops());
    assert_eq!(graph_flops(&g0, true), graph_flops(&g1, true));
    assert_eq!(job.training.memory_saving, MemorySaving::default());
}

/// Truth: walking DualPipe's schedule, rank `r` of `pp` holds at most `pp - r` micro-batches of
/// its forward-direction chunk and `r + 1` of its reverse-direction chunk, both at once
/// (`pp + 1` together, the DeepSeek-V3 report's Table 2); so a rank's activations are
/// `(pp - r) w0 + (r + 1) w1` for chunk bytes `w0`, `w1`, the embedding tensors (stage 0)
/// stay `pp` micro-batches and the head tensors (stage `pp - 1`) one.
#[test]
fn dualpipe_per_chunk_in_flight() {
    use prism_core::job::Schedule;
    for (pp, m) in [(2u32, 4u32), (4, 8), (4, 12), (8, 16), (8, 30)] {
        let mut job = small_deepseek_job(4, 1, pp, 32 / pp * m, 4);
        job.parallel.schedule = Schedule::DualPipe;
        job.training.precision = Precision::Fp8;
        let job = valid(job);
        assert_eq!(job.micro_batches(), m as u64);
        for r in 0..pp {
            let n = memory::dualpipe_chunk_in_flight(&job, r);
            assert_eq!(
                n,
                [(pp - r) as f64, (r + 1) as f64],
                "pp {pp} m {m} rank {r}"
            );
            // Layer activations: chunk sums of the per-layer closed forms times those counts.
            let chunks = job.chunk_layers(r);
            let w = |c: usize| -> f64 {
                chunks[c]
                    .clone()
                    .map(|l| layer_activation_bytes_at(&job, Recompute::None, l))
                    .sum()
            };
            let want = (pp - r) as f64 * w(0) + (r + 1) as f64 * w(1);
            let got = memory::in_flight_activations(&job, r);
            assert!((got - want).abs() <= 1e-9 * want, "pp {pp} rank {r}");
        }
        // Rank 0: the forward-direction embedding's dropout mask (`sbh`, 1 byte) for pp
        // micro-batches and the reverse-direction head for one (final-norm input `2sbh`,
        // head input `2sbh`, FP32 logits `4sbV`).
        let (s, h, v) = (
            job.model.seq_len as f64,
            job.model.hidden as f64,
            job.model.vocab as f64,
        );
        let extras = memory::stage_memory(&job, 0).activations as f64
            - memory::in_flight_activations(&job, 0);
        let want = pp as f64 * s * h + (4.0 * s * h + 4.0 * s * v);
        assert!((extras - want).abs() <= 1.0, "pp {pp}: {extras} vs {want}");
    }
}

mod common;

/// The optimizer step's HBM bytes in each stage's program.
fn optimizer_step_bytes(job: &Job) -> Vec<u64> {
    common::memory_bytes_per_program(&ExecutionGraph::build(job), "optimizer_step")
}

/// Truth, per parameter a rank updates: a BF16 model without FP32 master weights (PyTorch's
/// Adam on a model cast to BF16) holds 2 bytes of weights, 2 of gradients and only the two
/// moments as optimizer state (2 + 2 in BF16, 4 + 4 in FP32), against 2 + 4 + 12 with master
/// weights; its Adam step reads the BF16 gradient (2), reads and writes the weight (4) and
/// both moments (8 in BF16, 16 in FP32): 14 or 22 bytes against 30 with master weights.
/// Activations do not change.
#[test]
fn bf16_model_without_master_weights() {
    let mut job = small_deepseek_job(2, 1, 2, 16, 4);
    job.parallel.set_distributed_optimizer(false);
    let mixed = valid(job);
    for (moments, state_bytes, step_bytes) in [
        (OptimizerStateDtype::Bf16, 4, 14),
        (OptimizerStateDtype::Fp32, 8, 22),
    ] {
        let mut pure = mixed.clone();
        pure.training.master_weights = false;
        pure.training.memory_saving.optimizer_state = moments;
        let pure = valid(pure);
        assert_eq!(pure.optimizer_bytes_per_param(), state_bytes);
        assert_eq!(pure.adam_step_bytes_per_param(), step_bytes);
        let steps = (optimizer_step_bytes(&mixed), optimizer_step_bytes(&pure));
        for s in 0..mixed.parallel.pp {
            let params = memory::stage_params(&mixed, s).total();
            let (a, b) = (
                memory::stage_memory(&mixed, s),
                memory::stage_memory(&pure, s),
            );
            assert_eq!(
                (a.weights, a.gradients, a.optimizer),
                (2 * params, 4 * params, 12 * params)
            );
            assert_eq!(
                (b.weights, b.gradients, b.optimizer),
                (2 * params, 2 * params, state_bytes * params),
                "{moments:?}, stage {s}"
            );
            assert_eq!(a.activations, b.activations);
            assert_eq!(steps.0[s as usize], 30 * params);
            assert_eq!(steps.1[s as usize], step_bytes * params);
        }
    }
}

/// Truth: under the distributed optimizer (ZeRO-1) the moments without master weights are
/// sharded like the full state: `4 x params / dp` bytes (BF16 moments), rounded up per part.
#[test]
fn bf16_model_without_master_weights_shards_its_moments() {
    let mut job = small_deepseek_job(2, 1, 2, 16, 4);
    job.parallel.set_distributed_optimizer(true);
    job.training.master_weights = false;
    job.training.memory_saving.optimizer_state = OptimizerStateDtype::Bf16;
    let job = valid(job);
    assert_sharded_optimizer(&job, 4);
    for s in 0..job.parallel.pp {
        let m = memory::stage_memory(&job, s);
        assert_eq!(m.gradients, 2 * memory::stage_params(&job, s).total());
    }
}

/// Asserts that each stage's optimizer state is `bytes` per parameter sharded as the
/// distributed optimizer shards it: dense parameters over dp x cp, experts over dp / ep x cp,
/// each part rounded up.
fn assert_sharded_optimizer(job: &Job, bytes: u64) {
    let p = &job.parallel;
    let (dp, edp) = (
        p.dp as u64 * p.cp as u64,
        (p.dp / p.ep) as u64 * p.cp as u64,
    );
    for s in 0..p.pp {
        let ps = memory::stage_params(job, s);
        assert_eq!(
            memory::stage_memory(job, s).optimizer,
            (bytes * ps.dense).div_ceil(dp) + (bytes * ps.expert).div_ceil(edp),
            "stage {s}"
        );
    }
}

/// Truth, per parameter a rank updates: FP32 master weights kept as remainders (Apex's
/// `store_param_remainders`, Transformer Engine's `FusedAdam` under Megatron-Core's
/// precision-aware optimizer) hold the low 16 bits of each master weight, 2 bytes instead of
/// 4: optimizer state 2 + 8 = 10 bytes (2 + 4 = 6 with BF16 moments) against 12 (8). The step
/// reads the FP32 gradient (4), reads and writes the BF16 weight and the remainder (8) and both
/// moments (16 or 8): 28 (20) against 30 (22). Weights, gradients and activations do not
/// change, and the step, memory-bound, gets no slower.
#[test]
fn master_weight_remainders_halve_the_master_copy() {
    let mut job = small_deepseek_job(2, 1, 2, 16, 4);
    job.parallel.set_distributed_optimizer(false);
    for (moments, full, halves, full_step, halves_step) in [
        (OptimizerStateDtype::Fp32, 12, 10, 30, 28),
        (OptimizerStateDtype::Bf16, 8, 6, 22, 20),
    ] {
        let mut mixed = job.clone();
        mixed.training.memory_saving.optimizer_state = moments;
        let mixed = valid(mixed);
        let mut rem = mixed.clone();
        rem.training.master_weight_remainders = true;
        let rem = valid(rem);
        assert_eq!(
            (
                mixed.optimizer_bytes_per_param(),
                rem.optimizer_bytes_per_param()
            ),
            (full, halves)
        );
        assert_eq!(
            (
                mixed.adam_step_bytes_per_param(),
                rem.adam_step_bytes_per_param()
            ),
            (full_step, halves_step)
        );
        let steps = (optimizer_step_bytes(&mixed), optimizer_step_bytes(&rem));
        for s in 0..mixed.parallel.pp {
            let params = memory::stage_params(&mixed, s).total();
            let (a, b) = (
                memory::stage_memory(&mixed, s),
                memory::stage_memory(&rem, s),
            );
            assert_eq!((a.weights, a.gradients), (b.weights, b.gradients));
            assert_eq!(a.activations, b.activations);
            assert_eq!(
                (a.optimizer, b.optimizer),
                (full * params, halves * params),
                "{moments:?}, stage {s}"
            );
            assert_eq!(
                (steps.0[s as usize], steps.1[s as usize]),
                (full_step * params, halves_step * params)
            );
        }
        let t0 = simulate(&mixed, &SimOptions::default()).unwrap();
        let t1 = simulate(&rem, &SimOptions::default()).unwrap();
        assert!(t1.summary.iteration_time_s <= t0.summary.iteration_time_s);
    }
    // Under the distributed optimizer the 10 bytes are sharded like the full state.
    job.parallel.set_distributed_optimizer(true);
    job.training.master_weight_remainders = true;
    assert_sharded_optimizer(&valid(job), 10);
}

/// The remainders are the low half of an FP32 master weight whose high half is a BF16 weight
/// held beside it: refused without master weights, with FP16 or FP8 weights, and under ZeRO-3,
/// each error naming the key and the setting that rules it out.
#[test]
fn master_weight_remainders_rules() {
    let base = {
        let mut j = small_deepseek_job(2, 1, 2, 16, 4);
        j.parallel.set_distributed_optimizer(true);
        j.training.master_weight_remainders = true;
        valid(j)
    };
    let mut cases: Vec<(Job, &str)> = Vec::new();
    let mut j = base.clone();
    j.training.master_weights = false;
    cases.push((j, "training.master_weights = false"));
    let mut j = base.clone();
    j.training.precision = Precision::Fp16;
    cases.push((j, "\"fp16\""));
    let mut j = base.clone();
    j.training.precision = Precision::Fp8;
    j.parallel.fp8_param_gather = true;
    cases.push((j, "parallel.fp8_param_gather"));
    let mut j = base.clone();
    j.parallel.zero_stage = 3;
    cases.push((j, "parallel.zero_stage = 3"));
    for (job, why) in cases {
        let e = job.validate().expect_err(why).to_string();
        assert!(
            e.contains("training.master_weight_remainders") && e.contains(why),
            "{e}"
        );
    }
    // FP8 GEMMs on BF16 weights keep them.
    let mut j = base.clone();
    j.training.precision = Precision::Fp8;
    valid(j);
}
