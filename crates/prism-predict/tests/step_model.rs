//! The max-plus step model against the per-rank engine.

use prism_core::engine::{Mode, SimOptions, simulate};
use prism_core::job::Job;
use prism_core::job::fixtures::{llama3_405b_job, small_job};
use prism_core::ops::OpClass;
use prism_predict::perturbation::Perturbation;
use prism_predict::step_model::StepModel;
use prism_predict::variability::Dist;
use rand::RngExt;

mod common;

fn engine(job: &Job, mode: Mode, p: Option<Perturbation>) -> f64 {
    simulate(
        job,
        &SimOptions {
            mode,
            perturbation: p.map(|p| std::sync::Arc::new(p) as _),
            ..SimOptions::default()
        },
    )
    .unwrap()
    .summary
    .iteration_time_s
}

/// `job` with context parallelism `cp` (taken out of data parallelism).
fn with_cp(mut job: Job, cp: u32) -> Job {
    job.parallel.cp = cp;
    job.parallel.dp /= cp;
    job
}

/// With nominal durations the model reproduces the engine's iteration time exactly.
#[test]
fn nominal_equals_the_engine() {
    for job in [
        small_job(1, 2, 2, 16),
        small_job(4, 2, 2, 32),
        small_job(8, 4, 4, 64),
        with_cp(small_job(1, 2, 2, 16), 2),
        with_cp(small_job(4, 2, 2, 32), 2),
        with_cp(small_job(8, 2, 2, 64), 4),
        llama3_405b_job(),
    ] {
        let m = StepModel::new(&job, &SimOptions::default()).unwrap();
        let want = engine(&job, Mode::Reduced, None);
        assert_eq!(m.nominal_s(), want);
        let got = m.evaluate_nominal().unwrap();
        println!("{}: engine {want} model {got}", job.num_gpus());
        assert_eq!(got, want, "{} GPUs", job.num_gpus());
    }
}

/// Inside one node communication does not depend on timing, so the model with the engine's
/// own draws equals the engine's perturbed per-rank run, up to one thing it freezes: the SMs
/// the NCCL kernels in flight hold when each kernel chain starts (the engine prices kernels
/// for them, and a perturbation can move a chain's start across a collective's edge). The
/// samples agree within 1e-4 (measured: 3e-5 at most).
#[test]
fn exact_sampler_equals_the_per_rank_engine_in_a_node() {
    for (job, seeds) in [
        (small_job(1, 2, 2, 16), 20),
        (with_cp(small_job(1, 2, 2, 16), 2), 10),
        (with_cp(small_job(1, 1, 2, 16), 2), 10),
    ] {
        exact_sampler_case(&job, seeds);
    }
}

fn exact_sampler_case(job: &Job, seeds: u64) {
    let job = job.clone();
    let n = job.num_gpus() as usize;
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    for seed in 0..seeds {
        let p = Perturbation {
            rank_factor: (0..n)
                .map(|r| 1.0 + 0.03 * ((r as u64 * 7 + seed) % 5) as f64)
                .collect(),
            jitter: vec![
                (
                    Some(OpClass::Gemm),
                    Dist::Normal {
                        mean: 1.0,
                        std: 0.05,
                    },
                ),
                (
                    None,
                    Dist::LogNormal {
                        mu: 0.0,
                        sigma: 0.02,
                    },
                ),
            ],
            // By op name, on top of the class: one kernel name of the forward pass and one of
            // the backward pass.
            op_jitter: vec![
                (
                    "fc1_fwd".to_string(),
                    Dist::Normal {
                        mean: 1.1,
                        std: 0.05,
                    },
                ),
                (
                    "qkv_dgrad".to_string(),
                    Dist::LogNormal {
                        mu: 0.0,
                        sigma: 0.1,
                    },
                ),
            ],
            comm_factor: 1.0,
            seed,
        };
        let want = engine(&job, Mode::Full, Some(p.clone()));
        let got = m.sample_exact(&p).unwrap();
        assert!(
            ((got - want) / want).abs() <= 1e-4,
            "seed {seed}, tp {} cp {}: model {got} engine {want}",
            job.parallel.tp,
            job.parallel.cp
        );
    }
}

