//! `prism calibrate`: fit the physical parameters of one GPU generation.
//!
//! 1. GEMM shape efficiency (`gemm_eff_max_bf16`, `gemm_k_overhead`) from measured kernel times
//!    of a Kineto trace, when one is given (least squares on log time over a grid).
//! 2. The remaining parameters from the published runs of that generation: Nelder-Mead on the
//!    mean absolute percentage error, inside physical bounds, every case sharing one value per
//!    parameter (no per-case factors).
//! 3. k-fold cross-validation: fit on k-1 folds, predict the held-out fold, report the error of
//!    the held-out predictions next to the in-sample error.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::cost::comm::CommParams;
use prism_core::cost::compute::{ComputeParams, KernelTable};
use prism_core::engine::SimOptions;
use prism_core::ops::Work;
use prism_io::validation::{self, Case};

#[derive(Debug, clap::Args)]
pub struct CalibrateArgs {
    /// GPU generation to fit: `a100` or `h100`.
    #[arg(long)]
    gpu: String,
    /// Case file (default: the embedded validation/cases.csv).
    path: Option<PathBuf>,
    /// Kineto trace whose kernel times fit GEMM shape efficiency, norm and softmax bandwidth and
    /// NVLink all-reduce efficiency (needs --kineto-job).
    #[arg(long, value_name = "TRACE.json", requires = "kineto_job")]
    kineto: Option<PathBuf>,
    /// The job the Kineto trace ran (e.g. validation/kineto/megatron-gpt-tp8-a100.toml).
    #[arg(long, value_name = "JOB.toml")]
    kineto_job: Option<PathBuf>,
    /// Kernel micro-benchmark CSV measured on one GPU of this generation (as
    /// `python/h100bench/bench.py` writes it, e.g. validation/h100/kernels.csv): fixes the GEMM
    /// shape model, the FP8 GEMM ceiling, cuDNN fused-attention forward and backward ceilings and
    /// norm and softmax bandwidth from measurement; the published runs then fit the rest.
    #[arg(long, value_name = "KERNELS.csv")]
    kernels: Option<PathBuf>,
    /// Objective evaluations for the full fit (each simulates every case of the generation).
    #[arg(long, default_value_t = 150)]
    evals: usize,
    /// Folds for cross-validation (0 = skip).
    #[arg(long, default_value_t = 5)]
    folds: usize,
    /// Compare each run with Prism's expected iteration time with stragglers (`prism validate
    /// --stragglers`) and fit the per-GPU speed spread (`gpu_speed_cv`, shared by every run of
    /// the generation) with the other parameters: the spread is what makes the error change
    /// with the GPU count, so the scaling series of the calibration set decide it.
    #[arg(long)]
    stragglers: bool,
}

/// The parameters of one generation.
#[derive(Clone, Debug)]
struct Params {
    compute: ComputeParams,
    comm: CommParams,
    /// Per-GPU speed spread when the runs are compared with stragglers (`--stragglers`); `None`
    /// compares the nominal iteration.
    straggler_cv: Option<f64>,
}

/// A fitted parameter: name, bounds, log-scaled search, accessors.
struct Spec {
    name: &'static str,
    lo: f64,
    hi: f64,
    log: bool,
    get: fn(&Params) -> f64,
    set: fn(&mut Params, f64),
}

/// The spread as a fitted parameter (`--stragglers`): from identical GPUs to a 4% coefficient
/// of variation (Sinha et al. SC22's 8% average max-min range over thousands of GPUs is about
/// 1.1%; their worst clusters, 22%, about 3%).
fn straggler_spec() -> Spec {
    Spec {
        name: "gpu_speed_cv",
        lo: 0.0,
        hi: 0.04,
        log: false,
        get: |p| {
            p.straggler_cv
                .unwrap_or(prism_core::straggler::DEFAULT_GPU_SPEED_CV)
        },
        set: |p, x| p.straggler_cv = Some(x),
    }
}

