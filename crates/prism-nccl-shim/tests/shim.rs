//! The NCCL shim driven through its C ABI on host buffers against a mock coordinator: world
//! communicator, collectives, send/recv, sub-groups, errors, and the session's Bye.

#![allow(unsafe_code)]

use std::ffi::CStr;
use std::os::unix::net::UnixListener;
use std::ptr::null_mut;

use nccl::*;
use prism_emulate::comm::{bytes_to_f32, f32_bytes};
use prism_emulate::protocol::{Body, Call, Done, Op, Welcome, read_frame, write_frame};

const F32: i32 = 7;
const SUM: i32 = 0;

fn last_error() -> String {
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn nccl_calls_reach_the_coordinator() {
    let dir = std::env::temp_dir().join(format!("prism-shim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("c.sock");
    let l = UnixListener::bind(&sock).unwrap();
    // Rank 0 real in a world of 4; virtual ranks contribute copies (sums scale by the group
    // size, gathers repeat), receives are ramps.
    let mock = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let Some(Body::Hello(_)) = read_frame(&mut s).unwrap() else {
            panic!()
        };
        write_frame(
            &mut s,
            &Body::Welcome(Welcome {
                world_size: 4,
                real_ranks: vec![0],
            }),
        )
        .unwrap();
        let mut calls: Vec<Call> = Vec::new();
        loop {
            match read_frame(&mut s).unwrap() {
                Some(Body::Call(c)) => {
                    let g = c.group.len();
                    let mut v = vec![0f32; c.data.len() / 4];
                    bytes_to_f32(&c.data, &mut v);
                    let data = match Op::try_from(c.op).unwrap() {
                        Op::AllReduce => {
                            f32_bytes(&v.iter().map(|x| x * g as f32).collect::<Vec<_>>())
                        }
                        Op::AllGather => c.data.repeat(g),
                        Op::ReduceScatter => f32_bytes(
                            &v[..v.len() / g]
                                .iter()
                                .map(|x| x * g as f32)
                                .collect::<Vec<_>>(),
                        ),
                        Op::Broadcast | Op::AllToAll => c.data.clone(),
                        Op::Recv => {
                            f32_bytes(&(0..c.bytes / 4).map(|i| i as f32).collect::<Vec<_>>())
                        }
                        _ => Vec::new(),
                    };
                    write_frame(
                        &mut s,
                        &Body::Done(Done {
                            seq: c.seq,
                            emulated_end_s: 0.0,
                            data,
                        }),
                    )
                    .unwrap();
                    calls.push(c);
                }
                Some(Body::Bye(_)) => return (calls, true),
                _ => return (calls, false),
            }
        }
    });
    set_env_override(&[
        ("PRISM_RANK", "0"),
        ("PRISM_WORLD_SIZE", "4"),
        ("PRISM_COORDINATOR", &format!("unix:{}", sock.display())),
        ("PRISM_TIMEOUT_S", "10"),
    ]);
    unsafe {
        let mut v = 0;
        assert_eq!(ncclGetVersion(&mut v), NCCL_SUCCESS);
        assert_eq!(v, NCCL_VERSION_CODE);
        let mut id = NcclUniqueId { internal: [0; 128] };
        assert_eq!(ncclGetUniqueId(&mut id), NCCL_SUCCESS);
        let mut world: *mut Comm = null_mut();
        assert_eq!(ncclCommInitRank(&mut world, 4, id, 0), NCCL_SUCCESS);
        let mut n = 0;
        ncclCommCount(world, &mut n);
        assert_eq!(n, 4);

        // In-place all-reduce.
        let mut x = [1.0f32, -0.5];
        let p = x.as_mut_ptr() as *mut _;
        assert_eq!(
            ncclAllReduce(p, p, 2, F32, SUM, world, null_mut()),
            NCCL_SUCCESS
        );
        assert_eq!(x, [4.0, -2.0]);
        let send = [3.0f32];
        let mut ag = [0.0f32; 4];
        assert_eq!(
            ncclAllGather(
                send.as_ptr() as *const _,
                ag.as_mut_ptr() as *mut _,
                1,
                F32,
                world,
                null_mut()
            ),
            NCCL_SUCCESS
        );
        assert_eq!(ag, [3.0; 4]);
        let rs_in = [1.0f32, 2.0, 3.0, 4.0];
        let mut rs = [0.0f32];
        assert_eq!(
            ncclReduceScatter(
                rs_in.as_ptr() as *const _,
                rs.as_mut_ptr() as *mut _,
                1,
                F32,
                SUM,
                world,
                null_mut()
            ),
            NCCL_SUCCESS
        );
        assert_eq!(rs, [4.0]);
        let mut r = [9.0f32; 3];
        assert_eq!(
            ncclRecv(r.as_mut_ptr() as *mut _, 3, F32, 2, world, null_mut()),
            NCCL_SUCCESS
        );
        assert_eq!(r, [0.0, 1.0, 2.0]);
        assert_eq!(
            ncclSend(send.as_ptr() as *const _, 1, F32, 3, world, null_mut()),
            NCCL_SUCCESS
        );

        // A sub-group needs its global ranks first.
        let mut sub: *mut Comm = null_mut();
        assert_eq!(ncclCommInitRank(&mut sub, 2, id, 0), NCCL_INVALID_USAGE);
        assert!(
            last_error().contains("global ranks are unknown"),
            "{}",
            last_error()
        );
        let ranks = [0, 2];
        assert_eq!(prismNcclSetNextGroup(ranks.as_ptr(), 2), NCCL_SUCCESS);
        assert_eq!(ncclCommInitRank(&mut sub, 2, id, 0), NCCL_SUCCESS);
        let mut y = [1.5f32];
        let q = y.as_mut_ptr() as *mut _;
        assert_eq!(
            ncclAllReduce(q, q, 1, F32, SUM, sub, null_mut()),
            NCCL_SUCCESS
        );
        assert_eq!(y, [3.0]);
        // Bad arguments are refused by name.
        assert_eq!(
            ncclAllReduce(q, q, 1, 99, SUM, sub, null_mut()),
            NCCL_INVALID_ARGUMENT
        );
        assert!(last_error().contains("unknown datatype 99"));
        assert_eq!(
            ncclSend(q, 1, F32, 5, sub, null_mut()),
            NCCL_INVALID_ARGUMENT
        );
        assert!(last_error().contains("peer 5 outside a communicator of 2"));
        assert!(!ncclGetErrorString(NCCL_INVALID_USAGE).is_null());
        assert_eq!(ncclCommDestroy(sub), NCCL_SUCCESS);
        assert_eq!(ncclCommDestroy(world), NCCL_SUCCESS);
    }
    let (calls, bye) = mock.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bye, "the last destroy ends the session");
    let ops: Vec<i32> = calls.iter().map(|c| c.op).collect();
    assert_eq!(
        ops,
        [
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Recv,
            Op::Send,
            Op::AllReduce
        ]
        .map(|o| o as i32)
    );
    assert_eq!(calls[0].group, vec![0, 1, 2, 3]);
    assert_eq!((calls[3].peer, calls[4].peer), (2, 3));
    assert_eq!(calls[5].group, vec![0, 2]);
}

