//! Context parallelism in Transformer Engine's all-to-all form (`parallel.cp_comm_type =
//! "a2a"`, Ulysses-style) against its definition (`AttnFuncWithCPAndQKVOA2A` and
//! `flash_attn_a2a_communicate`): the exchanges and their bytes, one kernel over the whole
//! sequence on `1 / cp` of the heads, the causal work conserved exactly, the exchanges exposed
//! as nothing overlaps them, local windows applied as on one rank, and the job rules (the
//! agreement of the reduced and full runs is checked with the ring's in `cp_ring.rs`).

mod common;

use common::{Step, attention_steps, kernels};
use prism_core::cost::comm::Collective;
use prism_core::graph::{ExecutionGraph, OpKind, Phase};
use prism_core::job::fixtures::small_job;
use prism_core::job::{CpCommType, Job};
use prism_core::layout::GroupKind;
use prism_core::ops::Work;
use prism_core::{SimOptions, simulate};

/// Llama-like layers (16 query heads of 64, 8 key/value heads) on `nodes` nodes of 8 GPUs:
/// TP `tp`, CP `cp`, a sequence of `seq` tokens, the rest data parallel.
fn cp_job(nodes: u32, tp: u32, seq: u32, cp: u32, kind: CpCommType) -> Job {
    let mut job = small_job(nodes, tp, 1, 16);
    job.model.seq_len = seq;
    job.model.layers = 4;
    job.model.kv_heads = 8;
    job.parallel.cp = cp;
    job.parallel.dp /= cp;
    job.parallel.cp_comm_type = kind;
    job.validate().expect("valid test job");
    job
}

/// The attention-related ops of layer 0, micro-batch 0, of `phase`, in program order.
fn layer0(g: &ExecutionGraph, phase: Phase) -> Vec<Step> {
    attention_steps(g, 0, phase)
}

/// Truth: `AttnFuncWithCPAndQKVOA2A`. With `t = s / cp` tokens per rank, `q` and `kv` the
/// rank's query and key/value widths and 2-byte activations: forward packs, exchanges (an
/// all-to-all of what a rank holds, `t (q + 2 kv) x 2` bytes) and unpacks the queries, keys
/// and values, runs one causal kernel over the whole sequence on `heads / (tp cp)` heads, and
/// exchanges its output (`t q x 2`) likewise; backward exchanges the output and its gradient
/// (`2 t q x 2`) before the kernel and the three gradients (`t (q + 2 kv) x 2`) after it. Each
/// pack and unpack reads and writes what it moves.
#[test]
fn a2a_exchanges_and_kernel_follow_transformer_engine() {
    for (tp, cp) in [(1u32, 2u32), (2, 4), (1, 4)] {
        let seq = 4096;
        let job = cp_job(2, tp, seq, cp, CpCommType::A2a);
        let g = ExecutionGraph::build(&job);
        let t = (seq / cp) as u64;
        let head_dim = job.model.head_dim as u64;
        let q = (job.model.heads / tp) as u64 * head_dim;
        let kv = (job.model.kv_heads / tp) as u64 * head_dim;
        let qkv = t * (q + 2 * kv) * 2;
        let out = t * q * 2;
        for (phase, backward) in [(Phase::Forward, false), (Phase::Backward, true)] {
            let (before, after) = if backward { (2 * out, qkv) } else { (qkv, out) };
            let (pack, unpack) = if backward {
                ("cp_a2a_pack_bwd", "cp_a2a_unpack_bwd")
            } else {
                ("cp_a2a_pack_fwd", "cp_a2a_unpack_fwd")
            };
            let kernel = Work::Attention {
                batch: 1,
                heads: (job.model.heads / tp / cp) as u64,
                seq_q: seq as u64,
                seq_kv: seq as u64,
                head_dim,
                causal: true,
                window: 0,
                backward,
            };
            let want = vec![
                Step::Pass(pack, 2 * before),
                Step::Exchange(Collective::AllToAll, before),
                Step::Pass(unpack, 2 * before),
                Step::Kernel(kernel),
                Step::Pass(pack, 2 * after),
                Step::Exchange(Collective::AllToAll, after),
                Step::Pass(unpack, 2 * after),
            ];
            assert_eq!(layer0(&g, phase), want, "{phase:?}, tp {tp} cp {cp}");
        }
    }
}

/// Truth: every rank computes the whole causal score matrix of `1 / cp` of the heads, so the
/// `cp` ranks' attention FLOPs sum to those of one rank without context parallelism exactly,
/// forward and backward (2.5 times forward), and the ring form's FLOPs are the same.
#[test]
fn a2a_conserves_the_causal_attention_work() {
    let seq = 8192u32;
    let flops = |g: &ExecutionGraph, phase| -> f64 {
        kernels(&layer0(g, phase)).iter().map(Work::flops).sum()
    };
    let one = ExecutionGraph::build(&cp_job(2, 1, seq, 1, CpCommType::A2a));
    let whole = flops(&one, Phase::Forward);
    assert!(whole > 0.0);
    for cp in [2u32, 4] {
        let a2a = ExecutionGraph::build(&cp_job(2, 1, seq, cp, CpCommType::A2a));
        let ring = ExecutionGraph::build(&cp_job(2, 1, seq, cp, CpCommType::P2p));
        let f = flops(&a2a, Phase::Forward) * cp as f64;
        let b = flops(&a2a, Phase::Backward) * cp as f64;
        assert!((f - whole).abs() <= 1e-9 * whole, "cp {cp}: {f} vs {whole}");
        assert!((b - 2.5 * whole).abs() <= 1e-9 * whole, "cp {cp} backward");
        let r = flops(&ring, Phase::Forward) * cp as f64;
        assert!((r - f).abs() <= 1e-9 * f, "cp {cp}: ring {r}, a2a {f}");
    }
}

