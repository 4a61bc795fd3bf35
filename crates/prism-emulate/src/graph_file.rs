//! The sliced-graph file (`prism emulate slice --out FILE`, read by `prism emulate GRAPH`): one
//! JSON object holding the target layout, the cluster to price communication on, and one
//! recorded trace per symmetry class (pipeline stage). The global graph is not stored: it is
//! rebuilt from these by [`prism_core::recorded::graph_from_traces`] (every rank of a stage runs
//! its class's program on its own groups), which is exact and keeps the file small at any scale.
//!
//! ```json
//! {
//!   "format": "prism-emulate-graph", "version": 1,
//!   "layout": {"tp": 2, "pp": 2, "dp": 2},
//!   "cluster": {"preset": "dgx-h100", "set": ["cluster.nic_gbps=100"]},
//!   "classes": [
//!     {"stage": 0, "rank": 0, "client": "prism-rust 0.1", "peak_memory_bytes": 123,
//!      "tail_ps": 5000000,
//!      "calls": [{"op": "all_reduce", "group": [0, 1], "bytes": 4096, "dtype": "f32",
//!                 "reduce": "sum", "peer": 0, "compute_ps": 1000000}]}
//!   ]
//! }
//! ```
//!
//! Times are integer picoseconds (`compute_ps`: compute before the call; `tail_ps`: after the
//! last call), so a file round-trips exactly. `op`, `dtype` and `reduce` use the protocol's
//! names in snake case. `group` lists global ranks in group-rank order, as recorded by the
//! class's representative `rank`.

use serde::{Deserialize, Serialize};

use crate::protocol::{Call, DType, Op, ReduceOp};

/// The `format` value of a sliced-graph file.
pub const FORMAT: &str = "prism-emulate-graph";
/// The `version` this build writes and reads.
pub const VERSION: u32 = 1;

/// Tensor, pipeline and data parallel sizes of the target job (rank = tp_idx + tp * (dp_idx +
/// dp * pp_idx), Megatron's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutSpec {
    /// Tensor-parallel size.
    pub tp: u32,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Data-parallel size.
    pub dp: u32,
}

impl LayoutSpec {
    /// Parses `tp,pp,dp` (e.g. `2,2,2`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        let bad = || format!("layout `{text}` is not `tp,pp,dp` with three positive integers");
        if parts.len() != 3 {
            return Err(bad());
        }
        let mut v = [0u32; 3];
        for (i, p) in parts.iter().enumerate() {
            v[i] = p.parse::<u32>().map_err(|_| bad())?;
            if v[i] == 0 {
                return Err(bad());
            }
        }
        let spec = LayoutSpec {
            tp: v[0],
            pp: v[1],
            dp: v[2],
        };
        spec.world_size()?;
        Ok(spec)
    }

    /// `tp * pp * dp`, refused past `u32` (and past 2^24 ranks, beyond any target).
    pub fn world_size(&self) -> Result<u32, String> {
        let n = self.tp as u64 * self.pp as u64 * self.dp as u64;
        if n == 0 || n > 1 << 24 {
            return Err(format!(
                "layout tp {} pp {} dp {} has {n} ranks; 1 to 16,777,216 are supported",
                self.tp, self.pp, self.dp
            ));
        }
        Ok(n as u32)
    }

    /// The engine's layout (cp = ep = 1, Megatron's default order `tp-cp-ep-dp-pp`) on nodes of
    /// `gpus_per_node`.
    pub fn layout(&self, gpus_per_node: u32) -> prism_core::layout::Layout {
        prism_core::layout::Layout {
            tp: self.tp,
            cp: 1,
            dp: self.dp,
            pp: self.pp,
            ep: 1,
            gpus_per_node,
            order: prism_core::job::RankOrder::TpCpEpDpPp,
        }
    }

    /// `tp,pp,dp`, as `PRISM_LAYOUT` and `--layout` spell it.
    pub fn to_arg(&self) -> String {
        format!("{},{},{}", self.tp, self.pp, self.dp)
    }
}

