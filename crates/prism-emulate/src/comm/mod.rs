//! The Rust client: a [`Communicator`] with collectives, point-to-point calls and a barrier,
//! over one of three backends (`docs/emulate.md`, "Rust client"):
//!
//! - [`tcp`]: real data among N processes over loopback TCP, a full mesh; every collective is a
//!   direct exchange among the group, reduced locally in group-rank order, so every member gets
//!   the same bits and a run repeats bit for bit. The all-real ground truth.
//! - [`local`]: recording. Completes every call at once with data synthesised from this rank's
//!   own contribution ([`reduce::synthesize`]); needs no peers.
//! - [`emulated`]: protocol v1 to the emulation coordinator; each call blocks until its `Done`.
//!
//! Whatever the backend, the communicator measures this thread's CPU time of compute between
//! calls (`Call::compute_s`) and keeps a [`Trace`] of every call of the current iteration in the
//! recorded-trace form (the frames a real rank would send, without data), so any run, recording
//! or not, can write the trace slicing reads.

pub mod emulated;
pub mod local;
pub mod reduce;
pub mod tcp;

use std::fmt;
use std::io::Write;
use std::path::Path;

use crate::protocol::{Body, Bye, Call, Hello, write_frame};
pub use crate::protocol::{DType, Op, ReduceOp};

/// Name this client gives in `Hello::client`.
pub const CLIENT_NAME: &str = concat!("prism-rust ", env!("CARGO_PKG_VERSION"));

/// Why a communication call or the session failed. Messages name the rank, the op index and
/// the group.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A call failed on this side (bad arguments, a peer that went away, a time-out).
    #[error("rank {rank}, op {op_index} ({op:?}, group {group:?}): {message}")]
    Call {
        rank: u32,
        op_index: u64,
        op: Op,
        group: Vec<u32>,
        message: String,
    },
    /// The coordinator (or a peer) ended the session with a `Fault`.
    #[error("fault from the coordinator: rank {rank}, group {group:?}, op {op_index}: {message}")]
    Fault {
        rank: u32,
        group: Vec<u32>,
        op_index: u64,
        message: String,
    },
    /// Setting up or closing the session failed.
    #[error("rank {rank}: {message}")]
    Session { rank: u32, message: String },
}

/// What one call asks for, as a backend sees it.
#[derive(Clone, Copy, Debug)]
pub struct CallSpec<'a> {
    /// The call's index in this rank's program (`Call::seq`).
    pub seq: u64,
    pub op: Op,
    /// Global ranks of the group in group-rank order (empty for send and receive).
    pub group: &'a [u32],
    pub dtype: DType,
    pub reduce: ReduceOp,
    /// Peer of a send or receive, root of a broadcast.
    pub peer: u32,
    /// CPU seconds of compute since the previous call returned.
    pub compute_s: f64,
}

impl CallSpec<'_> {
    /// The group's size (2 for a send or receive).
    pub fn group_size(&self) -> usize {
        match self.op {
            Op::Send | Op::Recv => 2,
            _ => self.group.len(),
        }
    }

    /// The protocol's `Call` for this spec with `bytes` and `data`.
    pub fn to_call(&self, bytes: u64, data: Vec<u8>) -> Call {
        Call {
            seq: self.seq,
            op: self.op as i32,
            group: self.group.to_vec(),
            bytes,
            dtype: self.dtype as i32,
            reduce: self.reduce as i32,
            peer: self.peer,
            data,
            compute_s: self.compute_s,
        }
    }
}

/// A transport under a [`Communicator`].
pub trait Backend: fmt::Debug + Send {
    /// Short name for messages ("tcp", "local", "emulated").
    fn name(&self) -> &'static str;

