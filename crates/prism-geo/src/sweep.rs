//! `prism geo sweep`: ATLAS's speedup over each baseline and BUBBLETEA's GPU utilisation over a
//! grid of WAN bandwidths, RTTs, datacenter counts and model sizes. Every point is a full
//! `geo plan` (all designs searched and simulated) and a `geo bubbles` run on ATLAS's plan with
//! a request stream that offers about twice the idle GPU time as prefill work.

use prism_core::engine::SimError;
use prism_core::job::{Job, Model};
use prism_core::wan::{Wan, WanLink};

use crate::bubbles::{self, BubbleOptions, PrefillModel, PromptDist};
use crate::plan::{self, Design, PlanError, PlanOptions};

/// A model to sweep: a job template (its cluster's node count is the per-DC count, its
/// `[parallel]` tp the TP every design keeps) and a label.
#[derive(Clone, Debug)]
pub struct SweepModel {
    /// Label in the table.
    pub label: String,
    /// Template job.
    pub job: Job,
    /// Nodes per datacenter.
    pub nodes_per_dc: u32,
}

/// The grid and the BUBBLETEA settings.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    /// WAN capacities, Gb/s.
    pub gbps: Vec<f64>,
    /// RTTs, ms.
    pub rtt_ms: Vec<f64>,
    /// Datacenter counts.
    pub dcs: Vec<u32>,
    /// TCP window, MiB, and connections per transfer of every WAN link.
    pub tcp_window_mib: f64,
    /// Connections per transfer.
    pub connections: u32,
    /// Plan options (micro-batches searched etc.).
    pub plan: PlanOptions,
    /// Inference model and TP for BUBBLETEA.
    pub inference: Model,
    /// Inference TP.
    pub inference_tp: u32,
    /// TTFT SLO, s.
    pub slo_s: f64,
    /// Guard band, s.
    pub guard_s: f64,
    /// Iterations of arrivals per point.
    pub iterations: u32,
    /// Seed of the arrivals.
    pub seed: u64,
}

/// The most datacenters a sweep point may have (the `[wan]` section's limit).
pub const MAX_SWEEP_DCS: u32 = 64;

impl SweepOptions {
    /// Checks the grid: WAN capacities positive and finite, RTTs finite and not negative,
    /// datacenter counts in `2..=MAX_SWEEP_DCS`, a positive TCP window, at least one
    /// connection, a positive SLO. The message names the option (as `prism geo sweep`'s flag).
    pub fn validate(&self) -> Result<(), String> {
        let bad =
            |what: &str, rule: &str, got: String| Err(format!("--{what}: {rule} (got {got})"));
        if self.gbps.is_empty() || self.rtt_ms.is_empty() || self.dcs.is_empty() {
            return Err("--gbps, --rtt-ms and --dcs each need at least one value".into());
        }
        if let Some(g) = self.gbps.iter().find(|g| !(g.is_finite() && **g > 0.0)) {
            return bad(
                "gbps",
                "every WAN capacity must be a positive number of Gb/s",
                g.to_string(),
            );
        }
        if let Some(r) = self.rtt_ms.iter().find(|r| !(r.is_finite() && **r >= 0.0)) {
            return bad(
                "rtt-ms",
                "every RTT must be a finite number of ms, at least 0",
                r.to_string(),
            );
        }
        if let Some(d) = self.dcs.iter().find(|d| !(2..=MAX_SWEEP_DCS).contains(*d)) {
            return bad(
                "dcs",
                &format!("every datacenter count must be from 2 to {MAX_SWEEP_DCS}"),
                d.to_string(),
            );
        }
        if !(self.tcp_window_mib.is_finite() && self.tcp_window_mib > 0.0) {
            return bad(
                "tcp-window-mib",
                "must be a positive number of MiB",
                self.tcp_window_mib.to_string(),
            );
        }
        if self.connections == 0 {
            return bad("connections", "must be at least 1", "0".into());
        }
        if !(self.slo_s.is_finite() && self.slo_s > 0.0) {
            return bad(
                "slo-ms",
                "must be a positive number of ms",
                (self.slo_s * 1e3).to_string(),
            );
        }
        Ok(())
    }
}

/// One point of the sweep.
#[derive(Clone, Debug)]
pub struct SweepRow {
    /// Model label.
    pub model: String,
    /// Datacenters.
    pub dcs: u32,
    /// WAN Gb/s.
    pub gbps: f64,
    /// RTT, ms.
    pub rtt_ms: f64,
    /// GPUs available.
    pub gpus: u64,
    /// ATLAS's iteration, s (None when no placement fits).
    pub atlas_s: Option<f64>,
    /// ATLAS's placement: (pp, dp, micro-batch, GPUs used).
    pub atlas_layout: Option<(u32, u32, u32, u64)>,
    /// Each baseline's iteration, s.
    pub baselines: Vec<(Design, f64)>,
    /// ATLAS's WAN utilisation.
    pub wan_utilisation: f64,
    /// BUBBLETEA: utilisation without and with prefill, and the training slowdown measured.
    pub utilisation: Option<(f64, f64, f64)>,
}

