//! `prism emulate`: hybrid emulation (PrismLLM). `slice` builds a target-scale graph from
//! recorded traces; `synth` writes synthetic traces of a GPT-like step; `prism emulate GRAPH`
//! runs the coordinator. See docs/emulate.md.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use prism_core::job::Cluster;
use prism_emulate::coordinator::{self, Clock, Listen, Setup};
use prism_emulate::graph_file::{ClusterSpec, LayoutSpec, SlicedGraph};
use prism_emulate::slice::{self, RankTrace};
use prism_emulate::synth::{self, SynthSpec};

/// `prism emulate`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct EmulateArgs {
    #[command(subcommand)]
    command: Option<EmulateCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, clap::Subcommand)]
enum EmulateCommand {
    /// Build the target-scale graph from recorded traces (one per pipeline stage at least) and
    /// print its statistics.
    Slice(SliceArgs),
    /// Write synthetic recorded traces of a GPT-like tp/pp/dp step (for trying slicing and the
    /// coordinator without a workload).
    Synth(SynthArgs),
    /// Run the reference workload all-real (every rank a process over TCP) and hybrid (the
    /// real ranks against the coordinator, the others replayed), and compare iteration times
    /// and peak memory.
    Validate(ValidateArgs),
    /// One rank of the reference workload (what `validate` launches; `prism-gpt-worker`'s
    /// arguments and environment).
    #[command(hide = true)]
    Worker(WorkerCliArgs),
}

/// `prism emulate validate`.
#[derive(Debug, clap::Args)]
struct ValidateArgs {
    /// Ranks of the job (must equal tp x pp x dp).
    #[arg(long, default_value_t = 8)]
    world: u32,
    /// Layout `tp,pp,dp`.
    #[arg(long, value_name = "TP,PP,DP", default_value = "2,2,2")]
    layout: String,
    /// Ranks that run for real in the hybrid run, e.g. `0` or `0,5`.
    #[arg(long, value_name = "LIST", default_value = "0")]
    real_ranks: String,
    /// Warm-up steps before the measured ones (not measured).
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Measured steps per run.
    #[arg(long, default_value_t = 5)]
    iters: u32,
    /// Runs of each kind; medians are over every measured step of every run.
    #[arg(long, default_value_t = 3)]
    repeats: u32,
    /// Cluster preset communication is priced on, in both runs.
    #[arg(long, default_value = "dgx-h100")]
    cluster: String,
    /// Override a cluster key, e.g. `--set cluster.nvlink_gbps=800`.
    #[arg(long = "set", value_name = "cluster.KEY=VALUE")]
    sets: Vec<String>,
    /// Bound of every wait, seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Slice the virtual ranks from the all-real run's traces (its representatives' compute,
    /// measured under the same CPU contention) instead of recording them alone: isolates the
    /// emulation's own error from the machine's.
    #[arg(long)]
    slice_all_real: bool,
    /// How ranks measure compute: `cpu`, each rank's thread CPU time; `work`, the reference
    /// workload's counted floating-point operations at a nominal 1 GFLOP/s (deterministic:
    /// the same steps read the same whatever shares the cores, so the comparison shows the
    /// emulation's own error).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "work"])]
    compute_clock: String,
    /// Keep the traces and worker outputs here (default: a temporary directory, removed).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// `prism emulate worker ARGS...`.
#[derive(Debug, clap::Args)]
struct WorkerCliArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// Run the coordinator on a sliced graph.
#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Sliced graph (from `prism emulate slice`).
    #[arg(required = true)]
    graph: Option<PathBuf>,
    /// Ranks that run for real, e.g. `0,5` or `0-3`.
    #[arg(long, value_name = "LIST", required = true)]
    real_ranks: Option<String>,
    /// Where real ranks connect: `unix:PATH` or `tcp:127.0.0.1:PORT` (port 0: any free port).
    /// Default: a Unix socket in the temporary directory.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Bound of every wait (connecting, a rank's next call, processes exiting), seconds.
    #[arg(long, default_value_t = 120.0)]
    timeout_s: f64,
    /// Price communication on this cluster preset instead of the graph's.
    #[arg(long)]
    cluster: Option<String>,
    /// Override a cluster key, e.g. `--set cluster.nic_gbps=100` (after the graph's own).
    #[arg(long = "set", value_name = "cluster.KEY=VALUE")]
    sets: Vec<String>,
    /// `wall`: answer each call at the wall time of its emulated completion; `asap`: as soon
    /// as known (measures the coordinator itself).
    #[arg(long, default_value = "wall", value_parser = ["wall", "asap"])]
    clock: String,
    /// Training iterations the real ranks run: the graph (one recorded iteration) is repeated
    /// this many times (1: the graph is the whole session).
    #[arg(long, default_value_t = 1)]
    iterations: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Launch this command once per real rank (with PRISM_RANK, PRISM_WORLD_SIZE,
    /// PRISM_COORDINATOR, PRISM_LAYOUT set).
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct SliceArgs {
    /// Trace files, or directories of trace files (every file in them).
    #[arg(long, required = true, num_args = 1..)]
    traces: Vec<PathBuf>,
    /// Target layout `tp,pp,dp`.
    #[arg(long, value_name = "TP,PP,DP")]
    layout: String,
    /// Cluster preset the graph is priced on.
    #[arg(long, default_value = "dgx-h100")]
    cluster: String,
    /// Override a cluster key, e.g. `--set cluster.nic_gbps=100` (stored in the graph).
    #[arg(long = "set", value_name = "cluster.KEY=VALUE")]
    sets: Vec<String>,
    /// Write the sliced graph here (JSON, docs/emulate.md).
    #[arg(long)]
    out: PathBuf,
    /// Print the statistics as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct SynthArgs {
    /// Target layout `tp,pp,dp`.
    #[arg(long, value_name = "TP,PP,DP")]
    layout: String,
    /// Directory to write `rank-N.trace` files into.
    #[arg(long)]
    out: PathBuf,
    /// Write every rank's trace, not one per stage.
    #[arg(long)]
    all_ranks: bool,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 4)]
    micro_batches: u32,
    /// Layers per stage.
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// Forward compute of one layer, microseconds.
    #[arg(long, default_value_t = 200)]
    layer_us: u64,
}

