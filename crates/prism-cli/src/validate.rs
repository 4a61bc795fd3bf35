//! `prism validate`: simulate every published run in a case file and show the error.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_core::engine::SimOptions;
use prism_io::validation::{self, Case, CaseOptions, CaseResult, Compare};

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
    /// Compare each published figure with Prism's expected iteration time with stragglers (the
    /// slowest of the run's GPUs at `cluster.gpu_speed_cv`) instead of the nominal one. Both
    /// errors are always reported; this picks the one that is compared with the tolerance.
    #[arg(long)]
    stragglers: bool,
    /// Per-GPU speed spread (coefficient of variation, 0 to 0.5) for the straggler prediction
    /// of every case, instead of each case job's `cluster.gpu_speed_cv` (default 0.011).
    #[arg(long, value_name = "CV")]
    gpu_speed_cv: Option<f64>,
    /// Also simulate the excluded cases and list what Prism predicts for them, apart: they
    /// count in no error statistic, tolerance check, plot or Markdown table. A case whose job
    /// cannot run says why.
    #[arg(long)]
    excluded: bool,
}

impl ValidateArgs {
    fn case_options(&self) -> CaseOptions {
        CaseOptions {
            compare: if self.stragglers {
                Compare::Stragglers
            } else {
                Compare::Nominal
            },
            gpu_speed_cv: self.gpu_speed_cv,
        }
    }
}

pub fn load_cases(path: Option<&PathBuf>) -> Result<Vec<Case>> {
    Ok(match path {
        Some(p) => validation::read_cases(p)?,
        None => validation::parse_cases(EMBEDDED_CASES, "<embedded validation/cases.csv>")?,
    })
}

/// Simulates `cases` in parallel behind a progress bar; the results in the cases' order.
fn simulate(
    cases: &[&Case],
    opts: &SimOptions,
    how: &CaseOptions,
) -> Vec<Result<CaseResult, String>> {
    use rayon::prelude::*;
    let bar = indicatif::ProgressBar::new(cases.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} cases {elapsed}")
            .expect("template")
            .progress_chars("=> "),
    );
    bar.set_prefix("validate");
    let out = cases
        .par_iter()
        .map(|c| {
            let r = validation::run_case_with(c, opts, how);
            bar.inc(1);
            r
        })
        .collect();
    bar.finish_and_clear();
    out
}

/// Runs every modelled case (in parallel), in case-file order.
pub fn run_all(cases: &[Case], opts: &SimOptions, how: &CaseOptions) -> Result<Vec<CaseResult>> {
    let modelled: Vec<&Case> = cases.iter().filter(|c| c.status.is_modelled()).collect();
    simulate(&modelled, opts, how)
        .into_iter()
        .map(|r| r.map_err(anyhow::Error::msg))
        .collect()
}

