//! The guarantee of `prism predict`, checked by its coverage on the pipeline users run: step
//! model, clusters of persistent GPU speeds, stratified communication regimes, pruning, whole
//! runs with failures and checkpoints. 200 seeds per case; a seed covers when its bound is at or
//! above the true quantile (a closed form, or a reference run with 25x the clusters).
//!
//! The tolerance: observed coverage at least `nominal - 3 sd` of a binomial with 200 trials at
//! the nominal rate (0.95 -> 0.904, 0.90 -> 0.836). The seeds are fixed, so the test is
//! deterministic; a valid bound fails it with probability below 0.2% per case and pair.

use prism_core::engine::{SimOptions, simulate};
use prism_core::job::Job;
use prism_core::job::fixtures::small_job;
use prism_predict::predict::{PredictOptions, Prediction, predict};
use prism_predict::stats::{self, quantile_sorted, std_normal_quantile};
use prism_predict::variability::{CommRegime, Dist, Failures, GpuSpeed, KernelJitter, Variability};

mod common;

const SEEDS: u64 = 200;
const PAIRS: [(f64, f64); 3] = [(0.90, 0.90), (0.95, 0.95), (0.99, 0.95)];

fn opts(tokens: f64, samples: u64, clusters: u64, runs: u64, seed: u64) -> PredictOptions {
    PredictOptions {
        tokens,
        samples,
        clusters,
        runs,
        quantile: 0.95,
        confidence: 0.95,
        seed,
        per_rank: false,
        prune: true,
        pool: true,
    }
}

/// A 1-node job: tp 2, pp 2, dp 2 (8 GPUs).
fn eight_gpus() -> Job {
    small_job(1, 2, 2, 8)
}

fn predictions(
    job: &Job,
    v: &Variability,
    tokens: f64,
    samples: u64,
    clusters: u64,
) -> Vec<Prediction> {
    (1..=SEEDS)
        .map(|seed| {
            predict(
                job,
                v,
                &opts(tokens, samples, clusters, 10 * clusters, seed),
                &SimOptions::default(),
                &|_| {},
            )
            .unwrap()
        })
        .collect()
}

/// Observed coverage of the training-time guarantee at each pair, and the tolerance check.
fn check(name: &str, preds: &[Prediction], truth: impl Fn(f64) -> f64, step: bool) {
    for (q, c) in PAIRS {
        let t = truth(q);
        let covered = (preds.iter())
            .filter(|p| {
                let g = p.guarantee_at(q, c);
                let b = if step { g.step_s } else { g.training_s };
                b.expect("a bound at this many clusters") >= t
            })
            .count() as f64;
        let observed = covered / preds.len() as f64;
        let floor = c - 3.0 * (c * (1.0 - c) / preds.len() as f64).sqrt();
        println!("{name}: q {q} confidence {c}: coverage {observed:.3} (floor {floor:.3})");
        assert!(
            observed >= floor,
            "{name}: q {q} at {c}: coverage {observed} below {floor}"
        );
    }
}

/// The q-quantile of the pooled runs of a reference prediction.
fn reference_quantile(r: &Prediction, q: f64, step: bool) -> f64 {
    let groups = if step { &r.step_groups } else { &r.run_groups };
    let mut all: Vec<f64> = groups.iter().flatten().copied().collect();
    all.sort_by(f64::total_cmp);
    quantile_sorted(&all, q)
}

fn reference(job: &Job, v: &Variability, tokens: f64, per_cluster: u64) -> Prediction {
    let clusters = 12_500;
    predict(
        job,
        v,
        &opts(
            tokens,
            clusters * per_cluster,
            clusters,
            20 * clusters,
            1_000_003,
        ),
        &SimOptions::default(),
        &|_| {},
    )
    .unwrap()
}

/// Closed form: one GPU with i.i.d. normal GEMM jitter runs one chain of kernels, so a step is
/// normal with mean `T` and variance `sigma^2 sum d_k^2` (durations from the engine's timeline);
/// a run of one iteration takes one step, so its q-quantile is `T + z_q sd` exactly.
#[test]
fn closed_form_quantile_is_covered() {
    let sigma = 0.05;
    let (job, t, sd) = common::one_gpu_gemm_jitter(sigma);
    let v = Variability {
        kernel_jitter: vec![KernelJitter {
            class: "gemm".into(),
            factor: Dist::Normal {
                mean: 1.0,
                std: sigma,
            },
        }],
        ..Variability::default()
    };
    let tokens = job.tokens_per_iteration() as f64;
    let preds = predictions(&job, &v, tokens, 500, 500);
    assert_eq!(preds[0].iterations, 1);
    let truth = |q: f64| t + std_normal_quantile(q) * sd;
    check("closed form, training time", &preds, truth, false);
    check("closed form, step time", &preds, truth, true);
}

