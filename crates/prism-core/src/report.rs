//! The numbers a simulation reports: iteration time, throughput, utilisation, memory and where
//! the time went. Plain values; `prism-io` turns them into JSON and text.

use crate::graph::{ExecutionGraph, OpKind};
use crate::job::Job;
use crate::ops::{Work, causal_fraction};

/// Where one rank's iteration time went, seconds. The parts add up to the iteration time:
/// every instant the compute stream is idle is charged to what it waited for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Breakdown {
    /// Kernels running.
    pub compute_s: f64,
    /// Waiting for tensor-parallel collectives.
    pub tp_s: f64,
    /// Waiting for context-parallel collectives.
    pub cp_s: f64,
    /// Waiting for expert-parallel all-to-alls.
    pub ep_s: f64,
    /// Waiting for pipeline transfers (the transfer time itself).
    pub pp_s: f64,
    /// Waiting for data-parallel gradient/parameter collectives.
    pub dp_s: f64,
    /// Pipeline bubble: waiting for other stages' compute (and for the slowest rank at the end).
    pub bubble_s: f64,
}

impl Breakdown {
    /// Sum of all parts.
    pub fn total(&self) -> f64 {
        self.compute_s + self.tp_s + self.cp_s + self.ep_s + self.pp_s + self.dp_s + self.bubble_s
    }

    /// Adds `o` part by part.
    pub fn add(&mut self, o: &Breakdown) {
        self.compute_s += o.compute_s;
        self.tp_s += o.tp_s;
        self.cp_s += o.cp_s;
        self.ep_s += o.ep_s;
        self.pp_s += o.pp_s;
        self.dp_s += o.dp_s;
        self.bubble_s += o.bubble_s;
    }

    /// Multiplies every part by `f`.
    pub fn scale(&mut self, f: f64) {
        self.compute_s *= f;
        self.tp_s *= f;
        self.cp_s *= f;
        self.ep_s *= f;
        self.pp_s *= f;
        self.dp_s *= f;
        self.bubble_s *= f;
    }

    /// (name, seconds) pairs in display order.
    pub fn parts(&self) -> [(&'static str, f64); 7] {
        [
            ("compute", self.compute_s),
            ("exposed_tp", self.tp_s),
            ("exposed_cp", self.cp_s),
            ("exposed_ep", self.ep_s),
            ("exposed_pp", self.pp_s),
            ("exposed_dp", self.dp_s),
            ("bubble", self.bubble_s),
        ]
    }
}

/// Timing of one simulated rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankTiming {
    /// Rank.
    pub rank: u32,
    /// When its last op ended, seconds from iteration start.
    pub finish_s: f64,
    /// Kernel time.
    pub compute_s: f64,
    /// GEMM kernel time.
    pub gemm_s: f64,
    /// Where its time went (sums to the iteration time).
    pub breakdown: Breakdown,
}

/// Headline results of one simulated iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Job name.
    pub name: String,
    /// GPUs.
    pub num_gpus: u64,
    /// Iteration time, seconds.
    pub iteration_time_s: f64,
    /// Tokens per second, whole job.
    pub tokens_per_s: f64,
    /// Model FLOP/s per GPU, in TFLOP/s (no recompute; attention included).
    pub model_tflops_per_gpu: f64,
    /// Hardware FLOP/s per GPU, in TFLOP/s (recompute included).
    pub hardware_tflops_per_gpu: f64,
    /// Model FLOPs utilisation against the dense peak of the job's precision, Megatron's and
    /// PaLM's convention: causal attention counted in full ([`crate::flops`]).
    pub mfu: f64,
    /// Model FLOPs utilisation counting only the unmasked half of causal attention
    /// ([`crate::flops::model_flops_per_iteration_causal`]; FlashAttention's and torchtitan's
    /// convention).
    pub mfu_causal: f64,
    /// Hardware FLOPs utilisation.
    pub hfu: f64,
    /// Expected iteration time with stragglers: every GPU has its own persistent speed
    /// (`cluster.gpu_speed_cv`) and the slowest of them sets each synchronisation
    /// ([`crate::straggler`]). Equal to `iteration_time_s` when the spread is 0.
    pub expected_iteration_time_s: f64,
    /// Model TFLOP/s per GPU at the expected iteration time.
    pub expected_model_tflops_per_gpu: f64,
    /// MFU at the expected iteration time.
    pub expected_mfu: f64,
    /// Peak memory of the worst pipeline stage, bytes.
    pub peak_memory_bytes: u64,
    /// Peak memory per pipeline stage, bytes.
    pub stage_memory_bytes: Vec<u64>,
    /// Mean share of the iteration ranks spend in the pipeline bubble.
    pub bubble_fraction: f64,
    /// Mean per-rank breakdown, seconds.
    pub breakdown: Breakdown,
    /// Model FLOPs per iteration.
    pub model_flops: f64,
    /// Hardware FLOPs per iteration.
    pub hardware_flops: f64,
    /// Ops in the execution graph (summed over all ranks).
    pub graph_ops: u64,
    /// Distinct programs (symmetry classes).
    pub programs: usize,
}