    /// Performs one call. `input` is this rank's contribution (`Call::bytes` is its length,
    /// or `output`'s for a receive); `output` receives the result and has the length
    /// [`output_len`] gives. An `Err` is the message; the communicator adds rank, op and
    /// group, except for a [`BackendError::Fault`], which it passes on.
    fn call(
        &mut self,
        spec: &CallSpec<'_>,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), BackendError>;

    /// Ends the session (`Bye` with the compute after the last call and the peak memory).
    fn finish(&mut self, compute_s: f64, peak_memory_bytes: u64) -> Result<(), BackendError>;

    /// Emulated completion time of the last call (`Done::emulated_end_s`), when the backend has
    /// one.
    fn emulated_time(&self) -> Option<f64> {
        None
    }
}

/// A backend's failure.
#[derive(Debug)]
pub enum BackendError {
    /// A message; the communicator names the rank, op and group.
    Msg(String),
    /// A `Fault` received from the other side.
    Fault(crate::protocol::Fault),
}

impl From<String> for BackendError {
    fn from(s: String) -> Self {
        BackendError::Msg(s)
    }
}

/// Bytes of one element of `dtype` (1 for opaque bytes).
pub fn dtype_size(dtype: DType) -> usize {
    match dtype {
        DType::Bytes | DType::U8 => 1,
        DType::F16 | DType::Bf16 => 2,
        DType::F32 | DType::I32 => 4,
        DType::F64 | DType::I64 => 8,
    }
}

/// The output length of `op` for an input of `input_len` bytes in a group of `group_size`
/// (for a receive, `input_len` is the expected message). Errors name the rule broken.
pub fn output_len(
    op: Op,
    input_len: usize,
    group_size: usize,
    elem: usize,
) -> Result<usize, String> {
    let g = group_size.max(1);
    if !input_len.is_multiple_of(elem) {
        return Err(format!(
            "{input_len} bytes is not a whole number of {elem}-byte elements"
        ));
    }
    Ok(match op {
        Op::Unspecified => return Err("the op is not set".into()),
        Op::AllReduce | Op::Broadcast | Op::Recv => input_len,
        Op::Send | Op::Barrier => 0,
        Op::AllGather => input_len * g,
        Op::ReduceScatter | Op::AllToAll => {
            if !(input_len / elem).is_multiple_of(g) {
                return Err(format!(
                    "{input_len} bytes do not split into {g} equal chunks of whole elements"
                ));
            }
            if op == Op::ReduceScatter {
                input_len / g
            } else {
                input_len
            }
        }
    })
}

/// One rank's calls of one iteration in recorded-trace form (`docs/emulate.md`, "Recorded
/// traces"): the `Call`s without data, then the compute after the last call and the peak memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub rank: u32,
    pub world_size: u32,
    /// Calls in program order, `seq` from 0, `data` empty.
    pub calls: Vec<Call>,
    /// CPU seconds of compute after the last call (`Bye::compute_s`).
    pub tail_compute_s: f64,
    /// Peak memory in bytes (`Bye::peak_memory_bytes`).
    pub peak_memory_bytes: u64,
}

impl Trace {
    /// The trace's frames: `Hello`, the calls, `Bye`.
    pub fn write(&self, w: &mut impl Write) -> Result<(), crate::protocol::ProtocolError> {
        write_frame(
            w,
            &Body::Hello(Hello {
                rank: self.rank,
                world_size: self.world_size,
                client: CLIENT_NAME.into(),
            }),
        )?;
        for c in &self.calls {
            write_frame(w, &Body::Call(c.clone()))?;
        }
        write_frame(
            w,
            &Body::Bye(Bye {
                compute_s: self.tail_compute_s,
                peak_memory_bytes: self.peak_memory_bytes,
            }),
        )
    }

    /// Writes the trace to `path`.
    pub fn write_file(&self, path: &Path) -> Result<(), String> {
        let f = std::fs::File::create(path)
            .map_err(|e| format!("cannot create trace {}: {e}", path.display()))?;
        let mut w = std::io::BufWriter::new(f);
        self.write(&mut w)
            .map_err(|e| format!("cannot write trace {}: {e}", path.display()))
    }