/// Truth: nothing overlaps the exchanges (the kernel waits for its inputs' all-to-all, the
/// output projection for the output's), so with a CP group inside one node and no other
/// communication (TP 1, DP 1, PP 1) every all-to-all's time is exposed: the exposed CP time
/// equals the summed durations of rank 0's CP collectives. A free network removes it and
/// saves the job at least that time; spreading the CP group over two nodes (slower NICs
/// instead of NVLink) exposes more.
#[test]
fn a2a_exchanges_are_exposed() {
    let mut job = cp_job(1, 1, 16384, 8, CpCommType::A2a);
    job.training.global_batch = 2;
    job.validate().expect("valid");
    assert_eq!(job.parallel.dp, 1);
    let opts = SimOptions {
        record_ranks: vec![0],
        ..SimOptions::default()
    };
    let r = simulate(&job, &opts).expect("a2a");
    let prog = &r.graph.programs[0];
    let tl = r.timelines.iter().find(|t| t.rank == 0).expect("rank 0");
    let in_flight: f64 = tl
        .ops
        .iter()
        .filter(|o| {
            matches!(
                prog.kind[o.op as usize],
                OpKind::Collective {
                    group: GroupKind::Cp,
                    ..
                }
            )
        })
        .map(|o| (o.end - o.start) as f64 * 1e-12)
        .sum();
    let exposed = r.summary.breakdown.cp_s;
    assert!(in_flight > 0.0);
    assert!(
        (exposed - in_flight).abs() <= 1e-6 * in_flight + 1e-9,
        "exposed {exposed} s, in flight {in_flight} s"
    );
    let free = simulate(
        &job,
        &SimOptions {
            ideal_network: true,
            ..SimOptions::default()
        },
    )
    .expect("free");
    assert_eq!(free.summary.breakdown.cp_s, 0.0);
    // It also frees the gradients' reduction over the DP x CP group.
    let gap = r.summary.iteration_time_s - free.summary.iteration_time_s;
    assert!(
        gap >= in_flight * (1.0 - 1e-6),
        "a free network saves {gap} s, the exchanges take {in_flight} s"
    );
    // The same 8 CP ranks on two nodes of 4 GPUs: half of every all-to-all crosses NICs.
    let mut spread = job.clone();
    spread.cluster.gpus_per_node = 4;
    spread.cluster.nodes = 2;
    spread.validate().expect("valid");
    let s = simulate(&spread, &SimOptions::default()).expect("spread");
    assert!(
        s.summary.breakdown.cp_s > exposed,
        "across nodes {} s, inside one {} s",
        s.summary.breakdown.cp_s,
        exposed
    );
}

/// Truth: Transformer Engine asserts that a rank's query and key/value heads divide by the CP
/// size ("The number of attention heads needs to be divisible by CP size!"); the ring has no
/// such rule. The error names the key and both head counts.
#[test]
fn a2a_needs_the_heads_divisible_by_cp() {
    // 4 key/value heads over TP 2: 2 per rank, which CP 4 cannot split.
    let mut job = small_job(2, 2, 1, 16);
    job.model.kv_heads = 4;
    job.parallel.cp = 4;
    job.parallel.dp /= 4;
    job.parallel.cp_comm_type = CpCommType::P2p;
    job.validate().expect("the ring needs no head split");
    job.parallel.cp_comm_type = CpCommType::A2a;
    let err = job.validate().expect_err("2 heads over cp 4").to_string();
    assert!(err.contains("parallel.cp"), "{err}");
    assert!(err.contains("a2a") && err.contains("8 and 2"), "{err}");
}

/// Truth: with the whole sequence on each rank, a sliding window applies as without context
/// parallelism (`AttnFuncWithCPAndQKVOA2A` passes `window_size` to the kernel; Transformer
/// Engine allows sliding windows with `a2a` and `all_gather` only): the kernel of a local
/// layer is the single-rank kernel with the window on `1 / cp` of the heads, global layers
/// keep the causal kernel, and the ring form is refused with a message that names `a2a`.
#[test]
fn a2a_applies_local_windows_as_one_rank_does() {
    let windowed = |kind| {
        let mut job = small_job(2, 1, 1, 16);
        job.model.seq_len = 8192;
        job.model.layers = 4;
        job.model.arch.attention_window = 1024;
        job.model.arch.attention_global_every = 2;
        job.parallel.cp = 4;
        job.parallel.dp /= 4;
        job.parallel.cp_comm_type = kind;
        job
    };
    let ring = windowed(CpCommType::P2p);
    let err = ring.validate().expect_err("ring over windows").to_string();
    assert!(err.contains("parallel.cp") && err.contains("a2a"), "{err}");
    // Unfused attention gathers under every form, without the window.
    let mut unfused = windowed(CpCommType::A2a);
    unfused.training.flash_attention = false;
    let err = unfused
        .validate()
        .expect_err("unfused over windows")
        .to_string();
    assert!(err.contains("fused attention"), "{err}");
    let job = windowed(CpCommType::A2a);
    job.validate().expect("a2a over windows");
    let g = ExecutionGraph::build(&job);
    for layer in 0..4u32 {
        let kernels = kernels(&attention_steps(&g, layer, Phase::Forward));
        let window = if layer % 2 == 0 { 1024 } else { 0 };
        assert_eq!(
            kernels,
            vec![Work::Attention {
                batch: 1,
                heads: 4,
                seq_q: 8192,
                seq_kv: 8192,
                head_dim: 64,
                causal: true,
                window,
                backward: false,
            }],
            "layer {layer}"
        );
    }
}
