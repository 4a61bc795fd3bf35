//! One rank of the reference workload as a process (`prism-gpt-worker`; the CLI may re-use
//! [`run`] behind a subcommand). See `docs/emulate.md`, "Reference workload".
//!
//! Environment: `PRISM_RANK`, `PRISM_WORLD_SIZE`, `PRISM_LAYOUT` (`tp,pp,dp`), and the
//! backend: `--record FILE` (recording, no peers), else `--tcp ADDR` or `PRISM_TCP_ADDR`
//! (all-real mesh; rank 0 listens there), else `PRISM_COORDINATOR` (`unix:PATH` or
//! `tcp:127.0.0.1:PORT`, emulated). Runs `--warmup` then `--iters` training steps (emulated: the
//! warm-up steps run on the recording backend before the worker connects, so the coordinator
//! sees exactly the measured steps) and prints
//! one JSON line per measured iteration on stdout:
//! `{"rank":R,"iter":K,"wall_s":..,"compute_s":..,"peak_memory_bytes":..,"loss":..,"calls":..,"emulated_end_s":..|null}`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::workload::{Config, Model, mem};

/// What the worker was asked to do.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerArgs {
    pub rank: u32,
    pub world: u32,
    pub config: Config,
    pub warmup: u32,
    pub iters: u32,
    pub record: Option<PathBuf>,
    pub tcp: Option<String>,
    pub coordinator: Option<String>,
    /// Writes `rank{R}.iter{K}.trace` for each measured iteration `K` here.
    pub trace_dir: Option<PathBuf>,
    /// Compute lock file (`--compute-lock` or `PRISM_COMPUTE_LOCK`), see
    /// [`Communicator::set_compute_lock`].
    pub compute_lock: Option<PathBuf>,
    pub timeout: Duration,
    /// Compute measured by the work clock (counted FLOPs at a nominal rate,
    /// [`crate::workload::kernels::work_clock_s`]) instead of thread CPU time
    /// (`--compute-clock work`, or `PRISM_COMPUTE_CLOCK=work`).
    pub work_clock: bool,
}

/// The usage text.
pub const USAGE: &str =
    "usage: prism-gpt-worker [--record FILE | --tcp HOST:PORT] [--layout tp,pp,dp] \
[--warmup N] [--iters N] [--trace-dir DIR] [--compute-lock FILE] [--compute-clock cpu|work] [--timeout-s S] [--hidden N] [--layers N] [--heads N] \
[--ffn N] [--vocab N] [--seq N] [--micro-batches N] [--seed N]
environment: PRISM_RANK, PRISM_WORLD_SIZE, PRISM_LAYOUT, PRISM_TCP_ADDR, PRISM_COORDINATOR, PRISM_COMPUTE_LOCK, PRISM_COMPUTE_CLOCK";

