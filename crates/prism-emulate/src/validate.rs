//! The all-real half of `prism emulate validate` (`docs/emulate.md`, "Validation"): N worker
//! processes of the reference workload over the TCP mesh, and their per-rank iteration times
//! and peak memory.
//!
//! Time accounting. The machine has two cores, so N = 8 processes cannot run side by side in
//! real time, and their wall clocks measure the scheduler more than the program. Each rank
//! therefore measures its compute as its own thread's CPU time between communication calls
//! (`Call::compute_s`), and writes one trace per measured iteration (the recorded-trace format).
//! The iteration time is then the *logical clock* of [`replay`]: every rank starts at 0 and
//! advances by its measured compute; a collective starts when the last member arrives and ends
//! for all members `cost` seconds later; a send takes `cost` seconds on the sender and its
//! message is available to the receiver from then on; a receive ends at the later of its
//! arrival and the message's availability. A rank's iteration time is its clock after its last
//! compute; the job's is the largest. These are the engine's rules for collectives and sends
//! (`prism_core::engine`), so the hybrid run, priced by the same [`CommCost`], differs from
//! the all-real one only by what emulation changes.
//!
//! Peak memory is the workload's tensor ledger ([`crate::workload::mem`]), deterministic and
//! backend-independent. Results are medians over measured iterations and repeats.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::comm::Trace;
use crate::protocol::{Call, Op};
use crate::workload::Config;

/// Prices one communication call.
pub trait CommCost: fmt::Debug + Sync {
    /// Seconds `call` of rank `rank` takes, once every member has arrived (for a send: on the
    /// wire), in a group of `group_size` ranks (2 for a send).
    fn seconds(&self, rank: u32, call: &Call, group_size: usize) -> f64;
}

/// The alpha-beta model of ring algorithms: with `g` ranks and `n` bytes contributed, an
/// all-reduce takes `2(g-1)` latencies plus `2(g-1)/g * n` bytes of bandwidth time, a
/// reduce-scatter and an all-to-all `(g-1)` latencies and `(g-1)/g * n` bytes, an all-gather
/// `(g-1)` latencies and `(g-1) * n` bytes, a broadcast `(g-1)` latencies and `n` bytes, a
/// barrier `(g-1)` latencies, a send one latency and `n` bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlphaBeta {
    pub latency_s: f64,
    pub bytes_per_s: f64,
}

impl Default for AlphaBeta {
    /// 10 us and 25 GB/s: a slow intra-node link, so communication is visible next to the
    /// small CPU workload.
    fn default() -> Self {
        AlphaBeta {
            latency_s: 10e-6,
            bytes_per_s: 25e9,
        }
    }
}

impl CommCost for AlphaBeta {
    fn seconds(&self, _rank: u32, call: &Call, g: usize) -> f64 {
        let n = call.bytes as f64;
        let gf = g as f64;
        let steps = (g.saturating_sub(1)) as f64;
        let (lat, bytes) = match Op::try_from(call.op).unwrap_or(Op::Unspecified) {
            Op::AllReduce => (2.0 * steps, 2.0 * steps / gf * n),
            Op::ReduceScatter | Op::AllToAll => (steps, steps / gf * n),
            Op::AllGather => (steps, steps * n),
            Op::Broadcast => (steps, if g > 1 { n } else { 0.0 }),
            Op::Barrier => (steps, 0.0),
            Op::Send | Op::Recv => (1.0, n),
            Op::Unspecified => (0.0, 0.0),
        };
        lat * self.latency_s + bytes / self.bytes_per_s
    }
}

/// Prism's own prices (`prism_core::cost::comm`), as the engine charges a call on an idle
/// network: collectives by [`plan_collective`](prism_core::cost::comm::plan_collective)
/// (NCCL's algorithm and protocol choice; a broadcast priced as an all-gather of its bytes, a
/// barrier as an all-reduce of nothing), sends by
/// [`plan_p2p`](prism_core::cost::comm::plan_p2p) over NVLink inside a node and the NIC across.
/// Rank `r` sits on node `r / gpus_per_node`.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineCost {
    pub cluster: prism_core::job::Cluster,
    pub params: prism_core::cost::comm::CommParams,
}

