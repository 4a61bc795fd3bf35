//! The Rust client: the TCP mesh against closed forms, the recording backend's trace, and the
//! emulated backend against a mock coordinator (answers, faults, time-outs, disconnects).

use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use prism_emulate::comm::{CommError, Communicator, ReduceOp, Trace, f32_bytes};
use prism_emulate::protocol::{Body, Call, Done, Fault, Op, Welcome, read_frame, write_frame};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A clock that advances by `step` on each reading.
fn counter(step: f64) -> Box<dyn FnMut() -> f64 + Send> {
    let mut t = 0.0;
    Box::new(move || {
        t += step;
        t
    })
}

/// Runs `f(comm)` on `world` TCP ranks (threads), returning each rank's result.
fn on_mesh<T: Send>(world: u32, f: impl Fn(&mut Communicator) -> T + Sync) -> Vec<T> {
    let addr = format!("127.0.0.1:{}", free_port());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                let f = &f;
                s.spawn(move || {
                    let mut c =
                        Communicator::tcp(r, world, &addr, Duration::from_secs(20)).unwrap();
                    let out = f(&mut c);
                    c.finish(0).unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r's test vector: values that are not exactly representable sums, so order matters.
fn contrib(r: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 * (r as f32 + 1.0) + 0.37 * i as f32 - 0.013 * (r * r) as f32)
        .collect()
}

#[test]
fn tcp_collectives_match_closed_forms() {
    let world = 4u32;
    let n = 8usize;
    let group: Vec<u32> = (0..world).collect();
    let results = on_mesh(world, |c| {
        let r = c.rank();
        let mut ar = contrib(r, n);
        c.all_reduce(&group, &mut ar, ReduceOp::Sum).unwrap();
        let mut mx = contrib(r, n);
        c.all_reduce(&group, &mut mx, ReduceOp::Max).unwrap();
        let mut avg = contrib(r, n);
        c.all_reduce(&group, &mut avg, ReduceOp::Avg).unwrap();
        let mut rs = vec![0.0f32; n / world as usize];
        c.reduce_scatter(&group, &contrib(r, n), &mut rs, ReduceOp::Sum)
            .unwrap();
        let mut ag = vec![0.0f32; n * world as usize];
        c.all_gather(&group, &contrib(r, n), &mut ag).unwrap();
        let mut a2a = vec![0.0f32; n];
        c.all_to_all(&group, &contrib(r, n), &mut a2a).unwrap();
        let mut bc = contrib(r, n);
        c.broadcast(&group, 2, &mut bc).unwrap();
        // A ring of sends: even ranks send first, odd ranks receive first.
        let next = (r + 1) % world;
        let prev = (r + world - 1) % world;
        let mut got = vec![0.0f32; n];
        if r % 2 == 0 {
            c.send(next, &contrib(r, n)).unwrap();
            c.recv(prev, &mut got).unwrap();
        } else {
            c.recv(prev, &mut got).unwrap();
            c.send(next, &contrib(r, n)).unwrap();
        }
        // A sub-group collective.
        let pair = if r < 2 { vec![0, 1] } else { vec![2, 3] };
        let mut sub = contrib(r, n);
        c.all_reduce(&pair, &mut sub, ReduceOp::Sum).unwrap();
        c.barrier(&group).unwrap();
        (ar, mx, avg, rs, ag, a2a, bc, got, sub)
    });
    let cs: Vec<Vec<f32>> = (0..world).map(|r| contrib(r, n)).collect();
    for (r, (ar, mx, avg, rs, ag, a2a, bc, got, sub)) in results.iter().enumerate() {
        let chunk = n / world as usize;
        for i in 0..n {
            // Left fold in group-rank order, exactly.
            let s = ((cs[0][i] + cs[1][i]) + cs[2][i]) + cs[3][i];
            assert_eq!(ar[i].to_bits(), s.to_bits(), "rank {r} all-reduce elem {i}");
            assert_eq!(avg[i], s / 4.0);
            assert_eq!(mx[i], cs.iter().map(|c| c[i]).fold(f32::MIN, f32::max));
            assert_eq!(bc[i], cs[2][i]);
            assert_eq!(
                got[i],
                cs[(r + 3) % 4][i],
                "rank {r} received from its left"
            );
            let base = if r < 2 { 0 } else { 2 };
            assert_eq!(sub[i], cs[base][i] + cs[base + 1][i]);
        }
        for (k, got) in rs.iter().enumerate() {
            let i = r * chunk + k;
            assert_eq!(*got, ((cs[0][i] + cs[1][i]) + cs[2][i]) + cs[3][i]);
        }
        for j in 0..world as usize {
            assert_eq!(&ag[j * n..(j + 1) * n], cs[j].as_slice());
            assert_eq!(
                &a2a[j * chunk..(j + 1) * chunk],
                &cs[j][r * chunk..(r + 1) * chunk]
            );
        }
    }
    // Every rank holds the same bits.
    for r in 1..world as usize {
        assert_eq!(results[r].0, results[0].0);
    }
}

#[test]
fn tcp_mismatched_programs_fail_naming_rank_and_op() {
    let errs = on_mesh(2, |c| {
        let mut b = vec![1.0f32; if c.rank() == 0 { 2 } else { 3 }];
        c.all_reduce(&[0, 1], &mut b, ReduceOp::Sum)
            .unwrap_err()
            .to_string()
    });
    assert!(errs[0].contains("rank 0, op 0"), "{}", errs[0]);
    assert!(
        errs[0].contains("rank 1 sent a AllReduce of 12 bytes"),
        "{}",
        errs[0]
    );
}

#[test]
fn tcp_peer_that_leaves_is_named() {
    let errs = on_mesh(2, |c| {
        if c.rank() == 1 {
            c.finish(0).unwrap();
            return String::new();
        }
        let mut b = vec![0.0f32; 4];
        c.recv(1, &mut b).unwrap_err().to_string()
    });
    assert!(
        errs[0].contains("rank 1 closed the connection"),
        "{}",
        errs[0]
    );
}

#[test]
fn bad_arguments_are_refused_before_any_traffic() {
    let mut c = Communicator::local(1, 4);
    let mut out = vec![0.0f32; 3];
    let e = c
        .reduce_scatter(&[0, 1, 2, 3], &[0.0; 8], &mut out, ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("rank 1, op 0"), "{e}");
    let e = c.send(9, &[1.0]).unwrap_err();
    assert!(e.to_string().contains("outside the world of 4"), "{e}");
    let e = c
        .all_reduce(&[0, 2], &mut [1.0], ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("does not hold the rank"), "{e}");
}

#[test]
fn local_backend_synthesises_and_records_the_trace() {
    let mut c = Communicator::with_clock(
        1,
        4,
        Box::new(prism_emulate::comm::local::LocalBackend::new(1)),
        counter(0.5),
    );
    let g = [0, 1, 2, 3];
    let mut x = vec![1.5f32, -2.0];
    c.all_reduce(&g, &mut x, ReduceOp::Sum).unwrap();
    assert_eq!(
        x,
        vec![6.0, -8.0],
        "four copies of this rank's contribution"
    );
    let mut ag = vec![0.0f32; 4];
    c.all_gather(&[1, 3], &[7.0, 8.0], &mut ag).unwrap();
    assert_eq!(ag, vec![7.0, 8.0, 7.0, 8.0]);
    let mut rs = vec![0.0f32; 1];
    c.reduce_scatter(&[0, 1], &[1.0, 2.0], &mut rs, ReduceOp::Avg)
        .unwrap();
    assert_eq!(rs, vec![2.0], "chunk of group index 1");
    let mut r = vec![9.0f32; 3];
    c.recv(0, &mut r).unwrap();
    assert_eq!(r, vec![0.0; 3]);
    let t = c.finish(1234).unwrap();
    assert_eq!(t.calls.len(), 4);
    assert_eq!(
        t.calls.iter().map(|c| c.seq).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    // The clock reads once at construction, once per call start and once per release, so each
    // call's compute and the tail are one tick.
    for call in &t.calls {
        assert_eq!(call.compute_s, 0.5);
        assert!(call.data.is_empty());
    }
    assert_eq!(t.calls[3].op, Op::Recv as i32);
    assert_eq!(t.calls[3].bytes, 12);
    assert_eq!(t.calls[1].group, vec![1, 3]);
    assert_eq!(t.tail_compute_s, 0.5);
    assert_eq!(t.peak_memory_bytes, 1234);
    let mut wire = Vec::new();
    t.write(&mut wire).unwrap();
    let back = Trace::read(&mut wire.as_slice()).unwrap();
    assert_eq!(back, t);
}

#[test]
fn iterations_split_the_trace() {
    let mut c = Communicator::with_clock(
        0,
        1,
        Box::new(prism_emulate::comm::local::LocalBackend::new(0)),
        counter(1.0),
    );
    c.barrier(&[0]).unwrap();
    let first = c.start_iteration(10);
    c.barrier(&[0]).unwrap();
    c.barrier(&[0]).unwrap();
    let second = c.finish(20).unwrap();
    assert_eq!(first.calls.len(), 1);
    assert_eq!(second.calls.len(), 2);
    assert_eq!(second.calls[0].seq, 0);
    assert_eq!(first.peak_memory_bytes, 10);
    assert_eq!(second.peak_memory_bytes, 20);
}

static SOCK: AtomicU32 = AtomicU32::new(0);

fn sock_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "prism-comm-test-{}-{}.sock",
        std::process::id(),
        SOCK.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A mock coordinator on a Unix socket: answers `Welcome`, then lets `answer` reply to each
/// call (`None`: say nothing and hold the connection for a while; `Some(body)`: send it).
/// Returns the calls it saw and the final `Bye`, if any.
fn mock(
    path: &std::path::Path,
    world: u32,
    answer: impl Fn(&Call) -> Option<Body> + Send + 'static,
) -> std::thread::JoinHandle<(Vec<Call>, Option<Body>)> {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut calls = Vec::new();
        let Some(Body::Hello(h)) = read_frame(&mut s).unwrap() else {
            panic!("first frame must be Hello")
        };
        write_frame(
            &mut s,
            &Body::Welcome(Welcome {
                world_size: world,
                real_ranks: vec![h.rank],
            }),
        )
        .unwrap();
        loop {
            match read_frame(&mut s) {
                Ok(Some(Body::Call(c))) => {
                    let a = answer(&c);
                    calls.push(c);
                    match a {
                        Some(b) => write_frame(&mut s, &b).unwrap(),
                        None => {
                            std::thread::sleep(Duration::from_millis(600));
                            return (calls, None);
                        }
                    }
                }
                Ok(Some(b @ Body::Bye(_))) => return (calls, Some(b)),
                _ => return (calls, None),
            }
        }
    })
}

fn emulated(path: &std::path::Path, rank: u32, world: u32, timeout_ms: u64) -> Communicator {
    let b = prism_emulate::comm::emulated::EmulatedBackend::connect(
        rank,
        world,
        &format!("unix:{}", path.display()),
        Duration::from_secs(5),
        Duration::from_millis(timeout_ms),
    )
    .unwrap();
    Communicator::with_clock(rank, world, Box::new(b), counter(0.25))
}

#[test]
fn emulated_backend_speaks_protocol_v1() {
    let p = sock_path();
    // The mock sums its contribution with a virtual copy (doubles it) for reductions, answers
    // receives with a ramp, and stamps emulated time = 10 * seq.
    let h = mock(&p, 8, |c| {
        let data = match Op::try_from(c.op).unwrap() {
            Op::AllReduce => {
                let mut v = vec![0f32; c.data.len() / 4];
                prism_emulate::comm::bytes_to_f32(&c.data, &mut v);
                f32_bytes(&v.iter().map(|x| 2.0 * x).collect::<Vec<_>>())
            }
            Op::Recv => f32_bytes(&(0..c.bytes / 4).map(|i| i as f32).collect::<Vec<_>>()),
            _ => Vec::new(),
        };
        Some(Body::Done(Done {
            seq: c.seq,
            emulated_end_s: 10.0 * c.seq as f64,
            data,
        }))
    });
    let mut c = emulated(&p, 3, 8, 5000);
    let mut x = vec![1.0f32, 2.5];
    c.all_reduce(&[2, 3], &mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, vec![2.0, 5.0]);
    c.send(7, &[4.0]).unwrap();
    let mut r = vec![0.0f32; 3];
    c.recv(7, &mut r).unwrap();
    assert_eq!(r, vec![0.0, 1.0, 2.0]);
    assert_eq!(c.emulated_time(), Some(20.0));
    c.finish(4096).unwrap();
    let (calls, bye) = h.join().unwrap();
    let _ = std::fs::remove_file(&p);
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[0].group, vec![2, 3]);
    assert_eq!(calls[0].data, f32_bytes(&[1.0, 2.5]));
    assert_eq!(calls[0].compute_s, 0.25);
    assert_eq!(calls[1].op, Op::Send as i32);
    assert_eq!(calls[1].peer, 7);
    assert_eq!(calls[2].bytes, 12);
    assert!(calls[2].data.is_empty());
    for (i, c) in calls.iter().enumerate() {
        assert_eq!(c.seq, i as u64);
        c.validate(3).unwrap();
    }
    match bye {
        Some(Body::Bye(b)) => {
            assert_eq!(b.peak_memory_bytes, 4096);
            assert_eq!(b.compute_s, 0.25);
        }
        other => panic!("expected Bye, got {other:?}"),
    }
}

