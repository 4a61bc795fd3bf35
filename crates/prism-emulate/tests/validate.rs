//! The all-real half of validation: the logical-clock replay against closed forms and its
//! refusals, and real runs of the worker processes (results, failures, time-outs).

use std::path::PathBuf;
use std::time::Duration;

use prism_emulate::comm::{Communicator, Trace};
use prism_emulate::protocol::{Call, DType, Op, ReduceOp};
use prism_emulate::validate::{
    AllRealOptions, AlphaBeta, CommCost, WorkerCommand, chain, median, replay, run_all_real,
};
use prism_emulate::workload::{Config, Model, mem};

/// Every call costs `0.5 s` (sends `0.25 s`).
#[derive(Debug)]
struct Fixed;

impl CommCost for Fixed {
    fn seconds(&self, _rank: u32, c: &Call, _g: usize) -> f64 {
        if c.op == Op::Send as i32 { 0.25 } else { 0.5 }
    }
}

fn call(seq: u64, op: Op, group: &[u32], peer: u32, bytes: u64, compute_s: f64) -> Call {
    Call {
        seq,
        op: op as i32,
        group: group.to_vec(),
        bytes,
        dtype: DType::F32 as i32,
        reduce: ReduceOp::Sum as i32,
        peer,
        data: Vec::new(),
        compute_s,
    }
}

fn trace(rank: u32, calls: Vec<Call>, tail: f64) -> Trace {
    Trace {
        rank,
        world_size: 3,
        calls,
        tail_compute_s: tail,
        peak_memory_bytes: 0,
    }
}

#[test]
fn replay_follows_the_clock_rules() {
    // Rank 0: 1 s, all-reduce {0,1}, 0.5 s, send to 2, 0.1 s tail.
    // Rank 1: 3 s, all-reduce {0,1}, 2 s tail.
    // Rank 2: 0.2 s, receive from 0, 1 s tail.
    let t = vec![
        trace(
            0,
            vec![
                call(0, Op::AllReduce, &[0, 1], 0, 8, 1.0),
                call(1, Op::Send, &[], 2, 8, 0.5),
            ],
            0.1,
        ),
        trace(1, vec![call(0, Op::AllReduce, &[0, 1], 0, 8, 3.0)], 2.0),
        trace(2, vec![call(0, Op::Recv, &[], 0, 8, 0.2)], 1.0),
    ];
    let e = replay(&t, &Fixed).unwrap();
    // All-reduce: starts at max(1, 3) = 3, ends 3.5 for both.
    // Rank 0: send starts 4.0, ends 4.25; tail -> 4.35.
    assert!((e[0] - 4.35).abs() < 1e-12, "{e:?}");
    assert!((e[1] - 5.5).abs() < 1e-12, "{e:?}");
    // Rank 2: message available at 4.25 > 0.2 -> 4.25 + 1.
    assert!((e[2] - 5.25).abs() < 1e-12, "{e:?}");
}

#[test]
fn replay_refuses_deadlocks_and_mismatches_by_rank_and_op() {
    let dead = vec![
        trace(0, vec![call(0, Op::Recv, &[], 1, 4, 0.0)], 0.0),
        trace(1, vec![call(0, Op::Recv, &[], 0, 4, 0.0)], 0.0),
        trace(2, vec![], 0.0),
    ];
    let e = replay(&dead, &Fixed).unwrap_err();
    assert!(e.contains("rank 0, op 0 (Recv"), "{e}");
    assert!(e.contains("never completes"), "{e}");
    let size = vec![
        trace(0, vec![call(0, Op::AllReduce, &[0, 1], 0, 8, 0.0)], 0.0),
        trace(1, vec![call(0, Op::AllReduce, &[0, 1], 0, 12, 0.0)], 0.0),
        trace(2, vec![], 0.0),
    ];
    let e = replay(&size, &Fixed).unwrap_err();
    assert!(e.contains("rank 0, op 0") && e.contains("12 bytes"), "{e}");
    let p2p = vec![
        trace(0, vec![call(0, Op::Send, &[], 1, 8, 0.0)], 0.0),
        trace(1, vec![call(0, Op::Recv, &[], 0, 4, 0.0)], 0.0),
        trace(2, vec![], 0.0),
    ];
    let e = replay(&p2p, &Fixed).unwrap_err();
    assert!(e.contains("rank 1, op 0") && e.contains("sent 8"), "{e}");
}

