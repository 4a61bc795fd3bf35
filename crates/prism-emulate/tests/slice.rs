//! Slicing: the graph stitched from one trace per class equals the graph of every rank traced;
//! instantiated class traces equal each rank's own; malformed traces are refused by name.

use prism_core::engine::{GraphOptions, Mode, simulate_graph};
use prism_core::job::Cluster;
use prism_emulate::graph_file::{ClusterSpec, LayoutSpec, SlicedGraph};
use prism_emulate::protocol::{Body, Op, write_frame};
use prism_emulate::slice::{self, RankTrace, instantiate};
use prism_emulate::synth::{self, SynthSpec};

fn cluster(gpus_per_node: u32, nodes: u32) -> Cluster {
    let mut job = prism_core::job::fixtures::small_job(nodes, 1, 1, 8);
    job.cluster.gpus_per_node = gpus_per_node;
    job.cluster.nodes = nodes;
    job.cluster
}

fn spec_cluster() -> ClusterSpec {
    ClusterSpec {
        preset: "dgx-h100".into(),
        set: vec![],
    }
}

fn all_traces(spec: &SynthSpec) -> Vec<RankTrace> {
    let n = spec.layout.world_size().unwrap();
    (0..n).map(|r| synth::trace(spec, r)).collect()
}

/// The highest rank of every stage: representatives that are not the stage's first rank, so
/// instantiation has to translate every group.
fn reps(spec: &SynthSpec) -> Vec<RankTrace> {
    let size = spec.layout.tp * spec.layout.dp;
    (0..spec.layout.pp)
        .map(|s| synth::trace(spec, (s + 1) * size - 1))
        .collect()
}

fn cases() -> Vec<(SynthSpec, Cluster)> {
    let even = SynthSpec::small(LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    });
    // Uneven: three stages of different depth, no tensor parallelism, 4 GPUs per node so the
    // DP groups cross nodes.
    let mut uneven = SynthSpec::small(LayoutSpec {
        tp: 1,
        pp: 3,
        dp: 2,
    });
    uneven.layers = vec![3, 1, 2];
    uneven.micro_batches = 5;
    let mut wide = SynthSpec::small(LayoutSpec {
        tp: 4,
        pp: 2,
        dp: 4,
    });
    wide.micro_batches = 3;
    vec![
        (even, cluster(8, 1)),
        (uneven, cluster(4, 2)),
        (wide, cluster(8, 4)),
    ]
}

#[test]
fn stitched_graph_equals_the_graph_of_every_rank_traced() {
    for (spec, cl) in cases() {
        let all = slice::slice(&all_traces(&spec), spec.layout, spec_cluster()).unwrap();
        let rep = slice::slice(&reps(&spec), spec.layout, spec_cluster()).unwrap();
        let g_all = all.graph(cl.gpus_per_node).unwrap();
        let g_rep = rep.graph(cl.gpus_per_node).unwrap();
        assert_eq!(g_all, g_rep, "{:?}", spec.layout);
        // Every rank's own trace is its class trace instantiated for it.
        for t in all_traces(&spec) {
            let got = instantiate(&rep, t.hello.rank).unwrap();
            assert_eq!(got.len(), t.calls.len());
            for (a, b) in got.iter().zip(&t.calls) {
                let strip = |c: &prism_emulate::protocol::Call| {
                    let mut c = c.clone();
                    c.compute_s = 0.0;
                    c
                };
                assert_eq!(strip(a), strip(b), "rank {} op {}", t.hello.rank, b.seq);
                assert_eq!(
                    slice::ps_from_secs(a.compute_s).unwrap(),
                    slice::ps_from_secs(b.compute_s).unwrap()
                );
            }
        }
        // Same simulated time: every rank simulated on either graph, and one instance per class.
        let full = GraphOptions::default();
        let reduced = GraphOptions {
            mode: Mode::Reduced,
            ..Default::default()
        };
        let t_all = simulate_graph(&g_all, &cl, &full, None).unwrap();
        let t_rep = simulate_graph(&g_rep, &cl, &full, None).unwrap();
        let t_red = simulate_graph(&g_rep, &cl, &reduced, None).unwrap();
        assert_eq!(t_all.iteration_ps, t_rep.iteration_ps);
        assert_eq!(t_all.iteration_ps, t_red.iteration_ps, "{:?}", spec.layout);
        // Every rank of a stage finishes when its representative does.
        for r in &t_all.ranks {
            let stage = r.rank / (spec.layout.tp * spec.layout.dp);
            let rr = t_red
                .ranks
                .iter()
                .find(|x| x.rank / (spec.layout.tp * spec.layout.dp) == stage);
            assert_eq!(r.finish_s, rr.unwrap().finish_s, "rank {}", r.rank);
        }
        // The iteration is longer than any stage's compute, which the graph keeps exactly.
        let st = slice::stats(&rep, &cl).unwrap();
        for c in &st.per_class {
            assert!(st.iteration_s >= c.compute_s - 1e-12, "{st:?}");
        }
        assert_eq!(st.iteration_s, t_red.iteration_ps as f64 * 1e-12);
    }
}

