//! The FP8 cast kernels of a Transformer Engine layer against hand-computed byte counts: the
//! activation and gradient casts every micro-batch runs, and the weight casts that Megatron-Core's
//! first-micro-batch flag lets Transformer Engine run once per iteration
//! (`Training::fp8_weight_cache`).

use prism_core::cost::comm::Collective;
use prism_core::graph::{ExecutionGraph, OpKind, Phase};
use prism_core::job::fixtures::small_job;
use prism_core::job::{Job, Precision, Recompute};
use prism_core::layout::GroupKind;
use prism_core::ops::Work;
use prism_core::{SimOptions, simulate};

/// GPT-small (8 layers, h 1024, FFN 4096, 16 heads of 64, GeLU) on 8 H100s, tp 2, pp 2, dp 2:
/// 32 micro-batches of one 2,048-token sequence, FP8 GEMMs.
fn fp8_job(cache: bool, recompute: Recompute) -> Job {
    let mut job = small_job(1, 2, 2, 64);
    job.training.precision = Precision::Fp8;
    job.training.fp8_weight_cache = cache;
    job.parallel.recompute = recompute;
    common::valid_with(job, 32)
}

mod common;

/// Memory bytes of the compute ops called `name`, summed per program (pipeline stage).
fn cast_bytes(g: &ExecutionGraph, name: &str) -> Vec<u64> {
    common::memory_bytes_per_program(g, name)
}

/// Truth, per stage of 4 layers, with W the layer's weights on one GPU (`layer_params / tp`)
/// and t = 2,048 tokens per micro-batch (gathered from the sequence-parallel shards):
/// * forward casts the inputs of the out-projection (h / tp wide) and FC2 (f / tp), the two
///   GEMM inputs that the norm and activation kernels do not emit in FP8: read 2, write 1;
/// * backward casts and transposes the output gradients of QKV (3h / tp), out-projection (h),
///   FC1 (f / tp) and FC2 (h): read 2, write 1 twice;
/// * with the cache the weights are cast and transposed once per iteration (read 2, write
///   1 + 1: 4 W); without it 3 W in every forward and 3 W again in every backward.
#[test]
fn fp8_weight_casts_follow_the_cache() {
    let job = fp8_job(true, Recompute::None);
    let (tp, m, layers) = (2u64, 32u64, 4u64);
    let (h, f) = (1024u64, 4096u64);
    let t = 2048u64;
    let w = job.model.layer_params() / tp;
    let act_fwd = 3 * t * (h / tp + f / tp);
    // Output gradients cast in backward: QKV (3 h / tp wide), out-projection (h), FC1 (f / tp),
    // FC2 (h).
    let act_bwd = 4 * t * (3 * h / tp + h + f / tp + h);

    let cached = ExecutionGraph::build(&job);
    let uncached = ExecutionGraph::build(&fp8_job(false, Recompute::None));
    for stage in 0..2 {
        assert_eq!(
            cast_bytes(&cached, "fp8_cast_fwd")[stage],
            layers * (4 * w + m * act_fwd),
            "stage {stage}, cached forward"
        );
        assert_eq!(
            cast_bytes(&cached, "fp8_cast_transpose_bwd")[stage],
            layers * m * act_bwd,
            "stage {stage}, cached backward"
        );
        assert_eq!(
            cast_bytes(&uncached, "fp8_cast_fwd")[stage],
            layers * m * (3 * w + act_fwd),
            "stage {stage}, uncached forward"
        );
        assert_eq!(
            cast_bytes(&uncached, "fp8_cast_transpose_bwd")[stage],
            layers * m * (3 * w + act_bwd),
            "stage {stage}, uncached backward"
        );
    }
    // The one weight cast of each layer is on micro-batch 0's forward.
    for p in &cached.programs {
        for (i, k) in p.kind.iter().enumerate() {
            if let OpKind::Compute(op) = k
                && op.name == "fp8_cast_fwd"
            {
                let Work::Memory { bytes } = op.work else {
                    unreachable!()
                };
                let first = p.tag[i].micro_batch == 0 && p.tag[i].phase == Phase::Forward;
                assert_eq!(bytes, act_fwd + if first { 4 * w } else { 0 });
            }
        }
    }

    // A recomputed forward reuses the cached weights: full recompute adds one more activation
    // cast per micro-batch and layer and no weight cast.
    let rec = ExecutionGraph::build(&fp8_job(true, Recompute::Full));
    for stage in 0..2 {
        assert_eq!(
            cast_bytes(&rec, "fp8_cast_fwd")[stage],
            layers * (4 * w + 2 * m * act_fwd),
            "stage {stage}, cached forward with full recompute"
        );
    }

    // Less memory traffic, a shorter iteration; BF16 runs no cast at all.
    let time = |j: &Job| {
        simulate(j, &SimOptions::default())
            .expect("simulates")
            .summary
            .iteration_time_s
    };
    let (t_cached, t_uncached) = (time(&job), time(&fp8_job(false, Recompute::None)));
    assert!(t_cached < t_uncached, "{t_cached} vs {t_uncached}");
    let mut bf16 = job.clone();
    bf16.training.precision = Precision::Bf16;
    let g = ExecutionGraph::build(&bf16);
    assert!(cast_bytes(&g, "fp8_cast_fwd").iter().all(|&b| b == 0));
    assert!(
        cast_bytes(&g, "fp8_cast_transpose_bwd")
            .iter()
            .all(|&b| b == 0)
    );
}

