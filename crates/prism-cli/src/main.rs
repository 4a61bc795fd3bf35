//! `prism`: predicts how LLM training behaves on 1,000 to 100,000 GPUs.
//!
//! `prism simulate [JOB.toml]` simulates one iteration of a job (the embedded Llama 3 405B on
//! 16,384 H100 example when no file is given) and prints where the time goes.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use prism_core::engine::{Mode, SimOptions, SimResult};
use prism_core::job::Job;
use prism_core::memory;
use prism_core::units::GIB;

/// Prism: training-cluster performance prediction.
#[derive(Debug, Parser)]
#[command(name = "prism", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulate one training iteration and report time, throughput, MFU, memory and breakdown.
    Simulate(SimulateArgs),
    /// Measure Prism itself: wall time (median of repeats) and peak memory of reference runs.
    Bench(BenchArgs),
    /// Simulate published training runs and report the prediction error.
    Validate(validate::ValidateArgs),
    /// Work with measured profiles.
    #[command(subcommand)]
    Profile(profile::ProfileCommand),
    /// Turn another tool's job description into a Prism job file (a Megatron-LM launch script).
    #[command(subcommand)]
    Import(import::ImportCommand),
    /// Fit the physical parameters of a GPU generation to published runs (and Kineto kernels).
    Calibrate(calibrate::CalibrateArgs),
    /// Training time as a distribution: Monte Carlo over iterations, failures and checkpoints,
    /// with a probabilistic guarantee.
    Predict(predict::PredictArgs),
    /// Fit Normal, Gamma and LogNormal distributions to measured durations (KS selection).
    Fit(fit::FitArgs),
    /// Search the parallel layouts (tp, pp, dp, cp, vpp, micro-batch, recompute, distributed
    /// optimizer) of a job for the fastest that fits in memory; rank by mean, p95 or p99.
    Explore(explore::ExploreArgs),
    /// Hybrid emulation (PrismLLM): slice recorded traces into a target-scale graph, or run
    /// the coordinator that plays every virtual rank while real ranks connect.
    Emulate(emulate::EmulateArgs),
    /// Fail-slow and fail-stop detection over timing logs (ResiHP's workload-aware detector and
    /// two baselines); `--generate` writes logs with injected faults from the engine.
    Detect(detect::DetectArgs),
    /// Hours of training with faults: ResiHP's joint TP/PP/DP adaptation against baselines and
    /// an oracle (throughput timeline, goodput, plot).
    Resilience(resilience::ResilienceArgs),
    /// Training across datacenters: ATLAS placement (plan), BUBBLETEA prefill in the bubbles
    /// (bubbles), scenario sweeps (sweep).
    #[command(subcommand)]
    Geo(geo::GeoCommand),
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Repeats per scenario (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: u32,
    /// Only scenarios whose name contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct SimulateArgs {
    /// Job file (TOML, see docs/job-format.md). Without it, the embedded default example:
    /// Llama 3 405B on 16,384 H100 (tp 8, pp 16, dp 128, 2048 x 8192 tokens).
    job: Option<PathBuf>,
    /// Override a job key, e.g. `--set parallel.tp=4` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    json: bool,
    /// Write a Chrome trace (Trace Event JSON; open in ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Ranks in the trace: `all` or a list like `0,8,100-103` (default: a sample).
    #[arg(long, value_name = "all|LIST")]
    trace_ranks: Option<String>,
    /// Simulate only these ranks (plus one representative of every other stage that they
    /// depend on); their timings equal the full run's.
    #[arg(long, value_name = "LIST")]
    ranks: Option<String>,
    /// Simulate one representative per pipeline stage (exact for symmetric jobs, much faster).
    #[arg(long, conflicts_with = "ranks")]
    reduced: bool,
    /// Simulate even when the memory model says a stage does not fit in GPU memory.
    #[arg(long)]
    allow_oom: bool,
}

/// `println!` that returns the write error instead of panicking, so that a closed pipe
/// (`prism validate --show ID | head`) ends the command quietly like every other output path.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `print!` that returns the write error instead of panicking (see `outln!`).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)
    }};
}