#[test]
fn emulated_fault_names_rank_group_and_op() {
    let p = sock_path();
    let h = mock(&p, 4, |c| {
        Some(if c.seq == 1 {
            Body::Fault(Fault {
                rank: 2,
                group: c.group.clone(),
                op_index: c.seq,
                message: "size differs from the graph".into(),
            })
        } else {
            Body::Done(Done {
                seq: c.seq,
                emulated_end_s: 0.0,
                data: Vec::new(),
            })
        })
    });
    let mut c = emulated(&p, 1, 4, 5000);
    c.barrier(&[0, 1]).unwrap();
    let e = c.barrier(&[1, 2]).unwrap_err();
    assert!(
        matches!(&e, CommError::Fault { rank: 2, op_index: 1, group, .. } if group == &vec![1, 2]),
        "{e:?}"
    );
    assert!(e.to_string().contains("size differs from the graph"));
    drop(c);
    h.join().unwrap();
    let _ = std::fs::remove_file(&p);
}

#[test]
fn emulated_silence_is_a_bounded_time_out() {
    let p = sock_path();
    let h = mock(&p, 2, |_| None);
    let mut c = emulated(&p, 0, 2, 100);
    let e = c.barrier(&[0, 1]).unwrap_err().to_string();
    assert!(
        e.contains("no answer from the coordinator within 0.1 s"),
        "{e}"
    );
    assert!(e.contains("rank 0, op 0"), "{e}");
    h.join().unwrap();
    let _ = std::fs::remove_file(&p);
}