    /// Reads a trace file: `Hello`, calls, `Bye`, nothing else. Errors name the file and the
    /// frame number.
    pub fn read_file(path: &Path) -> Result<Trace, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::read(&mut bytes.as_slice()).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Reads a trace from frames.
    pub fn read(r: &mut impl std::io::Read) -> Result<Trace, String> {
        use crate::protocol::read_frame;
        let mut t = Trace::default();
        let mut n = 0usize;
        let mut next = |r: &mut _| {
            n += 1;
            read_frame(r).map_err(|e| format!("frame {n}: {e}"))
        };
        match next(r)? {
            Some(Body::Hello(h)) => {
                t.rank = h.rank;
                t.world_size = h.world_size;
            }
            other => return Err(format!("frame 1: expected Hello, found {other:?}")),
        }
        loop {
            match next(r)? {
                Some(Body::Call(c)) => {
                    if c.seq != t.calls.len() as u64 {
                        return Err(format!(
                            "call {}: seq {} out of order",
                            t.calls.len(),
                            c.seq
                        ));
                    }
                    c.validate(t.rank)?;
                    t.calls.push(c)
                }
                Some(Body::Bye(b)) => {
                    t.tail_compute_s = b.compute_s;
                    t.peak_memory_bytes = b.peak_memory_bytes;
                    break;
                }
                other => return Err(format!("expected Call or Bye, found {other:?}")),
            }
        }
        if next(r)?.is_some() {
            return Err("frames after Bye".into());
        }
        Ok(t)
    }

    /// Total compute of the trace (the calls' and the tail's).
    pub fn compute_s(&self) -> f64 {
        self.calls.iter().map(|c| c.compute_s).sum::<f64>() + self.tail_compute_s
    }
}

/// Where compute time comes from: this thread's CPU time, or (for tests) any clock.
pub type ClockFn = Box<dyn FnMut() -> f64 + Send>;

/// This thread's CPU time in seconds.
pub fn thread_cpu_s() -> f64 {
    cpu_time::ThreadTime::now().as_duration().as_secs_f64()
}

