//! Kineto import: a synthetic trace (always), and the real Megatron GPT tp8 A100 traces of
//! `shared/traces/megatron-gpt-tp8-a100/` when the checkout has them (skipped otherwise).

use std::path::{Path, PathBuf};

use prism_io::kernel_table::{parse_kernel_table, write_kernel_table};
use prism_io::kineto::{
    KernelClass, KinetoError, class_totals, coverage, parse_kineto, read_kineto, summary_table,
    to_kernel_table,
};
use serde_json::{Value, json};

/// The trace folder: `$PRISM_SHARED_DIR/traces/...`, else a `shared/` next to the crates
/// (`../../shared` from this crate) or next to the project root (`../../../shared`).
fn trace_dir() -> Option<PathBuf> {
    let rel = "traces/megatron-gpt-tp8-a100";
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("PRISM_SHARED_DIR") {
        candidates.push(PathBuf::from(dir).join(rel));
    }
    candidates.push(crate_dir.join("../../shared").join(rel));
    candidates.push(crate_dir.join("../../../shared").join(rel));
    let found = candidates
        .into_iter()
        .find(|d| d.join("megatron_kineto_0.json").is_file());
    if found.is_none() {
        eprintln!("skipped: shared/{rel} not present");
    }
    found
}

fn rank_file(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("megatron_kineto_{rank}.json"))
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-300)
}

/// Raw sums straight from the JSON: `(kernel count, kernel us, memcpy+memset count, us)`.
fn raw_sums(text: &str) -> (usize, f64, usize, f64) {
    let v: Value = serde_json::from_str(text).unwrap();
    let (mut kn, mut kus, mut mn, mut mus) = (0, 0.0, 0, 0.0);
    for e in v["traceEvents"].as_array().unwrap() {
        let dur = e["dur"].as_f64().unwrap_or(0.0);
        match e["cat"].as_str() {
            Some("kernel") => {
                kn += 1;
                kus += dur;
            }
            Some("gpu_memcpy" | "gpu_memset") => {
                mn += 1;
                mus += dur;
            }
            _ => {}
        }
    }
    (kn, kus, mn, mus)
}

/// A deliberately tiny, independent classifier for the context-free classes: returns
/// `(name, count, us)` per class from the raw JSON.
fn tiny_classifier(text: &str) -> Vec<(&'static str, usize, f64)> {
    let v: Value = serde_json::from_str(text).unwrap();
    let mut out = vec![
        ("nccl_all_reduce", 0, 0.0),
        ("gemm", 0, 0.0),
        ("softmax", 0, 0.0),
        ("norm", 0, 0.0),
    ];
    for e in v["traceEvents"].as_array().unwrap() {
        if e["cat"] != "kernel" {
            continue;
        }
        let name = e["name"].as_str().unwrap();
        let slot = if name.starts_with("ncclDevKernel_AllReduce") {
            0
        } else if name.contains("gemm") {
            1
        } else if name.contains("softmax") {
            2
        } else if name.contains("LayerNorm") {
            3
        } else {
            continue;
        };
        out[slot].1 += 1;
        out[slot].2 += e["dur"].as_f64().unwrap();
    }
    out
}

