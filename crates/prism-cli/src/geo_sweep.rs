//! `prism geo sweep`: ATLAS's speedup and BUBBLETEA's utilisation over WAN bandwidth, RTT,
//! datacenter count and model size ([`prism_geo::sweep`]).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_geo::plan::{Design, PlanOptions};
use prism_geo::sweep::{self, SweepModel, SweepOptions, SweepRow};

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// WAN capacities, Gb/s.
    #[arg(long, value_delimiter = ',', default_value = "10,25,100,400")]
    gbps: Vec<f64>,
    /// RTTs, ms.
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    rtt_ms: Vec<f64>,
    /// Datacenter counts.
    #[arg(long, value_delimiter = ',', default_value = "2,5")]
    dcs: Vec<u32>,
    /// Training models (preset names).
    #[arg(long, value_delimiter = ',', default_value = "llama3-8b,llama3-70b")]
    models: Vec<String>,
    /// Nodes (8 GPUs) per datacenter.
    #[arg(long, default_value_t = 32)]
    nodes_per_dc: u32,
    /// Tensor parallelism of training (ATLAS: GPUs per node).
    #[arg(long, default_value_t = 8)]
    tp: u32,
    /// Sequences per iteration.
    #[arg(long, default_value_t = 512)]
    global_batch: u32,
    /// TCP window per connection, MiB.
    #[arg(long, default_value_t = 16.0)]
    tcp_window_mib: f64,
    /// TCP connections per transfer.
    #[arg(long, default_value_t = 16)]
    connections: u32,
    /// Micro-batch sizes searched.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    micro_batches: Vec<u32>,
    /// Inference model of BUBBLETEA.
    #[arg(long, default_value = "llama3-8b")]
    inference_model: String,
    /// Inference TP.
    #[arg(long, default_value_t = 1)]
    inference_tp: u32,
    /// TTFT SLO, ms.
    #[arg(long, default_value_t = 2000.0)]
    slo_ms: f64,
    /// Write an SVG of ATLAS's speedup over DP across DCs.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Write an SVG of BUBBLETEA's GPU utilisation.
    #[arg(long, value_name = "FILE")]
    plot_util: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn template(preset: &str, nodes: u32, tp: u32, gb: u32) -> Result<prism_core::job::Job> {
    if tp == 0 || !(nodes * 8).is_multiple_of(tp) {
        bail!(
            "--tp {tp} must divide the {} GPUs of a datacenter",
            nodes * 8
        );
    }
    let text = format!(
        "[model]\npreset = \"{preset}\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = {nodes}\n\
         [parallel]\ntp = {tp}\npp = 1\ndp = {}\nmicro_batch = 1\nschedule = \"1f1b\"\n\
         recompute = \"none\"\n[training]\nglobal_batch = {gb}\n",
        nodes * 8 / tp
    );
    Ok(prism_io::jobfile::load_job_str(&text, &format!("--models {preset}"), None, &[])?.job)
}

fn f(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}x"))
}

