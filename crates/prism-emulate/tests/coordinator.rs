//! The coordinator against scripted real ranks over Unix sockets: emulated times equal the
//! offline run, data is combined as documented, and every fault ends with an error naming the
//! rank (and the group and op index where there is one), without hanging.

use std::path::PathBuf;
use std::time::Duration;

use prism_core::engine::{GraphOptions, simulate_graph};
use prism_core::job::Cluster;
use prism_emulate::coordinator::{self, Clock, EmulateError, Listen, Report, Setup};
use prism_emulate::graph_file::{ClusterSpec, LayoutSpec, SlicedGraph};
use prism_emulate::protocol::{Bye, Call, Op};
use prism_emulate::replay::{ReplayOptions, Replayed, replay};
use prism_emulate::slice::{self, instantiate};
use prism_emulate::synth::{self, SynthSpec};

const LAYOUT: LayoutSpec = LayoutSpec {
    tp: 2,
    pp: 2,
    dp: 2,
};

fn cluster() -> Cluster {
    let mut c = prism_core::job::fixtures::small_job(1, 1, 1, 8).cluster;
    c.gpus_per_node = 8;
    c.nodes = 1;
    c
}

fn sliced(spec: &SynthSpec) -> SlicedGraph {
    let size = spec.layout.tp * spec.layout.dp;
    let traces: Vec<_> = (0..spec.layout.pp)
        .map(|s| synth::trace(spec, s * size))
        .collect();
    let cs = ClusterSpec {
        preset: "dgx-h100".into(),
        set: vec![],
    };
    slice::slice(&traces, spec.layout, cs).unwrap()
}

fn sock(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prism-emulate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("c.sock")
}

fn setup(g: &SlicedGraph, real: &[u32], name: &str, timeout_ms: u64) -> Setup {
    Setup {
        graph: g.clone(),
        cluster: cluster(),
        real_ranks: real.to_vec(),
        listen: Listen::Unix(sock(name)),
        timeout: Duration::from_millis(timeout_ms),
        command: vec![],
        clock: Clock::Asap,
        iterations: 1,
        output_dir: None,
    }
}

fn bye_of(g: &SlicedGraph, rank: u32) -> Bye {
    let c = g.class_of(rank);
    Bye {
        compute_s: c.tail_ps as f64 * 1e-12,
        peak_memory_bytes: c.peak_memory_bytes,
    }
}

type Client = std::thread::JoinHandle<Result<Replayed, String>>;

/// Starts a scripted client for `rank` replaying `calls`.
fn client(s: &Setup, rank: u32, calls: Vec<Call>, opts: ReplayOptions) -> Client {
    let Listen::Unix(path) = &s.listen else {
        unreachable!()
    };
    let addr = format!("unix:{}", path.display());
    let world = s.graph.layout.world_size().unwrap();
    let bye = bye_of(&s.graph, rank);
    std::thread::spawn(move || {
        let opts = ReplayOptions {
            connect_timeout: Duration::from_secs(5),
            ..opts
        };
        replay(&addr, rank, world, &calls, &bye, &opts)
    })
}

fn run_with(
    s: &Setup,
    clients: Vec<Client>,
) -> (Result<Report, EmulateError>, Vec<Result<Replayed, String>>) {
    let r = coordinator::run(s);
    let c = clients.into_iter().map(|h| h.join().unwrap()).collect();
    if let Listen::Unix(p) = &s.listen {
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }
    (r, c)
}

#[test]
fn real_ranks_see_the_offline_times() {
    let spec = SynthSpec::small(LAYOUT);
    let g = sliced(&spec);
    let graph = g.graph(8).unwrap();
    for (i, real) in [vec![5u32], vec![0, 5], vec![2, 3], vec![0, 1]]
        .into_iter()
        .enumerate()
    {
        let offline = simulate_graph(
            &graph,
            &cluster(),
            &GraphOptions {
                record_ranks: real.clone(),
                ..Default::default()
            },
            None,
        )
        .unwrap();
        let s = setup(&g, &real, &format!("times{i}"), 5000);
        // Each rank replays its own recorded calls (whose all-reduces say peer 0 whatever the
        // rank), as a real rank would make them.
        let clients = (real.iter())
            .map(|&r| {
                client(
                    &s,
                    r,
                    synth::trace(&spec, r).calls,
                    ReplayOptions::default(),
                )
            })
            .collect();
        let (rep, got) = run_with(&s, clients);
        let rep = rep.unwrap();
        assert_eq!(rep.emulated_s, offline.iteration_ps as f64 * 1e-12);
        assert_eq!(rep.world_size, 8);
        for (&r, c) in real.iter().zip(&got) {
            let c = c.as_ref().unwrap();
            let tl = offline.timelines.iter().find(|t| t.rank == r).unwrap();
            assert_eq!(c.done.len(), instantiate(&g, r).unwrap().len());
            for (k, d) in c.done.iter().enumerate() {
                let end = tl
                    .ops
                    .iter()
                    .find(|o| o.op == 2 * k as u32 + 1)
                    .unwrap()
                    .end;
                assert_eq!(d.emulated_end_s, end as f64 * 1e-12, "rank {r} call {k}");
            }
            let rr = rep.ranks.iter().find(|x| x.rank == r).unwrap();
            assert_eq!(rr.peak_memory_bytes, g.class_of(r).peak_memory_bytes);
            assert_eq!(rr.calls as usize, c.done.len());
            let fin = offline.ranks.iter().find(|t| t.rank == r).unwrap().finish_s;
            assert_eq!(rr.emulated_end_s, fin);
        }
    }
}

