//! Chrome Trace Event Format output: the recorded ranks' timelines as a JSON trace that opens in
//! Perfetto (<https://ui.perfetto.dev>) and `chrome://tracing`.
//!
//! Layout of the trace:
//! - one *process* per recorded rank, named `rank N (tp a, cp b, dp c, pp d)` and sorted by rank;
//!   its pid is `rank + PID_OFFSET` (Perfetto treats pid 0 as the kernel's swapper process, so
//!   rank 0 cannot be pid 0);
//! - one *thread* per stream of that rank that ran anything, named by [`Stream::name`] and sorted
//!   in stream order; its tid is `stream index + TID_OFFSET` (tid 0 is special for the same
//!   reason);
//! - one complete event (`"ph":"X"`) per op, `ts` and `dur` in microseconds (fractional: the
//!   engine's picoseconds divided by 10^6). Names: the kernel name (`qkv_fwd`, ...) with the op
//!   class as category, or for communication (`"cat":"comm"`) `"<group> <collective>"`
//!   (`tp all_gather`, `dp reduce_scatter`, `edp all_reduce`, ...), `pp send` and `pp recv`.
//!   A `pp recv` event spans the time the stream waited for the message; receives whose message
//!   was already there take no time and are left out.
//! - `args`: `phase`, `micro_batch` and `layer` (absent for per-iteration / non-layer work),
//!   `op` (the op id in the rank's program), `bytes` for communication, `shape` for GEMMs
//!   (`{m, n, k, batch}`) and attention kernels, `hbm_bytes` for memory-bound kernels.
//!
//! Events are written one at a time with `serde_json` (a trace of millions of ops is never held
//! as one JSON value); within each (pid, tid) they are sorted by start time.

use std::io::{self, BufWriter, Write};

use prism_core::SimResult;
use prism_core::cost::comm::Collective;
use prism_core::graph::{NONE, NUM_STREAMS, OpKind, OpTag, Phase, Program, STREAMS, Stream};
use prism_core::layout::{Coord, GroupKind, Layout};
use prism_core::ops::Work;
use serde::Serialize;

/// Added to a rank to form its trace pid.
pub const PID_OFFSET: u32 = 1;

/// Added to a stream's index to form its trace tid.
pub const TID_OFFSET: u32 = 1;

/// Trace pid of `rank`.
pub fn pid_of(rank: u32) -> u32 {
    rank + PID_OFFSET
}

/// Trace tid of `stream`.
pub fn tid_of(stream: Stream) -> u32 {
    stream as u32 + TID_OFFSET
}

/// Lower-case name of a process-group kind, as used in collective event names.
pub fn group_name(kind: GroupKind) -> &'static str {
    match kind {
        GroupKind::Tp => "tp",
        GroupKind::Cp => "cp",
        GroupKind::Ep => "ep",
        GroupKind::Dp => "dp",
        GroupKind::Edp => "edp",
    }
}

/// Lower-case name of a phase.
pub fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Recompute => "recompute",
        Phase::Optimizer => "optimizer",
        Phase::Weight => "weight",
    }
}

/// Trace event name of a collective over a group of `kind`, e.g. `tp all_gather`.
pub fn collective_event_name(kind: GroupKind, op: Collective) -> String {
    format!("{} {}", group_name(kind), op.name())
}

/// Writes the recorded timelines of `result` as a Chrome Trace Event Format JSON document.
///
/// Ranks without a recorded timeline (see `SimOptions::record_ranks`) do not appear; with no
/// recorded rank the trace has no events but is still valid. `out` is buffered internally.
pub fn write_chrome_trace<W: Write>(result: &SimResult, out: W) -> io::Result<()> {
    let mut w = Emitter {
        w: BufWriter::with_capacity(1 << 16, out),
        first: true,
    };
    let layout = result.graph.layout;
    w.w.write_all(b"{\"traceEvents\":[")?;

    let mut timelines: Vec<_> = result.timelines.iter().collect();
    timelines.sort_by_key(|t| t.rank);

    let mut ops: Vec<(u8, u64, u64, u32)> = Vec::new();
    for tl in timelines {
        let rank = tl.rank;
        let pid = pid_of(rank);
        let prog = result.graph.program_of(rank);
        // Which ops are shown: every op except receives that did not wait.
        ops.clear();
        ops.extend(tl.ops.iter().filter_map(|r| {
            let s = prog.stream[r.op as usize];
            let shown = r.end > r.start || !matches!(prog.kind[r.op as usize], OpKind::Recv { .. });
            shown.then_some((s as u8, r.start, r.end, r.op))
        }));
        ops.sort_unstable();

        let c = layout.coord(rank);
        w.emit(&Meta {
            name: "process_name",
            ph: "M",
            pid,
            tid: 0,
            args: MetaArgs::Name {
                name: &format!(
                    "rank {rank} (tp {}, cp {}, dp {}, pp {})",
                    c.tp, c.cp, c.dp, c.pp
                ),
            },
        })?;
        w.emit(&Meta {
            name: "process_sort_index",
            ph: "M",
            pid,
            tid: 0,
            args: MetaArgs::Sort { sort_index: rank },
        })?;
        let mut used = [false; NUM_STREAMS];
        for &(s, ..) in &ops {
            used[s as usize] = true;
        }
        for (i, &stream) in STREAMS.iter().enumerate() {
            if !used[i] {
                continue;
            }
            let tid = tid_of(stream);
            w.emit(&Meta {
                name: "thread_name",
                ph: "M",
                pid,
                tid,
                args: MetaArgs::Name {
                    name: stream.name(),
                },
            })?;
            w.emit(&Meta {
                name: "thread_sort_index",
                ph: "M",
                pid,
                tid,
                args: MetaArgs::Sort {
                    sort_index: i as u32,
                },
            })?;
        }

        for &(s, start, end, op) in &ops {
            let stream = STREAMS[s as usize];
            w.emit(&complete_event(
                prog, &layout, c, rank, stream, op, start, end,
            ))?;
        }
    }

    w.w.write_all(b"],\"displayTimeUnit\":\"ms\",\"otherData\":")?;
    let s = &result.summary;
    let other = serde_json::json!({
        "name": s.name,
        "num_gpus": s.num_gpus,
        "iteration_time_s": s.iteration_time_s,
        "tokens_per_s": s.tokens_per_s,
        "model_tflops_per_gpu": s.model_tflops_per_gpu,
        "hardware_tflops_per_gpu": s.hardware_tflops_per_gpu,
        "mfu": s.mfu,
        "hfu": s.hfu,
        "peak_memory_bytes": s.peak_memory_bytes,
        "bubble_fraction": s.bubble_fraction,
        "events": result.events,
        "recorded_ranks": result.timelines.len(),
        "time_unit": "ts and dur in microseconds",
    });
    serde_json::to_writer(&mut w.w, &other)?;
    w.w.write_all(b"}\n")?;
    w.w.flush()
}