/// Two-sample Kolmogorov-Smirnov distance.
fn ks2(mut a: Vec<f64>, mut b: Vec<f64>) -> f64 {
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0.0f64);
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / a.len() as f64 - j as f64 / b.len() as f64).abs());
    }
    d
}

fn mean_sd(x: &[f64]) -> (f64, f64) {
    let m = x.iter().sum::<f64>() / x.len() as f64;
    let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len() - 1) as f64;
    (m, v.sqrt())
}

/// The fast sampler (per-segment normal sums, one order-statistic draw for the slowest of the
/// i.i.d. TP lanes) has the law of the per-kernel sampler: two-sample KS at the 0.1% level and
/// means within 4 standard errors, with and without persistent per-GPU speeds.
#[test]
fn fast_sampler_has_the_law_of_the_per_kernel_sampler() {
    // Without and with context parallelism (TP and CP groups of different lanes).
    for job in [small_job(4, 4, 2, 32), with_cp(small_job(4, 2, 2, 32), 2)] {
        law_case(&job, normal_jitter(), Vec::new(), 600);
    }
}

/// Jitter with no segment-sum shortcut (log-normal and gamma, and two distributions on one
/// class, drawn by the engine at one shared uniform) is drawn kernel by kernel: the same law
/// as the per-kernel sampler.
#[test]
fn fast_sampler_draws_other_jitter_kernel_by_kernel() {
    let jitter = vec![
        (
            Some(OpClass::Gemm),
            Dist::LogNormal {
                mu: 0.0,
                sigma: 0.05,
            },
        ),
        (
            Some(OpClass::Attention),
            Dist::Gamma {
                shape: 400.0,
                scale: 0.0025,
            },
        ),
        (
            None,
            Dist::LogNormal {
                mu: 0.0,
                sigma: 0.03,
            },
        ),
        (
            Some(OpClass::Elementwise),
            Dist::Normal {
                mean: 1.0,
                std: 0.1,
            },
        ),
    ];
    // (Fewer samples: the engine's gamma quantile is slow.)
    law_case(&small_job(4, 4, 2, 32), jitter, Vec::new(), 300);
}

/// Jitter by op name (a fit table's signature naming a kernel) on top of the class jitter: a
/// normal one joins the segment sums, a log-normal one is drawn kernel by kernel; the law is
/// the per-kernel sampler's.
#[test]
fn fast_sampler_draws_op_name_jitter() {
    let op_jitter = vec![
        (
            "fc1_fwd".to_string(),
            Dist::Normal {
                mean: 1.05,
                std: 0.1,
            },
        ),
        (
            "fc2_dgrad".to_string(),
            Dist::LogNormal {
                mu: 0.0,
                sigma: 0.08,
            },
        ),
    ];
    let job = small_job(4, 4, 2, 32);
    law_case(&job, normal_jitter(), op_jitter, 400);
    // The name selects its kernels: twice as long fc1 forward GEMMs lengthen the step (the
    // engine agrees to the picosecond); a name of no kernel changes nothing.
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let only = |name: &str| Perturbation {
        op_jitter: vec![(name.to_string(), Dist::Constant(2.0))],
        ..Perturbation::default()
    };
    let doubled = m.sample_exact(&only("fc1_fwd")).unwrap();
    println!(
        "fc1_fwd twice as long: {doubled} s, nominal {} s",
        m.nominal_s()
    );
    assert!(doubled > 1.01 * m.nominal_s());
    assert_eq!(doubled, engine(&job, Mode::Full, Some(only("fc1_fwd"))));
    assert_eq!(m.sample_exact(&only("no_such_op")).unwrap(), m.nominal_s());
}

fn normal_jitter() -> Vec<(Option<OpClass>, Dist)> {
    vec![
        (
            Some(OpClass::Gemm),
            Dist::Normal {
                mean: 1.0,
                std: 0.06,
            },
        ),
        (
            Some(OpClass::Attention),
            Dist::Normal {
                mean: 1.02,
                std: 0.04,
            },
        ),
        (
            Some(OpClass::Elementwise),
            Dist::Normal {
                mean: 1.0,
                std: 0.1,
            },
        ),
    ]
}