#[test]
fn wall_clock_coupling_never_releases_early() {
    let mut spec = SynthSpec::small(LAYOUT);
    spec.layer_us = 50;
    let g = sliced(&spec);
    let mut s = setup(&g, &[1], "wall", 5000);
    s.clock = Clock::Wall;
    let c = client(&s, 1, instantiate(&g, 1).unwrap(), ReplayOptions::default());
    let (rep, got) = run_with(&s, vec![c]);
    let rep = rep.unwrap();
    let got = got[0].as_ref().unwrap();
    for (d, at) in got.done.iter().zip(&got.done_at) {
        let w_ns = at.duration_since(rep.clock_start).as_nanos();
        let end_ps = (d.emulated_end_s * 1e12).round() as u128;
        assert!(
            w_ns * 1000 >= end_ps,
            "released at {w_ns} ns before {end_ps} ps"
        );
    }
    assert!(rep.ranks[0].max_lag_s >= 0.0 && rep.ranks[0].mean_lag_s <= rep.ranks[0].max_lag_s);
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn data_is_combined_among_real_ranks_and_copied_for_virtual_ones() {
    let mut spec = SynthSpec::small(LAYOUT);
    spec.activation_bytes = 16;
    spec.grad_bytes = 32;
    let g = sliced(&spec);
    // Ranks 0 and 1 form a TP group; 4 is rank 0's next stage; 1's neighbour 5 is virtual.
    let real = [0u32, 1, 4];
    let value = |r: u32, k: usize| (r * 100) as f32 + k as f32;
    let with_data = |r: u32| -> Vec<Call> {
        let mut calls = instantiate(&g, r).unwrap();
        for (k, c) in calls.iter_mut().enumerate() {
            if c.op != Op::Recv as i32 && c.bytes > 0 {
                c.data = f32s(&vec![value(r, k); (c.bytes / 4) as usize]);
            }
        }
        calls
    };
    let s = setup(&g, &real, "data", 5000);
    let clients = real
        .iter()
        .map(|&r| client(&s, r, with_data(r), ReplayOptions::default()))
        .collect();
    let (rep, got) = run_with(&s, clients);
    rep.unwrap();
    let mut checked = [0usize; 6];
    for (&r, c) in real.iter().zip(&got) {
        let c = c.as_ref().unwrap();
        let calls = instantiate(&g, r).unwrap();
        let mut recvs_from: std::collections::BTreeMap<u32, usize> = Default::default();
        for (k, (call, d)) in calls.iter().zip(&c.done).enumerate() {
            let out = floats(&d.data);
            let n = call.group.len();
            let real_in = |m: u32| real.contains(&m);
            // The value a member contributes: its own if real, else the lowest real member's.
            let contrib = |m: u32| {
                let lowest = *call.group.iter().filter(|&&x| real_in(x)).min().unwrap();
                value(if real_in(m) { m } else { lowest }, k)
            };
            match Op::try_from(call.op).unwrap() {
                Op::AllReduce if call.bytes > 0 => {
                    let sum: f32 = call.group.iter().map(|&m| contrib(m)).sum();
                    assert!(
                        out.iter().all(|&x| x == sum),
                        "rank {r} op {k}: {out:?} != {sum}"
                    );
                    checked[0] += 1;
                }
                Op::ReduceScatter => {
                    let sum: f32 = call.group.iter().map(|&m| contrib(m)).sum();
                    assert_eq!(out.len() as u64, call.bytes / 4 / n as u64);
                    assert!(out.iter().all(|&x| x == sum), "rank {r} op {k}");
                    checked[1] += 1;
                }
                Op::AllGather => {
                    let per = (call.bytes / 4) as usize;
                    let want: Vec<f32> = (call.group.iter())
                        .flat_map(|&m| vec![contrib(m); per])
                        .collect();
                    assert_eq!(out, want, "rank {r} op {k}");
                    checked[2] += 1;
                }
                Op::Broadcast => {
                    assert!(
                        out.iter().all(|&x| x == contrib(call.peer)),
                        "rank {r} op {k}"
                    );
                    checked[3] += 1;
                }
                Op::Recv => {
                    // The j-th receive from a peer carries the peer's j-th send to this rank.
                    let j = *recvs_from
                        .entry(call.peer)
                        .and_modify(|j| *j += 1)
                        .or_insert(0);
                    assert_eq!(out.len() as u64, call.bytes / 4);
                    if real_in(call.peer) {
                        let sends = instantiate(&g, call.peer).unwrap();
                        let sk = (sends.iter().enumerate())
                            .filter(|(_, c)| c.op == Op::Send as i32 && c.peer == r)
                            .nth(j)
                            .unwrap()
                            .0;
                        assert!(
                            out.iter().all(|&x| x == value(call.peer, sk)),
                            "rank {r} op {k}"
                        );
                        checked[4] += 1;
                    } else {
                        assert!(out.iter().all(|&x| x == 0.0), "rank {r} op {k}");
                        checked[5] += 1;
                    }
                }
                _ => assert!(d.data.is_empty()),
            }
        }
    }
    assert!(checked.iter().all(|&c| c > 0), "{checked:?}");
}

fn rank_error(e: EmulateError) -> (u32, Option<Vec<u32>>, Option<u64>, String) {
    match e {
        EmulateError::Rank {
            rank,
            group,
            op,
            message,
        } => (rank, group, op, message),
        other => panic!("not a rank error: {other}"),
    }
}

#[test]
fn a_rank_that_disconnects_is_named_with_its_group_and_op() {
    let g = sliced(&SynthSpec::small(LAYOUT));
    let s = setup(&g, &[0, 5], "disconnect", 5000);
    let calls5 = instantiate(&g, 5).unwrap();
    let c0 = client(&s, 0, instantiate(&g, 0).unwrap(), ReplayOptions::default());
    let c5 = client(
        &s,
        5,
        calls5.clone(),
        ReplayOptions {
            crash_before: Some(7),
            ..Default::default()
        },
    );
    let (rep, got) = run_with(&s, vec![c0, c5]);
    let e = rep.unwrap_err();
    let text = e.to_string();
    let (rank, group, op, message) = rank_error(e);
    assert_eq!((rank, op), (5, Some(7)), "{text}");
    assert_eq!(group.unwrap_or_default(), calls5[7].group);
    assert!(message.contains("disconnected"), "{text}");
    assert!(text.contains("rank 5") && text.contains("op 7"), "{text}");
    // The other real rank is told, not left waiting.
    let full = instantiate(&g, 0).unwrap().len();
    assert!(got[0].as_ref().map_or(true, |r| r.done.len() < full));
}

#[test]
fn a_size_mismatch_is_refused() {
    let g = sliced(&SynthSpec::small(LAYOUT));
    let s = setup(&g, &[3], "size", 5000);
    let mut calls = instantiate(&g, 3).unwrap();
    let k = (3..calls.len())
        .find(|&k| !calls[k].group.is_empty())
        .unwrap();
    calls[k].bytes += 8;
    let c = client(&s, 3, calls.clone(), ReplayOptions::default());
    let (rep, got) = run_with(&s, vec![c]);
    let text = rep.as_ref().unwrap_err().to_string();
    let (rank, group, op, message) = rank_error(rep.unwrap_err());
    assert_eq!((rank, op), (3, Some(k as u64)), "{text}");
    assert_eq!(group.unwrap(), calls[k].group);
    assert!(message.contains("size mismatch"), "{text}");
    // The rank received the Fault.
    let e = got[0].as_ref().unwrap_err();
    assert!(e.contains("fault") && e.contains("size mismatch"), "{e}");
    // Rank, group and op index travel in the Fault's fields, not repeated in its message.
    assert!(e.starts_with("fault: size mismatch"), "{e}");
}

#[test]
fn an_order_mismatch_is_refused() {
    let g = sliced(&SynthSpec::small(LAYOUT));
    let s = setup(&g, &[6], "order", 5000);
    let mut calls = instantiate(&g, 6).unwrap();
    // Two calls of different kinds swapped (renumbered, so only the order is wrong).
    let k = (0..calls.len() - 1)
        .find(|&k| calls[k].op != calls[k + 1].op)
        .unwrap();
    calls.swap(k, k + 1);
    calls[k].seq = k as u64;
    calls[k + 1].seq = k as u64 + 1;
    let c = client(&s, 6, calls, ReplayOptions::default());
    let (rep, _) = run_with(&s, vec![c]);
    let text = rep.as_ref().unwrap_err().to_string();
    let (rank, _, op, message) = rank_error(rep.unwrap_err());
    assert_eq!((rank, op), (6, Some(k as u64)), "{text}");
    assert!(message.contains("order mismatch"), "{text}");
    // Too many calls, too few calls.
    let mut more = instantiate(&g, 6).unwrap();
    let extra = Call {
        seq: more.len() as u64,
        ..more[0].clone()
    };
    more.push(extra);
    let s = setup(&g, &[6], "order-more", 5000);
    let c = client(&s, 6, more.clone(), ReplayOptions::default());
    let (rep, _) = run_with(&s, vec![c]);
    let (_, _, op, message) = rank_error(rep.unwrap_err());
    assert_eq!(op, Some(more.len() as u64 - 1));
    assert!(message.contains("another"), "{message}");
    let mut fewer = instantiate(&g, 6).unwrap();
    fewer.pop();
    let s = setup(&g, &[6], "order-fewer", 5000);
    let c = client(&s, 6, fewer.clone(), ReplayOptions::default());
    let (rep, _) = run_with(&s, vec![c]);
    let (_, _, op, message) = rank_error(rep.unwrap_err());
    assert_eq!(op, Some(fewer.len() as u64));
    assert!(message.contains("Bye after"), "{message}");
}

#[test]
fn a_rank_that_never_arrives_or_stops_talking_times_out() {
    let g = sliced(&SynthSpec::small(LAYOUT));
    let s = setup(&g, &[0, 5], "never", 300);
    let c0 = client(&s, 0, instantiate(&g, 0).unwrap(), ReplayOptions::default());
    let (rep, got) = run_with(&s, vec![c0]);
    let text = rep.as_ref().unwrap_err().to_string();
    let (rank, _, _, message) = rank_error(rep.unwrap_err());
    assert_eq!(rank, 5, "{text}");
    assert!(message.contains("never arrived"), "{text}");
    // The rank that came is told why it will not be welcomed.
    assert!(got[0].as_ref().unwrap_err().contains("never arrived"));

    let s = setup(&g, &[2], "hang", 300);
    let calls = instantiate(&g, 2).unwrap();
    let c = client(
        &s,
        2,
        calls.clone(),
        ReplayOptions {
            hang_before: Some((5, Duration::from_millis(800))),
            ..Default::default()
        },
    );
    let (rep, _) = run_with(&s, vec![c]);
    let text = rep.as_ref().unwrap_err().to_string();
    let (rank, group, op, message) = rank_error(rep.unwrap_err());
    assert_eq!((rank, op), (2, Some(5)), "{text}");
    assert_eq!(group.unwrap_or_default(), calls[5].group);
    assert!(message.contains("sent nothing"), "{text}");
}

#[test]
fn hello_checks_refuse_unknown_ranks_and_wrong_world_sizes() {
    let g = sliced(&SynthSpec::small(LAYOUT));
    let s = setup(&g, &[1], "unknown", 3000);
    let c = client(&s, 2, instantiate(&g, 2).unwrap(), ReplayOptions::default());
    let (rep, got) = run_with(&s, vec![c]);
    let (rank, _, _, message) = rank_error(rep.unwrap_err());
    assert_eq!(rank, 2);
    assert!(message.contains("not a real rank"), "{message}");
    assert!(got[0].as_ref().unwrap_err().contains("not a real rank"));

    let s = setup(&g, &[1], "world", 3000);
    let Listen::Unix(path) = &s.listen else {
        unreachable!()
    };
    let addr = format!("unix:{}", path.display());
    let calls = instantiate(&g, 1).unwrap();
    let h = std::thread::spawn(move || {
        let opts = ReplayOptions {
            connect_timeout: Duration::from_secs(5),
            ..Default::default()
        };
        replay(&addr, 1, 16, &calls, &Bye::default(), &opts)
    });
    let (rep, got) = run_with(&s, vec![h]);
    let (rank, _, _, message) = rank_error(rep.unwrap_err());
    assert_eq!(rank, 1);
    assert!(message.contains("world size 16"), "{message}");
    assert!(got[0].as_ref().unwrap_err().contains("world size 16"));
}

#[test]
fn launched_ranks_run_and_faulty_launches_are_named() {
    let spec = SynthSpec::small(LAYOUT);
    let g = sliced(&spec);
    let file = sock("launch").with_file_name("graph.json");
    std::fs::write(&file, g.to_json()).unwrap();
    let mut s = setup(&g, &[0, 5], "launch", 10_000);
    s.command = vec![
        env!("CARGO_BIN_EXE_prism-replay").into(),
        file.display().to_string(),
    ];
    let rep = coordinator::run(&s).unwrap();
    let offline = simulate_graph(
        &g.graph(8).unwrap(),
        &cluster(),
        &GraphOptions::default(),
        None,
    )
    .unwrap();
    assert_eq!(rep.emulated_s, offline.iteration_ps as f64 * 1e-12);
    assert_eq!(rep.ranks.len(), 2);

    // A rank whose process dies before connecting.
    let mut s = setup(&g, &[0, 5], "launch-crash", 10_000);
    s.command = vec![
        "sh".into(),
        "-c".into(),
        "test $PRISM_RANK = 0 && exec sleep 30; exit 3".into(),
    ];
    let (rank, _, _, message) = rank_error(coordinator::run(&s).unwrap_err());
    assert_eq!(rank, 5);
    assert!(
        message.contains("exited") && message.contains("before connecting"),
        "{message}"
    );

    // Processes that never connect are killed at the time-out (else this test would take 30 s
    // waiting for them).
    let mut s = setup(&g, &[3], "launch-hang", 300);
    s.command = vec!["sleep".into(), "30".into()];
    let (rank, _, _, message) = rank_error(coordinator::run(&s).unwrap_err());
    assert_eq!(rank, 3);
    assert!(message.contains("never arrived"), "{message}");
    for name in ["launch", "launch-crash", "launch-hang"] {
        let _ = std::fs::remove_dir_all(sock(name).parent().unwrap());
    }
}

#[test]
fn several_iterations_repeat_the_graph() {
    let spec = SynthSpec::small(LAYOUT);
    let g = sliced(&spec);
    assert_eq!(g.repeated(1), g);
    let g3 = g.repeated(3);
    let per = g.classes[1].calls.len();
    assert_eq!(g3.classes[1].calls.len(), 3 * per);
    // Between iterations the tail and the next head are one segment.
    assert_eq!(
        g3.classes[1].calls[per].compute_ps,
        g.classes[1].calls[0].compute_ps + g.classes[1].tail_ps
    );
    // A rank that runs two iterations: its calls continue the numbering, and its compute
    // between the iterations covers the tail of the first and the head of the second.
    let one = instantiate(&g, 6).unwrap();
    let mut two = one.clone();
    for (k, c) in one.iter().enumerate() {
        let mut c = c.clone();
        c.seq = (per + k) as u64;
        if k == 0 {
            c.compute_s += g.class_of(6).tail_ps as f64 * 1e-12;
        }
        two.push(c);
    }
    let mut s = setup(&g, &[6], "iterations", 5000);
    s.iterations = 2;
    let c = client(&s, 6, two, ReplayOptions::default());
    let (rep, got) = run_with(&s, vec![c]);
    let rep = rep.unwrap();
    let offline = simulate_graph(
        &g.repeated(2).graph(8).unwrap(),
        &cluster(),
        &GraphOptions {
            record_ranks: vec![6],
            ..Default::default()
        },
        None,
    )
    .unwrap();
    assert_eq!(rep.emulated_s, offline.iteration_ps as f64 * 1e-12);
    assert_eq!(rep.emulated_iteration_s, rep.emulated_s / 2.0);
    let r = &rep.ranks[0];
    let got = got[0].as_ref().unwrap();
    assert_eq!(got.done.len(), 2 * per);
    // The first iteration ends with the Done of its last call; the second with the Bye.
    assert_eq!(r.iteration_ends_s.len(), 2);
    assert_eq!(r.iteration_ends_s[0], got.done[per - 1].emulated_end_s);
    assert_eq!(r.iteration_ends_s[1], r.emulated_end_s);
    let tl = offline.timelines.iter().find(|t| t.rank == 6).unwrap();
    let last = tl
        .ops
        .iter()
        .find(|o| o.op == 2 * (2 * per as u32))
        .unwrap();
    assert_eq!(r.emulated_end_s, last.end as f64 * 1e-12);
}