#[test]
fn megatron_rank0_class_totals_reproduce_the_trace() {
    let Some(dir) = trace_dir() else { return };
    let path = rank_file(&dir, 0);
    let text = std::fs::read_to_string(&path).unwrap();
    let trace = read_kineto(&path).unwrap();
    let totals = class_totals(&trace);
    eprintln!(
        "{} ({}, step {:.1} ms):\n{}",
        path.display(),
        trace.device.as_deref().unwrap_or("?"),
        trace.step_s.unwrap_or(f64::NAN) * 1e3,
        summary_table(&trace)
    );

    // Everything the GPU ran is accounted for, exactly.
    let (kn, kus, mn, mus) = raw_sums(&text);
    let all: f64 = totals.values().map(|t| t.1).sum();
    let n: usize = totals.values().map(|t| t.0).sum();
    assert_eq!(n, kn + mn);
    assert!(
        close(all, (kus + mus) * 1e-6, 1e-9),
        "{all} vs {kus} + {mus} us"
    );
    let kernels_only: f64 = totals
        .iter()
        .filter(|(c, _)| **c != "memcpy")
        .map(|(_, t)| t.1)
        .sum();
    assert!(
        close(kernels_only, kus * 1e-6, 1e-9),
        "{kernels_only} vs {kus} us"
    );
    assert!(close(totals["memcpy"].1, mus * 1e-6, 1e-9));
    assert_eq!(totals["memcpy"].0, mn);

    // Context-free classes against the tiny classifier (within 1%; exact in practice).
    for (class, count, us) in tiny_classifier(&text) {
        let (c, s) = totals[class];
        assert_eq!(c, count, "{class}");
        assert!(close(s, us * 1e-6, 0.01), "{class}: {s} s vs {us} us");
    }

    // Hand-verified against the trace (kernel -> correlation -> cuda launch -> enclosing ops):
    // 84 NCCL ring all-reduces (81 fp16 + 3 fp32); 241 GEMMs = 40 layers x (qkv, out_proj,
    // fc1, fc2, baddbmm, bmm) + lm_head; 15 kernels under _VocabParallelCrossEntropy; 2 under
    // aten::embedding; the remaining 227 generic kernels elementwise; nothing unclassified.
    let expect: [(&str, usize, f64); 8] = [
        ("nccl_all_reduce", 84, 241_191.0),
        ("gemm", 241, 86_781.0),
        ("softmax", 40, 17_025.0),
        ("norm", 81, 11_046.0),
        ("loss", 15, 1_108.0),
        ("embedding", 2, 413.0),
        ("elementwise", 227, 15_017.0),
        ("memcpy", 87, 146.0),
    ];
    for (class, count, us) in expect {
        let (c, s) = totals.get(class).copied().unwrap_or_default();
        assert_eq!(c, count, "{class}");
        assert!(close(s, us * 1e-6, 0.01), "{class}: {s} s vs {us} us");
    }
    let other = totals.get("other").map_or(0.0, |t| t.1);
    eprintln!("other: {:.3}% of GPU time", 100.0 * other / all);
    assert!(other < 0.02 * all);

    assert!(
        trace.device.as_deref().is_some_and(|d| d.contains("A100")),
        "{:?}",
        trace.device
    );
    let step = trace.step_s.unwrap();
    assert!(close(step, 0.603, 0.05), "step {step} s");

    // Shapes and message sizes.
    let gemm_cov = coverage(&trace, KernelClass::Gemm).unwrap();
    let nccl_cov = coverage(&trace, KernelClass::NcclAllReduce).unwrap();
    eprintln!(
        "GEMM shape coverage: {:.1}% of GEMM time; all-reduce size coverage: {:.1}%",
        100.0 * gemm_cov,
        100.0 * nccl_cov
    );
    assert!(gemm_cov >= 0.99);
    assert!(nccl_cov >= 0.99);
    let fp16_ar: Vec<_> = trace
        .kernels
        .iter()
        .filter(|k| k.name.starts_with("ncclDevKernel_AllReduce_Sum_f16"))
        .collect();
    assert_eq!(fp16_ar.len(), 81);
    // 80 tensor-parallel all-reduces of [2048, 4, 4096] fp16 activations and one of [4, 2048,
    // 4096] (the embedding's).
    assert!(fp16_ar.iter().all(|k| k.bytes == Some(2048 * 4 * 4096 * 2)));

    // Kernel table: seven GEMM shapes, medians of 40 launches (one for lm_head).
    let table = to_kernel_table(&trace, "bf16");
    for (op, shape, dtype, s) in table.iter() {
        eprintln!("{op},{shape},{dtype},{:.1} us", s * 1e6);
    }
    assert_eq!(table.len(), 7);
    let want = [
        ("8192x1536x4096", 400.0),  // qkv
        ("8192x4096x512", 161.0),   // attention out projection (tp-sharded K)
        ("8192x2048x4096", 522.0),  // fc1
        ("8192x4096x2048", 566.0),  // fc2
        ("32x2048x2048x64", 294.0), // scores, baddbmm
        ("32x2048x64x2048", 184.0), // context, bmm
        ("8192x6400x4096", 1698.0), // lm_head (vocab / tp)
    ];
    for (shape, us) in want {
        let got = table.get("gemm", shape, "bf16");
        assert_eq!(got, Some(us / 1e6), "{shape}");
    }
    let csv = write_kernel_table(&table);
    assert_eq!(parse_kernel_table(&csv, "kineto.csv").unwrap(), table);
}