fn law_case(
    job: &Job,
    jitter: Vec<(Option<OpClass>, Dist)>,
    op_jitter: Vec<(String, Dist)>,
    samples: u64,
) {
    let job = job.clone();
    let n = job.num_gpus() as usize;
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    for speeds in [false, true] {
        let rank_factor: Vec<f64> = if speeds {
            (0..n).map(|r| 1.0 + 0.02 * ((r * 7) % 5) as f64).collect()
        } else {
            Vec::new()
        };
        let p = |seed: u64| Perturbation {
            rank_factor: rank_factor.clone(),
            jitter: jitter.clone(),
            op_jitter: op_jitter.clone(),
            comm_factor: 1.0,
            seed,
        };
        let fast_stats = m.fast_stats(&p(0)).unwrap();
        let exact: Vec<f64> = (0..samples)
            .map(|s| m.sample_exact(&p(s)).unwrap())
            .collect();
        let fast: Vec<f64> = (0..samples)
            .map(|s| {
                m.sample_fast(
                    &fast_stats,
                    &rank_factor,
                    1.0,
                    prism_predict::stats::stream_rng(99, &[s]).random::<u64>(),
                )
                .unwrap()
            })
            .collect();
        let d = ks2(exact.clone(), fast.clone());
        let crit = 1.95 * (2.0 / samples as f64).sqrt();
        let (me, se) = mean_sd(&exact);
        let (mf, sf) = mean_sd(&fast);
        let err = ((se * se + sf * sf) / samples as f64).sqrt();
        println!(
            "cp {} speeds {speeds}: exact mean {me:.6e} sd {se:.3e}, fast mean {mf:.6e} sd {sf:.3e}, \
             KS {d:.4} (critical {crit:.4})",
            job.parallel.cp
        );
        assert!(d < crit, "KS {d} >= {crit}");
        assert!((me - mf).abs() < 4.0 * err, "means {me} vs {mf} (se {err})");
        assert!(
            se > 0.0 && (sf / se - 1.0).abs() < 0.2,
            "spread {se} vs {sf}"
        );
    }
}

/// Persistent per-GPU speeds alone draw nothing: the fast sampler is the per-kernel one up to
/// picosecond rounding (one per kernel).
#[test]
fn fast_sampler_with_speeds_only_is_deterministic_and_exact() {
    let job = small_job(4, 4, 2, 32);
    let n = job.num_gpus() as usize;
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let rank_factor: Vec<f64> = (0..n).map(|r| 1.0 + 0.01 * ((r * 5) % 9) as f64).collect();
    let p = Perturbation {
        rank_factor: rank_factor.clone(),
        ..Perturbation::default()
    };
    let fs = m.fast_stats(&p).unwrap();
    let exact = m.sample_exact(&p).unwrap();
    let a = m
        .sample_fast(
            &fs,
            &rank_factor,
            1.0,
            prism_predict::stats::stream_rng(1, &[1]).random::<u64>(),
        )
        .unwrap();
    let b = m
        .sample_fast(
            &fs,
            &rank_factor,
            1.0,
            prism_predict::stats::stream_rng(2, &[2]).random::<u64>(),
        )
        .unwrap();
    assert_eq!(a, b, "no randomness without jitter");
    // Rounding: one picosecond per kernel at most (the engine rounds each kernel and gives a
    // kernel at least 1 ps; the fast sampler rounds each segment).
    let kernels = job_kernels(&job) as f64;
    println!("speeds only: fast {a} per-kernel {exact} kernels {kernels}");
    assert!((a - exact).abs() <= kernels * 1e-12, "{a} vs {exact}");
    assert!(a > m.nominal_s());
}

