//! `prism bench`: wall time and peak memory of reference simulations, measured in-process on a
//! release build. Peak memory is the process's resident high-water mark (Linux `VmHWM`), reset
//! before each scenario through `/proc/self/clear_refs`; elsewhere it is reported as unknown.

use std::time::Instant;

use anyhow::{Context, Result};
use prism_core::engine::{Mode, SimOptions};
use prism_core::ops::OpClass;
use prism_predict::perturbation::Perturbation;
use prism_predict::variability::Dist;

use crate::BenchArgs;

struct Scenario {
    name: &'static str,
    what: &'static str,
    sets: &'static [&'static str],
    run: Run,
}

/// What a scenario times.
#[derive(Clone)]
enum Run {
    /// One engine simulation.
    Engine(Mode),
    /// One Monte Carlo sample of the max-plus step model on one thread (compiled once,
    /// untimed): per-GPU speeds (normal 3%, 1% outliers at 1.1x) and/or normal 2% jitter on
    /// GEMMs and attention.
    Step { speeds: bool, jitter: bool },
    /// One pruned sample of the step model (speeds and jitter as above, regime 1) after two
    /// untimed pilots at regimes 0.9 and 1.1: the cost of a cluster's non-pilot sample.
    Pruned,
    /// Ten million standard normal draws from the step model's generator on one thread.
    NormalDraws,
}

/// Draws timed by the `normal-draws-10m` scenario.
const NORMAL_DRAWS: u64 = 10_000_000;

const SETS_64K: &[&str] = &[
    "cluster.nodes=8192",
    "parallel.dp=512",
    "training.global_batch=8192",
];

fn scenarios() -> Vec<Scenario> {
    // Smallest first: the allocator keeps freed memory, so each high-water mark is its own.
    vec![
        Scenario {
            name: "llama3-405b-16k-reduced",
            what: "default job, one representative per pipeline stage",
            sets: &[],
            run: Run::Engine(Mode::Reduced),
        },
        Scenario {
            name: "llama3-405b-16k-full",
            what: "default job: Llama 3 405B, 16,384 H100, tp 8 pp 16 dp 128, every rank",
            sets: &[],
            run: Run::Engine(Mode::Full),
        },
        Scenario {
            name: "llama3-405b-64k-full",
            what: "same model on 65,536 H100 (dp 512, global batch 8192), every rank",
            sets: SETS_64K,
            run: Run::Engine(Mode::Full),
        },
        Scenario {
            name: "normal-draws-10m",
            what: "10 million standard normal draws from the step model's generator",
            sets: &[],
            run: Run::NormalDraws,
        },
        Scenario {
            name: "step-64k-jitter",
            what: "step model, 65,536 H100: one sample, normal 2% GEMM/attention jitter",
            sets: SETS_64K,
            run: Run::Step {
                speeds: false,
                jitter: true,
            },
        },
        Scenario {
            name: "step-64k-speeds",
            what: "step model, 65,536 H100: one sample, per-GPU speeds",
            sets: SETS_64K,
            run: Run::Step {
                speeds: true,
                jitter: false,
            },
        },
        Scenario {
            name: "step-64k-speeds-jitter",
            what: "step model, 65,536 H100: one sample, per-GPU speeds and jitter",
            sets: SETS_64K,
            run: Run::Step {
                speeds: true,
                jitter: true,
            },
        },
        Scenario {
            name: "step-64k-pruned",
            what: "step model, 65,536 H100: one sample with replica pruning, per-GPU speeds and jitter",
            sets: SETS_64K,
            run: Run::Pruned,
        },
    ]
}