fn specs(generation: &str) -> Vec<Spec> {
    let mut v = vec![
        Spec {
            name: "clock_factor",
            lo: 0.75,
            hi: 1.0,
            log: false,
            get: |p| p.compute.clock_factor,
            set: |p, x| p.compute.clock_factor = x,
        },
        Spec {
            name: "mem_eff",
            lo: 0.45,
            hi: 0.95,
            log: false,
            get: |p| p.compute.mem_eff,
            set: |p, x| p.compute.mem_eff = x,
        },
        Spec {
            name: "launch_overhead_us",
            lo: 1.0,
            hi: 15.0,
            log: true,
            get: |p| p.compute.launch_overhead_s * 1e6,
            set: |p, x| p.compute.launch_overhead_s = x * 1e-6,
        },
        Spec {
            name: "nvlink_efficiency",
            lo: 0.4,
            hi: 0.95,
            log: false,
            get: |p| p.comm.nvlink_efficiency,
            set: |p, x| p.comm.nvlink_efficiency = x,
        },
        Spec {
            name: "layer_overhead_us",
            lo: 0.0,
            hi: 300.0,
            log: false,
            get: |p| p.compute.layer_overhead_s * 1e6,
            set: |p, x| p.compute.layer_overhead_s = x * 1e-6,
        },
        Spec {
            name: "nic_efficiency",
            lo: 0.4,
            hi: 0.95,
            log: false,
            get: |p| p.comm.nic_efficiency,
            set: |p, x| p.comm.nic_efficiency = x,
        },
        Spec {
            name: "nccl_latency_scale",
            lo: 0.05,
            hi: 1.5,
            log: true,
            get: |p| p.comm.latency_scale,
            set: |p, x| p.comm.latency_scale = x,
        },
    ];
    if generation == "h100" {
        // The FP8 ceiling is tied to the BF16 one by the measured ratio
        // (compute::H100_FP8_GEMM_EFF_REL_BF16), not fitted on its own.
        v.push(Spec {
            name: "gemm_eff_max_bf16",
            lo: 0.5,
            hi: 0.92,
            log: false,
            get: |p| p.compute.gemm_eff_max_bf16,
            set: |p, x| {
                p.compute.gemm_eff_max_bf16 = x;
                p.compute.gemm_eff_max_fp8 =
                    prism_core::cost::compute::H100_FP8_GEMM_EFF_REL_BF16 * x;
            },
        });
        v.push(Spec {
            name: "attn_fwd_eff_max",
            lo: 0.25,
            hi: 0.8,
            log: false,
            get: |p| p.compute.attn_fwd_eff_max,
            set: |p, x| p.compute.attn_fwd_eff_max = x,
        });
        v.push(Spec {
            name: "attn_bwd_eff_max",
            lo: 0.2,
            hi: 0.75,
            log: false,
            get: |p| p.compute.attn_bwd_eff_max,
            set: |p, x| p.compute.attn_bwd_eff_max = x,
        });
    }
    v
}

fn to_unit(s: &Spec, x: f64) -> f64 {
    let x = x.clamp(s.lo, s.hi);
    if s.log {
        (x.ln() - s.lo.ln()) / (s.hi.ln() - s.lo.ln())
    } else {
        (x - s.lo) / (s.hi - s.lo)
    }
}

fn from_unit(s: &Spec, u: f64) -> f64 {
    let u = u.clamp(0.0, 1.0);
    if s.log {
        (s.lo.ln() + u * (s.hi.ln() - s.lo.ln())).exp()
    } else {
        s.lo + u * (s.hi - s.lo)
    }
}

fn apply(base: &Params, specs: &[Spec], u: &[f64]) -> Params {
    let mut p = base.clone();
    for (s, &x) in specs.iter().zip(u) {
        (s.set)(&mut p, from_unit(s, x));
    }
    p
}

/// Signed percentage errors of `cases` under `p`.
fn errors(cases: &[&Case], p: &Params) -> Result<Vec<f64>> {
    use rayon::prelude::*;
    let opts = SimOptions {
        compute: Some(p.compute.clone()),
        comm: Some(p.comm.clone()),
        ..SimOptions::default()
    };
    let how = validation::CaseOptions {
        compare: match p.straggler_cv {
            Some(_) => validation::Compare::Stragglers,
            None => validation::Compare::Nominal,
        },
        gpu_speed_cv: p.straggler_cv,
    };
    cases
        .par_iter()
        .map(|c| {
            validation::run_case_with(c, &opts, &how)
                .map(|r| r.error_pct)
                .map_err(anyhow::Error::msg)
        })
        .collect()
}