impl SweepRow {
    /// ATLAS's speedup over `d`.
    pub fn speedup(&self, d: Design) -> Option<f64> {
        let a = self.atlas_s?;
        self.baselines
            .iter()
            .find(|(x, _)| *x == d)
            .map(|(_, t)| t / a)
    }
}

fn scenario(m: &SweepModel, dcs: u32, gbps: f64, rtt: f64, o: &SweepOptions) -> Job {
    let mut job = m.job.clone();
    job.cluster.nodes = m.nodes_per_dc * dcs;
    let link = WanLink {
        a: 0,
        b: 1,
        gbps,
        rtt_ms: rtt,
        tcp_window_mib: o.tcp_window_mib,
        connections: o.connections,
    };
    job.cluster.topology.wan = Wan::full_mesh(&vec![m.nodes_per_dc; dcs as usize], &link);
    job.name = format!("{} x {dcs} DCs, {gbps} Gb/s, {rtt} ms", m.label);
    job
}

/// Runs the sweep; `progress` hears each finished point.
pub fn sweep(
    models: &[SweepModel],
    o: &SweepOptions,
    mut progress: impl FnMut(&SweepRow),
) -> Result<Vec<SweepRow>, SimError> {
    let mut rows = Vec::new();
    for m in models {
        // The prefill model depends only on the GPU and the inference model.
        let prefill = PrefillModel::new(&m.job, &o.inference, o.inference_tp, 8192)?;
        for &dcs in &o.dcs {
            for &rtt in &o.rtt_ms {
                for &gbps in &o.gbps {
                    let job = scenario(m, dcs, gbps, rtt, o);
                    let mut row = SweepRow {
                        model: m.label.clone(),
                        dcs,
                        gbps,
                        rtt_ms: rtt,
                        gpus: job.num_gpus(),
                        atlas_s: None,
                        atlas_layout: None,
                        baselines: Vec::new(),
                        wan_utilisation: 0.0,
                        utilisation: None,
                    };
                    match plan::plan(&job, &o.plan) {
                        Ok(p) => {
                            row.atlas_s = Some(p.atlas.iteration_s);
                            let pl = &p.atlas.placement;
                            row.atlas_layout = Some((pl.pp, pl.dp, pl.micro_batch, p.atlas.gpus()));
                            row.wan_utilisation = p.atlas.wan_utilisation();
                            row.baselines = p
                                .baselines
                                .iter()
                                .map(|b| (b.design, b.iteration_s))
                                .collect();
                            row.utilisation = Some(bubble_point(&p.atlas.job, o, &prefill)?);
                        }
                        Err(PlanError::Sim(e)) => return Err(e),
                        Err(_) => {}
                    }
                    progress(&row);
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

/// Most requests one sweep point offers.
pub const MAX_REQUESTS: f64 = 150_000.0;

/// BUBBLETEA on `job`: Poisson arrivals offering about twice the schedule's idle GPU time as
/// prefill work (log-normal prompts, median 1024 tokens; at most [`MAX_REQUESTS`]), over
/// `o.iterations` iterations.
fn bubble_point(
    job: &Job,
    o: &SweepOptions,
    prefill: &PrefillModel,
) -> Result<(f64, f64, f64), SimError> {
    let sched = bubbles::training_schedule(job)?;
    let t = sched.iteration_ps as f64 * 1e-12;
    let busy: f64 =
        sched.busy_ps.iter().map(|&b| b as f64 * 1e-12).sum::<f64>() / (job.parallel.pp as f64 * t);
    let idle_gpu_s = (1.0 - busy) * job.num_gpus() as f64;
    let per_request = prefill.seconds(1024) * o.inference_tp as f64;
    // Twice the idle time as prefill work, at most MAX_REQUESTS requests over the horizon.
    let rate = (2.0 * idle_gpu_s / per_request)
        .min(MAX_REQUESTS / (t * o.iterations.max(1) as f64))
        .max(1.0);
    let prompts = PromptDist::LogNormal {
        median: 1024.0,
        sigma: 0.8,
        max: 8192,
    };
    let reqs = bubbles::poisson_requests(rate, t * o.iterations as f64, prompts, o.seed);
    let r = bubbles::bubbles_with(
        job,
        &reqs,
        &BubbleOptions {
            model: o.inference.clone(),
            tp: o.inference_tp,
            slo_s: o.slo_s,
            guard_s: o.guard_s,
        },
        prefill.clone(),
    )?;
    Ok((
        r.utilisation_without,
        r.utilisation_with,
        r.training_slowdown,
    ))
}