/// Runs `prism emulate ...`.
pub fn run(args: &EmulateArgs) -> Result<()> {
    match &args.command {
        Some(EmulateCommand::Slice(a)) => run_slice(a),
        Some(EmulateCommand::Synth(a)) => run_synth(a),
        Some(EmulateCommand::Validate(a)) => run_validate(a),
        Some(EmulateCommand::Worker(a)) => run_worker(a),
        None => run_coordinator(&args.run),
    }
}

/// The cluster of preset `preset` with `sets` applied, with enough nodes for `ranks`.
pub fn resolve_cluster(preset: &str, sets: &[String], ranks: u32) -> Result<Cluster> {
    for s in sets {
        if !s.starts_with("cluster.") {
            bail!("--set {s}: only cluster keys can be set here (cluster.KEY=VALUE)");
        }
    }
    let gpn = {
        let text = prism_io::presets::cluster_preset(preset).ok_or_else(|| {
            anyhow!(
                "unknown cluster preset `{preset}` (known: {})",
                prism_io::presets::cluster_preset_names().join(", ")
            )
        })?;
        text.lines()
            .find_map(|l| l.trim().strip_prefix("gpus_per_node"))
            .and_then(|v| v.trim().trim_start_matches('=').trim().parse::<u32>().ok())
            .unwrap_or(8)
    };
    let gpn = sets
        .iter()
        .find_map(|s| s.strip_prefix("cluster.gpus_per_node="))
        .map(|v| v.trim().parse::<u32>())
        .transpose()
        .context("cluster.gpus_per_node")?
        .unwrap_or(gpn)
        .max(1);
    let nodes = ranks.div_ceil(gpn).max(1);
    let text = format!(
        "[model]\npreset = \"gpt-1.7b\"\n[cluster]\npreset = \"{preset}\"\nnodes = {nodes}\n\
         [parallel]\ntp = 1\npp = 1\nmicro_batch = 1\n[training]\nglobal_batch = {}\n",
        nodes as u64 * gpn as u64
    );
    let loaded = prism_io::jobfile::load_job_str(&text, &format!("cluster `{preset}`"), None, sets)
        .map_err(|e| anyhow!("{e}"))?;
    Ok(loaded.job.cluster)
}