impl EngineCost {
    /// The prices of `cluster` with its GPU generation's calibrated parameters.
    pub fn new(cluster: &prism_core::job::Cluster) -> Self {
        EngineCost {
            cluster: cluster.clone(),
            params: prism_core::cost::comm::CommParams::for_gpu(&cluster.gpu),
        }
    }
}

impl CommCost for EngineCost {
    fn seconds(&self, rank: u32, call: &Call, g: usize) -> f64 {
        use prism_core::cost::comm::{Collective, GroupShape, plan_collective, plan_p2p};
        let per = self.cluster.gpus_per_node.max(1);
        let op = Op::try_from(call.op).unwrap_or(Op::Unspecified);
        let plan = match op {
            Op::Send | Op::Recv => plan_p2p(
                call.bytes,
                rank / per == call.peer / per,
                &self.cluster,
                &self.params,
            ),
            Op::Unspecified => return 0.0,
            _ => {
                let mut nodes: BTreeMap<u32, u32> = BTreeMap::new();
                for &r in &call.group {
                    *nodes.entry(r / per).or_insert(0) += 1;
                }
                let shape = GroupShape {
                    ranks: g as u32,
                    nodes: nodes.len() as u32,
                    per_node: nodes.values().copied().max().unwrap_or(1),
                };
                let (c, bytes) = match op {
                    Op::AllReduce => (Collective::AllReduce, call.bytes),
                    Op::ReduceScatter => (Collective::ReduceScatter, call.bytes),
                    Op::AllGather => (Collective::AllGather, call.bytes * g as u64),
                    Op::AllToAll => (Collective::AllToAll, call.bytes),
                    Op::Broadcast => (Collective::AllGather, call.bytes),
                    _ => (Collective::AllReduce, 0),
                };
                plan_collective(c, bytes, shape, &self.cluster, &self.params)
            }
        };
        plan.idle_seconds(&self.cluster, &self.params)
    }
}

/// A message in flight: (available at, bytes, sender's op index).
type Message = (f64, u64, u64);