pub fn run(a: &SweepArgs) -> Result<()> {
    let models = a
        .models
        .iter()
        .map(|m| {
            Ok(SweepModel {
                label: m.clone(),
                job: template(m, a.nodes_per_dc, a.tp, a.global_batch)?,
                nodes_per_dc: a.nodes_per_dc,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let o = SweepOptions {
        gbps: a.gbps.clone(),
        rtt_ms: a.rtt_ms.clone(),
        dcs: a.dcs.clone(),
        tcp_window_mib: a.tcp_window_mib,
        connections: a.connections,
        plan: PlanOptions {
            micro_batches: a.micro_batches.clone(),
            dc_order_search: false,
            ..Default::default()
        },
        inference: crate::geo_bubbles::model_preset(&a.inference_model)?,
        inference_tp: a.inference_tp,
        slo_s: a.slo_ms * 1e-3,
        guard_s: 0.005,
        iterations: 2,
        seed: 1,
    };
    o.validate().map_err(anyhow::Error::msg)?;
    if !a.json {
        outln!(
            "Prism geo sweep: ATLAS speedup (baseline iteration / ATLAS iteration) and BUBBLETEA utilisation"
        )?;
        outln!(
            "  {:<12} {:>3} {:>6} {:>5} {:>6} {:>9} {:>16} {:>9} {:>9} {:>9} {:>7} {:>13} {:>9}",
            "model",
            "DCs",
            "Gb/s",
            "RTT",
            "GPUs",
            "ATLAS s",
            "pp/dp/mb/GPUs",
            "vs DP",
            "vs PPfair",
            "vs 1conn",
            "WAN use",
            "util w/o->w",
            "slowdown"
        )?;
    }
    let json = a.json;
    let rows = sweep::sweep(&models, &o, |r: &SweepRow| {
        if json {
            return;
        }
        let lay = r
            .atlas_layout
            .map_or("-".into(), |(pp, dp, mb, g)| format!("{pp}/{dp}/{mb}/{g}"));
        let u = r.utilisation.map_or("-".into(), |(w, x, _)| {
            format!("{:.1}->{:.1}%", 100.0 * w, 100.0 * x)
        });
        println!(
            "  {:<12} {:>3} {:>6} {:>5} {:>6} {:>9} {:>16} {:>9} {:>9} {:>9} {:>6.1}% {:>13} {:>9}",
            r.model,
            r.dcs,
            r.gbps,
            r.rtt_ms,
            r.gpus,
            r.atlas_s.map_or("-".into(), |t| format!("{t:.3}")),
            lay,
            f(r.speedup(Design::DpAcrossDcs)),
            f(r.speedup(Design::PpFairSharing)),
            f(r.speedup(Design::OneConnection)),
            100.0 * r.wan_utilisation,
            u,
            r.utilisation.map_or("-".into(), |u| format!("{:.1e}", u.2)),
        );
    })?;
    if let Some(path) = &a.plot {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for m in &a.models {
            for &d in &a.dcs {
                for &rtt in &a.rtt_ms {
                    let p: Vec<(f64, f64)> = rows
                        .iter()
                        .filter(|r| &r.model == m && r.dcs == d && r.rtt_ms == rtt)
                        .filter_map(|r| r.speedup(Design::DpAcrossDcs).map(|s| (r.gbps, s)))
                        .collect();
                    series.push((format!("{m}, {d} DCs, RTT {rtt} ms"), p));
                }
            }
        }
        let svg = prism_io::geo::lines_svg(
            "ATLAS speedup over DP across DCs",
            "WAN capacity (Gb/s)",
            "speedup (x)",
            &series,
            true,
        )
        .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &a.plot_util {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for m in &a.models {
            for &d in &a.dcs {
                for &rtt in &a.rtt_ms {
                    for (with, name) in [(false, "without"), (true, "with")] {
                        let p: Vec<(f64, f64)> = rows
                            .iter()
                            .filter(|r| &r.model == m && r.dcs == d && r.rtt_ms == rtt)
                            .filter_map(|r| {
                                r.utilisation
                                    .map(|u| (r.gbps, 100.0 * if with { u.1 } else { u.0 }))
                            })
                            .collect();
                        series.push((format!("{m}, {d} DCs, {rtt} ms, {name} prefill"), p));
                    }
                }
            }
        }
        let svg = prism_io::geo::lines_svg(
            "GPU utilisation with ATLAS, without and with BUBBLETEA prefill",
            "WAN capacity (Gb/s)",
            "GPU utilisation (%)",
            &series,
            true,
        )
        .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&prism_io::geo::sweep_json(&rows))?
        )?;
        return Ok(());
    }
    // Where the paper's headline figures are (or are not) reached.
    let mut best: Option<(f64, &SweepRow, Design)> = None;
    for r in &rows {
        for d in [
            Design::DpAcrossDcs,
            Design::PpFairSharing,
            Design::OneConnection,
        ] {
            if let Some(s) = r.speedup(d)
                && best.is_none_or(|b| s > b.0)
            {
                best = Some((s, r, d));
            }
        }
    }
    if let Some((s, r, d)) = best {
        outln!(
            "\n  largest ATLAS speedup: {s:.2}x over {} ({}, {} DCs, {} Gb/s, RTT {} ms); paper: up to 17x",
            d.name(),
            r.model,
            r.dcs,
            r.gbps,
            r.rtt_ms
        )?;
    }
    if let Some(r) = rows
        .iter()
        .filter(|r| r.utilisation.is_some())
        .max_by(|a, b| {
            a.utilisation
                .unwrap()
                .1
                .total_cmp(&b.utilisation.unwrap().1)
        })
    {
        let u = r.utilisation.unwrap();
        outln!(
            "  largest GPU utilisation with BUBBLETEA: {:.1}% (from {:.1}%; {}, {} DCs, {} Gb/s, RTT {} ms); paper: up to 94%",
            100.0 * u.1,
            100.0 * u.0,
            r.model,
            r.dcs,
            r.gbps,
            r.rtt_ms
        )?;
    }
    let worst = rows
        .iter()
        .filter_map(|r| r.utilisation.map(|u| u.2))
        .fold(0.0f64, f64::max);
    outln!("  largest training slowdown from BUBBLETEA over all points: {worst:e}")?;
    Ok(())
}
