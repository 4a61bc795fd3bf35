//! `prism detect`: fail-slow and fail-stop detection over timing logs (ResiHP's workload-aware
//! detector beside a raw iteration-time threshold and a Greyhound-style change-point
//! detector), and `--generate`: logs with injected faults from the engine.

use std::path::PathBuf;

use std::io::Write;

use anyhow::{Context, Result, bail};
use prism_resilience::detect::{
    DetectorConfig, Episode, FaultKind, GreyhoundDetector, LogEvent, ResihpDetector,
    ThresholdDetector, run_detector, score,
};
use prism_resilience::generate::{GenConfig, generate};

#[derive(Debug, clap::Args)]
pub struct DetectArgs {
    /// Timing log: CSV (docs/resilience.md) or Megatron-LM iteration lines.
    log: Option<PathBuf>,
    /// Ground truth (CSV: kind,unit,start_s,end_s) to score the detectors against.
    #[arg(long, value_name = "FILE")]
    truth: Option<PathBuf>,
    /// Write a log with injected faults played out on the engine into this directory
    /// (`log.csv`, `truth.csv`), then detect and score on it. Needs `--job`.
    #[arg(long, value_name = "DIR")]
    generate: Option<PathBuf>,
    /// Job file whose layout, model and `[resilience]` workload the generated log follows.
    #[arg(long, value_name = "FILE")]
    job: Option<PathBuf>,
    /// Override a job key (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Fault episodes to inject.
    #[arg(long, default_value_t = 240)]
    episodes: u32,
    /// Slowest speed of a fail-slow device in the generated log (relative to healthy).
    #[arg(long, default_value_t = 0.3)]
    slow_min: f64,
    /// Fastest speed of a fail-slow device in the generated log.
    #[arg(long, default_value_t = 0.75)]
    slow_max: f64,
    /// Log-normal sigma of the per-unit, per-iteration speed noise of the generated log.
    #[arg(long, default_value_t = 0.02)]
    noise: f64,
    /// Seed of the generated log.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Observed / expected ratio that counts as slow.
    #[arg(long, default_value_t = 1.15)]
    ratio: f64,
    /// Records in a row that confirm a start or an end.
    #[arg(long, default_value_t = 3)]
    confirm: u32,
    /// Heartbeat silence that means fail-stop, seconds.
    #[arg(long, default_value_t = 30.0)]
    heartbeat_timeout: f64,
    /// Seconds after a true episode's end within which a detection still matches it.
    #[arg(long, default_value_t = 60.0)]
    grace: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: &DetectArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if !(a.ratio.is_finite() && a.ratio > 1.0) {
        bail!("--ratio must be a number above 1 (got {})", a.ratio);
    }
    if a.confirm == 0 || !(a.heartbeat_timeout.is_finite() && a.heartbeat_timeout > 0.0) {
        bail!("--confirm and --heartbeat-timeout must be positive");
    }
    let (events, truth, origin): (Vec<LogEvent>, Option<Vec<Episode>>, String) = match (
        &a.generate,
        &a.log,
    ) {
        (Some(dir), None) => {
            let Some(job_path) = &a.job else {
                bail!(
                    "--generate needs --job FILE (the job whose layout and workload the log follows)"
                );
            };
            let loaded = prism_io::jobfile::load_job_file(job_path, &a.sets)?;
            if !(0.0 < a.slow_min && a.slow_min <= a.slow_max && a.slow_max < 1.0) {
                bail!(
                    "need 0 < --slow-min <= --slow-max < 1 (got {} and {})",
                    a.slow_min,
                    a.slow_max
                );
            }
            if !(a.noise.is_finite() && (0.0..0.5).contains(&a.noise)) {
                bail!("--noise must be in [0, 0.5) (got {})", a.noise);
            }
            if a.episodes == 0 || a.episodes > 100_000 {
                bail!("--episodes must be in 1..=100000 (got {})", a.episodes);
            }
            let mut cfg = GenConfig::from_job(&loaded.job, &loaded.resilience, a.episodes, a.seed);
            cfg.slow_speed = (a.slow_min, a.slow_max);
            cfg.noise_sigma = a.noise;
            let g = generate(&cfg, &loaded.job.cluster)
                .map_err(|e| anyhow::anyhow!("cannot generate: {e}"))?;
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let log = dir.join("log.csv");
            let tr = dir.join("truth.csv");
            std::fs::write(&log, prism_io::resilience::write_log(&g.events))
                .with_context(|| format!("cannot write {}", log.display()))?;
            std::fs::write(&tr, prism_io::resilience::write_truth(&g.truth))
                .with_context(|| format!("cannot write {}", tr.display()))?;
            if !a.json {
                writeln!(
                    out,
                    "wrote {} ({} iterations, {} events, {:.1} h) and {} ({} episodes)",
                    log.display(),
                    g.iterations,
                    g.events.len(),
                    g.duration_s / 3600.0,
                    tr.display(),
                    g.truth.len()
                )?;
            }
            (g.events, Some(g.truth), log.display().to_string())
        }
        (None, Some(path)) => {
            let text = prism_io::resilience::read_file(path)?;
            let origin = path.display().to_string();
            let events = prism_io::resilience::parse_log(&text, &origin)?;
            let truth = match &a.truth {
                Some(t) => {
                    let tt = prism_io::resilience::read_file(t)?;
                    Some(prism_io::resilience::parse_truth(
                        &tt,
                        &t.display().to_string(),
                    )?)
                }
                None => None,
            };
            (events, truth, origin)
        }
        (Some(_), Some(_)) => bail!("give either a LOG or --generate DIR, not both"),
        (None, None) => bail!("give a LOG to read, or --generate DIR --job FILE"),
    };
    let cfg = DetectorConfig {
        ratio: a.ratio,
        confirm: a.confirm,
        heartbeat_timeout_s: a.heartbeat_timeout,
        ..DetectorConfig::default()
    };
    let start = events
        .iter()
        .map(|e| e.time())
        .fold(f64::INFINITY, f64::min);
    let end = events.iter().map(|e| e.time()).fold(0.0, f64::max);
    let duration = (end - start.min(end)).max(1e-9);
    let runs: Vec<(&str, bool, Vec<Episode>)> = vec![
        (
            "resihp",
            true,
            run_detector(&mut ResihpDetector::new(cfg), &events),
        ),
        (
            "threshold",
            false,
            run_detector(&mut ThresholdDetector::new(cfg), &events),
        ),
        (
            "greyhound",
            false,
            run_detector(&mut GreyhoundDetector::new(cfg), &events),
        ),
    ];
    let scored = |found: &[Episode], localised: bool| {
        truth.as_ref().map(|t| {
            [FaultKind::FailSlow, FaultKind::FailStop]
                .map(|k| score(found, t, k, duration, a.grace, localised))
        })
    };
    if a.json {
        let v = serde_json::json!({
            "log": origin,
            "events": events.len(),
            "duration_s": duration,
            "truth_episodes": truth.as_ref().map(|t| t.len()),
            "detectors": runs.iter().map(|(name, loc, found)| serde_json::json!({
                "name": name,
                "localised": loc,
                "episodes": prism_io::resilience::episodes_json(found),
                "scores": scored(found, *loc).map(|s| s.iter().map(prism_io::resilience::score_json).collect::<Vec<_>>()),
            })).collect::<Vec<_>>(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "{origin}: {} events over {:.2} h",
        events.len(),
        duration / 3600.0
    )?;
    for (name, loc, found) in &runs {
        let slow = found
            .iter()
            .filter(|e| e.kind == FaultKind::FailSlow)
            .count();
        let stop = found.len() - slow;
        writeln!(
            out,
            "  {name:<10} {slow} fail-slow, {stop} fail-stop episodes{}",
            if *loc { " (localised)" } else { " (job level)" }
        )?;
    }
    if truth.is_none() {
        if let Some((_, _, found)) = runs.first() {
            writeln!(out, "  resihp episodes:")?;
            for e in found.iter().take(50) {
                writeln!(
                    out,
                    "    {:<9} {:<12} start {:>10.1} s  end {:>12}  detected {:>10.1} s",
                    e.kind.name(),
                    e.unit.as_deref().unwrap_or("-"),
                    e.start_s,
                    e.end_s
                        .map(|x| format!("{x:.1} s"))
                        .unwrap_or("open".into()),
                    e.detected_at_s
                )?;
            }
            if found.len() > 50 {
                writeln!(out, "    ... {} more (--json lists all)", found.len() - 50)?;
            }
        }
        return Ok(());
    }
    writeln!(
        out,
        "  {:<10} {:<9} {:>8} {:>9} {:>7} {:>7} {:>7} {:>10} {:>10} {:>10}",
        "detector",
        "kind",
        "episodes",
        "detected",
        "prec",
        "recall",
        "F1",
        "FA/day",
        "delay s",
        "max s"
    )?;
    for (name, loc, found) in &runs {
        for s in scored(found, *loc).expect("truth given") {
            writeln!(
                out,
                "  {name:<10} {:<9} {:>8} {:>9} {:>7.4} {:>7.4} {:>7.4} {:>10.2} {:>10.1} {:>10.1}",
                s.kind.name(),
                s.episodes,
                s.detections,
                s.precision,
                s.recall,
                s.f1,
                s.false_alarms_per_day,
                s.mean_delay_s,
                s.max_delay_s
            )?;
        }
    }
    writeln!(
        out,
        "  (resihp is scored at the right unit; the job-level baselines by time only)"
    )?;
    Ok(())
}