/// The logical-clock replay of one iteration of every rank (`traces[r]` is rank `r`'s; see
/// the module documentation): each rank's iteration time. Errors name the rank, op index and
/// group of a call that cannot be matched (mismatched op or size, or a deadlock).
pub fn replay(traces: &[Trace], cost: &dyn CommCost) -> Result<Vec<f64>, String> {
    let n = traces.len();
    for (r, t) in traces.iter().enumerate() {
        if t.rank as usize != r {
            return Err(format!("trace {r} is rank {}'s", t.rank));
        }
    }
    // Occurrence of each collective on its group, per rank.
    let mut occ: Vec<Vec<u64>> = Vec::with_capacity(n);
    for t in traces {
        let mut seen: BTreeMap<&[u32], u64> = BTreeMap::new();
        occ.push(
            t.calls
                .iter()
                .map(|c| {
                    let e = seen.entry(c.group.as_slice()).or_insert(0);
                    *e += 1;
                    *e - 1
                })
                .collect(),
        );
    }
    let mut pc = vec![0usize; n];
    let mut release = vec![0.0f64; n];
    // Messages in flight per (src, dst): (available at, bytes, sender's op index).
    let mut mail: BTreeMap<(u32, u32), VecDeque<Message>> = BTreeMap::new();
    let at = |r: usize, i: usize| {
        let c = &traces[r].calls[i];
        format!(
            "rank {r}, op {i} ({:?}, group {:?})",
            Op::try_from(c.op).unwrap_or(Op::Unspecified),
            c.group
        )
    };
    loop {
        let mut progress = false;
        let mut done = true;
        for r in 0..n {
            let Some(c) = traces[r].calls.get(pc[r]) else {
                continue;
            };
            done = false;
            let arrive = release[r] + c.compute_s;
            let op = Op::try_from(c.op).unwrap_or(Op::Unspecified);
            match op {
                Op::Send => {
                    let end = arrive + cost.seconds(r as u32, c, 2);
                    mail.entry((r as u32, c.peer)).or_default().push_back((
                        end,
                        c.bytes,
                        pc[r] as u64,
                    ));
                    release[r] = end;
                    pc[r] += 1;
                    progress = true;
                }
                Op::Recv => {
                    if c.peer as usize >= n {
                        return Err(format!(
                            "{}: peer {} outside the world",
                            at(r, pc[r]),
                            c.peer
                        ));
                    }
                    if let Some((avail, bytes, sop)) = mail
                        .get_mut(&(c.peer, r as u32))
                        .and_then(|q| q.pop_front())
                    {
                        if bytes != c.bytes {
                            return Err(format!(
                                "{}: expects {} bytes, rank {} sent {bytes} (its op {sop})",
                                at(r, pc[r]),
                                c.bytes,
                                c.peer
                            ));
                        }
                        release[r] = arrive.max(avail);
                        pc[r] += 1;
                        progress = true;
                    }
                }
                _ => {
                    // Complete when every member's current call is this collective.
                    let k = occ[r][pc[r]];
                    let mut ready = true;
                    let mut start = arrive;
                    for &m in &c.group {
                        let m = m as usize;
                        if m >= n {
                            return Err(format!("{}: member {m} outside the world", at(r, pc[r])));
                        }
                        match traces[m].calls.get(pc[m]) {
                            Some(mc) if mc.group == c.group && occ[m][pc[m]] == k => {
                                if mc.op != c.op || mc.bytes != c.bytes {
                                    return Err(format!(
                                        "{}: rank {m} calls {:?} of {} bytes there (its op {}), not {op:?} of {} bytes",
                                        at(r, pc[r]),
                                        Op::try_from(mc.op).unwrap_or(Op::Unspecified),
                                        mc.bytes,
                                        pc[m],
                                        c.bytes
                                    ));
                                }
                                start = start.max(release[m] + mc.compute_s);
                            }
                            _ => {
                                ready = false;
                                break;
                            }
                        }
                    }
                    if ready {
                        let end = start + cost.seconds(r as u32, c, c.group.len());
                        for &m in &c.group {
                            release[m as usize] = end;
                            pc[m as usize] += 1;
                        }
                        progress = true;
                    }
                }
            }
        }
        if done {
            break;
        }
        if !progress {
            let r = (0..n).find(|&r| pc[r] < traces[r].calls.len()).unwrap_or(0);
            return Err(format!(
                "{}: never completes (its peers wait elsewhere or have ended)",
                at(r, pc[r])
            ));
        }
    }
    Ok(traces
        .iter()
        .enumerate()
        .map(|(r, t)| release[r] + t.tail_compute_s)
        .collect())
}

/// How to start one worker: a program and the arguments before the worker's own (for example
/// `prism-gpt-worker` and none, or `prism` and `emulate worker`).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// What to run all-real.
#[derive(Clone, Debug)]
pub struct AllRealOptions {
    /// Model and layout (`tp * pp * dp` processes).
    pub config: Config,
    pub warmup: u32,
    pub iters: u32,
    pub repeats: u32,
    pub worker: WorkerCommand,
    /// Bound on every wait of a worker and on a whole run.
    pub timeout: Duration,
    /// Where traces and worker output go (created).
    pub work_dir: PathBuf,
    /// Serialise the workers' compute with a lock file in `work_dir`
    /// ([`Communicator::set_compute_lock`](crate::comm::Communicator::set_compute_lock)).
    pub compute_lock: bool,
}

