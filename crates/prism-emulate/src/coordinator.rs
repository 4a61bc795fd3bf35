//! The emulation coordinator: real ranks connect over the wire protocol, every other rank is
//! played on the engine from the sliced graph, and each call of a real rank is answered when it
//! completes in emulated time.
//!
//! How a run goes ([`run`]):
//! 1. Listen (`unix:PATH` or `tcp:127.0.0.1:PORT`); with a command, launch one process per real
//!    rank with `PRISM_RANK`, `PRISM_WORLD_SIZE`, `PRISM_COORDINATOR`, `PRISM_LAYOUT`.
//! 2. Accept a `Hello` from every real rank within the time-out (unknown rank, repeated rank,
//!    wrong world size: `Fault` and an error); answer `Welcome`. The emulated clock starts.
//! 3. Run the engine ([`prism_core::engine::simulate_graph`]) with the real ranks external, in
//!    reduced mode (one instance per stage, which stands for the stage's real ranks and is
//!    replayed by its virtual ranks; so virtual ranks of a real rank's class reuse its measured
//!    compute), or every rank when the placement is not symmetric (then virtual ranks keep the
//!    recorded compute). When the engine needs a real rank's next compute segment, the
//!    coordinator waits (bounded) for the rank's next `Call`, checks it against the graph (op,
//!    group, bytes, peer, order) and feeds its `compute_s` in; when a real rank's call completes
//!    in emulated time, its `Done` is sent at the wall time of that completion (clock coupling)
//!    with the call's data result. `Bye` gives the compute after the last call and the peak
//!    memory.
//! 4. Any fault (a crash or disconnect, a mismatching call, a rank that never arrives or stops
//!    talking) sends `Fault` to every connected rank, kills the launched processes, and returns
//!    an error naming the rank, the group and the op index.
//!
//! Data: a collective is answered with data when the rank's call carried data (a call with
//! sizes only gets an empty `Done`). Real contributions are combined among the group's real
//! ranks; a virtual member contributes a copy of the contribution of the group's
//! lowest-numbered real rank (so an averaged data-parallel all-reduce returns the real ranks'
//! average). A receive is always answered with `bytes` bytes: a real peer's message as sent,
//! zeros from a virtual peer (or from a real peer that sent sizes only).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prism_core::engine::{External, GraphOptions, Mode, SimError, simulate_graph};
use prism_core::job::Cluster;
use prism_core::units::SimTime;

use crate::conn::Conn;
use crate::graph_file::{SlicedGraph, op_name};
use crate::protocol::{
    Body, Bye, Call, DType, Done, Fault, Op, ReduceOp, Welcome, encode_frame, read_frame,
};
use crate::slice::{instantiate, ps_from_secs};

/// Where the coordinator listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A Unix-domain socket at this path (a stale socket there is replaced).
    Unix(PathBuf),
    /// TCP on 127.0.0.1 at this port (0: any free port).
    Tcp(u16),
}

impl Listen {
    /// Parses `unix:PATH` or `tcp:127.0.0.1:PORT`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Some(p) = text.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("`unix:` needs a path".into());
            }
            return Ok(Listen::Unix(PathBuf::from(p)));
        }
        if let Some(rest) = text.strip_prefix("tcp:") {
            let port = rest
                .strip_prefix("127.0.0.1:")
                .ok_or_else(|| format!("`{text}`: the coordinator listens on 127.0.0.1 only"))?;
            return port
                .parse::<u16>()
                .map(Listen::Tcp)
                .map_err(|_| format!("`{text}`: `{port}` is not a port number"));
        }
        Err(format!(
            "`{text}` is not `unix:PATH` or `tcp:127.0.0.1:PORT`"
        ))
    }
}

/// When a real rank's call is answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Clock {
    /// At the wall time of its emulated completion (the default: the rank's timers stay
    /// truthful).
    #[default]
    Wall,
    /// As soon as the engine knows it (for measuring the coordinator itself).
    Asap,
}

/// Everything a coordinator run needs.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The sliced graph.
    pub graph: SlicedGraph,
    /// The cluster its communication is priced on.
    pub cluster: Cluster,
    /// Ranks that run for real.
    pub real_ranks: Vec<u32>,
    /// Where to listen.
    pub listen: Listen,
    /// Bound of every wait: for all ranks to connect, for a rank's next frame, for launched
    /// processes to exit.
    pub timeout: Duration,
    /// When non-empty, the command launched once per real rank.
    pub command: Vec<String>,
    /// Clock coupling.
    pub clock: Clock,
    /// Training iterations the real ranks run: the graph (one iteration, as recorded) is
    /// repeated this many times back to back (1: the graph is the whole session).
    pub iterations: u32,
    /// Where launched ranks write their output (`rank{R}.out`, `rank{R}.err`); `None`: they
    /// inherit the coordinator's.
    pub output_dir: Option<PathBuf>,
}

