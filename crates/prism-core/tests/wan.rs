//! The engine on multi-datacenter jobs: WAN links in the flow-level network, their latency and
//! per-transfer caps, and temporal sharing (pipelines take turns owning a WAN link), against
//! closed forms and the full simulation.

use prism_core::graph::OpKind;
use prism_core::job::Job;
use prism_core::job::fixtures::small_job;
use prism_core::wan::{Wan, WanLink, WanSharing};
use prism_core::{Mode, SimOptions, simulate};

fn link(gbps: f64, rtt_ms: f64, window_mib: f64, connections: u32) -> WanLink {
    WanLink {
        a: 0,
        b: 1,
        gbps,
        rtt_ms,
        tcp_window_mib: window_mib,
        connections,
    }
}

/// `small_job` on 2 nodes, tp 1, pp 2, dp 8: stage 0 on node 0 (DC 0), stage 1 on node 1
/// (DC 1), so the 8 pipelines' sends all cross the one WAN link.
fn two_dc_job(l: WanLink, sharing: WanSharing) -> Job {
    let mut job = small_job(2, 1, 2, 16);
    job.cluster.topology.wan = Wan {
        sharing,
        ..Wan::full_mesh(&[1, 1], &l)
    };
    job.validate().unwrap();
    job
}

/// A WAN that can never bind (huge capacity, no RTT) gives exactly the single-DC iteration time.
#[test]
fn a_wan_that_never_binds_changes_nothing() {
    let base = small_job(2, 1, 2, 16);
    let wan = two_dc_job(link(1e6, 0.0, 1e6, 1), WanSharing::Fair);
    for mode in [Mode::Full, Mode::Reduced] {
        let opts = SimOptions {
            mode: mode.clone(),
            ..Default::default()
        };
        let a = simulate(&base, &opts).unwrap().summary.iteration_time_s;
        let b = simulate(&wan, &opts).unwrap().summary.iteration_time_s;
        assert_eq!(a, b, "{mode:?}");
    }
}

/// The first forward sends of the 8 pipelines: (start, end) in ps, sorted by end.
fn first_sends(job: &Job) -> (Vec<(u64, u64)>, u64) {
    let opts = SimOptions {
        record_ranks: (0..8).collect(),
        ..Default::default()
    };
    let r = simulate(job, &opts).unwrap();
    let prog = &r.graph.programs[0];
    let mut bytes = 0;
    let mut out = Vec::new();
    for t in &r.timelines {
        let rec = t
            .ops
            .iter()
            .find(|o| matches!(prog.kind[o.op as usize], OpKind::Send { .. }))
            .expect("a send");
        if let OpKind::Send { bytes: b, .. } = prog.kind[rec.op as usize] {
            bytes = b;
        }
        out.push((rec.start, rec.end));
    }
    out.sort_by_key(|&(_, e)| e);
    (out, bytes)
}

/// Temporal sharing closed form: D = 8 pipelines send S bytes over a WAN link of B at the same
/// instant. Fair-shared, every transfer takes D S / B; in turns, each takes S / B on the wire,
/// the k-th ending k S / B after the start. (Latency is the same in both and cancels.)
#[test]
fn temporal_sharing_of_equal_transfers() {
    let l = link(1.0, 2.0, 1e6, 1); // 125 MB/s, cap far above
    let (fair, s) = first_sends(&two_dc_job(l.clone(), WanSharing::Fair));
    let (turns, s2) = first_sends(&two_dc_job(l, WanSharing::Temporal));
    assert_eq!(s, s2);
    let d = fair.len() as u64;
    assert_eq!(d, 8);
    let b = 125_000_000u64;
    let one = s as f64 * 1e12 / b as f64; // S / B, ps
    let t0 = fair[0].0;
    assert!(
        fair.iter().chain(&turns).all(|&(st, _)| st == t0),
        "all start together"
    );
    let latency = fair[0].1 as f64 - t0 as f64 - d as f64 * one;
    assert!(latency > 0.0 && latency < 1.1e9, "latency {latency} ps");
    for &(_, e) in &fair {
        let took = e as f64 - t0 as f64 - latency;
        assert!(
            (took - d as f64 * one).abs() < 2.0,
            "fair: {took} vs {}",
            d as f64 * one
        );
    }
    for (k, &(_, e)) in turns.iter().enumerate() {
        let took = e as f64 - t0 as f64 - latency;
        assert!(
            (took - (k + 1) as f64 * one).abs() < 2.0 * (k + 1) as f64,
            "turn {k}: {took} vs {}",
            (k + 1) as f64 * one
        );
    }
}

/// The reduced run (one pipeline, the others' turns as lag) against the full run with every
/// pipeline's turns simulated.
#[test]
fn temporal_sharing_reduced_matches_full() {
    for gbps in [1.0, 10.0, 100.0] {
        let job = two_dc_job(link(gbps, 10.0, 1e6, 1), WanSharing::Temporal);
        let full = simulate(&job, &SimOptions::default()).unwrap();
        let red = simulate(
            &job,
            &SimOptions {
                mode: Mode::Reduced,
                ..Default::default()
            },
        )
        .unwrap();
        let (f, r) = (full.summary.iteration_time_s, red.summary.iteration_time_s);
        assert_eq!(f, r, "{gbps} Gb/s: full {f} vs reduced {r}");
    }
}

/// Fewer connections or a longer RTT never make an iteration shorter; fair sharing and the
/// reduced run agree with the full run exactly.
#[test]
fn wan_caps_and_rtt_are_monotone_and_reduced_is_exact() {
    let mut last = 0.0;
    for (conns, rtt) in [(64, 10.0), (8, 10.0), (1, 10.0), (1, 50.0)] {
        let job = two_dc_job(link(10.0, rtt, 0.5, conns), WanSharing::Fair);
        let full = simulate(&job, &SimOptions::default()).unwrap();
        let red = simulate(
            &job,
            &SimOptions {
                mode: Mode::Reduced,
                ..Default::default()
            },
        )
        .unwrap();
        let t = full.summary.iteration_time_s;
        assert_eq!(t, red.summary.iteration_time_s, "{conns} conns, {rtt} ms");
        assert!(t >= last, "{conns} conns {rtt} ms: {t} < {last}");
        last = t;
    }
}

/// WAN bytes are conserved: the reduced run reports the bytes every pipeline moves, as the full
/// run does, with fair and temporal sharing; in turns no two transfers overlap on a link in the
/// full run.
#[test]
fn wan_transfers_account_for_every_byte() {
    for sharing in [WanSharing::Fair, WanSharing::Temporal] {
        let job = two_dc_job(link(10.0, 10.0, 1e6, 1), sharing);
        let full = simulate(&job, &SimOptions::default()).unwrap();
        let red = simulate(
            &job,
            &SimOptions {
                mode: Mode::Reduced,
                ..Default::default()
            },
        )
        .unwrap();
        let total = |r: &prism_core::SimResult| r.wan.iter().map(|t| t.bytes).sum::<u64>();
        assert!(total(&full) > 0);
        assert_eq!(total(&full), total(&red), "{sharing:?}");
        if sharing == WanSharing::Temporal {
            for link in [0u32, 1] {
                let mut v: Vec<_> = full.wan.iter().filter(|t| t.link == link).collect();
                v.sort_by_key(|t| t.start);
                // Transfers of one pipeline (its TP ranks) may share a turn; here tp = 1.
                assert!(v.windows(2).all(|w| w[0].end <= w[1].start), "link {link}");
            }
        }
    }
}
