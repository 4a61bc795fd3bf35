//! Context parallelism as Transformer Engine's P2P ring (`parallel.cp_comm_type = "p2p"`)
//! against its definition: the steps, shapes and bytes of `AttnFuncWithCPAndKVP2P`, the causal
//! attention work conserved exactly, the exchanges hidden under the attention they overlap, and
//! the gathered alternative kept.

mod common;

use common::{attention_steps, exchanges, kernels};
use prism_core::cost::comm::Collective;
use prism_core::graph::{ExecutionGraph, Phase};
use prism_core::job::fixtures::small_job;
use prism_core::job::{CpCommType, Job};
use prism_core::ops::Work;
use prism_core::{SimOptions, simulate};

/// Llama-like layers on 2 nodes: TP 2 and CP 4 over 8 GPUs per node, 16 heads of 64, a
/// sequence of `seq` tokens.
fn cp_job(seq: u32, cp: u32, kind: CpCommType) -> Job {
    let mut job = small_job(2, 2, 1, 16);
    job.model.seq_len = seq;
    job.model.layers = 4;
    job.parallel.cp = cp;
    job.parallel.dp /= cp;
    job.parallel.cp_comm_type = kind;
    job.validate().expect("valid test job");
    job
}

/// The attention kernels and CP exchanges of layer 0, micro-batch 0, in program order.
fn layer0(g: &ExecutionGraph, phase: Phase) -> (Vec<Work>, Vec<(Collective, u64)>) {
    let steps = attention_steps(g, 0, phase);
    (kernels(&steps), exchanges(&steps))
}

/// Truth: `AttnFuncWithCPAndKVP2P` (Transformer Engine) with `c = s / (2 cp)`: forward runs `cp`
/// kernels, the causal `2c x 2c` diagonal of the rank's own chunks first and then `cp - 1`
/// unmasked `2c x c` blocks, beside `cp - 1` ring exchanges of its keys and values
/// (`2c x 2 x kv_width x 2 B` per micro-sequence); backward runs as many kernels beside `cp`
/// exchanges: keys and values first, then keys, values and their gradients, the last only the
/// gradients.
#[test]
fn ring_steps_shapes_and_bytes_follow_transformer_engine() {
    for cp in [2u32, 4] {
        let seq = 4096;
        let job = cp_job(seq, cp, CpCommType::P2p);
        let g = ExecutionGraph::build(&job);
        let c = (seq / (2 * cp)) as u64;
        let heads = (job.model.heads / job.parallel.tp) as u64;
        let kv_width = (job.model.kv_heads / job.parallel.tp) as u64 * job.model.head_dim as u64;
        let kv = 2 * c * 2 * kv_width * 2;
        for (phase, backward) in [(Phase::Forward, false), (Phase::Backward, true)] {
            let (attn, xch) = layer0(&g, phase);
            assert_eq!(attn.len(), cp as usize, "{phase:?} kernels, cp {cp}");
            for (i, w) in attn.iter().enumerate() {
                let want = Work::Attention {
                    batch: 1,
                    heads,
                    seq_q: 2 * c,
                    seq_kv: if i == 0 { 2 * c } else { c },
                    head_dim: job.model.head_dim as u64,
                    causal: i == 0,
                    window: 0,
                    backward,
                };
                assert_eq!(*w, want, "{phase:?} step {i}, cp {cp}");
            }
            let want: Vec<(Collective, u64)> = if backward {
                (0..cp)
                    .map(|i| {
                        let b = if i == 0 || i + 1 == cp { kv } else { 2 * kv };
                        (Collective::RingExchange, b)
                    })
                    .collect()
            } else {
                (1..cp).map(|_| (Collective::RingExchange, kv)).collect()
            };
            assert_eq!(xch, want, "{phase:?} exchanges, cp {cp}");
        }
    }
}