/// Unsupported jobs and jitter are errors (callers fall back to the engine), never panics.
#[test]
fn unsupported_inputs_are_errors() {
    let job = small_job(4, 2, 2, 32);
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let p = Perturbation {
        jitter: vec![(
            None,
            Dist::LogNormal {
                mu: 0.0,
                sigma: -0.02,
            },
        )],
        ..Perturbation::default()
    };
    assert!(m.fast_stats(&p).is_err(), "an invalid jitter distribution");
    let p = Perturbation::default();
    let fs = m.fast_stats(&p).unwrap();
    assert!(
        m.sample_fast(
            &fs,
            &[1.0; 3],
            1.0,
            prism_predict::stats::stream_rng(0, &[0]).random::<u64>()
        )
        .is_err()
    );
    assert!(
        m.sample_fast(
            &fs,
            &[],
            f64::NAN,
            prism_predict::stats::stream_rng(0, &[0]).random::<u64>()
        )
        .is_err()
    );
}

/// Kernels of the busiest stage program.
fn job_kernels(job: &Job) -> usize {
    prism_core::graph::ExecutionGraph::build(job)
        .programs
        .iter()
        .map(|p| p.stream_ops[0].len())
        .max()
        .unwrap_or(0)
}

/// The step model's critical path adds up to the sample's step time, is deterministic, and
/// finds a GPU made much slower than the rest.
#[test]
fn fast_attribution_telescopes_and_finds_a_slow_gpu() {
    for job in [small_job(4, 4, 2, 32), with_cp(small_job(4, 2, 2, 32), 2)] {
        attribution_case(&job);
    }
}

fn attribution_case(job: &Job) {
    let job = job.clone();
    let n = job.num_gpus() as usize;
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let slow = 13u32;
    let rank_factor: Vec<f64> = (0..n)
        .map(|r| if r as u32 == slow { 1.5 } else { 1.0 })
        .collect();
    let p = Perturbation {
        rank_factor: rank_factor.clone(),
        jitter: vec![(
            Some(OpClass::Gemm),
            Dist::Normal {
                mean: 1.0,
                std: 0.05,
            },
        )],
        ..Perturbation::default()
    };
    let fs = m.fast_stats(&p).unwrap();
    for seed in 0..5u64 {
        let a = m.attribute_fast(&fs, &rank_factor, 1.1, seed).unwrap();
        let step = m.sample_fast(&fs, &rank_factor, 1.1, seed).unwrap();
        assert_eq!(a.step_s, step, "the attribution evaluates the same sample");
        assert!(
            (a.path_s - step).abs() <= 1e-9 * step,
            "path {} vs step {step}",
            a.path_s
        );
        let sum: f64 = a.by_op.iter().map(|x| x.1).sum();
        assert!((sum - a.path_s).abs() <= 1e-9 * step);
        assert_eq!(a, m.attribute_fast(&fs, &rank_factor, 1.1, seed).unwrap());
        // The slow GPU (or its tensor-parallel group, for segments drawn as the slowest lane)
        // carries the most compute.
        let group = slow - slow % job.parallel.tp;
        let top_rank = a.by_rank.first().map(|x| x.0);
        let top_group = a.by_tp_group.first().map(|x| x.0);
        println!(
            "cp {} seed {seed}: top rank {top_rank:?} top group {top_group:?} step {step}",
            job.parallel.cp
        );
        assert!(
            top_rank == Some(slow) || top_group == Some(group),
            "{:?} {:?}",
            a.by_rank.first(),
            a.by_tp_group.first()
        );
    }
}

/// The draw count of a fast sample: none without jitter; per-GPU speeds turn each order-statistic
/// draw of a tensor-parallel group into one draw per lane and leave the rest alone; twice the
/// replicas (same micro-batches each) take twice the draws.
#[test]
fn draws_per_sample_follow_the_program() {
    let count = |job: &Job, speeds: bool, jitter: bool| {
        let m = StepModel::new(job, &SimOptions::default()).unwrap();
        let p = Perturbation {
            rank_factor: if speeds {
                vec![1.0; job.num_gpus() as usize]
            } else {
                Vec::new()
            },
            jitter: if jitter { normal_jitter() } else { Vec::new() },
            ..Perturbation::default()
        };
        m.draws_per_sample(&m.fast_stats(&p).unwrap())
    };
    for (job, twice) in [
        (small_job(4, 4, 2, 32), small_job(8, 4, 2, 64)),
        (
            with_cp(small_job(4, 2, 2, 32), 2),
            with_cp(small_job(8, 2, 2, 64), 2),
        ),
    ] {
        let lanes = (job.parallel.tp * job.parallel.cp) as u64;
        let none = count(&job, true, false);
        assert_eq!((none.lane, none.group), (0, 0), "no jitter, no draws");
        let j = count(&job, false, true);
        let sj = count(&job, true, true);
        println!(
            "{} GPUs: jitter {j:?}, speeds and jitter {sj:?}",
            job.num_gpus()
        );
        assert!(j.lane > 0);
        assert_eq!(sj.group, 0, "per-GPU speeds: no i.i.d. lanes");
        assert_eq!(sj.lane, j.lane + lanes * j.group);
        if job.parallel.cp == 1 {
            assert!(j.group > 0, "collapsible segments draw the slowest lane");
        }
        let t = count(&twice, true, true);
        assert_eq!(t.lane, 2 * sj.lane, "twice the replicas");
    }
}