/// Parses arguments (without the program name) and the environment (`env(key)`).
pub fn parse(args: &[String], env: impl Fn(&str) -> Option<String>) -> Result<WorkerArgs, String> {
    let mut layout = env("PRISM_LAYOUT").unwrap_or_else(|| "1,1,1".into());
    let mut cfg = Config::reference();
    let mut warmup = 1u32;
    let mut iters = 3u32;
    let mut record = None;
    let mut tcp = env("PRISM_TCP_ADDR");
    let mut trace_dir = None;
    let mut compute_lock = env("PRISM_COMPUTE_LOCK").map(PathBuf::from);
    let mut timeout_s = 120.0f64;
    let mut clock = env("PRISM_COMPUTE_CLOCK").unwrap_or_else(|| "cpu".into());
    let mut i = 0;
    while i < args.len() {
        let key = args[i].as_str();
        let val = args
            .get(i + 1)
            .ok_or_else(|| format!("{key} needs a value\n{USAGE}"))?;
        let num = || {
            val.parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{key} {val:?}: expected a positive integer"))
        };
        match key {
            "--record" => record = Some(PathBuf::from(val)),
            "--tcp" => tcp = Some(val.clone()),
            "--layout" => layout = val.clone(),
            "--warmup" => {
                warmup = val
                    .parse()
                    .map_err(|_| format!("--warmup {val:?}: expected an integer"))?
            }
            "--iters" => iters = num()? as u32,
            "--trace-dir" => trace_dir = Some(PathBuf::from(val)),
            "--compute-lock" => compute_lock = Some(PathBuf::from(val)),
            "--compute-clock" => clock = val.clone(),
            "--timeout-s" => {
                timeout_s = val
                    .parse::<f64>()
                    .ok()
                    .filter(|t| t.is_finite() && *t > 0.0)
                    .ok_or_else(|| format!("--timeout-s {val:?}: expected positive seconds"))?
            }
            "--hidden" => cfg.hidden = num()?,
            "--layers" => cfg.layers = num()?,
            "--heads" => cfg.heads = num()?,
            "--ffn" => cfg.ffn = num()?,
            "--vocab" => cfg.vocab = num()?,
            "--seq" => cfg.seq = num()?,
            "--micro-batches" => cfg.micro_batches = num()?,
            "--seed" => cfg.seed = num()? as u64,
            _ => return Err(format!("unknown argument {key:?}\n{USAGE}")),
        }
        i += 2;
    }
    let cfg = cfg.with_layout(&layout)?;
    cfg.validate()?;
    let get = |k: &str| -> Result<u32, String> {
        let v = env(k).ok_or_else(|| format!("{k} is not set"))?;
        v.parse()
            .map_err(|_| format!("{k}={v:?}: expected a non-negative integer"))
    };
    let rank = get("PRISM_RANK")?;
    let world = get("PRISM_WORLD_SIZE")?;
    if world as usize != cfg.world() {
        return Err(format!(
            "PRISM_WORLD_SIZE={world} but layout {layout} has {} ranks",
            cfg.world()
        ));
    }
    if rank >= world {
        return Err(format!("PRISM_RANK={rank} outside a world of {world}"));
    }
    let coordinator = env("PRISM_COORDINATOR");
    if record.is_none() && tcp.is_none() && coordinator.is_none() {
        return Err(format!(
            "no backend: give --record FILE, --tcp ADDR (or PRISM_TCP_ADDR) or PRISM_COORDINATOR\n{USAGE}"
        ));
    }
    let work_clock = match clock.as_str() {
        "cpu" => false,
        "work" => true,
        other => return Err(format!("--compute-clock {other:?}: expected cpu or work")),
    };
    Ok(WorkerArgs {
        rank,
        world,
        config: cfg,
        warmup,
        iters,
        record,
        tcp,
        coordinator,
        trace_dir,
        compute_lock,
        timeout: Duration::from_secs_f64(timeout_s),
        work_clock,
    })
}

/// One measured iteration of one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct IterReport {
    pub rank: u32,
    pub iter: u32,
    /// Wall seconds of the iteration.
    pub wall_s: f64,
    /// CPU seconds of compute (between calls) in the iteration.
    pub compute_s: f64,
    /// Ledger peak of the iteration (bytes of live tensors, parameters and optimizer state
    /// included).
    pub peak_memory_bytes: u64,
    /// This rank's share of the loss.
    pub loss: f64,
    /// Communication calls in the iteration.
    pub calls: usize,
    /// The emulated backend's completion time of the iteration's last call.
    pub emulated_end_s: Option<f64>,
}

impl IterReport {
    /// The JSON line the worker prints.
    pub fn json(&self) -> String {
        format!(
            "{{\"rank\":{},\"iter\":{},\"wall_s\":{:e},\"compute_s\":{:e},\"peak_memory_bytes\":{},\"loss\":{:e},\"calls\":{},\"emulated_end_s\":{}}}",
            self.rank,
            self.iter,
            self.wall_s,
            self.compute_s,
            self.peak_memory_bytes,
            self.loss,
            self.calls,
            self.emulated_end_s
                .map_or("null".to_string(), |t| format!("{t:e}"))
        )
    }
}

