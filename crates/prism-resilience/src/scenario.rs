//! Hours of training with faults: detection, adaptation and the throughput that results, for
//! ResiHP, every baseline and the oracle.
//!
//! A [`Scenario`] lists faults: a device turning slow for a while, or failing until it is
//! replaced. Each fault is *known* to the scheduler a detection delay after it happens
//! (`detect_fail_slow_s`, `detect_fail_stop_s`, the same for every policy so the comparison
//! isolates adaptation); its end (the slowdown passing, the replacement arriving) is known
//! after the fail-slow delay or at once. At every change of what is known, each policy picks a
//! plan ([`crate::plan::adapt`], planning over `horizon_s`), pays its pause (reconfiguration,
//! or restart and lost progress), then runs at the engine's throughput of that plan on the
//! *true* devices (a plan that uses a dead device makes no progress). The result is a
//! throughput timeline per policy, tokens, goodput (tokens over the healthy job's tokens in the
//! same time) and mean throughput.

use prism_core::hetero::{LayerCost, MicroBatch, ReconfigCost};
use prism_core::job::Job;

use crate::detect::FaultKind;
use crate::plan::{Fleet, Plan, Setup, Strategy, adapt, throughput};
use crate::workload::Workload;

/// The job's `[resilience]` settings (documented in `docs/job-format.md`).
#[derive(Clone, Debug, PartialEq)]
pub struct ResilienceSettings {
    /// Median packed-document length, tokens (`None`: a quarter of the sequence length).
    pub seq_len_median: Option<f64>,
    /// Log-normal sigma of document lengths.
    pub seq_len_sigma: f64,
    /// Training state bytes per parameter.
    pub state_bytes_per_param: u64,
    /// In-place restart after a reconfiguration, seconds.
    pub restart_s: f64,
    /// Checkpoint restart, seconds.
    pub checkpoint_restart_s: f64,
    /// Checkpoint interval, seconds.
    pub checkpoint_interval_s: f64,
    /// Tensor-parallel degree of each pipeline stage (`None`: `parallel.tp` everywhere).
    pub stage_tp: Option<Vec<u32>>,
    /// Usable fraction of device memory.
    pub memory_fraction: f64,
}

impl Default for ResilienceSettings {
    fn default() -> Self {
        ResilienceSettings {
            seq_len_median: None,
            seq_len_sigma: 1.0,
            state_bytes_per_param: 16,
            restart_s: 30.0,
            checkpoint_restart_s: 600.0,
            checkpoint_interval_s: 1800.0,
            stage_tp: None,
            memory_fraction: 0.9,
        }
    }
}

impl ResilienceSettings {
    /// The packed-sequence workload of `job`: documents up to a micro-batch's tokens.
    pub fn workload(&self, job: &Job) -> Workload {
        let seq = job.model.seq_len as f64;
        Workload {
            median_len: self.seq_len_median.unwrap_or(seq / 4.0),
            sigma: self.seq_len_sigma,
            capacity: job.model.seq_len as u64 * job.parallel.micro_batch as u64,
        }
    }

    /// The planning setup of `job` (its tp, pp, dp, layers, micro-batches; the mean packed
    /// micro-batch of the workload; activations per Korthikanti et al. with sequence
    /// parallelism: 34 h bytes per token per layer).
    pub fn setup(&self, job: &Job) -> Setup {
        let p = &job.parallel;
        let stage_tp = self
            .stage_tp
            .clone()
            .unwrap_or_else(|| vec![p.tp; p.pp as usize]);
        Setup {
            cluster: job.cluster.clone(),
            cost: LayerCost::from_job(job, self.state_bytes_per_param),
            schedule: job.parallel.schedule,
            replicas: p.dp,
            stages: p.pp,
            stage_tp,
            stage_layers: job.stage_layers(),
            layers: job.model.layers,
            heads: job.model.heads,
            micro_batches: (job.micro_batches() * p.dp as u64) as u32,
            micro_batch: self.workload(job).mean_micro_batch(1, 2000),
            hbm_bytes: job.cluster.gpu.hbm_gib * (1u64 << 30) as f64 * self.memory_fraction,
            act_bytes_per_token_layer: 34.0 * job.model.hidden as f64,
            reconfig: ReconfigCost {
                restart_s: self.restart_s,
                checkpoint_restart_s: self.checkpoint_restart_s,
            },
            checkpoint_interval_s: self.checkpoint_interval_s,
        }
    }
}

