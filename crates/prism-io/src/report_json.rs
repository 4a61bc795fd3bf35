//! The JSON summary of a simulation: headline numbers, where the time went, memory, the job's
//! parallel settings and (for small runs) per-rank timings.
//!
//! The keys `iteration_time_s`, `tokens_per_s`, `model_tflops_per_gpu`,
//! `hardware_tflops_per_gpu`, `mfu` (Megatron's convention: causal attention counted in full), `mfu_causal` (only its unmasked half), `hfu`, `peak_memory_bytes`, `hbm_capacity_bytes` and `memory_fits` (the peak within the GPU's HBM), `bubble_fraction` and `num_gpus`
//! are a public contract. Objects are written with sorted keys, so the output is deterministic.

use prism_core::SimResult;
use prism_core::job::{Job, Recompute, Schedule};
use prism_core::layout::Layout;
use prism_core::report::{Breakdown, RankTiming};
use serde_json::{Map, Value, json};

/// Results with at most this many simulated ranks list them under `ranks`.
pub const MAX_LISTED_RANKS: usize = 64;

/// Name of a pipeline schedule, as job files spell it.
pub fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::GPipe => "gpipe",
        Schedule::OneFOneB => "1f1b",
        Schedule::Interleaved => "interleaved",
        Schedule::DualPipe => "dualpipe",
        Schedule::OneFOneBOverlap => "1f1b-overlap",
    }
}

/// Name of a recompute mode, as job files spell it.
pub fn recompute_name(r: Recompute) -> &'static str {
    r.name()
}

/// A breakdown as `{compute_s, exposed_tp_s, ..., bubble_s}` ([`Breakdown::parts`] names plus
/// `_s`).
pub fn breakdown_json(b: &Breakdown) -> Value {
    let mut m = Map::new();
    for (name, secs) in b.parts() {
        m.insert(format!("{name}_s"), json!(secs));
    }
    Value::Object(m)
}

/// One rank's timing, with its coordinates.
pub fn rank_json(r: &RankTiming, layout: &Layout) -> Value {
    let c = layout.coord(r.rank);
    json!({
        "rank": r.rank,
        "tp": c.tp,
        "cp": c.cp,
        "dp": c.dp,
        "pp": c.pp,
        "finish_s": r.finish_s,
        "compute_s": r.compute_s,
        "gemm_s": r.gemm_s,
        "breakdown": breakdown_json(&r.breakdown),
    })
}

