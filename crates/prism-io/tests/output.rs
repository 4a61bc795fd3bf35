//! Output-format tests for `prism-io`: the Chrome/Perfetto trace and the JSON summary of a real
//! simulation, parsed back and checked for structure and consistency with the simulation.

use std::collections::{BTreeMap, BTreeSet};

use prism_core::job::Job;
use prism_core::job::fixtures::small_job;
use prism_core::report::RankTiming;
use prism_core::{Mode, SimOptions, SimResult, simulate};
use prism_io::report_json::{MAX_LISTED_RANKS, summary_json};
use prism_io::trace::{PID_OFFSET, TID_OFFSET, write_chrome_trace};
use serde_json::Value;

const RECORDED: [u32; 4] = [0, 1, 8, 15];

/// A complete event: (ts us, dur us, name).
type Slice = (f64, f64, String);

/// 2 nodes x 8 GPUs = 16 GPUs: tp 2, pp 2, dp 4, 4 micro-batches per pipeline.
fn job() -> Job {
    let job = small_job(2, 2, 2, 16);
    assert_eq!(job.num_gpus(), 16);
    job.validate().expect("valid job");
    job
}

fn run(job: &Job, mode: Mode, record: &[u32]) -> SimResult {
    let opts = SimOptions {
        mode,
        record_ranks: record.to_vec(),
        ..SimOptions::default()
    };
    simulate(job, &opts).expect("simulation runs")
}

fn trace_of(result: &SimResult) -> Value {
    let mut buf = Vec::new();
    write_chrome_trace(result, &mut buf).expect("trace written");
    serde_json::from_slice(&buf).expect("trace is valid JSON")
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

fn rel_close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-300)
}