/// One rank's all-real result.
#[derive(Clone, Debug, PartialEq)]
pub struct RankResult {
    pub rank: u32,
    /// Median logical-clock iteration time.
    pub iteration_time_s: f64,
    /// Every sample (repeat-major, then iteration).
    pub iteration_times_s: Vec<f64>,
    /// Median CPU seconds of compute per iteration.
    pub compute_s: f64,
    /// Median wall seconds per iteration (contended: for information only).
    pub wall_s: f64,
    /// Peak of the tensor ledger (the same in every iteration and repeat, else an error).
    pub peak_memory_bytes: u64,
    /// Median over repeats of the rank's end of the whole run over the measured iterations,
    /// the iterations replayed back to back as they ran ([`chain`]): comparable with the
    /// coordinator's `emulated_end_s / iterations`.
    pub chained_iteration_time_s: f64,
}

/// The all-real run's result.
#[derive(Clone, Debug, PartialEq)]
pub struct AllRealResult {
    pub ranks: Vec<RankResult>,
    /// Median over samples of the job's iteration time (the slowest rank's).
    pub iteration_time_s: f64,
    /// The job's iteration time per sample.
    pub samples_s: Vec<f64>,
    /// Median over repeats of the run's end (every rank) over the measured iterations, the
    /// iterations replayed back to back ([`chain`]).
    pub chained_iteration_time_s: f64,
    /// That per repeat.
    pub chained_samples_s: Vec<f64>,
}

/// One rank's measured iterations as one trace, as they ran back to back: each iteration's
/// compute after its last call (its tail) is added to the next iteration's first segment, and
/// the last tail stays the tail. The per-iteration traces start every rank at 0; chained, a
/// rank starts an iteration when its previous one ended, as the real run (and the
/// coordinator's repeated graph) does.
pub fn chain(iterations: &[Trace]) -> Trace {
    let mut out = iterations.first().cloned().unwrap_or_default();
    for t in &iterations[1.min(iterations.len())..] {
        let mut carry = out.tail_compute_s;
        let base = out.calls.len() as u64;
        for c in &t.calls {
            let mut c = c.clone();
            c.seq += base;
            c.compute_s += carry;
            carry = 0.0;
            out.calls.push(c);
        }
        out.tail_compute_s = carry + t.tail_compute_s;
        out.peak_memory_bytes = out.peak_memory_bytes.max(t.peak_memory_bytes);
    }
    out
}

/// Keeps the first peak seen in `slot`; a later different one is the error `differs(first)`
/// (the workload's ledger gives the same peak every step).
fn same_peak(
    slot: &mut Option<u64>,
    peak: u64,
    differs: impl FnOnce(u64) -> String,
) -> Result<(), String> {
    match *slot {
        None => *slot = Some(peak),
        Some(p) if p != peak => return Err(differs(p)),
        Some(_) => {}
    }
    Ok(())
}

/// The median (mean of the middle two for an even count); NaN for none.
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let k = v.len();
    if k % 2 == 1 {
        v[k / 2]
    } else {
        0.5 * (v[k / 2 - 1] + v[k / 2])
    }
}

/// `100 * |measured - reference| / reference`.
pub fn error_pct(measured: f64, reference: f64) -> f64 {
    100.0 * (measured - reference).abs() / reference.abs()
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("bind: {e}"))
}

/// The worker arguments that fix `cfg`'s model (the layout goes by `PRISM_LAYOUT`).
pub fn model_args(cfg: &Config) -> Vec<String> {
    [
        ("--hidden", cfg.hidden as u64),
        ("--layers", cfg.layers as u64),
        ("--heads", cfg.heads as u64),
        ("--ffn", cfg.ffn as u64),
        ("--vocab", cfg.vocab as u64),
        ("--seq", cfg.seq as u64),
        ("--micro-batches", cfg.micro_batches as u64),
        ("--seed", cfg.seed),
    ]
    .iter()
    .flat_map(|(k, v)| [k.to_string(), v.to_string()])
    .collect()
}