/// Bytes of every TP collective of `op` in the graph, in program order.
fn tp_bytes(g: &ExecutionGraph, op: Collective) -> Vec<u64> {
    g.programs
        .iter()
        .flat_map(|p| p.kind.iter())
        .filter_map(|k| match *k {
            OpKind::Collective {
                group: GroupKind::Tp,
                op: o,
                bytes,
            } if o == op => Some(bytes),
            _ => None,
        })
        .collect()
}

/// Truth: with sequence parallelism an FP8 layer gathers its GEMM inputs in FP8 (Transformer
/// Engine's norm kernels emit FP8 and the gather moves that tensor; backward casts the output
/// gradient to FP8 before gathering it), so every TP all-gather of a transformer layer moves
/// half the bytes of the BF16 job's, the LM head's input (a BF16 GEMM) excepted; the
/// reduce-scatters of GEMM outputs stay BF16, byte for byte.
#[test]
fn fp8_sequence_parallel_gathers_move_one_byte_per_element() {
    let f8 = fp8_job(true, Recompute::None);
    let mut bf = f8.clone();
    bf.training.precision = Precision::Bf16;
    let (g8, g16) = (ExecutionGraph::build(&f8), ExecutionGraph::build(&bf));
    let (ag8, ag16) = (
        tp_bytes(&g8, Collective::AllGather),
        tp_bytes(&g16, Collective::AllGather),
    );
    assert_eq!(ag8.len(), ag16.len());
    let t_h = 2048 * 1024u64;
    let (mut halved, mut whole) = (0, 0);
    for (a, b) in ag8.iter().zip(&ag16) {
        assert_eq!(*b, 2 * t_h, "BF16 gathers move 2 bytes per element");
        if *a == t_h {
            halved += 1;
        } else {
            assert_eq!(a, b);
            whole += 1;
        }
    }
    // Per micro-batch and layer: QKV and FC1 inputs forward, the same two again for their
    // weight gradients, and the out-projection's and FC2's output gradients: 6 halved. The
    // LM head's input (forward) and the embedding gradient (backward) stay BF16: 2 per
    // micro-batch on the last and first stage.
    let (m, layers) = (32, 8);
    assert_eq!(halved, 6 * m * layers);
    assert_eq!(whole, 2 * m);
    assert_eq!(
        tp_bytes(&g8, Collective::ReduceScatter),
        tp_bytes(&g16, Collective::ReduceScatter)
    );
}
