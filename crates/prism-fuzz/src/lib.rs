//! A mutation fuzzer over Prism's readers and entry points, on stable Rust.
//!
//! Each case takes a seed input of one target (a job file, an HF `config.json`, a kernel table,
//! a samples file, a distribution table, validation cases, a Kineto trace), applies one to four
//! mutations drawn from a seeded generator (byte flips, deletions, duplicated ranges, numbers
//! replaced by extreme values, lines dropped, swapped or copied), and feeds it to the reader. A
//! job that loads is also simulated (reduced) and predicted (2 samples, 4 runs) when its graph
//! is small ([`SMALL_OPS`]). A case passes when it returns (a value or an error); a panic, or a
//! case slower than [`SLOW_S`], is a finding. Aborts (out of memory) end the process: run it
//! under an address-space limit (`ulimit -v`), as CI does.
//!
//! Every case is a pure function of `(seed, index)`: a finding is replayed with
//! `prism-fuzz --seed S --start I --cases 1 --keep DIR`, which writes the input, and becomes a
//! regression file under `regressions/<target>/` (replayed by this crate's tests).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// A graph at most this large is simulated and predicted by a fuzz case.
pub const SMALL_OPS: u64 = 200_000;

/// A case slower than this is a finding (a hang, in effect).
pub const SLOW_S: f64 = 10.0;

