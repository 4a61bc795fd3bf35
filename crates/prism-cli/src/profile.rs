//! `prism profile import`: a PyTorch profiler (Kineto) trace -> measured kernel-time table.

use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(Debug, clap::Subcommand)]
pub enum ProfileCommand {
    /// Read a Kineto trace: per-class kernel totals, and a kernel-time table (CSV) the cost
    /// model accepts (`[cost] kernel_table = "..."` in a job file).
    Import(ImportArgs),
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// PyTorch profiler trace (Chrome JSON written by Kineto).
    trace: PathBuf,
    /// Write the kernel-time table here (CSV).
    #[arg(long, short, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Data type the kernels ran in (bf16 or fp8; fp16 traces count as bf16).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: &ProfileCommand) -> Result<()> {
    let ProfileCommand::Import(a) = cmd;
    let trace = prism_io::kineto::read_kineto(&a.trace)?;
    let totals = prism_io::kineto::class_totals(&trace);
    let all: f64 = totals.values().map(|v| v.1).sum();
    let table = prism_io::kineto::to_kernel_table(&trace, &a.dtype);
    if let Some(out) = &a.out {
        std::fs::write(out, prism_io::kernel_table::write_kernel_table(&table))
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if a.json {
        let v = serde_json::json!({
            "device": trace.device,
            "step_s": trace.step_s,
            "kernels": trace.kernels.len(),
            "kernel_time_s": all,
            "classes": totals.iter().map(|(k, (n, s))| serde_json::json!({"class": k, "count": n, "seconds": s})).collect::<Vec<_>>(),
            "table_rows": table.len(),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!(
            "{}: {} kernels, {:.3} ms kernel time{}{}",
            a.trace.display(),
            trace.kernels.len(),
            all * 1e3,
            trace
                .device
                .as_deref()
                .map(|d| format!(", device {d}"))
                .unwrap_or_default(),
            trace
                .step_s
                .map(|s| format!(", step {:.1} ms", s * 1e3))
                .unwrap_or_default()
        )?;
        outln!(
            "  {:<22} {:>8} {:>12} {:>7}",
            "class",
            "kernels",
            "ms",
            "share"
        )?;
        for (k, (n, s)) in &totals {
            outln!(
                "  {k:<22} {n:>8} {:>12.3} {:>6.1}%",
                s * 1e3,
                100.0 * s / all.max(f64::MIN_POSITIVE)
            )?;
        }
        if let Some(out) = &a.out {
            outln!("  wrote {} table rows to {}", table.len(), out.display())?;
        }
    }
    Ok(())
}