/// Truth: the ring computes each query against exactly the keys a causal mask lets it see, so
/// the attention FLOPs of the `cp` ranks sum to those of the whole causal sequence on one rank,
/// `s (s + 1) / 2` score entries per head (the diagonal included), exactly.
#[test]
fn ring_conserves_the_causal_attention_work() {
    let seq = 8192u64;
    let one = cp_job(seq as u32, 1, CpCommType::P2p);
    let g1 = ExecutionGraph::build(&one);
    let (a1, _) = layer0(&g1, Phase::Forward);
    let whole: f64 = a1.iter().map(Work::flops).sum();
    let heads = (one.model.heads / one.parallel.tp) as f64;
    let exact = 4.0 * heads * (seq * (seq + 1) / 2) as f64 * one.model.head_dim as f64;
    assert!((whole - exact).abs() <= 1e-9 * exact, "{whole} vs {exact}");
    for cp in [2u32, 4, 8] {
        let g = ExecutionGraph::build(&cp_job(seq as u32, cp, CpCommType::P2p));
        let (fwd, _) = layer0(&g, Phase::Forward);
        let (bwd, _) = layer0(&g, Phase::Backward);
        let f: f64 = fwd.iter().map(Work::flops).sum::<f64>() * cp as f64;
        let b: f64 = bwd.iter().map(Work::flops).sum::<f64>() * cp as f64;
        assert!((f - whole).abs() <= 1e-9 * whole, "cp {cp}: {f} vs {whole}");
        assert!((b - 2.5 * whole).abs() <= 1e-9 * whole, "cp {cp} backward");
    }
}

/// Truth: with long sequences each ring step's attention outlasts its exchange, so the ring
/// exposes (almost) no CP communication, while gathering the keys and values up front exposes
/// all of it; across nodes (TP 8 fills a node, so the CP group spans 4 nodes and every
/// exchange crosses a NIC) that makes the ring the faster of the two. The all-gather job's
/// graph is the one Prism built before the ring.
#[test]
fn ring_hides_its_exchanges_under_the_attention() {
    let seq = 32768;
    let across = |kind| {
        // 70B-like attention: 64 query heads and 8 KV heads of 128, 8 and 1 per GPU.
        let mut job = small_job(4, 8, 1, 16);
        job.model.hidden = 8192;
        job.model.ffn_hidden = 16384;
        job.model.heads = 64;
        job.model.kv_heads = 8;
        job.model.head_dim = 128;
        job.model.seq_len = seq;
        job.model.layers = 4;
        job.parallel.cp = 4;
        job.parallel.dp /= 4;
        job.parallel.cp_comm_type = kind;
        job.validate().expect("valid test job");
        job
    };
    let ring = across(CpCommType::P2p);
    let gather = across(CpCommType::AllGather);
    let r = simulate(&ring, &SimOptions::default()).expect("ring");
    let a = simulate(&gather, &SimOptions::default()).expect("gather");
    let rs = &r.summary;
    let gs = &a.summary;
    assert!(
        rs.breakdown.cp_s < 0.01 * rs.iteration_time_s,
        "ring exposes {} s of {} s",
        rs.breakdown.cp_s,
        rs.iteration_time_s
    );
    assert!(gs.breakdown.cp_s > 0.0, "gathering exposes its collectives");
    assert!(
        rs.iteration_time_s < gs.iteration_time_s,
        "ring {} s, gather {} s",
        rs.iteration_time_s,
        gs.iteration_time_s
    );
    // The gathered job keeps one kernel over the gathered keys and one collective each way.
    let (fwd, xf) = layer0(&a.graph, Phase::Forward);
    let (_, xb) = layer0(&a.graph, Phase::Backward);
    assert_eq!(fwd.len(), 1);
    assert_eq!(xf.len(), 1);
    assert_eq!(xf[0].0, Collective::AllGather);
    assert_eq!(xb[0].0, Collective::ReduceScatter);
}

/// Truth: determinism, and the reduced and slice modes agree with the full run, for the ring
/// and for the all-to-all form.
#[test]
fn cp_runs_agree_across_modes() {
    for kind in [CpCommType::P2p, CpCommType::A2a] {
        let job = cp_job(8192, 4, kind);
        let full = simulate(&job, &SimOptions::default()).expect("full");
        let again = simulate(&job, &SimOptions::default()).expect("again");
        assert_eq!(
            full.summary.iteration_time_s.to_bits(),
            again.summary.iteration_time_s.to_bits(),
            "{kind:?}"
        );
        for mode in [
            prism_core::Mode::Reduced,
            prism_core::Mode::Slice(vec![3, 13]),
        ] {
            let part = simulate(
                &job,
                &SimOptions {
                    mode: mode.clone(),
                    ..SimOptions::default()
                },
            )
            .expect("reduced or slice");
            assert_eq!(
                full.summary.iteration_time_s.to_bits(),
                part.summary.iteration_time_s.to_bits(),
                "{kind:?}, {mode:?}"
            );
        }
    }
}