fn mape(e: &[f64]) -> f64 {
    e.iter().map(|x| x.abs()).sum::<f64>() / e.len().max(1) as f64
}

/// The fit's objective: mean absolute error, plus a steep penalty for any case beyond 18%
/// (the validation budget allows no case beyond 20%), so the fit does not buy a lower mean
/// with one far-off case.
fn objective(e: &[f64]) -> f64 {
    mape(e) + 10.0 * e.iter().map(|x| (x.abs() - 18.0).max(0.0)).sum::<f64>()
}

/// Nelder-Mead on the unit cube (points clamped into it), deterministic start.
fn nelder_mead(f: &mut dyn FnMut(&[f64]) -> f64, x0: &[f64], evals: usize) -> (Vec<f64>, f64) {
    let n = x0.len();
    let clamp = |v: Vec<f64>| {
        v.into_iter()
            .map(|x| x.clamp(0.0, 1.0))
            .collect::<Vec<f64>>()
    };
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(n + 1);
    let mut used = 0;
    let mut eval = |x: Vec<f64>, used: &mut usize| {
        *used += 1;
        let y = f(&x);
        (x, y)
    };
    simplex.push(eval(x0.to_vec(), &mut used));
    for i in 0..n {
        let mut x = x0.to_vec();
        x[i] = if x[i] + 0.2 <= 1.0 {
            x[i] + 0.2
        } else {
            x[i] - 0.2
        };
        simplex.push(eval(x, &mut used));
    }
    while used < evals {
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        let centroid: Vec<f64> = (0..n)
            .map(|j| simplex[..n].iter().map(|(x, _)| x[j]).sum::<f64>() / n as f64)
            .collect();
        let worst = simplex[n].clone();
        let along = |t: f64| {
            clamp(
                (0..n)
                    .map(|j| centroid[j] + t * (worst.0[j] - centroid[j]))
                    .collect(),
            )
        };
        let r = eval(along(-1.0), &mut used);
        if r.1 < simplex[0].1 {
            let e = eval(along(-2.0), &mut used);
            simplex[n] = if e.1 < r.1 { e } else { r };
        } else if r.1 < simplex[n - 1].1 {
            simplex[n] = r;
        } else {
            let c = if r.1 < worst.1 {
                eval(along(-0.5), &mut used)
            } else {
                eval(along(0.5), &mut used)
            };
            if c.1 < worst.1.min(r.1) {
                simplex[n] = c;
            } else {
                let best = simplex[0].0.clone();
                for item in simplex.iter_mut().skip(1) {
                    let x: Vec<f64> = (0..n)
                        .map(|j| best[j] + 0.5 * (item.0[j] - best[j]))
                        .collect();
                    *item = eval(x, &mut used);
                }
            }
        }
    }
    simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
    simplex.swap_remove(0)
}

/// Fits the GEMM efficiency ceiling and K overhead to measured GEMM times.
fn fit_gemm(
    base: &ComputeParams,
    table: &KernelTable,
    job: &prism_core::job::Job,
) -> Option<(f64, f64, f64)> {
    let rows: Vec<(Work, f64)> = table
        .iter()
        .filter(|(op, _, dtype, _)| *op == "gemm" && *dtype == "bf16")
        .filter_map(|(_, shape, _, t)| {
            let d: Vec<u64> = shape
                .split('x')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?;
            let w = match d[..] {
                [m, n, k] => Work::Gemm { m, n, k, batch: 1 },
                [b, m, n, k] => Work::Gemm { m, n, k, batch: b },
                _ => return None,
            };
            Some((w, t))
        })
        .collect();
    let base = ComputeParams {
        launch_overhead_s: 0.0,
        ..base.clone()
    };
    grid_gemm(&base, job, &rows, 0.6, 70)
}

