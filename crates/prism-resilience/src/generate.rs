//! Timing logs with injected faults, played out on the engine, with their ground truth.
//!
//! Every iteration is one run of `prism_core::hetero::simulate_hetero`: each replica gets fresh
//! packed micro-batches from a long-tailed [`Workload`], each unit (a stage's tensor-parallel
//! group of one replica) a small multiplicative speed noise, and the engine gives every unit's
//! compute window and busy time. Faults are injected one at a time after healthy gaps: a
//! fail-slow episode slows one device of one unit for a while (the unit runs at that device's
//! pace); a fail-stop kills one device mid-iteration, the job hangs (the dead unit's
//! heartbeats stop, the others keep beating) and restarts after `restart_s` with the device
//! replaced.

use prism_core::hetero::{
    Device, HeteroError, HeteroPipeline, LayerCost, Replica, Stage, simulate_hetero,
};
use prism_core::job::{Cluster, Schedule};
use prism_predict::stats::stream_rng;
use rand::RngExt;
use rand_distr::{Distribution, LogNormal};

use crate::detect::{Episode, FaultKind, LogEvent, StepRecord};
use crate::workload::{Workload, uniform};

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenConfig {
    /// Data-parallel replicas.
    pub replicas: u32,
    /// Layers of each pipeline stage.
    pub stage_layers: Vec<u32>,
    /// Tensor-parallel degree of every stage.
    pub tp: u32,
    /// Micro-batches per replica per iteration.
    pub micro_batches: u32,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Per-layer costs.
    pub cost: LayerCost,
    /// Document lengths and packing.
    pub workload: Workload,
    /// Log-normal sigma of the per-unit, per-iteration speed noise.
    pub noise_sigma: f64,
    /// Heartbeat period, seconds.
    pub heartbeat_s: f64,
    /// Fault episodes to inject.
    pub episodes: u32,
    /// Fraction of episodes that are fail-stop.
    pub fail_stop_fraction: f64,
    /// Healthy time between episodes, seconds (uniform in the range).
    pub gap_s: (f64, f64),
    /// Fail-slow duration, seconds (uniform).
    pub slow_s: (f64, f64),
    /// Speed of the slow device (uniform), relative to healthy.
    pub slow_speed: (f64, f64),
    /// Hang before the job is back after a fail-stop, seconds.
    pub restart_s: f64,
    /// Seed.
    pub seed: u64,
}

impl GenConfig {
    /// A small default (2 replicas x 2 stages of TP 2) with `episodes` faults.
    pub fn small(cost: LayerCost, episodes: u32) -> Self {
        GenConfig {
            replicas: 2,
            stage_layers: vec![4, 4],
            tp: 2,
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            cost,
            workload: Workload {
                median_len: 1024.0,
                sigma: 1.2,
                capacity: 8192,
            },
            noise_sigma: 0.02,
            heartbeat_s: 10.0,
            episodes,
            fail_stop_fraction: 0.3,
            gap_s: (150.0, 330.0),
            slow_s: (60.0, 180.0),
            slow_speed: (0.3, 0.75),
            restart_s: 120.0,
            seed: 1,
        }
    }

    /// Logs of `job` (its dp, pp, tp, stage layers, micro-batches, schedule; the workload and
    /// costs of its `[resilience]` settings) with `episodes` faults from `seed`.
    pub fn from_job(
        job: &prism_core::job::Job,
        settings: &crate::scenario::ResilienceSettings,
        episodes: u32,
        seed: u64,
    ) -> Self {
        let schedule = match job.parallel.schedule {
            Schedule::GPipe => Schedule::GPipe,
            _ => Schedule::OneFOneB,
        };
        GenConfig {
            replicas: job.parallel.dp,
            stage_layers: job.stage_layers(),
            tp: job.parallel.tp,
            micro_batches: job.micro_batches() as u32,
            schedule,
            cost: LayerCost::from_job(job, settings.state_bytes_per_param),
            workload: settings.workload(job),
            seed,
            ..GenConfig::small(
                LayerCost::from_job(job, settings.state_bytes_per_param),
                episodes,
            )
        }
    }