/// Replica pruning changes nothing: with persistent speeds (a few slow GPUs) and normal jitter,
/// every sample of a cluster whose communication regime lies between the two pilots' equals
/// the full fast sample to the bit, while most replicas are never evaluated; a regime outside
/// the pilots' range evaluates every replica.
#[test]
fn pruned_samples_equal_full_samples() {
    let job = small_job(16, 4, 2, 64);
    let n = job.num_gpus() as usize;
    let dp = job.parallel.dp as usize;
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let mut rng = prism_predict::stats::stream_rng(3, &[0]);
    let rank_factor: Vec<f64> = (0..n)
        .map(|_| {
            let f = Dist::Normal {
                mean: 1.0,
                std: 0.04,
            }
            .sample(&mut rng);
            if rng.random::<f64>() < 0.02 {
                f * 1.1
            } else {
                f
            }
        })
        .collect();
    let jitter = vec![
        (
            Some(OpClass::Gemm),
            Dist::Normal {
                mean: 1.0,
                std: 0.04,
            },
        ),
        (
            Some(OpClass::Attention),
            Dist::Normal {
                mean: 1.0,
                std: 0.15,
            },
        ),
    ];
    let p = Perturbation {
        rank_factor: rank_factor.clone(),
        jitter,
        ..Perturbation::default()
    };
    let fs = m.fast_stats(&p).unwrap();
    let seed = |i: u64| prism_predict::stats::stream_rng(11, &[i]).random::<u64>();
    let (c0, c1) = (0.9, 1.25);
    let (s0, p0) = m.sample_pilot(&fs, &rank_factor, c0, seed(0)).unwrap();
    let (s1, p1) = m.sample_pilot(&fs, &rank_factor, c1, seed(1)).unwrap();
    assert_eq!(s0, m.sample_fast(&fs, &rank_factor, c0, seed(0)).unwrap());
    assert_eq!(s1, m.sample_fast(&fs, &rank_factor, c1, seed(1)).unwrap());
    let pruner =
        prism_predict::step_model::Pruner::new(&m, &fs, &rank_factor, &p1, Some(&p0)).unwrap();
    let mut evaluated = 0;
    let samples = 60;
    for i in 2..2 + samples {
        let c = c0 + (c1 - c0) * ((i * 37) % 61) as f64 / 60.0;
        let full = m.sample_fast(&fs, &rank_factor, c, seed(i)).unwrap();
        let (pruned, k) = m
            .sample_pruned(&fs, &pruner, &rank_factor, c, seed(i))
            .unwrap();
        assert_eq!(pruned.to_bits(), full.to_bits(), "sample {i} (c {c})");
        evaluated += k;
    }
    println!(
        "{dp} replicas: {evaluated} of {} replica evaluations",
        samples as usize * dp
    );
    // Measured: 345 of 960 with the H100 parameters of the 2026-11-25 interleaved refit (under
    // a quarter with the earlier ones); most replicas are still skipped.
    assert!(
        evaluated * 5 < samples as usize * dp * 2,
        "{evaluated} evaluated"
    );
    // Outside the pilots' regimes: every replica.
    let (t, k) = m
        .sample_pruned(&fs, &pruner, &rank_factor, 1.3, seed(99))
        .unwrap();
    assert_eq!(k, dp);
    assert_eq!(t, m.sample_fast(&fs, &rank_factor, 1.3, seed(99)).unwrap());
    // Without per-GPU factors the replicas are alike: every replica.
    let (t, k) = m.sample_pruned(&fs, &pruner, &[], 1.0, seed(98)).unwrap();
    assert_eq!(k, dp);
    assert_eq!(t, m.sample_fast(&fs, &[], 1.0, seed(98)).unwrap());
}