#[test]
fn one_stage_on_an_ideal_network_is_its_compute() {
    // Independent truth: without pipeline peers and with free communication, a rank only
    // computes, so the iteration is the sum of its recorded compute.
    let spec = SynthSpec::small(LayoutSpec {
        tp: 2,
        pp: 1,
        dp: 4,
    });
    let t = synth::trace(&spec, 0);
    let total_ps: u64 = t
        .calls
        .iter()
        .map(|c| slice::ps_from_secs(c.compute_s).unwrap())
        .sum::<u64>()
        + slice::ps_from_secs(t.bye.compute_s).unwrap();
    let g = slice::slice(&[t], spec.layout, spec_cluster())
        .unwrap()
        .graph(8)
        .unwrap();
    let opts = GraphOptions {
        ideal_network: true,
        ..Default::default()
    };
    let r = simulate_graph(&g, &cluster(8, 1), &opts, None).unwrap();
    assert_eq!(r.iteration_ps, total_ps);
}

#[test]
fn statistics_count_the_global_graph() {
    let spec = SynthSpec::small(LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    });
    let g = slice::slice(&reps(&spec), spec.layout, spec_cluster()).unwrap();
    let st = slice::stats(&g, &cluster(8, 1)).unwrap();
    assert_eq!((st.ranks, st.classes), (8, 2));
    // Count from the traces of every rank: each collective once per group, each send once.
    let all = all_traces(&spec);
    let mut coll = 0u64;
    let mut sends = 0u64;
    for t in &all {
        for c in &t.calls {
            match Op::try_from(c.op).unwrap() {
                Op::Send => sends += 1,
                Op::Recv => {}
                // Counted at the group's first member only.
                _ if c.group[0] == t.hello.rank => coll += 1,
                _ => {}
            }
        }
    }
    assert_eq!((st.collectives, st.sends), (coll, sends));
    let ops: u64 = all.iter().map(|t| 2 * t.calls.len() as u64 + 1).sum();
    assert_eq!(st.global_ops, ops);
}

#[test]
fn graph_file_round_trips_and_is_checked() {
    let spec = SynthSpec::small(LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    });
    let g = slice::slice(&reps(&spec), spec.layout, spec_cluster()).unwrap();
    let text = g.to_json();
    assert_eq!(SlicedGraph::from_json(&text, "g.json").unwrap(), g);
    let bad_version = text.replace("\"version\": 1", "\"version\": 2");
    let e = SlicedGraph::from_json(&bad_version, "g.json").unwrap_err();
    assert!(e.contains("g.json") && e.contains("version"), "{e}");
    let mut one = g.clone();
    one.classes.pop();
    let e = SlicedGraph::from_json(&one.to_json(), "g.json").unwrap_err();
    assert!(e.contains("1 classes for 2 pipeline stages"), "{e}");
    let mut bad_op = g.clone();
    bad_op.classes[0].calls[3].op = "all_reduse".into();
    let e = SlicedGraph::from_json(&bad_op.to_json(), "g.json").unwrap_err();
    assert!(
        e.contains("classes[0].calls[3]") && e.contains("all_reduse"),
        "{e}"
    );
}

fn refused(traces: &[RankTrace], layout: LayoutSpec) -> String {
    slice::slice(traces, layout, spec_cluster()).unwrap_err()
}