/// What a real rank did.
#[derive(Clone, Debug, PartialEq)]
pub struct RankReport {
    /// Rank.
    pub rank: u32,
    /// Its pipeline stage.
    pub stage: u32,
    /// Calls answered.
    pub calls: u64,
    /// Emulated end of its session (its `Bye`), seconds.
    pub emulated_end_s: f64,
    /// `emulated_end_s / iterations`.
    pub iteration_time_s: f64,
    /// Emulated end of each iteration (the completion of its last call; the last iteration
    /// ends with the rank's `Bye`), seconds.
    pub iteration_ends_s: Vec<f64>,
    /// Compute it reported, seconds.
    pub compute_s: f64,
    /// Largest lag of a `Done` behind its wall-clock target, seconds.
    pub max_lag_s: f64,
    /// Mean lag, seconds.
    pub mean_lag_s: f64,
    /// Peak memory from its `Bye` (0: not measured).
    pub peak_memory_bytes: u64,
}

/// Result of a coordinator run.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Ranks of the emulated job.
    pub world_size: u32,
    /// Where it listened (`unix:PATH` / `tcp:127.0.0.1:PORT`).
    pub address: String,
    /// Engine mode (`reduced` or `full`).
    pub mode: &'static str,
    /// Emulated session time (the last end of any rank), seconds.
    pub emulated_s: f64,
    /// `emulated_s / iterations`.
    pub emulated_iteration_s: f64,
    /// Wall time from the `Welcome`s (emulated time 0) to the end of the engine run, seconds.
    pub wall_s: f64,
    /// Wall time from the last `Hello` to the `Welcome`s (building the engine's run: layout,
    /// fabric, symmetry check), seconds.
    pub setup_s: f64,
    /// The instant the emulated clock started (emulated time 0, just before the `Welcome`s).
    pub clock_start: Instant,
    /// Engine events.
    pub events: u64,
    /// Per real rank, by rank.
    pub ranks: Vec<RankReport>,
}

/// Why a coordinator run failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EmulateError {
    /// The setup is wrong (graph, ranks, address, command).
    #[error("{0}")]
    Setup(String),
    /// A real rank is at fault.
    #[error("rank {rank}{}{}: {message}",
        .group.as_ref().map(|g| format!(", group {g:?}")).unwrap_or_default(),
        .op.map(|k| format!(", op {k}")).unwrap_or_default())]
    Rank {
        /// Rank.
        rank: u32,
        /// Group of the call at fault, when known.
        group: Option<Vec<u32>>,
        /// Op index (the call's `seq`), when known.
        op: Option<u64>,
        /// What happened.
        message: String,
    },
    /// The engine failed.
    #[error("engine: {0}")]
    Engine(String),
}

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    fn bind(l: &Listen) -> Result<(Listener, String), String> {
        match l {
            Listen::Unix(path) => {
                use std::os::unix::fs::FileTypeExt;
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    if meta.file_type().is_socket() {
                        let _ = std::fs::remove_file(path);
                    } else {
                        return Err(format!(
                            "{}: exists and is not a socket; choose another path",
                            path.display()
                        ));
                    }
                }
                let ls = UnixListener::bind(path)
                    .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
                ls.set_nonblocking(true).map_err(|e| e.to_string())?;
                let addr = format!("unix:{}", path.display());
                Ok((Listener::Unix(ls, path.clone()), addr))
            }
            Listen::Tcp(port) => {
                let ls = TcpListener::bind(("127.0.0.1", *port))
                    .map_err(|e| format!("cannot listen on 127.0.0.1:{port}: {e}"))?;
                ls.set_nonblocking(true).map_err(|e| e.to_string())?;
                let p = ls.local_addr().map_err(|e| e.to_string())?.port();
                Ok((Listener::Tcp(ls), format!("tcp:127.0.0.1:{p}")))
            }
        }
    }

    fn accept(&self) -> std::io::Result<Conn> {
        match self {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Conn::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Conn::Tcp(s)
            }),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What a reader thread hands on.
enum Msg {
    Frame(Body),
    Closed,
    Error(String),
}

/// A frame to write, at a wall time (or now).
struct Out {
    at: Option<Instant>,
    body: Body,
}

#[derive(Clone, Copy, Debug, Default)]
struct Lag {
    max_s: f64,
    sum_s: f64,
    count: u64,
}

/// One connected real rank.
struct Peer {
    conn: Arc<Mutex<Conn>>,
    out: Option<Sender<Out>>,
    writer: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
    lag: Arc<Mutex<Lag>>,
}

/// Launched processes, killed (with their process groups) when dropped unless reaped.
struct Children(Vec<(u32, Child)>);

