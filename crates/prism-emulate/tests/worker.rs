//! The worker process: argument and environment checks, and a real rank run against a mock
//! coordinator that applies the virtual-contribution rule (a virtual peer contributes a copy of
//! the real rank's data), which must train exactly like the recording backend.

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::process::Command;

use prism_emulate::comm::{Communicator, bytes_to_f32, f32_bytes};
use prism_emulate::protocol::{Body, Done, Op, ReduceOp, Welcome, read_frame, write_frame};
use prism_emulate::worker::parse;
use prism_emulate::workload::{Config, Model, mem};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

fn args(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

/// Arguments, environment, and the expected error.
type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

#[test]
fn arguments_and_environment_are_checked_by_name() {
    let ok = [
        ("PRISM_RANK", "1"),
        ("PRISM_WORLD_SIZE", "8"),
        ("PRISM_LAYOUT", "2,2,2"),
    ];
    let a = parse(&args(&["--record", "x.trace", "--iters", "2"]), env(&ok)).unwrap();
    assert_eq!((a.rank, a.world, a.iters), (1, 8, 2));
    assert_eq!((a.config.tp, a.config.pp, a.config.dp), (2, 2, 2));
    let cases: Vec<Case> = vec![
        (
            vec!["--record", "x"],
            vec![("PRISM_WORLD_SIZE", "8"), ("PRISM_LAYOUT", "2,2,2")],
            "PRISM_RANK is not set",
        ),
        (
            vec!["--record", "x"],
            vec![
                ("PRISM_RANK", "0"),
                ("PRISM_WORLD_SIZE", "4"),
                ("PRISM_LAYOUT", "2,2,2"),
            ],
            "PRISM_WORLD_SIZE=4 but layout 2,2,2 has 8 ranks",
        ),
        (
            vec!["--record", "x"],
            vec![
                ("PRISM_RANK", "8"),
                ("PRISM_WORLD_SIZE", "8"),
                ("PRISM_LAYOUT", "2,2,2"),
            ],
            "PRISM_RANK=8 outside a world of 8",
        ),
        (vec![], ok.to_vec(), "no backend"),
        (
            vec!["--iters", "0", "--record", "x"],
            ok.to_vec(),
            "--iters \"0\": expected a positive integer",
        ),
        (
            vec!["--bogus", "1"],
            ok.to_vec(),
            "unknown argument \"--bogus\"",
        ),
        (vec!["--record"], ok.to_vec(), "--record needs a value"),
        (
            vec!["--heads", "3", "--record", "x"],
            ok.to_vec(),
            "hidden 128 is not a multiple of heads 3",
        ),
    ];
    for (a, e, want) in cases {
        let err = parse(&args(&a), env(&e)).unwrap_err();
        assert!(err.contains(want), "{a:?}: {err}");
    }
}

#[test]
fn worker_process_reports_a_clear_error_and_exit_code() {
    let out = Command::new(env!("CARGO_BIN_EXE_prism-gpt-worker"))
        .env_clear()
        .env("PRISM_RANK", "0")
        .env("PRISM_WORLD_SIZE", "2")
        .env("PRISM_LAYOUT", "2,1,1")
        .env("PRISM_COORDINATOR", "unix:/nonexistent/prism.sock")
        .args(["--timeout-s", "0.2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 0") && err.contains("cannot connect to the coordinator"),
        "{err}"
    );
}

/// Losses the recording backend gives rank 0 of a tp-2 job (its peer's contribution synthesised
/// as a copy), and that rank's ledger peak.
fn recorded(cfg: &Config, steps: u64) -> (Vec<f64>, u64) {
    let cfg = cfg.clone();
    std::thread::spawn(move || {
        let mut c = Communicator::local(0, 2);
        let mut m = Model::new(&cfg, 0).unwrap();
        let mut losses = Vec::new();
        let mut peak = 0;
        for s in 0..steps {
            mem::reset_peak();
            losses.push(m.train_step(&mut c, s).unwrap());
            peak = mem::peak_bytes();
        }
        (losses, peak)
    })
    .join()
    .unwrap()
}

#[test]
fn emulated_worker_trains_like_the_recording_backend() {
    let dir = std::env::temp_dir().join(format!("prism-worker-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("coord.sock");
    let l = UnixListener::bind(&sock).unwrap();
    // Mock coordinator: rank 0 real, rank 1 virtual; every all-reduce (sum over {0, 1}) gets
    // the real contribution twice.
    let mock = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let Some(Body::Hello(h)) = read_frame(&mut s).unwrap() else {
            panic!("Hello first")
        };
        assert_eq!((h.rank, h.world_size), (0, 2));
        write_frame(
            &mut s,
            &Body::Welcome(Welcome {
                world_size: 2,
                real_ranks: vec![0],
            }),
        )
        .unwrap();
        let mut calls = 0u64;
        loop {
            match read_frame(&mut s).unwrap() {
                Some(Body::Call(c)) => {
                    assert_eq!(c.seq, calls, "program-wide op index");
                    assert_eq!(c.op, Op::AllReduce as i32);
                    assert_eq!(c.reduce, ReduceOp::Sum as i32);
                    assert_eq!(c.group, vec![0, 1]);
                    let mut v = vec![0f32; c.data.len() / 4];
                    bytes_to_f32(&c.data, &mut v);
                    let twice: Vec<f32> = v.iter().map(|x| x + x).collect();
                    write_frame(
                        &mut s,
                        &Body::Done(Done {
                            seq: c.seq,
                            emulated_end_s: 0.0,
                            data: f32_bytes(&twice),
                        }),
                    )
                    .unwrap();
                    calls += 1;
                }
                Some(Body::Bye(b)) => return (calls, b.peak_memory_bytes),
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    let out = Command::new(env!("CARGO_BIN_EXE_prism-gpt-worker"))
        .env("PRISM_RANK", "0")
        .env("PRISM_WORLD_SIZE", "2")
        .env("PRISM_LAYOUT", "2,1,1")
        .env("PRISM_COORDINATOR", format!("unix:{}", sock.display()))
        .env_remove("PRISM_TCP_ADDR")
        .args(["--warmup", "1", "--iters", "2", "--timeout-s", "30"])
        .args([
            "--hidden", "16", "--heads", "4", "--ffn", "32", "--layers", "2",
        ])
        .args([
            "--seq",
            "8",
            "--vocab",
            "32",
            "--micro-batches",
            "2",
            "--seed",
            "7",
        ])
        .output()
        .unwrap();
    let (calls, peak) = mock.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cfg = Config::tiny().with_layout("2,1,1").unwrap();
    cfg.lr = Config::reference().lr;
    let (losses, want_peak) = recorded(&cfg, 3);
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (k, line) in lines.iter().enumerate() {
        let want = format!("\"loss\":{:e}", losses[k + 1]);
        assert!(line.contains(&want), "iteration {k}: {line} lacks {want}");
        assert!(
            line.contains(&format!("\"peak_memory_bytes\":{want_peak}")),
            "{line}"
        );
    }
    // 2 layers x 2 micro-batches x 4 all-reduces, 2 measured steps (the warm-up step ran on
    // the recording backend).
    assert_eq!(calls, 2 * 2 * 2 * 4);
    for (k, line) in lines.iter().enumerate() {
        let r = prism_emulate::worker::IterReport::parse(line).unwrap();
        assert_eq!((r.rank, r.iter as usize, r.calls), (0, k, 16));
        assert_eq!(r.loss, losses[k + 1]);
        assert_eq!(r.emulated_end_s, Some(0.0));
        assert_eq!(r.json(), *line);
    }
    assert_eq!(peak, want_peak);
}