/// Checks everything the trace of `result` must satisfy, for the ranks in `recorded`.
fn check_trace(result: &SimResult, recorded: &[u32]) -> Value {
    let trace = trace_of(result);
    let events = trace["traceEvents"].as_array().expect("traceEvents array");
    assert!(!events.is_empty());
    assert_eq!(trace["displayTimeUnit"], "ms");
    assert!(trace["otherData"]["iteration_time_s"].is_number());

    let mut process_names: BTreeMap<u64, String> = BTreeMap::new();
    let mut thread_names: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut slices: BTreeMap<(u64, u64), Vec<Slice>> = BTreeMap::new();
    let mut pids = BTreeSet::new();
    for ev in events {
        for key in ["ph", "pid", "tid", "name"] {
            assert!(ev.get(key).is_some(), "event without {key}: {ev}");
        }
        let pid = ev["pid"].as_u64().expect("integer pid");
        let tid = ev["tid"].as_u64().expect("integer tid");
        pids.insert(pid);
        let name = ev["name"].as_str().expect("string name").to_string();
        match ev["ph"].as_str().expect("string ph") {
            "M" => match name.as_str() {
                "process_name" => {
                    process_names.insert(pid, ev["args"]["name"].as_str().expect("name").into());
                }
                "thread_name" => {
                    assert!(ev["args"]["name"].is_string());
                    thread_names.insert((pid, tid));
                }
                "process_sort_index" | "thread_sort_index" => {
                    assert!(ev["args"]["sort_index"].is_u64());
                }
                other => panic!("unexpected metadata event {other}"),
            },
            "X" => {
                let ts = num(ev, "ts");
                let dur = num(ev, "dur");
                assert!(ts >= 0.0 && dur >= 0.0, "negative time in {ev}");
                assert!(ev["cat"].is_string());
                let args = &ev["args"];
                assert!(args["phase"].is_string());
                if let Some(l) = args.get("layer") {
                    assert!(l.as_u64().expect("layer") < u32::MAX as u64);
                }
                if ev["cat"] == "comm" && name != "pp recv" {
                    assert!(args["bytes"].is_u64(), "comm event without bytes: {ev}");
                }
                if ev["cat"] == "gemm" {
                    for k in ["m", "n", "k"] {
                        assert!(args["shape"][k].is_u64(), "gemm without shape: {ev}");
                    }
                }
                slices.entry((pid, tid)).or_default().push((ts, dur, name));
            }
            other => panic!("unexpected phase {other}"),
        }
    }

    // Processes are exactly the recorded ranks, each named with its coordinates.
    let want: BTreeSet<u64> = recorded.iter().map(|&r| (r + PID_OFFSET) as u64).collect();
    assert_eq!(pids, want);
    let layout = result.graph.layout;
    for &r in recorded {
        let c = layout.coord(r);
        let expect = format!(
            "rank {r} (tp {}, cp {}, dp {}, pp {})",
            c.tp, c.cp, c.dp, c.pp
        );
        assert_eq!(process_names.get(&((r + PID_OFFSET) as u64)), Some(&expect));
    }
    // Every thread with events is named.
    for key in slices.keys() {
        assert!(
            thread_names.contains(key),
            "thread {key:?} has no thread_name"
        );
    }

    let iter_us = result.summary.iteration_time_s * 1e6;
    let compute_tid = TID_OFFSET as u64;
    for (&(pid, tid), evs) in &slices {
        // Sorted, and one op at a time per stream.
        for w in evs.windows(2) {
            assert!(w[0].0 <= w[1].0, "events out of order on {pid}/{tid}");
            assert!(
                w[0].0 + w[0].1 <= w[1].0 + 1e-6,
                "overlap on pid {pid} tid {tid}: {:?} then {:?}",
                w[0],
                w[1]
            );
        }
        let last = evs.iter().map(|e| e.0 + e.1).fold(0.0, f64::max);
        assert!(
            last <= iter_us + 1e-3,
            "pid {pid} ends at {last} us after the iteration {iter_us}"
        );
        assert!(evs.iter().all(|e| !e.2.is_empty()));
        if tid == compute_tid {
            let rank = (pid - PID_OFFSET as u64) as u32;
            let timing: &RankTiming = result
                .ranks
                .iter()
                .find(|t| t.rank == rank)
                .expect("timing of a recorded rank");
            let sum_s: f64 = evs.iter().map(|e| e.1).sum::<f64>() * 1e-6;
            assert!(
                rel_close(sum_s, timing.compute_s, 1e-6),
                "rank {rank}: trace compute {sum_s} s vs timing {} s",
                timing.compute_s
            );
        }
    }
    // Every recorded rank has compute events.
    for &r in recorded {
        assert!(slices.contains_key(&((r + PID_OFFSET) as u64, compute_tid)));
    }
    trace
}

#[test]
fn trace_structure_full_run() {
    let job = job();
    let result = run(&job, Mode::Full, &RECORDED);
    let trace = check_trace(&result, &RECORDED);
    let events = trace["traceEvents"].as_array().unwrap();
    let names: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    // tp 2 with sequence parallelism, distributed optimizer, pp 2.
    for n in [
        "tp all_gather",
        "tp reduce_scatter",
        "dp reduce_scatter",
        "pp send",
    ] {
        assert!(names.contains(n), "no {n} event; names: {names:?}");
    }
    // Thread names are the stream names.
    let threads: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(threads.contains("compute") && threads.contains("tp comm"));
    // Micro-batches and layers are reported, per-iteration work leaves them out.
    assert!(events.iter().any(|e| e["args"]["micro_batch"].is_u64()));
    assert!(events.iter().any(|e| e["args"]["layer"].is_u64()));
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "X" && e["args"].get("layer").is_none())
    );
}

#[test]
fn trace_reduced_run_records_representatives() {
    let job = job();
    // Reduced mode runs ranks 0 and 8 (the first rank of each stage).
    let result = run(&job, Mode::Reduced, &[0, 8]);
    check_trace(&result, &[0, 8]);
}

#[test]
fn trace_without_recorded_ranks_is_valid() {
    let job = job();
    let result = run(&job, Mode::Reduced, &[]);
    let mut buf = Vec::new();
    write_chrome_trace(&result, &mut buf).unwrap();
    let v: Value = serde_json::from_slice(&buf).unwrap();
    assert_eq!(v["traceEvents"].as_array().map(Vec::len), Some(0));
}