impl Children {
    fn kill_all(&mut self) {
        for (_, c) in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                // The whole process group: a command may be a shell that started the rank.
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", c.id())])
                    .stderr(std::process::Stdio::null())
                    .status();
                let _ = c.kill();
            }
            let _ = c.wait();
        }
        self.0.clear();
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Runs the coordinator until every real rank said `Bye` (see the module docs).
pub fn run(setup: &Setup) -> Result<Report, EmulateError> {
    let repeated = setup.graph.repeated(setup.iterations.max(1));
    let g = &repeated;
    let n = g.layout.world_size().map_err(EmulateError::Setup)?;
    let mut real = setup.real_ranks.clone();
    real.sort_unstable();
    real.dedup();
    if real.is_empty() {
        return Err(EmulateError::Setup("no real ranks given".into()));
    }
    if let Some(&r) = real.iter().find(|&&r| r >= n) {
        return Err(EmulateError::Setup(format!(
            "real rank {r} is not a rank of the {n}-rank job"
        )));
    }
    let graph = g
        .graph(setup.cluster.gpus_per_node)
        .map_err(EmulateError::Setup)?;
    let expected: BTreeMap<u32, Vec<Call>> = real
        .iter()
        .map(|&r| instantiate(g, r).map(|c| (r, c)))
        .collect::<Result<_, _>>()
        .map_err(EmulateError::Setup)?;
    let (listener, address) = Listener::bind(&setup.listen).map_err(EmulateError::Setup)?;
    let mut children = Children(Vec::new());
    if !setup.command.is_empty() {
        for &r in &real {
            use std::os::unix::process::CommandExt;
            let mut cmd = Command::new(&setup.command[0]);
            cmd.args(&setup.command[1..])
                .env("PRISM_RANK", r.to_string())
                .env("PRISM_WORLD_SIZE", n.to_string())
                .env("PRISM_COORDINATOR", &address)
                .env("PRISM_LAYOUT", g.layout.to_arg())
                .process_group(0);
            if let Some(dir) = &setup.output_dir {
                let file = |ext: &str| {
                    let path = dir.join(format!("rank{r}.{ext}"));
                    std::fs::File::create(&path).map_err(|e| {
                        EmulateError::Setup(format!("cannot create {}: {e}", path.display()))
                    })
                };
                cmd.stdout(file("out")?).stderr(file("err")?);
            }
            let child = cmd.spawn().map_err(|e| {
                EmulateError::Setup(format!("cannot launch `{}`: {e}", setup.command[0]))
            })?;
            children.0.push((r, child));
        }
    }
    let mut peers: BTreeMap<u32, Peer> = BTreeMap::new();
    let abort = Arc::new(AtomicBool::new(false));
    let result = session(
        setup,
        n,
        &real,
        &graph,
        expected,
        &listener,
        &address,
        &mut children,
        &mut peers,
        &abort,
    );
    match result {
        Ok(report) => {
            // Let the writers finish, close the connections, reap the processes.
            for p in peers.values_mut() {
                p.out = None;
                if let Some(w) = p.writer.take() {
                    let _ = w.join();
                }
                p.conn.lock().expect("conn").shutdown();
                if let Some(r) = p.reader.take() {
                    let _ = r.join();
                }
            }
            reap(&mut children, setup.timeout)?;
            Ok(report)
        }
        Err(e) => {
            abort.store(true, Ordering::SeqCst);
            // The Fault's fields carry rank, group and op index; its message the rest.
            let (rank, group, op, message) = match &e {
                EmulateError::Rank {
                    rank,
                    group,
                    op,
                    message,
                } => (
                    *rank,
                    group.clone().unwrap_or_default(),
                    op.unwrap_or(0),
                    message.clone(),
                ),
                _ => (u32::MAX, vec![], 0, e.to_string()),
            };
            let fault = Body::Fault(Fault {
                rank,
                group,
                op_index: op,
                message,
            });
            for p in peers.values_mut() {
                p.out = None;
                let mut c = p.conn.lock().expect("conn");
                if let Ok(frame) = encode_frame(&fault) {
                    let _ = c.set_write_timeout_short();
                    let _ = c.write_all(&frame);
                }
                c.shutdown();
            }
            children.kill_all();
            for p in peers.values_mut() {
                if let Some(w) = p.writer.take() {
                    let _ = w.join();
                }
                if let Some(r) = p.reader.take() {
                    let _ = r.join();
                }
            }
            Err(e)
        }
    }
}