/// The built `libnccl.so` (next to the test's `deps` directory), loaded by Python's ctypes:
/// the real C ABI, including the 128-byte unique id passed by value.
#[test]
fn the_shared_library_works_through_ctypes() {
    let py = std::process::Command::new("python3")
        .arg("--version")
        .output();
    if !matches!(&py, Ok(o) if o.status.success()) {
        eprintln!("python3 not found: the ctypes test of the NCCL shim did not run");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let mut lib = profile_dir.join("libnccl.so");
    if !lib.exists() {
        // `cargo test` links the test against the rlib and need not build the cdylib: build
        // it here, in a target directory of its own (no lock shared with the running cargo).
        let target = profile_dir.parent().unwrap().join("nccl-shim-test");
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "-p", "prism-nccl-shim", "--lib", "--target-dir"])
            .arg(&target)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the shim's cdylib failed");
        lib = target.join("debug").join("libnccl.so");
    }
    assert!(lib.exists(), "{} was not built", lib.display());
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new("python3")
        .args(["-m", "unittest", "-v", "tests.test_nccl_shim"])
        .current_dir(repo.join("python"))
        .env("PYTHONPATH", repo.join("python"))
        .env("PRISM_NCCL_SHIM", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("test_c_abi_through_ctypes") && text.contains(" ok"),
        "{text}"
    );
}