/// Writes events as comma-separated JSON array elements.
struct Emitter<W: Write> {
    w: BufWriter<W>,
    first: bool,
}

impl<W: Write> Emitter<W> {
    fn emit<T: Serialize>(&mut self, ev: &T) -> io::Result<()> {
        if self.first {
            self.first = false;
            self.w.write_all(b"\n")?;
        } else {
            self.w.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut self.w, ev)?;
        Ok(())
    }
}

#[derive(Serialize)]
struct Meta<'a> {
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    args: MetaArgs<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum MetaArgs<'a> {
    Name { name: &'a str },
    Sort { sort_index: u32 },
}

#[derive(Serialize)]
struct Complete {
    name: EventName,
    cat: &'static str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    ts: f64,
    dur: f64,
    args: Args,
}

/// An event name without allocating for kernels.
enum EventName {
    Static(&'static str),
    Coll(GroupKind, Collective),
}

impl Serialize for EventName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            EventName::Static(n) => s.serialize_str(n),
            EventName::Coll(g, c) => s.collect_str(&format_args!("{} {}", group_name(g), c.name())),
        }
    }
}

#[derive(Serialize)]
struct Args {
    phase: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    micro_batch: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    layer: Option<u32>,
    op: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shape: Option<Shape>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hbm_bytes: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    recompute: bool,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Shape {
    Gemm {
        m: u64,
        n: u64,
        k: u64,
        batch: u64,
    },
    Attention {
        batch: u64,
        heads: u64,
        seq_q: u64,
        seq_kv: u64,
        head_dim: u64,
        causal: bool,
    },
}

/// Picoseconds to microseconds.
fn us(ps: u64) -> f64 {
    ps as f64 / 1e6
}

#[allow(clippy::too_many_arguments)]
fn complete_event(
    prog: &Program,
    layout: &Layout,
    c: Coord,
    rank: u32,
    stream: Stream,
    op: u32,
    start: u64,
    end: u64,
) -> Complete {
    let OpTag {
        phase,
        micro_batch,
        layer,
    } = prog.tag[op as usize];
    let mut args = Args {
        phase: phase_name(phase),
        micro_batch: (micro_batch != NONE).then_some(micro_batch),
        layer: (layer != NONE).then_some(layer),
        op,
        bytes: None,
        peer: None,
        shape: None,
        hbm_bytes: None,
        recompute: false,
    };
    let (name, cat) = match prog.kind[op as usize] {
        OpKind::Compute(k) => {
            args.recompute = k.recompute;
            match k.work {
                Work::Gemm { m, n, k, batch } => args.shape = Some(Shape::Gemm { m, n, k, batch }),
                Work::Attention {
                    batch,
                    heads,
                    seq_q,
                    seq_kv,
                    head_dim,
                    causal,
                    ..
                } => {
                    args.shape = Some(Shape::Attention {
                        batch,
                        heads,
                        seq_q,
                        seq_kv,
                        head_dim,
                        causal,
                    })
                }
                Work::Memory { bytes } => args.hbm_bytes = Some(bytes),
                Work::Measured { .. } => {}
            }
            (EventName::Static(k.name), k.class.name())
        }
        OpKind::Collective { group, op, bytes } => {
            args.bytes = Some(bytes);
            (EventName::Coll(group, op), "comm")
        }
        OpKind::Send { delta, bytes, .. } => {
            args.bytes = Some(bytes);
            let pp = (c.pp as i64 + delta as i64).rem_euclid(layout.pp as i64) as u32;
            args.peer = Some(layout.rank(Coord { pp, ..c }));
            (EventName::Static("pp send"), "comm")
        }
        OpKind::Recv { .. } => (EventName::Static("pp recv"), "comm"),
    };
    Complete {
        name,
        cat,
        ph: "X",
        pid: pid_of(rank),
        tid: tid_of(stream),
        ts: us(start),
        dur: us(end - start),
        args,
    }
}
