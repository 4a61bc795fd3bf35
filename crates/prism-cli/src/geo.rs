//! `prism geo`: training across datacenters. `plan` (ATLAS placement and temporal WAN sharing
//! against baselines), `bubbles` (BUBBLETEA prefill in the pipeline bubbles), `sweep` (scenario
//! sweep). The work is [`prism_geo`]; this module parses, calls and prints.

use std::path::PathBuf;

use anyhow::{Context, Result};
use prism_core::job::Job;
use prism_geo::plan::{self, Design, PlanOptions};

/// `prism geo` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum GeoCommand {
    /// ATLAS: place pipeline stages across datacenters (DP and TP inside one), share WAN links
    /// in turns, several TCP connections per transfer; compare with the baselines.
    Plan(PlanArgs),
    /// BUBBLETEA: admit inference prefill into the pipeline bubbles without slowing training.
    Bubbles(BubblesArgs),
    /// Sweep WAN bandwidth, RTT, datacenter count and model size: ATLAS's speedup and
    /// BUBBLETEA's utilisation.
    Sweep(SweepArgs),
}

#[derive(Debug, clap::Args)]
pub struct JobArgs {
    /// Job file with a `[wan]` section (docs/job-format.md).
    pub job: PathBuf,
    /// Override a job key, e.g. `--set wan.link_gbps=100` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
}

impl JobArgs {
    pub fn load(&self) -> Result<Job> {
        Ok(prism_io::jobfile::load_job_file(&self.job, &self.sets)?.job)
    }
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    job: JobArgs,
    /// ATLAS without temporal sharing (WAN links shared max-min fairly).
    #[arg(long)]
    no_temporal: bool,
    /// ATLAS with one TCP connection per transfer.
    #[arg(long)]
    single_connection: bool,
    /// ATLAS with the largest-first DC order only (no search over DC orders).
    #[arg(long)]
    no_dc_order_search: bool,
    /// Micro-batch sizes searched (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    micro_batches: Vec<u32>,
    /// Iterations of the training run (training time = iterations x iteration time).
    #[arg(long, default_value_t = 10_000)]
    iterations: u64,
    /// Skip the baselines.
    #[arg(long)]
    no_baselines: bool,
    /// Every design uses at least this many datacenters.
    #[arg(long, default_value_t = 2)]
    min_dcs: u32,
    /// Write an SVG timeline of the WAN links' use in ATLAS's iteration.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub use crate::geo_bubbles::BubblesArgs;
pub use crate::geo_sweep::SweepArgs;

pub fn run(cmd: &GeoCommand) -> Result<()> {
    match cmd {
        GeoCommand::Plan(a) => run_plan(a),
        GeoCommand::Bubbles(a) => crate::geo_bubbles::run(a),
        GeoCommand::Sweep(a) => crate::geo_sweep::run(a),
    }
}

fn write_svg(path: &PathBuf, svg: Result<String, String>) -> Result<()> {
    let svg = svg.map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))
}

fn hours(s: f64) -> String {
    if s >= 3600.0 * 48.0 {
        format!("{:.1} days", s / 86400.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn run_plan(a: &PlanArgs) -> Result<()> {
    let job = a.job.load()?;
    let opts = PlanOptions {
        temporal: !a.no_temporal,
        multi_connection: !a.single_connection,
        dc_order_search: !a.no_dc_order_search,
        micro_batches: a.micro_batches.clone(),
        iterations: a.iterations,
        baselines: !a.no_baselines,
        min_dcs: a.min_dcs,
    };
    let p = plan::plan(&job, &opts)?;
    if let Some(path) = &a.plot {
        let rows = prism_io::geo::wan_timeline_rows(&p.atlas);
        write_svg(
            path,
            prism_io::geo::timeline_svg(
                &format!(
                    "WAN link use, ATLAS plan of {} (bar height: rate / capacity)",
                    job.name
                ),
                &rows,
                p.atlas.iteration_s,
                &["one direction", "other direction"],
            ),
        )?;
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&prism_io::geo::plan_json(&p))?
        )?;
        return Ok(());
    }
    outln!("Prism geo plan: {}", job.name)?;
    let w = &job.cluster.topology.wan;
    let dcs: Vec<String> = w
        .datacenters
        .iter()
        .map(|d| format!("{} ({} GPUs)", d.name, d.nodes * job.cluster.gpus_per_node))
        .collect();
    outln!("  datacenters: {}", dcs.join(", "))?;
    for l in &w.links {
        outln!(
            "  WAN {} - {}: {} Gb/s, RTT {} ms, window {} MiB x {} connections (cap {:.2} GB/s per transfer)",
            w.datacenters[l.a as usize].name,
            w.datacenters[l.b as usize].name,
            l.gbps,
            l.rtt_ms,
            l.tcp_window_mib,
            l.connections,
            l.transfer_cap() as f64 / 1e9
        )?;
    }
    outln!(
        "  {} candidates simulated; training run of {} iterations\n",
        p.simulated,
        opts.iterations
    )?;
    outln!(
        "  {:<22} {:>6} {:>4} {:>5} {:>3} {:>7}  {:<22} {:>10} {:>12} {:>6} {:>7} {:>7} {:>8}",
        "design",
        "GPUs",
        "pp",
        "dp",
        "mb",
        "recomp",
        "stages|pipes per DC",
        "iter (s)",
        "training",
        "MFU",
        "bubble",
        "WAN use",
        "speedup"
    )?;
    let mut all = vec![&p.atlas];
    all.extend(p.baselines.iter());
    for e in all {
        let per: Vec<String> = e.placement.per_dc.iter().map(|k| k.to_string()).collect();
        let speed = if e.design == Design::Atlas {
            "-".to_string()
        } else {
            format!("{:.2}x", e.iteration_s / p.atlas.iteration_s)
        };
        outln!(
            "  {:<22} {:>6} {:>4} {:>5} {:>3} {:>7}  {:<22} {:>10.3} {:>12} {:>5.1}% {:>6.1}% {:>6.1}% {:>8}",
            e.design.name(),
            e.gpus(),
            e.placement.pp,
            e.placement.dp,
            e.placement.micro_batch,
            if e.placement.recompute_full {
                "full"
            } else {
                "as job"
            },
            per.join("+"),
            e.iteration_s,
            hours(e.iteration_s * opts.iterations as f64),
            100.0 * e.mfu,
            100.0 * e.bubble_fraction,
            100.0 * e.wan_utilisation(),
            speed
        )?;
    }
    outln!(
        "\n  speedup = baseline iteration time / ATLAS iteration time (same global batch). \
         ATLAS: temporal sharing {}, multi-connection {}, DC order search {}.",
        opts.temporal,
        opts.multi_connection,
        opts.dc_order_search
    )?;
    Ok(())
}
