//! `prism geo bubbles`: BUBBLETEA on a job's training schedule ([`prism_geo::bubbles`]).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_geo::bubbles::{self, BubbleOptions, PromptDist};
use prism_geo::plan::{self, PlanOptions};

#[derive(Debug, clap::Args)]
pub struct BubblesArgs {
    #[command(flatten)]
    job: crate::geo::JobArgs,
    /// Use the job's layout as written (default for a multi-DC job: ATLAS's plan of it).
    #[arg(long)]
    as_is: bool,
    /// Inference model (a model preset name, docs/job-format.md).
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Tensor parallelism of one inference instance.
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// Poisson arrival rate, requests per second (ignored with --trace).
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Seconds of arrivals (ignored with --trace).
    #[arg(long, default_value_t = 120.0)]
    duration: f64,
    /// Prompt lengths: `fixed:N`, `uniform:LO:HI` or `lognormal:MEDIAN:SIGMA:MAX` (ignored with
    /// --trace).
    #[arg(long, default_value = "lognormal:1024:0.8:8192")]
    prompt: String,
    /// Arrival trace CSV (`arrived_at`, `num_prefill_tokens` columns; Vidur's Splitwise traces).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Time-to-first-token objective, ms.
    #[arg(long, default_value_t = 2000.0)]
    slo_ms: f64,
    /// Guard band before and after every admitted prefill, ms.
    #[arg(long, default_value_t = 5.0)]
    guard_ms: f64,
    /// Seed of the arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write an SVG of one stage's compute timeline with the admitted prefill.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Stage shown in the plot (default: the one with the most admitted prefill).
    #[arg(long)]
    stage: Option<u32>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn prompt_dist(s: &str) -> Result<PromptDist> {
    let parts: Vec<&str> = s.split(':').collect();
    let num = |i: usize| -> Result<f64> {
        parts
            .get(i)
            .and_then(|p| p.trim().parse::<f64>().ok())
            .filter(|x| x.is_finite() && *x > 0.0)
            .with_context(|| format!("--prompt {s}: field {i} must be a positive number"))
    };
    Ok(match parts[0] {
        "fixed" if parts.len() == 2 => PromptDist::Fixed(num(1)? as u32),
        "uniform" if parts.len() == 3 => PromptDist::Uniform {
            lo: num(1)? as u32,
            hi: num(2)? as u32,
        },
        "lognormal" if parts.len() == 4 => PromptDist::LogNormal {
            median: num(1)?,
            sigma: num(2)?,
            max: num(3)? as u32,
        },
        _ => bail!("--prompt {s}: expected fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA:MAX"),
    })
}

/// The model of preset `name`.
pub fn model_preset(name: &str) -> Result<prism_core::job::Model> {
    let text = format!(
        "[model]\npreset = \"{name}\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 1\n\
         [parallel]\ntp = 1\npp = 1\ndp = 8\n[training]\nglobal_batch = 8\n"
    );
    Ok(
        prism_io::jobfile::load_job_str(&text, "--model", None, &[])?
            .job
            .model,
    )
}

pub fn run(a: &BubblesArgs) -> Result<()> {
    let mut job = a.job.load()?;
    if job.cluster.topology.wan.is_multi() && !a.as_is {
        let p = plan::plan(
            &job,
            &PlanOptions {
                baselines: false,
                ..Default::default()
            },
        )?;
        job = p.atlas.job;
    }
    let requests = match &a.trace {
        Some(path) => prism_io::geo::read_arrival_trace(path).map_err(anyhow::Error::msg)?,
        None => {
            if !(a.rate.is_finite() && a.rate > 0.0 && a.duration.is_finite() && a.duration > 0.0) {
                bail!("--rate and --duration must be positive");
            }
            bubbles::poisson_requests(a.rate, a.duration, prompt_dist(&a.prompt)?, a.seed)
        }
    };
    if !(a.slo_ms > 0.0 && a.guard_ms >= 0.0) {
        bail!("--slo-ms must be positive and --guard-ms not negative");
    }
    let model = model_preset(&a.model)?;
    let opts = BubbleOptions {
        model,
        tp: a.tp,
        slo_s: a.slo_ms * 1e-3,
        guard_s: a.guard_ms * 1e-3,
    };
    let r = bubbles::bubbles(&job, &requests, &opts)?;
    if let Some(path) = &a.plot {
        let stage = a.stage.unwrap_or_else(|| {
            (0..job.parallel.pp)
                .max_by_key(|&s| {
                    (
                        r.admitted.iter().filter(|x| x.stage == s).count(),
                        std::cmp::Reverse(s),
                    )
                })
                .unwrap_or(0)
        });
        if stage >= job.parallel.pp {
            bail!("--stage {stage}: the job has {} stages", job.parallel.pp);
        }
        let bars = bubbles::stage_timeline(&r, stage);
        let row = |prefill: bool, label: &str| prism_io::geo::TimelineRow {
            label: label.into(),
            bars: bars
                .iter()
                .filter(|b| b.2 == prefill)
                .map(|&(s, e, _)| (s, e, 1.0, prefill as usize))
                .collect(),
        };
        let svg = prism_io::geo::timeline_svg(
            &format!(
                "Stage {stage} GPU: training kernels and admitted prefill ({})",
                a.model
            ),
            &[row(false, "training"), row(true, "prefill + KV hand-off")],
            r.iteration_s,
            &["training compute", "prefill (BUBBLETEA)"],
        )
        .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&prism_io::geo::bubbles_json(&r, &a.model, a.tp))?
        )?;
        return Ok(());
    }
    outln!("Prism geo bubbles: {}", job.name)?;
    outln!(
        "  training: {} GPUs, tp {} pp {} dp {}, micro-batch {}; iteration {:.3} s",
        job.num_gpus(),
        job.parallel.tp,
        job.parallel.pp,
        job.parallel.dp,
        job.parallel.micro_batch,
        r.iteration_s
    )?;
    outln!(
        "  inference: {} at tp {} ({} instances per stage; fits beside training on {} of {} stages)",
        a.model,
        a.tp,
        r.instances_per_stage,
        r.stages_fitting.iter().filter(|&&f| f).count(),
        r.stages_fitting.len()
    )?;
    let grid: Vec<String> = r
        .prefill
        .grid
        .iter()
        .map(|(n, s)| format!("{n}: {:.0} ms", s * 1e3))
        .collect();
    outln!("  prefill latency (engine): {}", grid.join(", "))?;
    outln!(
        "  requests: {} over {:.1} s; admitted {} ({:.1}%), {:.2} prefill/s, {:.0} prompt tokens/s",
        r.requests,
        r.horizon_s,
        r.admitted.len(),
        100.0 * r.admitted.len() as f64 / r.requests.max(1) as f64,
        r.prefill_per_s(),
        r.tokens_per_s()
    )?;
    outln!(
        "  TTFT of admitted: p50 {:.0} ms, p99 {:.0} ms (SLO {:.0} ms)",
        r.ttft_p50_s * 1e3,
        r.ttft_p99_s * 1e3,
        r.slo_s * 1e3
    )?;
    outln!(
        "  GPU utilisation: {:.1}% without prefill, {:.1}% with (idle share of the schedule {:.1}%)",
        100.0 * r.utilisation_without,
        100.0 * r.utilisation_with,
        100.0 * r.idle_fraction
    )?;
    outln!(
        "  training slowdown (re-simulated with the prefill as engine ops): {:.6}% (iteration {:.6} s -> {:.6} s; largest kernel shift {:.3} us)",
        100.0 * r.training_slowdown,
        r.iteration_s,
        r.iteration_with_prefill_s,
        r.max_kernel_shift_s * 1e6
    )?;
    Ok(())
}
