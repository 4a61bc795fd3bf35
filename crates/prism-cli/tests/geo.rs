//! `prism geo`: plan, bubbles and sweep end to end on a small two-DC job (JSON fields, the
//! plot files, zero training slowdown, clear errors).

use std::process::{Command, Output};

fn prism(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run prism")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn geo_plan_and_bubbles() {
    let dir = std::env::temp_dir().join(format!("prism-geo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("wan.svg");
    let v = json(&prism(&[
        "geo",
        "plan",
        "tests/data/geo.toml",
        "--micro-batches",
        "1",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]));
    let atlas = &v["atlas"];
    assert_eq!(atlas["design"], "atlas");
    assert!(atlas["iteration_time_s"].as_f64().unwrap() > 0.0);
    let u = atlas["wan_utilisation"].as_f64().unwrap();
    assert!((0.0..=1.0 + 1e-9).contains(&u));
    assert_eq!(v["baselines"].as_array().unwrap().len(), 3);
    for b in v["baselines"].as_array().unwrap() {
        assert!(b["atlas_speedup"].as_f64().unwrap() > 0.0);
    }
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));

    let b = json(&prism(&[
        "geo",
        "bubbles",
        "tests/data/geo.toml",
        "--rate",
        "200",
        "--duration",
        "2",
        "--json",
    ]));
    assert_eq!(b["training_slowdown"].as_f64().unwrap(), 0.0);
    assert!(
        b["gpu_utilisation_with"].as_f64().unwrap()
            >= b["gpu_utilisation_without"].as_f64().unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn geo_errors_are_clear() {
    // A job without datacenters.
    let out = prism(&["geo", "plan", "tests/data/explore.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[wan]"));
    let out = prism(&[
        "geo",
        "bubbles",
        "tests/data/geo.toml",
        "--prompt",
        "gauss:3",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prompt"));
    let out = prism(&["geo", "bubbles", "tests/data/geo.toml", "--model", "nope"]);
    assert_eq!(out.status.code(), Some(2));
}

/// Issue 51: sweep and plan options outside their rules are errors naming the flag, not a row
/// of "-" with exit 0, a plan with fewer datacenters than asked, or a 10 GiB allocation.
#[test]
fn geo_options_out_of_range_are_errors() {
    for (args, flag) in [
        (
            vec!["geo", "sweep", "--gbps", "0", "--models", "llama3-8b"],
            "--gbps",
        ),
        (
            vec!["geo", "sweep", "--rtt-ms=-10", "--models", "llama3-8b"],
            "--rtt-ms",
        ),
        (
            vec![
                "geo",
                "sweep",
                "--dcs",
                "100000",
                "--models",
                "llama3-8b",
                "--micro-batches",
                "1",
            ],
            "--dcs",
        ),
        (
            vec![
                "geo",
                "plan",
                "../../examples/geo-llama3-70b-2dc.toml",
                "--min-dcs",
                "1000",
            ],
            "--min-dcs 1000",
        ),
    ] {
        let out = prism(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