#[test]
fn megatron_all_ranks_import() {
    let Some(dir) = trace_dir() else { return };
    for rank in 0..8 {
        let path = rank_file(&dir, rank);
        if !path.is_file() {
            continue;
        }
        let trace = read_kineto(&path).unwrap();
        let totals = class_totals(&trace);
        let all: f64 = totals.values().map(|t| t.1).sum();
        let other = totals.get("other").map_or(0.0, |t| t.1);
        let gemm = totals["gemm"];
        let ar = totals["nccl_all_reduce"];
        eprintln!(
            "rank {rank}: step {:.1} ms, kernels {:.1} ms, gemm {} / {:.1} ms, all-reduce {} / \
             {:.1} ms, other {:.2}%, gemm shape coverage {:.1}%",
            trace.step_s.unwrap() * 1e3,
            all * 1e3,
            gemm.0,
            gemm.1 * 1e3,
            ar.0,
            ar.1 * 1e3,
            100.0 * other / all,
            100.0 * coverage(&trace, KernelClass::Gemm).unwrap()
        );
        assert!(other < 0.02 * all, "rank {rank}");
        assert_eq!(gemm.0, 241, "rank {rank}");
        assert_eq!(ar.0, 84, "rank {rank}");
        assert!(coverage(&trace, KernelClass::Gemm).unwrap() >= 0.99);
        assert_eq!(to_kernel_table(&trace, "bf16").len(), 7, "rank {rank}");
    }
}

