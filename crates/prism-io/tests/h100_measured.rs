//! Prism's calibrated H100 cost model against kernels and a training step measured on a real
//! H100 (NVIDIA H100 80GB HBM3, PyTorch 2.11 / CUDA 13.0 / cuDNN 9.19; `validation/h100/`,
//! written by `python/h100bench/bench.py`, see `validation/h100/README.md`).
//!
//! The calibrated parameters were fitted on published multi-thousand-GPU runs, never on these
//! measurements, so this is an independent check: the model's time for each measured shape
//! (BF16 and FP8 GEMMs, cuDNN fused attention forward and backward, memory-bound kernels) and
//! for a whole 4-layer Llama training step. Run with `-- --nocapture` for the tables.

use std::path::PathBuf;

use prism_core::cost::compute::{ComputeModel, ComputeParams};
use prism_core::job::{Job, Precision};
use prism_core::ops::{ComputeOp, OpClass, Work};
use prism_core::{SimOptions, simulate};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../validation/h100")
}

/// A measurement file of JSON (`validation/h100/<name>`, or a path relative to it).
fn measured_json(name: &str) -> serde_json::Value {
    let path = dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one-GPU job of the measured step (also the GPU every kernel ran on).
fn step_job() -> Job {
    prism_io::jobfile::load_job_file(&dir().join("llama-4layer-step.toml"), &[])
        .unwrap_or_else(|e| panic!("{e}"))
        .job
}

/// One measured row of `kernels.csv`, read by Prism's own reader.
struct Row {
    kind: String,
    variant: String,
    work: Option<Work>,
    us: f64,
}

fn rows() -> Vec<Row> {
    let path = dir().join("kernels.csv");
    prism_io::kernel_bench::read_kernel_bench(&path)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(|k| Row {
            kind: k.kind,
            variant: k.variant,
            work: k.work,
            us: k.seconds * 1e6,
        })
        .collect()
}

/// `(m, n, k)` of a measured GEMM row.
fn mnk(r: &Row) -> Option<(u64, u64, u64)> {
    match r.work {
        Some(Work::Gemm { m, n, k, .. }) => Some((m, n, k)),
        _ => None,
    }
}

/// The GEMM row of `variant` timed on the same `(m, n, k)` as `x`, if any.
fn same_shape<'a>(rows: &'a [Row], variant: &str, x: &Row) -> Option<&'a Row> {
    let shape = mnk(x)?;
    rows.iter()
        .find(|y| y.kind == "gemm" && y.variant == variant && mnk(y) == Some(shape))
}

fn model(job: &Job, precision: Precision) -> ComputeModel {
    model_beside_nccl(job, precision, 0)
}

/// [`model`] with `held` SMs taken by NCCL kernels in flight (what the engine prices kernels
/// with while communication runs).
fn model_beside_nccl(job: &Job, precision: Precision, held: u32) -> ComputeModel {
    let mut job = job.clone();
    job.training.precision = precision;
    ComputeModel::with_extra_sms(&job, ComputeParams::h100(), None, held)
}

/// Model time of a measured row, microseconds, without the per-kernel launch overhead (the
/// measurement times back-to-back calls of one kernel, whose launches overlap).
fn predicted_us(m: &ComputeModel, class: OpClass, work: Work) -> f64 {
    let op = ComputeOp {
        name: "measured",
        class,
        work,
        recompute: false,
        sm_margin: false,
    };
    (m.time_s(&op) - m.params().launch_overhead_s) * 1e6
}

/// Signed relative error of the model, (model - measured) / measured.
fn err(pred: f64, meas: f64) -> f64 {
    (pred - meas) / meas
}

struct Stats {
    n: usize,
    mean_abs: f64,
    median: f64,
    max_abs: f64,
}

fn stats(e: &[f64]) -> Stats {
    let mut s: Vec<f64> = e.to_vec();
    s.sort_by(f64::total_cmp);
    Stats {
        n: s.len(),
        mean_abs: s.iter().map(|x| x.abs()).sum::<f64>() / s.len() as f64,
        median: s[s.len() / 2],
        max_abs: s.iter().map(|x| x.abs()).fold(0.0, f64::max),
    }
}

fn print_stats(what: &str, e: &[f64]) -> Stats {
    let s = stats(e);
    println!(
        "{what:34} n {:3}  median {:+6.1}%  mean |err| {:5.1}%  max |err| {:5.1}%",
        s.n,
        100.0 * s.median,
        100.0 * s.mean_abs,
        100.0 * s.max_abs
    );
    s
}

fn gemm_errors(variant: &str, precision: Precision, min_flops: f64) -> Vec<f64> {
    let job = step_job();
    let m = model(&job, precision);
    rows()
        .iter()
        .filter(|r| r.kind == "gemm" && r.variant == variant)
        .filter_map(|r| {
            let (mm, n, k) = mnk(r)?;
            let flops = 2.0 * (mm * n * k) as f64;
            (flops >= min_flops).then(|| {
                let work = Work::Gemm {
                    m: mm,
                    n,
                    k,
                    batch: 1,
                };
                err(predicted_us(&m, OpClass::Gemm, work), r.us)
            })
        })
        .collect()
}

#[test]
fn bf16_gemms_match_the_calibrated_model() {
    println!("\nH100 GEMMs: calibrated model vs measured (model - measured) / measured");
    let mut all = Vec::new();
    for v in ["bf16_nt", "bf16_nn", "bf16_tn"] {
        let e = gemm_errors(v, Precision::Bf16, 0.0);
        print_stats(v, &e);
        all.extend(e);
    }
    let s = print_stats("bf16, every layout", &all);
    assert!(s.n >= 150, "{} BF16 GEMM rows", s.n);
    // The model was fitted on published multi-thousand-GPU runs (clock_factor 0.875), whose
    // losses at scale it absorbs, so it may be slower than one GPU, not faster (the benchmark
    // does run at the sustained power-capped clock: `sustained_gemm_throughput_...` below).
    assert!(
        s.median > -0.05 && s.median < 0.20,
        "median error {:+.3}",
        s.median
    );
    // Large GEMMs (>= 1 TFLOP, the ones that dominate a step) agree tightly.
    let big: Vec<f64> = ["bf16_nt", "bf16_nn", "bf16_tn"]
        .iter()
        .flat_map(|v| gemm_errors(v, Precision::Bf16, 1e12))
        .collect();
    let b = print_stats("bf16, >= 1 TFLOP", &big);
    assert!(b.mean_abs < 0.15, "mean |err| {:.3}", b.mean_abs);
    assert!(b.max_abs < 0.30, "max |err| {:.3}", b.max_abs);
}

