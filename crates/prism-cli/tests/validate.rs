//! Fidelity acceptance: the whole validation set against published runs, and the Kineto import.

use std::path::PathBuf;
use std::process::Command;

fn prism(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

/// Every modelled published run: mean absolute error at most 8% and no case beyond 20%.
/// Also prints the comparison with Calculon on the Korthikanti et al. 2022 Table 5 rows.
#[test]
fn validation_meets_the_error_budget() {
    let o = prism(&["validate", "--json"]);
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "validate --json: {e}\n{}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let mape = v["mape"].as_f64().expect("mape");
    let cases = v["cases"].as_array().expect("cases");
    assert!(cases.len() >= 50, "only {} cases modelled", cases.len());
    let mut worst = ("", 0.0f64);
    for c in cases {
        let e = c["error_pct"].as_f64().unwrap();
        if e.abs() > worst.1.abs() {
            worst = (c["id"].as_str().unwrap(), e);
        }
    }
    if let Some(k) = v["calculon_rows"].as_object() {
        eprintln!(
            "Korthikanti Table 5: Prism {:.2}% mean {:.2}% max; Calculon 3.65% / 8.87%",
            k["prism_mape"].as_f64().unwrap(),
            k["prism_max_abs_error_pct"].as_f64().unwrap()
        );
    }
    eprintln!(
        "validation: {} cases, MAPE {mape:.2}%, worst {} {:+.2}%",
        cases.len(),
        worst.0,
        worst.1
    );
    assert!(mape <= 8.0, "mean absolute error {mape:.2}% exceeds 8%");
    assert!(
        worst.1.abs() <= 20.0,
        "case {} is off by {:+.2}% (> 20%)",
        worst.0,
        worst.1
    );
    // The exit status agrees: no case exceeds its tolerance.
    assert!(
        o.status.success(),
        "validate exited with {:?}",
        o.status.code()
    );
}

fn shared_trace() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/megatron-gpt-tp8-a100/megatron_kineto_0.json");
    p.exists().then_some(p)
}