#[test]
fn emulated_disconnect_and_wrong_world_are_named() {
    let p = sock_path();
    let h = mock(&p, 2, |_| Some(Body::Bye(Default::default())));
    let mut c = emulated(&p, 0, 2, 5000);
    let e = c.barrier(&[0, 1]).unwrap_err().to_string();
    assert!(e.contains("expected Done, got Bye"), "{e}");
    drop(c);
    h.join().unwrap();
    let _ = std::fs::remove_file(&p);

    let p = sock_path();
    let h = mock(&p, 16, |_| None);
    let e = prism_emulate::comm::emulated::EmulatedBackend::connect(
        0,
        8,
        &format!("unix:{}", p.display()),
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(e.contains("world of 16, this rank believes in 8"), "{e}");
    h.join().unwrap();
    let _ = std::fs::remove_file(&p);

    let e = prism_emulate::comm::emulated::EmulatedBackend::connect(
        0,
        8,
        "unix:/nonexistent/prism.sock",
        Duration::from_millis(50),
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(e.contains("cannot connect to the coordinator"), "{e}");
}

#[test]
fn compute_lock_keeps_ranks_from_computing_together() {
    use std::sync::atomic::AtomicI32;
    let dir = std::env::temp_dir().join(format!("prism-lock-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lock = dir.join("compute.lock");
    let inside = AtomicI32::new(0);
    let overlaps = AtomicI32::new(0);
    std::thread::scope(|s| {
        for r in 0..3u32 {
            let (lock, inside, overlaps) = (&lock, &inside, &overlaps);
            s.spawn(move || {
                let mut c = Communicator::local(r, 3);
                c.set_compute_lock(lock).unwrap();
                for _ in 0..20 {
                    // "Compute": nobody else may be inside.
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::sleep(Duration::from_micros(300));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    c.barrier(&[r]).unwrap();
                }
                c.finish(0).unwrap();
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(overlaps.load(Ordering::SeqCst), 0);
}

#[test]
fn synthesize_refuses_bad_lengths_instead_of_panicking() {
    use prism_emulate::comm::reduce::synthesize;
    use prism_emulate::protocol::DType;
    let mut out = vec![0u8; 4];
    let e = synthesize(
        Op::ReduceScatter,
        DType::F32,
        ReduceOp::Sum,
        2,
        5,
        &[0; 8],
        &mut out,
    );
    assert!(e.unwrap_err().contains("group index 5 of 2"));
    let e = synthesize(
        Op::AllGather,
        DType::F32,
        ReduceOp::Sum,
        2,
        0,
        &[0; 8],
        &mut out,
    );
    assert!(e.is_err());
    let e = synthesize(
        Op::AllReduce,
        DType::F32,
        ReduceOp::Sum,
        2,
        0,
        &[0; 6],
        &mut [0; 6],
    );
    assert!(e.unwrap_err().contains("whole number"));
    let mut ok = vec![0u8; 8];
    synthesize(
        Op::AllReduce,
        DType::I32,
        ReduceOp::Max,
        3,
        1,
        &f32_bytes(&[1.0, 2.0]),
        &mut ok,
    )
    .unwrap();
    assert_eq!(ok, f32_bytes(&[1.0, 2.0]), "max of copies is the input");
}

#[test]
fn from_env_picks_the_backend_and_names_missing_variables() {
    let env = |pairs: Vec<(&'static str, String)>| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    };
    let e = Communicator::from_env_with(env(vec![("PRISM_RANK", "0".into())])).unwrap_err();
    assert!(e.to_string().contains("PRISM_WORLD_SIZE is not set"), "{e}");
    let e = Communicator::from_env_with(env(vec![
        ("PRISM_RANK", "0".into()),
        ("PRISM_WORLD_SIZE", "2".into()),
    ]))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("neither PRISM_COORDINATOR nor PRISM_TCP_ADDR"),
        "{e}"
    );
    let e = Communicator::from_env_with(env(vec![
        ("PRISM_RANK", "2".into()),
        ("PRISM_WORLD_SIZE", "2".into()),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("outside a world of 2"), "{e}");
    // A world of one over TCP needs no peers.
    let mut c = Communicator::from_env_with(env(vec![
        ("PRISM_RANK", "0".into()),
        ("PRISM_WORLD_SIZE", "1".into()),
        ("PRISM_TCP_ADDR", format!("127.0.0.1:{}", free_port())),
    ]))
    .unwrap();
    assert_eq!(c.backend_name(), "tcp");
    let mut x = vec![3.0f32];
    c.all_reduce(&[0], &mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, vec![3.0]);
    // The emulated backend wins when both are set.
    let p = sock_path();
    let h = mock(&p, 1, |c| {
        Some(Body::Done(Done {
            seq: c.seq,
            emulated_end_s: 0.0,
            data: Vec::new(),
        }))
    });
    let mut c = Communicator::from_env_with(env(vec![
        ("PRISM_RANK", "0".into()),
        ("PRISM_WORLD_SIZE", "1".into()),
        ("PRISM_TCP_ADDR", "127.0.0.1:1".into()),
        ("PRISM_COORDINATOR", format!("unix:{}", p.display())),
        ("PRISM_TIMEOUT_S", "5".into()),
    ]))
    .unwrap();
    assert_eq!(c.backend_name(), "emulated");
    c.barrier(&[0]).unwrap();
    c.finish(0).unwrap();
    h.join().unwrap();
    let _ = std::fs::remove_file(&p);
}