impl Summary {
    /// Builds the summary of a run that took `iteration_time_s`.
    pub fn new(
        job: &Job,
        iteration_time_s: f64,
        breakdown: Breakdown,
        stage_memory_bytes: Vec<u64>,
        graph: &ExecutionGraph,
    ) -> Self {
        let n = job.num_gpus() as f64;
        let model_flops = crate::flops::model_flops_per_iteration(job);
        let hardware_flops = crate::flops::hardware_flops_per_iteration(job);
        let t = iteration_time_s.max(f64::MIN_POSITIVE);
        let peak = job.peak_flops();
        let per_stage = graph.layout.stage_size() as u64;
        let expected = crate::straggler::expected_iteration_time(
            iteration_time_s,
            breakdown.compute_s,
            job.num_gpus(),
            job.cluster.gpu_speed_cv,
        );
        let te = expected.max(f64::MIN_POSITIVE);
        Summary {
            name: job.name.clone(),
            num_gpus: job.num_gpus(),
            iteration_time_s,
            tokens_per_s: job.tokens_per_iteration() as f64 / t,
            model_tflops_per_gpu: model_flops / t / n / 1e12,
            hardware_tflops_per_gpu: hardware_flops / t / n / 1e12,
            mfu: model_flops / t / n / peak,
            mfu_causal: crate::flops::model_flops_per_iteration_causal(job) / t / n / peak,
            hfu: hardware_flops / t / n / peak,
            expected_iteration_time_s: expected,
            expected_model_tflops_per_gpu: model_flops / te / n / 1e12,
            expected_mfu: model_flops / te / n / peak,
            peak_memory_bytes: stage_memory_bytes.iter().copied().max().unwrap_or(0),
            stage_memory_bytes,
            bubble_fraction: breakdown.bubble_s / t,
            breakdown,
            model_flops,
            hardware_flops,
            graph_ops: graph
                .programs
                .iter()
                .map(|p| p.len() as u64 * per_stage)
                .sum(),
            programs: graph.programs.len(),
        }
    }
}

/// FLOPs the execution graph performs in one iteration, summed over every rank, counting
/// attention scores without the causal discount (the convention of MFU formulas) and
/// optionally excluding recomputed work. An independent check on [`crate::flops`].
pub fn graph_flops(graph: &ExecutionGraph, include_recompute: bool) -> f64 {
    let per_stage = graph.layout.stage_size() as f64;
    let mut total = 0.0;
    for p in &graph.programs {
        let mut prog = 0.0;
        for k in &p.kind {
            if let OpKind::Compute(op) = k {
                if op.recompute && !include_recompute {
                    continue;
                }
                let f = op.work.flops();
                prog += match op.work {
                    Work::Attention {
                        seq_q,
                        causal: true,
                        window: w @ 1..,
                        ..
                    } => {
                        // A local layer counts `s min(w, s)` pairs unmasked (crate::flops).
                        let s = seq_q as f64;
                        f * s * w.min(seq_q) as f64
                            / (s * s * crate::ops::window_fraction(seq_q, w))
                    }
                    Work::Attention {
                        seq_q,
                        seq_kv,
                        causal: true,
                        ..
                    } => f / causal_fraction(seq_q, seq_kv),
                    Work::Attention {
                        causal: false,
                        seq_q,
                        seq_kv,
                        ..
                    } if seq_kv < seq_q * graph.layout.cp as u64 => {
                        // Context parallel: s/cp queries against s/2 keys stands for half of s/cp x s.
                        f * 2.0
                    }
                    _ => f,
                };
            }
        }
        total += prog * per_stage;
    }
    total
}