/// The summary of `result` (a simulation of `job`) as one JSON object.
///
/// Always present: the contract keys above, `name`, `stage_memory_bytes`, `breakdown`,
/// `model_flops`, `hardware_flops`, `graph_ops`, `programs`, `events`, `tokens_per_s_per_gpu`,
/// `ranks_simulated` and `parallel` (the job's `tp`, `pp`, `cp`, `ep`, `dp`, `vpp`,
/// `micro_batch`, `schedule`, `recompute`, `sequence_parallel`, `distributed_optimizer`,
/// `zero_stage`, `order`, `stack`, `global_batch`, `precision`; with ZeRO-3 also
/// `reshard_after_forward` and `zero3_grad_sync`; with the interleaved schedule also
/// `overlap_p2p_comm` and `overlap_p2p_comm_warmup_flush`). `ranks` (per-rank timings) is present when at most
/// [`MAX_LISTED_RANKS`] ranks were simulated.
pub fn summary_json(result: &SimResult, job: &Job) -> Value {
    let s = &result.summary;
    let p = &job.parallel;
    let per_gpu = if s.num_gpus > 0 {
        s.tokens_per_s / s.num_gpus as f64
    } else {
        0.0
    };
    let mut v = json!({
        "name": s.name,
        "num_gpus": s.num_gpus,
        "iteration_time_s": s.iteration_time_s,
        "tokens_per_s": s.tokens_per_s,
        "tokens_per_s_per_gpu": per_gpu,
        "tokens_per_iteration": job.tokens_per_iteration(),
        "micro_batches": job.micro_batches(),
        "model_tflops_per_gpu": s.model_tflops_per_gpu,
        "hardware_tflops_per_gpu": s.hardware_tflops_per_gpu,
        "mfu": s.mfu,
        "mfu_causal": s.mfu_causal,
        "hfu": s.hfu,
        "gpu_speed_cv": job.cluster.gpu_speed_cv,
        "expected_iteration_time_s": s.expected_iteration_time_s,
        "expected_model_tflops_per_gpu": s.expected_model_tflops_per_gpu,
        "expected_mfu": s.expected_mfu,
        "peak_memory_bytes": s.peak_memory_bytes,
        "hbm_capacity_bytes": (job.cluster.gpu.hbm_gib * prism_core::units::GIB).round() as u64,
        "memory_fits": s.peak_memory_bytes as f64 <= job.cluster.gpu.hbm_gib * prism_core::units::GIB,
        "stage_memory_bytes": s.stage_memory_bytes,
        "bubble_fraction": s.bubble_fraction,
        "breakdown": breakdown_json(&s.breakdown),
        "model_flops": s.model_flops,
        "hardware_flops": s.hardware_flops,
        "graph_ops": s.graph_ops,
        "programs": s.programs,
        "events": result.events,
        "ranks_simulated": result.ranks.len(),
        "model": job.model.name,
        "model_params": job.model.params(),
        "model_active_params": job.model.active_params(),
        "model_active_params_without_input_embedding": job.model.active_params_without_input_embedding(),
        "cluster": job.cluster.name,
        "gpu": job.cluster.gpu.name,
        "parallel": {
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "dp": p.dp,
            "vpp": p.vpp,
            "pipeline_layout": p.pipeline_layout.as_ref().map(|l| l.text.clone()),
            "stage_layers": job.stage_layers(),
            "deallocate_stage_input": p.deallocate_stage_input,
            "micro_batch": p.micro_batch,
            "schedule": schedule_name(p.schedule),
            "recompute": recompute_name(p.recompute),
            "sequence_parallel": p.sequence_parallel,
            "distributed_optimizer": p.distributed_optimizer,
            "zero_stage": p.zero_stage,
            "order": p.order.name(),
            "stack": job.training.stack.name(),
            "global_batch": job.training.global_batch,
            "precision": job.training.precision.name(),
        },
    });
    // Gradient accumulation over whole schedules and DeepEP's dispatch, listed only when set
    // (the default output is as before).
    if p.pipeline_rounds > 1 {
        v["parallel"]["pipeline_rounds"] = json!(p.pipeline_rounds);
    }
    if p.moe_dispatcher == prism_core::job::MoeDispatcher::DeepEp {
        v["parallel"]["moe_dispatcher"] = json!("deepep");
    }
    // How context-parallel attention exchanges its tensors, for jobs with context parallelism.
    if p.cp > 1 {
        v["parallel"]["cp_comm_type"] = json!(p.cp_comm_type.name());
    }
    // How the interleaved schedule's pipeline messages overlap, in Megatron's two flags.
    if p.schedule == prism_core::job::Schedule::Interleaved {
        use prism_core::job::PipelineP2p;
        v["parallel"]["overlap_p2p_comm"] = json!(p.pipeline_p2p != PipelineP2p::Blocking);
        v["parallel"]["overlap_p2p_comm_warmup_flush"] =
            json!(p.pipeline_p2p == PipelineP2p::Async);
    }
    // ZeRO-3's gather and reduce rhythm, listed for ZeRO-3 jobs only.
    if p.shards_params() {
        v["parallel"]["reshard_after_forward"] = json!(p.reshard_after_forward);
        v["parallel"]["zero3_grad_sync"] = json!(p.zero3_grad_sync.name());
    }
    // DeepSeek-V3's memory savings, listed only when one is on (the default output is as
    // before).
    let ms = &job.training.memory_saving;
    if *ms != prism_core::job::MemorySaving::default() {
        v["parallel"]["recompute_norm_upproj"] = json!(ms.recompute_norm_upproj);
        v["parallel"]["activation_cache"] = json!(match ms.activation_cache {
            prism_core::job::ActivationCache::Bf16 => "bf16",
            prism_core::job::ActivationCache::Fp8 => "fp8",
        });
        v["parallel"]["optimizer_state_dtype"] = json!(match ms.optimizer_state {
            prism_core::job::OptimizerStateDtype::Fp32 => "fp32",
            prism_core::job::OptimizerStateDtype::Bf16 => "bf16",
        });
    }
    // A BF16 model without FP32 master weights, listed only then.
    if !job.training.master_weights {
        v["parallel"]["master_weights"] = json!(false);
    }
    // FP32 master weights kept as their low halves beside the BF16 weights, listed only then.
    if job.training.master_weight_remainders {
        v["parallel"]["master_weight_remainders"] = json!(true);
    }
    // FP8 weight gathers, listed only when on.
    if job.parallel.fp8_param_gather {
        v["parallel"]["fp8_param_gather"] = json!(true);
    }
    if result.ranks.len() <= MAX_LISTED_RANKS {
        let layout = &result.graph.layout;
        let ranks: Vec<Value> = result.ranks.iter().map(|r| rank_json(r, layout)).collect();
        v["ranks"] = Value::Array(ranks);
    }
    v
}