/// Persistent GPU speeds (with outliers) and a congestion regime: the runs of a cluster share
/// its GPUs. The bound that treats every run as independent (the one `prism predict` used
/// before) misses here; the cluster bound holds.
#[test]
fn persistent_gpu_speeds_are_covered() {
    let job = eight_gpus();
    let v = Variability {
        gpu_speed: Some(GpuSpeed {
            factor: Dist::Normal {
                mean: 1.0,
                std: 0.05,
            },
            outlier_fraction: 0.05,
            outlier_slowdown: 1.3,
        }),
        comm_regime: Some(CommRegime {
            factor: Dist::LogNormal {
                mu: 0.0,
                sigma: 0.2,
            },
        }),
        ..Variability::default()
    };
    let tokens = 200.0 * job.tokens_per_iteration() as f64;
    let r = reference(&job, &v, tokens, 2);
    let preds = predictions(&job, &v, tokens, 1000, 500);
    check(
        "gpu speeds",
        &preds,
        |q| reference_quantile(&r, q, false),
        false,
    );
    check(
        "gpu speeds, step",
        &preds,
        |q| reference_quantile(&r, q, true),
        true,
    );
    // The old bound: every run of 10 clusters as an independent draw.
    let truth = reference_quantile(&r, 0.95, false);
    let naive = (1..=SEEDS)
        .filter(|&seed| {
            let p = predict(
                &job,
                &v,
                &opts(tokens, 200, 10, 1000, seed),
                &SimOptions::default(),
                &|_| {},
            )
            .unwrap();
            let mut all: Vec<f64> = p.run_groups.iter().flatten().copied().collect();
            all.sort_by(f64::total_cmp);
            stats::guarantee(&all, 0.95, 0.95).is_some_and(|b| b >= truth)
        })
        .count() as f64
        / SEEDS as f64;
    println!("runs as independent draws, 10 clusters: coverage {naive:.3} (nominal 0.95)");
    assert!(
        naive < 0.85,
        "the i.i.d. bound was expected to undercover: {naive}"
    );
}

/// Kernel jitter only: no persistent speeds, but the runs of a cluster still share its step
/// samples.
#[test]
fn kernel_jitter_is_covered() {
    let job = eight_gpus();
    let v = Variability {
        kernel_jitter: vec![KernelJitter {
            class: "gemm".into(),
            factor: Dist::Normal {
                mean: 1.0,
                std: 0.1,
            },
        }],
        ..Variability::default()
    };
    let tokens = 50.0 * job.tokens_per_iteration() as f64;
    let r = reference(&job, &v, tokens, 2);
    let preds = predictions(&job, &v, tokens, 1000, 500);
    check(
        "kernel jitter",
        &preds,
        |q| reference_quantile(&r, q, false),
        false,
    );
}

/// Failures and checkpoints: lost work, restarts and checkpoint writes on top of persistent
/// speeds.
#[test]
fn failures_and_checkpoints_are_covered() {
    let job = eight_gpus();
    // About 4 failures per run of 300 iterations; a checkpoint every 15 iterations.
    let step = simulate(&job, &SimOptions::default())
        .unwrap()
        .summary
        .iteration_time_s;
    let run_h = 300.0 * step / 3600.0;
    let v = Variability {
        gpu_speed: Some(GpuSpeed {
            factor: Dist::Normal {
                mean: 1.0,
                std: 0.03,
            },
            outlier_fraction: 0.0,
            outlier_slowdown: 1.0,
        }),
        failures: Some(Failures {
            rate_per_gpu_hour: 4.0 / (8.0 * run_h),
            checkpoint_interval_s: 15.0 * step,
            checkpoint_write_s: 0.5 * step,
            restart_s: 5.0 * step,
        }),
        ..Variability::default()
    };
    let tokens = 300.0 * job.tokens_per_iteration() as f64;
    let r = reference(&job, &v, tokens, 2);
    let interruptions = r.interruptions;
    assert!(
        (1.0..20.0).contains(&interruptions),
        "failures must matter: {interruptions} per run"
    );
    let preds = predictions(&job, &v, tokens, 1000, 500);
    check(
        "failures",
        &preds,
        |q| reference_quantile(&r, q, false),
        false,
    );
}
