//! `prism predict`: training time as a distribution.

use std::process::Command;

fn prism(args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("JSON")
}

fn data(name: &str) -> String {
    format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Without a [variability] section every Monte Carlo iteration is the deterministic one, and
/// with no failures the run takes exactly iterations x step time.
#[test]
fn deterministic_job_has_no_spread() {
    let job = data("variability.toml");
    // `--set` reaches [variability] keys too.
    let det = prism(&[
        "simulate",
        &job,
        "--json",
        "--set",
        "variability.gpu_outlier_fraction=0",
    ]);
    assert!(det["iteration_time_s"].as_f64().unwrap() > 0.0);
    // The same job without variability: strip the section through a copy.
    let text = std::fs::read_to_string(&job).unwrap();
    let plain = text.split("[variability]").next().unwrap().to_string();
    let path = std::env::temp_dir().join(format!("prism-plain-{}.toml", std::process::id()));
    std::fs::write(&path, plain).unwrap();
    let p = path.to_str().unwrap();
    let step = prism(&["simulate", p, "--json"])["iteration_time_s"]
        .as_f64()
        .unwrap();
    let v = prism(&[
        "predict",
        p,
        "--tokens",
        "1e9",
        "--samples",
        "4",
        "--runs",
        "50",
        "--json",
    ]);
    let s = &v["step_time_s"];
    for k in ["mean", "p50", "p99", "min", "max"] {
        assert!((s[k].as_f64().unwrap() / step - 1.0).abs() < 1e-12, "{k}");
    }
    let iterations = v["iterations"].as_f64().unwrap();
    let days = v["training_time_days"]["p50"].as_f64().unwrap();
    // Whole blocks of iterations: at most one block (iterations / 4096 rounded up) extra.
    let block = (iterations / 4096.0).ceil();
    let expect = iterations * step / 86400.0;
    assert!(
        days >= expect * (1.0 - 1e-12)
            && days <= (iterations + block) * step / 86400.0 * (1.0 + 1e-12)
    );
    assert_eq!(v["expected_interruptions"].as_f64().unwrap(), 0.0);
}

/// Same seed, same distribution; variability spreads the step time; interruptions follow the
/// failure rate (Poisson: mean = rate x GPUs x wall time).
#[test]
fn variability_spreads_and_is_seeded() {
    let job = data("variability.toml");
    let args = [
        "predict",
        &job,
        "--tokens",
        "2e11",
        "--samples",
        "16",
        "--runs",
        "400",
        "--json",
        "--seed",
        "3",
    ];
    let a = prism(&args);
    let b = prism(&args);
    assert_eq!(a, b);
    let s = &a["step_time_s"];
    assert!(s["max"].as_f64().unwrap() > s["min"].as_f64().unwrap());
    // 16 clusters are too few for a valid bound at 0.95 / 0.95: none, and the note says why.
    let g = &a["guarantee"];
    assert!(g["training_time_days"].is_null(), "{g}");
    let needed = g["min_clusters"].as_u64().unwrap();
    assert!(
        g["training_time_note"]
            .as_str()
            .unwrap()
            .contains(&format!("needs at least {needed}")),
        "{g}"
    );
    assert_eq!(g["independent_clusters"], 16);
    // Every reported quantile carries its Monte Carlo error, the interval around it.
    for (what, summary) in [
        ("step_time_s", s),
        ("training_time_days", &a["training_time_days"]),
    ] {
        for k in ["p50", "p90", "p95", "p99"] {
            let e = &a[format!("{what}_error")][k];
            let (se, lo, hi) = (
                e["se"].as_f64().unwrap(),
                e["ci95"][0].as_f64().unwrap(),
                e["ci95"][1].as_f64().unwrap(),
            );
            let x = summary[k].as_f64().unwrap();
            assert!(
                se > 0.0 && lo <= x && x <= hi && hi - lo < 8.0 * se + 1e-12,
                "{what} {k}: {e}"
            );
        }
    }
    // With enough clusters there is a guarantee, above the median.
    let more = prism(&[
        "predict",
        &job,
        "--tokens",
        "2e11",
        "--samples",
        "140",
        "--clusters",
        "70",
        "--runs",
        "700",
        "--json",
        "--seed",
        "3",
    ]);
    let g = more["guarantee"]["training_time_days"]
        .as_f64()
        .expect("guarantee with 70 clusters");
    assert!(g >= more["training_time_days"]["p50"].as_f64().unwrap());
    assert!(more["guarantee"]["training_time_note"].is_null());
    // The p95 step is attributed along its critical path; the parts sum to that step's path.
    let attr = a["p95_attribution"].as_array().expect("p95_attribution");
    assert!(!attr.is_empty());
    let sample = &a["p95_attribution_sample"];
    assert!(sample["step_time_s"].as_f64().unwrap() >= s["p90"].as_f64().unwrap());
    let gpus = a["num_gpus"].as_f64().unwrap();
    let mean_h = a["training_time_days"]["mean"].as_f64().unwrap() * 24.0;
    let expect = 2e-5 * gpus * mean_h;
    let got = a["expected_interruptions"].as_f64().unwrap();
    // 400 runs of a Poisson count: standard error sqrt(expect / 400).
    assert!(
        (got - expect).abs() < 4.0 * (expect / 400.0).sqrt() + 0.02,
        "{got} vs {expect}"
    );
}

/// GPU speeds persist within a cluster: with nothing else varying, the samples of one cluster
/// are identical, so there are at most `clusters` distinct step times, and more than one.
#[test]
fn gpu_speeds_persist_within_a_cluster() {
    let job = data("gpu_speed_only.toml");
    let v = prism(&[
        "predict",
        &job,
        "--tokens",
        "1e9",
        "--samples",
        "8",
        "--clusters",
        "2",
        "--runs",
        "20",
        "--json",
    ]);
    let s = &v["step_time_s"];
    let (min, max, p50) = (
        s["min"].as_f64().unwrap(),
        s["max"].as_f64().unwrap(),
        s["p50"].as_f64().unwrap(),
    );
    assert!(
        max > min,
        "two clusters of different GPUs give two step times"
    );
    // Two values, four samples each: the median (type 7) is their midpoint.
    assert!(
        (p50 - 0.5 * (min + max)).abs() <= 1e-12 * max,
        "{min} {p50} {max}"
    );
    assert_eq!(v["clusters"], 2);
}

/// A `prism fit` table drives the Monte Carlo: GEMM jitter and congestion from fitted
/// distributions spread the step time; an unknown signature is an error naming it.
#[test]
fn fit_table_drives_the_variability() {
    let v = prism(&[
        "predict",
        &data("fitted.toml"),
        "--tokens",
        "1e9",
        "--samples",
        "6",
        "--runs",
        "20",
        "--json",
    ]);
    let s = &v["step_time_s"];
    assert!(s["max"].as_f64().unwrap() > s["min"].as_f64().unwrap());
    let o = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args([
            "predict",
            &data("fitted_bad.toml"),
            "--tokens",
            "1e9",
            "--samples",
            "2",
            "--runs",
            "2",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("qkv_magic") && e.contains("fit_table_bad.csv"),
        "{e}"
    );
}

/// A fit-table row named after a kernel of the job (`fc1_fwd`) jitters that kernel: it is the
/// job's only variability, and the step time spreads.
#[test]
fn fit_table_row_can_name_a_kernel() {
    let v = prism(&[
        "predict",
        &data("fitted_op.toml"),
        "--tokens",
        "1e9",
        "--samples",
        "8",
        "--runs",
        "4",
        "--json",
    ]);
    let s = &v["step_time_s"];
    let (min, max) = (s["min"].as_f64().unwrap(), s["max"].as_f64().unwrap());
    println!("fc1_fwd jitter only: step {min} .. {max} s");
    assert!(max > min, "{min} {max}");
}

/// A job the step model does not cover (mixture of experts) is sampled by the per-rank engine,
/// and `step_method` says why.
#[test]
fn engine_fallback_names_its_reason() {
    let dir = std::env::temp_dir().join(format!("prism-predict-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let job = dir.join("moe.toml");
    std::fs::write(
        &job,
        r#"name = "Mixtral 8x7B on 16 H100 with jitter"
[model]
preset = "mixtral-8x7b"
layers = 4
[cluster]
preset = "dgx-h100"
nodes = 2
[parallel]
tp = 2
pp = 1
ep = 8
[training]
global_batch = 16
[variability]
kernel_jitter = { gemm = { dist = "normal", mean = 1.0, std = 0.02 } }
"#,
    )
    .unwrap();
    let v = prism(&[
        "predict",
        job.to_str().unwrap(),
        "--tokens",
        "1e9",
        "--samples",
        "2",
        "--runs",
        "10",
        "--allow-oom",
        "--json",
    ]);
    let method = v["step_method"].as_str().unwrap();
    assert!(
        method.starts_with("every rank simulated by the engine (") && method.contains("mixture"),
        "{method}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Replica pruning (the default) gives the same prediction as evaluating every replica of
/// every sample (`--no-prune`): clusters of 20 samples, two pilots each.
#[test]
fn pruning_changes_no_number() {
    let job = data("pruning.toml");
    let args = |prune: bool| {
        let mut a = vec![
            "predict".to_string(),
            job.clone(),
            "--tokens".into(),
            "1e10".into(),
            "--samples".into(),
            "60".into(),
            "--clusters".into(),
            "3".into(),
            "--runs".into(),
            "100".into(),
            "--json".into(),
        ];
        if !prune {
            a.push("--no-prune".into());
        }
        a
    };
    let run = |prune: bool| {
        let a = args(prune);
        prism(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (pruned, full) = (run(true), run(false));
    assert_eq!(pruned, full);
    // Nothing repeats often enough here to be pooled: `--no-pool` changes nothing either.
    let mut a = args(true);
    a.push("--no-pool".into());
    assert_eq!(
        prism(&a.iter().map(String::as_str).collect::<Vec<_>>()),
        pruned
    );
    let s = &pruned["step_time_s"];
    assert!(s["max"].as_f64().unwrap() > s["min"].as_f64().unwrap());
    assert!(
        pruned["step_method"].as_str().unwrap().contains("max-plus"),
        "{}",
        pruned["step_method"]
    );
}

/// `--check-coverage N`: N seeds against a reference with 10x the clusters; the JSON contract.
#[test]
fn coverage_check_reports_its_contract() {
    let job = data("gpu_speed_only.toml");
    let v = prism(&[
        "predict",
        &job,
        "--tokens",
        "1e9",
        "--samples",
        "140",
        "--clusters",
        "70",
        "--runs",
        "700",
        "--check-coverage",
        "3",
        "--json",
    ]);
    let c = &v["coverage"];
    assert_eq!(c["seeds"], 3);
    assert_eq!(c["nominal"], 0.95);
    assert_eq!(c["reference"]["clusters"], 700);
    assert_eq!(c["reference"]["samples"], 1400);
    let observed = c["observed"].as_f64().unwrap();
    let covered = c["covered"].as_u64().unwrap();
    assert_eq!(observed, covered as f64 / 3.0);
    let r = c["reference_quantile"].as_f64().unwrap();
    let bounds = c["bounds"].as_array().unwrap();
    assert_eq!(bounds.len(), 3);
    let above = bounds.iter().filter(|b| b.as_f64().unwrap() >= r).count() as u64;
    assert_eq!(above, covered);
    let (lo, hi) = (
        c["interval95"][0].as_f64().unwrap(),
        c["interval95"][1].as_f64().unwrap(),
    );
    assert!(lo <= observed && observed <= hi);
    assert!(c["median_margin_pct"].is_number() && c["step_time_s"]["observed"].is_number());
}