/// One published figure beside Prism's value of the same quantity.
#[derive(Clone, Debug, PartialEq)]
pub struct PublishedRow {
    /// JSON key of the figure (`tflops_per_gpu`, `mfu`, `iteration_time_s`).
    pub key: &'static str,
    /// The published value.
    pub published: f64,
    /// Prism's nominal value.
    pub predicted: f64,
    /// Prism's value at the expected iteration time with stragglers.
    pub predicted_expected: f64,
    /// Signed error of the nominal value, percent (positive: Prism predicts a faster run).
    pub error_pct: f64,
    /// Signed error of the value with stragglers, percent.
    pub error_expected_pct: f64,
}

/// The figures of a `[published]` section that are given, each against the prediction.
pub fn published_rows(
    p: &crate::jobfile::Published,
    s: &prism_core::report::Summary,
) -> Vec<PublishedRow> {
    // Prism's model FLOPs in the figure's convention: the causal count is the full one times
    // `mfu_causal / mfu` (the same FLOPs over the same time and peak).
    let conv = match p.attention_flops {
        crate::jobfile::AttentionFlops::Full => 1.0,
        crate::jobfile::AttentionFlops::Causal if s.mfu > 0.0 => s.mfu_causal / s.mfu,
        crate::jobfile::AttentionFlops::Causal => 1.0,
    };
    // (key, published, nominal, expected, a higher value means a faster run)
    let figures = [
        (
            "tflops_per_gpu",
            p.tflops_per_gpu,
            s.model_tflops_per_gpu * conv,
            s.expected_model_tflops_per_gpu * conv,
            true,
        ),
        ("mfu", p.mfu, s.mfu * conv, s.expected_mfu * conv, true),
        (
            "iteration_time_s",
            p.iteration_time_s,
            s.iteration_time_s,
            s.expected_iteration_time_s,
            false,
        ),
    ];
    figures
        .into_iter()
        .filter_map(
            |(key, published, predicted, predicted_expected, higher_is_faster)| {
                let x = published?;
                let err = |y: f64| {
                    let e = 100.0 * (y - x) / x;
                    if higher_is_faster { e } else { -e }
                };
                Some(PublishedRow {
                    key,
                    published: x,
                    predicted,
                    predicted_expected,
                    error_pct: err(predicted),
                    error_expected_pct: err(predicted_expected),
                })
            },
        )
        .collect()
}

/// The `[published]` section of a job beside the prediction: `source`, and per given figure
/// the fields of a [`PublishedRow`].
pub fn published_json(p: &crate::jobfile::Published, s: &prism_core::report::Summary) -> Value {
    let mut v = json!({ "source": p.source, "attention_flops": p.attention_flops.name() });
    for r in published_rows(p, s) {
        v[r.key] = json!({
            "published": r.published,
            "predicted": r.predicted,
            "predicted_expected": r.predicted_expected,
            "error_pct": r.error_pct,
            "error_expected_pct": r.error_expected_pct,
        });
    }
    v
}