#[test]
fn fp8_gemms_and_scaling_recipes() {
    println!("\nH100 FP8 GEMMs (torch._scaled_mm / F.scaled_mm) vs the FP8 model");
    let t = print_stats(
        "fp8 tensor-wise, >= 1 TFLOP",
        &gemm_errors("fp8_tensor", Precision::Fp8, 1e12),
    );
    print_stats(
        "fp8 row-wise, >= 1 TFLOP",
        &gemm_errors("fp8_row", Precision::Fp8, 1e12),
    );
    print_stats(
        "fp8 block-wise (1x128 / 128x128)",
        &gemm_errors("fp8_block", Precision::Fp8, 1e12),
    );
    assert!(t.n >= 10);
    // The FP8 ceiling fitted on NeMo's FP8 runs is 28% below what a fresh H100 reaches with
    // cuBLASLt (docs/calibration.md, "Measured on an H100"): never faster, within 40%.
    assert!(
        t.median > -0.05 && t.mean_abs < 0.40,
        "tensor-wise median {:+.3}, mean |err| {:.3}",
        t.median,
        t.mean_abs
    );
    // The measured speed of each recipe relative to tensor-wise scaling, shape by shape.
    let rel = |variant: &str| -> Vec<f64> {
        let r = rows();
        r.iter()
            .filter(|x| x.kind == "gemm" && x.variant == variant)
            .filter(|x| x.work.is_some_and(|w| w.flops() >= 1e12))
            .filter_map(|x| same_shape(&r, "fp8_tensor", x).map(|y| y.us / x.us))
            .collect()
    };
    for v in ["fp8_row", "fp8_block"] {
        let s = stats(&rel(v));
        println!(
            "{v:10} throughput / tensor-wise: median {:.3} (n {})",
            s.median, s.n
        );
        // Finer scales cost throughput (more scale loads and multiplies per tile), never gain.
        assert!(s.median < 1.0 && s.median > 0.6, "{v}: {:.3}", s.median);
        // `training.fp8_recipe` prices them with these measured ratios.
        let p = ComputeParams::h100();
        let model = if v == "fp8_row" {
            p.fp8_rowwise_rel
        } else {
            p.fp8_blockwise_rel
        };
        assert!(
            (model - s.median).abs() < 0.005,
            "{v}: {model} vs {}",
            s.median
        );
    }
}