/// Kills and reaps every child still running (only the children this module started).
fn kill_all(children: &mut [(u32, Child)]) {
    for (_, c) in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// Starts `world` workers over TCP writing into `dir` and waits for them; on any failure or
/// time-out kills the others and names the rank with its error output.
fn launch(opts: &AllRealOptions, dir: &Path) -> Result<(), String> {
    let cfg = &opts.config;
    let world = cfg.world();
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut children: Vec<(u32, Child)> = Vec::new();
    for r in 0..world as u32 {
        let out = std::fs::File::create(dir.join(format!("rank{r}.out")))
            .map_err(|e| format!("create output of rank {r}: {e}"))?;
        let err = std::fs::File::create(dir.join(format!("rank{r}.err")))
            .map_err(|e| format!("create output of rank {r}: {e}"))?;
        let mut cmd = worker_command(opts, r);
        if opts.compute_lock {
            cmd.arg("--compute-lock").arg(dir.join("compute.lock"));
        }
        let child = cmd
            .args(["--tcp", &addr])
            .args(["--iters", &opts.iters.to_string()])
            .args(["--timeout-s", &opts.timeout.as_secs_f64().to_string()])
            .arg("--trace-dir")
            .arg(dir)
            .stdout(out)
            .stderr(err)
            .spawn();
        match child {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!(
                    "cannot start worker {} for rank {r}: {e}",
                    opts.worker.program.display()
                ));
            }
        }
    }
    let deadline = Instant::now() + opts.timeout;
    let mut failed: Option<(u32, String)> = None;
    loop {
        let mut running = 0;
        let mut first_running = None;
        for (r, c) in children.iter_mut() {
            match c.try_wait() {
                Ok(Some(st)) if !st.success() => {
                    failed.get_or_insert((*r, format!("exited with {st}")));
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    running += 1;
                    first_running.get_or_insert(*r);
                }
                Err(e) => {
                    failed.get_or_insert((*r, format!("cannot wait: {e}")));
                }
            }
        }
        if failed.is_some() || running == 0 {
            break;
        }
        if Instant::now() >= deadline {
            failed = Some((
                first_running.unwrap_or(0),
                format!("still running after {} s", opts.timeout.as_secs_f64()),
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    kill_all(&mut children);
    if let Some((r, why)) = failed {
        let err = std::fs::read_to_string(dir.join(format!("rank{r}.err"))).unwrap_or_default();
        return Err(format!(
            "all-real run: rank {r} {why}: {}",
            err.trim().lines().last().unwrap_or("(no error output)")
        ));
    }
    Ok(())
}

/// Runs the reference workload all-real `repeats` times and returns per-rank results.
pub fn run_all_real(opts: &AllRealOptions, cost: &dyn CommCost) -> Result<AllRealResult, String> {
    opts.config.validate()?;
    if opts.iters == 0 || opts.repeats == 0 {
        return Err("iters and repeats must be positive".into());
    }
    let world = opts.config.world();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); world];
    let mut compute: Vec<Vec<f64>> = vec![Vec::new(); world];
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); world];
    let mut peaks: Vec<Option<u64>> = vec![None; world];
    let mut samples = Vec::new();
    let mut chained: Vec<Vec<f64>> = vec![Vec::new(); world];
    let mut chained_samples = Vec::new();
    for rep in 0..opts.repeats {
        let dir = opts.work_dir.join(format!("repeat{rep}"));
        launch(opts, &dir)?;
        let mut per_rank: Vec<Vec<Trace>> = vec![Vec::new(); world];
        for r in 0..world {
            let path = dir.join(format!("rank{r}.out"));
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("read {}: {e}", path.display()))?;
            for rep in text.lines().filter_map(crate::worker::IterReport::parse) {
                wall[r].push(rep.wall_s);
                compute[r].push(rep.compute_s);
            }
        }
        for k in 0..opts.iters {
            let traces = (0..world)
                .map(|r| Trace::read_file(&dir.join(format!("rank{r}.iter{k}.trace"))))
                .collect::<Result<Vec<_>, _>>()?;
            let t =
                replay(&traces, cost).map_err(|e| format!("repeat {rep}, iteration {k}: {e}"))?;
            for (r, tr) in traces.iter().enumerate() {
                per_rank[r].push(tr.clone());
            }
            for (r, tr) in traces.iter().enumerate() {
                same_peak(&mut peaks[r], tr.peak_memory_bytes, |p| {
                    format!(
                        "rank {r}: peak memory {} in repeat {rep}, iteration {k}, {p} before: the ledger should not vary",
                        tr.peak_memory_bytes
                    )
                })?;
                times[r].push(t[r]);
            }
            samples.push(t.iter().copied().fold(0.0, f64::max));
        }
        let whole: Vec<Trace> = per_rank.iter().map(|its| chain(its)).collect();
        let ends = replay(&whole, cost).map_err(|e| format!("repeat {rep}, chained: {e}"))?;
        let iters = opts.iters as f64;
        for (r, e) in ends.iter().enumerate() {
            chained[r].push(e / iters);
        }
        chained_samples.push(ends.iter().copied().fold(0.0, f64::max) / iters);
    }
    let ranks = (0..world)
        .map(|r| RankResult {
            rank: r as u32,
            iteration_time_s: median(&times[r]),
            iteration_times_s: times[r].clone(),
            compute_s: median(&compute[r]),
            wall_s: median(&wall[r]),
            peak_memory_bytes: peaks[r].unwrap_or(0),
            chained_iteration_time_s: median(&chained[r]),
        })
        .collect();
    Ok(AllRealResult {
        ranks,
        iteration_time_s: median(&samples),
        samples_s: samples,
        chained_iteration_time_s: median(&chained_samples),
        chained_samples_s: chained_samples,
    })
}

