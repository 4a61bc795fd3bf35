//! `prism resilience JOB --scenario FILE`: hours of training with faults; ResiHP's joint
//! adaptation against every baseline and the oracle, on the engine.

use std::path::PathBuf;

use std::io::Write;

use anyhow::{Context, Result};
use prism_resilience::plan::Strategy;

#[derive(Debug, clap::Args)]
pub struct ResilienceArgs {
    /// Job file (TOML, see docs/job-format.md; `[resilience]` keys optional).
    job: PathBuf,
    /// Scenario file (TOML, see docs/resilience.md).
    #[arg(long, value_name = "FILE")]
    scenario: PathBuf,
    /// Override a job key (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Write the throughput timelines as SVG here.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: &ResilienceArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let loaded = prism_io::jobfile::load_job_file(&a.job, &a.sets)?;
    let text = prism_io::resilience::read_file(&a.scenario)?;
    let sc = prism_io::resilience::parse_scenario(&text, &a.scenario.display().to_string())?;
    let setup = loaded.resilience.setup(&loaded.job);
    let r = prism_resilience::scenario::run(&setup, &sc)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.scenario.display()))?;
    if let Some(p) = &a.plot {
        let svg = prism_io::resilience::timeline_svg(
            &format!("{}: throughput under faults", sc.name),
            &r,
        )
        .map_err(|e| anyhow::anyhow!("cannot draw the plot: {e}"))?;
        std::fs::write(p, svg).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&prism_io::resilience::scenario_json(&sc, &r))?
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{} on {} ({} GPUs: dp {} x pp {} x tp {}), scenario {}: {:.1} h, {} faults",
        loaded.job.model.name,
        loaded.job.cluster.name,
        setup.devices(),
        setup.replicas,
        setup.stages,
        if setup.stage_tp.windows(2).all(|w| w[0] == w[1]) {
            setup.stage_tp[0].to_string()
        } else {
            format!(
                "({})",
                setup
                    .stage_tp
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        },
        sc.name,
        sc.duration_s / 3600.0,
        sc.faults.len()
    )?;
    writeln!(
        out,
        "  healthy: {:.0} tokens/s (planning micro-batch: {} tokens, sum len^2 {:.3e})",
        r.healthy_tokens_per_s, setup.micro_batch.tokens, setup.micro_batch.sum_sq_len as f64
    )?;
    let resihp = r.timelines[0].tokens;
    writeln!(
        out,
        "  {:<20} {:>14} {:>12} {:>9} {:>14} {:>9} {:>10}",
        "policy", "tokens", "tokens/s", "goodput", "ResiHP x", "reconfigs", "paused s"
    )?;
    for t in &r.timelines {
        writeln!(
            out,
            "  {:<20} {:>14.4e} {:>12.0} {:>8.2}% {:>14.3} {:>9} {:>10.0}",
            t.strategy.name(),
            t.tokens,
            t.mean_tokens_per_s,
            100.0 * t.goodput,
            if t.tokens > 0.0 {
                resihp / t.tokens
            } else {
                f64::INFINITY
            },
            t.reconfigurations,
            t.paused_s
        )?;
    }
    if let Some(o) = r.timelines.iter().find(|t| t.strategy == Strategy::Oracle) {
        writeln!(
            out,
            "  gap to the oracle: {:.2}% of the oracle's tokens",
            100.0 * (1.0 - resihp / o.tokens.max(f64::MIN_POSITIVE))
        )?;
    }
    if let Some(p) = &a.plot {
        writeln!(out, "  wrote {}", p.display())?;
    }
    Ok(())
}