/// What a case feeds its input to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// Job file (TOML), then `simulate` and `predict` on small jobs.
    Job,
    /// HuggingFace `config.json`.
    Hf,
    /// Kernel-time table (CSV).
    KernelTable,
    /// Samples file (CSV).
    Samples,
    /// Distribution table (CSV, `prism fit` output).
    DistTable,
    /// Validation cases (CSV).
    Cases,
    /// Kineto trace (JSON), then class totals and the kernel table.
    Kineto,
    /// Timing log of `prism detect` (CSV or Megatron-LM lines), then the three detectors.
    ResilienceLog,
    /// Scenario of `prism resilience` (TOML).
    Scenario,
    /// Kernel micro-benchmark results (CSV, `prism calibrate --kernels`).
    KernelBench,
    /// Megatron-LM launch script (`prism import megatron`), then the job it writes.
    Megatron,
    /// NeMo training config (YAML, `prism import nemo`), then the job it writes.
    Nemo,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 12] = [
        Target::Job,
        Target::Hf,
        Target::KernelTable,
        Target::Samples,
        Target::DistTable,
        Target::Cases,
        Target::Kineto,
        Target::ResilienceLog,
        Target::Scenario,
        Target::KernelBench,
        Target::Megatron,
        Target::Nemo,
    ];

    /// Name (command line, regression folders).
    pub fn name(self) -> &'static str {
        match self {
            Target::Job => "job",
            Target::Hf => "hf",
            Target::KernelTable => "kernel-table",
            Target::Samples => "samples",
            Target::DistTable => "dist-table",
            Target::Cases => "cases",
            Target::Kineto => "kineto",
            Target::ResilienceLog => "resilience-log",
            Target::Scenario => "scenario",
            Target::KernelBench => "kernel-bench",
            Target::Megatron => "megatron",
            Target::Nemo => "nemo",
        }
    }

    /// The target of a name.
    pub fn from_name(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == s)
    }

    /// The seed inputs: the repository's own examples and test data.
    pub fn seeds(self) -> &'static [&'static str] {
        match self {
            Target::Job => &[
                prism_io::jobfile::DEFAULT_JOB_TOML,
                include_str!("../../../examples/llama3-405b-16k-variability.toml"),
                include_str!("../../prism-cli/tests/data/variability.toml"),
                include_str!("../../prism-cli/tests/data/explore.toml"),
                include_str!("../../prism-cli/tests/data/pruning.toml"),
                include_str!("../../prism-cli/tests/data/geo.toml"),
                include_str!("../../prism-io/tests/data/jobs/canonical.toml"),
                include_str!("../../prism-io/tests/data/jobs/inline.toml"),
                include_str!("../../prism-io/tests/data/jobs/megatron-aliases.toml"),
                include_str!("../../prism-io/tests/data/jobs/cp-a2a.toml"),
                include_str!("../../../validation/kineto/megatron-gpt-tp8-a100.toml"),
            ],
            Target::Megatron => &[
                include_str!("../../prism-io/tests/data/megatron/llama3-70b-h100.sh"),
                include_str!("../../prism-io/tests/data/megatron/gpt3-175b.cmd"),
                include_str!("../../prism-io/tests/data/megatron/mistral-7b-32k-a2a.sh"),
            ],
            Target::Nemo => &[
                include_str!("../../prism-io/tests/data/nemo/llama3-70b.yaml"),
                include_str!("../../prism-io/tests/data/nemo/gpt3-175b-launcher.yaml"),
            ],
            Target::Hf => &[
                include_str!("../../prism-io/tests/data/hf/mistral-7b.json"),
                include_str!("../../prism-io/tests/data/hf/mixtral-8x7b.json"),
                include_str!("../../prism-io/tests/data/hf/qwen2-7b.json"),
                include_str!("../../prism-io/tests/data/hf/Meta-Llama-3-8B/config.json"),
                include_str!("../../prism-io/tests/data/hf/deepseek-v3.json"),
                include_str!("../../prism-io/tests/data/hf/gemma3-27b.json"),
                include_str!("../../prism-io/tests/data/hf/llama4-maverick.json"),
                include_str!("../../prism-io/tests/data/hf/gpt-oss-120b.json"),
                include_str!("../../prism-io/tests/data/hf/llava-1.5-7b.json"),
                include_str!("../../prism-io/tests/data/hf/falcon-7b.json"),
                include_str!("../../prism-io/tests/data/hf/gpt2-xl.json"),
                include_str!("../../prism-io/tests/data/hf/ernie4.5-21b-a3b.json"),
                include_str!("../../prism-io/tests/data/hf/dots-llm1.json"),
            ],
            Target::KernelTable => &[
                include_str!("../../prism-io/tests/data/kernels_h100.csv"),
                include_str!("../../prism-io/tests/data/jobs/kernels.csv"),
            ],
            Target::Samples => &[include_str!("../../prism-io/tests/data/samples.csv")],
            Target::DistTable => &[
                include_str!("../../prism-cli/tests/data/fit_table.csv"),
                include_str!("../../prism-cli/tests/data/fit_table_op.csv"),
            ],
            Target::Cases => &[include_str!("../../../validation/cases.csv")],
            Target::Kineto => &[KINETO_SEED],
            Target::ResilienceLog => &[LOG_SEED, MEGATRON_SEED],
            Target::Scenario => &[
                include_str!("../../../examples/resilience/mixed-6h.toml"),
                include_str!("../../../examples/resilience/fail-slow-4h.toml"),
                include_str!("../../../examples/resilience/fail-stop-4h.toml"),
            ],
            Target::KernelBench => &[include_str!("../../../validation/h100/kernels.csv")],
        }
    }
}

/// A small timing log: heartbeats and per-stage steps of two units, one of them slowing down.
const LOG_SEED: &str = "kind,iteration,unit,start_s,end_s,busy_s,tokens,sum_sq_len
heartbeat,,dp0.pp0,0.0,,,,
heartbeat,,dp0.pp1,0.5,,,,
step,0,dp0.pp0,0.0,2.0,1.5,8192,16777216
step,0,dp0.pp1,0.4,2.4,1.6,8192,16777216
step,1,dp0.pp0,2.4,4.3,1.4,7000,9000000
step,1,dp0.pp1,2.8,4.8,1.5,7000,9000000
heartbeat,,dp0.pp0,10.0,,,,
step,2,dp0.pp0,4.8,6.9,1.6,8000,20000000
step,2,dp0.pp1,5.2,9.2,3.9,8000,20000000
";

/// Megatron-LM iteration lines.
const MEGATRON_SEED: &str = " [2024-05-01 10:00:00] iteration      100/  500000 | consumed samples:        51200 | elapsed time per iteration (ms): 1500.0 | learning rate: 1.0E-04 | global batch size:   512 | lm loss: 2.1E+00 |
 [2024-05-01 10:00:02] iteration      101/  500000 | consumed samples:        51712 | elapsed time per iteration (ms): 1510.0 | global batch size:   512 |
 [2024-05-01 10:00:03] iteration      102/  500000 | consumed samples:        52224 | elapsed time per iteration (ms): 2510.0 | global batch size:   512 |