/// Runs the worker; calls `out` with each measured iteration's report.
pub fn run(a: &WorkerArgs, mut out: impl FnMut(&IterReport)) -> Result<(), String> {
    let emulated = a.record.is_none() && a.tcp.is_none();
    let mut model = Model::new(&a.config, a.rank as usize)?;
    // Emulated: warm up on the recording backend (the coordinator's copy rule, no traffic), so
    // the coordinator's session holds exactly the measured iterations.
    let mut first = 0;
    if emulated {
        let mut local = Communicator::local(a.rank, a.world);
        if a.work_clock {
            local.set_clock(Box::new(crate::workload::kernels::work_clock_s));
        }
        for it in 0..a.warmup {
            model
                .train_step(&mut local, it as u64)
                .map_err(|e| e.to_string())?;
        }
        first = a.warmup;
    }
    let mut comm = if a.record.is_some() {
        Communicator::local(a.rank, a.world)
    } else if let Some(addr) = &a.tcp {
        Communicator::tcp(a.rank, a.world, addr, a.timeout).map_err(|e| e.to_string())?
    } else if let Some(addr) = &a.coordinator {
        Communicator::emulated(a.rank, a.world, addr, a.timeout, a.timeout)
            .map_err(|e| e.to_string())?
    } else {
        return Err("no backend".into());
    };
    if let Some(p) = &a.compute_lock {
        comm.set_compute_lock(p).map_err(|e| e.to_string())?;
    }
    if a.work_clock {
        comm.set_clock(Box::new(crate::workload::kernels::work_clock_s));
    }
    comm.reset_compute_clock();
    let mut last = None;
    for it in first..a.warmup + a.iters {
        mem::reset_peak();
        let t0 = Instant::now();
        let loss = model
            .train_step(&mut comm, it as u64)
            .map_err(|e| e.to_string())?;
        let wall_s = t0.elapsed().as_secs_f64();
        let peak = mem::peak_bytes();
        let emulated_end_s = comm.emulated_time();
        let trace = comm.start_iteration(peak);
        if it < a.warmup {
            continue;
        }
        let k = it - a.warmup;
        if let Some(d) = &a.trace_dir {
            trace.write_file(&d.join(format!("rank{}.iter{k}.trace", a.rank)))?;
        }
        out(&IterReport {
            rank: a.rank,
            iter: k,
            wall_s,
            compute_s: trace.compute_s(),
            peak_memory_bytes: peak,
            loss,
            calls: trace.calls.len(),
            emulated_end_s,
        });
        last = Some(trace);
    }
    let peak = last.as_ref().map_or(0, |t| t.peak_memory_bytes);
    comm.finish(peak).map_err(|e| e.to_string())?;
    if let (Some(path), Some(t)) = (&a.record, &last) {
        t.write_file(path)?;
    }
    Ok(())
}

impl IterReport {
    /// Reads a line [`IterReport::json`] wrote (`None` for any other line).
    pub fn parse(line: &str) -> Option<IterReport> {
        let field = |key: &str| -> Option<&str> {
            let pat = format!("\"{key}\":");
            let i = line.find(&pat)? + pat.len();
            let rest = &line[i..];
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            Some(rest[..end].trim())
        };
        let end = field("emulated_end_s")?;
        Some(IterReport {
            rank: field("rank")?.parse().ok()?,
            iter: field("iter")?.parse().ok()?,
            wall_s: field("wall_s")?.parse().ok()?,
            compute_s: field("compute_s")?.parse().ok()?,
            peak_memory_bytes: field("peak_memory_bytes")?.parse().ok()?,
            loss: field("loss")?.parse().ok()?,
            calls: field("calls")?.parse().ok()?,
            emulated_end_s: if end == "null" {
                None
            } else {
                Some(end.parse().ok()?)
            },
        })
    }
}