#[test]
fn alpha_beta_prices_ring_algorithms() {
    let ab = AlphaBeta {
        latency_s: 1.0,
        bytes_per_s: 100.0,
    };
    let c = |op| call(0, op, &[0, 1, 2, 3], 0, 400, 0.0);
    assert_eq!(ab.seconds(0, &c(Op::AllReduce), 4), 6.0 + 6.0);
    assert_eq!(ab.seconds(0, &c(Op::ReduceScatter), 4), 3.0 + 3.0);
    assert_eq!(ab.seconds(0, &c(Op::AllGather), 4), 3.0 + 12.0);
    assert_eq!(
        ab.seconds(0, &call(0, Op::Send, &[], 1, 400, 0.0), 2),
        1.0 + 4.0
    );
    assert_eq!(ab.seconds(0, &c(Op::AllReduce), 1), 0.0);
}

fn worker() -> WorkerCommand {
    WorkerCommand {
        program: env!("CARGO_BIN_EXE_prism-gpt-worker").into(),
        args: vec![],
    }
}

fn work_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("prism-validate-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tiny_opts(layout: &str, name: &str) -> AllRealOptions {
    AllRealOptions {
        config: Config::tiny().with_layout(layout).unwrap(),
        warmup: 1,
        iters: 2,
        repeats: 2,
        worker: worker(),
        timeout: Duration::from_secs(60),
        work_dir: work_dir(name),
        compute_lock: true,
    }
}

#[test]
fn all_real_run_reports_every_rank() {
    let opts = tiny_opts("2,2,2", "ok");
    let cost = AlphaBeta::default();
    let res = run_all_real(&opts, &cost).unwrap();
    assert_eq!(res.ranks.len(), 8);
    assert_eq!(res.samples_s.len(), 4, "2 repeats x 2 iterations");
    assert_eq!(res.iteration_time_s, median(&res.samples_s));
    for r in &res.ranks {
        assert_eq!(r.iteration_times_s.len(), 4);
        // The logical clock covers at least the rank's own compute.
        assert!(r.iteration_time_s >= r.compute_s * 0.5, "{r:?}");
        // The job's sample is its slowest rank's.
        for (t, job) in r.iteration_times_s.iter().zip(&res.samples_s) {
            assert!(t <= job);
        }
        // Independent truth for the peak: the same rank's step in this thread on the
        // recording backend.
        let cfg = opts.config.clone();
        let rank = r.rank as usize;
        let want = std::thread::spawn(move || {
            let mut c = Communicator::local(rank as u32, 8);
            let mut m = Model::new(&cfg, rank).unwrap();
            m.train_step(&mut c, 0).unwrap();
            mem::reset_peak();
            m.train_step(&mut c, 1).unwrap();
            mem::peak_bytes()
        })
        .join()
        .unwrap();
        assert_eq!(r.peak_memory_bytes, want, "rank {rank}");
    }
    for (k, job) in res.samples_s.iter().enumerate() {
        assert!(res.ranks.iter().any(|r| r.iteration_times_s[k] == *job));
    }
    // Ranks of one stage do the same work: same peak.
    assert_eq!(
        res.ranks[0].peak_memory_bytes,
        res.ranks[3].peak_memory_bytes
    );
    let _ = std::fs::remove_dir_all(&opts.work_dir);
}

#[test]
fn a_failing_worker_is_named_and_the_others_are_stopped() {
    let mut opts = tiny_opts("2,1,1", "fail");
    opts.worker = WorkerCommand {
        program: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            "if [ \"$PRISM_RANK\" = 1 ]; then echo boom >&2; exit 3; fi; sleep 30".into(),
        ],
    };
    let t0 = std::time::Instant::now();
    let e = run_all_real(&opts, &AlphaBeta::default()).unwrap_err();
    assert!(e.contains("rank 1 exited with exit status: 3: boom"), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "rank 0 was not stopped"
    );
    let _ = std::fs::remove_dir_all(&opts.work_dir);
}