/// One injected fault.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// Kind.
    pub kind: FaultKind,
    /// Onset, seconds from the start.
    pub at_s: f64,
    /// Global device id.
    pub device: u32,
    /// Speed while slow (fail-slow only).
    pub speed: f64,
    /// Fail-slow: how long it lasts; fail-stop: until the device is replaced, seconds.
    pub duration_s: f64,
}

/// A scenario (documented in `docs/resilience.md`).
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// Name.
    pub name: String,
    /// Training time simulated, seconds.
    pub duration_s: f64,
    /// Planning horizon of a decision, seconds.
    pub horizon_s: f64,
    /// Delay until a fail-slow onset or end is known, seconds.
    pub detect_fail_slow_s: f64,
    /// Delay until a fail-stop is known, seconds.
    pub detect_fail_stop_s: f64,
    /// Faults.
    pub faults: Vec<Fault>,
}

/// One policy's run through a scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Policy.
    pub strategy: Strategy,
    /// Constant-throughput segments: (start s, end s, tokens/s).
    pub segments: Vec<(f64, f64, f64)>,
    /// Tokens trained.
    pub tokens: f64,
    /// Mean tokens per second.
    pub mean_tokens_per_s: f64,
    /// Tokens over the healthy job's tokens in the same time.
    pub goodput: f64,
    /// Plan changes.
    pub reconfigurations: u32,
    /// Seconds paused (reconfiguration, restarts, lost progress).
    pub paused_s: f64,
}

/// A scenario's result.
#[derive(Clone, Debug, PartialEq)]
pub struct ScenarioResult {
    /// Healthy throughput, tokens/s.
    pub healthy_tokens_per_s: f64,
    /// One timeline per policy ([`Strategy::ALL`] order).
    pub timelines: Vec<Timeline>,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    /// The true state changes: device, (speed, failed).
    Truth(u32, f64, bool),
    /// The scheduler learns the state of device: (speed, failed).
    Known(u32, f64, bool),
}

/// Why a scenario does not fit its job.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScenarioError(pub String);

/// Runs every policy through the scenario.
pub fn run(s: &Setup, sc: &Scenario) -> Result<ScenarioResult, ScenarioError> {
    let n = s.devices();
    for (i, f) in sc.faults.iter().enumerate() {
        if f.device >= n {
            return Err(ScenarioError(format!(
                "fault {} names device {}, the job has {n} devices (0..{})",
                i + 1,
                f.device,
                n - 1
            )));
        }
    }
    let mut ev: Vec<(f64, usize, Action)> = Vec::new();
    for f in &sc.faults {
        match f.kind {
            FaultKind::FailSlow => {
                ev.push((f.at_s, ev.len(), Action::Truth(f.device, f.speed, false)));
                ev.push((
                    f.at_s + sc.detect_fail_slow_s,
                    ev.len(),
                    Action::Known(f.device, f.speed, false),
                ));
                let end = f.at_s + f.duration_s;
                ev.push((end, ev.len(), Action::Truth(f.device, 1.0, false)));
                ev.push((
                    end + sc.detect_fail_slow_s,
                    ev.len(),
                    Action::Known(f.device, 1.0, false),
                ));
            }
            FaultKind::FailStop => {
                ev.push((f.at_s, ev.len(), Action::Truth(f.device, 1.0, true)));
                ev.push((
                    f.at_s + sc.detect_fail_stop_s,
                    ev.len(),
                    Action::Known(f.device, 1.0, true),
                ));
                let end = f.at_s + f.duration_s;
                ev.push((end, ev.len(), Action::Truth(f.device, 1.0, false)));
                ev.push((end, ev.len(), Action::Known(f.device, 1.0, false)));
            }
        }
    }
    ev.retain(|e| e.0 < sc.duration_s);
    ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let init = Plan::initial(s);
    let healthy = throughput(&init, &Fleet::healthy(s), s);
    let mut timelines = Vec::new();
    for st in Strategy::ALL {
        let (mut truth, mut known) = (Fleet::healthy(s), Fleet::healthy(s));
        let mut plan = init.clone();
        let mut tps = healthy;
        let (mut t, mut pause_until) = (0.0f64, 0.0f64);
        let mut segs: Vec<(f64, f64, f64)> = Vec::new();
        let (mut reconfigs, mut paused) = (0u32, 0.0f64);
        let push = |segs: &mut Vec<(f64, f64, f64)>, a: f64, b: f64, v: f64| {
            if b <= a {
                return;
            }
            match segs.last_mut() {
                Some(l) if l.2 == v && l.1 == a => l.1 = b,
                _ => segs.push((a, b, v)),
            }
        };
        let bounds = ev
            .iter()
            .map(|e| (e.0, Some(e.2)))
            .chain([(sc.duration_s, None)]);
        for (b, action) in bounds {
            if pause_until > t {
                let pe = pause_until.min(b);
                push(&mut segs, t, pe, 0.0);
                t = pe;
            }
            push(&mut segs, t, b, tps);
            t = t.max(b);
            let Some(action) = action else { break };
            match action {
                Action::Truth(d, speed, failed) => {
                    let dv = truth.device_mut(d).expect("checked");
                    dv.speed = speed;
                    dv.failed = failed;
                }
                Action::Known(d, speed, failed) => {
                    let dv = known.device_mut(d).expect("checked");
                    dv.speed = speed;
                    dv.failed = failed;
                    let dec = adapt(st, &plan, &known, s, sc.horizon_s);
                    if dec.plan != plan || dec.pause_s > 0.0 {
                        reconfigs += u32::from(dec.plan != plan);
                        paused += dec.pause_s.min(sc.duration_s - t);
                        pause_until = t + dec.pause_s;
                        plan = dec.plan;
                    }
                }
            }
            tps = throughput(&plan, &truth, s);
        }
        let tokens: f64 = segs.iter().map(|(a, b, v)| (b - a) * v).sum();
        timelines.push(Timeline {
            strategy: st,
            tokens,
            mean_tokens_per_s: tokens / sc.duration_s,
            goodput: tokens / (healthy * sc.duration_s),
            segments: segs,
            reconfigurations: reconfigs,
            paused_s: paused,
        });
    }
    Ok(ScenarioResult {
        healthy_tokens_per_s: healthy,
        timelines,
    })
}