impl Conn {
    fn set_write_timeout_short(&self) -> std::io::Result<()> {
        let t = Some(Duration::from_secs(1));
        match self {
            Conn::Unix(s) => s.set_write_timeout(t),
            Conn::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

/// Waits (bounded) for the launched processes to exit; a failure names the rank.
fn reap(children: &mut Children, timeout: Duration) -> Result<(), EmulateError> {
    let deadline = Instant::now() + timeout;
    let mut i = 0;
    while i < children.0.len() {
        let (rank, c) = &mut children.0[i];
        match c.try_wait() {
            Ok(Some(st)) => {
                if !st.success() {
                    let rank = *rank;
                    children.kill_all();
                    return Err(EmulateError::Rank {
                        rank,
                        group: None,
                        op: None,
                        message: format!("its process exited with {st} after its Bye"),
                    });
                }
                i += 1;
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            _ => {
                let rank = *rank;
                children.kill_all();
                return Err(EmulateError::Rank {
                    rank,
                    group: None,
                    op: None,
                    message: format!(
                        "its process did not exit within {:.1} s after its Bye (killed)",
                        timeout.as_secs_f64()
                    ),
                });
            }
        }
    }
    children.0.clear();
    Ok(())
}

fn rank_err(rank: u32, group: Option<Vec<u32>>, op: Option<u64>, message: String) -> EmulateError {
    EmulateError::Rank {
        rank,
        group,
        op,
        message,
    }
}

#[allow(clippy::too_many_arguments)]
fn session(
    setup: &Setup,
    n: u32,
    real: &[u32],
    graph: &prism_core::graph::ExecutionGraph,
    expected: BTreeMap<u32, Vec<Call>>,
    listener: &Listener,
    address: &str,
    children: &mut Children,
    peers: &mut BTreeMap<u32, Peer>,
    abort: &Arc<AtomicBool>,
) -> Result<Report, EmulateError> {
    let deadline = Instant::now() + setup.timeout;
    let mut inboxes: BTreeMap<u32, Receiver<Msg>> = BTreeMap::new();
    // 1. Every real rank says Hello.
    while peers.len() < real.len() {
        for (rank, c) in children.0.iter_mut() {
            if !peers.contains_key(rank)
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(rank_err(
                    *rank,
                    None,
                    None,
                    format!("its process exited with {st} before connecting"),
                ));
            }
        }
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<u32> = (real.iter())
                        .copied()
                        .filter(|r| !peers.contains_key(r))
                        .collect();
                    return Err(rank_err(
                        missing[0],
                        None,
                        None,
                        format!(
                            "never arrived: real rank(s) {missing:?} did not connect to {address} \
                             within {:.1} s",
                            setup.timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(EmulateError::Setup(format!("accept on {address}: {e}"))),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let mut conn = conn;
        conn.set_blocking()
            .and_then(|_| conn.set_read_timeout(Some(left.max(Duration::from_millis(10)))))
            .map_err(|e| EmulateError::Setup(e.to_string()))?;
        let hello = match read_frame(&mut conn) {
            Ok(Some(Body::Hello(h))) => h,
            Ok(other) => {
                refuse(&mut conn, u32::MAX, "the first frame must be Hello".into());
                return Err(EmulateError::Setup(format!(
                    "a client on {address} opened with {} instead of Hello",
                    match other {
                        None => "nothing",
                        Some(_) => "another frame",
                    }
                )));
            }
            Err(e) => {
                return Err(EmulateError::Setup(format!(
                    "a client on {address} sent no valid Hello: {e}"
                )));
            }
        };
        let r = hello.rank;
        let why = if hello.world_size != n {
            Some(format!(
                "world size {} does not match the emulated job's {n}",
                hello.world_size
            ))
        } else if real.binary_search(&r).is_err() {
            Some(format!(
                "rank {r} is not a real rank of this emulation (real ranks {real:?})"
            ))
        } else if peers.contains_key(&r) {
            Some(format!("rank {r} connected twice"))
        } else {
            None
        };
        if let Some(why) = why {
            refuse(&mut conn, r, why.clone());
            return Err(rank_err(r, None, None, format!("refused at Hello: {why}")));
        }
        conn.set_read_timeout(None)
            .map_err(|e| EmulateError::Setup(e.to_string()))?;
        let reader_conn = conn
            .try_clone()
            .map_err(|e| EmulateError::Setup(e.to_string()))?;
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || reader_loop(reader_conn, tx));
        let conn = Arc::new(Mutex::new(conn));
        let (otx, orx) = mpsc::channel::<Out>();
        let lag = Arc::new(Mutex::new(Lag::default()));
        let writer = {
            let (conn, lag, abort) = (conn.clone(), lag.clone(), abort.clone());
            std::thread::spawn(move || writer_loop(conn, orx, lag, abort))
        };
        inboxes.insert(r, rx);
        peers.insert(
            r,
            Peer {
                conn,
                out: Some(otx),
                writer: Some(writer),
                reader: Some(reader),
                lag,
            },
        );
    }
    let hellos_done = Instant::now();
    // 2. The engine, with the real ranks external. The hook sends the Welcomes and starts the
    // emulated clock when the engine first needs a real rank (its set-up is done by then, so
    // it does not count as lag).
    let mut hook = Hook {
        t0: None,
        welcome: Some((
            peers.values().filter_map(|p| p.out.clone()).collect(),
            Welcome {
                world_size: n,
                real_ranks: real.to_vec(),
            },
        )),
        clock: setup.clock,
        timeout: setup.timeout,
        real: real.to_vec(),
        ranks: BTreeMap::new(),
        error: None,
    };
    for (&r, calls) in &expected {
        hook.ranks.insert(
            r,
            RankState {
                expected: calls.clone(),
                inbox: inboxes.remove(&r).expect("inbox"),
                out: peers[&r].out.clone().expect("writer"),
                received: vec![None; calls.len()],
                bye: None,
                compute_s: 0.0,
                answered: 0,
                done_ps: Vec::new(),
            },
        );
    }
    let mut opts = GraphOptions {
        mode: Mode::Reduced,
        external_ranks: real.to_vec(),
        ..Default::default()
    };
    let mut mode = "reduced";
    let res = match simulate_graph(graph, &setup.cluster, &opts, Some(&mut hook)) {
        Err(SimError::Asymmetric(_)) => {
            opts.mode = Mode::Full;
            mode = "full";
            simulate_graph(graph, &setup.cluster, &opts, Some(&mut hook))
        }
        r => r,
    };
    let res = match res {
        Ok(r) => r,
        Err(SimError::External(_)) => {
            return Err(hook
                .error
                .take()
                .unwrap_or_else(|| EmulateError::Engine("a real rank failed".into())));
        }
        Err(e) => return Err(EmulateError::Engine(e.to_string())),
    };
    let t0 = hook.t0.unwrap_or_else(Instant::now);
    let wall_s = t0.elapsed().as_secs_f64();
    let iters = setup.iterations.max(1) as f64;
    let size = setup.graph.layout.tp * setup.graph.layout.dp;
    let mut ranks = Vec::new();
    for (&r, st) in &hook.ranks {
        let stage = r / size;
        let timing = (res.ranks.iter())
            .find(|t| t.rank == r)
            .or_else(|| res.ranks.iter().find(|t| t.rank / size == stage))
            .expect("an instance of the stage");
        let lag = *peers[&r].lag.lock().expect("lag");
        // Iteration i ends with its last call (the last iteration with the Bye).
        let per = setup.graph.classes[stage as usize].calls.len();
        let n_iter = setup.iterations.max(1) as usize;
        let iteration_ends_s: Vec<f64> = (0..n_iter)
            .map(|i| match ((i + 1) * per).checked_sub(1) {
                Some(k) if i + 1 < n_iter => st.done_ps.get(k).map_or(0.0, |&p| p as f64 * 1e-12),
                _ => timing.finish_s,
            })
            .collect();
        ranks.push(RankReport {
            iteration_ends_s,
            rank: r,
            stage,
            calls: st.answered,
            emulated_end_s: timing.finish_s,
            iteration_time_s: timing.finish_s / iters,
            compute_s: st.compute_s,
            max_lag_s: lag.max_s,
            mean_lag_s: if lag.count > 0 {
                lag.sum_s / lag.count as f64
            } else {
                0.0
            },
            peak_memory_bytes: st.bye.as_ref().map_or(0, |b| b.peak_memory_bytes),
        });
    }
    let emulated_s = res.iteration_ps as f64 * 1e-12;
    Ok(Report {
        world_size: n,
        address: address.into(),
        mode,
        emulated_s,
        emulated_iteration_s: emulated_s / iters,
        wall_s,
        clock_start: t0,
        setup_s: t0.saturating_duration_since(hellos_done).as_secs_f64(),
        events: res.events,
        ranks,
    })
}

fn refuse(conn: &mut Conn, rank: u32, message: String) {
    let body = Body::Fault(Fault {
        rank,
        group: vec![],
        op_index: 0,
        message,
    });
    if let Ok(f) = encode_frame(&body) {
        let _ = conn.set_write_timeout_short();
        let _ = conn.write_all(&f);
    }
    conn.shutdown();
}

fn reader_loop(mut conn: Conn, tx: Sender<Msg>) {
    loop {
        let msg = match read_frame(&mut conn) {
            Ok(Some(b)) => Msg::Frame(b),
            Ok(None) => Msg::Closed,
            Err(e) => Msg::Error(e.to_string()),
        };
        let end = !matches!(msg, Msg::Frame(Body::Call(_)));
        if tx.send(msg).is_err() || end {
            return;
        }
    }
}

fn writer_loop(
    conn: Arc<Mutex<Conn>>,
    rx: Receiver<Out>,
    lag: Arc<Mutex<Lag>>,
    abort: Arc<AtomicBool>,
) {
    while let Ok(out) = rx.recv() {
        if let Some(at) = out.at {
            // Sleep until the target in short steps, so that an abort is not held up.
            loop {
                if abort.load(Ordering::SeqCst) {
                    return;
                }
                let now = Instant::now();
                if now >= at {
                    break;
                }
                std::thread::sleep((at - now).min(Duration::from_millis(20)));
            }
        }
        let Ok(frame) = encode_frame(&out.body) else {
            return;
        };
        let mut c = conn.lock().expect("conn");
        if abort.load(Ordering::SeqCst) || c.write_all(&frame).is_err() {
            return;
        }
        drop(c);
        if let Some(at) = out.at {
            let late = Instant::now().saturating_duration_since(at).as_secs_f64();
            let mut l = lag.lock().expect("lag");
            l.max_s = l.max_s.max(late);
            l.sum_s += late;
            l.count += 1;
        }
    }
}

struct RankState {
    expected: Vec<Call>,
    inbox: Receiver<Msg>,
    out: Sender<Out>,
    /// Received calls (with data), by op index.
    received: Vec<Option<Call>>,
    bye: Option<Bye>,
    compute_s: f64,
    answered: u64,
    /// Emulated completion of each answered call, ps.
    done_ps: Vec<SimTime>,
}

/// The engine's hook: real ranks' compute in, completions out.
struct Hook {
    /// When the emulated clock started (the Welcomes went out).
    t0: Option<Instant>,
    /// The Welcome and where to send it, until it is sent.
    welcome: Option<(Vec<Sender<Out>>, Welcome)>,
    clock: Clock,
    timeout: Duration,
    real: Vec<u32>,
    ranks: BTreeMap<u32, RankState>,
    error: Option<EmulateError>,
}

impl Hook {
    /// Sends the Welcomes and starts the emulated clock, once; returns its start.
    fn start(&mut self) -> Instant {
        if let Some((outs, w)) = self.welcome.take() {
            self.t0 = Some(Instant::now());
            for o in outs {
                let _ = o.send(Out {
                    at: None,
                    body: Body::Welcome(w.clone()),
                });
            }
        }
        self.t0.expect("started")
    }

    /// Keeps the first error (the engine carries only its text).
    fn fail(&mut self, e: EmulateError) -> String {
        let s = e.to_string();
        self.error.get_or_insert(e);
        s
    }

    fn describe(c: &Call) -> String {
        let op = Op::try_from(c.op).map(op_name).unwrap_or("unknown op");
        match Op::try_from(c.op) {
            Ok(Op::Send) => format!("send of {} bytes to rank {}", c.bytes, c.peer),
            Ok(Op::Recv) => format!("recv of {} bytes from rank {}", c.bytes, c.peer),
            Ok(Op::Broadcast) => format!(
                "broadcast of {} bytes from root {} on group {:?}",
                c.bytes, c.peer, c.group
            ),
            _ => format!("{op} of {} bytes on group {:?}", c.bytes, c.group),
        }
    }

    /// Waits for `rank`'s next frame.
    fn next_frame(&mut self, rank: u32, k: u64) -> Result<Body, EmulateError> {
        let st = &self.ranks[&rank];
        let due = st.expected.get(k as usize);
        let group = due.map(|c| c.group.clone()).filter(|g| !g.is_empty());
        let what = due.map_or("its Bye".to_string(), |c| {
            format!("op {k} ({})", Self::describe(c))
        });
        match st.inbox.recv_timeout(self.timeout) {
            Ok(Msg::Frame(b)) => Ok(b),
            Ok(Msg::Closed) | Err(RecvTimeoutError::Disconnected) => Err(rank_err(
                rank,
                group,
                due.map(|_| k),
                format!("disconnected (crashed?) while {what} was due"),
            )),
            Ok(Msg::Error(e)) => Err(rank_err(
                rank,
                group,
                due.map(|_| k),
                format!("bad frame while {what} was due: {e}"),
            )),
            Err(RecvTimeoutError::Timeout) => Err(rank_err(
                rank,
                group,
                due.map(|_| k),
                format!(
                    "sent nothing for {:.1} s while {what} was due",
                    self.timeout.as_secs_f64()
                ),
            )),
        }
    }

    fn compute(&mut self, rank: u32, op: u32) -> Result<SimTime, EmulateError> {
        self.start();
        let k = (op / 2) as u64;
        let total = self.ranks[&rank].expected.len() as u64;
        let body = self.next_frame(rank, k)?;
        let st = self.ranks.get_mut(&rank).expect("rank");
        match body {
            Body::Call(c) if k < total => {
                let exp = &st.expected[k as usize];
                let group = Some(exp.group.clone()).filter(|g| !g.is_empty());
                let at = |m: String| rank_err(rank, group.clone(), Some(k), m);
                if c.seq != k {
                    return Err(at(format!(
                        "the call says seq {}, the graph's next op is {k}",
                        c.seq
                    )));
                }
                c.validate(rank).map_err(&at)?;
                // `peer` counts for a send, a receive and a broadcast (its root) only.
                let peer_counts = matches!(
                    Op::try_from(exp.op),
                    Ok(Op::Send | Op::Recv | Op::Broadcast)
                );
                let same_kind =
                    c.op == exp.op && c.group == exp.group && (!peer_counts || c.peer == exp.peer);
                if !same_kind {
                    return Err(at(format!(
                        "order mismatch: the graph expects {}, the rank called {}",
                        Self::describe(exp),
                        Self::describe(&c)
                    )));
                }
                if c.bytes != exp.bytes {
                    return Err(at(format!(
                        "size mismatch: the graph expects {}, the rank called {}",
                        Self::describe(exp),
                        Self::describe(&c)
                    )));
                }
                let ps = ps_from_secs(c.compute_s).map_err(&at)?;
                st.compute_s += c.compute_s;
                st.received[k as usize] = Some(c);
                Ok(ps)
            }
            Body::Bye(b) if k == total => {
                let ps = ps_from_secs(b.compute_s)
                    .map_err(|e| rank_err(rank, None, None, format!("Bye: {e}")))?;
                st.compute_s += b.compute_s;
                st.bye = Some(b);
                Ok(ps)
            }
            Body::Bye(_) => {
                let exp = &st.expected[k as usize];
                Err(rank_err(
                    rank,
                    Some(exp.group.clone()).filter(|g| !g.is_empty()),
                    Some(k),
                    format!(
                        "order mismatch: the rank said Bye after {k} of {total} calls; the graph \
                         expects {}",
                        Self::describe(exp)
                    ),
                ))
            }
            Body::Call(c) => Err(rank_err(
                rank,
                Some(c.group.clone()).filter(|g| !g.is_empty()),
                Some(c.seq),
                format!(
                    "order mismatch: the graph holds {total} calls, the rank made another ({})",
                    Self::describe(&c)
                ),
            )),
            Body::Fault(f) => Err(rank_err(
                rank,
                Some(f.group).filter(|g| !g.is_empty()),
                Some(f.op_index),
                format!("the rank reported a fault: {}", f.message),
            )),
            _ => Err(rank_err(
                rank,
                None,
                Some(k),
                "unexpected frame (only Call, Bye and Fault come from a rank)".into(),
            )),
        }
    }

    fn done(&mut self, rank: u32, op: u32, end: SimTime) -> Result<(), EmulateError> {
        let k = ((op - 1) / 2) as usize;
        let data = self.result(rank, k)?;
        let t0 = self.start();
        let end_s = end as f64 * 1e-12;
        let at = match self.clock {
            // Whole nanoseconds, rounded up: never before the emulated completion.
            Clock::Wall => Some(t0 + Duration::from_nanos(end.div_ceil(1000))),
            Clock::Asap => None,
        };
        let st = self.ranks.get_mut(&rank).expect("rank");
        st.answered += 1;
        st.done_ps.push(end);
        let _ = st.out.send(Out {
            at,
            body: Body::Done(Done {
                seq: k as u64,
                emulated_end_s: end_s,
                data,
            }),
        });
        Ok(())
    }

    /// The data result of call `k` of `rank` (empty when the rank sent no data).
    fn result(&self, rank: u32, k: usize) -> Result<Vec<u8>, EmulateError> {
        let st = &self.ranks[&rank];
        let mine = st.received[k]
            .as_ref()
            .expect("a call is received before it completes");
        let op = Op::try_from(mine.op).expect("validated");
        if mine.data.is_empty() && op != Op::Recv {
            return Ok(Vec::new());
        }
        let group = mine.group.clone();
        let err = |m: String| {
            rank_err(
                rank,
                Some(group.clone()).filter(|g| !g.is_empty()),
                Some(k as u64),
                m,
            )
        };
        match op {
            Op::Send | Op::Barrier => Ok(Vec::new()),
            Op::Recv => {
                let peer = mine.peer;
                let Some(pst) = self.ranks.get(&peer) else {
                    // A virtual peer: zeros of the expected size.
                    return Ok(vec![0; mine.bytes as usize]);
                };
                // The j-th receive from `peer` is the j-th send of `peer` to this rank.
                let j = (st.expected[..k].iter())
                    .filter(|c| c.op == Op::Recv as i32 && c.peer == peer)
                    .count();
                let send_k = (pst.expected.iter().enumerate())
                    .filter(|(_, c)| c.op == Op::Send as i32 && c.peer == rank)
                    .nth(j)
                    .map(|(i, _)| i)
                    .ok_or_else(|| err(format!("real peer {peer} has no matching send")))?;
                let sent = pst.received[send_k].as_ref().ok_or_else(|| {
                    err(format!("real peer {peer}'s send {send_k} has not arrived"))
                })?;
                if sent.data.is_empty() {
                    Ok(vec![0; mine.bytes as usize])
                } else {
                    Ok(sent.data.clone())
                }
            }
            _ => {
                // Contributions in group order; virtual members copy the lowest real member.
                let lowest = (group.iter())
                    .copied()
                    .filter(|m| self.real.binary_search(m).is_ok())
                    .min()
                    .expect("the rank itself is real");
                let data_of = |m: u32| -> Result<&[u8], EmulateError> {
                    let src = if self.ranks.contains_key(&m) {
                        m
                    } else {
                        lowest
                    };
                    let c = self.ranks[&src].received[k]
                        .as_ref()
                        .ok_or_else(|| err(format!("rank {src}'s call {k} has not arrived")))?;
                    if c.group != group {
                        return Err(err(format!(
                            "rank {src}'s call {k} is on group {:?}",
                            c.group
                        )));
                    }
                    Ok(if c.data.is_empty() {
                        &mine.data
                    } else {
                        &c.data
                    })
                };
                let contribs: Vec<&[u8]> = group
                    .iter()
                    .map(|&m| data_of(m))
                    .collect::<Result<_, _>>()?;
                let pos = group.iter().position(|&m| m == rank).expect("member");
                let dtype = DType::try_from(mine.dtype).expect("validated");
                let red = ReduceOp::try_from(mine.reduce).expect("validated");
                combine(op, dtype, red, &contribs, pos, mine.peer, &group).map_err(err)
            }
        }
    }
}

impl External for Hook {
    fn compute_ps(&mut self, rank: u32, op: u32, _start: SimTime) -> Result<SimTime, String> {
        self.compute(rank, op).map_err(|e| self.fail(e))
    }

    fn comm_done(&mut self, rank: u32, op: u32, end: SimTime) -> Result<(), String> {
        self.done(rank, op, end).map_err(|e| self.fail(e))
    }
}

/// Combines the contributions of a collective's members (in group order) into the result of
/// the member at `pos`: all-reduce and reduce-scatter reduce element-wise (sum, avg, max, min,
/// product over f32, f64, bf16, i32, i64, u8), reduce-scatter then keeps the member's shard;
/// all-gather concatenates; broadcast returns the root's buffer; all-to-all returns chunk `pos`
/// of every member's buffer.
pub fn combine(
    op: Op,
    dtype: DType,
    red: ReduceOp,
    contribs: &[&[u8]],
    pos: usize,
    root: u32,
    group: &[u32],
) -> Result<Vec<u8>, String> {
    let n = contribs.len();
    let len = contribs[pos].len();
    if contribs.iter().any(|c| c.len() != len) {
        return Err(format!(
            "members contributed buffers of different sizes ({:?} bytes)",
            contribs.iter().map(|c| c.len()).collect::<Vec<_>>()
        ));
    }
    match op {
        Op::AllReduce => reduce(dtype, red, contribs, n),
        Op::ReduceScatter => {
            if !len.is_multiple_of(n) {
                return Err(format!(
                    "reduce-scatter of {len} bytes does not split into {n} shards"
                ));
            }
            let all = reduce(dtype, red, contribs, n)?;
            let shard = len / n;
            Ok(all[pos * shard..(pos + 1) * shard].to_vec())
        }
        Op::AllGather => Ok(contribs.concat()),
        Op::Broadcast => {
            let r = group
                .iter()
                .position(|&m| m == root)
                .ok_or_else(|| format!("broadcast root {root} is not in the group"))?;
            Ok(contribs[r].to_vec())
        }
        Op::AllToAll => {
            if !len.is_multiple_of(n) {
                return Err(format!(
                    "all-to-all of {len} bytes does not split into {n} chunks"
                ));
            }
            let chunk = len / n;
            Ok(contribs
                .iter()
                .flat_map(|c| c[pos * chunk..(pos + 1) * chunk].iter().copied())
                .collect())
        }
        Op::Barrier | Op::Send | Op::Recv | Op::Unspecified => Ok(Vec::new()),
    }
}

fn reduce(dtype: DType, red: ReduceOp, contribs: &[&[u8]], n: usize) -> Result<Vec<u8>, String> {
    fn go<const W: usize>(
        contribs: &[&[u8]],
        n: usize,
        red: ReduceOp,
        dec: impl Fn([u8; W]) -> f64,
        enc: impl Fn(f64) -> [u8; W],
    ) -> Result<Vec<u8>, String> {
        let len = contribs[0].len();
        if !len.is_multiple_of(W) {
            return Err(format!(
                "{len} bytes is not a whole number of {W}-byte elements"
            ));
        }
        // Virtual members share one buffer (a copy of the lowest real member's): fold equal
        // buffers into one term with a multiplicity, so a group of thousands costs as much as
        // its real members (sums of f32 in f64 stay exact: k x v is what k additions give).
        let mut distinct: Vec<(&[u8], u32)> = Vec::new();
        for c in contribs {
            match distinct
                .iter_mut()
                .find(|(d, _)| std::ptr::eq(d.as_ptr(), c.as_ptr()) && d.len() == c.len())
            {
                Some((_, k)) => *k += 1,
                None => distinct.push((c, 1)),
            }
        }
        let mut out = Vec::with_capacity(len);
        for i in (0..len).step_by(W) {
            let x = |c: &[u8]| dec(c[i..i + W].try_into().expect("width"));
            let term = |c: &[u8], k: u32| {
                let v = x(c);
                match red {
                    ReduceOp::Sum | ReduceOp::Avg => v * k as f64,
                    ReduceOp::Max | ReduceOp::Min => v,
                    ReduceOp::Product => v.powi(k as i32),
                }
            };
            let mut acc = term(distinct[0].0, distinct[0].1);
            for &(c, k) in &distinct[1..] {
                let v = term(c, k);
                acc = match red {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::Max => acc.max(v),
                    ReduceOp::Min => acc.min(v),
                    ReduceOp::Product => acc * v,
                };
            }
            if red == ReduceOp::Avg {
                acc /= n as f64;
            }
            out.extend_from_slice(&enc(acc));
        }
        Ok(out)
    }
    match dtype {
        // f32 is accumulated in f64 and rounded once: the sum of equal contributions is exact.
        DType::F32 => go::<4>(
            contribs,
            n,
            red,
            |b| f32::from_le_bytes(b) as f64,
            |v| (v as f32).to_le_bytes(),
        ),
        DType::F64 => go::<8>(contribs, n, red, f64::from_le_bytes, f64::to_le_bytes),
        DType::Bf16 => go::<2>(
            contribs,
            n,
            red,
            |b| f32::from_bits((u16::from_le_bytes(b) as u32) << 16) as f64,
            |v| {
                // Round to nearest even on the 16 dropped bits.
                let bits = (v as f32).to_bits();
                let r = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
                ((r >> 16) as u16).to_le_bytes()
            },
        ),
        DType::I32 => go::<4>(
            contribs,
            n,
            red,
            |b| i32::from_le_bytes(b) as f64,
            |v| (v as i32).to_le_bytes(),
        ),
        DType::I64 => {
            // Integers beyond 2^53 would lose bits through f64: reduce them exactly.
            let len = contribs[0].len();
            if !len.is_multiple_of(8) {
                return Err(format!(
                    "{len} bytes is not a whole number of 8-byte elements"
                ));
            }
            let mut out = Vec::with_capacity(len);
            for i in (0..len).step_by(8) {
                let x = |c: &[u8]| i64::from_le_bytes(c[i..i + 8].try_into().expect("8"));
                let mut acc = x(contribs[0]);
                for c in &contribs[1..] {
                    let v = x(c);
                    acc = match red {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v),
                        ReduceOp::Max => acc.max(v),
                        ReduceOp::Min => acc.min(v),
                        ReduceOp::Product => acc.wrapping_mul(v),
                    };
                }
                if red == ReduceOp::Avg {
                    acc /= n as i64;
                }
                out.extend_from_slice(&acc.to_le_bytes());
            }
            Ok(out)
        }
        DType::U8 => go::<1>(
            contribs,
            n,
            red,
            |b| b[0] as f64,
            |v| [(v as i64).rem_euclid(256) as u8],
        ),
        DType::F16 | DType::Bytes => Err(format!(
            "the coordinator cannot reduce {} data (f32, f64, bf16, i32, i64 and u8 it can)",
            crate::graph_file::dtype_name(dtype)
        )),
    }
}
