//! Hostile inputs (issue 13): each gets a correct result or a clear error naming the key and
//! the rule, within 10 s under a 4 GiB address-space limit; never a panic, abort or hang.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs prism under `ulimit -v 4 GiB` and a 10 s time-out.
fn prism_limited(args: &[&str]) -> Output {
    Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 4194304; exec timeout 10 \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

/// An error exit (2 or 1), not a panic (101), a kill or a time-out (124), with `needle` in
/// the message.
fn refused(args: &[&str], needle: &str) {
    let o = prism_limited(args);
    let err = String::from_utf8_lossy(&o.stderr);
    let code = o.status.code();
    assert!(
        matches!(code, Some(1) | Some(2)),
        "{args:?}: exit {code:?}, stderr: {err}"
    );
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

fn file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prism-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn cluster_figures_out_of_physical_bounds_name_the_key() {
    for (set, key) in [
        ("cluster.nvlink_gbps=1e-12", "cluster.nvlink_gbps"),
        ("cluster.hbm_tbps=1e-15", "cluster.hbm_tbps"),
        ("cluster.peak_tflops_bf16=1e-15", "cluster.peak_tflops_bf16"),
        ("cluster.nic_latency_us=1e15", "cluster.nic_latency_us"),
        ("cluster.nic_gbps=1e-9", "cluster.nic_gbps"),
    ] {
        refused(&["simulate", "--set", set], key);
    }
}

#[test]
fn time_beyond_the_engine_range_is_an_error() {
    // Every model size at its documented maximum, inside every cluster bound.
    let maxed = file(
        "maxsize.toml",
        "[model]\npreset = \"llama3-8b\"\nlayers = 4096\nhidden = 131072\nffn_hidden = 1048576\n\
         heads = 16384\nkv_heads = 16384\nvocab = 16777216\nseq_len = 16777216\n\
         [cluster]\npreset = \"dgx-h100\"\nnodes = 2\n[parallel]\ntp = 2\npp = 2\n\
         [training]\nglobal_batch = 16\n",
    );
    refused(
        &["simulate", maxed.to_str().unwrap(), "--allow-oom"],
        "longer than 26.7 days",
    );
}

#[test]
fn graphs_past_the_size_limit_are_refused_by_key() {
    let big = file(
        "many-micro-batches.toml",
        "[model]\npreset = \"llama3-8b\"\nseq_len = 2048\n[cluster]\npreset = \"dgx-h200\"\n\
         nodes = 1\n[parallel]\ntp = 4\npp = 1\n[training]\nglobal_batch = 65536\n",
    );
    refused(
        &["simulate", big.to_str().unwrap()],
        "training.global_batch",
    );
    refused(
        &[
            "predict",
            big.to_str().unwrap(),
            "--tokens",
            "1e12",
            "--samples",
            "2",
        ],
        "training.global_batch",
    );
}

fn variability(name: &str, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/variability.toml"
    ))
    .unwrap();
    assert!(text.contains(from));
    file(name, &text.replace(from, to))
}

/// A small `predict` of job file `f` (1e12 tokens, 8 samples, 20 runs) is refused with `want`.
fn small_predict_refused(f: &std::path::Path, want: &str) {
    refused(
        &[
            "predict",
            f.to_str().unwrap(),
            "--tokens",
            "1e12",
            "--samples",
            "8",
            "--runs",
            "20",
        ],
        want,
    );
}

#[test]
fn non_finite_step_times_are_errors() {
    let speed = "gpu_speed = { dist = \"normal\", mean = 1.0, std = 0.03 }";
    for (i, to) in [
        "gpu_speed = { dist = \"normal\", mean = 1.0, std = 1e300 }",
        "gpu_speed = { dist = \"lognormal\", mu = 700, sigma = 0.1 }",
    ]
    .into_iter()
    .enumerate()
    {
        let f = variability(&format!("speed-{i}.toml"), speed, to);
        small_predict_refused(&f, "[variability]");
    }
}

#[test]
fn abandoned_runs_are_reported_not_timed() {
    let f = variability(
        "failures.toml",
        "rate_per_gpu_hour = 2e-5",
        "rate_per_gpu_hour = 1e6",
    );
    small_predict_refused(&f, "abandoned");
}

#[test]
fn absurd_token_counts_are_refused_at_once() {
    refused(
        &["predict", "--tokens", "1e300", "--samples", "4"],
        "tokens",
    );
}

/// A Kineto trace with one GEMM, `aten::mm` of [8192, 4096] x [4096, 2048] (shape key
/// `8192x2048x4096`: FC1 of the Megatron A100 job), whose kernel ran `us` microseconds.
fn one_gemm_trace(name: &str, us: f64) -> PathBuf {
    let text = format!(
        r#"{{"deviceProperties": [{{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}}],
"traceEvents": [
 {{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 10000, "args": {{}}}},
 {{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 40,
   "args": {{"Input Dims": [[8192, 4096], [4096, 2048]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}}}},
 {{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 1, "args": {{"correlation": 1}}}},
 {{"ph": "X", "cat": "kernel", "name": "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "pid": 0, "tid": 7, "ts": 100, "dur": {us},
   "args": {{"correlation": 1, "stream": 7, "device": 0}}}}
]}}"#
    );
    file(name, &text)
}