// ---------------------------------------------------------------------------------------------
// The hybrid half and the comparison (`prism emulate validate`)
// ---------------------------------------------------------------------------------------------

/// What to run hybrid: the reference workload with `real_ranks` running for real against the
/// coordinator and every other rank replayed from a graph sliced from one recorded trace per
/// pipeline stage.
#[derive(Clone, Debug)]
pub struct HybridOptions {
    /// Model, layout, warm-up, measured iterations, repeats, worker, time-out and work
    /// directory, shared with the all-real run (`compute_lock` is not used: a real rank's
    /// compute is its own thread's CPU time either way).
    pub common: AllRealOptions,
    /// Ranks that run for real.
    pub real_ranks: Vec<u32>,
    /// The cluster communication is priced on (the same as the all-real run's [`EngineCost`]).
    pub cluster: prism_core::job::Cluster,
    /// How the sliced graph names that cluster (preset and overrides).
    pub cluster_spec: crate::graph_file::ClusterSpec,
    /// Slice the representatives' traces of the all-real run in this directory (its repeat of
    /// the same number, its middle measured iteration) instead of recording them alone: the
    /// virtual ranks then carry compute measured under the all-real run's CPU contention, and
    /// the comparison isolates the emulation itself (slicing, engine, coordinator, the real
    /// rank's live compute).
    pub slice_all_real: Option<PathBuf>,
}

/// One real rank in the hybrid runs.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridRank {
    pub rank: u32,
    /// Median over repeats of its emulated end over the iterations (the coordinator's
    /// `iteration_time_s`).
    pub iteration_time_s: f64,
    pub iteration_times_s: Vec<f64>,
    /// Peak of its tensor ledger (from its `Bye`).
    pub peak_memory_bytes: u64,
    /// Largest lag of a release behind its emulated time, over the repeats.
    pub max_lag_s: f64,
}

/// The hybrid runs' result.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridResult {
    pub ranks: Vec<HybridRank>,
    /// Median over repeats of the emulated job's iteration time (every rank, real and
    /// virtual: the session's end over the iterations).
    pub iteration_time_s: f64,
    pub samples_s: Vec<f64>,
    /// Ranks whose recorded traces were sliced (one per stage).
    pub recorded_ranks: Vec<u32>,
}

/// The recorded representative of each stage: its last rank that is not real (every rank of
/// a stage does the same work; a rank that runs for real is measured live anyway).
fn representatives(cfg: &Config, real: &[u32]) -> Vec<u32> {
    let per_stage = (cfg.tp * cfg.dp) as u32;
    (0..cfg.pp as u32)
        .map(|s| {
            let first = s * per_stage;
            (first..first + per_stage)
                .rev()
                .find(|r| !real.contains(r))
                .unwrap_or(first + per_stage - 1)
        })
        .collect()
}