/// Grid search of `gemm_k_overhead` (0..512 in steps of 16) and `gemm_eff_max_bf16` (`e_lo`
/// and `steps` steps of 0.005 above it) minimising the mean |log time error| over measured
/// BF16 GEMM times; `base` holds every other parameter. `(k_overhead, eff_max, error)`.
fn grid_gemm(
    base: &ComputeParams,
    job: &prism_core::job::Job,
    rows: &[(Work, f64)],
    e_lo: f64,
    steps: u32,
) -> Option<(f64, f64, f64)> {
    if rows.is_empty() {
        return None;
    }
    let mut best: Option<(f64, f64, f64)> = None;
    for k0 in (0..=32).map(|i| 16.0 * i as f64) {
        for e in (0..=steps).map(|i| e_lo + 0.005 * i as f64) {
            let p = ComputeParams {
                gemm_k_overhead: k0,
                gemm_eff_max_bf16: e,
                ..base.clone()
            };
            let model = prism_core::cost::compute::ComputeModel::new(job, p, None);
            let err: f64 = rows
                .iter()
                .map(|(w, t)| {
                    let op = prism_core::ops::ComputeOp {
                        name: "gemm",
                        class: prism_core::ops::OpClass::Gemm,
                        work: *w,
                        recompute: false,
                        sm_margin: false,
                    };
                    (model.time_s(&op) / t).ln().abs()
                })
                .sum::<f64>()
                / rows.len() as f64;
            if best.is_none_or(|b| err < b.2) {
                best = Some((k0, e, err));
            }
        }
    }
    best
}

/// Measured kernels -> GEMM shape efficiency, norm and softmax bandwidth, NVLink efficiency.
fn fit_from_trace(
    base: &mut Params,
    trace: &prism_io::kineto::KinetoTrace,
    job: &prism_core::job::Job,
    path: &std::path::Path,
) -> Result<()> {
    use prism_core::graph::OpKind;
    let table = prism_io::kineto::to_kernel_table(trace, "bf16");
    let (k0, e, err) =
        fit_gemm(&base.compute, &table, job).context("no GEMM shapes in the trace")?;
    outln!(
        "{}: GEMM shapes ({} in the table): gemm_k_overhead = {k0}, gemm_eff_max_bf16 = {e:.3} (mean |log time error| {err:.3})",
        path.display(),
        table.len()
    )?;
    base.compute.gemm_k_overhead = k0;
    base.compute.gemm_eff_max_bf16 = e;
    // Norm and softmax: measured forward class totals vs the same job's forward kernels.
    let totals = prism_io::kineto::class_totals(trace);
    for _ in 0..3 {
        let opts = SimOptions {
            mode: prism_core::engine::Mode::Reduced,
            compute: Some(base.compute.clone()),
            comm: Some(base.comm.clone()),
            record_ranks: vec![0],
            ..SimOptions::default()
        };
        let r = prism_core::simulate(job, &opts)?;
        let prog = r.graph.program_of(0);
        let mut norm = 0.0;
        let mut softmax = 0.0;
        for rec in &r.timelines[0].ops {
            if prog.tag[rec.op as usize].phase != prism_core::graph::Phase::Forward {
                continue;
            }
            if let OpKind::Compute(c) = prog.kind[rec.op as usize] {
                let t = (rec.end - rec.start) as f64 * 1e-12 - base.compute.launch_overhead_s;
                match c.class {
                    prism_core::ops::OpClass::Norm => norm += t,
                    prism_core::ops::OpClass::Softmax => softmax += t,
                    _ => {}
                }
            }
        }
        if let Some(&(_, m)) = totals.get("norm") {
            base.compute.norm_mem_eff = (base.compute.norm_mem_eff * norm / m).clamp(0.05, 1.0);
        }
        if let Some(&(_, m)) = totals.get("softmax") {
            base.compute.softmax_mem_eff =
                (base.compute.softmax_mem_eff * softmax / m).clamp(0.05, 1.0);
        }
    }
    outln!(
        "  norm kernels: norm_mem_eff = {:.3}; softmax kernels: softmax_mem_eff = {:.3} (forward class totals)",
        base.compute.norm_mem_eff,
        base.compute.softmax_mem_eff
    )?;
    // NVLink: the fastest all-reduce of the largest size (others include waiting for ranks).
    let ar: Vec<(u64, f64)> = trace
        .kernels
        .iter()
        .filter(|k| k.class == prism_io::kineto::KernelClass::NcclAllReduce)
        .filter_map(|k| k.bytes.map(|b| (b, k.duration_s)))
        .collect();
    if let Some(&(bytes, _)) = ar.iter().max_by_key(|x| x.0) {
        let t = ar
            .iter()
            .filter(|x| x.0 == bytes)
            .map(|x| x.1)
            .fold(f64::INFINITY, f64::min);
        let n = job.parallel.tp as f64;
        let c = &job.cluster;
        // The fastest instance is NCCL's Simple ring (an A100 node has no NVLS): its latency
        // from NCCL's tuning tables, the rest is bandwidth.
        let latency = prism_core::cost::comm::nccl_latency_s(
            prism_core::cost::comm::Collective::AllReduce,
            prism_core::cost::comm::Algorithm::Ring,
            prism_core::cost::comm::Protocol::Simple,
            prism_core::cost::comm::GroupShape {
                ranks: n as u32,
                nodes: 1,
                per_node: n as u32,
            },
            prism_core::cost::comm::Arch::of(&c.gpu),
            bytes,
        ) * base.comm.latency_scale;
        let eff = 2.0 * (n - 1.0) / n * bytes as f64 / ((t - latency) * c.nvlink_gbps * 1e9 / 8.0);
        base.comm.nvlink_efficiency = eff.clamp(0.05, 1.0);
        outln!(
            "  NVLink all-reduce: {} B over {n} GPUs in {:.1} us at best: nvlink_efficiency = {:.3}",
            bytes,
            t * 1e6,
            base.comm.nvlink_efficiency
        )?;
    }
    Ok(())
}

