//! `prism emulate`: synth -> slice -> coordinator, through the binary.

use std::path::PathBuf;
use std::process::{Command, Output};

fn prism(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("prism-cli-emulate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn synth_slice_and_a_coordinator_fault() {
    let d = dir("flow");
    let traces = d.join("traces");
    let graph = d.join("g.json");
    let out = prism(&[
        "emulate",
        "synth",
        "--layout",
        "2,2,2",
        "--out",
        traces.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = prism(&[
        "emulate",
        "slice",
        "--traces",
        traces.to_str().unwrap(),
        "--layout",
        "2,2,2",
        "--out",
        graph.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ranks"], 8);
    assert_eq!(v["classes"], 2);
    assert!(v["iteration_time_s"].as_f64().unwrap() > 0.0);
    // The human table names the file it wrote.
    let text = prism(&[
        "emulate",
        "slice",
        "--traces",
        traces.to_str().unwrap(),
        "--layout",
        "2,2,2",
        "--out",
        graph.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("g.json"));
    // A wrong layout is refused by name, with exit status 2.
    let out = prism(&[
        "emulate",
        "slice",
        "--traces",
        traces.to_str().unwrap(),
        "--layout",
        "2,2,4",
        "--out",
        d.join("x.json").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank-0.trace") && err.contains("16"), "{err}");
    // A real rank that never connects: a bounded wait, then an error naming it.
    let sock = d.join("c.sock");
    let out = prism(&[
        "emulate",
        graph.to_str().unwrap(),
        "--real-ranks",
        "3",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--timeout-s",
        "0.3",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 3") && err.contains("never arrived"),
        "{err}"
    );
    // A launched rank that fails before connecting is named too.
    let out = prism(&[
        "emulate",
        graph.to_str().unwrap(),
        "--real-ranks",
        "1",
        "--listen",
        &format!("unix:{}", sock.display()),
        "--timeout-s",
        "10",
        "--",
        "sh",
        "-c",
        "exit 4",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 1") && err.contains("before connecting"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `prism emulate validate` end to end on the reference workload (tp 2, pp 2, dp 2), two real
/// ranks in different stages: the JSON carries the contract fields, the error is computed from
/// them, and the real ranks' peak memory equals their all-real peak exactly (the workload's
/// ledger does not depend on the backend). With the deterministic work clock the two runs see
/// the same compute, so the hybrid iteration (sliced recordings, engine, coordinator, live real
/// ranks) must equal the all-real replay: the emulation's own error is zero. A layout that
/// does not match the world is refused by flag.
#[test]
fn validate_runs_all_real_and_hybrid() {
    let o = prism(&[
        "emulate",
        "validate",
        "--world",
        "8",
        "--layout",
        "2,2,2",
        "--real-ranks",
        "0,5",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--repeats",
        "1",
        "--compute-clock",
        "work",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let a = v["all_real"]["iteration_time_s"].as_f64().unwrap();
    let h = v["hybrid"]["iteration_time_s"].as_f64().unwrap();
    assert!(a.is_finite() && a > 0.0 && h.is_finite() && h > 0.0, "{v}");
    let e = v["iteration_time_error_pct"].as_f64().unwrap();
    assert!((e - 100.0 * (h - a).abs() / a).abs() < 1e-9);
    assert!(
        e < 1e-6,
        "work clock: hybrid {h} s vs all-real {a} s ({e}%)"
    );
    assert_eq!(v["peak_memory_error_pct"].as_f64(), Some(0.0));
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        assert!(r["hybrid_peak_memory_bytes"].as_u64().unwrap() > 0);
        assert_eq!(
            r["hybrid_peak_memory_bytes"],
            r["all_real_peak_memory_bytes"]
        );
    }
    let bad = prism(&["emulate", "validate", "--world", "6", "--layout", "2,2,2"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--world 6 does not match"));
}