/// The FP8 GEMM ceiling is tied to the BF16 one by a measured ratio
/// (`H100_FP8_GEMM_EFF_REL_BF16`): the model's BF16 / FP8 time ratio, shape by shape, must be
/// the measured one (the same GEMMs of at least 1 TFLOP timed in BF16 and in FP8 with
/// tensor-wise scales), whatever the calibrated clock.
#[test]
fn fp8_speedup_over_bf16_is_the_measured_one() {
    use prism_core::cost::compute::H100_FP8_GEMM_EFF_REL_BF16;
    let job = step_job();
    let (bf16, fp8) = (model(&job, Precision::Bf16), model(&job, Precision::Fp8));
    let r = rows();
    let mut measured = Vec::new();
    let mut modelled = Vec::new();
    for x in r
        .iter()
        .filter(|x| x.kind == "gemm" && x.variant == "fp8_tensor")
    {
        let Some(w) = x.work.filter(|w| w.flops() >= 1e12) else {
            continue;
        };
        let Some(b) = same_shape(&r, "bf16_nt", x) else {
            continue;
        };
        measured.push(b.us / x.us);
        modelled.push(predicted_us(&bf16, OpClass::Gemm, w) / predicted_us(&fp8, OpClass::Gemm, w));
    }
    let (meas, model) = (stats(&measured), stats(&modelled));
    println!(
        "FP8 / BF16 GEMM speed-up, {} shapes: measured median {:.3}, model median {:.3} \
         (ceiling ratio {H100_FP8_GEMM_EFF_REL_BF16})",
        meas.n, meas.median, model.median
    );
    assert!(meas.n >= 10, "{} paired shapes", meas.n);
    // The constant is the FP8 / BF16 ceiling ratio at which the model's median speed-up over
    // these shapes is the measured one (found here by bisection), to its printed digits.
    let model_median = |ratio: f64| {
        let mut p = ComputeParams::h100();
        p.gemm_eff_max_fp8 = ratio * p.gemm_eff_max_bf16;
        let mut j = job.clone();
        j.training.precision = Precision::Fp8;
        let f = ComputeModel::with_extra_sms(&j, p, None, 0);
        let s: Vec<f64> = r
            .iter()
            .filter(|x| x.kind == "gemm" && x.variant == "fp8_tensor")
            .filter_map(|x| {
                let w = x.work.filter(|w| w.flops() >= 1e12)?;
                same_shape(&r, "bf16_nt", x)?;
                Some(predicted_us(&bf16, OpClass::Gemm, w) / predicted_us(&f, OpClass::Gemm, w))
            })
            .collect();
        stats(&s).median
    };
    let (mut lo, mut hi) = (0.8, 1.0);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if model_median(mid) < meas.median {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    println!("ceiling ratio that reproduces the measured median: {lo:.4}");
    assert!(
        (lo - H100_FP8_GEMM_EFF_REL_BF16).abs() < 0.001,
        "derived {lo:.4}"
    );
    // The model's speed-up follows (the shape model is shared by both precisions).
    assert!(
        (model.median / meas.median - 1.0).abs() < 0.03,
        "model {:.3} vs measured {:.3}",
        model.median,
        meas.median
    );
}

#[test]
fn fused_attention_matches_the_calibrated_model() {
    let job = step_job();
    let m = model(&job, Precision::Bf16);
    println!("\nH100 fused attention (SDPA) vs model");
    let mut by: std::collections::BTreeMap<(String, String), Vec<f64>> = Default::default();
    for r in rows().iter().filter(|r| r.kind.starts_with("attn_")) {
        let work = r.work.expect("attention rows have a shape");
        let Work::Attention {
            batch,
            heads,
            seq_q,
            head_dim,
            causal,
            ..
        } = work
        else {
            panic!("{work:?}")
        };
        let p = predicted_us(&m, OpClass::Attention, work);
        println!(
            "  {:8} {:5} b{:2} h{:2} s{:6} d{:3} {}: measured {:9.1} us  model {:9.1} us  {:+6.1}%",
            r.kind,
            r.variant,
            batch,
            heads,
            seq_q,
            head_dim,
            if causal { "c" } else { "n" },
            r.us,
            p,
            100.0 * err(p, r.us)
        );
        by.entry((r.kind.clone(), r.variant.clone()))
            .or_default()
            .push(err(p, r.us));
    }
    for ((kind, variant), e) in &by {
        print_stats(&format!("{kind} {variant}"), e);
    }
    // Megatron-Core runs cuDNN's fused attention (through Transformer Engine): that is what
    // the calibrated ceilings describe. The forward agrees within 25% on every shape; the
    // backward ceiling fitted on published runs is up to 45% slower than cuDNN 9.19 on this
    // H100 (docs/calibration.md), and never more than 20% faster.
    for (kind, worst_fast, worst_slow) in [("attn_fwd", -0.25, 0.25), ("attn_bwd", -0.20, 0.45)] {
        let e = &by[&(kind.to_string(), "cudnn".to_string())];
        assert!(e.len() >= 10);
        for &x in e {
            assert!(x > worst_fast && x < worst_slow, "{kind}: {x:+.3}");
        }
    }
    // PyTorch's own flash kernels (FlashAttention-2) are slower than cuDNN's on Hopper: the
    // model, describing cuDNN, is faster than every one of them.
    for kind in ["attn_fwd", "attn_bwd"] {
        let e = &by[&(kind.to_string(), "flash".to_string())];
        assert!(e.iter().all(|&x| x < 0.0), "{kind} flash: {e:?}");
    }
}

/// Median over the measured shapes of cuDNN's time over the flash back-end's, for `kind`
/// (`attn_fwd` or `attn_bwd`) in `rows`.
fn flash_over_cudnn_throughput(rows: &[prism_io::kernel_bench::BenchKernel], kind: &str) -> f64 {
    let mut by: std::collections::BTreeMap<String, (Option<f64>, Option<f64>)> = Default::default();
    for r in rows.iter().filter(|r| r.kind == kind) {
        let e = by.entry(format!("{:?}", r.work)).or_default();
        match r.variant.as_str() {
            "cudnn" => e.0 = Some(r.seconds),
            "flash" => e.1 = Some(r.seconds),
            _ => {}
        }
    }
    let mut ratios: Vec<f64> = by.values().filter_map(|&(c, f)| Some(c? / f?)).collect();
    assert!(ratios.len() >= 10, "{kind}: {} shapes", ratios.len());
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

#[test]
fn flash2_attention_is_priced_as_measured_relative_to_cudnn() {
    use prism_core::job::AttentionBackend;
    // The constants are the measured medians (validation/h100 and validation/h200), to the
    // three digits they are written with.
    for (csv, params) in [
        ("kernels.csv", ComputeParams::h100()),
        ("../h200/kernels.csv", ComputeParams::h200()),
    ] {
        let rows = prism_io::kernel_bench::read_kernel_bench(&dir().join(csv))
            .unwrap_or_else(|e| panic!("{e}"));
        let (fwd, bwd) = params.attn_flash2_rel;
        let mf = flash_over_cudnn_throughput(&rows, "attn_fwd");
        let mb = flash_over_cudnn_throughput(&rows, "attn_bwd");
        println!("{csv}: flash / cuDNN throughput, forward {mf:.4} backward {mb:.4}");
        assert!((fwd - mf).abs() < 5e-4 && (bwd - mb).abs() < 5e-4);
    }
    // A flash2 job's attention kernels take exactly 1 / rel of the cuDNN job's time, and
    // against the measured flash kernels the model errs as it does against cuDNN's.
    let cudnn = step_job();
    let mut flash = cudnn.clone();
    flash.training.attention_backend = AttentionBackend::Flash2;
    let (mc, mf) = (
        model(&cudnn, Precision::Bf16),
        model(&flash, Precision::Bf16),
    );
    let rel = ComputeParams::h100().attn_flash2_rel;
    let mut errs: std::collections::BTreeMap<(String, String), Vec<f64>> = Default::default();
    for r in rows().iter().filter(|r| r.kind.starts_with("attn_")) {
        let work = r.work.expect("attention rows have a shape");
        let (tc, tf) = (
            predicted_us(&mc, OpClass::Attention, work),
            predicted_us(&mf, OpClass::Attention, work),
        );
        let k = if r.kind == "attn_fwd" { rel.0 } else { rel.1 };
        assert!(
            (tf * k - tc).abs() < 1e-9 * tc,
            "{}: {tf} x {k} vs {tc}",
            r.kind
        );
        let p = if r.variant == "flash" { tf } else { tc };
        errs.entry((r.kind.clone(), r.variant.clone()))
            .or_default()
            .push(err(p, r.us));
    }
    for kind in ["attn_fwd", "attn_bwd"] {
        let c = print_stats(
            &format!("{kind} cudnn, cudnn job"),
            &errs[&(kind.into(), "cudnn".into())],
        );
        let f = print_stats(
            &format!("{kind} flash, flash2 job"),
            &errs[&(kind.into(), "flash".into())],
        );
        assert!(
            (f.median - c.median).abs() < 0.08,
            "{kind}: {} vs {}",
            f.median,
            c.median
        );
        assert!(f.mean_abs < c.mean_abs + 0.08);
    }
}

#[test]
fn memory_bound_kernels_stream_at_the_calibrated_bandwidth() {
    let job = step_job();
    let m = model(&job, Precision::Bf16);
    println!("\nH100 memory-bound kernels vs model (bytes read + written)");
    let mut errs = std::collections::BTreeMap::new();
    for r in rows().iter().filter(|r| r.kind == "mem") {
        let Some(Work::Memory { bytes }) = r.work else {
            panic!("a mem row without bytes")
        };
        let class = match r.variant.as_str() {
            "rmsnorm" | "layernorm" => OpClass::Norm,
            "softmax" => OpClass::Softmax,
            _ => OpClass::Elementwise,
        };
        let p = predicted_us(&m, class, Work::Memory { bytes });
        println!(
            "  {:18} {:12} B  measured {:8.1} us ({:6.0} GB/s)  model {:8.1} us  {:+6.1}%",
            r.variant,
            bytes,
            r.us,
            bytes as f64 / r.us / 1e3,
            p,
            100.0 * err(p, r.us)
        );
        errs.insert(r.variant.clone(), err(p, r.us));
    }
    // Elementwise kernels are priced at the fitted `mem_eff`, below what a copy or an add
    // reaches on this GPU (docs/calibration.md: the published runs still want memory-bound
    // time the graph does not hold): never faster than measured, within 25%.
    for k in ["copy", "add"] {
        assert!(errs[k] > 0.0 && errs[k] < 0.25, "{k}: {:+.3}", errs[k]);
    }
    // Norm and softmax bandwidth are these measurements.
    for k in ["rmsnorm", "softmax"] {
        assert!(errs[k].abs() < 0.02, "{k}: {:+.3}", errs[k]);
    }
}

/// Simulated kernel seconds by class.
type SimClasses = std::collections::BTreeMap<&'static str, f64>;
/// Measured kernel count and seconds by class.
type MeasuredClasses = std::collections::BTreeMap<&'static str, (usize, f64)>;

/// Kernel time by class, seconds: rank 0 of the simulated run `r`, and the Kineto trace
/// `trace` of `validation/h100/` (seconds and kernel counts); both printed.
fn class_table(r: &prism_core::SimResult, trace: &str) -> (SimClasses, MeasuredClasses) {
    let mut sim: std::collections::BTreeMap<&str, f64> = Default::default();
    let prog = r.graph.program_of(0);
    for rec in &r.timelines[0].ops {
        if let prism_core::graph::OpKind::Compute(c) = prog.kind[rec.op as usize] {
            *sim.entry(c.class.name()).or_default() += (rec.end - rec.start) as f64 * 1e-12;
        }
    }
    let trace = prism_io::kineto::read_kineto(&dir().join(trace)).unwrap_or_else(|e| panic!("{e}"));
    let measured_classes = prism_io::kineto::class_totals(&trace);
    println!("\nkernel time by class, one step: class, measured ms (kernels), Prism ms");
    let mut names: Vec<&str> = sim.keys().copied().collect();
    names.extend(measured_classes.keys().copied());
    names.sort_unstable();
    names.dedup();
    for n in names {
        let (k, m) = measured_classes.get(n).copied().unwrap_or((0, 0.0));
        println!(
            "  {n:12} {:8.1} ({k:4})  {:8.1}",
            m * 1e3,
            sim.get(n).copied().unwrap_or(0.0) * 1e3
        );
    }
    (sim, measured_classes)
}

#[test]
fn the_measured_training_step_is_predicted() {
    let job = step_job();
    let opts = SimOptions {
        record_ranks: vec![0],
        ..SimOptions::default()
    };
    let r = simulate(&job, &opts).unwrap_or_else(|e| panic!("{e}"));
    let (sim, measured_classes) = class_table(&r, "step_trace.json.gz");
    // GEMMs are 61% of the measured kernel time. The calibrated model (sustained clock of
    // multi-day runs) prices them slower than this fresh GPU ran them, by less than 30%.
    let g_meas = measured_classes["gemm"].1;
    let g_sim = sim["gemm"];
    assert!(
        err(g_sim, g_meas) > 0.0 && err(g_sim, g_meas) < 0.30,
        "GEMM class {g_sim} s vs {g_meas} s"
    );
    // Eager PyTorch launches unfused elementwise kernels (280 in this step) that Megatron-Core
    // fuses; the model describes the fused stack, so it must price less elementwise time.
    assert!(sim["elementwise"] < measured_classes["elementwise"].1);
    let v = measured_json("step.json");
    let measured = v["median_s"].as_f64().unwrap();
    let params = v["params"].as_f64().unwrap();
    let predicted = r.summary.iteration_time_s;
    println!(
        "\nmeasured step on one H100: {:.1} ms (median of {}); Prism {:.1} ms ({:+.1}%); parameters {} (Prism {})",
        measured * 1e3,
        v["step_s"].as_array().unwrap().len(),
        predicted * 1e3,
        100.0 * err(predicted, measured),
        params,
        job.model.params()
    );
    // The model's parameter count is the PyTorch model's, exactly.
    assert_eq!(job.model.params() as f64, params);
    assert!(
        err(predicted, measured).abs() < 0.10,
        "{predicted} vs {measured}"
    );
}

#[test]
fn fp32_gradient_accumulation_in_weight_gradient_gemms() {
    // validation/h100/wgrad.csv: dW[n x k] = dY^T X over m tokens, with a BF16 output
    // (`bf16_out`) and accumulated into an FP32 gradient (`fp32_accum`, Megatron's fused
    // gradient accumulation).
    let path = dir().join("wgrad.csv");
    let mut r = csv::Reader::from_path(&path).unwrap();
    let mut rows: std::collections::BTreeMap<(u64, u64, u64), (f64, f64)> = Default::default();
    for rec in r.records() {
        let rec = rec.unwrap();
        let key = (
            rec[0].parse().unwrap(),
            rec[1].parse().unwrap(),
            rec[2].parse().unwrap(),
        );
        let us: f64 = rec[4].parse().unwrap();
        let e = rows.entry(key).or_default();
        match &rec[3] {
            "bf16_out" => e.0 = us,
            "fp32_accum" => e.1 = us,
            _ => {}
        }
    }
    let job = step_job();
    let mut core = job.clone();
    core.training.stack = prism_core::job::Stack::MegatronCore;
    core.parallel.gradient_accumulation_fusion = true; // Megatron-Core's default
    let m_plain = model(&job, Precision::Bf16); // torchtitan: no fused accumulation
    let m_core = model(&core, Precision::Bf16);
    let op = |m: u64, n: u64, k: u64| ComputeOp {
        name: "fc1_wgrad",
        class: OpClass::Gemm,
        // Prism's weight-gradient GEMM: output n x k, reduction over the m tokens.
        work: Work::Gemm {
            m: n,
            n: k,
            k: m,
            batch: 1,
        },
        recompute: false,
        sm_margin: false,
    };
    println!("\nFP32-accumulating weight-gradient GEMMs: extra time over the BF16-output GEMM");
    let mut errs = Vec::new();
    for (tokens, rows_at) in [1024u64, 2048, 4096, 8192, 16384].map(|t| {
        (
            t,
            rows.iter()
                .filter(|((m, _, _), _)| *m == t)
                .collect::<Vec<_>>(),
        )
    }) {
        let (mut meas, mut pred) = (0.0, 0.0);
        for &(&(m, n, k), &(bf16, accum)) in &rows_at {
            let o = op(m, n, k);
            let extra = m_core.time_s(&o) - m_plain.time_s(&o);
            meas += accum - bf16;
            pred += extra * 1e6;
            // Against the measured accumulating GEMM: the model's BF16 time plus its epilogue.
            errs.push(err(bf16 + extra * 1e6, accum));
        }
        println!(
            "  {tokens:5} tokens: measured {meas:8.1} us over {} shapes, model {pred:8.1} us",
            rows_at.len()
        );
        // The modelled extra time follows the measured one within a factor 1.6 at every
        // token count where it matters (where the measured extra is above 5%).
        let base: f64 = rows_at.iter().map(|(_, v)| v.0).sum();
        if meas > 0.05 * base {
            assert!(
                pred > meas / 1.6 && pred < meas * 1.6,
                "{tokens}: {pred} vs {meas}"
            );
        }
    }
    let s = print_stats("accumulating GEMM, BF16 time + epilogue", &errs);
    assert!(s.mean_abs < 0.10, "mean |err| {:.3}", s.mean_abs);
}

/// The same kernels measured on an H200 (`validation/h200/kernels.csv`, same script, same
/// software; 141 GB HBM3e at 4.8 TB/s, same GH100 die and clocks): Prism prices the H200 with
/// the H100's efficiencies and the H200's bandwidth.
#[test]
fn h200_kernels_against_the_h100_parameters() {
    let text = std::fs::read_to_string(dir().join("llama-4layer-step.toml"))
        .unwrap()
        .replace("dgx-h100", "dgx-h200");
    let job = prism_io::jobfile::load_job_str(&text, "h200-step.toml", None, &[])
        .unwrap_or_else(|e| panic!("{e}"))
        .job;
    let m = model(&job, Precision::Bf16);
    let path = dir().join("../h200/kernels.csv");
    let rows = prism_io::kernel_bench::read_kernel_bench(&path).unwrap_or_else(|e| panic!("{e}"));
    println!("\nH200 kernels vs the model (H100 efficiencies, 4.8 TB/s)");
    let mut gemm = Vec::new();
    let mut fwd = Vec::new();
    let mut bwd = Vec::new();
    for r in &rows {
        let us = r.seconds * 1e6;
        match (r.kind.as_str(), r.variant.as_str(), r.work) {
            ("gemm", v, Some(w)) if v.starts_with("bf16") => {
                gemm.push(err(predicted_us(&m, OpClass::Gemm, w), us));
            }
            ("attn_fwd", "cudnn", Some(w)) => {
                fwd.push(err(predicted_us(&m, OpClass::Attention, w), us));
            }
            ("attn_bwd", "cudnn", Some(w)) => {
                bwd.push(err(predicted_us(&m, OpClass::Attention, w), us));
            }
            ("mem", v, Some(w)) if ["copy", "add", "rmsnorm", "softmax"].contains(&v) => {
                let class = match v {
                    "rmsnorm" => OpClass::Norm,
                    "softmax" => OpClass::Softmax,
                    _ => OpClass::Elementwise,
                };
                let p = predicted_us(&m, class, w);
                println!(
                    "  {v:8} measured {us:8.1} us  model {p:8.1} us  {:+6.1}%",
                    100.0 * err(p, us)
                );
            }
            _ => {}
        }
    }
    let g = print_stats("bf16 GEMMs", &gemm);
    let f = print_stats("cuDNN attention forward", &fwd);
    let b = print_stats("cuDNN attention backward", &bwd);
    // Same die and clocks: the compute-bound kernels agree as they do on the H100 (the model
    // slower than a fresh GPU, by about the sustained-clock factor).
    assert!(
        g.n >= 150 && g.median > -0.05 && g.median < 0.20,
        "GEMMs {:+.3}",
        g.median
    );
    assert!(f.mean_abs < 0.25 && b.mean_abs < 0.35);
}

/// One row of `contention.csv` (`python/h100bench/contention.py`): a kernel timed alone and
/// beside a stand-in of an NCCL kernel (640-thread blocks with NCCL's 80 KB of shared memory)
/// on `sms` SMs.
struct Beside {
    kernel: String,
    shape: (u64, u64, u64),
    interferer: String,
    sms: u32,
    alone_us: f64,
    beside_us: f64,
}

/// A GEMM's `(m, n, k)`, or an attention's `(seq_q, seq_kv, head_dim)`.
type Mnk = (u64, u64, u64);

fn contention_rows() -> Vec<Beside> {
    let path = dir().join("contention.csv");
    let mut r = csv::Reader::from_path(&path).unwrap_or_else(|e| panic!("{e}"));
    r.records()
        .map(|rec| {
            let rec = rec.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let num = |i: usize| -> f64 { rec[i].parse().expect("number") };
            Beside {
                kernel: rec[0].to_string(),
                shape: (num(1) as u64, num(2) as u64, num(3) as u64),
                interferer: rec[4].to_string(),
                sms: num(5) as u32,
                alone_us: num(6),
                beside_us: num(7),
            }
        })
        .collect()
}

/// What the engine charges a kernel that starts beside NCCL kernels holding `k` SMs
/// (`ComputeModel::with_extra_sms`, `engine::NCCL_COLLECTIVE_SMS` and `NCCL_P2P_SMS`),
/// against what such a kernel measured on the H100. Per Llama layer (the time-weighted
/// slowdown of its GEMMs, and of cuDNN attention forward and backward): the model's
/// proportional share `132 / (132 - k)` is the mean of four kernel sets whose cuBLAS kernels
/// scatter around it (persistent grids lose a whole wave to one held SM; large GEMMs at the
/// power cap regain clock on the SMs left).
#[test]
fn kernels_beside_an_nccl_stand_in_match_the_held_sm_model() {
    use prism_core::engine::{NCCL_COLLECTIVE_SMS, NCCL_P2P_SMS};
    let rows = contention_rows();
    let job = step_job();
    let plain = model(&job, Precision::Bf16);
    let sets: [(&str, &str, &[Mnk]); 4] = [
        (
            "Llama 3 405B TP 8 GEMMs",
            "gemm",
            &[
                (8192, 2304, 16384),
                (8192, 16384, 2048),
                (8192, 13312, 16384),
                (8192, 16384, 6656),
            ],
        ),
        (
            "Llama 3 70B TP 8 GEMMs",
            "gemm",
            &[
                (8192, 1280, 8192),
                (8192, 8192, 1024),
                (8192, 7168, 8192),
                (8192, 8192, 3584),
            ],
        ),
        (
            "Llama 3 8B TP 1 GEMMs",
            "gemm",
            &[(8192, 6144, 4096), (8192, 28672, 4096), (8192, 4096, 14336)],
        ),
        ("cuDNN attention fwd + bwd", "attn", &[(8192, 8192, 128)]),
    ];
    let work_of = |kernel: &str, (m, n, k): (u64, u64, u64)| -> (OpClass, Work) {
        match kernel {
            "gemm" => (OpClass::Gemm, Work::Gemm { m, n, k, batch: 1 }),
            _ => (
                OpClass::Attention,
                Work::Attention {
                    batch: 1,
                    heads: 16,
                    seq_q: m,
                    seq_kv: n,
                    head_dim: k,
                    causal: true,
                    window: 0,
                    backward: kernel == "attn_bwd",
                },
            ),
        }
    };
    println!("\nH100 kernels beside an NCCL stand-in on k SMs: slowdown measured / model");
    for (interferer, k) in [
        ("copy", NCCL_P2P_SMS),
        ("copy", NCCL_COLLECTIVE_SMS),
        ("copy", 32),
        ("hold", 66),
    ] {
        let beside = model_beside_nccl(&job, Precision::Bf16, k);
        let mut measured = Vec::new();
        let mut modelled = Vec::new();
        for (name, family, shapes) in sets {
            let (mut alone, mut meas, mut modl) = (0.0, 0.0, 0.0);
            for r in rows.iter().filter(|r| {
                r.kernel.starts_with(family)
                    && shapes.contains(&r.shape)
                    && r.interferer == interferer
                    && r.sms == k
            }) {
                let (class, work) = work_of(&r.kernel, r.shape);
                let ratio = predicted_us(&beside, class, work) / predicted_us(&plain, class, work);
                alone += r.alone_us;
                meas += r.beside_us;
                modl += r.alone_us * ratio;
            }
            assert!(alone > 0.0, "{name}: no {interferer} row at {k} SMs");
            println!(
                "  {interferer:4} k {k:2}  {name:28} measured x{:.3}  model x{:.3}",
                meas / alone,
                modl / alone
            );
            measured.push(meas / alone);
            modelled.push(modl / alone);
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (mm, md) = (mean(&measured), mean(&modelled));
        println!(
            "  {interferer:4} k {k:2}  mean of the four sets          measured x{mm:.3}  model x{md:.3}"
        );
        if k <= NCCL_COLLECTIVE_SMS {
            // At NCCL's own SM counts the proportional model is the mean of the kernel sets...
            assert!(
                (md - mm).abs() < 0.03,
                "k {k}: model {md:.3}, measured {mm:.3}"
            );
            // ...and no set is more than 15% off it.
            for (a, b) in measured.iter().zip(&modelled) {
                assert!((a - b).abs() < 0.15, "k {k}: model {b:.3}, measured {a:.3}");
            }
        } else {
            // Beyond them the model is pessimistic on the mean, more so the more SMs are held
            // (the SMs left run faster under the 700 W cap: x1.676 measured, x2 modelled with
            // half the GPU held), but still within 15% on every set at 32 SMs.
            assert!(
                mm < md && mm > 1.0,
                "k {k}: model {md:.3}, measured {mm:.3}"
            );
            for (a, b) in measured.iter().zip(&modelled) {
                let tol = if k <= 32 { 0.15 } else { 0.40 };
                assert!((a - b).abs() < tol, "k {k}: model {b:.3}, measured {a:.3}");
            }
        }
    }
    // Memory-bound kernels beside an NCCL kernel streaming memory lose a few per cent of
    // their bandwidth, which the model does not charge (it holds HBM bandwidth constant).
    for kernel in ["copy", "rmsnorm"] {
        let r = rows
            .iter()
            .find(|r| r.kernel == kernel && r.interferer == "copy" && r.sms == NCCL_COLLECTIVE_SMS)
            .expect("memory-bound row");
        let slow = r.beside_us / r.alone_us;
        println!("  copy k 16  {kernel:28} measured x{slow:.3}  model x1.000");
        assert!(slow > 1.0 && slow < 1.12, "{kernel}: x{slow:.3}");
    }
}

/// The largest Llama 3 405B GEMM run back to back for a minute: throughput holds at the power
/// cap's clock from the first second on, so a benchmark of seconds measures the sustained rate.
#[test]
fn sustained_gemm_throughput_holds_at_the_power_cap() {
    let path = dir().join("sustained.csv");
    let mut r = csv::Reader::from_path(&path).unwrap_or_else(|e| panic!("{e}"));
    let rows: Vec<(f64, f64, f64, f64)> = r
        .records()
        .map(|rec| {
            let rec = rec.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let n = |i: usize| -> f64 { rec[i].parse().expect("number") };
            (n(0), n(1), n(2), n(3))
        })
        .collect();
    assert!(rows.len() >= 50, "{} samples", rows.len());
    let median_of = |col: fn(&(f64, f64, f64, f64)) -> f64| {
        stats(&rows.iter().map(col).collect::<Vec<f64>>()).median
    };
    let median = median_of(|r| r.1);
    let clk = median_of(|r| r.2);
    let pw = median_of(|r| r.3);
    let first = rows[0].1;
    let last = rows[rows.len() - 1].1;
    println!(
        "\nH100 8192x13312x16384 BF16 GEMM for {:.0} s: median {median:.1} TFLOP/s (first second \
         {first:.1}, last {last:.1}), SM clock median {clk:.0} MHz of 1980, power median {pw:.0} W of 700",
        rows[rows.len() - 1].0,
    );
    assert!((first - median).abs() / median < 0.02);
    assert!((last - median).abs() / median < 0.02);
    // Power-capped, not boosting: well under the 1,980 MHz maximum at the 700 W limit.
    assert!(clk < 0.8 * 1980.0);
    assert!(pw > 0.97 * 700.0);
    // The calibrated model prices this GEMM within 10% of the sustained rate.
    let job = step_job();
    let m = model(&job, Precision::Bf16);
    let work = Work::Gemm {
        m: 8192,
        n: 13312,
        k: 16384,
        batch: 1,
    };
    let model_tflops =
        2.0 * 8192.0 * 13312.0 * 16384.0 / predicted_us(&m, OpClass::Gemm, work) / 1e6;
    let e = model_tflops / median - 1.0;
    println!("  model {model_tflops:.1} TFLOP/s ({:+.1}%)", 100.0 * e);
    assert!(e < 0.0 && e > -0.10, "{e:+.3}");
}

/// One data-parallel rank of Megatron-Core's 2024 "1.7B" GPT (validation case
/// `mcore24_weak_1`: four micro-batches of one 4,096-token sequence, without the data-parallel
/// communication) measured on the H100 by `python/h100bench/gpt_step.py`: plain PyTorch, and
/// each layer under torch.compile, cuDNN attention, fused AdamW (`validation/h100/gpt_step.json`,
/// the compiled step's Kineto trace `gpt_step_trace.json.gz`, the job `gpt-1.7b-step.toml`).
/// Prism predicts the step within a few per cent, so its 17% optimism on the published
/// 48-GPU run (docs/validation.md) is not in the kernels of a rank.
#[test]
fn the_measured_megatron_1_7b_rank_step_is_predicted() {
    let job = prism_io::jobfile::load_job_file(&dir().join("gpt-1.7b-step.toml"), &[])
        .unwrap_or_else(|e| panic!("{e}"))
        .job;
    let opts = SimOptions {
        record_ranks: vec![0],
        ..SimOptions::default()
    };
    let r = simulate(&job, &opts).unwrap_or_else(|e| panic!("{e}"));
    let (sim, measured_classes) = class_table(&r, "gpt_step_trace.json.gz");
    let v = measured_json("gpt_step.json");
    let predicted = r.summary.iteration_time_s;
    for variant in ["eager", "compiled"] {
        let measured = v[variant]["median_s"].as_f64().unwrap();
        println!(
            "measured {variant} step: {:.1} ms (forward + backward {:.1}, optimizer {:.1}); \
             Prism {:.1} ms ({:+.1}%)",
            measured * 1e3,
            v[variant]["fwd_bwd_median_s"].as_f64().unwrap() * 1e3,
            v[variant]["optimizer_median_s"].as_f64().unwrap() * 1e3,
            predicted * 1e3,
            100.0 * err(predicted, measured)
        );
        assert!(
            err(predicted, measured).abs() < 0.06,
            "{variant}: {predicted} vs {measured}"
        );
    }
    // The PyTorch model carries biases, LayerNorm shifts and learned positions that Prism's
    // GPT leaves out: 0.8% of the parameters.
    let params = v["compiled"]["params"].as_f64().unwrap();
    let e = err(job.model.params() as f64, params);
    println!(
        "parameters: measured model {params}, Prism {} ({:+.2}%)",
        job.model.params(),
        100.0 * e
    );
    assert!(e < 0.0 && e > -0.01, "{e}");
    // By class the agreement is partly compensation, as on the Llama step: the GEMMs (52% of
    // the kernel time) are priced 28% slower than they ran (the calibrated clock factor),
    // PyTorch's elementwise kernels (2,732, fused by Megatron-Core) took 2.5x the model's.
    let (gm, gs) = (measured_classes["gemm"].1, sim["gemm"]);
    assert!(
        err(gs, gm) > 0.0 && err(gs, gm) < 0.35,
        "GEMMs: Prism {gs} s, measured {gm} s"
    );
    let (am, asim) = (measured_classes["attention"].1, sim["attention"]);
    assert!(
        err(asim, am).abs() < 0.10,
        "attention: Prism {asim} s, measured {am} s"
    );
    assert!(sim["elementwise"] < measured_classes["elementwise"].1);
}

/// cuDNN attention at long context (`python/h100bench/long_attention.py`,
/// `validation/h100/long_attention.csv`): Llama 3 405B's attention at TP 8 (16 query heads,
/// head width 128) over up to 131,072 tokens, causal on one GPU, and 4,096 or 8,192 queries
/// against 131,072 keys unmasked (a context-parallel rank's late chunk). Long sequences keep
/// cuDNN at 535-680 TFLOP/s.
#[test]
fn long_context_attention_against_the_model() {
    let job = step_job();
    let m = model(&job, Precision::Bf16);
    let path = dir().join("long_attention.csv");
    let rows = prism_io::kernel_bench::read_kernel_bench(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(rows.len() >= 10, "{} rows", rows.len());
    println!("\nH100 cuDNN attention at long context vs model");
    for r in rows {
        let work = r.work.expect("attention rows have a shape");
        let Work::Attention {
            heads,
            seq_q,
            seq_kv,
            causal,
            ..
        } = work
        else {
            panic!("{work:?}")
        };
        let us = r.seconds * 1e6;
        let p = predicted_us(&m, OpClass::Attention, work);
        let flops = work.flops();
        println!(
            "  {:8} h{heads:2} q{seq_q:7} kv{seq_kv:7} {}: measured {us:10.1} us ({:5.0} TFLOP/s)  model {p:10.1} us  {:+6.1}%",
            r.kind,
            if causal { "c" } else { "n" },
            flops / us / 1e6,
            100.0 * err(p, us)
        );
        // The forward within 15% (the last row, 16 KV heads instead of 1, reads more and runs
        // 9% slower, which the model, blind to KV heads, does not see); the backward ceiling fitted on published runs is slower
        // than cuDNN 9.19 here as at short context ("Measured on an H100"), by less than 35%.
        let e = err(p, us);
        if r.kind == "attn_fwd" {
            assert!(e.abs() < 0.15, "attn_fwd: {e:+.3}");
        } else {
            assert!(e > 0.0 && e < 0.35, "attn_bwd: {e:+.3}");
        }
    }
}

/// One expert-parallel rank's MoE work on the H100 (`python/h100bench/moe_host.py`,
/// `validation/h100/moe_host.json`): the grouped expert GEMMs (`torch._grouped_mm`, BF16) at
/// GPT-OSS 120B's shapes at EP 8 (16 local experts, 1,024 rows each) and Qwen3 30B-A3B's at
/// EP 16 (8 local experts, 4,096 rows each), against Prism's batched expert GEMMs; and the
/// host's share of a whole MoE layer in PyTorch eager.
#[test]
fn grouped_expert_gemms_and_the_host_against_the_model() {
    let v = measured_json("moe_host.json");
    let job = step_job();
    let m = model(&job, Precision::Bf16);
    println!("\nGrouped expert GEMMs: Prism's batched GEMM vs torch._grouped_mm on the H100");
    let mut errs = Vec::new();
    for case in ["gpt-oss-120b_ep8", "qwen3-30b-a3b_ep16"] {
        let c = &v["moe"][case];
        let u = |k: &str| c[k].as_u64().unwrap();
        let (h, f, local) = (u("hidden"), u("ffn"), u("local_experts"));
        let g = &c["grouped_gemm"];
        let per = g["rows_per_expert"].as_u64().unwrap();
        let gemm = |m, n, k| Work::Gemm {
            m,
            n,
            k,
            batch: local,
        };
        for (what, work, key) in [
            ("fc1 forward", gemm(per, 2 * f, h), "fc1_grouped_us"),
            (
                "fc1 data gradient",
                gemm(per, h, 2 * f),
                "fc1_dgrad_grouped_us",
            ),
            // Weight gradient: a (h x 2f) output per expert, reduced over its rows.
            (
                "fc1 weight gradient",
                gemm(h, 2 * f, per),
                "fc1_wgrad_grouped_us",
            ),
            ("fc2 forward", gemm(per, h, f), "fc2_grouped_us"),
        ] {
            let meas = g[key].as_f64().unwrap();
            let pred = predicted_us(&m, OpClass::Gemm, work);
            let e = err(pred, meas);
            println!(
                "  {case:20} {what:20} measured {meas:7.1} us  Prism {pred:7.1} us  {:+6.1}%",
                100.0 * e
            );
            errs.push(e);
        }
        // The whole rank's layer (router, top-k, permutation, grouped GEMMs, un-permutation,
        // forward and backward) in eager PyTorch is bound by the GPU, not by the host that
        // issues its ~100-125 kernels, and reading the split sizes back to the host every layer
        // (Megatron-Core's alltoall dispatcher) costs nothing measurable.
        let (sync, nosync) = (&c["host_sync"], &c["no_sync"]);
        let wall = sync["wall_ms_per_layer"].as_f64().unwrap();
        let gpu = sync["gpu_kernel_ms_per_layer"].as_f64().unwrap();
        let wall_nosync = nosync["wall_ms_per_layer"].as_f64().unwrap();
        println!(
            "  {case:20} layer fwd+bwd: wall {wall:.2} ms, GPU kernels {gpu:.2} ms, \
             without the host read {wall_nosync:.2} ms"
        );
        assert!(gpu / wall > 0.85, "{case}: GPU busy {gpu} of {wall} ms");
        assert!(
            err(wall, wall_nosync).abs() < 0.05,
            "{case}: {wall} vs {wall_nosync}"
        );
    }
    let s = print_stats("grouped expert GEMMs", &errs);
    // Prism prices them no faster than the H100 ran them: the MoE runs it predicts too fast
    // (the excluded Megatron-Bridge rows) are not too fast in their expert GEMMs.
    assert!(errs.iter().all(|&e| e > -0.05), "{errs:?}");
    assert!(s.median < 0.40, "median {:.3}", s.median);
}

/// FP8 GEMMs at short reductions (`python/h100bench/moe_fp8.py`, `validation/h100/moe_fp8.json`,
/// every time GPU-only: the calls captured in a CUDA graph). Dense BF16 and FP8 (tensor-wise)
/// GEMMs over k = 256 to 8,192 at three output shapes, and one FP8 cuBLASLt GEMM per local
/// expert (as Transformer Engine's GroupedLinear runs them) at GPT-OSS 120B's (EP 8) and Qwen3
/// 30B-A3B's (EP 16) shapes. FP8's speed-up over BF16 grows with k because a tile's fixed cost
/// takes the same time in both precisions; a model that shares BF16's overhead in
/// reduction-length units gives one constant speed-up instead.
#[test]
fn fp8_speedup_grows_with_the_reduction_length() {
    let v = measured_json("moe_fp8.json");
    let job = step_job();
    let (m8, m16) = (model(&job, Precision::Fp8), model(&job, Precision::Bf16));
    let one = |m, n, k| Work::Gemm { m, n, k, batch: 1 };
    // The speed-up of a model whose FP8 tiles pay BF16's overhead in k units: the ratio of the
    // two rates, whatever the shape (every swept shape fills the 132 SMs).
    let large = one(16384, 16384, 1 << 20);
    let constant =
        predicted_us(&m16, OpClass::Gemm, large) / predicted_us(&m8, OpClass::Gemm, large);
    // The H200 (`validation/h200/moe_fp8.json`, same script and software) has the same SMs and
    // clocks: the same model holds.
    let h200 = measured_json("../h200/moe_fp8.json");
    for (gpu, sv) in [("H100", &v), ("H200", &h200)] {
        println!(
            "\n{gpu}: FP8 / BF16 speed-up over k (model; constant-overhead model {constant:.2})"
        );
        let (mut e_model, mut e_const) = (Vec::new(), Vec::new());
        let (mut full_model, mut full_const) = (Vec::new(), Vec::new());
        let sweep = sv["dense_sweep"].as_array().unwrap();
        for r in sweep {
            let u = |k: &str| r[k].as_u64().unwrap();
            let w = one(u("m"), u("n"), u("k"));
            // At least two full waves of 128 x 256 tiles on 132 SMs (4096 x 4096 and 8192 x 2048;
            // 1024 x 5760 is 1.4 waves, where cuBLASLt's FP8 tile choice is its own).
            let waves = (u("m") * u("n")) as f64 / (128.0 * 256.0) / 132.0;
            let meas = r["speedup"].as_f64().unwrap();
            let model = predicted_us(&m16, OpClass::Gemm, w) / predicted_us(&m8, OpClass::Gemm, w);
            println!(
                "  {:5} x {:5} x {:5}: measured {meas:.2}, model {model:.2}",
                u("m"),
                u("n"),
                u("k")
            );
            e_model.push(err(model, meas));
            e_const.push(err(constant, meas));
            if waves >= 2.0 {
                full_model.push(err(model, meas));
                full_const.push(err(constant, meas));
            }
        }
        let (sm, sc) = (
            print_stats("speed-up, model", &e_model),
            print_stats("speed-up, constant", &e_const),
        );
        let (fm, fc) = (
            print_stats("speed-up, model, >= 2 waves", &full_model),
            print_stats("speed-up, constant, >= 2 waves", &full_const),
        );
        assert!(
            sm.mean_abs < sc.mean_abs,
            "{} vs {}",
            sm.mean_abs,
            sc.mean_abs
        );
        // 7.9% on the H100, 10.1% on the H200.
        assert!(fm.n >= 10 && fm.mean_abs < 0.12, "{gpu}: {}", fm.mean_abs);
        assert!(
            fm.mean_abs < 0.5 * fc.mean_abs,
            "{} vs {}",
            fm.mean_abs,
            fc.mean_abs
        );
        // Where the reduction is short (k <= 1,024) the measured speed-up is at most 1.55, and the
        // model's stays below the constant.
        for r in sweep.iter().filter(|r| r["k"].as_u64().unwrap() <= 1024) {
            assert!(r["speedup"].as_f64().unwrap() < 1.55, "{r}");
        }
    }
    println!(
        "FP8 expert GEMMs (a loop of per-expert cuBLASLt GEMMs, CUDA graph) against the model"
    );
    let mut errs = Vec::new();
    for case in ["gpt-oss-120b_ep8", "qwen3-30b-a3b_ep16"] {
        let c = &v[case];
        let local = c["local_experts"].as_u64().unwrap();
        for g in ["fc1", "fc2"] {
            let r = &c[g];
            let u = |k: &str| r[k].as_u64().unwrap();
            let work = Work::Gemm {
                m: u("m"),
                n: u("n"),
                k: u("k"),
                batch: local,
            };
            let meas = r["fp8_loop_graph_us"].as_f64().unwrap();
            let bf16 = r["bf16_loop_graph_us"].as_f64().unwrap();
            let pred = predicted_us(&m8, OpClass::Gemm, work);
            let pred16 = predicted_us(&m16, OpClass::Gemm, work);
            let e = err(pred, meas);
            println!(
                "  {case:20} {g}: FP8 measured {meas:7.1} us, Prism {pred:7.1} us ({:+6.1}%); \
                 speed-up over BF16 measured {:.2}, Prism {:.2}",
                100.0 * e,
                bf16 / meas,
                pred16 / pred
            );
            errs.push(e);
        }
    }
    let s = print_stats("FP8 expert GEMMs", &errs);
    // Within 10% each (the shortest reduction, Qwen3's fc2 at k = 768, priced fastest).
    assert!(errs.iter().all(|&e| e.abs() < 0.10), "{errs:?}");
    assert!(s.mean_abs < 0.08, "{}", s.mean_abs);
}

/// The MoE token permutations as single fused kernels (`python/h100bench/permute.py`,
/// `validation/h100/permute.json`; Triton stand-ins for Transformer Engine's fused permute,
/// un-permute and chunk sort, GPU time under a CUDA graph) against Prism's memory passes of the
/// same bytes (`moe_permute_*`, `moe_unpermute_*`, `moe_sort_*`).
#[test]
fn fused_moe_permutations_against_the_memory_passes() {
    let v = measured_json("permute.json");
    let m = model(&step_job(), Precision::Bf16);
    println!("\nFused MoE permutations: Prism's memory pass vs the measured kernel");
    let mut errs = Vec::new();
    for case in ["gpt-oss-120b", "qwen3-30b-a3b"] {
        let c = &v[case];
        for pass in ["permute", "unpermute", "sort", "copy"] {
            let bytes = c[format!("{pass}_bytes")].as_u64().unwrap();
            let meas = c[format!("{pass}_us")].as_f64().unwrap();
            let pred = predicted_us(&m, OpClass::Elementwise, Work::Memory { bytes });
            let e = err(pred, meas);
            println!(
                "  {case:14} {pass:9} {:6.1} MB: measured {meas:6.1} us, Prism {pred:6.1} us ({:+5.1}%)",
                bytes as f64 / 1e6,
                100.0 * e
            );
            errs.push(e);
        }
    }
    let s = print_stats("fused permutations and copies", &errs);
    assert!(errs.iter().all(|e| e.abs() < 0.25), "{errs:?}");
    assert!(s.mean_abs < 0.12, "{}", s.mean_abs);
}
