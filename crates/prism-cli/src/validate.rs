//! `prism validate`: simulate every published run in a case file and show the error.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::engine::SimOptions;
use prism_io::validation::{self, Case, CaseResult};

/// The eight Korthikanti et al. 2022 Table 5 runs on which Calculon (Isaev et al. 2023) reports
/// 3.65% mean and 8.87% max iteration-time error.
pub const CALCULON_ROWS: [&str; 8] = [
    "kor22_1_present",
    "kor22_1_fullrecomp",
    "kor22_2_present",
    "kor22_2_fullrecomp",
    "kor22_3_present",
    "kor22_3_fullrecomp",
    "kor22_4_present",
    "kor22_4_fullrecomp",
];
/// Calculon's published errors on those rows, percent.
pub const CALCULON_MEAN_PCT: f64 = 3.65;
/// Calculon's published maximum error on those rows, percent.
pub const CALCULON_MAX_PCT: f64 = 8.87;

/// The case file shipped in the repository, embedded so `prism validate` works anywhere.
pub const EMBEDDED_CASES: &str = include_str!("../../../validation/cases.csv");

#[derive(Debug, clap::Args)]
pub struct ValidateArgs {
    /// Case file (CSV, see validation/README.md); default: the embedded validation/cases.csv.
    path: Option<PathBuf>,
    /// Print one JSON object (with `mape`, percent) instead of tables.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of predicted vs published with the y = x line.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Write the per-case table, the per-source errors and a link to the plot as Markdown
    /// (docs/validation.md is made with `--markdown docs/validation.md --plot docs/validation.svg`).
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Only cases whose id contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// Print the job file of one case and exit.
    #[arg(long, value_name = "ID")]
    show: Option<String>,
}

pub fn load_cases(path: Option<&PathBuf>) -> Result<Vec<Case>> {
    Ok(match path {
        Some(p) => validation::read_cases(p)?,
        None => validation::parse_cases(EMBEDDED_CASES, "<embedded validation/cases.csv>")?,
    })
}

/// Runs every modelled case (in parallel), in case-file order.
pub fn run_all(cases: &[Case], opts: &SimOptions) -> Result<Vec<CaseResult>> {
    use rayon::prelude::*;
    let modelled: Vec<&Case> = cases.iter().filter(|c| c.status.is_modelled()).collect();
    let bar = indicatif::ProgressBar::new(modelled.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} cases {elapsed}")
            .expect("template")
            .progress_chars("=> "),
    );
    bar.set_prefix("validate");
    let out: Vec<Result<CaseResult, String>> = modelled
        .par_iter()
        .map(|c| {
            let r = validation::run_case(c, opts);
            bar.inc(1);
            r
        })
        .collect();
    bar.finish_and_clear();
    out.into_iter()
        .map(|r| r.map_err(anyhow::Error::msg))
        .collect()
}

fn mean_max(results: &[CaseResult], ids: &[&str]) -> Option<(f64, f64, usize)> {
    let errs: Vec<f64> = results
        .iter()
        .filter(|r| ids.contains(&r.id.as_str()))
        .map(|r| r.error_pct.abs())
        .collect();
    if errs.is_empty() {
        return None;
    }
    Some((
        errs.iter().sum::<f64>() / errs.len() as f64,
        errs.iter().copied().fold(0.0, f64::max),
        errs.len(),
    ))
}