#[test]
fn trace_is_deterministic() {
    let job = job();
    let a = run(&job, Mode::Full, &RECORDED);
    let b = run(&job, Mode::Full, &RECORDED);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    write_chrome_trace(&a, &mut x).unwrap();
    write_chrome_trace(&b, &mut y).unwrap();
    assert_eq!(x, y);
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
fn summary_json_contract() {
    let job = job();
    let result = run(&job, Mode::Full, &RECORDED);
    let v = summary_json(&result, &job);
    for key in CONTRACT {
        assert!(v[key].is_number(), "{key} missing or not numeric in {v}");
    }
    for key in [
        "model_flops",
        "hardware_flops",
        "graph_ops",
        "programs",
        "events",
        "tokens_per_s_per_gpu",
        "ranks_simulated",
    ] {
        assert!(v[key].is_number(), "{key} missing or not numeric");
    }
    assert_eq!(v["name"], "small");
    assert_eq!(v["num_gpus"].as_u64(), Some(16));
    // Parameters: per layer QKV + output projection + the MLP's matrices + two norms, times
    // the layers, plus the embeddings and the final norm; a dense model uses all of them.
    let m = &job.model;
    let (h, f) = (m.hidden as u64, m.ffn_hidden as u64);
    let q = (m.heads * m.head_dim) as u64;
    let kv = (m.kv_heads * m.head_dim) as u64;
    let mats = match m.activation {
        prism_core::job::Activation::SwiGlu => 3,
        prism_core::job::Activation::Gelu => 2,
    };
    let layer = h * (q + 2 * kv) + q * h + mats * h * f + 2 * h;
    let emb = m.vocab as u64 * h * if m.tied_embeddings { 1 } else { 2 };
    let want = m.layers as u64 * layer + emb + h;
    assert_eq!(v["model_params"].as_u64(), Some(want));
    assert_eq!(v["model_active_params"].as_u64(), Some(want));
    let mfu = num(&v, "mfu");
    assert!(mfu > 0.0 && mfu < 1.0, "mfu {mfu}");
    assert!(num(&v, "hfu") >= mfu);
    let iter = num(&v, "iteration_time_s");
    assert!(iter > 0.0);
    assert!(rel_close(
        num(&v, "tokens_per_s_per_gpu") * 16.0,
        num(&v, "tokens_per_s"),
        1e-12
    ));

    // Breakdown: the named parts, summing to the iteration time.
    let b = v["breakdown"].as_object().expect("breakdown object");
    let names: Vec<&str> = b.keys().map(String::as_str).collect();
    let mut want = vec![
        "compute_s",
        "exposed_tp_s",
        "exposed_cp_s",
        "exposed_ep_s",
        "exposed_pp_s",
        "exposed_dp_s",
        "bubble_s",
    ];
    want.sort_unstable();
    assert_eq!(names, want);
    let total: f64 = b.values().map(|x| x.as_f64().expect("numeric part")).sum();
    assert!(
        rel_close(total, iter, 1e-6),
        "breakdown sums to {total}, iteration {iter}"
    );

    // Memory.
    let stages = v["stage_memory_bytes"].as_array().expect("stage memory");
    assert_eq!(stages.len(), 2);
    let peak = stages.iter().map(|x| x.as_u64().unwrap()).max().unwrap();
    assert_eq!(v["peak_memory_bytes"].as_u64(), Some(peak));

    // Parallel echo.
    let p = &v["parallel"];
    assert_eq!(p["tp"], 2);
    assert_eq!(p["pp"], 2);
    assert_eq!(p["dp"], 4);
    assert_eq!(p["cp"], 1);
    assert_eq!(p["ep"], 1);
    assert_eq!(p["vpp"], 1);
    assert_eq!(p["micro_batch"], 1);
    assert_eq!(p["global_batch"], 16);
    assert_eq!(p["precision"], "bf16");
    assert_eq!(p["recompute"], "none");
    assert!(p["schedule"].is_string());
    // Listed only for jobs with context parallelism, in the job file's spelling.
    assert!(p.get("cp_comm_type").is_none());
    let mut cp = job.clone();
    cp.parallel.cp = 2;
    cp.parallel.dp /= 2;
    cp.parallel.cp_comm_type = prism_core::job::CpCommType::A2a;
    cp.validate().expect("valid CP job");
    let w = summary_json(&run(&cp, Mode::Reduced, &[]), &cp);
    assert_eq!(w["parallel"]["cp_comm_type"], "a2a");

    // Full run of 16 ranks: every rank listed, each breakdown summing to the iteration time.
    assert_eq!(v["ranks_simulated"], 16);
    let ranks = v["ranks"].as_array().expect("ranks listed");
    assert_eq!(ranks.len(), 16);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r["rank"].as_u64(), Some(i as u64));
        let t: f64 = r["breakdown"]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .sum();
        assert!(rel_close(t, iter, 1e-6), "rank {i} breakdown {t} vs {iter}");
    }

    // Deterministic: a second run gives the same text (keys sorted, same numbers).
    let again = summary_json(&run(&job, Mode::Full, &RECORDED), &job);
    assert_eq!(
        serde_json::to_string(&v).unwrap(),
        serde_json::to_string(&again).unwrap()
    );
}