/// The cluster a graph is priced on: a preset name and `cluster.KEY=VALUE` overrides (resolved
/// by the command line through `prism-io`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Cluster preset (`prism-io` presets, e.g. `dgx-h100`).
    pub preset: String,
    /// Overrides, e.g. `cluster.nic_gbps=100`.
    #[serde(default)]
    pub set: Vec<String>,
}

/// One recorded call of a class trace (a protocol [`Call`] without data; compute in ps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassCall {
    /// Operation (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`, `broadcast`,
    /// `send`, `recv`, `barrier`).
    pub op: String,
    /// Global ranks of the group, group-rank order (empty for send and receive).
    #[serde(default)]
    pub group: Vec<u32>,
    /// Bytes the rank contributes (protocol meaning).
    pub bytes: u64,
    /// Element type (`bytes`, `f32`, `f16`, `bf16`, `f64`, `i32`, `i64`, `u8`).
    pub dtype: String,
    /// Reduction (`sum`, `avg`, `max`, `min`, `product`).
    pub reduce: String,
    /// Send/receive peer or broadcast root.
    #[serde(default)]
    pub peer: u32,
    /// Compute before the call, ps.
    pub compute_ps: u64,
}

/// The trace of one symmetry class, as recorded by its representative.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassTrace {
    /// Pipeline stage (the class).
    pub stage: u32,
    /// The representative that recorded it.
    pub rank: u32,
    /// The recording client's `Hello.client`.
    #[serde(default)]
    pub client: String,
    /// The representative's peak memory (`Bye.peak_memory_bytes`; 0: not measured).
    #[serde(default)]
    pub peak_memory_bytes: u64,
    /// Compute after the last call, ps.
    pub tail_ps: u64,
    /// Calls in program order.
    pub calls: Vec<ClassCall>,
}

/// A sliced graph: everything the coordinator needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlicedGraph {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// Target layout.
    pub layout: LayoutSpec,
    /// Cluster to price communication on.
    pub cluster: ClusterSpec,
    /// One trace per stage, by stage.
    pub classes: Vec<ClassTrace>,
}

/// Snake-case name of a protocol op.
pub fn op_name(op: Op) -> &'static str {
    match op {
        Op::Unspecified => "unspecified",
        Op::AllReduce => "all_reduce",
        Op::ReduceScatter => "reduce_scatter",
        Op::AllGather => "all_gather",
        Op::AllToAll => "all_to_all",
        Op::Broadcast => "broadcast",
        Op::Send => "send",
        Op::Recv => "recv",
        Op::Barrier => "barrier",
    }
}

/// Snake-case name of a dtype.
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bytes => "bytes",
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
        DType::F64 => "f64",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U8 => "u8",
    }
}

/// Snake-case name of a reduction.
pub fn reduce_name(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "sum",
        ReduceOp::Avg => "avg",
        ReduceOp::Max => "max",
        ReduceOp::Min => "min",
        ReduceOp::Product => "product",
    }
}

fn parse_named<T: Copy>(all: &[T], name: impl Fn(T) -> &'static str, text: &str) -> Option<T> {
    all.iter().copied().find(|&x| name(x) == text)
}

impl ClassCall {
    /// The call as recorded, from a protocol call (data dropped; compute rounded to ps).
    pub fn from_call(c: &Call, compute_ps: u64) -> Result<Self, String> {
        let op = Op::try_from(c.op).map_err(|_| format!("unknown op number {}", c.op))?;
        let dtype =
            DType::try_from(c.dtype).map_err(|_| format!("unknown dtype number {}", c.dtype))?;
        let reduce = ReduceOp::try_from(c.reduce)
            .map_err(|_| format!("unknown reduction number {}", c.reduce))?;
        Ok(ClassCall {
            op: op_name(op).into(),
            group: c.group.clone(),
            bytes: c.bytes,
            dtype: dtype_name(dtype).into(),
            reduce: reduce_name(reduce).into(),
            peer: c.peer,
            compute_ps,
        })
    }