";

/// A small Kineto trace: a profiler step, a GEMM and an attention call with their shapes, an
/// NCCL collective, a memset.
const KINETO_SEED: &str = r#"{"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
"traceEvents": [
{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 1000, "args": {}},
{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 40, "args": {"Input Dims": [[64, 32], [32, 16]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}},
{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 1, "args": {"correlation": 1}},
{"ph": "X", "cat": "cpu_op", "name": "aten::_scaled_dot_product_flash_attention", "pid": 1, "tid": 1, "ts": 120, "dur": 20, "args": {"Input Dims": [[2, 8, 128, 64], [2, 2, 128, 64], [2, 2, 128, 64], [], [], [], []], "Concrete Inputs": ["", "", "", "0.", "True", "False", ""]}},
{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 125, "dur": 1, "args": {"correlation": 2}},
{"ph": "X", "cat": "user_annotation", "name": "nccl:all_reduce", "pid": 1, "tid": 1, "ts": 200, "dur": 20, "args": {"Input Dims": [[1024, 8]], "Input type": ["c10::BFloat16"]}},
{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 205, "dur": 1, "args": {"correlation": 3}},
{"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "pid": 0, "tid": 7, "ts": 100, "dur": 10, "args": {"correlation": 1, "stream": 7, "device": 0}},
{"ph": "X", "cat": "kernel", "name": "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "pid": 0, "tid": 7, "ts": 190, "dur": 7, "args": {"correlation": 2, "stream": 7, "device": 0}},
{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)", "pid": 0, "tid": 24, "ts": 210, "dur": 50, "args": {"correlation": 3, "stream": 24, "device": 0}},
{"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 400, "dur": 1, "args": {"stream": 7, "bytes": 4096}}
]}"#;

/// Values a number is replaced with: bounds, overflows, signs, non-numbers.
const EXTREMES: &[&str] = &[
    "0",
    "-1",
    "1",
    "3",
    "0.0",
    "-0.0",
    "1e-300",
    "1e300",
    "-1e300",
    "1e15",
    "1e-15",
    "nan",
    "inf",
    "-inf",
    "65535",
    "65536",
    "1048576",
    "2147483647",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551616",
    "1e19",
    "0.5",
    "\"x\"",
    "true",
    "[]",
    "{}",
];

/// The input of case `index` of `target` under `seed`.
pub fn case_input(target: Target, seed: u64, index: u64) -> String {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(
        seed ^ (index.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (target as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let seeds = target.seeds();
    let mut text = seeds[rng.random_range(0..seeds.len())].to_string();
    for _ in 0..rng.random_range(1..=4u32) {
        text = mutate(&text, &mut rng, seeds);
    }
    text
}

/// One mutation of `text`.
fn mutate(text: &str, rng: &mut Xoshiro256PlusPlus, seeds: &[&str]) -> String {
    let bytes = text.as_bytes();
    if bytes.is_empty() {
        return EXTREMES[rng.random_range(0..EXTREMES.len())].to_string();
    }
    let at = rng.random_range(0..bytes.len());
    match rng.random_range(0..8u32) {
        // A number replaced by an extreme value.
        0..=2 => {
            let starts: Vec<usize> = (0..bytes.len())
                .filter(|&i| {
                    bytes[i].is_ascii_digit() && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric())
                })
                .collect();
            if starts.is_empty() {
                return text.to_string();
            }
            let s = starts[rng.random_range(0..starts.len())];
            let e = (s..bytes.len())
                .find(|&i| !(bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'.' | b'_')))
                .unwrap_or(bytes.len());
            let v = EXTREMES[rng.random_range(0..EXTREMES.len())];
            format!("{}{v}{}", &text[..s], &text[e..])
        }
        // A byte flipped to another printable byte (or a control or non-ASCII one).
        3 => {
            let mut b = bytes.to_vec();
            b[at] = match rng.random_range(0..4u32) {
                0 => rng.random_range(0..32u8),
                1 => rng.random_range(128..=255u8),
                _ => rng.random_range(32..127u8),
            };
            String::from_utf8_lossy(&b).into_owned()
        }
        // A range deleted.
        4 => {
            let end = (at + rng.random_range(1..64usize)).min(bytes.len());
            let mut b = bytes.to_vec();
            b.drain(at..end);
            String::from_utf8_lossy(&b).into_owned()
        }
        // A range duplicated in place.
        5 => {
            let end = (at + rng.random_range(1..256usize)).min(bytes.len());
            let mut b = bytes.to_vec();
            let copy = b[at..end].to_vec();
            b.splice(at..at, copy);
            String::from_utf8_lossy(&b).into_owned()
        }
        // Lines: one dropped, two swapped, or one copied from another seed.
        _ => {
            let mut lines: Vec<&str> = text.lines().collect();
            let n = lines.len();
            let i = rng.random_range(0..n);
            match rng.random_range(0..3u32) {
                0 => {
                    lines.remove(i);
                }
                1 => lines.swap(i, rng.random_range(0..n)),
                _ => {
                    let other: Vec<&str> =
                        seeds[rng.random_range(0..seeds.len())].lines().collect();
                    if !other.is_empty() {
                        lines.insert(i, other[rng.random_range(0..other.len())]);
                    }
                }
            }
            lines.join("\n")
        }
    }
}

/// How a case ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The reader (and the entry points) returned a value.
    Accepted,
    /// The reader or an entry point returned an error.
    Refused,
    /// A panic, with its message: a finding.
    Panicked(String),
}

/// Feeds `input` to `target`'s reader and, for a small valid job, to `simulate` and `predict`.
/// Returns the outcome and the time it took.
pub fn run_case(target: Target, input: &str) -> (Outcome, Duration) {
    let t0 = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| feed(target, input)));
    let outcome = match r {
        Ok(true) => Outcome::Accepted,
        Ok(false) => Outcome::Refused,
        Err(p) => Outcome::Panicked(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic".into()),
        ),
    };
    (outcome, t0.elapsed())
}

/// True when everything accepted the input.
fn feed(target: Target, input: &str) -> bool {
    use prism_io::*;
    match target {
        Target::Job => match jobfile::load_job_str(input, "fuzz.toml", None, &[]) {
            Ok(loaded) => entry_points(&loaded),
            Err(_) => false,
        },
        Target::Hf => hf::model_from_hf_config(input, "config.json").is_ok(),
        Target::Megatron => {
            let opts = megatron_args::ImportOptions {
                cluster: "dgx-h100".into(),
                nodes: Some(4),
                ..Default::default()
            };
            match megatron_args::import_megatron(input, "train.sh", &opts) {
                // The job it writes must load or be refused, never panic.
                Ok(imported) => {
                    jobfile::load_job_str(&imported.toml, "train.sh", None, &[]).is_ok()
                }
                Err(_) => false,
            }
        }
        Target::Nemo => {
            let opts = nemo::NemoOptions {
                machine: megatron_args::ImportOptions {
                    cluster: "dgx-h100".into(),
                    ..Default::default()
                },
                ..Default::default()
            };
            match nemo::import_nemo(input, "config.yaml", &opts) {
                // The job it writes must load or be refused, never panic.
                Ok(imported) => {
                    jobfile::load_job_str(&imported.toml, "config.yaml", None, &[]).is_ok()
                }
                Err(_) => false,
            }
        }
        Target::KernelTable => kernel_table::parse_kernel_table(input, "k.csv").is_ok(),
        Target::KernelBench => prism_io::kernel_bench::parse_kernel_bench(input, "b.csv").is_ok(),
        Target::Samples => samples::parse_samples(input, "s.csv").is_ok(),
        Target::DistTable => samples::parse_dist_table(input, "d.csv").is_ok(),
        Target::Cases => validation::parse_cases(input, "cases.csv").is_ok(),
        Target::Kineto => match kineto::parse_kineto(input, "trace.json") {
            Ok(trace) => {
                let _ = kineto::class_totals(&trace);
                let _ = kineto::to_kernel_table(&trace, "bf16");
                true
            }
            Err(_) => false,
        },
        Target::ResilienceLog => match resilience::parse_log(input, "log.csv") {
            Ok(events) => {
                use prism_resilience::detect::*;
                let cfg = DetectorConfig::default();
                let _ = run_detector(&mut ResihpDetector::new(cfg), &events);
                let _ = run_detector(&mut ThresholdDetector::new(cfg), &events);
                let _ = run_detector(&mut GreyhoundDetector::new(cfg), &events);
                true
            }
            Err(_) => false,
        },
        Target::Scenario => resilience::parse_scenario(input, "s.toml").is_ok(),
    }
}

/// Loaded jobs that reached `simulate` and `predict` (a process-wide count, for the report).
pub static SIMULATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `simulate` (reduced) and `predict` (2 samples, 4 runs) on a loaded job with a small graph.
fn entry_points(loaded: &prism_io::jobfile::LoadedJob) -> bool {
    use prism_core::engine::{Mode, SimOptions};
    let job = &loaded.job;
    if prism_core::graph::ExecutionGraph::min_ops(job) > SMALL_OPS
        || prism_core::graph::ExecutionGraph::estimate_ops(job) > SMALL_OPS
    {
        return true;
    }
    SIMULATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let opts = SimOptions {
        mode: Mode::Reduced,
        ..SimOptions::default()
    };
    let sim = prism_core::engine::simulate_or_full(job, &opts);
    if let Ok(r) = &sim {
        assert!(
            r.summary.iteration_time_s.is_finite() && r.summary.iteration_time_s > 0.0,
            "simulate returned a non-finite or zero iteration: {}",
            r.summary.iteration_time_s
        );
    }
    let popts = prism_predict::predict::PredictOptions {
        tokens: 1e9,
        samples: 2,
        clusters: 1,
        runs: 4,
        quantile: 0.95,
        confidence: 0.95,
        seed: 1,
        per_rank: false,
        prune: true,
        pool: true,
    };
    let pred = prism_predict::predict::predict(
        job,
        &loaded.variability,
        &popts,
        &SimOptions::default(),
        &|_| {},
    );
    if let Ok(p) = &pred {
        assert!(
            p.steps.iter().all(|t| t.is_finite()) && p.totals.iter().all(|t| t.is_finite()),
            "predict returned non-finite times"
        );
    }
    sim.is_ok() && pred.is_ok()
}

/// Counts of a fuzz run, per target.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    /// Cases run.
    pub cases: u64,
    /// Accepted inputs.
    pub accepted: u64,
    /// Refused inputs (an error).
    pub refused: u64,
    /// Findings: `(case index, what)`.
    pub findings: Vec<(u64, String)>,
    /// The slowest case, seconds.
    pub slowest_s: f64,
}