/// The planning micro-batch of a workload (exposed for reports).
pub fn planning_micro_batch(w: &Workload) -> MicroBatch {
    w.mean_micro_batch(1, 2000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fail-slow and a fail-stop on a small job: tokens add up over the segments, ResiHP is
    /// no worse than any baseline, the oracle no worse than ResiHP, and a policy that never
    /// adapts to a fail-stop would make no progress until the repair (checkpoint restart does).
    #[test]
    fn scenario_timelines() {
        let s = crate::plan::tests::setup();
        let sc = Scenario {
            name: "t".into(),
            duration_s: 4.0 * 3600.0,
            horizon_s: 1800.0,
            detect_fail_slow_s: 20.0,
            detect_fail_stop_s: 30.0,
            faults: vec![
                Fault {
                    kind: FaultKind::FailSlow,
                    at_s: 600.0,
                    device: 17,
                    speed: 0.3,
                    duration_s: 3600.0,
                },
                Fault {
                    kind: FaultKind::FailStop,
                    at_s: 7200.0,
                    device: 30,
                    speed: 1.0,
                    duration_s: 3600.0,
                },
            ],
        };
        let r = run(&s, &sc).unwrap();
        assert_eq!(r.timelines.len(), Strategy::ALL.len());
        let get = |st: Strategy| r.timelines.iter().find(|t| t.strategy == st).unwrap();
        for tl in &r.timelines {
            let sum: f64 = tl.segments.iter().map(|(a, b, v)| (b - a) * v).sum();
            assert!((sum - tl.tokens).abs() < 1e-6 * tl.tokens);
            assert!(
                tl.goodput > 0.0 && tl.goodput < 1.0,
                "{:?} {}",
                tl.strategy,
                tl.goodput
            );
            assert_eq!(tl.segments.last().unwrap().1, sc.duration_s);
        }
        let res = get(Strategy::Resihp).tokens;
        for st in Strategy::ALL {
            if st != Strategy::Oracle {
                assert!(
                    res >= get(st).tokens * 0.999,
                    "{st:?}: {} vs {res}",
                    get(st).tokens
                );
            }
        }
        assert!(get(Strategy::Oracle).tokens >= res * 0.98);
        let bad = Scenario {
            faults: vec![Fault {
                kind: FaultKind::FailStop,
                at_s: 1.0,
                device: 999,
                speed: 1.0,
                duration_s: 1.0,
            }],
            ..sc
        };
        assert!(run(&s, &bad).unwrap_err().0.contains("device 999"));
    }
}