/// Measured kernels (micro-benchmarks on one GPU) -> the kernel-level parameters.
///
/// The benchmark's clock is the datasheet's (`clock_factor` = 1 while fitting): the ceilings
/// absorb how far one GPU running kernels for seconds is from its datasheet peak, and the
/// published runs' `clock_factor` then measures what hours at scale cost on top.
fn fit_from_kernels(
    base: &mut Params,
    kernels: &[prism_io::kernel_bench::BenchKernel],
    job: &prism_core::job::Job,
    path: &std::path::Path,
) -> Result<()> {
    use prism_core::cost::compute::ComputeModel;
    use prism_core::job::Precision;
    use prism_core::ops::{ComputeOp, OpClass};
    let bench = |p: &ComputeParams, precision: Precision| {
        let mut job = job.clone();
        job.training.precision = precision;
        ComputeModel::new(
            &job,
            ComputeParams {
                clock_factor: 1.0,
                launch_overhead_s: 0.0,
                ..p.clone()
            },
            None,
        )
    };
    let time = |m: &ComputeModel, class: OpClass, w: Work| {
        m.time_s(&ComputeOp {
            name: "measured",
            class,
            work: w,
            recompute: false,
            sm_margin: false,
        })
    };
    let rows = |kind: &str, variant: &dyn Fn(&str) -> bool| -> Vec<(Work, f64)> {
        kernels
            .iter()
            .filter(|k| k.kind == kind && variant(&k.variant))
            .filter_map(|k| k.work.map(|w| (w, k.seconds)))
            .collect()
    };
    let median = |mut v: Vec<f64>| -> Option<f64> {
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    // GEMM shape model: grid over (k_overhead, eff_max), mean |log error| over every BF16 row.
    let gemms = rows("gemm", &|v| v.starts_with("bf16"));
    if gemms.is_empty() {
        bail!("{}: no BF16 GEMM rows", path.display());
    }
    let at_datasheet_clock = ComputeParams {
        clock_factor: 1.0,
        launch_overhead_s: 0.0,
        ..base.compute.clone()
    };
    let best = grid_gemm(&at_datasheet_clock, job, &gemms, 0.5, 80);
    let (k0, e, err) = best.expect("non-empty grid");
    base.compute.gemm_k_overhead = k0;
    base.compute.gemm_eff_max_bf16 = e;
    outln!(
        "{}: {} BF16 GEMMs: gemm_k_overhead = {k0}, gemm_eff_max_bf16 = {e:.3} (mean |log time error| {err:.3})",
        path.display(),
        gemms.len()
    )?;
    // Ceilings scaled so that the median compute-bound row is matched: FP8 tensor-wise GEMMs
    // and cuDNN fused attention (what Megatron-Core runs through Transformer Engine).
    let scale = |p: &ComputeParams, rows: &[(Work, f64)], class: OpClass, precision: Precision| {
        let m = bench(p, precision);
        median(rows.iter().map(|&(w, t)| time(&m, class, w) / t).collect())
    };
    let fp8 = rows("gemm", &|v| v == "fp8_tensor");
    if let Some(r) = scale(&base.compute, &fp8, OpClass::Gemm, Precision::Fp8) {
        base.compute.gemm_eff_max_fp8 = (base.compute.gemm_eff_max_fp8 * r).clamp(0.05, 1.0);
    }
    let fwd = rows("attn_fwd", &|v| v == "cudnn");
    if let Some(r) = scale(&base.compute, &fwd, OpClass::Attention, Precision::Bf16) {
        base.compute.attn_fwd_eff_max = (base.compute.attn_fwd_eff_max * r).clamp(0.05, 1.0);
    }
    let bwd = rows("attn_bwd", &|v| v == "cudnn");
    if let Some(r) = scale(&base.compute, &bwd, OpClass::Attention, Precision::Bf16) {
        base.compute.attn_bwd_eff_max = (base.compute.attn_bwd_eff_max * r).clamp(0.05, 1.0);
    }
    outln!(
        "  {} FP8 GEMMs: gemm_eff_max_fp8 = {:.3}; {} + {} cuDNN attention: attn_fwd_eff_max = {:.3}, attn_bwd_eff_max = {:.3}",
        fp8.len(),
        base.compute.gemm_eff_max_fp8,
        fwd.len(),
        bwd.len(),
        base.compute.attn_fwd_eff_max,
        base.compute.attn_bwd_eff_max
    )?;
    // Norm and softmax bandwidth at face value (bytes read + written over time).
    let bw = job.cluster.gpu.hbm_tbps * 1e12;
    let at = |name: &str| {
        median(
            kernels
                .iter()
                .filter(|k| k.kind == "mem" && k.variant == name)
                .filter_map(|k| match k.work {
                    Some(Work::Memory { bytes }) => Some(bytes as f64 / k.seconds / bw),
                    _ => None,
                })
                .collect(),
        )
    };
    // Elementwise bandwidth: the streaming kernels (a copy and a binary add).
    if let Some(x) = median(["copy", "add"].iter().filter_map(|n| at(n)).collect()) {
        base.compute.mem_eff = x.clamp(0.05, 1.0);
    }
    if let Some(x) = at("rmsnorm") {
        base.compute.norm_mem_eff = x.clamp(0.05, 1.0);
    }
    if let Some(x) = at("softmax") {
        base.compute.softmax_mem_eff = x.clamp(0.05, 1.0);
    }
    outln!(
        "  mem_eff = {:.3} (copy, add), norm_mem_eff = {:.3} (RMSNorm), softmax_mem_eff = {:.3} (softmax), of {:.2} TB/s",
        base.compute.mem_eff,
        base.compute.norm_mem_eff,
        base.compute.softmax_mem_eff,
        job.cluster.gpu.hbm_tbps
    )?;
    Ok(())
}

fn generation_of(case: &Case) -> Option<&'static str> {
    let job = prism_io::jobfile::load_job_str(&case.job_toml, &case.id, None, &[])
        .ok()?
        .job;
    // The generations whose parameters the simulator shares (compute::Generation): the
    // A800 with the A100, the H800 (an H100 with fewer NVLink links) with the H100.
    use prism_core::cost::compute::Generation;
    match Generation::of(&job.cluster.gpu) {
        Generation::Ampere => Some("a100"),
        Generation::Hopper => Some("h100"),
        Generation::H200 | Generation::Blackwell => None,
    }
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let generation = args.gpu.to_ascii_lowercase();
    if generation != "a100" && generation != "h100" {
        bail!(
            "--gpu: `{}` is not a calibrated generation (a100 or h100)",
            args.gpu
        );
    }
    let all = crate::validate::load_cases(args.path.as_ref())?;
    let cases: Vec<&Case> = all
        .iter()
        .filter(|c| c.status.is_modelled() && generation_of(c) == Some(generation.as_str()))
        .collect();
    if cases.is_empty() {
        bail!("no modelled case runs on {generation}");
    }
    let (compute, comm) = if generation == "a100" {
        (ComputeParams::a100(), CommParams::a100())
    } else {
        (ComputeParams::h100(), CommParams::h100())
    };
    let mut base = Params {
        compute,
        comm,
        straggler_cv: args
            .stragglers
            .then_some(prism_core::straggler::DEFAULT_GPU_SPEED_CV),
    };
    // 1. Kernel-level parameters from a measured trace.
    if let (Some(path), Some(job_path)) = (&args.kineto, &args.kineto_job) {
        let trace = prism_io::kineto::read_kineto(path)?;
        let job = prism_io::jobfile::load_job_file(job_path, &[])?.job;
        fit_from_trace(&mut base, &trace, &job, path)?;
    }
    if let Some(path) = &args.kernels {
        let kernels = prism_io::kernel_bench::read_kernel_bench(path)?;
        let job = prism_io::jobfile::load_job_str(&cases[0].job_toml, &cases[0].id, None, &[])
            .map_err(anyhow::Error::msg)?
            .job;
        fit_from_kernels(&mut base, &kernels, &job, path)?;
    }
    // 2. Fit on every case.
    let mut specs = specs(&generation);
    if args.kernels.is_some() {
        specs.retain(|s| {
            !matches!(
                s.name,
                "gemm_eff_max_bf16" | "attn_fwd_eff_max" | "attn_bwd_eff_max" | "mem_eff"
            )
        });
    }
    if args.kineto.is_some() {
        specs.retain(|s| s.name != "nvlink_efficiency");
    }
    if args.stragglers {
        specs.push(straggler_spec());
    }
    let start: Vec<f64> = specs.iter().map(|s| to_unit(s, (s.get)(&base))).collect();
    // One tick per objective evaluation (each simulates every training case); the fit and
    // each fold may overrun their budget by a simplex step.
    let planned = args.evals
        + if args.folds >= 2 {
            args.folds * (args.evals / 2)
        } else {
            0
        };
    let bar = indicatif::ProgressBar::new(planned as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} evaluations {elapsed} (eta {eta})",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    bar.set_prefix("calibrate");
    let before = mape(&errors(&cases, &base)?);
    let fit = |train: &[&Case], evals: usize| -> (Vec<f64>, f64) {
        let mut f = |u: &[f64]| {
            bar.inc(1);
            errors(train, &apply(&base, &specs, u))
                .map(|e| objective(&e))
                .unwrap_or(1e9)
        };
        nelder_mead(&mut f, &start, evals)
    };
    let (u, _) = fit(&cases, args.evals);
    if args.folds < 2 {
        bar.finish_and_clear();
    }
    let fitted = apply(&base, &specs, &u);
    let fitted_errors = errors(&cases, &fitted)?;
    let in_sample = mape(&fitted_errors);
    let worst = fitted_errors.iter().map(|x| x.abs()).fold(0.0, f64::max);
    bar.suspend(|| {
        println!(
            "{generation}: {} cases{}; MAPE before {before:.2}%, after fit {in_sample:.2}% (in-sample), max |error| {worst:.2}%",
            cases.len(),
            if args.stragglers { ", compared with stragglers" } else { "" }
        );
        for s in &specs {
            println!(
                "  {:<22} = {:.4}   (bounds {} .. {})",
                s.name,
                (s.get)(&fitted),
                s.lo,
                s.hi
            );
        }
    });
    // 3. Cross-validation.
    if args.folds >= 2 {
        let mut held = Vec::new();
        for k in 0..args.folds {
            let train: Vec<&Case> = cases
                .iter()
                .enumerate()
                .filter(|(i, _)| i % args.folds != k)
                .map(|(_, c)| *c)
                .collect();
            let test: Vec<&Case> = cases
                .iter()
                .enumerate()
                .filter(|(i, _)| i % args.folds == k)
                .map(|(_, c)| *c)
                .collect();
            if test.is_empty() || train.is_empty() {
                continue;
            }
            let (uk, _) = fit(&train, args.evals / 2);
            let e = errors(&test, &apply(&base, &specs, &uk))?;
            bar.suspend(|| {
                println!(
                    "  fold {k}: {} held-out cases, MAPE {:.2}%",
                    test.len(),
                    mape(&e)
                )
            });
            held.extend(e);
        }
        bar.finish_and_clear();
        outln!(
            "{generation}: cross-validated MAPE {:.2}% over {} held-out predictions ({}-fold)",
            mape(&held),
            held.len(),
            args.folds
        )?;
    }
    Ok(())
}