#[test]
fn malformed_traces_are_refused_by_name() {
    let layout = LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    };
    let spec = SynthSpec::small(layout);
    let good = synth::trace(&spec, 5);
    let bytes = good.to_bytes();
    // Truncated inside a frame.
    let e = RankTrace::parse(&bytes[..bytes.len() - 3], "r5.trace").unwrap_err();
    assert!(e.contains("r5.trace") && e.contains("truncated"), "{e}");
    // No Bye.
    let mut nobye = Vec::new();
    write_frame(&mut nobye, &Body::Hello(good.hello.clone())).unwrap();
    write_frame(&mut nobye, &Body::Call(good.calls[0].clone())).unwrap();
    let e = RankTrace::parse(&nobye, "r5.trace").unwrap_err();
    assert!(e.contains("r5.trace") && e.contains("without Bye"), "{e}");
    // Starts with a call.
    let mut nohello = Vec::new();
    write_frame(&mut nohello, &Body::Call(good.calls[0].clone())).unwrap();
    let e = RankTrace::parse(&nohello, "r5.trace").unwrap_err();
    assert!(e.contains("starts with Hello"), "{e}");
    // A gap in the numbering names the op.
    let mut gap = good.clone();
    gap.calls[3].seq = 4;
    let e = RankTrace::parse(&gap.to_bytes(), "r5.trace").unwrap_err();
    assert!(e.contains("rank 5, op 3"), "{e}");
    // Negative compute.
    let mut neg = good.clone();
    neg.calls[2].compute_s = -1.0;
    let e = RankTrace::parse(&neg.to_bytes(), "r5.trace").unwrap_err();
    assert!(e.contains("rank 5, op 2") && e.contains("compute_s"), "{e}");

    // Refusals of the set of traces.
    let mut set: Vec<RankTrace> = vec![synth::trace(&spec, 0), good.clone()];
    // Wrong world size.
    let mut w = set.clone();
    w[1].hello.world_size = 16;
    let e = refused(&w, layout);
    assert!(e.contains("synthetic rank 5") && e.contains("16"), "{e}");
    // A group that is none of the layout's (the whole world).
    let mut g = set.clone();
    let k = g[1]
        .calls
        .iter()
        .position(|c| c.op == Op::Barrier as i32)
        .unwrap();
    g[1].calls[k].group = (0..8).collect();
    let e = refused(&g, layout);
    assert!(
        e.contains(&format!("rank 5, op {k}")) && e.contains("[0, 1, 2, 3, 4, 5, 6, 7]"),
        "{e}"
    );
    // A send to a rank that is not the pipeline neighbour.
    let mut p = set.clone();
    let k = p[1]
        .calls
        .iter()
        .position(|c| c.op == Op::Send as i32)
        .unwrap();
    p[1].calls[k].peer = 0;
    let e = refused(&p, layout);
    assert!(
        e.contains(&format!("rank 5, op {k}")) && e.contains("neighbour"),
        "{e}"
    );
    // A send without its receive (stage 0's first receive removed).
    let mut u = set.clone();
    let k = u[0]
        .calls
        .iter()
        .position(|c| c.op == Op::Recv as i32)
        .unwrap();
    u[0].calls.remove(k);
    for (i, c) in u[0].calls.iter_mut().enumerate() {
        c.seq = i as u64;
    }
    let e = refused(&u, layout);
    assert!(e.contains("sends") && e.contains("receives"), "{e}");
    // Sizes of a send and its receive differ.
    let mut b = set.clone();
    let k = b[0]
        .calls
        .iter()
        .position(|c| c.op == Op::Recv as i32)
        .unwrap();
    b[0].calls[k].bytes += 4;
    let e = refused(&b, layout);
    assert!(e.contains("bytes") && e.contains("expects"), "{e}");
    // Two traces of one stage that disagree.
    set.push(synth::trace(&spec, 6));
    set[2].calls[7].bytes *= 2;
    let e = refused(&set, layout);
    assert!(e.contains("rank 6, op 7") && e.contains("rank 5"), "{e}");
    // A stage without a trace.
    let e = refused(&[synth::trace(&spec, 0)], layout);
    assert!(e.contains("no trace of pipeline stage 1"), "{e}");
}

mod random {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Any small layout and step shape: the stitched graph equals every rank's, and one
        /// instance per stage gives the time of every rank simulated.
        #[test]
        fn stitched_equals_traced(tp in 1u32..4, pp in 1u32..4, dp in 1u32..4, mb in 1u32..5,
                                  layers in prop::collection::vec(1u32..4, 3), gpn in prop::sample::select(vec![2u32, 4, 8])) {
            let layout = LayoutSpec { tp, pp, dp };
            let mut spec = SynthSpec::small(layout);
            spec.micro_batches = mb;
            spec.layers = layers[..pp as usize].to_vec();
            let n = tp * pp * dp;
            let cl = cluster(gpn, n.div_ceil(gpn));
            let all = slice::slice(&all_traces(&spec), layout, spec_cluster()).unwrap();
            let rep = slice::slice(&reps(&spec), layout, spec_cluster()).unwrap();
            let (ga, gr) = (all.graph(gpn).unwrap(), rep.graph(gpn).unwrap());
            prop_assert_eq!(&ga, &gr);
            let full = simulate_graph(&ga, &cl, &GraphOptions::default(), None).unwrap();
            let reduced = GraphOptions { mode: Mode::Reduced, ..Default::default() };
            match simulate_graph(&gr, &cl, &reduced, None) {
                Ok(r) => prop_assert_eq!(r.iteration_ps, full.iteration_ps),
                Err(prism_core::engine::SimError::Asymmetric(_)) => {}
                Err(e) => prop_assert!(false, "{e}"),
            }
        }

        /// Random bytes are refused or read, never a panic.
        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = RankTrace::parse(&bytes, "garbage");
        }

        /// A valid trace with one byte flipped is refused or read, never a panic, and what is
        /// read slices or is refused by name.
        #[test]
        fn flipped_bytes_never_panic(at in 0usize..4000, bit in 0u8..8) {
            let spec = SynthSpec::small(LayoutSpec { tp: 2, pp: 2, dp: 2 });
            let mut b = synth::trace(&spec, 5).to_bytes();
            let i = at % b.len();
            b[i] ^= 1 << bit;
            if let Ok(t) = RankTrace::parse(&b, "flipped") {
                let _ = slice::slice(&[synth::trace(&spec, 0), t], spec.layout, spec_cluster());
            }
        }
    }
}
