//! `prism explore`: search of parallel layouts.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

fn prism_text(args: &[&str]) -> String {
    let o = run(args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).expect("UTF-8")
}

fn prism(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&prism_text(args)).expect("JSON")
}

fn data(name: &str) -> String {
    format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn sets(entry: &serde_json::Value) -> Vec<String> {
    entry["set"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn f(v: &serde_json::Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// Every reported layout is a valid job of the same GPU count and batch that fits in memory.
fn check_feasible(job: &str, extra: &[String], v: &serde_json::Value, gpus: u64) {
    let ranking = v["ranking"].as_array().unwrap();
    assert_eq!(ranking.len() as u64, v["feasible"].as_u64().unwrap());
    for e in ranking {
        let mut s: Vec<String> = extra.to_vec();
        s.extend(sets(e));
        let loaded = prism_io::jobfile::load_job_file(std::path::Path::new(job), &s)
            .unwrap_or_else(|err| panic!("{e}: {err}"));
        let j = &loaded.job;
        j.validate().unwrap();
        assert_eq!(j.num_gpus(), gpus);
        assert_eq!(j.training.global_batch, 64);
        let p = &j.parallel;
        for (k, val) in [
            ("tp", p.tp),
            ("pp", p.pp),
            ("cp", p.cp),
            ("dp", p.dp),
            ("vpp", p.vpp),
            ("micro_batch", p.micro_batch),
        ] {
            assert_eq!(e[k].as_u64().unwrap(), val as u64, "{k} in {e}");
        }
        assert_eq!(p.tp * p.pp * p.cp * p.dp, gpus as u32);
        assert_eq!(e["cp_comm_type"], p.cp_comm_type.name(), "{e}");
        let peak = prism_core::memory::peak_memory(j).1.total();
        assert_eq!(peak, e["peak_memory_bytes"].as_u64().unwrap());
        assert!(peak as f64 <= j.cluster.gpu.hbm_gib * (1u64 << 30) as f64);
    }
}

fn assert_sorted(ranking: &[serde_json::Value], key: &str) {
    for w in ranking.windows(2) {
        assert!(f(&w[0], key) <= f(&w[1], key), "{} > {}", w[0], w[1]);
    }
}

/// Deterministic search: valid, fitting, sorted, contains the job's own layout, and the best
/// layout's time is what `prism simulate` reports for it.
#[test]
fn deterministic_search() {
    let job = data("explore.toml");
    let v = prism(&["explore", &job, "--top", "0", "--json"]);
    assert_eq!(v["objective"], "mean");
    assert!(v["feasible"].as_u64().unwrap() > 10);
    assert!(v["candidates_evaluated"].as_u64().unwrap() >= v["feasible"].as_u64().unwrap());
    check_feasible(&job, &[], &v, 16);
    let ranking = v["ranking"].as_array().unwrap();
    assert_sorted(ranking, "objective_s");
    assert_sorted(ranking, "iteration_time_s");
    for (i, e) in ranking.iter().enumerate() {
        assert_eq!(e["rank"].as_u64().unwrap(), i as u64 + 1);
        assert_eq!(f(e, "objective_s"), f(e, "iteration_time_s"));
        assert!(e.get("sampled").is_none());
    }
    // Context parallelism is searched in both of Transformer Engine's overlapped forms (the
    // job says nothing, so its layouts without CP keep the default ring): every feasible layout
    // with cp > 1 of one form has its twin in the other when the twin fits.
    let form = |e: &serde_json::Value| e["cp_comm_type"].as_str().unwrap().to_string();
    let key = |e: &serde_json::Value| {
        let mut k: Vec<String> = sets(e)
            .into_iter()
            .filter(|s| !s.starts_with("parallel.cp_comm_type"))
            .collect();
        k.sort();
        k
    };
    let with_cp: Vec<_> = ranking
        .iter()
        .filter(|e| e["cp"].as_u64() > Some(1))
        .collect();
    assert!(with_cp.iter().any(|e| form(e) == "a2a"));
    assert!(with_cp.iter().any(|e| form(e) == "p2p"));
    assert!(
        ranking
            .iter()
            .filter(|e| e["cp"].as_u64() == Some(1))
            .all(|e| form(e) == "p2p")
    );
    for e in &with_cp {
        let twins = with_cp
            .iter()
            .filter(|o| key(o) == key(e) && form(o) != form(e))
            .count();
        assert!(twins <= 1, "{e}");
    }
    let pairs = with_cp
        .iter()
        .filter(|e| {
            form(e) == "a2a" && with_cp.iter().any(|o| key(o) == key(e) && form(o) == "p2p")
        })
        .count();
    assert!(pairs > 0);
    // The job's own layout (tp 2, pp 2, micro-batch 2) is there exactly once.
    let own: Vec<_> = ranking
        .iter()
        .filter(|e| e["is_job_config"].as_bool().unwrap())
        .collect();
    assert_eq!(own.len(), 1);
    assert_eq!(
        (
            own[0]["tp"].as_u64(),
            own[0]["pp"].as_u64(),
            own[0]["micro_batch"].as_u64()
        ),
        (Some(2), Some(2), Some(2))
    );
    // Best and own layouts equal `prism simulate` (every rank simulated) of that layout.
    for e in [&ranking[0], own[0]] {
        let mut args = vec!["simulate".to_string(), job.clone(), "--json".into()];
        for s in sets(e) {
            args.push("--set".into());
            args.push(s);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sim = prism(&args);
        let (a, b) = (f(&sim, "iteration_time_s"), f(e, "iteration_time_s"));
        assert!((a / b - 1.0).abs() < 1e-12, "simulate {a} vs explore {b}");
        assert!((f(&sim, "mfu") / f(e, "mfu") - 1.0).abs() < 1e-12);
        assert_eq!(sim["peak_memory_bytes"], e["peak_memory_bytes"]);
    }
    // --top limits the rows, keeping the order.
    let top = prism(&["explore", &job, "--top", "5", "--json"]);
    assert_eq!(top["ranking"].as_array().unwrap()[..], ranking[..5]);
}

/// Two runs give byte-identical JSON.
#[test]
fn deterministic_output() {
    let job = data("explore.toml");
    let args = ["explore", job.as_str(), "--top", "0", "--json"];
    assert_eq!(prism_text(&args), prism_text(&args));
}

/// A smaller GPU memory rejects layouts; what is left fits.
#[test]
fn memory_filter() {
    let job = data("explore.toml");
    let extra = vec!["cluster.hbm_gib=20".to_string(), "cluster.nodes=1".into()];
    let v = prism(&[
        "explore", &job, "--set", &extra[0], "--gpus", "8", "--top", "0", "--json",
    ]);
    assert!(v["rejected_out_of_memory"].as_u64().unwrap() > 0);
    check_feasible(&job, &extra, &v, 8);
}

/// `--gpus` changes the GPU count (whole nodes only).
#[test]
fn gpus_override() {
    let job = data("explore.toml");
    let v = prism(&["explore", &job, "--gpus", "8", "--top", "0", "--json"]);
    assert_eq!(v["num_gpus"], 8);
    check_feasible(&job, &["cluster.nodes=1".into()], &v, 8);
    let o = run(&["explore", &job, "--gpus", "12"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--gpus 12"));
}

/// explore.toml with the `[variability]` section of variability.toml (`edit` applied to the
/// section), written to a temporary file named after `tag`.
fn job_with_variability(tag: &str, edit: impl Fn(&str) -> String) -> std::path::PathBuf {
    let base = std::fs::read_to_string(data("explore.toml")).unwrap();
    let var = std::fs::read_to_string(data("variability.toml")).unwrap();
    let section = edit(&var[var.find("[variability]").unwrap()..]);
    let path =
        std::env::temp_dir().join(format!("prism-explore-{tag}-{}.toml", std::process::id()));
    std::fs::write(&path, format!("{base}\n{section}")).unwrap();
    path
}

/// With a [variability] section and samples, the 10 fastest are sampled and ranked by p99
/// ahead of the rest; runs repeat exactly.
#[test]
fn sampled_ranking() {
    let path = job_with_variability("var", str::to_string);
    let p = path.to_str().unwrap();
    let args = [
        "explore",
        p,
        "--samples",
        "6",
        "--objective",
        "p99",
        "--top",
        "0",
        "--json",
    ];
    let text = prism_text(&args);
    assert_eq!(text, prism_text(&args));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["objective"], "p99");
    assert_eq!(v["samples"], 6);
    let ranking = v["ranking"].as_array().unwrap();
    let (sampled, rest) = ranking.split_at(10);
    assert!(rest.iter().all(|e| e.get("sampled").is_none()));
    assert_sorted(sampled, "objective_s");
    assert_sorted(rest, "objective_s");
    for e in sampled {
        let s = &e["sampled"];
        assert_eq!(f(e, "objective_s"), f(s, "p99"));
        assert!(f(s, "p50") <= f(s, "p95") && f(s, "p95") <= f(s, "p99"));
    }
    // The sampled ones are the 10 fastest by deterministic time.
    let slowest_sampled = sampled
        .iter()
        .map(|e| f(e, "iteration_time_s"))
        .fold(0.0, f64::max);
    assert!(
        rest.iter()
            .all(|e| f(e, "iteration_time_s") >= slowest_sampled)
    );
    // Inversions name a faster-on-average and a faster-at-p99 pair.
    for x in v["p99_inversions"].as_array().unwrap() {
        let a = &ranking[x["faster_on_average"].as_u64().unwrap() as usize - 1]["sampled"];
        let b = &ranking[x["faster_at_p99"].as_u64().unwrap() as usize - 1]["sampled"];
        assert!(f(a, "mean") < f(b, "mean") && f(a, "p99") > f(b, "p99"));
    }
    // The human table shows the sampled columns.
    let table = prism_text(&["explore", p, "--samples", "6", "--objective", "p99"]);
    assert!(table.contains("p99 s"), "{table}");
    std::fs::remove_file(&path).ok();
}

/// `--sample-top N` sets how many of the fastest layouts are sampled (0: every feasible one).
#[test]
fn sample_top_sets_how_many_are_sampled() {
    let path = job_with_variability("top", str::to_string);
    let p = path.to_str().unwrap();
    let count = |v: &serde_json::Value| {
        v["ranking"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e.get("sampled").is_some())
            .count()
    };
    let base = ["explore", p, "--samples", "2", "--top", "0", "--json"];
    let three = prism(&[&base[..], &["--sample-top", "3"]].concat());
    assert_eq!(three["sampled_candidates"], 3);
    assert_eq!(count(&three), 3);
    let all = prism(&[&base[..], &["--sample-top", "0", "--gpus", "8"]].concat());
    let feasible = all["feasible"].as_u64().unwrap() as usize;
    assert!(feasible > 10, "{feasible}");
    assert_eq!(
        all["sampled_candidates"].as_u64().unwrap() as usize,
        feasible
    );
    assert_eq!(count(&all), feasible);
    std::fs::remove_file(&path).ok();
}

/// The sampled statistics of every sampled layout, by its `--set` arguments.
fn sampled_by_layout(v: &serde_json::Value) -> Vec<(Vec<String>, serde_json::Value)> {
    let mut out: Vec<_> = v["ranking"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e.get("sampled").is_some())
        .map(|e| (sets(e), e["sampled"].clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The Monte Carlo stage reports how it sampled (`step_method`): the max-plus step model where
/// the jitter allows it (normal kernel jitter), the per-rank engine with `--per-rank`; both give
/// the sampled statistics of the same 10 layouts, close to each other.
#[test]
fn step_method_and_per_rank() {
    // Normal GEMM jitter (the step model draws normal jitter exactly; lognormal falls back).
    let path = job_with_variability("normal", |s| {
        s.replace(
            r#"gemm = { dist = "lognormal", mu = 0.0, sigma = 0.02 }"#,
            r#"gemm = { dist = "normal", mean = 1.0, std = 0.02 }"#,
        )
    });
    let p = path.to_str().unwrap();
    let args = ["explore", p, "--samples", "8", "--top", "0", "--json"];
    let fast = prism(&args);
    let method = fast["step_method"].as_str().unwrap();
    assert!(method.contains("max-plus"), "{method}");
    let per_rank = prism(&[&args[..], &["--per-rank"]].concat());
    assert_eq!(
        per_rank["step_method"].as_str().unwrap(),
        "every rank simulated by the engine (--per-rank)"
    );
    // Log-normal jitter has no segment-sum shortcut: the step model draws it kernel by kernel.
    let lognormal = job_with_variability("lognormal", str::to_string);
    let other = prism(&[
        "explore",
        lognormal.to_str().unwrap(),
        "--samples",
        "2",
        "--json",
    ]);
    let method = other["step_method"].as_str().unwrap();
    assert!(method.contains("max-plus"), "{method}");
    std::fs::remove_file(&lognormal).ok();
    let (a, b) = (sampled_by_layout(&fast), sampled_by_layout(&per_rank));
    assert_eq!(a.len(), 10);
    // The same 10 layouts (the fastest by deterministic time), each with its statistics.
    assert_eq!(
        a.iter().map(|x| &x.0).collect::<Vec<_>>(),
        b.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    for ((_, s), (_, t)) in a.iter().zip(&b) {
        for s in [s, t] {
            assert!(
                f(s, "p50") <= f(s, "p95") && f(s, "p95") <= f(s, "p99"),
                "{s}"
            );
        }
        let r = f(s, "mean") / f(t, "mean");
        assert!((r - 1.0).abs() < 0.01, "max-plus {s} vs per-rank {t}");
    }
    // Without samples there is no method.
    let det = prism(&["explore", p, "--json"]);
    assert!(det["step_method"].is_null());
    // The text header names the method.
    let table = prism_text(&["explore", p, "--samples", "4", "--per-rank"]);
    assert!(
        table.contains("every rank simulated by the engine"),
        "{table}"
    );
    std::fs::remove_file(&path).ok();
}

fn placements(v: &serde_json::Value) -> &Vec<serde_json::Value> {
    v["slow_gpu_placement"]["placements"].as_array().unwrap()
}

fn placement<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    placements(v)
        .iter()
        .find(|p| p["placement"] == name)
        .unwrap_or_else(|| panic!("{name} in {v}"))
}

fn slow_ranks(p: &serde_json::Value) -> Vec<u64> {
    p["slow_ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect()
}

/// `--slow-gpus` = one TP group's size: packing them into one TP group is never slower than
/// spreading them; every placement is at least the no-slow-GPU time, which is the job's own
/// time in the search; the report repeats exactly; without the flag there is no report.
#[test]
fn slow_gpu_placements() {
    let job = data("explore.toml");
    let l = prism_core::layout::Layout::new(
        &prism_io::jobfile::load_job_file(std::path::Path::new(&job), &[])
            .unwrap()
            .job,
    );
    for slowdown in ["1.2", "2"] {
        let args = [
            "explore",
            job.as_str(),
            "--slow-gpus",
            "2",
            "--slowdown",
            slowdown,
            "--top",
            "0",
            "--json",
        ];
        let text = prism_text(&args);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let a = &v["slow_gpu_placement"];
        assert_eq!(a["slow_gpus"], 2);
        assert_eq!(f(a, "slowdown"), slowdown.parse::<f64>().unwrap());
        assert_eq!((a["tp"].as_u64(), a["pp"].as_u64()), (Some(2), Some(2)));
        let base = f(a, "baseline_iteration_time_s");
        let own = v["ranking"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["is_job_config"].as_bool().unwrap())
            .unwrap();
        assert!((base / f(own, "iteration_time_s") - 1.0).abs() < 1e-12);
        let ps = placements(&v);
        assert_eq!(ps.len(), 5);
        let times: Vec<f64> = ps.iter().map(|p| f(p, "iteration_time_s")).collect();
        for (p, &t) in ps.iter().zip(&times) {
            assert_eq!(slow_ranks(p).len(), 2, "{p}");
            assert!(t >= base, "{p}: {t} < no-slow-GPU {base}");
        }
        // Packed into one TP group (ranks 0 and 1) versus spread (two TP groups).
        let packed = placement(&v, "tp-group");
        let spread = placement(&v, "spread");
        assert_eq!(slow_ranks(packed), vec![0, 1]);
        let groups: std::collections::BTreeSet<u32> = slow_ranks(spread)
            .iter()
            .map(|&r| l.group_of(prism_core::layout::GroupKind::Tp, r as u32))
            .collect();
        assert_eq!(groups.len(), 2);
        assert!(
            f(packed, "iteration_time_s") <= f(spread, "iteration_time_s"),
            "{a}"
        );
        // Best, worst and the gains agree with the rows.
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        let max = times.iter().copied().fold(0.0, f64::max);
        assert_eq!(
            f(
                placement(&v, a["best"].as_str().unwrap()),
                "iteration_time_s"
            ),
            min
        );
        assert_eq!(
            f(
                placement(&v, a["worst"].as_str().unwrap()),
                "iteration_time_s"
            ),
            max
        );
        assert!((f(a, "gain_vs_worst_pct") - 100.0 * (max / min - 1.0)).abs() < 1e-9);
        let s = f(spread, "iteration_time_s");
        assert!((f(a, "gain_vs_spread_pct") - 100.0 * (s / min - 1.0)).abs() < 1e-9);
        assert!(f(a, "gain_vs_spread_pct") >= 0.0);
        // Deterministic.
        assert_eq!(text, prism_text(&args));
    }
    let plain = prism(&["explore", &job, "--top", "1", "--json"]);
    assert!(plain.get("slow_gpu_placement").is_none());
    // The text report names the best placement.
    let table = prism_text(&["explore", &job, "--top", "1", "--slow-fraction", "0.125"]);
    assert!(table.contains("Slow GPUs: 2 of 16"), "{table}");
    assert!(table.contains("<- best"), "{table}");
}

/// An uneven split with a short last stage: the least-loaded stage is the last one, the slow
/// GPUs of that placement sit there, and it beats packing them into stage 0.
#[test]
fn slow_gpus_on_the_least_loaded_stage() {
    let job = data("explore.toml");
    let mut args = vec!["explore", job.as_str()];
    for s in [
        "parallel.tp=1",
        "parallel.pp=4",
        "parallel.micro_batch=1",
        "parallel.last_stage_layers=3",
    ] {
        args.extend(["--set", s]);
    }
    args.extend(["--slow-gpus", "2", "--top", "1", "--json"]);
    let v = prism(&args);
    let a = &v["slow_gpu_placement"];
    let stages: Vec<f64> = a["stage_compute_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_f64().unwrap())
        .collect();
    assert_eq!(stages.len(), 4);
    assert_eq!(a["least_loaded_stage"], 3);
    assert!(stages[3] < stages[0] && stages[3] < stages[1]);
    let least = placement(&v, "least-loaded-stage");
    let stage_size = 4; // tp 1, cp 1, dp 4
    assert!(slow_ranks(least).iter().all(|r| r / stage_size == 3));
    assert!(
        f(least, "iteration_time_s") < f(placement(&v, "tp-group"), "iteration_time_s"),
        "{a}"
    );
    assert_eq!(a["best"], "least-loaded-stage");
}

/// Bad requests fail with a message.
#[test]
fn slow_gpu_arguments() {
    let job = data("explore.toml");
    for (args, msg) in [
        (vec!["--slow-gpus", "0"], "--slow-gpus 0"),
        (vec!["--slow-gpus", "17"], "--slow-gpus 17"),
        (vec!["--slow-fraction", "1.5"], "--slow-fraction"),
        (vec!["--slow-gpus", "1", "--slowdown", "0.5"], "--slowdown"),
        (
            vec!["--slow-gpus", "1", "--slow-fraction", "0.5"],
            "cannot be used with",
        ),
    ] {
        let mut a = vec!["explore", job.as_str()];
        a.extend(args);
        let o = run(&a);
        assert!(!o.status.success(), "{a:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(msg), "{a:?}: {err}");
    }
}

/// A job whose only variability is a `prism fit` table (`[variability.distributions]`) is
/// sampled too: the table's kernel jitter spreads the sampled step times.
#[test]
fn fit_table_variability_is_sampled() {
    let job = &data("fitted_op.toml");
    let v = prism(&[
        "explore",
        job,
        "--samples",
        "6",
        "--top",
        "2",
        "--sample-top",
        "2",
        "--json",
    ]);
    assert_eq!(v["sampled_candidates"], 2);
    let first = &v["ranking"][0]["sampled"];
    println!("{first}");
    assert!(
        first["p99"].as_f64().unwrap() > first["p50"].as_f64().unwrap(),
        "{first}"
    );
}