fn run_slice(a: &SliceArgs) -> Result<()> {
    let layout = LayoutSpec::parse(&a.layout).map_err(|e| anyhow!("--layout: {e}"))?;
    let files = slice::trace_files(&a.traces).map_err(|e| anyhow!(e))?;
    let traces = files
        .iter()
        .map(|f| RankTrace::read(f))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!(e))?;
    let spec = ClusterSpec {
        preset: a.cluster.clone(),
        set: a.sets.clone(),
    };
    let n = layout.world_size().map_err(|e| anyhow!(e))?;
    let cluster = resolve_cluster(&a.cluster, &a.sets, n)?;
    let g = slice::slice(&traces, layout, spec).map_err(|e| anyhow!(e))?;
    let st = slice::stats(&g, &cluster).map_err(|e| anyhow!(e))?;
    std::fs::write(&a.out, g.to_json()).with_context(|| format!("writing {}", a.out.display()))?;
    if a.json {
        let classes: Vec<_> = (st.per_class.iter())
            .map(|c| {
                serde_json::json!({"stage": c.stage, "rank": c.rank, "ops": c.ops, "calls": c.calls,
                    "collectives": c.collectives, "sends": c.sends, "compute_s": c.compute_s,
                    "peak_memory_bytes": c.peak_memory_bytes})
            })
            .collect();
        let out = serde_json::json!({
            "out": a.out.display().to_string(), "traces": files.len(), "ranks": st.ranks,
            "classes": st.classes, "per_class": classes, "collectives": st.collectives,
            "sends": st.sends, "global_ops": st.global_ops, "iteration_time_s": st.iteration_s,
            "mode": st.mode, "cluster": cluster.name,
        });
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!(
        "Prism emulate slice: {} traces -> {} ranks (tp {} pp {} dp {}), {} classes",
        files.len(),
        st.ranks,
        layout.tp,
        layout.pp,
        layout.dp,
        st.classes
    )?;
    outln!("  stage  rank      ops    calls  collectives    sends   compute (s)  peak memory")?;
    for c in &st.per_class {
        outln!(
            "  {:>5} {:>5} {:>8} {:>8} {:>12} {:>8} {:>13.6} {:>12}",
            c.stage,
            c.rank,
            c.ops,
            c.calls,
            c.collectives,
            c.sends,
            c.compute_s,
            c.peak_memory_bytes
        )?;
    }
    outln!(
        "  global graph: {} ops, {} collectives, {} point-to-point messages",
        st.global_ops,
        st.collectives,
        st.sends
    )?;
    outln!(
        "  simulated iteration on {} ({} mode): {:.6} s",
        cluster.name,
        st.mode,
        st.iteration_s
    )?;
    outln!("  wrote {}", a.out.display())?;
    Ok(())
}