#[test]
fn truncated_and_garbage_traces_name_the_origin() {
    // Truncated real trace (when present) and synthetic garbage: errors, never panics.
    let mut inputs: Vec<(String, String)> = vec![
        ("garbage.json".into(), "this is not json".into()),
        ("empty.json".into(), String::new()),
        (
            "truncated.json".into(),
            r#"{"traceEvents": [{"ph": "X", "#.into(),
        ),
        ("number.json".into(), "42".into()),
        ("noevents.json".into(), r#"{"schemaVersion": 1}"#.into()),
        (
            "badevents.json".into(),
            r#"{"traceEvents": {"a": 1}}"#.into(),
        ),
    ];
    if let Some(dir) = trace_dir() {
        let text = std::fs::read_to_string(rank_file(&dir, 0)).unwrap();
        for cut in [1, text.len() / 3, text.len() / 2, text.len() - 2] {
            let mut cut = cut;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            inputs.push((format!("cut{cut}.json"), text[..cut].to_owned()));
        }
    }
    for (origin, text) in &inputs {
        let e = parse_kineto(text, origin).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{origin}: ")), "{msg}");
    }
    let e = read_kineto(Path::new("no/such/kineto.json")).unwrap_err();
    assert!(matches!(e, KinetoError::Io { .. }));
    assert!(e.to_string().contains("no/such/kineto.json"));
}

#[test]
fn rule_errors_name_the_json_path() {
    let cases = [
        (
            json!({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": -3}]}),
            "traceEvents[0].dur",
        ),
        (
            json!({"traceEvents": [{}, {"ph": "X", "cat": "kernel", "name": "k", "ts": "x", "dur": 1}]}),
            "traceEvents[1].ts",
        ),
        (
            json!({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": 7, "ts": 1, "dur": 1}]}),
            "traceEvents[0].name",
        ),
        (json!({"traceEvents": [1]}), "traceEvents[0]"),
        (json!({"traceEvents": []}), "traceEvents"),
        (json!({"traceEvents": 3}), "traceEvents"),
        (json!({"events": []}), "$"),
    ];
    for (v, at) in cases {
        let e = parse_kineto(&v.to_string(), "t.json").unwrap_err();
        match &e {
            KinetoError::Rule {
                origin, at: got, ..
            } => {
                assert_eq!(origin, "t.json");
                assert_eq!(got, at, "{e}");
            }
            other => panic!("unexpected {other}"),
        }
    }
}

/// A hand-made trace with the structure Kineto writes: one CPU thread with nested operators,
/// runtime launches, kernels linked by `correlation`.
fn synthetic() -> Value {
    let op = |name: &str, ts: f64, dur: f64, args: Value| {
        json!({"ph": "X", "cat": "cpu_op", "name": name, "pid": 10, "tid": 10, "ts": ts,
               "dur": dur, "args": args})
    };
    let launch = |corr: u64, ts: f64| {
        json!({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10,
               "tid": 10, "ts": ts, "dur": 1, "args": {"correlation": corr}})
    };
    let kernel = |corr: u64, name: &str, ts: f64, dur: f64, stream: u64| {
        json!({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
               "dur": dur, "args": {"correlation": corr, "stream": stream, "device": 1}})
    };
    let mm = json!({"Input Dims": [[64, 32], [32, 16]], "Input type": ["c10::Half", "c10::Half"]});
    let sdpa = json!({
        "Input Dims": [[2, 8, 128, 64], [2, 2, 128, 64], [2, 2, 128, 64], [], [], [], []],
        "Concrete Inputs": ["", "", "", "0.", "True", "False", ""]
    });
    let nccl = json!({"Input Dims": [[1024, 8]], "Input type": ["c10::BFloat16"]});
    json!({
        "deviceProperties": [{"id": 0, "name": "GPU zero"}, {"id": 1, "name": "NVIDIA H100 80GB HBM3"}],
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 10, "tid": 10,
             "ts": 0, "dur": 1000, "args": {}},
            op("aten::linear", 10.0, 50.0, json!({})),
            op("aten::mm", 12.0, 40.0, mm.clone()),
            launch(1, 20.0),
            launch(2, 30.0),
            op("aten::mm", 60.0, 20.0, mm.clone()),
            launch(3, 65.0),
            op("aten::mm", 90.0, 20.0, mm),
            launch(4, 95.0),
            op("aten::_scaled_dot_product_flash_attention", 120.0, 20.0, sdpa),
            launch(5, 125.0),
            op("MyCrossEntropy", 150.0, 20.0, json!({})),
            op("aten::exp", 151.0, 5.0, json!({})),
            launch(6, 152.0),
            {"ph": "X", "cat": "user_annotation", "name": "nccl:all_reduce", "pid": 10, "tid": 10,
             "ts": 200, "dur": 20, "args": nccl},
            launch(7, 205.0),
            launch(8, 300.0),
            kernel(1, "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", 100.0, 10.0, 7),
            kernel(2, "void cublasLt::splitKreduce_kernel<32, 16, int>", 111.0, 2.0, 7),
            kernel(3, "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", 120.0, 20.0, 7),
            kernel(4, "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", 150.0, 30.0, 7),
            kernel(5, "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 190.0, 7.0, 7),
            kernel(6, "void at::native::vectorized_elementwise_kernel<4, exp>", 200.0, 1.5, 7),
            kernel(7, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)", 210.0, 50.0, 24),
            kernel(8, "void at::native::vectorized_elementwise_kernel<4, add>", 320.0, 0.5, 7),
            kernel(99, "some_unknown_kernel", 330.0, 0.25, 7),
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7,
             "ts": 400, "dur": 1, "args": {"stream": 7, "bytes": 4096}},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 10, "tid": 10, "ts": 20},
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}
        ]
    })
}

#[test]
fn synthetic_trace_links_kernels_to_their_operators() {
    let trace = parse_kineto(&synthetic().to_string(), "synthetic.json").unwrap();
    assert_eq!(trace.device.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(trace.step_s, Some(1000e-6));
    let classes: Vec<KernelClass> = trace.kernels.iter().map(|k| k.class).collect();
    use KernelClass as K;
    assert_eq!(
        classes,
        [
            K::Gemm,
            K::Gemm,
            K::Gemm,
            K::Gemm,
            K::Attention,
            K::Loss,
            K::NcclAllReduce,
            K::Elementwise,
            K::Other,
            K::Memcpy
        ]
    );
    let k = &trace.kernels;
    assert_eq!(k[0].shape.as_deref(), Some("64x16x32"));
    assert_eq!(k[0].op.as_deref(), Some("aten::mm"));
    assert_eq!(k[0].op_index, k[1].op_index);
    assert_ne!(k[0].op_index, k[2].op_index);
    assert_eq!(k[0].stream, 7);
    assert_eq!(k[0].ts_us, 100.0);
    assert_eq!(k[4].shape.as_deref(), Some("b2h8q128k128d64c"));
    assert_eq!(k[6].bytes, Some(1024 * 8 * 2));
    assert_eq!(k[6].stream, 24);
    assert_eq!(k[7].shape, None);
    assert_eq!(k[8].op, None);

    // GEMM samples per call: 10+2 (split-K summed), 20, 30 -> median 20 us.
    let table = to_kernel_table(&trace, "bf16");
    assert_eq!(table.len(), 2);
    assert_eq!(table.get("gemm", "64x16x32", "bf16"), Some(20e-6));
    assert_eq!(
        table.get("attention_fwd", "b2h8q128k128d64c", "bf16"),
        Some(7e-6)
    );
    let csv = write_kernel_table(&table);
    assert_eq!(parse_kernel_table(&csv, "s.csv").unwrap(), table);

    let totals = class_totals(&trace);
    assert_eq!(totals["gemm"].0, 4);
    assert!(close(totals["gemm"].1, 62e-6, 1e-12));
    assert_eq!(totals["other"], (1, 0.25e-6));
    assert_eq!(coverage(&trace, K::Gemm), Some(1.0));
    assert_eq!(coverage(&trace, K::Norm), None);
    let table_text = summary_table(&trace);
    assert!(table_text.contains("nccl_all_reduce"), "{table_text}");
}

/// The reader parses events one at a time from raw slices; an event repeating a key is refused
/// with its JSON path rather than one of the values being kept silently.
#[test]
fn repeated_keys_in_an_event_are_refused() {
    let text = r#"{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a", "name": "b",
        "ts": 0, "dur": 1}]}"#;
    let e = prism_io::kineto::parse_kineto(text, "t.json").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("traceEvents[0]") && msg.contains("repeat a key"),
        "{msg}"
    );
}

#[test]
fn gzip_compressed_traces_read_like_plain_ones() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../validation/h100");
    let t = prism_io::kineto::read_kineto(&dir.join("step_trace.json.gz"))
        .unwrap_or_else(|e| panic!("{e}"));
    // The H100 step of validation/h100: 4 micro-batches x (4 layers x 12 + 3 LM-head) GEMMs.
    let gemms = t
        .kernels
        .iter()
        .filter(|k| k.class == prism_io::kineto::KernelClass::Gemm)
        .count();
    assert_eq!(gemms, 4 * (4 * 12 + 3));
    // A truncated gzip stream is an error naming the file, not a panic.
    let bytes = std::fs::read(dir.join("step_trace.json.gz")).unwrap();
    let tmp = std::env::temp_dir().join(format!("prism-trunc-{}.json.gz", std::process::id()));
    std::fs::write(&tmp, &bytes[..bytes.len() / 2]).unwrap();
    let e = prism_io::kineto::read_kineto(&tmp).unwrap_err().to_string();
    std::fs::remove_file(&tmp).ok();
    assert!(e.contains("prism-trunc"), "{e}");
}