    /// The name of unit (replica `r`, stage `s`).
    pub fn unit(r: u32, s: u32) -> String {
        format!("dp{r}.pp{s}")
    }
}

/// A generated log.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// Events in log order.
    pub events: Vec<LogEvent>,
    /// Injected episodes (detected_at = start).
    pub truth: Vec<Episode>,
    /// Length of the log, seconds.
    pub duration_s: f64,
    /// Iterations completed.
    pub iterations: u64,
}

/// Generates a log (module docs).
pub fn generate(cfg: &GenConfig, cluster: &Cluster) -> Result<Generated, HeteroError> {
    let p = cfg.stage_layers.len() as u32;
    let d = cfg.replicas;
    let mut rng = stream_rng(cfg.seed, &[0x0067_656E]);
    let noise =
        (cfg.noise_sigma > 0.0).then(|| LogNormal::new(0.0, cfg.noise_sigma).expect("sigma"));
    let base: Vec<Replica> = (0..d)
        .map(|r| Replica {
            stages: (0..p)
                .map(|s| Stage {
                    layers: cfg.stage_layers[s as usize],
                    devices: (0..cfg.tp)
                        .map(|i| Device::healthy((r * p + s) * cfg.tp + i))
                        .collect(),
                })
                .collect(),
            micro_batches: Vec::new(),
        })
        .collect();
    let units = (d * p) as usize;
    let mut next_hb: Vec<f64> = (0..units)
        .map(|u| cfg.heartbeat_s * (u as f64 + 0.5) / units as f64)
        .collect();
    let mut events = Vec::new();
    let mut truth = Vec::new();
    let mut t = 0.0f64;
    let mut it = 0u64;
    let mut injected = 0u32;
    let mut next_fault = t + uniform(&mut rng, cfg.gap_s.0, cfg.gap_s.1);
    // Active fail-slow: (unit, device index, speed, end time, truth index).
    let mut slow: Option<(usize, usize, f64, f64)> = None;
    let beat =
        |events: &mut Vec<LogEvent>, next_hb: &mut [f64], until: f64, dead: Option<usize>| {
            loop {
                let (u, &tm) = next_hb
                    .iter()
                    .enumerate()
                    .filter(|(u, _)| Some(*u) != dead)
                    .min_by(|a, b| a.1.total_cmp(b.1))
                    .expect("units");
                if tm > until {
                    break;
                }
                events.push(LogEvent::Heartbeat {
                    unit: GenConfig::unit(u as u32 / p, u as u32 % p),
                    time_s: tm,
                });
                next_hb[u] += cfg.heartbeat_s;
            }
        };
    loop {
        if let Some((_, _, _, end)) = slow
            && t >= end
        {
            let e: &mut Episode = truth.last_mut().expect("open episode");
            e.end_s = Some(t);
            slow = None;
            next_fault = t + uniform(&mut rng, cfg.gap_s.0, cfg.gap_s.1);
        }
        if slow.is_none() && t >= next_fault {
            if injected == cfg.episodes {
                break;
            }
            injected += 1;
            let u = rng.random_range(0..units);
            let name = GenConfig::unit(u as u32 / p, u as u32 % p);
            if rng.random::<f64>() < cfg.fail_stop_fraction {
                // Dies somewhere in the next iteration's span; the job hangs until restart.
                let fail = t + uniform(&mut rng, 0.0, 1.0);
                let back = fail + cfg.restart_s;
                beat(&mut events, &mut next_hb, fail, None);
                beat(&mut events, &mut next_hb, back, Some(u));
                next_hb[u] = back;
                truth.push(Episode {
                    kind: FaultKind::FailStop,
                    unit: Some(name),
                    start_s: fail,
                    end_s: Some(back),
                    detected_at_s: fail,
                });
                t = back;
                next_fault = t + uniform(&mut rng, cfg.gap_s.0, cfg.gap_s.1);
                continue;
            }
            let dev = rng.random_range(0..cfg.tp as usize);
            let speed = uniform(&mut rng, cfg.slow_speed.0, cfg.slow_speed.1);
            let len = uniform(&mut rng, cfg.slow_s.0, cfg.slow_s.1);
            slow = Some((u, dev, speed, t + len));
            truth.push(Episode {
                kind: FaultKind::FailSlow,
                unit: Some(name),
                start_s: t,
                end_s: None,
                detected_at_s: t,
            });
        }
        let mut reps = base.clone();
        for (r, rep) in reps.iter_mut().enumerate() {
            rep.micro_batches = cfg
                .workload
                .micro_batches(cfg.micro_batches as usize, &mut rng);
            for (s, st) in rep.stages.iter_mut().enumerate() {
                let u = r * p as usize + s;
                let f = noise.map(|n| n.sample(&mut rng)).unwrap_or(1.0);
                for (i, dv) in st.devices.iter_mut().enumerate() {
                    dv.speed /= f;
                    if let Some((su, sd, sp, _)) = slow
                        && su == u
                        && sd == i
                    {
                        dv.speed *= sp;
                    }
                }
            }
        }
        let pipe = HeteroPipeline {
            replicas: reps,
            schedule: cfg.schedule,
            cost: cfg.cost,
        };
        let res = simulate_hetero(&pipe, cluster, false)?;
        let end = t + res.iteration_s;
        beat(&mut events, &mut next_hb, end, None);
        for (r, rep) in pipe.replicas.iter().enumerate() {
            let tokens = rep.micro_batches.iter().map(|m| m.tokens).sum();
            let sq = rep.micro_batches.iter().map(|m| m.sum_sq_len).sum();
            for s in 0..p as usize {
                let (lo, hi, busy) = res.stage_spans[r][s];
                events.push(LogEvent::Step(StepRecord {
                    iteration: it,
                    unit: GenConfig::unit(r as u32, s as u32),
                    start_s: t + lo,
                    end_s: t + hi,
                    busy_s: Some(busy),
                    tokens,
                    sum_sq_len: sq,
                }));
            }
        }
        it += 1;
        t = end;
    }
    Ok(Generated {
        events,
        truth,
        duration_s: t,
        iterations: it,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{
        DetectorConfig, GreyhoundDetector, ResihpDetector, ThresholdDetector, run_detector, score,
    };
    use prism_core::job::fixtures::{h100_cluster, small_job};

    /// A short generated log: the workload-aware detector finds every injected episode at the
    /// right unit with no false alarm; the log is deterministic per seed.
    #[test]
    fn generated_faults_are_detected() {
        let job = small_job(1, 1, 1, 8);
        // A slow model (per-layer costs x 300) keeps the iteration count small: ~1 s iterations.
        let mut cost = LayerCost::from_job(&job, 16);
        cost.token_s *= 300.0;
        cost.sq_s *= 300.0;
        let mut cfg = GenConfig::small(cost, 12);
        cfg.gap_s = (40.0, 60.0);
        cfg.slow_s = (30.0, 50.0);
        cfg.restart_s = 60.0;
        cfg.workload.capacity = 4096;
        let cl = h100_cluster(1);
        let g = generate(&cfg, &cl).unwrap();
        assert_eq!(g.truth.len(), 12);
        assert!(g.iterations < 2000, "{}", g.iterations);
        assert_eq!(g, generate(&cfg, &cl).unwrap());
        let found = run_detector(
            &mut ResihpDetector::new(DetectorConfig::default()),
            &g.events,
        );
        for kind in [FaultKind::FailSlow, FaultKind::FailStop] {
            let s = score(&found, &g.truth, kind, g.duration_s, 60.0, true);
            assert_eq!(
                s.true_positives, s.episodes,
                "{s:?}\n{found:?}\n{:?}",
                g.truth
            );
            assert_eq!(s.detections, s.episodes, "{s:?}");
        }
        // The baselines run on the same log.
        let _ = run_detector(
            &mut ThresholdDetector::new(DetectorConfig::default()),
            &g.events,
        );
        let _ = run_detector(
            &mut GreyhoundDetector::new(DetectorConfig::default()),
            &g.events,
        );
    }
}