mod bench;
mod calibrate;
mod detect;
mod emulate;
mod explore;
mod fit;
mod geo;
mod geo_bubbles;
mod geo_sweep;
mod import;
mod predict;
mod profile;
mod resilience;
mod validate;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Validate(args) => match validate::run(&args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
        Command::Profile(cmd) => profile::run(&cmd),
        Command::Import(cmd) => import::run(&cmd),
        Command::Calibrate(args) => calibrate::run(&args),
        Command::Predict(args) => predict::run(&args),
        Command::Fit(args) => fit::run(&args),
        Command::Explore(args) => explore::run(&args),
        Command::Emulate(args) => emulate::run(&args),
        Command::Detect(args) => detect::run(&args),
        Command::Resilience(args) => resilience::run(&args),
        Command::Geo(cmd) => geo::run(&cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`prism simulate | head`): nothing is lost that anyone reads,
        // so stop quietly, as Unix tools do.
        Err(e)
            if e.chain().any(|c| {
                let pipe = Some(std::io::ErrorKind::BrokenPipe);
                c.downcast_ref::<std::io::Error>().map(|io| io.kind()) == pipe
                    || c.downcast_ref::<serde_json::Error>()
                        .and_then(|j| j.io_error_kind())
                        == pipe
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Parses `0,8,100-103` into ranks, checking them against `num_ranks`.
fn parse_rank_list(text: &str, flag: &str, num_ranks: u32) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| -> Result<u32> {
            s.parse::<u32>()
                .with_context(|| format!("{flag}: `{part}` is not a rank or a range like 4-7"))
        };
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            bail!("{flag}: range `{part}` is empty (start > end)");
        }
        if hi >= num_ranks {
            bail!(
                "{flag}: rank {hi} does not exist (the job has ranks 0-{})",
                num_ranks - 1
            );
        }
        if (hi - lo) as usize + out.len() > 1 << 20 {
            bail!("{flag}: too many ranks");
        }
        out.extend(lo..=hi);
    }
    if out.is_empty() {
        bail!("{flag}: no ranks given");
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A few ranks that show the pipeline: the first rank of every stage and the job's last rank.
fn sample_ranks(job: &Job) -> Vec<u32> {
    let p = &job.parallel;
    let stage = p.tp * p.cp * p.dp;
    let mut v: Vec<u32> = (0..p.pp).map(|s| s * stage).collect();
    v.push(p.tp * p.cp * p.dp * p.pp - 1);
    v.dedup();
    v
}

/// Refuses a job whose busiest stage does not fit in GPU memory, naming the job's source and
/// only the changes that would make it fit.
fn check_memory(job: &Job, origin: &str) -> Result<()> {
    use prism_core::job::Recompute;
    let (stage, peak) = memory::peak_memory(job);
    let capacity = job.cluster.gpu.hbm_gib * GIB;
    let fits = |j: &Job| memory::peak_memory(j).1.total() as f64 <= capacity;
    if peak.total() as f64 > capacity {
        let p = &job.parallel;
        let mut fixes: Vec<String> = Vec::new();
        for (r, name) in [
            (Recompute::Selective, "selective"),
            (Recompute::Full, "full"),
        ] {
            let mut j = job.clone();
            j.parallel.recompute = r;
            if p.recompute != r
                && fits(&j)
                && fixes.iter().all(|f| !f.starts_with("parallel.recompute"))
            {
                fixes.push(format!("parallel.recompute = \"{name}\""));
            }
        }
        if !p.distributed_optimizer {
            let mut j = job.clone();
            j.parallel.set_distributed_optimizer(true);
            if fits(&j) {
                fixes.push("parallel.distributed_optimizer = true".into());
            }
        }
        if p.micro_batch > 1 {
            let mut j = job.clone();
            j.parallel.micro_batch = 1;
            j.training.global_batch = job.training.global_batch;
            if j.validate().is_ok() && fits(&j) {
                fixes.push("parallel.micro_batch = 1".into());
            }
        }
        let advice = if fixes.is_empty() {
            "no single recompute, optimizer or micro-batch change fits it: use more tensor or \
             pipeline parallelism"
                .to_string()
        } else {
            format!("each of these fits it: {}", fixes.join("; "))
        };
        bail!(
            "{origin}: cluster.hbm_gib: pipeline stage {stage} needs {:.1} GiB per GPU but the GPU has {:.1} GiB \
             (weights {:.1} + gradients {:.1} + optimizer {:.1} + activations {:.1} + workspace {:.1} GiB); \
             {advice}; or pass --allow-oom to simulate anyway",
            gib(peak.total()),
            job.cluster.gpu.hbm_gib,
            gib(peak.weights),
            gib(peak.gradients),
            gib(peak.optimizer),
            gib(peak.activations),
            gib(peak.workspace),
        );
    }
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

fn simulate(args: &SimulateArgs) -> Result<()> {
    let loaded = match &args.job {
        Some(path) => prism_io::jobfile::load_job_file(path, &args.sets)?,
        None => prism_io::jobfile::default_job(&args.sets)?,
    };
    let job = &loaded.job;
    let num_ranks = job.num_gpus() as u32;
    if !args.allow_oom {
        check_memory(job, &loaded.source)?;
    }
    let kernel_table = match &loaded.kernel_table {
        Some(path) => Some(prism_io::kernel_table::read_kernel_table_for(path, job)?),
        None => None,
    };
    let mode = match (&args.ranks, args.reduced) {
        (Some(list), _) => Mode::Slice(parse_rank_list(list, "--ranks", num_ranks)?),
        (None, true) => Mode::Reduced,
        (None, false) => Mode::Full,
    };
    let record_ranks = if args.trace.is_some() {
        match args.trace_ranks.as_deref() {
            Some("all") => {
                if num_ranks > 4096 {
                    bail!(
                        "--trace-ranks all: {num_ranks} ranks would make a trace too large to open; give a list"
                    );
                }
                (0..num_ranks).collect()
            }
            Some(list) => parse_rank_list(list, "--trace-ranks", num_ranks)?,
            None => sample_ranks(job),
        }
    } else {
        Vec::new()
    };
    // In reduced and sliced runs only simulated ranks can be traced: a list that names others
    // is an error rather than a trace that silently holds fewer ranks.
    let explicit = args.trace.is_some() && args.trace_ranks.is_some();
    let record_ranks = match &mode {
        Mode::Full => record_ranks,
        Mode::Reduced => {
            let reps: Vec<u32> = sample_ranks(job)[..job.parallel.pp as usize].to_vec();
            if explicit && record_ranks.iter().any(|r| !reps.contains(r)) {
                bail!(
                    "--trace-ranks with --reduced: a reduced run simulates one representative \
                     per pipeline stage (ranks {}), so only those can be traced; omit \
                     --trace-ranks, drop --reduced, or simulate the ranks you want with --ranks",
                    reps.iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                );
            }
            reps
        }
        Mode::Slice(list) => {
            let missing: Vec<String> = (record_ranks.iter())
                .filter(|r| !list.contains(r))
                .map(u32::to_string)
                .collect();
            if explicit && !missing.is_empty() {
                bail!(
                    "--trace-ranks names ranks that --ranks does not simulate ({}); add them to \
                     --ranks or omit --trace-ranks to trace every simulated rank",
                    missing.join(",")
                );
            }
            if explicit { record_ranks } else { list.clone() }
        }
    };
    let opts = SimOptions {
        mode,
        kernel_table,
        record_ranks,
        ..SimOptions::default()
    };
    // The trace file is created before the run, so that a bad path fails at once.
    let trace_file = match &args.trace {
        Some(path) => Some(
            File::create(path)
                .with_context(|| format!("cannot create trace file {}", path.display()))?,
        ),
        None => None,
    };
    // A spinner while the engine runs (hidden when stderr is not a terminal): a full run of
    // tens of thousands of ranks takes seconds.
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "simulating one iteration of {} GPUs ({})",
        job.num_gpus(),
        match &opts.mode {
            Mode::Full => "every rank",
            Mode::Reduced => "one representative per stage",
            Mode::Slice(_) => "a slice of ranks",
        }
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let result = prism_core::simulate(job, &opts).context("simulation failed");
    spinner.finish_and_clear();
    let result = result?;
    if let (Some(path), Some(file)) = (&args.trace, trace_file) {
        let mut w = BufWriter::new(file);
        prism_io::trace::write_chrome_trace(&result, &mut w)
            .and_then(|_| w.flush())
            .with_context(|| format!("cannot write trace file {}", path.display()))?;
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        let mut v = prism_io::report_json::summary_json(&result, job);
        if let Some(p) = &loaded.published {
            v["published"] = prism_io::report_json::published_json(p, &result.summary);
            // The figures belong to the job as written; say so when --set changed it.
            v["published"]["job_overridden"] = serde_json::json!(!args.sets.is_empty());
        }
        serde_json::to_writer_pretty(&mut out, &v)?;
        writeln!(out)?;
    } else {
        print_summary(&mut out, job, &result, &loaded.source, args)?;
        if let Some(p) = &loaded.published {
            print_published(&mut out, p, &result.summary, !args.sets.is_empty())?;
        }
    }
    Ok(())
}

/// The `[published]` figures beside Prism's (nominal and with stragglers).
fn print_published(
    out: &mut impl Write,
    p: &prism_io::jobfile::Published,
    s: &prism_core::report::Summary,
    overridden: bool,
) -> Result<()> {
    writeln!(out)?;
    writeln!(
        out,
        "  published{}",
        p.source
            .as_ref()
            .map(|x| format!(" ({x})"))
            .unwrap_or_default()
    )?;
    if overridden {
        writeln!(
            out,
            "    (published for the job as written: this run changed it with --set, so the errors below compare different setups)"
        )?;
    }
    for r in prism_io::report_json::published_rows(p, s) {
        // MFU is printed in percent.
        let (label, scale) = match r.key {
            "tflops_per_gpu" => ("TFLOP/s per GPU", 1.0),
            "mfu" => ("MFU (%)", 100.0),
            _ => ("iteration time (s)", 1.0),
        };
        writeln!(
            out,
            "    {label:<22}{:>10.1}   Prism {:.1} ({:+.1}%), with stragglers {:.1} ({:+.1}%)",
            scale * r.published,
            scale * r.predicted,
            r.error_pct,
            scale * r.predicted_expected,
            r.error_expected_pct
        )?;
    }
    if p.attention_flops == prism_io::jobfile::AttentionFlops::Causal {
        writeln!(
            out,
            "    (model FLOPs as published: causal attention counted by its unmasked half)"
        )?;
    }
    writeln!(
        out,
        "    (error: + means Prism predicts a faster run than published)"
    )?;
    Ok(())
}

fn schedule_name(job: &Job) -> &'static str {
    match job.parallel.schedule {
        prism_core::job::Schedule::GPipe => "gpipe",
        prism_core::job::Schedule::OneFOneB => "1f1b",
        prism_core::job::Schedule::Interleaved => "interleaved 1f1b",
        prism_core::job::Schedule::DualPipe => "dualpipe",
        prism_core::job::Schedule::OneFOneBOverlap => "1f1b with EP overlap",
    }
}

fn print_summary(
    out: &mut impl Write,
    job: &Job,
    r: &SimResult,
    source: &str,
    args: &SimulateArgs,
) -> Result<()> {
    let s = &r.summary;
    let p = &job.parallel;
    let t = s.iteration_time_s;
    writeln!(out, "Prism simulate: {}  ({source})", s.name)?;
    writeln!(
        out,
        "  {} x {} GPUs ({} nodes); tp {} pp {} cp {} ep {} dp {}{}; {} schedule{}, micro-batch {}, {}; recompute {:?}; {}",
        s.num_gpus,
        job.cluster.gpu.name,
        job.cluster.nodes,
        p.tp,
        p.pp,
        p.cp,
        p.ep,
        p.dp,
        {
            let mut extra = Vec::new();
            if p.order != prism_core::job::RankOrder::TpCpEpDpPp {
                extra.push(format!("order {}", p.order.name()));
            }
            if p.zero_stage != 1 {
                extra.push(format!("ZeRO-{}", p.zero_stage));
            }
            if job.training.stack != prism_core::job::Stack::MegatronCore {
                extra.push(format!("stack {}", job.training.stack.name()));
            }
            if extra.is_empty() {
                String::new()
            } else {
                format!(" ({})", extra.join(", "))
            }
        },
        schedule_name(job),
        match (&p.pipeline_layout, p.vpp) {
            (Some(l), v) => format!(" (vpp {v}, layout \"{}\")", l.text),
            (None, v) if v > 1 => format!(" (vpp {v})"),
            _ => String::new(),
        },
        p.micro_batch,
        if p.pipeline_rounds > 1 {
            format!(
                "{} micro-batches in {} runs of the schedule ({} each)",
                job.micro_batches(),
                p.pipeline_rounds,
                job.round_micro_batches()
            )
        } else {
            format!("{} micro-batches", job.micro_batches())
        },
        p.recompute,
        job.training.precision,
    )?;
    let m = &job.model;
    // MoE models: also the count without the input embedding, as DeepSeek publishes theirs.
    let without_input = if m.moe.is_some() && !m.tied_embeddings {
        format!(
            "; {:.2} B without the input embedding",
            m.active_params_without_input_embedding() as f64 / 1e9
        )
    } else {
        String::new()
    };
    writeln!(
        out,
        "  model: {} layers, {:.2} B parameters, {:.2} B active per token (embeddings included{without_input})",
        m.layers,
        m.params() as f64 / 1e9,
        m.active_params() as f64 / 1e9,
    )?;
    let mode = match (&args.ranks, args.reduced) {
        (Some(_), _) => "slice (requested ranks + one representative per stage)",
        (None, true) => "reduced (one representative per pipeline stage)",
        _ => "full (every rank)",
    };
    writeln!(
        out,
        "  simulated: {mode}; {} events, {} graph ops in {} programs",
        r.events, s.graph_ops, s.programs
    )?;
    writeln!(out)?;
    writeln!(out, "  iteration time          {:>10.3} s", t)?;
    writeln!(
        out,
        "  throughput              {:>10.0} tokens/s  ({:.0} per GPU)",
        s.tokens_per_s,
        s.tokens_per_s / s.num_gpus as f64
    )?;
    writeln!(
        out,
        "  model TFLOP/s per GPU   {:>10.1}      MFU {:>5.1}%  (Megatron: causal attention in full; {:.1}% counting its unmasked half)",
        s.model_tflops_per_gpu,
        100.0 * s.mfu,
        100.0 * s.mfu_causal
    )?;
    writeln!(
        out,
        "  hardware TFLOP/s / GPU  {:>10.1}      HFU {:>5.1}%",
        s.hardware_tflops_per_gpu,
        100.0 * s.hfu
    )?;
    writeln!(
        out,
        "  with stragglers         {:>10.3} s   {:.1} TFLOP/s per GPU, MFU {:.1}%  (expected slowest of {} GPUs, speed spread {:.1}%)",
        s.expected_iteration_time_s,
        s.expected_model_tflops_per_gpu,
        100.0 * s.expected_mfu,
        s.num_gpus,
        100.0 * job.cluster.gpu_speed_cv
    )?;
    writeln!(
        out,
        "  pipeline bubble         {:>10.1} %",
        100.0 * s.bubble_fraction
    )?;
    let (stage, _) = memory::peak_memory(job);
    writeln!(
        out,
        "  peak memory             {:>10.1} GiB per GPU (stage {stage}) of {:.0} GiB{}",
        gib(s.peak_memory_bytes),
        job.cluster.gpu.hbm_gib,
        if gib(s.peak_memory_bytes) > job.cluster.gpu.hbm_gib {
            "  ** DOES NOT FIT: simulated with --allow-oom **"
        } else {
            ""
        }
    )?;
    let per_stage: Vec<String> = s
        .stage_memory_bytes
        .iter()
        .map(|&b| format!("{:.1}", gib(b)))
        .collect();
    writeln!(out, "  memory per stage (GiB)  {}", per_stage.join(" "))?;
    writeln!(out)?;
    writeln!(out, "  where the time goes (mean per GPU)")?;
    for (name, secs) in s.breakdown.parts() {
        let label = match name {
            "compute" => "compute",
            "exposed_tp" => "exposed TP comm",
            "exposed_cp" => "exposed CP comm",
            "exposed_ep" => "exposed EP comm",
            "exposed_pp" => "exposed PP comm",
            "exposed_dp" => "exposed DP comm",
            _ => "pipeline bubble",
        };
        let bar = "#".repeat((40.0 * secs / t).round().clamp(0.0, 40.0) as usize);
        writeln!(
            out,
            "    {label:<17} {secs:>9.3} s {:>6.1}%  {bar}",
            100.0 * secs / t
        )?;
    }
    if let Some(list) = &args.ranks {
        let _ = list;
        writeln!(out)?;
        writeln!(
            out,
            "  requested ranks (finish s, compute s, exposed comm s, bubble s)"
        )?;
        for rt in &r.ranks {
            let b = &rt.breakdown;
            writeln!(
                out,
                "    rank {:>6}  {:>9.4}  {:>9.4}  {:>9.4}  {:>9.4}",
                rt.rank,
                rt.finish_s,
                rt.compute_s,
                b.tp_s + b.cp_s + b.ep_s + b.pp_s + b.dp_s,
                b.bubble_s
            )?;
        }
    }
    if let Some(path) = &args.trace {
        writeln!(out)?;
        let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        // The browser UI loads JSON traces into tab memory; past about 1 GB it fails.
        let open = if bytes > 1 << 30 {
            "too large for the browser: open it with Perfetto's trace_processor \
             (`trace_processor --httpd FILE`, then https://ui.perfetto.dev), or trace fewer ranks \
             with --trace-ranks"
        } else {
            "open it at https://ui.perfetto.dev"
        };
        writeln!(
            out,
            "  trace: {} ({} ranks, {:.1} MB) - {open}",
            path.display(),
            r.timelines.len(),
            bytes as f64 / 1e6
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_parse_and_reject() {
        assert_eq!(
            parse_rank_list("0, 8,3-5,5", "--ranks", 16).unwrap(),
            vec![0, 3, 4, 5, 8]
        );
        for bad in ["", "x", "3-1", "16", "2-99", "-"] {
            let e = parse_rank_list(bad, "--ranks", 16).unwrap_err().to_string();
            assert!(e.starts_with("--ranks"), "{bad}: {e}");
        }
    }
}