/// Acceptance (issue 4): with i.i.d. normal jitter on a job small enough for a closed form, the
/// predicted p50 and p95 match it within the Monte Carlo error. One GPU: the iteration is one
/// chain of kernels, so its time is normal with mean `T` (the deterministic time; the factors
/// have mean 1) and variance `sigma^2 sum d_k^2` over the jittered (GEMM) kernels, whose
/// nominal durations `d_k` come from the engine's recorded timeline.
#[test]
fn iid_normal_jitter_matches_the_closed_form() {
    let sigma = 0.05;
    let (job, t, sd) = common::one_gpu_gemm_jitter(sigma);
    let (p50, p95) = (t, t + 1.6448536269514722 * sd);
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let jitter = vec![(
        Some(OpClass::Gemm),
        Dist::Normal {
            mean: 1.0,
            std: sigma,
        },
    )];
    let p = Perturbation {
        jitter,
        ..Perturbation::default()
    };
    let fs = m.fast_stats(&p).unwrap();
    let n = 4000;
    let mut x: Vec<f64> = (0..n)
        .map(|i| m.sample_fast(&fs, &[], 1.0, i).unwrap())
        .collect();
    x.sort_by(f64::total_cmp);
    let s = prism_predict::stats::summarize(&x);
    // Standard errors of sample quantiles of a normal: sqrt(p (1 - p) / n) / phi(z_p) sd.
    let se50 = 1.2533 * sd / (n as f64).sqrt();
    let se95 = 2.1131 * sd / (n as f64).sqrt();
    println!(
        "closed form p50 {p50:.6} p95 {p95:.6} (sd {sd:.3e}); predicted p50 {:.6} p95 {:.6}; \
         errors {:.2} and {:.2} standard errors",
        s.p50,
        s.p95,
        (s.p50 - p50) / se50,
        (s.p95 - p95) / se95
    );
    assert!(sd > 1e-3 * t, "the jitter must matter: sd {sd}");
    assert!((s.p50 - p50).abs() < 4.0 * se50, "p50 {} vs {p50}", s.p50);
    assert!((s.p95 - p95).abs() < 4.0 * se95, "p95 {} vs {p95}", s.p95);
    // The per-rank engine (the per-kernel draws) agrees too.
    let mut e: Vec<f64> = (0..400)
        .map(|seed| engine(&job, Mode::Full, Some(Perturbation { seed, ..p.clone() })))
        .collect();
    e.sort_by(f64::total_cmp);
    let se = prism_predict::stats::summarize(&e);
    let k = 4.0 / (400f64).sqrt();
    assert!(
        (se.p50 - p50).abs() < k * 1.2533 * sd,
        "engine p50 {}",
        se.p50
    );
    assert!(
        (se.p95 - p95).abs() < k * 2.1131 * sd,
        "engine p95 {}",
        se.p95
    );
}

/// Explore's deterministic run, kept, compiles the same step model as a fresh engine run: the
/// same frozen durations, the same nominal iteration and the same fast samples.
#[test]
fn frozen_durations_of_explores_run_equal_a_fresh_record() {
    use prism_predict::step_model::Frozen;
    let job = small_job(2, 2, 2, 8);
    let (run, frozen) = prism_predict::explore::simulate_det_frozen(&job, &None).unwrap();
    let frozen = frozen.expect("a symmetric job runs reduced");
    assert_eq!(
        frozen,
        Frozen::record(&job, &SimOptions::default()).unwrap()
    );
    let kept = StepModel::with_frozen(&job, &frozen).unwrap();
    let fresh = StepModel::new(&job, &SimOptions::default()).unwrap();
    assert_eq!(kept.nominal_s(), run.summary.iteration_time_s);
    assert_eq!(
        kept.evaluate_nominal().unwrap(),
        fresh.evaluate_nominal().unwrap()
    );
    let p = Perturbation {
        jitter: normal_jitter(),
        ..Perturbation::default()
    };
    let (fk, ff) = (kept.fast_stats(&p).unwrap(), fresh.fast_stats(&p).unwrap());
    for seed in 0..4 {
        assert_eq!(
            kept.sample_fast(&fk, &[], 1.1, seed).unwrap(),
            fresh.sample_fast(&ff, &[], 1.1, seed).unwrap()
        );
    }
    // Another job's durations are refused, not misread.
    let other = small_job(2, 4, 1, 8);
    assert!(StepModel::with_frozen(&other, &frozen).is_err());
}