#[test]
fn a_hanging_worker_times_out() {
    let mut opts = tiny_opts("2,1,1", "hang");
    opts.timeout = Duration::from_millis(300);
    opts.worker = WorkerCommand {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), "sleep 30".into()],
    };
    let e = run_all_real(&opts, &AlphaBeta::default()).unwrap_err();
    assert!(e.contains("rank 0 still running after 0.3 s"), "{e}");
    let _ = std::fs::remove_dir_all(&opts.work_dir);
}

#[test]
fn engine_cost_is_prism_cores_price() {
    use prism_core::cost::comm::{Collective, CommParams, GroupShape, plan_collective, plan_p2p};
    use prism_emulate::validate::EngineCost;
    let cluster = prism_core::job::fixtures::h100_cluster(2);
    let cost = EngineCost::new(&cluster);
    let params = CommParams::for_gpu(&cluster.gpu);
    // A TP all-reduce of 1 MiB inside node 0.
    let ar = call(0, Op::AllReduce, &[0, 1], 0, 1 << 20, 0.0);
    let want = plan_collective(
        Collective::AllReduce,
        1 << 20,
        GroupShape {
            ranks: 2,
            nodes: 1,
            per_node: 2,
        },
        &cluster,
        &params,
    )
    .idle_seconds(&cluster, &params);
    assert_eq!(cost.seconds(0, &ar, 2), want);
    assert!(want > 0.0);
    // A send from rank 3 (node 0) to rank 8 (node 1) crosses the NIC; to rank 4 it does not.
    let far = call(0, Op::Send, &[], 8, 1 << 20, 0.0);
    let near = call(0, Op::Send, &[], 4, 1 << 20, 0.0);
    assert_eq!(
        cost.seconds(3, &far, 2),
        plan_p2p(1 << 20, false, &cluster, &params).idle_seconds(&cluster, &params)
    );
    assert!(cost.seconds(3, &far, 2) > cost.seconds(3, &near, 2));
    // An all-gather is priced on its gathered size.
    let ag = call(0, Op::AllGather, &[0, 1, 2, 3], 0, 1000, 0.0);
    let want = plan_collective(
        Collective::AllGather,
        4000,
        GroupShape {
            ranks: 4,
            nodes: 1,
            per_node: 4,
        },
        &cluster,
        &params,
    )
    .idle_seconds(&cluster, &params);
    assert_eq!(cost.seconds(0, &ag, 4), want);
}

/// Truth: iterations chained back to back. Two ranks all-reduce once per iteration; rank 0
/// computes 1 s before the call and 2 s after it (its tail), rank 1 3 s and 0 s, the call costs
/// 0.5 s. Per iteration the call ends at max(1, 3) + 0.5 = 3.5 s; rank 0 then ends at 5.5 s.
/// Chained, rank 0's tail joins its next segment (2 + 1 = 3 s), so the second call ends at
/// max(3.5 + 3, 3.5 + 3) + 0.5 = 7 s and rank 0 ends at 9 s (not 2 x 5.5 = 11 s: its tail
/// overlaps rank 1's next compute). Seqs count on; the last tail stays the tail.
#[test]
fn chained_iterations_follow_the_clock_rules() {
    let it = |r: u32, before: f64, tail: f64| {
        trace(r, vec![call(0, Op::AllReduce, &[0, 1], 0, 8, before)], tail)
    };
    let r0 = chain(&[it(0, 1.0, 2.0), it(0, 1.0, 2.0)]);
    let r1 = chain(&[it(1, 3.0, 0.0), it(1, 3.0, 0.0)]);
    assert_eq!(r0.calls.len(), 2);
    assert_eq!((r0.calls[0].seq, r0.calls[1].seq), (0, 1));
    assert_eq!((r0.calls[1].compute_s, r0.tail_compute_s), (3.0, 2.0));
    let ends = replay(&[r0, r1], &Fixed).unwrap();
    assert_eq!(ends, vec![9.0, 7.0]);
    let single = replay(&[it(0, 1.0, 2.0), it(1, 3.0, 0.0)], &Fixed).unwrap();
    assert_eq!(single, vec![5.5, 3.5]);
    assert_eq!(chain(&[it(0, 1.0, 2.0)]), it(0, 1.0, 2.0));
}