fn run_synth(a: &SynthArgs) -> Result<()> {
    let layout = LayoutSpec::parse(&a.layout).map_err(|e| anyhow!("--layout: {e}"))?;
    let n = layout.world_size().map_err(|e| anyhow!(e))?;
    if a.micro_batches == 0 || a.layers == 0 {
        bail!("--micro-batches and --layers must be positive");
    }
    let mut spec = SynthSpec::small(layout);
    spec.micro_batches = a.micro_batches;
    spec.layers = vec![a.layers; layout.pp as usize];
    spec.layer_us = a.layer_us;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let size = layout.tp * layout.dp;
    let ranks: Vec<u32> = if a.all_ranks {
        if n > 4096 {
            bail!("--all-ranks writes one file per rank; {n} is too many (at most 4096)");
        }
        (0..n).collect()
    } else {
        (0..layout.pp).map(|s| s * size).collect()
    };
    for &r in &ranks {
        let path = a.out.join(format!("rank-{r}.trace"));
        std::fs::write(&path, synth::trace(&spec, r).to_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    outln!("wrote {} traces to {}", ranks.len(), a.out.display())?;
    Ok(())
}

fn run_coordinator(a: &RunArgs) -> Result<()> {
    let path = a
        .graph
        .as_ref()
        .ok_or_else(|| anyhow!("give a sliced graph file"))?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let graph =
        SlicedGraph::from_json(&text, &path.display().to_string()).map_err(|e| anyhow!(e))?;
    let n = graph.layout.world_size().map_err(|e| anyhow!(e))?;
    let real = crate::parse_rank_list(
        a.real_ranks.as_deref().unwrap_or_default(),
        "--real-ranks",
        n,
    )?;
    let preset = a
        .cluster
        .clone()
        .unwrap_or_else(|| graph.cluster.preset.clone());
    let mut sets = graph.cluster.set.clone();
    sets.extend(a.sets.iter().cloned());
    let cluster = resolve_cluster(&preset, &sets, n)?;
    let listen = match &a.listen {
        Some(l) => Listen::parse(l).map_err(|e| anyhow!("--listen: {e}"))?,
        None => Listen::Unix(
            std::env::temp_dir().join(format!("prism-emulate-{}.sock", std::process::id())),
        ),
    };
    if !(a.timeout_s.is_finite() && a.timeout_s > 0.0 && a.timeout_s <= 86_400.0) {
        bail!("--timeout-s must be in (0, 86400]");
    }
    let setup = Setup {
        graph,
        cluster,
        real_ranks: real,
        listen,
        timeout: Duration::from_secs_f64(a.timeout_s),
        command: a.command.clone(),
        clock: if a.clock == "asap" {
            Clock::Asap
        } else {
            Clock::Wall
        },
        iterations: a.iterations.max(1),
        output_dir: None,
    };
    let rep = coordinator::run(&setup).map_err(|e| anyhow!("{e}"))?;
    if a.json {
        let ranks: Vec<_> = (rep.ranks.iter())
            .map(|r| {
                serde_json::json!({"rank": r.rank, "stage": r.stage, "calls": r.calls,
                    "emulated_end_s": r.emulated_end_s, "iteration_time_s": r.iteration_time_s,
                    "iteration_ends_s": r.iteration_ends_s,
                    "compute_s": r.compute_s, "max_lag_s": r.max_lag_s, "mean_lag_s": r.mean_lag_s,
                    "peak_memory_bytes": r.peak_memory_bytes})
            })
            .collect();
        let out = serde_json::json!({
            "world_size": rep.world_size, "address": rep.address, "mode": rep.mode,
            "emulated_s": rep.emulated_s, "emulated_iteration_s": rep.emulated_iteration_s,
            "wall_s": rep.wall_s, "setup_s": rep.setup_s, "events": rep.events,
            "real_ranks": ranks,
        });
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!(
        "Prism emulate: {} ranks, {} real ({}), engine {} mode, listening on {}",
        rep.world_size,
        rep.ranks.len(),
        (rep.ranks.iter().map(|r| r.rank.to_string()))
            .collect::<Vec<_>>()
            .join(","),
        rep.mode,
        rep.address
    )?;
    outln!(
        "  emulated: {:.6} s ({:.6} s per iteration); wall {:.3} s after {:.3} s of set-up; {} \
         engine events",
        rep.emulated_s,
        rep.emulated_iteration_s,
        rep.wall_s,
        rep.setup_s,
        rep.events
    )?;
    outln!(
        "  rank stage  calls  iteration (s)  compute (s)  max lag (s)  mean lag (s)  peak memory"
    )?;
    for r in &rep.ranks {
        outln!(
            "  {:>4} {:>5} {:>6} {:>14.6} {:>12.6} {:>12.6} {:>13.6} {:>12}",
            r.rank,
            r.stage,
            r.calls,
            r.iteration_time_s,
            r.compute_s,
            r.max_lag_s,
            r.mean_lag_s,
            r.peak_memory_bytes
        )?;
    }
    Ok(())
}

fn run_worker(a: &WorkerCliArgs) -> Result<()> {
    let parsed = prism_emulate::worker::parse(&a.args, |k| std::env::var(k).ok())
        .map_err(|e| anyhow!("prism emulate worker: {e}"))?;
    prism_emulate::worker::run(&parsed, |r| println!("{}", r.json()))
        .map_err(|e| anyhow!("prism emulate worker: rank {}: {e}", parsed.rank))
}

fn run_validate(a: &ValidateArgs) -> Result<()> {
    use prism_emulate::validate::{
        AllRealOptions, EngineCost, HybridOptions, WorkerCommand, compare, run_all_real, run_hybrid,
    };
    let config = prism_emulate::workload::Config::reference()
        .with_layout(&a.layout)
        .map_err(|e| anyhow!("--layout: {e}"))?;
    if config.world() as u32 != a.world {
        bail!(
            "--world {} does not match --layout {} ({} ranks)",
            a.world,
            a.layout,
            config.world()
        );
    }
    let real = crate::parse_rank_list(&a.real_ranks, "--real-ranks", a.world)?;
    if !(a.timeout_s.is_finite() && a.timeout_s > 0.0 && a.timeout_s <= 86_400.0) {
        bail!("--timeout-s must be in (0, 86400]");
    }
    let cluster = resolve_cluster(&a.cluster, &a.sets, a.world)?;
    let (work_dir, remove) = match &a.work_dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("prism-validate-{}", std::process::id())),
            true,
        ),
    };
    let worker = WorkerCommand {
        program: std::env::current_exe().context("locating the prism binary")?,
        args: vec![
            "emulate".into(),
            "worker".into(),
            "--compute-clock".into(),
            a.compute_clock.clone(),
        ],
    };
    let common = AllRealOptions {
        config,
        warmup: a.warmup,
        iters: a.iters,
        repeats: a.repeats,
        worker,
        timeout: Duration::from_secs_f64(a.timeout_s),
        work_dir: work_dir.join("all-real"),
        compute_lock: false,
    };
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "all-real: {} processes over TCP, {} runs",
        a.world, a.repeats
    ));
    spinner.enable_steady_tick(Duration::from_millis(120));
    let all_real = run_all_real(&common, &EngineCost::new(&cluster));
    spinner.set_message(format!(
        "hybrid: real ranks {:?} against the coordinator, {} runs",
        real, a.repeats
    ));
    let hybrid = all_real.and_then(|ar| {
        run_hybrid(&HybridOptions {
            common: AllRealOptions {
                work_dir: work_dir.join("hybrid"),
                ..common.clone()
            },
            real_ranks: real.clone(),
            cluster: cluster.clone(),
            cluster_spec: ClusterSpec {
                preset: a.cluster.clone(),
                set: a.sets.clone(),
            },
            slice_all_real: a.slice_all_real.then(|| common.work_dir.clone()),
        })
        .map(|h| (ar, h))
    });
    spinner.finish_and_clear();
    if remove {
        let _ = std::fs::remove_dir_all(&work_dir);
    }
    let (all_real, hybrid) = hybrid.map_err(|e| anyhow!(e))?;
    let v = compare(all_real, hybrid).map_err(|e| anyhow!(e))?;
    if a.json {
        let ranks: Vec<_> = v
            .ranks
            .iter()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank,
                    "all_real_iteration_time_s": r.all_real_iteration_time_s,
                    "hybrid_iteration_time_s": r.hybrid_iteration_time_s,
                    "iteration_time_error_pct": r.iteration_time_error_pct,
                    "all_real_peak_memory_bytes": r.all_real_peak_memory_bytes,
                    "hybrid_peak_memory_bytes": r.hybrid_peak_memory_bytes,
                    "peak_memory_error_pct": r.peak_memory_error_pct,
                })
            })
            .collect();
        let all_ranks: Vec<_> = v
            .all_real
            .ranks
            .iter()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank, "iteration_time_s": r.chained_iteration_time_s,
                    "per_iteration_median_s": r.iteration_time_s,
                    "compute_s": r.compute_s, "wall_s": r.wall_s,
                    "peak_memory_bytes": r.peak_memory_bytes,
                })
            })
            .collect();
        let hy_ranks: Vec<_> = v
            .hybrid
            .ranks
            .iter()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank, "iteration_time_s": r.iteration_time_s,
                    "peak_memory_bytes": r.peak_memory_bytes, "max_lag_s": r.max_lag_s,
                })
            })
            .collect();
        let out = serde_json::json!({
            "world": a.world,
            "layout": a.layout,
            "real_ranks": real,
            "cluster": cluster.name,
            "warmup": a.warmup,
            "iters": a.iters,
            "repeats": a.repeats,
            "compute_clock": a.compute_clock,
            "slices_from": if a.slice_all_real { "all-real traces" } else { "recordings of one rank per stage, each alone" },
            "time_accounting": TIME_ACCOUNTING,
            "all_real": {
                "iteration_time_s": v.all_real.chained_iteration_time_s,
                "samples_s": v.all_real.chained_samples_s,
                "per_iteration_median_s": v.all_real.iteration_time_s,
                "ranks": all_ranks,
            },
            "hybrid": {
                "iteration_time_s": v.hybrid.iteration_time_s,
                "samples_s": v.hybrid.samples_s,
                "recorded_ranks": v.hybrid.recorded_ranks,
                "ranks": hy_ranks,
            },
            "ranks": ranks,
            "iteration_time_error_pct": v.iteration_time_error_pct,
            "peak_memory_error_pct": v.peak_memory_error_pct,
        });
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!(
        "Prism emulate validate: reference GPT step, {} ranks (tp,pp,dp {}), real ranks {:?}, \
         priced on {}",
        a.world,
        a.layout,
        real,
        cluster.name
    )?;
    outln!(
        "  {} warm-up + {} measured steps per run, {} runs of each kind; {}",
        a.warmup,
        a.iters,
        a.repeats,
        TIME_ACCOUNTING
    )?;
    outln!()?;
    outln!("  rank   all-real s   hybrid s   error %   all-real peak B   hybrid peak B   error %")?;
    for r in &v.ranks {
        outln!(
            "  {:>4}   {:>10.6}   {:>8.6}   {:>7.3}   {:>15}   {:>13}   {:>7.4}",
            r.rank,
            r.all_real_iteration_time_s,
            r.hybrid_iteration_time_s,
            r.iteration_time_error_pct,
            r.all_real_peak_memory_bytes,
            r.hybrid_peak_memory_bytes,
            r.peak_memory_error_pct
        )?;
    }
    outln!()?;
    outln!(
        "  job iteration: all-real {:.6} s, hybrid {:.6} s (emulated, every rank): error {:.3}%",
        v.all_real.chained_iteration_time_s,
        v.hybrid.iteration_time_s,
        v.iteration_time_error_pct
    )?;
    outln!(
        "  peak memory error (worst real rank): {:.4}%",
        v.peak_memory_error_pct
    )?;
    Ok(())
}

/// How both runs account time on a machine with fewer cores than ranks.
const TIME_ACCOUNTING: &str = "compute is each rank's own thread CPU time (so ranks sharing \
cores are not slowed by each other); all-real iteration times replay each rank's measured \
compute and its calls, the measured iterations back to back, on a logical clock with \
communication priced by Prism's cost model on the cluster; hybrid ones are the engine's \
emulated times for the same cluster; both are a run's end over its iterations";