#[test]
fn summary_json_omits_ranks_of_large_runs() {
    let job = job();
    let mut result = run(&job, Mode::Reduced, &[]);
    let v = summary_json(&result, &job);
    assert_eq!(v["ranks"].as_array().map(Vec::len), Some(2));
    let template = result.ranks[0].clone();
    result.ranks = (0..MAX_LISTED_RANKS as u32 + 1)
        .map(|r| RankTiming {
            rank: r % 16,
            ..template.clone()
        })
        .collect();
    let v = summary_json(&result, &job);
    assert!(v.get("ranks").is_none());
    assert_eq!(
        v["ranks_simulated"].as_u64(),
        Some(MAX_LISTED_RANKS as u64 + 1)
    );
    for key in CONTRACT {
        assert!(v[key].is_number());
    }
}

/// Truth: the memory-saving settings appear under `parallel` exactly when one is on, so the
/// default summary keeps its keys; with them on, the reported peak memory is the memory
/// model's and lower than without.
#[test]
fn summary_json_lists_memory_savings_only_when_set() {
    use prism_core::job::{OptimizerStateDtype, Precision};
    let job = job();
    let plain = summary_json(&run(&job, Mode::Reduced, &[]), &job);
    for key in [
        "recompute_norm_upproj",
        "activation_cache",
        "optimizer_state_dtype",
        "master_weights",
        "master_weight_remainders",
    ] {
        assert!(
            plain["parallel"].get(key).is_none(),
            "{key} in default output"
        );
    }
    let mut on = job.clone();
    on.training.precision = Precision::Fp8;
    on.training.memory_saving.recompute_norm_upproj = true;
    on.training.memory_saving.optimizer_state = OptimizerStateDtype::Bf16;
    on.validate().expect("valid job");
    let v = summary_json(&run(&on, Mode::Reduced, &[]), &on);
    assert_eq!(v["parallel"]["recompute_norm_upproj"], true);
    assert_eq!(v["parallel"]["activation_cache"], "bf16");
    assert_eq!(v["parallel"]["optimizer_state_dtype"], "bf16");
    let peak = |v: &Value| v["peak_memory_bytes"].as_u64().unwrap();
    assert_eq!(peak(&v), prism_core::memory::peak_memory(&on).1.total());
    assert!(peak(&v) < peak(&plain));
    // A BF16 model without master weights says so, and holds less still.
    let mut pure = on.clone();
    pure.training.master_weights = false;
    let w = summary_json(&run(&pure, Mode::Reduced, &[]), &pure);
    assert_eq!(w["parallel"]["master_weights"], false);
    assert_eq!(peak(&w), prism_core::memory::peak_memory(&pure).1.total());
    assert!(peak(&w) < peak(&v));
}