pub fn run(args: &ValidateArgs) -> Result<bool> {
    let mut cases = load_cases(args.path.as_ref())?;
    if let Some(id) = &args.show {
        let c = cases
            .iter()
            .find(|c| &c.id == id)
            .with_context(|| format!("--show: no case `{id}`"))?;
        outln!(
            "# case {} ({}): {} = {}\n# assumptions: {}\n{}",
            c.id,
            c.source,
            c.metric,
            c.published,
            c.assumptions,
            c.job_toml
        )?;
        return Ok(true);
    }
    if let Some(f) = &args.filter {
        cases.retain(|c| c.id.contains(f.as_str()));
        if cases.is_empty() {
            bail!("--filter {f}: no case matches");
        }
    }
    let excluded: Vec<&Case> = cases.iter().filter(|c| !c.status.is_modelled()).collect();
    let results = run_all(&cases, &SimOptions::default())?;
    let (per_source, overall) = validation::stats(&results);
    let failures: Vec<&CaseResult> = results.iter().filter(|r| !r.within).collect();
    // Published runs ran: a predicted peak above the GPU's memory is a memory-model error.
    let over_memory: Vec<&CaseResult> = results.iter().filter(|r| !r.fits()).collect();
    let calculon = mean_max(&results, &CALCULON_ROWS);
    if let Some(path) = &args.plot {
        let points: Vec<prism_io::plot::Point> = results
            .iter()
            .map(|r| prism_io::plot::Point {
                series: validation::source_prefix(&r.id).to_string(),
                x: r.published,
                y: r.predicted,
            })
            .collect();
        let title = format!(
            "Prism vs published runs: {} cases, MAPE {:.2}%",
            results.len(),
            overall.mape
        );
        let svg = prism_io::plot::predicted_vs_published_svg(&title, &points)
            .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg)
            .with_context(|| format!("cannot write plot {}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        let md = markdown(
            &cases,
            &results,
            &per_source,
            &overall,
            calculon,
            args.plot.as_ref(),
            path,
        );
        std::fs::write(path, md).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        let v = serde_json::json!({
            "mape": overall.mape,
            "max_abs_error_pct": overall.max_abs,
            "count": overall.count,
            "excluded": excluded.iter().map(|c| serde_json::json!({"id": c.id, "reason": match &c.status { validation::Status::Excluded(w) => w.clone(), _ => String::new() }})).collect::<Vec<_>>(),
            "per_source": per_source.iter().map(|s| serde_json::json!({"source": s.source, "count": s.count, "mape": s.mape, "max_abs_error_pct": s.max_abs})).collect::<Vec<_>>(),
            "calculon_rows": calculon.map(|(m, x, n)| serde_json::json!({"count": n, "prism_mape": m, "prism_max_abs_error_pct": x, "calculon_mape": CALCULON_MEAN_PCT, "calculon_max_abs_error_pct": CALCULON_MAX_PCT})),
            "cases": results.iter().map(|r| serde_json::json!({
                "id": r.id, "source": r.source, "metric": r.metric.name(), "published": r.published,
                "predicted": r.predicted, "error_pct": r.error_pct, "tolerance_pct": r.tolerance_pct, "within": r.within,
                "peak_memory_gib": r.peak_memory_gib, "hbm_gib": r.hbm_gib, "fits": r.fits(),
            })).collect::<Vec<_>>(),
            "over_memory": over_memory.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        out!("{}", validation::results_table(&results))?;
        outln!()?;
        out!("{}", validation::stats_table(&per_source, &overall))?;
        if let Some((m, x, n)) = calculon {
            outln!()?;
            outln!(
                "Korthikanti et al. 2022 Table 5 ({n} runs): Prism mean {m:.2}% max {x:.2}%   Calculon mean {CALCULON_MEAN_PCT:.2}% max {CALCULON_MAX_PCT:.2}%"
            )?;
        }
        if !excluded.is_empty() {
            outln!()?;
            outln!(
                "{} cases not modelled (see validation/cases.csv for the reasons)",
                excluded.len()
            )?;
        }
        if !results.is_empty() {
            outln!()?;
            outln!(
                "memory: {} of {} cases fit their GPUs in Prism's memory model{}",
                results.len() - over_memory.len(),
                results.len(),
                if over_memory.is_empty() {
                    String::new()
                } else {
                    let ids: Vec<&str> = over_memory.iter().map(|r| r.id.as_str()).collect();
                    format!("; over: {}", ids.join(", "))
                }
            )?;
        }
        for f in &failures {
            outln!(
                "OUT OF TOLERANCE: {} error {:+.2}% > {:.1}%",
                f.id,
                f.error_pct,
                f.tolerance_pct
            )?;
        }
    }
    Ok(failures.is_empty())
}

fn markdown(
    cases: &[Case],
    results: &[CaseResult],
    per_source: &[validation::SourceStats],
    overall: &validation::SourceStats,
    calculon: Option<(f64, f64, usize)>,
    plot: Option<&PathBuf>,
    out: &std::path::Path,
) -> String {
    use std::fmt::Write as _;
    let mut md = String::new();
    let _ = writeln!(md, "# Validation against published training runs\n");
    let _ = writeln!(
        md,
        "Generated by `prism validate --markdown docs/validation.md --plot docs/validation.svg` from \
         `validation/cases.csv` (sources, metrics and every assumption are in that file and in \
         `validation/README.md`). Errors are signed: (predicted - published) / published.\n"
    );
    let _ = writeln!(
        md,
        "**Overall: {} modelled cases, mean absolute error {:.2}%, max {:.2}%.**\n",
        overall.count, overall.mape, overall.max_abs
    );
    if let Some((m, x, n)) = calculon {
        let _ = writeln!(
            md,
            "On the {n} Korthikanti et al. 2022 Table 5 runs: Prism {m:.2}% mean / {x:.2}% max; \
             Calculon (Isaev et al. 2023) {CALCULON_MEAN_PCT:.2}% / {CALCULON_MAX_PCT:.2}%.\n"
        );
    }
    if let Some(p) = plot {
        let rel = match (p.parent(), out.parent()) {
            (Some(a), Some(b)) if a == b => p
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            _ => p.display().to_string(),
        };
        let _ = writeln!(md, "![predicted vs published]({rel})\n");
    }
    let _ = writeln!(
        md,
        "| source | cases | mean abs error % | max abs error % |\n|---|---:|---:|---:|"
    );
    for s in per_source.iter().chain(std::iter::once(overall)) {
        let _ = writeln!(
            md,
            "| {} | {} | {:.2} | {:.2} |",
            s.source, s.count, s.mape, s.max_abs
        );
    }
    let _ = writeln!(
        md,
        "\n| case | metric | published | predicted | error % | tolerance % | peak memory GiB |\n|---|---|---:|---:|---:|---:|---:|"
    );
    for r in results {
        let _ = writeln!(
            md,
            "| {} | {} | {:.4} | {:.4} | {:+.2} | {:.0} | {:.1}{} |",
            r.id,
            r.metric.name(),
            r.published,
            r.predicted,
            r.error_pct,
            r.tolerance_pct,
            r.peak_memory_gib,
            if r.fits() {
                String::new()
            } else {
                format!(" (over {:.0})", r.hbm_gib)
            }
        );
    }
    let _ = writeln!(
        md,
        "\n## Cases not modelled\n\n| case | reason |\n|---|---|"
    );
    for c in cases {
        if let validation::Status::Excluded(why) = &c.status {
            let _ = writeln!(md, "| {} | {} |", c.id, why.replace('|', "/"));
        }
    }
    md
}
