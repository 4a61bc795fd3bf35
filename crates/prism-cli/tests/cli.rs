//! The `prism` binary as a user runs it: output contracts, traces and errors.

use std::path::PathBuf;
use std::process::{Command, Output};

fn prism(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `prism` with `args`, which must succeed, and parses its stdout as one JSON object.
fn json_of(args: &[&str]) -> serde_json::Value {
    let o = prism(args);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("stdout is one JSON object")
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prism-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small job (2 nodes of H100, GPT-1.7B, tp 2 pp 2 dp 4) written to a temporary file.
fn small_job_file(name: &str, extra: &str) -> PathBuf {
    let path = tmp(name);
    let text = format!(
        "name = \"small\"\n[model]\npreset = \"gpt-1.7b\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 2\n\
         [parallel]\ntp = 2\npp = 2\n[training]\nglobal_batch = 32\n{extra}"
    );
    std::fs::write(&path, text).unwrap();
    path
}

const CONTRACT: [&str; 9] = [
    "iteration_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "hfu",
    "peak_memory_bytes",
    "bubble_fraction",
    "num_gpus",
];

#[test]
fn default_example_json_has_the_contract_fields() {
    let v = json_of(&["simulate", "--reduced", "--json"]);
    for k in CONTRACT {
        assert!(v[k].is_number(), "{k} missing or not a number");
    }
    assert_eq!(v["num_gpus"], 16384);
    let mfu = v["mfu"].as_f64().unwrap();
    assert!(mfu > 0.1 && mfu < 0.7, "mfu {mfu}");
    // Tokens per iteration / iteration time = tokens/s.
    let t = v["iteration_time_s"].as_f64().unwrap();
    let tps = v["tokens_per_s"].as_f64().unwrap();
    assert!((tps * t / (2048.0 * 8192.0) - 1.0).abs() < 1e-9);
}

#[test]
fn human_summary_and_full_equals_reduced() {
    let job = small_job_file("sum.toml", "");
    let job = job.to_str().unwrap();
    let full = prism(&["simulate", job]);
    assert!(full.status.success(), "{}", stderr(&full));
    let text = stdout(&full);
    for needle in [
        "iteration time",
        "MFU",
        "HFU",
        "pipeline bubble",
        "peak memory",
        "exposed TP comm",
    ] {
        assert!(text.contains(needle), "summary lacks {needle}:\n{text}");
    }
    let a = json_of(&["simulate", job, "--json"]);
    let b = json_of(&["simulate", job, "--json", "--reduced"]);
    assert_eq!(a["iteration_time_s"], b["iteration_time_s"]);
}

#[test]
fn trace_is_valid_chrome_json() {
    let job = small_job_file("trace.toml", "");
    let out = tmp("trace.json");
    let o = prism(&[
        "simulate",
        job.to_str().unwrap(),
        "--trace",
        out.to_str().unwrap(),
        "--trace-ranks",
        "0,5,15",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let mut pids: Vec<u64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(
        pids,
        vec![1, 6, 16],
        "one process per traced rank (pid = rank + 1)"
    );
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "M" && e["name"] == "thread_name")
    );
    // Issue 51: ranks that a reduced or sliced run does not simulate are an error naming
    // them, not a trace that silently holds fewer ranks.
    let j = job.to_str().unwrap();
    let t = out.to_str().unwrap();
    let o = prism(&[
        "simulate",
        j,
        "--reduced",
        "--trace",
        t,
        "--trace-ranks",
        "0,5,15",
    ]);
    assert!(!o.status.success() && stderr(&o).contains("--trace-ranks with --reduced"));
    let o = prism(&[
        "simulate",
        j,
        "--ranks",
        "0,5",
        "--trace",
        t,
        "--trace-ranks",
        "0,15",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("does not simulate (15)"),
        "{}",
        stderr(&o)
    );
    let o = prism(&[
        "simulate",
        j,
        "--ranks",
        "0,5",
        "--trace",
        t,
        "--trace-ranks",
        "5",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn ranks_slice_matches_the_full_run() {
    let job = small_job_file("slice.toml", "");
    let job = job.to_str().unwrap();
    let full = json_of(&["simulate", job, "--json"]);
    let slice = json_of(&["simulate", job, "--json", "--ranks", "3,12"]);
    assert_eq!(full["iteration_time_s"], slice["iteration_time_s"]);
    let ranks = slice["ranks"].as_array().unwrap();
    let find = |v: &serde_json::Value, r: u64| -> serde_json::Value {
        v["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["rank"] == r)
            .cloned()
            .unwrap()
    };
    assert_eq!(ranks.len(), 2);
    for r in [3, 12] {
        assert_eq!(find(&full, r)["finish_s"], find(&slice, r)["finish_s"]);
        assert_eq!(find(&full, r)["compute_s"], find(&slice, r)["compute_s"]);
    }
}

/// Each bad input exits with status 2 and a message naming the key or file and the rule.
#[test]
fn bad_inputs_name_the_key_and_rule() {
    let missing = tmp("nope.toml");
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec!["simulate".into(), missing.to_str().unwrap().into()],
            vec!["nope.toml"],
        ),
        (
            vec!["simulate".into(), "--set".into(), "parallel.tpp=4".into()],
            vec!["parallel.tpp", "did you mean `tp`"],
        ),
        (
            vec!["simulate".into(), "--set".into(), "parallel.tp=3".into()],
            vec!["parallel.tp", "divide"],
        ),
        (
            vec![
                "simulate".into(),
                "--set".into(),
                "cluster.nodes=1000000000".into(),
            ],
            vec!["cluster.nodes"],
        ),
        (
            vec![
                "simulate".into(),
                "--reduced".into(),
                "--set".into(),
                "training.global_batch=2047".into(),
            ],
            vec!["training.global_batch", "divisible"],
        ),
        (
            vec!["simulate".into(), "--ranks".into(), "20000".into()],
            vec!["--ranks", "does not exist"],
        ),
        (
            vec!["simulate".into(), "--ranks".into(), "9-2".into()],
            vec!["--ranks", "empty"],
        ),
        // Without sequence parallelism or recompute, 405B activations do not fit 80 GiB.
        (
            vec![
                "simulate".into(),
                "--set".into(),
                "parallel.micro_batch=2".into(),
                "--set".into(),
                "training.global_batch=4096".into(),
            ],
            vec!["cluster.hbm_gib", "activations", "--allow-oom"],
        ),
    ];
    for (args, needles) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = prism(&args);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?} should fail with status 2: {}",
            stdout(&o)
        );
        let e = stderr(&o);
        assert!(!e.contains("panicked"), "{args:?} panicked: {e}");
        for n in needles {
            assert!(e.contains(n), "{args:?}: error lacks `{n}`: {e}");
        }
    }
}

#[test]
fn allow_oom_simulates_anyway() {
    let v = json_of(&[
        "simulate",
        "--reduced",
        "--allow-oom",
        "--json",
        "--set",
        "parallel.micro_batch=2",
        "--set",
        "training.global_batch=4096",
    ]);
    assert!(v["peak_memory_bytes"].as_f64().unwrap() > 80.0 * (1u64 << 30) as f64);
    // Issue 51: a script can check the fit, and the text says it does not fit.
    assert_eq!(v["hbm_capacity_bytes"].as_u64().unwrap(), 80 * (1u64 << 30));
    assert_eq!(v["memory_fits"], false);
    let o = prism(&[
        "simulate",
        "--reduced",
        "--allow-oom",
        "--set",
        "parallel.micro_batch=2",
        "--set",
        "training.global_batch=4096",
    ]);
    assert!(stdout(&o).contains("DOES NOT FIT"), "{}", stdout(&o));
    let fits = json_of(&["simulate", "--reduced", "--json"]);
    assert_eq!(fits["memory_fits"], true);
}

/// `published.attention_flops`: `"full"` compares Prism's Megatron-convention figures as they
/// are; a value other than the two is refused, naming the key and the choices.
#[test]
fn published_attention_flops_selects_the_convention() {
    let v = json_of(&[
        "simulate",
        "--reduced",
        "--json",
        "--set",
        "published.attention_flops=full",
    ]);
    assert_eq!(v["published"]["attention_flops"], "full");
    assert_eq!(
        v["published"]["tflops_per_gpu"]["predicted"],
        v["model_tflops_per_gpu"]
    );
    assert_eq!(v["published"]["mfu"]["predicted"], v["mfu"]);
    let bad = prism(&[
        "simulate",
        "--reduced",
        "--set",
        "published.attention_flops=half",
    ]);
    assert!(!bad.status.success());
    let e = stderr(&bad);
    assert!(
        e.contains("published.attention_flops") && e.contains("causal"),
        "{e}"
    );
}

/// The embedded example carries Meta's published figure: `--json` reports it beside the
/// prediction with the signed error computed from the two values, and the text report prints it.
#[test]
fn the_published_figure_is_reported_beside_the_prediction() {
    let v = json_of(&["simulate", "--reduced", "--json"]);
    let t = &v["published"]["tflops_per_gpu"];
    assert_eq!(t["published"], 400.0);
    // Meta's figures count the causal attention's unmasked half (the preset says why): Prism's
    // full-count TFLOP/s scaled by mfu_causal / mfu, which is below 1.
    assert_eq!(v["published"]["attention_flops"], "causal");
    let f = |k: &str| v[k].as_f64().unwrap();
    let conv = f("mfu_causal") / f("mfu");
    assert!(conv > 0.9 && conv < 1.0, "{conv}");
    let close = |a: &serde_json::Value, b: f64| (a.as_f64().unwrap() - b).abs() < 1e-9 * b;
    assert!(close(&t["predicted"], f("model_tflops_per_gpu") * conv));
    assert!(close(
        &t["predicted_expected"],
        f("expected_model_tflops_per_gpu") * conv
    ));
    let (pred, err) = (
        t["predicted"].as_f64().unwrap(),
        t["error_pct"].as_f64().unwrap(),
    );
    assert!((err - 100.0 * (pred - 400.0) / 400.0).abs() < 1e-9);
    // With stragglers the run is slower: a smaller (less optimistic) error.
    assert!(t["error_expected_pct"].as_f64().unwrap() < err);
    assert_eq!(v["published"]["mfu"]["published"], 0.41);
    assert_eq!(v["published"]["job_overridden"], false);
    let text = prism(&["simulate", "--reduced"]);
    assert!(
        stdout(&text).contains("TFLOP/s per GPU            400.0   Prism"),
        "{}",
        stdout(&text)
    );
    assert!(!stdout(&text).contains("changed it with --set"));
    // A --set override makes it another setup: both outputs say so.
    let v = json_of(&[
        "simulate",
        "--reduced",
        "--json",
        "--set",
        "parallel.order=tp-cp-ep-dp-pp",
    ]);
    assert_eq!(v["published"]["job_overridden"], true);
    let text = prism(&[
        "simulate",
        "--reduced",
        "--set",
        "parallel.order=tp-cp-ep-dp-pp",
    ]);
    assert!(
        stdout(&text).contains("changed it with --set"),
        "{}",
        stdout(&text)
    );
}

/// A reader that stops early (`prism simulate | head`) is not an error: no "Broken pipe"
/// message, exit status 0.
#[test]
fn a_closed_stdout_is_not_an_error() {
    for json in [false, true] {
        let mut args = vec!["simulate", "--reduced"];
        if json {
            args.push("--json");
        }
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_prism"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the read end closes before anything is written
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("Broken pipe") && !err.contains("error"),
            "{args:?}: {err}"
        );
        assert!(out.status.success(), "{args:?}: {:?}: {err}", out.status);
    }
}