/// `prism profile import` on the real Megatron A100 trace writes a kernel table the cost model
/// reads back, and its class totals add up to the trace's kernel time.
#[test]
fn profile_import_writes_a_kernel_table() {
    let Some(trace) = shared_trace() else {
        eprintln!("skipped: shared/traces not present");
        return;
    };
    let out = std::env::temp_dir().join(format!("prism-kt-{}.csv", std::process::id()));
    let o = prism(&[
        "profile",
        "import",
        trace.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let total = v["kernel_time_s"].as_f64().unwrap();
    let sum: f64 = v["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["seconds"].as_f64().unwrap())
        .sum();
    assert!((sum - total).abs() <= 1e-9 * total);
    assert!(v["device"].as_str().unwrap().contains("A100"));
    let table = prism_io_table(&out);
    assert!(table >= 5, "only {table} rows");
}

fn prism_io_table(path: &std::path::Path) -> usize {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .count()
        - 1
}

/// A reader that goes away (`prism validate | head`) ends the command quietly: exit 0, no
/// panic. The pipe's read end is closed before the command starts, so every write fails.
#[test]
fn closed_stdout_is_not_a_panic() {
    for args in [
        &["validate", "--show", "dsv3_pretrain"][..],
        &["validate"][..],
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let o = Command::new(env!("CARGO_BIN_EXE_prism"))
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("run prism");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{args:?}: {:?}\n{err}", o.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `--json` says which prediction is compared and carries both; `--stragglers` compares the
/// expected iteration with stragglers, `--gpu-speed-cv` sets the spread of every case, and an
/// impossible spread is refused with the flag's name.
#[test]
fn validate_reports_nominal_and_straggler_errors() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["validate", "--filter", "meg20", "--json"];
        args.extend_from_slice(extra);
        let o = prism(&args);
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "validate {extra:?}: {e}\n{}",
                String::from_utf8_lossy(&o.stderr)
            )
        })
    };
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}"));
    let nominal = run(&[]);
    assert_eq!(nominal["compared"], "nominal");
    assert_eq!(f(&nominal, "mape"), f(&nominal, "mape_nominal"));
    assert_eq!(
        f(&nominal, "max_abs_error_pct"),
        f(&nominal, "max_abs_error_nominal_pct")
    );
    let strag = run(&["--stragglers"]);
    assert_eq!(strag["compared"], "stragglers");
    assert_eq!(f(&strag, "mape"), f(&strag, "mape_stragglers"));
    assert_eq!(f(&strag, "mape_nominal"), f(&nominal, "mape"));
    assert_ne!(f(&strag, "mape"), f(&nominal, "mape"));
    let (nc, sc) = (
        nominal["cases"].as_array().unwrap(),
        strag["cases"].as_array().unwrap(),
    );
    assert_eq!(nc.len(), 4);
    for (n, s) in nc.iter().zip(sc) {
        assert_eq!(f(n, "error_pct"), f(n, "error_nominal_pct"));
        assert_eq!(f(s, "error_pct"), f(s, "error_stragglers_pct"));
        assert_eq!(f(n, "error_stragglers_pct"), f(s, "error_stragglers_pct"));
        assert!(f(n, "gpus") >= 128.0);
        assert_eq!(f(n, "gpu_speed_cv"), 0.011);
        // These are iteration times: stragglers lengthen them.
        assert_eq!(n["metric"], "iteration_time_s");
        assert!(f(n, "predicted_stragglers") > f(n, "predicted_nominal"));
    }
    let flat = run(&["--gpu-speed-cv", "0"]);
    assert_eq!(f(&flat, "gpu_speed_cv_override"), 0.0);
    for c in flat["cases"].as_array().unwrap() {
        assert_eq!(f(c, "error_stragglers_pct"), f(c, "error_nominal_pct"));
    }
    let o = prism(&["validate", "--filter", "meg20", "--gpu-speed-cv", "0.9"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--gpu-speed-cv 0.9"), "{err}");
}

/// `--excluded` simulates the excluded cases and lists them apart: the same prediction a
/// modelled copy of the row gets, counted in no statistic and failing no tolerance.
#[test]
fn excluded_cases_are_predicted_apart() {
    let json = |args: &[&str]| {
        let o = prism(args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("json")
    };
    let with = json(&[
        "validate",
        "--filter",
        "mbridge2604",
        "--excluded",
        "--json",
    ]);
    let without = json(&["validate", "--filter", "mbridge2604", "--json"]);
    assert!(without.get("excluded_predictions").is_none());
    // The modelled cases and their statistics do not change.
    assert_eq!(with["cases"], without["cases"]);
    assert_eq!(with["mape"], without["mape"]);
    let excluded: Vec<&str> = with["excluded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    let preds = with["excluded_predictions"].as_array().expect("listed");
    assert!(!preds.is_empty());
    assert_eq!(
        preds
            .iter()
            .map(|p| p["id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        excluded
    );
    // A modelled copy of the same rows predicts the same figures.
    let text = cases_file_text();
    let mut lines = text.lines();
    let mut csv = format!("{}\n", lines.next().unwrap());
    for l in lines.filter(|l| excluded.iter().any(|id| l.starts_with(&format!("{id},")))) {
        // status `excluded` with its reason -> `modelled` with none: the reason is the first
        // quoted field after the status column.
        let (head, rest) = l.split_once(",excluded,\"").expect("excluded row");
        let (_, tail) = rest.split_once("\",").expect("reason");
        csv.push_str(&format!("{head},modelled,,{tail}\n"));
    }
    let dir = std::env::temp_dir().join(format!("prism-excluded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cases.csv");
    std::fs::write(&file, csv).unwrap();
    let modelled = prism(&["validate", file.to_str().unwrap(), "--json"]);
    let modelled: serde_json::Value = serde_json::from_slice(&modelled.stdout).expect("json");
    let cases = modelled["cases"].as_array().unwrap();
    assert_eq!(cases.len(), preds.len());
    for (p, c) in preds.iter().zip(cases) {
        assert_eq!(p["id"], c["id"]);
        assert_eq!(p["predicted"], c["predicted"]);
        assert_eq!(p["error_pct"], c["error_pct"]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn cases_file_text() -> String {
    std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../validation/cases.csv"),
    )
    .expect("validation/cases.csv")
}

/// Issue 51: the README's count of published runs is the number `prism validate` compares
/// with (the modelled rows of validation/cases.csv).
#[test]
fn readme_counts_the_published_runs_validate_uses() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let key = "compares Prism with ";
    let at = readme.find(key).expect("the README states the count") + key.len();
    let n: usize = readme[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let path = std::path::PathBuf::from(format!("{root}/validation/cases.csv"));
    let modelled = (prism_io::validation::read_cases(&path).unwrap().iter())
        .filter(|c| c.status.is_modelled())
        .count();
    assert_eq!(
        n, modelled,
        "README says {n} published runs; validate uses {modelled}"
    );
}
