//! The Python client: golden frames written by this (Rust, prost) encoder, which the Python
//! codec must decode and re-encode byte for byte, and the Python test suite itself (run with
//! `python3 -m unittest` when python3 exists; torch tests skip themselves without torch).

use std::path::PathBuf;
use std::process::Command;

use prism_emulate::protocol::*;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The samples; `python/tests/test_protocol.py` lists the same values.
fn samples() -> Vec<Body> {
    vec![
        Body::Hello(Hello {
            rank: 5,
            world_size: 8192,
            client: "prism-rust 0.1 \u{3bb}".into(),
        }),
        Body::Welcome(Welcome {
            world_size: 65536,
            real_ranks: vec![0, 5, 300, 65535],
        }),
        Body::Call(Call {
            seq: 17,
            op: Op::AllReduce as i32,
            group: vec![0, 1, 2, 3],
            bytes: 8,
            dtype: DType::F32 as i32,
            reduce: ReduceOp::Avg as i32,
            peer: 0,
            data: vec![0, 0, 128, 63, 0, 0, 0, 64],
            compute_s: 0.0125,
        }),
        Body::Call(Call {
            seq: u64::MAX,
            op: Op::Recv as i32,
            group: vec![],
            bytes: 1 << 40,
            dtype: DType::Bf16 as i32,
            reduce: ReduceOp::Sum as i32,
            peer: u32::MAX,
            data: vec![],
            compute_s: -2.5e-300,
        }),
        Body::Done(Done {
            seq: 17,
            emulated_end_s: 1.5,
            data: vec![1, 2, 3],
        }),
        Body::Fault(Fault {
            rank: 3,
            group: vec![2, 3],
            op_index: 9,
            message: "never arrived".into(),
        }),
        Body::Bye(Bye::default()),
        Body::Bye(Bye {
            compute_s: 0.75,
            peak_memory_bytes: 123_456_789_012,
        }),
    ]
}

fn golden() -> Vec<u8> {
    let mut out = Vec::new();
    for b in samples() {
        write_frame(&mut out, &b).unwrap();
    }
    out
}

#[test]
fn checked_in_golden_frames_are_this_encoders_bytes() {
    let path = repo().join("python/tests/golden/frames.bin");
    if std::env::var_os("PRISM_BLESS").is_some() {
        std::fs::write(&path, golden()).unwrap();
    }
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(
        on_disk,
        golden(),
        "python/tests/golden/frames.bin differs from the Rust encoder (PRISM_BLESS=1 rewrites it)"
    );
    let mut r = on_disk.as_slice();
    for b in samples() {
        assert_eq!(read_frame(&mut r).unwrap(), Some(b));
    }
}

#[test]
fn python_test_suite_passes() {
    let py = Command::new("python3").arg("--version").output();
    if !matches!(&py, Ok(o) if o.status.success()) {
        eprintln!("python3 not found: the Python client tests did not run");
        return;
    }
    let out = Command::new("python3")
        .args([
            "-m",
            "unittest",
            "discover",
            "-s",
            "python/tests",
            "-t",
            "python",
            "-v",
        ])
        .current_dir(repo())
        .env("PYTHONPATH", repo().join("python"))
        .env("PRISM_GPT_WORKER", env!("CARGO_BIN_EXE_prism-gpt-worker"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "python3 -m unittest failed:\n{text}");
    assert!(text.contains("OK"), "{text}");
}