    /// The protocol op.
    pub fn op(&self) -> Result<Op, String> {
        parse_named(
            &[
                Op::AllReduce,
                Op::ReduceScatter,
                Op::AllGather,
                Op::AllToAll,
                Op::Broadcast,
                Op::Send,
                Op::Recv,
                Op::Barrier,
            ],
            op_name,
            &self.op,
        )
        .ok_or_else(|| format!("unknown op `{}`", self.op))
    }

    /// The protocol dtype.
    pub fn dtype(&self) -> Result<DType, String> {
        parse_named(
            &[
                DType::Bytes,
                DType::F32,
                DType::F16,
                DType::Bf16,
                DType::F64,
                DType::I32,
                DType::I64,
                DType::U8,
            ],
            dtype_name,
            &self.dtype,
        )
        .ok_or_else(|| format!("unknown dtype `{}`", self.dtype))
    }

    /// The protocol reduction.
    pub fn reduce(&self) -> Result<ReduceOp, String> {
        parse_named(
            &[
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Product,
            ],
            reduce_name,
            &self.reduce,
        )
        .ok_or_else(|| format!("unknown reduction `{}`", self.reduce))
    }

    /// The protocol call `seq` this stands for (no data).
    pub fn to_call(&self, seq: u64) -> Result<Call, String> {
        Ok(Call {
            seq,
            op: self.op()? as i32,
            group: self.group.clone(),
            bytes: self.bytes,
            dtype: self.dtype()? as i32,
            reduce: self.reduce()? as i32,
            peer: self.peer,
            data: Vec::new(),
            compute_s: self.compute_ps as f64 * 1e-12,
        })
    }
}

impl SlicedGraph {
    /// The graph of `n` back-to-back iterations of this one: every class's calls repeated `n`
    /// times; the compute between two iterations (the tail of one and the compute before the
    /// first call of the next) is one segment, as a rank that keeps running records it.
    pub fn repeated(&self, n: u32) -> SlicedGraph {
        let mut g = self.clone();
        if n <= 1 {
            return g;
        }
        for c in &mut g.classes {
            let one = c.calls.clone();
            for _ in 1..n {
                let start = c.calls.len();
                c.calls.extend(one.iter().cloned());
                if let Some(first) = c.calls.get_mut(start) {
                    first.compute_ps = first.compute_ps.saturating_add(c.tail_ps);
                }
            }
        }
        g
    }

    /// Serialises to pretty JSON (deterministic: fields in declaration order).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a sliced graph serialises")
    }

    /// Parses and checks a sliced-graph file's text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, String> {
        let g: SlicedGraph =
            serde_json::from_str(text).map_err(|e| format!("{origin}: not a sliced graph: {e}"))?;
        if g.format != FORMAT {
            return Err(format!(
                "{origin}: `format` is `{}`, expected `{FORMAT}`",
                g.format
            ));
        }
        if g.version != VERSION {
            return Err(format!(
                "{origin}: `version` {} is not supported (this build reads version {VERSION})",
                g.version
            ));
        }
        g.layout
            .world_size()
            .map_err(|e| format!("{origin}: {e}"))?;
        if g.classes.len() != g.layout.pp as usize {
            return Err(format!(
                "{origin}: {} classes for {} pipeline stages; one per stage is needed",
                g.classes.len(),
                g.layout.pp
            ));
        }
        let size = g.layout.tp * g.layout.dp;
        for (i, c) in g.classes.iter().enumerate() {
            if c.stage != i as u32 || c.rank / size != c.stage {
                return Err(format!(
                    "{origin}: classes[{i}] is stage {} from rank {}; expected stage {i} from a \
                     rank of that stage",
                    c.stage, c.rank
                ));
            }
            for (k, call) in c.calls.iter().enumerate() {
                let pc = call
                    .to_call(k as u64)
                    .map_err(|e| format!("{origin}: classes[{i}].calls[{k}]: {e}"))?;
                pc.validate(c.rank)
                    .map_err(|e| format!("{origin}: classes[{i}]: {e}"))?;
            }
        }
        Ok(g)
    }
}