/// The worker process of `rank` with what every run shares: the layout, warm-up and model,
/// the rank's environment, no backend inherited from ours, no input.
fn worker_command(opts: &AllRealOptions, rank: u32) -> Command {
    let cfg = &opts.config;
    let layout = format!("{},{},{}", cfg.tp, cfg.pp, cfg.dp);
    let mut cmd = Command::new(&opts.worker.program);
    cmd.args(&opts.worker.args)
        .args(["--layout", &layout])
        .args(["--warmup", &opts.warmup.to_string()])
        .args(model_args(cfg))
        .env("PRISM_RANK", rank.to_string())
        .env("PRISM_WORLD_SIZE", cfg.world().to_string())
        .env("PRISM_LAYOUT", &layout)
        .env_remove("PRISM_COORDINATOR")
        .env_remove("PRISM_TCP_ADDR")
        .env_remove("PRISM_COMPUTE_LOCK")
        .stdin(Stdio::null());
    cmd
}

/// Records the representatives' traces into `dir` (one process at a time).
fn record(opts: &AllRealOptions, reps: &[u32], dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for &r in reps {
        let path = dir.join(format!("rank-{r}.trace"));
        let output = worker_command(opts, r)
            .arg("--record")
            .arg(&path)
            .args(["--iters", "1"])
            .output()
            .map_err(|e| format!("cannot start worker for rank {r}: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "recording rank {r} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        out.push(path);
    }
    Ok(out)
}

/// Runs the hybrid half `opts.common.repeats` times: record one trace per stage, slice, then
/// run the coordinator with the real ranks launched as workers against it.
pub fn run_hybrid(opts: &HybridOptions) -> Result<HybridResult, String> {
    use crate::coordinator::{Clock, Listen, Setup};
    use crate::graph_file::LayoutSpec;
    use crate::slice::{RankTrace, slice};
    let c = &opts.common;
    c.config.validate()?;
    if c.iters == 0 || c.repeats == 0 {
        return Err("iters and repeats must be positive".into());
    }
    let world = c.config.world() as u32;
    if opts.real_ranks.is_empty() {
        return Err("at least one real rank is needed".into());
    }
    if let Some(&r) = opts.real_ranks.iter().find(|&&r| r >= world) {
        return Err(format!("real rank {r} is not in a world of {world} ranks"));
    }
    let reps = representatives(&c.config, &opts.real_ranks);
    let layout = LayoutSpec {
        tp: c.config.tp as u32,
        pp: c.config.pp as u32,
        dp: c.config.dp as u32,
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); opts.real_ranks.len()];
    let mut peaks: Vec<Option<u64>> = vec![None; opts.real_ranks.len()];
    let mut lags = vec![0.0f64; opts.real_ranks.len()];
    let mut samples = Vec::new();
    for rep in 0..c.repeats {
        let dir = c.work_dir.join(format!("hybrid{rep}"));
        let files = match &opts.slice_all_real {
            None => record(c, &reps, &dir.join("traces"))?,
            Some(all) => {
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("create {}: {e}", dir.display()))?;
                reps.iter()
                    .map(|r| {
                        all.join(format!("repeat{rep}"))
                            .join(format!("rank{r}.iter{}.trace", c.iters / 2))
                    })
                    .collect()
            }
        };
        let traces = files
            .iter()
            .map(|p| RankTrace::read(p))
            .collect::<Result<Vec<_>, _>>()?;
        let graph = slice(&traces, layout, opts.cluster_spec.clone())?;
        let mut command = vec![c.worker.program.display().to_string()];
        command.extend(c.worker.args.iter().cloned());
        command.extend([
            "--warmup".to_string(),
            c.warmup.to_string(),
            "--iters".to_string(),
            c.iters.to_string(),
            "--timeout-s".to_string(),
            c.timeout.as_secs_f64().to_string(),
        ]);
        command.extend(model_args(&c.config));
        let setup = Setup {
            graph,
            cluster: opts.cluster.clone(),
            real_ranks: opts.real_ranks.clone(),
            listen: Listen::Unix(dir.join("coordinator.sock")),
            timeout: c.timeout,
            command,
            clock: Clock::Wall,
            iterations: c.iters,
            output_dir: Some(dir.clone()),
        };
        let report = crate::coordinator::run(&setup).map_err(|e| format!("repeat {rep}: {e}"))?;
        samples.push(report.emulated_iteration_s);
        for (i, &r) in opts.real_ranks.iter().enumerate() {
            let rr = report
                .ranks
                .iter()
                .find(|x| x.rank == r)
                .ok_or_else(|| format!("repeat {rep}: no report of real rank {r}"))?;
            times[i].push(rr.iteration_time_s);
            lags[i] = lags[i].max(rr.max_lag_s);
            same_peak(&mut peaks[i], rr.peak_memory_bytes, |p| {
                format!(
                    "real rank {r}: peak memory {} in repeat {rep}, {p} before",
                    rr.peak_memory_bytes
                )
            })?;
        }
    }
    let ranks = opts
        .real_ranks
        .iter()
        .enumerate()
        .map(|(i, &r)| HybridRank {
            rank: r,
            iteration_time_s: median(&times[i]),
            iteration_times_s: times[i].clone(),
            peak_memory_bytes: peaks[i].unwrap_or(0),
            max_lag_s: lags[i],
        })
        .collect();
    Ok(HybridResult {
        ranks,
        iteration_time_s: median(&samples),
        samples_s: samples,
        recorded_ranks: reps,
    })
}