/// Pooled lane races: every sample draws a pool of exact block times for each racing block
/// shape (the backward blocks whose lanes desynchronise) and each block picks one from it. The
/// pools are found on a TP job with kernel jitter, never with per-GPU speeds, are
/// deterministic, and keep the iteration time's law: two-sample KS at the 0.1% level against
/// the unpooled fast sampler, means within 4 standard errors, spreads within 20%, with the
/// communication regime varying across samples.
#[test]
fn pooled_lane_races_keep_the_law() {
    use prism_predict::step_model::PoolSettings;
    let job = small_job(4, 4, 2, 32);
    let m = StepModel::new(&job, &SimOptions::default()).unwrap();
    let p = Perturbation {
        jitter: normal_jitter(),
        ..Perturbation::default()
    };
    let exact = m.fast_stats(&p).unwrap();
    assert!(
        exact.pooled_shapes().is_empty(),
        "a small job stays below the default threshold"
    );
    let settings = PoolSettings {
        size: 512,
        min_uses: 1,
    };
    let pooled = m.fast_stats_with(&p, settings).unwrap();
    let shapes = pooled.pooled_shapes();
    println!("pooled shapes (blocks per sample): {shapes:?}");
    assert!(!shapes.is_empty(), "the backward blocks race and repeat");
    // Per-GPU speeds make lanes differ: nothing repeats.
    let speeds = Perturbation {
        rank_factor: (0..job.num_gpus())
            .map(|r| 1.0 + 0.01 * (r % 3) as f64)
            .collect(),
        ..p.clone()
    };
    assert!(
        (m.fast_stats_with(&speeds, settings).unwrap())
            .pooled_shapes()
            .is_empty()
    );
    let samples = 1000u64;
    let seed = |i: u64| prism_predict::stats::stream_rng(7, &[i]).random::<u64>();
    // Kernel jitter alone, then with a communication regime varying across samples.
    for varying in [false, true] {
        let comm = |i: u64| {
            if varying {
                0.8 + 0.4 * (i % 7) as f64 / 6.0
            } else {
                1.0
            }
        };
        let a: Vec<f64> = (0..samples)
            .map(|i| m.sample_fast(&exact, &[], comm(i), seed(i)).unwrap())
            .collect();
        let b: Vec<f64> = (0..samples)
            .map(|i| m.sample_fast(&pooled, &[], comm(i), seed(i)).unwrap())
            .collect();
        assert_eq!(
            m.sample_fast(&pooled, &[], comm(3), seed(3)).unwrap(),
            b[3],
            "deterministic"
        );
        let d = ks2(a.clone(), b.clone());
        let crit = 1.95 * (2.0 / samples as f64).sqrt();
        let (ma, sa) = mean_sd(&a);
        let (mb, sb) = mean_sd(&b);
        let err = ((sa * sa + sb * sb) / samples as f64).sqrt();
        println!(
            "varying regime {varying}: unpooled mean {ma:.6e} sd {sa:.3e}, pooled mean {mb:.6e} \
             sd {sb:.3e}, KS {d:.4} (critical {crit:.4})"
        );
        assert!(d < crit, "KS {d} >= {crit}");
        assert!((ma - mb).abs() < 4.0 * err, "means {ma} vs {mb} (se {err})");
        assert!((sb / sa - 1.0).abs() < 0.2, "spread {sa} vs {sb}");
    }
}