/// Runs cases `start..start + cases` of `target` (in parallel; the result does not depend on
/// the thread count). `keep` is called with each finding's index and input.
pub fn fuzz(
    target: Target,
    seed: u64,
    start: u64,
    cases: u64,
    keep: &(dyn Fn(u64, &str) + Sync),
) -> Tally {
    use rayon::prelude::*;
    let results: Vec<(u64, Outcome, f64)> = (start..start + cases)
        .into_par_iter()
        .map(|i| {
            let input = case_input(target, seed, i);
            let (mut o, d) = run_case(target, &input);
            let secs = d.as_secs_f64();
            if secs > SLOW_S && !matches!(o, Outcome::Panicked(_)) {
                o = Outcome::Panicked(format!("slow: {secs:.1} s"));
            }
            if matches!(o, Outcome::Panicked(_)) {
                keep(i, &input);
            }
            (i, o, secs)
        })
        .collect();
    let mut t = Tally::default();
    for (i, o, secs) in results {
        t.cases += 1;
        t.slowest_s = t.slowest_s.max(secs);
        match o {
            Outcome::Accepted => t.accepted += 1,
            Outcome::Refused => t.refused += 1,
            Outcome::Panicked(m) => t.findings.push((i, m)),
        }
    }
    t
}

/// Silences the default panic message (findings are reported by [`fuzz`]); call once.
pub fn quiet_panics() {
    std::panic::set_hook(Box::new(|_| {}));
}