/// The step scenarios' variability: per-GPU speeds N(1, 0.03) with 1% of GPUs 1.1x slower,
/// and N(1, 0.02) jitter on GEMMs and attention (seeded, so every run times the same work).
fn step_perturbation(gpus: usize, speeds: bool, jitter: bool) -> Perturbation {
    use rand::RngExt;
    let mut rng = prism_predict::stats::stream_rng(7, &[1]);
    let normal = Dist::Normal {
        mean: 1.0,
        std: 0.03,
    };
    let rank_factor = if speeds {
        (0..gpus)
            .map(|_| {
                let f = normal.sample(&mut rng);
                if rng.random::<f64>() < 0.01 {
                    f * 1.1
                } else {
                    f
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let j = Dist::Normal {
        mean: 1.0,
        std: 0.02,
    };
    let jitter = if jitter {
        vec![
            (Some(OpClass::Gemm), j.clone()),
            (Some(OpClass::Attention), j),
        ]
    } else {
        Vec::new()
    };
    Perturbation {
        rank_factor,
        jitter,
        ..Perturbation::default()
    }
}

fn peak_rss_reset() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let repeat = args.repeat.clamp(1, 100);
    let mut rows = Vec::new();
    for sc in scenarios() {
        if let Some(f) = &args.filter
            && !sc.name.contains(f.as_str())
        {
            continue;
        }
        let sets: Vec<String> = sc.sets.iter().map(|s| s.to_string()).collect();
        let job = prism_io::jobfile::default_job(&sets)
            .with_context(|| format!("scenario {}", sc.name))?
            .job;
        let rss_ok = peak_rss_reset();
        let mut times = Vec::new();
        let mut iteration = 0.0;
        let mut events = 0;
        let mut draws = None;
        let mut replicas: Option<Vec<usize>> = None;
        match &sc.run {
            Run::Engine(mode) => {
                let opts = SimOptions {
                    mode: mode.clone(),
                    ..SimOptions::default()
                };
                for _ in 0..repeat {
                    let t0 = Instant::now();
                    let r = prism_core::simulate(&job, &opts)
                        .with_context(|| format!("scenario {}", sc.name))?;
                    times.push(t0.elapsed().as_secs_f64());
                    iteration = r.summary.iteration_time_s;
                    events = r.events;
                }
            }
            &Run::Step { speeds, jitter } => {
                let p = step_perturbation(job.num_gpus() as usize, speeds, jitter);
                let m = prism_predict::step_model::StepModel::new(&job, &SimOptions::default())
                    .with_context(|| format!("scenario {}", sc.name))?;
                let fast = m
                    .fast_stats(&p)
                    .with_context(|| format!("scenario {}", sc.name))?;
                for i in 0..repeat as u64 {
                    let t0 = Instant::now();
                    iteration = m
                        .sample_fast(&fast, &p.rank_factor, 1.0, i)
                        .with_context(|| format!("scenario {}", sc.name))?;
                    times.push(t0.elapsed().as_secs_f64());
                }
                draws = Some(m.draws_per_sample(&fast));
                for (k, ps) in m.pool_summary(&fast, 1.0, 0)?.iter().enumerate() {
                    outln!(
                        "  pooled shape {k}: {} instructions, {} blocks per sample, block {:.1} us \
                         (sd {:.2} us)",
                        ps.instructions,
                        ps.blocks_per_sample,
                        ps.mean_s * 1e6,
                        ps.sd_s * 1e6
                    )?;
                }
            }
            Run::Pruned => {
                let p = step_perturbation(job.num_gpus() as usize, true, true);
                let m = prism_predict::step_model::StepModel::new(&job, &SimOptions::default())
                    .with_context(|| format!("scenario {}", sc.name))?;
                let fast = m.fast_stats(&p)?;
                let rf = &p.rank_factor;
                let (_, a) = m.sample_pilot(&fast, rf, 0.9, u64::MAX)?;
                let (_, b) = m.sample_pilot(&fast, rf, 1.1, u64::MAX - 1)?;
                let pruner = prism_predict::step_model::Pruner::new(&m, &fast, rf, &a, Some(&b))
                    .context("pruning does not apply")?;
                let mut evaluated = Vec::new();
                for i in 0..repeat as u64 {
                    let t0 = Instant::now();
                    let (t, k) = m.sample_pruned(&fast, &pruner, rf, 1.0, i)?;
                    times.push(t0.elapsed().as_secs_f64());
                    iteration = t;
                    evaluated.push(k);
                }
                replicas = Some(evaluated);
            }
            Run::NormalDraws => {
                for i in 0..repeat as u64 {
                    let t0 = Instant::now();
                    iteration = prism_predict::step_model::normal_draws(NORMAL_DRAWS, i);
                    times.push(t0.elapsed().as_secs_f64());
                }
            }
        }
        let rss = if rss_ok { peak_rss_bytes() } else { None };
        let med = median(&mut times);
        if !args.json {
            eprintln!("{}: median {:.3} s over {} runs", sc.name, med, repeat);
            if let Some(d) = draws {
                eprintln!(
                    "  draws per sample: {} per lane, {} per tensor-parallel group",
                    d.lane, d.group
                );
            }
            if let Some(r) = &replicas {
                eprintln!(
                    "  replicas evaluated per sample: {r:?} of {}",
                    job.parallel.dp
                );
            }
            if matches!(sc.run, Run::NormalDraws) {
                eprintln!("  {:.2} ns per draw", med / NORMAL_DRAWS as f64 * 1e9);
            }
        }
        rows.push(serde_json::json!({
            "scenario": sc.name,
            "description": sc.what,
            "gpus": (!matches!(sc.run, Run::NormalDraws)).then(|| job.num_gpus()),
            "repeats": repeat,
            "wall_s_median": med,
            "wall_s_min": times.first().copied(),
            "wall_s_max": times.last().copied(),
            "peak_rss_bytes": rss,
            "events": events,
            "simulated_iteration_s": iteration,
            "lane_draws_per_sample": draws.map(|d| d.lane),
            "group_draws_per_sample": draws.map(|d| d.group),
            "replicas_evaluated": replicas,
        }));
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
    } else {
        outln!(
            "{:<26} {:>7} {:>12} {:>12} {:>12} {:>14}",
            "scenario",
            "GPUs",
            "median s",
            "min s",
            "peak RSS MiB",
            "events"
        )?;
        for r in &rows {
            let rss = r["peak_rss_bytes"].as_u64().map_or("n/a".to_string(), |b| {
                format!("{:.0}", b as f64 / 1048576.0)
            });
            outln!(
                "{:<26} {:>7} {:>12.3} {:>12.3} {:>12} {:>14}",
                r["scenario"].as_str().unwrap_or(""),
                r["gpus"]
                    .as_u64()
                    .map_or("-".to_string(), |g| g.to_string()),
                r["wall_s_median"].as_f64().unwrap_or(f64::NAN),
                r["wall_s_min"].as_f64().unwrap_or(f64::NAN),
                rss,
                r["events"]
            )?;
        }
    }
    Ok(())
}