/// Simulates excluded cases as if they were modelled, in case-file order; a case whose job
/// cannot run keeps its error.
fn run_excluded(
    cases: &[&Case],
    opts: &SimOptions,
    how: &CaseOptions,
) -> Vec<(String, Result<CaseResult, String>)> {
    let as_modelled: Vec<Case> = cases
        .iter()
        .map(|c| Case {
            status: validation::Status::Modelled,
            ..(*c).clone()
        })
        .collect();
    let refs: Vec<&Case> = as_modelled.iter().collect();
    let results = simulate(&refs, opts, how);
    as_modelled.into_iter().map(|c| c.id).zip(results).collect()
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
    if let Some(cv) = args.gpu_speed_cv
        && !prism_core::straggler::is_valid_gpu_speed_cv(cv)
    {
        bail!(
            "--gpu-speed-cv {cv}: expected a coefficient of variation from 0 to {}",
            prism_core::straggler::MAX_GPU_SPEED_CV
        );
    }
    let how = args.case_options();
    let opts = SimOptions::default();
    let results = run_all(&cases, &opts, &how)?;
    let excluded_runs = if args.excluded {
        run_excluded(&excluded, &opts, &how)
    } else {
        Vec::new()
    };
    let stats_at = |c: Compare| validation::stats_by(&results, |r| r.error_at(c));
    let (nominal, stragglers) = (stats_at(Compare::Nominal), stats_at(Compare::Stragglers));
    let ((per_source, overall), (other_per_source, other_overall)) = match how.compare {
        Compare::Nominal => (&nominal, &stragglers),
        Compare::Stragglers => (&stragglers, &nominal),
    };
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
            (per_source.as_slice(), overall),
            (other_per_source.as_slice(), other_overall),
            calculon,
            args.plot.as_ref(),
            path,
        );
        std::fs::write(path, md).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        let mut v = serde_json::json!({
            "mape": overall.mape,
            "max_abs_error_pct": overall.max_abs,
            "count": overall.count,
            "compared": how.compare.name(),
            "gpu_speed_cv_override": how.gpu_speed_cv,
            "mape_nominal": nominal.1.mape,
            "max_abs_error_nominal_pct": nominal.1.max_abs,
            "mape_stragglers": stragglers.1.mape,
            "max_abs_error_stragglers_pct": stragglers.1.max_abs,
            "excluded": excluded.iter().map(|c| serde_json::json!({"id": c.id, "reason": match &c.status { validation::Status::Excluded(w) => w.clone(), _ => String::new() }})).collect::<Vec<_>>(),
            "per_source": per_source.iter().zip(nominal.0.iter().zip(stragglers.0.iter())).map(|(s, (n, g))| serde_json::json!({"source": s.source, "count": s.count, "mape": s.mape, "max_abs_error_pct": s.max_abs, "mape_nominal": n.mape, "mape_stragglers": g.mape})).collect::<Vec<_>>(),
            "calculon_rows": calculon.map(|(m, x, n)| serde_json::json!({"count": n, "prism_mape": m, "prism_max_abs_error_pct": x, "calculon_mape": CALCULON_MEAN_PCT, "calculon_max_abs_error_pct": CALCULON_MAX_PCT})),
            "cases": results.iter().map(|r| serde_json::json!({
                "id": r.id, "source": r.source, "metric": r.metric.name(), "published": r.published,
                "predicted": r.predicted, "error_pct": r.error_pct, "tolerance_pct": r.tolerance_pct, "within": r.within,
                "predicted_nominal": r.predicted_nominal, "error_nominal_pct": r.error_nominal_pct,
                "predicted_stragglers": r.predicted_stragglers, "error_stragglers_pct": r.error_stragglers_pct,
                "gpus": r.num_gpus, "gpu_speed_cv": r.gpu_speed_cv,
                "peak_memory_gib": r.peak_memory_gib, "hbm_gib": r.hbm_gib, "fits": r.fits(),
            })).collect::<Vec<_>>(),
            "over_memory": over_memory.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        });
        if args.excluded {
            v["excluded_predictions"] = excluded_runs
                .iter()
                .map(|(id, r)| match r {
                    Ok(r) => serde_json::json!({"id": id, "metric": r.metric.name(),
                        "published": r.published, "predicted": r.predicted,
                        "error_pct": r.error_pct, "peak_memory_gib": r.peak_memory_gib}),
                    Err(e) => serde_json::json!({"id": id, "error": e}),
                })
                .collect();
        }
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!("{}", compared_line(how.compare))?;
        outln!()?;
        out!("{}", validation::results_table(&results))?;
        outln!()?;
        out!(
            "{}",
            validation::stats_table_with(
                per_source,
                overall,
                Some((
                    how.compare.other().name(),
                    other_per_source.as_slice(),
                    other_overall
                ))
            )
        )?;
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
        if !excluded_runs.is_empty() {
            let ran: Vec<CaseResult> = excluded_runs
                .iter()
                .filter_map(|(_, r)| r.as_ref().ok().cloned())
                .collect();
            outln!("Prism's prediction for them (counted nowhere above):")?;
            out!("{}", validation::results_table(&ran))?;
            for (id, r) in &excluded_runs {
                if let Err(e) = r {
                    outln!("{id}: cannot run: {e}")?;
                }
            }
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

/// The sentence that says which prediction `error %` is.
fn compared_line(compare: Compare) -> &'static str {
    match compare {
        Compare::Nominal => {
            "compared: the nominal iteration (identical GPUs), with which the calibrated parameters \
             were fitted; `stragglers %` is the expected iteration with the slowest of the run's \
             GPUs (cluster.gpu_speed_cv, default 1.1%; `--stragglers` compares that one)"
        }
        Compare::Stragglers => {
            "compared: the expected iteration with stragglers (the slowest of the run's GPUs at \
             cluster.gpu_speed_cv, default 1.1%); `nominal %` is the iteration on identical GPUs"
        }
    }
}

type Stats<'a> = (&'a [validation::SourceStats], &'a validation::SourceStats);

fn markdown(
    cases: &[Case],
    results: &[CaseResult],
    (per_source, overall): Stats,
    (other_per_source, other_overall): Stats,
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
    let compare = results.first().map(|r| r.compared).unwrap_or_default();
    let other = compare.other().name();
    let _ = writeln!(md, "{}.\n", compared_line(compare));
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
        "| source | cases | mean abs error % | max abs error % | {other}: mean / max % |\n|---|---:|---:|---:|---:|"
    );
    let others = other_per_source
        .iter()
        .chain(std::iter::once(other_overall));
    for (s, o) in per_source
        .iter()
        .chain(std::iter::once(overall))
        .zip(others)
    {
        let _ = writeln!(
            md,
            "| {} | {} | {:.2} | {:.2} | {:.2} / {:.2} |",
            s.source, s.count, s.mape, s.max_abs, o.mape, o.max_abs
        );
    }
    let _ = writeln!(
        md,
        "\n| case | GPUs | metric | published | predicted | error % | {other} % | tolerance % | peak memory GiB |\n|---|---:|---|---:|---:|---:|---:|---:|---:|"
    );
    for r in results {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.4} | {:.4} | {:+.2} | {:+.2} | {:.0} | {:.1}{} |",
            r.id,
            r.num_gpus,
            r.metric.name(),
            r.published,
            r.predicted,
            r.error_pct,
            r.other_error_pct(),
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