/// One real rank compared: all-real vs hybrid.
#[derive(Clone, Debug, PartialEq)]
pub struct RankComparison {
    pub rank: u32,
    pub all_real_iteration_time_s: f64,
    pub hybrid_iteration_time_s: f64,
    pub iteration_time_error_pct: f64,
    pub all_real_peak_memory_bytes: u64,
    pub hybrid_peak_memory_bytes: u64,
    pub peak_memory_error_pct: f64,
}

/// `prism emulate validate`'s result.
#[derive(Clone, Debug, PartialEq)]
pub struct Validation {
    pub all_real: AllRealResult,
    pub hybrid: HybridResult,
    /// Per real rank.
    pub ranks: Vec<RankComparison>,
    /// The emulated job's iteration time against the all-real job's, both over the measured
    /// iterations run back to back (medians over repeats).
    pub iteration_time_error_pct: f64,
    /// The largest peak-memory error of a real rank.
    pub peak_memory_error_pct: f64,
}

/// Compares an all-real and a hybrid result.
pub fn compare(all_real: AllRealResult, hybrid: HybridResult) -> Result<Validation, String> {
    let mut ranks = Vec::new();
    for h in &hybrid.ranks {
        let a = all_real
            .ranks
            .iter()
            .find(|a| a.rank == h.rank)
            .ok_or_else(|| format!("rank {} has no all-real result", h.rank))?;
        ranks.push(RankComparison {
            rank: h.rank,
            all_real_iteration_time_s: a.chained_iteration_time_s,
            hybrid_iteration_time_s: h.iteration_time_s,
            iteration_time_error_pct: error_pct(h.iteration_time_s, a.chained_iteration_time_s),
            all_real_peak_memory_bytes: a.peak_memory_bytes,
            hybrid_peak_memory_bytes: h.peak_memory_bytes,
            peak_memory_error_pct: error_pct(
                h.peak_memory_bytes as f64,
                a.peak_memory_bytes as f64,
            ),
        });
    }
    let peak = ranks
        .iter()
        .map(|r| r.peak_memory_error_pct)
        .fold(0.0, f64::max);
    Ok(Validation {
        iteration_time_error_pct: error_pct(
            hybrid.iteration_time_s,
            all_real.chained_iteration_time_s,
        ),
        peak_memory_error_pct: peak,
        ranks,
        all_real,
        hybrid,
    })
}