/// A communicator of one rank over a [`Backend`].
///
/// Typed calls take `f32` buffers; [`Communicator::raw`] takes bytes of any [`DType`].
pub struct Communicator {
    rank: u32,
    world_size: u32,
    backend: Box<dyn Backend>,
    seq: u64,
    clock: ClockFn,
    /// Clock at the last call's release (the backend's compute is measured from here).
    last_release: f64,
    /// Clock at the last release or iteration start (the trace's compute is measured from
    /// here).
    trace_mark: f64,
    total_compute_s: f64,
    trace: Trace,
    /// Set once the session has ended.
    finished: bool,
    /// The compute lock, held while this rank computes (see
    /// [`Communicator::set_compute_lock`]).
    gate: Option<std::fs::File>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("backend", &self.backend)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Communicator {
    /// A communicator of `rank` in a world of `world_size` over `backend`, timing compute with
    /// this thread's CPU time.
    pub fn new(rank: u32, world_size: u32, backend: Box<dyn Backend>) -> Self {
        Self::with_clock(rank, world_size, backend, Box::new(thread_cpu_s))
    }

    /// As [`Communicator::new`] with another clock (tests use a counter).
    pub fn with_clock(
        rank: u32,
        world_size: u32,
        backend: Box<dyn Backend>,
        mut clock: ClockFn,
    ) -> Self {
        let last_release = clock();
        Communicator {
            rank,
            world_size,
            backend,
            seq: 0,
            clock,
            last_release,
            trace_mark: last_release,
            total_compute_s: 0.0,
            trace: Trace {
                rank,
                world_size,
                ..Trace::default()
            },
            finished: false,
            gate: None,
        }
    }

    /// Serialises compute across processes: from now on this rank holds an exclusive lock on
    /// the file `path` while it computes and releases it for the duration of each call, so
    /// ranks sharing the file never compute at the same time. Measured CPU time then does not
    /// depend on how many ranks share the cores (cache and SMT contention), which keeps an
    /// all-real run of many ranks on two cores comparable with a hybrid run of one or two.
    /// Waiting for the lock costs no CPU time, so it never counts as compute.
    pub fn set_compute_lock(&mut self, path: &Path) -> Result<(), CommError> {
        let rank = self.rank;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .and_then(|f| f.lock().map(|_| f))
            .map_err(|e| CommError::Session {
                rank,
                message: format!("compute lock {}: {e}", path.display()),
            })?;
        self.gate = Some(f);
        self.reset_compute_clock();
        Ok(())
    }

    /// A communicator over the TCP mesh ([`tcp::TcpBackend::connect`]).
    pub fn tcp(
        rank: u32,
        world_size: u32,
        addr: &str,
        timeout: std::time::Duration,
    ) -> Result<Self, CommError> {
        let b = tcp::TcpBackend::connect(rank, world_size, addr, timeout)
            .map_err(|message| CommError::Session { rank, message })?;
        Ok(Self::new(rank, world_size, Box::new(b)))
    }

    /// The communicator of a launched rank, from its environment: `PRISM_RANK`,
    /// `PRISM_WORLD_SIZE`, and `PRISM_COORDINATOR` (emulated) or else `PRISM_TCP_ADDR`
    /// (all-real); `PRISM_TIMEOUT_S` (default 300) bounds every wait; `PRISM_COMPUTE_LOCK`, when
    /// set, is the compute lock file ([`Communicator::set_compute_lock`]).
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// [`Communicator::from_env`] with another source of variables.
    pub fn from_env_with(env: impl Fn(&str) -> Option<String>) -> Result<Self, CommError> {
        let num = |k: &str| -> Result<u32, CommError> {
            let v = env(k).ok_or_else(|| CommError::Session {
                rank: 0,
                message: format!("{k} is not set"),
            })?;
            v.parse().map_err(|_| CommError::Session {
                rank: 0,
                message: format!("{k}={v:?}: expected a non-negative integer"),
            })
        };
        let rank = num("PRISM_RANK")?;
        let world = num("PRISM_WORLD_SIZE")?;
        let session = |message: String| CommError::Session { rank, message };
        if rank >= world {
            return Err(session(format!(
                "PRISM_RANK={rank} outside a world of {world}"
            )));
        }
        let timeout = match env("PRISM_TIMEOUT_S") {
            None => 300.0,
            Some(v) => v
                .parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    session(format!("PRISM_TIMEOUT_S={v:?}: expected positive seconds"))
                })?,
        };
        let timeout = std::time::Duration::from_secs_f64(timeout);
        let mut c = if let Some(addr) = env("PRISM_COORDINATOR") {
            Self::emulated(rank, world, &addr, timeout, timeout)?
        } else if let Some(addr) = env("PRISM_TCP_ADDR") {
            Self::tcp(rank, world, &addr, timeout)?
        } else {
            return Err(session(
                "neither PRISM_COORDINATOR nor PRISM_TCP_ADDR is set".into(),
            ));
        };
        if let Some(p) = env("PRISM_COMPUTE_LOCK") {
            c.set_compute_lock(Path::new(&p))?;
        }
        Ok(c)
    }

    /// A recording communicator ([`local::LocalBackend`]).
    pub fn local(rank: u32, world_size: u32) -> Self {
        Self::new(rank, world_size, Box::new(local::LocalBackend::new(rank)))
    }

    /// A communicator speaking protocol v1 to the coordinator at `addr`
    /// ([`emulated::EmulatedBackend::connect`]).
    pub fn emulated(
        rank: u32,
        world_size: u32,
        addr: &str,
        connect_timeout: std::time::Duration,
        timeout: std::time::Duration,
    ) -> Result<Self, CommError> {
        let b =
            emulated::EmulatedBackend::connect(rank, world_size, addr, connect_timeout, timeout)
                .map_err(|message| CommError::Session { rank, message })?;
        Ok(Self::new(rank, world_size, Box::new(b)))
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The world size.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Compute seconds measured up to the last call's release or iteration start (all
    /// iterations).
    pub fn total_compute_s(&self) -> f64 {
        self.total_compute_s
    }

    /// The backend's emulated time of the last completed call, if it has one.
    pub fn emulated_time(&self) -> Option<f64> {
        self.backend.emulated_time()
    }

    /// Measures compute with `clock` from now on (the compute since the last release is
    /// forgotten, as by [`Communicator::reset_compute_clock`]).
    pub fn set_clock(&mut self, clock: ClockFn) {
        self.clock = clock;
        self.reset_compute_clock();
    }

    /// Forgets the compute since the last release (e.g. the model's set-up before the first
    /// step), for the backend and the trace alike.
    pub fn reset_compute_clock(&mut self) {
        let now = (self.clock)();
        self.last_release = now;
        self.trace_mark = now;
    }

    /// Starts a new iteration of the trace: the compute since the last call closes the previous
    /// iteration (returned, with its trace, as its tail), and the new trace's calls count from
    /// 0. The backend is unaffected: its next call's `compute_s` still counts from the last
    /// release (the emulated backend's `seq` keeps counting too).
    pub fn start_iteration(&mut self, peak_memory_bytes: u64) -> Trace {
        let now = (self.clock)();
        self.split_at(now, peak_memory_bytes)
    }

    fn split_at(&mut self, now: f64, peak_memory_bytes: u64) -> Trace {
        let tail = (now - self.trace_mark).max(0.0);
        self.trace_mark = now;
        let mut done = std::mem::replace(
            &mut self.trace,
            Trace {
                rank: self.rank,
                world_size: self.world_size,
                ..Trace::default()
            },
        );
        done.tail_compute_s = tail;
        done.peak_memory_bytes = peak_memory_bytes;
        done
    }

    /// Performs one call on bytes. `input` is the contribution (empty for a receive and a
    /// barrier); `output` must have the length the op implies ([`output_len`]; the expected
    /// message for a receive).
    #[allow(clippy::too_many_arguments)]
    pub fn raw(
        &mut self,
        op: Op,
        group: &[u32],
        dtype: DType,
        reduce: ReduceOp,
        peer: u32,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        let now = (self.clock)();
        let compute_s = (now - self.last_release).max(0.0);
        let trace_compute_s = (now - self.trace_mark).max(0.0);
        let spec = CallSpec {
            seq: self.seq,
            op,
            group,
            dtype,
            reduce,
            peer,
            compute_s,
        };
        let err = |message: String| CommError::Call {
            rank: self.rank,
            op_index: self.seq,
            op,
            group: group.to_vec(),
            message,
        };
        if self.finished {
            return Err(err("the session has ended".into()));
        }
        let bytes = if op == Op::Recv {
            output.len()
        } else {
            input.len()
        };
        let want = output_len(op, bytes, spec.group_size(), dtype_size(dtype)).map_err(err)?;
        if op == Op::Recv && !input.is_empty() {
            return Err(err("a receive takes no input".into()));
        }
        if output.len() != want {
            return Err(err(format!(
                "output of {} bytes; a {op:?} of {bytes} bytes in a group of {} gives {want}",
                output.len(),
                spec.group_size()
            )));
        }
        if op == Op::Barrier && !input.is_empty() {
            return Err(err("a barrier takes no data".into()));
        }
        let call = spec.to_call(bytes as u64, Vec::new());
        call.validate(self.rank).map_err(err)?;
        if matches!(op, Op::Send | Op::Recv) && peer >= self.world_size
            || group.iter().any(|&g| g >= self.world_size)
        {
            return Err(err(format!(
                "a rank outside the world of {}",
                self.world_size
            )));
        }
        if op == Op::Broadcast && !group.contains(&peer) {
            return Err(err(format!("broadcast root {peer} is not in the group")));
        }
        self.total_compute_s += compute_s;
        if let Some(g) = &self.gate {
            g.unlock().map_err(|e| err(format!("compute lock: {e}")))?;
        }
        let res = self.backend.call(&spec, input, output);
        if let Some(g) = &self.gate {
            g.lock().map_err(|e| err(format!("compute lock: {e}")))?;
        }
        match res {
            Ok(()) => {}
            Err(BackendError::Msg(m)) => return Err(err(m)),
            Err(BackendError::Fault(f)) => {
                return Err(CommError::Fault {
                    rank: f.rank,
                    group: f.group,
                    op_index: f.op_index,
                    message: f.message,
                });
            }
        }
        let mut call = call;
        call.seq = self.trace.calls.len() as u64;
        call.compute_s = trace_compute_s;
        self.trace.calls.push(call);
        self.seq += 1;
        self.last_release = (self.clock)();
        self.trace_mark = self.last_release;
        Ok(())
    }

    fn raw_f32(
        &mut self,
        op: Op,
        group: &[u32],
        reduce: ReduceOp,
        peer: u32,
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), CommError> {
        let inb = f32_bytes(input);
        let mut outb = vec![0u8; output.len() * 4];
        self.raw(op, group, DType::F32, reduce, peer, &inb, &mut outb)?;
        bytes_to_f32(&outb, output);
        Ok(())
    }

    /// All-reduce of `buf` in place over `group` (global ranks, group-rank order).
    pub fn all_reduce(
        &mut self,
        group: &[u32],
        buf: &mut [f32],
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        let input = buf.to_vec();
        self.raw_f32(Op::AllReduce, group, reduce, 0, &input, buf)
    }

    /// Reduce-scatter: `input` holds `group.len()` equal chunks; `output` (one chunk) gets the
    /// reduction of this rank's chunk over the group.
    pub fn reduce_scatter(
        &mut self,
        group: &[u32],
        input: &[f32],
        output: &mut [f32],
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        self.raw_f32(Op::ReduceScatter, group, reduce, 0, input, output)
    }

    /// All-gather: `output` gets every member's `input`, in group-rank order.
    pub fn all_gather(
        &mut self,
        group: &[u32],
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), CommError> {
        self.raw_f32(Op::AllGather, group, ReduceOp::Sum, 0, input, output)
    }

    /// All-to-all: chunk `j` of `input` goes to member `j`; chunk `i` of `output` comes from
    /// member `i`.
    pub fn all_to_all(
        &mut self,
        group: &[u32],
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), CommError> {
        self.raw_f32(Op::AllToAll, group, ReduceOp::Sum, 0, input, output)
    }

    /// Broadcast of the root's (`root`, a global rank) `buf` to every member, in place.
    pub fn broadcast(
        &mut self,
        group: &[u32],
        root: u32,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        let input = buf.to_vec();
        self.raw_f32(Op::Broadcast, group, ReduceOp::Sum, root, &input, buf)
    }

    /// Sends `buf` to the global rank `peer`.
    pub fn send(&mut self, peer: u32, buf: &[f32]) -> Result<(), CommError> {
        self.raw_f32(Op::Send, &[], ReduceOp::Sum, peer, buf, &mut [])
    }

    /// Receives `buf.len()` values from the global rank `peer`.
    pub fn recv(&mut self, peer: u32, buf: &mut [f32]) -> Result<(), CommError> {
        self.raw_f32(Op::Recv, &[], ReduceOp::Sum, peer, &[], buf)
    }

    /// Waits until every member of `group` has reached the barrier.
    pub fn barrier(&mut self, group: &[u32]) -> Result<(), CommError> {
        self.raw(
            Op::Barrier,
            group,
            DType::Bytes,
            ReduceOp::Sum,
            0,
            &[],
            &mut [],
        )
    }

    /// Ends the session: the backend's `Bye` carries the compute since the last call and
    /// `peak_memory_bytes`. Returns the current iteration's trace, closed the same way.
    pub fn finish(&mut self, peak_memory_bytes: u64) -> Result<Trace, CommError> {
        let now = (self.clock)();
        let trace = self.split_at(now, peak_memory_bytes);
        if self.finished {
            return Ok(trace);
        }
        self.finished = true;
        if let Some(g) = self.gate.take() {
            let _ = g.unlock();
        }
        let tail = (now - self.last_release).max(0.0);
        self.total_compute_s += tail;
        self.last_release = now;
        match self.backend.finish(tail, peak_memory_bytes) {
            Ok(()) => Ok(trace),
            Err(BackendError::Msg(message)) => Err(CommError::Session {
                rank: self.rank,
                message,
            }),
            Err(BackendError::Fault(f)) => Err(CommError::Fault {
                rank: f.rank,
                group: f.group,
                op_index: f.op_index,
                message: f.message,
            }),
        }
    }
}

/// Little-endian bytes of `xs`.
pub fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * 4);
    for x in xs {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Fills `out` from little-endian bytes (`bytes.len() == 4 * out.len()`).
pub fn bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Parses an address `unix:PATH` or `tcp:HOST:PORT` (also a bare `HOST:PORT`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Unix(std::path::PathBuf),
    Tcp(String),
}

impl Address {
    /// Parses `s`; the error names the forms accepted.
    pub fn parse(s: &str) -> Result<Address, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(format!("address {s:?}: unix: needs a path"));
            }
            Ok(Address::Unix(p.into()))
        } else {
            let hp = s.strip_prefix("tcp:").unwrap_or(s);
            match hp.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
                    Ok(Address::Tcp(hp.to_string()))
                }
                _ => Err(format!(
                    "address {s:?}: expected unix:PATH or tcp:HOST:PORT"
                )),
            }
        }
    }
}