fn compute_s(job: &std::path::Path) -> f64 {
    let o = prism_limited(&["simulate", job.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["breakdown"]["compute_s"].as_f64().unwrap()
}

/// `profile import` -> `[cost] kernel_table` -> a changed, correct iteration: the imported
/// `gemm` row prices every GEMM of its shape, and the compute time moves by exactly the
/// measured difference times the number of such GEMMs (forward and recomputed: a whole count).
#[test]
fn imported_kernel_tables_change_the_iteration_correctly() {
    let job_text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../validation/kineto/megatron-gpt-tp8-a100.toml"
    ))
    .unwrap();
    let mut times = Vec::new();
    for (i, us) in [1000.0, 2000.0].into_iter().enumerate() {
        let trace = one_gemm_trace(&format!("gemm-{i}.json"), us);
        let table = trace.with_extension("csv");
        let o = prism_limited(&[
            "profile",
            "import",
            trace.to_str().unwrap(),
            "--out",
            table.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let csv = std::fs::read_to_string(&table).unwrap();
        assert!(csv.contains("gemm,8192x2048x4096,bf16"), "{csv}");
        let job = file(
            &format!("kt-job-{i}.toml"),
            &format!(
                "{job_text}\n[cost]\nkernel_table = \"{}\"\n",
                table.display()
            ),
        );
        times.push(compute_s(&job));
    }
    let plain = file("kt-job-plain.toml", &job_text);
    let base = compute_s(&plain);
    assert!(times[0] != base, "the table changed nothing");
    // 1 ms more per GEMM of the shape: a whole number (>= the 40 layers' FC1) of milliseconds.
    let n = (times[1] - times[0]) / 1e-3;
    assert!(n >= 39.5 && (n - n.round()).abs() < 1e-6, "{n}");
    // A row no kernel of the job can use is refused by name.
    let bad = file(
        "nonsense.csv",
        "op,shape,dtype,seconds\nnonsense_op,1x2x3,bf16,0.001\n",
    );
    let job = file(
        "kt-job-bad.toml",
        &format!("{job_text}\n[cost]\nkernel_table = \"{}\"\n", bad.display()),
    );
    refused(&["simulate", job.to_str().unwrap()], "nonsense_op");
}

#[test]
fn interleaved_jobs_with_huge_batches_are_refused_by_key() {
    let job = file(
        "interleaved.toml",
        "[model]\npreset = \"gpt-7.5b\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 4\n\
         [parallel]\ntp = 4\npp = 4\nvpp = 3\nschedule = \"interleaved\"\nrecompute = \"full\"\n\
         [training]\nglobal_batch = 32000\n",
    );
    refused(
        &["simulate", job.to_str().unwrap()],
        "training.global_batch",
    );
}

#[test]
fn out_of_memory_names_the_job_and_only_fixes_that_fit() {
    // The README's deeper pipeline at tp 4 does not fit; full recompute does, selective not.
    let args = [
        "simulate",
        "--reduced",
        "--set",
        "parallel.tp=4",
        "--set",
        "parallel.pp=32",
        "--set",
        "parallel.dp=",
        "--set",
        "parallel.pipeline_layout=",
        "--set",
        "parallel.first_stage_layers=3",
        "--set",
        "parallel.last_stage_layers=3",
    ];
    let o = prism_limited(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(matches!(o.status.code(), Some(1) | Some(2)), "{err}");
    assert!(err.contains("<embedded default>: cluster.hbm_gib"), "{err}");
    assert!(err.contains("parallel.recompute = \"full\""), "{err}");
    assert!(!err.contains("\"selective\""), "{err}");
}

#[test]
fn the_readme_override_example_runs() {
    let o = prism_limited(&[
        "simulate",
        "--reduced",
        "--json",
        "--set",
        "parallel.pp=32",
        "--set",
        "parallel.dp=",
        "--set",
        "parallel.pipeline_layout=E|(t|)*126,L",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["parallel"]["pp"], 32);
    assert_eq!(v["parallel"]["dp"], 64);
    assert_eq!(v["parallel"]["vpp"], 4);
    assert_eq!(v["parallel"]["pipeline_layout"], "E|(t|)*126,L");
}

#[test]
fn an_unwritable_trace_path_fails_before_the_run() {
    let t0 = std::time::Instant::now();
    refused(
        &["simulate", "--trace", "/nonexistent-dir/trace.json"],
        "cannot create trace file",
    );
    // Before the 16,384-GPU full run (seconds), not after it.
    assert!(t0.elapsed().as_secs_f64() < 2.0);
}

/// A 150 MB Kineto trace imports under a 1 GiB address-space limit: the reader keeps raw
/// slices of the text, not a parsed tree (which took about 20 times the file).
#[test]
fn large_traces_import_in_bounded_memory() {
    use std::io::Write;
    let path = std::env::temp_dir().join(format!("prism-big-{}.json", std::process::id()));
    {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        write!(
            w,
            r#"{{"deviceProperties": [{{"id": 0, "name": "NVIDIA H100 80GB HBM3"}}], "traceEvents": ["#
        )
        .unwrap();
        let n = 400_000u64;
        for i in 0..n {
            let ts = i * 100;
            write!(
                w,
                r#"{{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": {ts}, "dur": 40, "args": {{"Input Dims": [[8192, 4096], [4096, 2048]], "Input type": ["c10::BFloat16", "c10::BFloat16"], "External id": {i}}}}},
{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": {}, "dur": 1, "args": {{"correlation": {i}}}}},
{{"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "pid": 0, "tid": 7, "ts": {}, "dur": 30, "args": {{"correlation": {i}, "stream": 7, "device": 0}}}}{}"#,
                ts + 10,
                ts + 20,
                if i + 1 < n { "," } else { "" }
            )
            .unwrap();
        }
        write!(w, "]}}").unwrap();
    }
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size > 150_000_000, "{size}");
    let o = Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 1048576; exec \"$0\" profile import \"$1\" --json")
        .arg(env!("CARGO_BIN_EXE_prism"))
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kernels"], 400_000);
    assert_eq!(v["table_rows"], 1);
}
