//! PyTorch-profiler (Kineto) Chrome traces -> measured GPU kernels, for calibration.
//!
//! A Kineto trace (`torch.profiler` with CUDA activity, exported with
//! `export_chrome_trace`) is a JSON object whose `traceEvents` array holds, among others:
//!
//! * GPU activity: complete events (`"ph":"X"`) of category `kernel`, `gpu_memcpy` and
//!   `gpu_memset`, with `ts`/`dur` in microseconds and `args.stream`, `args.device`,
//!   `args.correlation`;
//! * the CUDA runtime/driver calls that launched them (`cuda_runtime`, `cuda_driver`), carrying
//!   the same `args.correlation`, on the launching CPU thread;
//! * the CPU operators (`cpu_op`) and annotations (`user_annotation`, e.g. `ProfilerStep#3`,
//!   `nccl:all_reduce`) on that thread; with `record_shapes=True` they carry `Input Dims`,
//!   `Input type` and `Concrete Inputs`.
//!
//! [`parse_kineto`] keeps one [`KernelRecord`] per GPU event (kernels, and copies/memsets as
//! [`KernelClass::Memcpy`]). Each kernel is linked to its launch by `correlation`, and the launch
//! to the CPU operators that enclose it in time on the same thread (the innermost first). From
//! that chain of operators it recovers:
//!
//! * GEMM shapes (`"MxNxK"` or `"BxMxNxK"`, the keys of
//!   [`prism_core::cost::compute::shape_key`]) from the innermost `aten::mm`, `addmm`, `bmm`,
//!   `baddbmm`, `matmul`, `linear`, `_scaled_mm` or `_addmm_activation` whose `Input Dims` are
//!   consistent;
//! * fused-attention shapes (`"b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c|n}"`) from the
//!   innermost `aten::_scaled_dot_product_{flash,efficient}_attention[_backward]`;
//! * NCCL message sizes (bytes of the largest tensor passed to the collective) from the innermost
//!   `nccl:*` annotation's `Input Dims` and `Input type`, or `record_param_comms`'
//!   `In msg nelems`/`Out msg nelems`/`dtype` (newer PyTorch);
//! * a refined class for generic kernels (see [`classify`]): an `at::native` elementwise kernel
//!   launched inside `_VocabParallelCrossEntropy` is [`KernelClass::Loss`], inside
//!   `aten::embedding` [`KernelClass::Embedding`], and so on.
//!
//! The classification rules are data ([`NAME_RULES`], [`CONTEXT_RULES`]) and are documented with
//! the measured coverage in `docs/kineto.md`.
//!
//! Errors name the origin (usually the file path), and for a broken rule the JSON path of the
//! offending value (`traceEvents[12].dur`) and the rule. Nothing here panics on bad input.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use prism_core::cost::compute::KernelTable;
use serde_json::Value;
use serde_json::value::RawValue;

/// The class of one GPU kernel, from its name and launch context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KernelClass {
    /// Dense matrix multiply (cuBLAS, CUTLASS, Triton matmul templates), including split-K
    /// reductions.
    Gemm,
    /// Fused (flash / memory-efficient / cuDNN) attention.
    Attention,
    /// Layer norm / RMS norm, forward and backward.
    Norm,
    /// Other memory-bound work: elementwise, reductions, copies, index ops, Inductor/Triton
    /// pointwise fusions.
    Elementwise,
    /// Softmax outside a fused attention kernel (Megatron's fused scale-mask-softmax).
    Softmax,
    /// Embedding lookup / gradient.
    Embedding,
    /// Cross-entropy loss (including its log-softmax).
    Loss,
    /// Optimizer step, gradient unscale/clip (multi-tensor-apply kernels).
    Optimizer,
    /// Memory copies and memsets (`gpu_memcpy` / `gpu_memset` events, `memcpy` kernels).
    Memcpy,
    /// NCCL all-reduce.
    NcclAllReduce,
    /// NCCL all-gather.
    NcclAllGather,
    /// NCCL reduce-scatter.
    NcclReduceScatter,
    /// NCCL send/receive (pipeline point-to-point).
    NcclSendRecv,
    /// NCCL all-to-all (send/receive kernels launched by an all-to-all).
    NcclAllToAll,
    /// Anything else, including NCCL broadcast/reduce.
    Other,
}

impl KernelClass {
    /// Every class, in report order.
    pub const ALL: [KernelClass; 15] = [
        KernelClass::Gemm,
        KernelClass::Attention,
        KernelClass::Norm,
        KernelClass::Elementwise,
        KernelClass::Softmax,
        KernelClass::Embedding,
        KernelClass::Loss,
        KernelClass::Optimizer,
        KernelClass::Memcpy,
        KernelClass::NcclAllReduce,
        KernelClass::NcclAllGather,
        KernelClass::NcclReduceScatter,
        KernelClass::NcclSendRecv,
        KernelClass::NcclAllToAll,
        KernelClass::Other,
    ];

    /// Lower-case name used in reports (the compute classes match `OpClass::name`).
    pub fn name(&self) -> &'static str {
        match self {
            KernelClass::Gemm => "gemm",
            KernelClass::Attention => "attention",
            KernelClass::Norm => "norm",
            KernelClass::Elementwise => "elementwise",
            KernelClass::Softmax => "softmax",
            KernelClass::Embedding => "embedding",
            KernelClass::Loss => "loss",
            KernelClass::Optimizer => "optimizer",
            KernelClass::Memcpy => "memcpy",
            KernelClass::NcclAllReduce => "nccl_all_reduce",
            KernelClass::NcclAllGather => "nccl_all_gather",
            KernelClass::NcclReduceScatter => "nccl_reduce_scatter",
            KernelClass::NcclSendRecv => "nccl_send_recv",
            KernelClass::NcclAllToAll => "nccl_all_to_all",
            KernelClass::Other => "other",
        }
    }

    /// True for the NCCL classes.
    pub fn is_nccl(&self) -> bool {
        matches!(
            self,
            KernelClass::NcclAllReduce
                | KernelClass::NcclAllGather
                | KernelClass::NcclReduceScatter
                | KernelClass::NcclSendRecv
                | KernelClass::NcclAllToAll
        )
    }
}

/// One GPU event of the trace.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelRecord {
    /// Kernel name as the profiler reports it (demangled).
    pub name: String,
    /// Its class.
    pub class: KernelClass,
    /// GPU duration, seconds.
    pub duration_s: f64,
    /// CUDA stream (`args.stream`; the event's `tid` when absent).
    pub stream: u64,
    /// Canonical shape key when recoverable: `"MxNxK"`/`"BxMxNxK"` for GEMMs,
    /// `"b..h..q..k..d..{c|n}"` for fused attention.
    pub shape: Option<String>,
    /// NCCL message size, bytes, when recoverable.
    pub bytes: Option<u64>,
    /// Start, microseconds, on the trace's clock.
    pub ts_us: f64,
    /// Name of the CPU operator that supplied `shape` or `bytes` (e.g. `aten::mm`,
    /// `nccl:all_reduce`).
    pub op: Option<String>,
    /// Index in `traceEvents` of that operator: kernels sharing it were launched by one call.
    pub op_index: Option<usize>,
}

/// The kernels of one Kineto trace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KinetoTrace {
    /// GPU events in file order.
    pub kernels: Vec<KernelRecord>,
    /// GPU name from `deviceProperties` (the entry of the kernels' device, else the first).
    pub device: Option<String>,
    /// Duration of the `ProfilerStep#N` annotation, seconds (the mean when several).
    pub step_s: Option<f64>,
}

/// Why a Kineto trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KinetoError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not JSON.
    #[error("{origin}: not valid JSON: {source}")]
    Json {
        /// The source (file path).
        origin: String,
        /// The parser's error (with line and column).
        #[source]
        source: serde_json::Error,
    },
    /// The JSON broke a rule of the Kineto format.
    #[error("{origin}: {at}: {rule}")]
    Rule {
        /// The source (file path).
        origin: String,
        /// JSON path of the offending value (`$` for the root).
        at: String,
        /// The rule broken.
        rule: String,
    },
}

/// Reads a Kineto trace file, plain JSON or gzip-compressed (`.json.gz`, as PyTorch's
/// `tensorboard_trace_handler` writes them; recognised by the gzip magic bytes, not the name).
pub fn read_kineto(path: &Path) -> Result<KinetoTrace, KinetoError> {
    use std::io::Read as _;
    let name = path.display().to_string();
    let io = |source| KinetoError::Io {
        path: name.clone(),
        source,
    };
    let bytes = std::fs::read(path).map_err(io)?;
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .map_err(io)?;
        text
    } else {
        String::from_utf8(bytes).map_err(|e| {
            io(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not UTF-8 text ({e}) and not gzip"),
            ))
        })?
    };
    parse_kineto(&text, &name)
}

/// One name rule: the kernel's lower-cased name must contain every pattern.
#[derive(Clone, Copy, Debug)]
pub struct NameRule {
    /// Substrings that must all occur in the lower-cased kernel name.
    pub all_of: &'static [&'static str],
    /// The class given.
    pub class: KernelClass,
}

const fn rule(all_of: &'static [&'static str], class: KernelClass) -> NameRule {
    NameRule { all_of, class }
}

use KernelClass as K;

/// Ordered kernel-name rules; the first that matches decides. Matched against the lower-cased
/// name. A kernel matching none is [`KernelClass::Other`].
pub const NAME_RULES: &[NameRule] = &[
    // NCCL: ncclKernel_<Coll>_..., ncclDevKernel_<Coll>_...
    rule(&["nccl", "allreduce"], K::NcclAllReduce),
    rule(&["nccl", "allgather"], K::NcclAllGather),
    rule(&["nccl", "reducescatter"], K::NcclReduceScatter),
    rule(&["nccl", "alltoall"], K::NcclAllToAll),
    rule(&["nccl", "sendrecv"], K::NcclSendRecv),
    rule(&["nccl", "send"], K::NcclSendRecv),
    rule(&["nccl", "recv"], K::NcclSendRecv),
    rule(&["nccl"], K::Other), // broadcast, reduce: not modelled
    // Fused attention: FlashAttention 2/3, PyTorch mem-efficient (fmha_cutlassF/B), cuDNN SDPA.
    rule(&["flash_fwd"], K::Attention),
    rule(&["flash_bwd"], K::Attention),
    rule(&["flash::"], K::Attention),
    rule(&["flash_attn"], K::Attention),
    rule(&["fmha"], K::Attention),
    rule(&["sdpa"], K::Attention),
    rule(&["fused_attn"], K::Attention),
    rule(&["attention_kernel"], K::Attention),
    rule(&["efficient_attention"], K::Attention),
    // Loss (before softmax: log-softmax belongs to cross-entropy).
    rule(&["cross_entropy"], K::Loss),
    rule(&["crossentropy"], K::Loss),
    rule(&["nll_loss"], K::Loss),
    rule(&["logsoftmax"], K::Loss),
    rule(&["log_softmax"], K::Loss),
    // Softmax: Megatron scaled_(upper_triang_)masked_softmax_warp_*, cunn_SoftMax*.
    rule(&["softmax"], K::Softmax),
    // Norms: apex cuApplyLayerNorm / cuComputeGradInput / cuComputePartGradGammaBeta, PyTorch
    // vectorized_layer_norm_kernel / GammaBetaBackward, TE/apex ln_fwd/ln_bwd, RMS norms.
    rule(&["layernorm"], K::Norm),
    rule(&["layer_norm"], K::Norm),
    rule(&["rmsnorm"], K::Norm),
    rule(&["rms_norm"], K::Norm),
    rule(&["cucomputegradinput"], K::Norm),
    rule(&["cucomputepartgradgammabeta"], K::Norm),
    rule(&["cucomputegradgammabeta"], K::Norm),
    rule(&["gammabetabackward"], K::Norm),
    rule(&["ln_fwd"], K::Norm),
    rule(&["ln_bwd"], K::Norm),
    rule(&["batch_norm"], K::Norm),
    rule(&["batchnorm"], K::Norm),
    rule(&["group_norm"], K::Norm),
    // GEMM: cuBLAS (ampere_*gemm*, sm80_xmma_gemm_*, nvjet_*, cublasLt splitKreduce), CUTLASS
    // (cutlass_80_tensorop_*gemm*), sgemm/hgemm, gemv, Inductor matmul templates.
    rule(&["gemm"], K::Gemm),
    rule(&["gemv"], K::Gemm),
    rule(&["cutlass"], K::Gemm),
    rule(&["xmma"], K::Gemm),
    rule(&["cublas"], K::Gemm),
    rule(&["nvjet"], K::Gemm),
    rule(&["s1688"], K::Gemm),
    rule(&["s16816"], K::Gemm),
    rule(&["splitkreduce"], K::Gemm),
    rule(&["triton_tem_"], K::Gemm),
    // Embedding.
    rule(&["embedding"], K::Embedding),
    // Optimizer: apex/torch multi-tensor-apply (Adam, LAMB, L2 norm for clipping, scale), AMP
    // scaler. (No "lamb" pattern: every `{lambda()#1}` would match it.)
    rule(&["adam"], K::Optimizer),
    rule(&["multi_tensor"], K::Optimizer),
    rule(&["non_finite_check_and_unscale"], K::Optimizer),
    rule(&["amp_update_scale"], K::Optimizer),
    // Copies.
    rule(&["memcpy"], K::Memcpy),
    rule(&["memset"], K::Memcpy),
    // Generic memory-bound work.
    rule(&["elementwise"], K::Elementwise),
    rule(&["triton"], K::Elementwise),
    rule(&["at::native"], K::Elementwise),
    rule(&["reduce_kernel"], K::Elementwise),
    rule(&["codegen"], K::Elementwise),
    rule(&["nvfuser"], K::Elementwise),
    rule(&["cub::"], K::Elementwise),
    rule(&["thrust::"], K::Elementwise),
    rule(&["copy"], K::Elementwise),
    rule(&["fill"], K::Elementwise),
    rule(&["index"], K::Elementwise),
    rule(&["gelu"], K::Elementwise),
    rule(&["silu"], K::Elementwise),
    rule(&["swiglu"], K::Elementwise),
    rule(&["dropout"], K::Elementwise),
    rule(&["rotary"], K::Elementwise),
    rule(&["rope"], K::Elementwise),
    rule(&["bias"], K::Elementwise),
    rule(&["transpose"], K::Elementwise),
    rule(&["permute"], K::Elementwise),
];

/// Ordered launch-context rules, applied to kernels that the name rules left
/// [`KernelClass::Elementwise`] or [`KernelClass::Other`] (generic kernels): the enclosing CPU
/// operators are visited innermost first, and the first operator whose lower-cased name contains
/// a pattern gives its class. NCCL send/receive kernels inside an all-to-all operator (pattern
/// `all_to_all`/`alltoall`) become [`KernelClass::NcclAllToAll`].
pub const CONTEXT_RULES: &[(&str, KernelClass)] = &[
    ("crossentropy", K::Loss),
    ("cross_entropy", K::Loss),
    ("nll_loss", K::Loss),
    ("embedding", K::Embedding),
    ("optimizer", K::Optimizer),
    ("adam", K::Optimizer),
    ("layer_norm", K::Norm),
    ("layernorm", K::Norm),
    ("rms_norm", K::Norm),
    ("rmsnorm", K::Norm),
    ("softmax", K::Softmax),
];

/// Class of a kernel from its name alone ([`NAME_RULES`]).
pub fn classify_name(name: &str) -> KernelClass {
    let lower = name.to_ascii_lowercase();
    NAME_RULES
        .iter()
        .find(|r| r.all_of.iter().all(|p| lower.contains(p)))
        .map_or(KernelClass::Other, |r| r.class)
}

/// Class of a kernel from its name and the names of the CPU operators that launched it,
/// innermost first ([`NAME_RULES`], then [`CONTEXT_RULES`]).
pub fn classify<'a>(name: &str, context: impl IntoIterator<Item = &'a str>) -> KernelClass {
    let class = classify_name(name);
    match class {
        KernelClass::Elementwise | KernelClass::Other => {
            for op in context {
                let op = op.to_ascii_lowercase();
                if let Some((_, c)) = CONTEXT_RULES.iter().find(|(p, _)| op.contains(p)) {
                    return *c;
                }
            }
            class
        }
        KernelClass::NcclSendRecv => {
            for op in context {
                let op = op.to_ascii_lowercase();
                if op.contains("all_to_all") || op.contains("alltoall") {
                    return KernelClass::NcclAllToAll;
                }
            }
            class
        }
        _ => class,
    }
}

/// A CPU operator or annotation: an interval on one CPU thread.
struct CpuOp<'a> {
    index: usize,
    name: String,
    /// The operator's `args`, parsed only when a kernel's shape is looked up.
    args: Option<&'a RawValue>,
    start: f64,
    end: f64,
    parent: Option<usize>,
}

/// A GPU event before classification.
struct GpuEvent {
    index: usize,
    name: String,
    ts: f64,
    dur: f64,
    stream: u64,
    correlation: Option<u64>,
    device: Option<u64>,
    memory: bool,
}

fn as_u64(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0 && *f < 1.8e19)
            .map(|f| f as u64)
    })
}

/// The fields of a trace event the reader uses, each kept as raw JSON until it is needed.
#[derive(serde::Deserialize)]
struct RawEvent<'a> {
    #[serde(borrow)]
    ph: Option<&'a RawValue>,
    #[serde(borrow)]
    cat: Option<&'a RawValue>,
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    ts: Option<&'a RawValue>,
    #[serde(borrow)]
    dur: Option<&'a RawValue>,
    #[serde(borrow)]
    pid: Option<&'a RawValue>,
    #[serde(borrow)]
    tid: Option<&'a RawValue>,
    #[serde(borrow)]
    args: Option<&'a RawValue>,
}

/// A raw field parsed (it was validated with the whole file, so only `null` is lost).
fn parse_raw(raw: Option<&RawValue>) -> Option<Value> {
    serde_json::from_str::<Value>(raw?.get())
        .ok()
        .filter(|v| !v.is_null())
}

fn thread_key(pid: Option<&RawValue>, tid: Option<&RawValue>) -> String {
    let show = |v: Option<&RawValue>| v.map_or_else(|| "null".to_owned(), |r| r.get().to_owned());
    format!("{}/{}", show(pid), show(tid))
}

/// Parses Kineto trace JSON; `origin` names the source in errors (usually the file path).
pub fn parse_kineto(text: &str, origin: &str) -> Result<KinetoTrace, KinetoError> {
    let rule_err = |at: String, rule: String| KinetoError::Rule {
        origin: origin.to_owned(),
        at,
        rule,
    };
    // The trace is read event by event: the root and each event are kept as raw slices of
    // `text` (validated once), and an event's fields are parsed only when it is used, so memory
    // stays near the file's size (a parsed `Value` tree is about 20 times larger).
    let json_err = |source| KinetoError::Json {
        origin: origin.to_owned(),
        source,
    };
    let not_a_trace = || {
        rule_err(
            "$".into(),
            "a Kineto trace is an object with a \"traceEvents\" array".into(),
        )
    };
    let root: &RawValue = serde_json::from_str(text).map_err(json_err)?;
    let first = root.get().trim_start().as_bytes().first().copied();
    let (events, prefix, device_props): (Vec<&RawValue>, &str, Option<Value>) = match first {
        Some(b'{') => {
            let map: BTreeMap<String, &RawValue> =
                serde_json::from_str(root.get()).map_err(json_err)?;
            let Some(raw) = map.get("traceEvents") else {
                return Err(not_a_trace());
            };
            let events: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| {
                rule_err(
                    "traceEvents".into(),
                    "must be an array of trace events".into(),
                )
            })?;
            let props = (map.get("deviceProperties"))
                .and_then(|r| serde_json::from_str::<Value>(r.get()).ok());
            (events, "traceEvents", props)
        }
        Some(b'[') => (
            serde_json::from_str(root.get()).map_err(json_err)?,
            "",
            None,
        ),
        _ => return Err(not_a_trace()),
    };
    let path = |i: usize, field: &str| {
        if prefix.is_empty() {
            format!("[{i}].{field}")
        } else {
            format!("{prefix}[{i}].{field}")
        }
    };

    let mut gpu: Vec<GpuEvent> = Vec::new();
    let mut launches: HashMap<u64, (String, f64)> = HashMap::new();
    let mut cpu: Vec<CpuOp> = Vec::new();
    let mut cpu_threads: HashMap<String, Vec<usize>> = HashMap::new();
    let mut steps: Vec<f64> = Vec::new();

    for (i, raw) in events.iter().enumerate() {
        let at = || {
            if prefix.is_empty() {
                format!("[{i}]")
            } else {
                format!("{prefix}[{i}]")
            }
        };
        let ev = match raw.get().trim_start().as_bytes().first() {
            Some(b'{') => serde_json::from_str::<RawEvent>(raw.get()).map_err(|e| {
                rule_err(at(), format!("a trace event must not repeat a key ({e})"))
            })?,
            _ => return Err(rule_err(at(), "a trace event must be an object".into())),
        };
        if parse_raw(ev.ph).as_ref().and_then(Value::as_str) != Some("X") {
            continue;
        }
        let cat = parse_raw(ev.cat)
            .as_ref()
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_ascii_lowercase();
        let kind = match cat.as_str() {
            "kernel" => Kind::Kernel,
            "gpu_memcpy" | "gpu_memset" | "memcpy" | "memset" => Kind::Memory,
            "cuda_runtime" | "cuda_driver" | "runtime" => Kind::Launch,
            "cpu_op" | "user_annotation" | "operator" | "python_function" => Kind::Cpu,
            _ => continue,
        };
        let name = match parse_raw(ev.name) {
            Some(Value::String(s)) => s,
            _ => {
                return Err(rule_err(
                    path(i, "name"),
                    format!("a \"{cat}\" event needs a string name"),
                ));
            }
        };
        let ts = parse_raw(ev.ts).as_ref().and_then(Value::as_f64);
        let Some(ts) = ts.filter(|t| t.is_finite()) else {
            return Err(rule_err(
                path(i, "ts"),
                format!("a \"{cat}\" event needs a finite numeric ts (microseconds)"),
            ));
        };
        let thread = || thread_key(ev.pid, ev.tid);
        if kind == Kind::Launch {
            let args = parse_raw(ev.args);
            if let Some(c) = as_u64(args.as_ref().and_then(|a| a.get("correlation"))) {
                launches.insert(c, (thread(), ts));
            }
            continue;
        }
        let dur = parse_raw(ev.dur).as_ref().and_then(Value::as_f64);
        let Some(dur) = dur.filter(|d| d.is_finite() && *d >= 0.0) else {
            return Err(rule_err(
                path(i, "dur"),
                format!("a \"{cat}\" event needs a non-negative finite numeric dur (microseconds)"),
            ));
        };
        match kind {
            Kind::Kernel | Kind::Memory => {
                let args = parse_raw(ev.args);
                let arg = |key: &str| args.as_ref().and_then(|a| a.get(key));
                let tid = parse_raw(ev.tid);
                gpu.push(GpuEvent {
                    index: i,
                    name,
                    ts,
                    dur,
                    stream: as_u64(arg("stream"))
                        .or_else(|| as_u64(tid.as_ref()))
                        .unwrap_or(0),
                    correlation: as_u64(arg("correlation")),
                    device: as_u64(arg("device")),
                    memory: kind == Kind::Memory,
                })
            }
            Kind::Cpu => {
                if name.starts_with("ProfilerStep#") {
                    steps.push(dur);
                }
                cpu_threads.entry(thread()).or_default().push(cpu.len());
                cpu.push(CpuOp {
                    index: i,
                    name,
                    args: ev.args,
                    start: ts,
                    end: ts + dur,
                    parent: None,
                });
            }
            Kind::Launch => {}
        }
    }
    if !gpu.iter().any(|g| !g.memory) {
        let at = if prefix.is_empty() { "$" } else { prefix };
        return Err(rule_err(
            at.into(),
            "no GPU kernel events (\"cat\": \"kernel\"); profile with \
             ProfilerActivity.CUDA"
                .into(),
        ));
    }

    // Nest each thread's operators: sort by start (outer first on ties) and keep a stack.
    for ops in cpu_threads.values_mut() {
        ops.sort_by(|&a, &b| {
            cpu[a]
                .start
                .total_cmp(&cpu[b].start)
                .then(cpu[b].end.total_cmp(&cpu[a].end))
                .then(a.cmp(&b))
        });
        let mut stack: Vec<usize> = Vec::new();
        for &o in ops.iter() {
            while let Some(&top) = stack.last() {
                if cpu[o].end <= cpu[top].end {
                    break;
                }
                stack.pop();
            }
            cpu[o].parent = stack.last().copied();
            stack.push(o);
        }
    }

    // Operators enclosing time `t` on `thread`, innermost first.
    let enclosing = |thread: &str, t: f64| -> Vec<usize> {
        let mut chain = Vec::new();
        let Some(ops) = cpu_threads.get(thread) else {
            return chain;
        };
        let n = ops.partition_point(|&o| cpu[o].start <= t);
        let mut node = n.checked_sub(1).map(|j| ops[j]);
        while let Some(o) = node {
            if cpu[o].end >= t {
                chain.push(o);
            }
            node = cpu[o].parent;
        }
        chain
    };

    let mut kernels = Vec::with_capacity(gpu.len());
    for g in &gpu {
        let chain = g
            .correlation
            .and_then(|c| launches.get(&c))
            .map(|(thread, t)| enclosing(thread, *t))
            .unwrap_or_default();
        let class = if g.memory {
            KernelClass::Memcpy
        } else {
            classify(&g.name, chain.iter().map(|&o| cpu[o].name.as_str()))
        };
        let mut shape = None;
        let mut bytes = None;
        let mut source = None;
        for &o in &chain {
            let op = &cpu[o];
            let args = parse_raw(op.args);
            let (name, args) = (op.name.as_str(), args.as_ref());
            let found = match class {
                KernelClass::Gemm => gemm_shape(name, args).map(|s| shape = Some(s)),
                KernelClass::Attention => attention_shape(name, args).map(|s| shape = Some(s)),
                c if c.is_nccl() => comm_bytes(name, args).map(|b| bytes = Some(b)),
                _ => None,
            };
            if found.is_some() {
                source = Some(o);
                break;
            }
        }
        kernels.push(KernelRecord {
            name: g.name.clone(),
            class,
            duration_s: g.dur / 1e6,
            stream: g.stream,
            shape,
            bytes,
            ts_us: g.ts,
            op: source.map(|o| cpu[o].name.clone()),
            op_index: source.map(|o| cpu[o].index),
        });
    }
    // Keep file order (GPU events were collected in it already).
    debug_assert!(gpu.windows(2).all(|w| w[0].index < w[1].index));

    let device = device_name(
        device_props.as_ref(),
        gpu.iter().find(|g| !g.memory).and_then(|g| g.device),
    );
    let step_s = (!steps.is_empty()).then(|| steps.iter().sum::<f64>() / steps.len() as f64 / 1e6);
    Ok(KinetoTrace {
        kernels,
        device,
        step_s,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Kernel,
    Memory,
    Launch,
    Cpu,
}

fn device_name(props: Option<&Value>, device: Option<u64>) -> Option<String> {
    let props = props?.as_array()?;
    let by_id = device.and_then(|d| {
        props
            .iter()
            .find(|p| as_u64(p.get("id")) == Some(d))
            .and_then(|p| p.get("name")?.as_str())
    });
    by_id
        .or_else(|| props.iter().find_map(|p| p.get("name")?.as_str()))
        .map(str::to_owned)
}

/// `Input Dims` of an operator: per input, the tensor's dimensions (`None` for tensor lists and
/// anything that is not a flat list of non-negative integers).
fn input_dims(args: Option<&Value>) -> Vec<Option<Vec<u64>>> {
    let Some(Value::Array(inputs)) = args.and_then(|a| a.get("Input Dims")) else {
        return Vec::new();
    };
    inputs
        .iter()
        .map(|d| {
            d.as_array()?
                .iter()
                .map(|x| x.as_u64())
                .collect::<Option<Vec<u64>>>()
        })
        .collect()
}

fn string_list(args: Option<&Value>, key: &str) -> Vec<Option<String>> {
    let Some(Value::Array(items)) = args.and_then(|a| a.get(key)) else {
        return Vec::new();
    };
    items
        .iter()
        .map(|v| v.as_str().map(str::to_owned))
        .collect()
}

fn gemm_key(batch: u64, m: u64, n: u64, k: u64) -> Option<String> {
    if batch == 0 || m == 0 || n == 0 || k == 0 {
        return None;
    }
    Some(if batch > 1 {
        format!("{batch}x{m}x{n}x{k}")
    } else {
        format!("{m}x{n}x{k}")
    })
}

/// `[M, K] x [K, N]`.
fn mk2(a: &[u64], b: &[u64]) -> Option<String> {
    match (a, b) {
        ([m, k], [k2, n]) if k == k2 => gemm_key(1, *m, *n, *k),
        _ => None,
    }
}

/// `[B, M, K] x [B, K, N]`.
fn mk3(a: &[u64], b: &[u64]) -> Option<String> {
    match (a, b) {
        ([bt, m, k], [bt2, k2, n]) if k == k2 && bt == bt2 => gemm_key(*bt, *m, *n, *k),
        _ => None,
    }
}

/// GEMM shape key from a launching operator's `Input Dims`, when the operator is a GEMM and the
/// dimensions are consistent.
fn gemm_shape(op: &str, args: Option<&Value>) -> Option<String> {
    let dims = input_dims(args);
    let d = |i: usize| dims.get(i).and_then(|x| x.as_deref());
    match op {
        "aten::mm" | "aten::_scaled_mm" => mk2(d(0)?, d(1)?),
        "aten::addmm" | "aten::addmm_" | "aten::_addmm_activation" => mk2(d(1)?, d(2)?),
        "aten::bmm" => mk3(d(0)?, d(1)?),
        "aten::baddbmm" | "aten::baddbmm_" => mk3(d(1)?, d(2)?),
        "aten::matmul" => {
            let (a, b) = (d(0)?, d(1)?);
            match (a.len(), b.len()) {
                (3, 3) => mk3(a, b),
                (la, 2) if la >= 2 => {
                    let k = a[la - 1];
                    let m = a[..la - 1]
                        .iter()
                        .try_fold(1u64, |p, x| p.checked_mul(*x))?;
                    mk2(&[m, k], b)
                }
                _ => None,
            }
        }
        "aten::linear" => {
            let (a, w) = (d(0)?, d(1)?);
            let &[n, k] = w else { return None };
            let (&k2, lead) = a.split_last()?;
            if lead.is_empty() || k != k2 {
                return None;
            }
            let m = lead.iter().try_fold(1u64, |p, x| p.checked_mul(*x))?;
            gemm_key(1, m, n, k)
        }
        _ => None,
    }
}

/// Fused-attention shape key from an SDPA operator (`query`/`key` laid out `[B, H, S, D]`).
fn attention_shape(op: &str, args: Option<&Value>) -> Option<String> {
    // (operator, index of query, index of key, index of is_causal)
    const SDPA: &[(&str, usize, usize, usize)] = &[
        ("aten::_scaled_dot_product_flash_attention", 0, 1, 4),
        ("aten::_scaled_dot_product_efficient_attention", 0, 1, 6),
        (
            "aten::_scaled_dot_product_flash_attention_backward",
            1,
            2,
            11,
        ),
        (
            "aten::_scaled_dot_product_efficient_attention_backward",
            1,
            2,
            11,
        ),
    ];
    let &(_, qi, ki, ci) = SDPA.iter().find(|(name, ..)| *name == op)?;
    let dims = input_dims(args);
    let q = dims.get(qi)?.as_deref()?;
    let k = dims.get(ki)?.as_deref()?;
    let ([b, h, sq, d], [b2, _, skv, d2]) = (q, k) else {
        return None;
    };
    if b != b2 || d != d2 || [*b, *h, *sq, *skv, *d].contains(&0) {
        return None;
    }
    let causal = match string_list(args, "Concrete Inputs").get(ci)?.as_deref()? {
        "True" | "true" | "1" => 'c',
        "False" | "false" | "0" => 'n',
        _ => return None,
    };
    Some(format!("b{b}h{h}q{sq}k{skv}d{d}{causal}"))
}

/// Bytes of one element of a profiler dtype name (`c10::Half`, `float`, `BFloat16`, ...).
fn dtype_bytes(t: &str) -> Option<u64> {
    let t = t.trim().to_ascii_lowercase();
    let t = t.strip_prefix("c10::").unwrap_or(&t);
    if t.starts_with("float8") {
        return Some(1);
    }
    Some(match t {
        "half" | "float16" | "bfloat16" | "short" | "short int" | "int16" => 2,
        "float" | "float32" | "int" | "int32" | "unsigned int" => 4,
        "double" | "float64" | "long" | "long int" | "long long" | "int64" => 8,
        "bool" | "byte" | "char" | "signed char" | "unsigned char" | "int8" | "uint8" => 1,
        _ => return None,
    })
}

/// NCCL message size from a `nccl:*` annotation (largest input tensor) or a
/// `record_param_comms` with message-size arguments.
fn comm_bytes(op: &str, args: Option<&Value>) -> Option<u64> {
    if op.to_ascii_lowercase().starts_with("nccl:") {
        let dims = input_dims(args);
        let types = string_list(args, "Input type");
        let best = dims
            .iter()
            .zip(&types)
            .filter_map(|(d, t)| {
                let elems = d
                    .as_ref()?
                    .iter()
                    .try_fold(1u64, |p, x| p.checked_mul(*x))?;
                elems.checked_mul(dtype_bytes(t.as_deref()?)?)
            })
            .max();
        if best.is_some() {
            return best;
        }
    }
    let a = args?;
    let size = dtype_bytes(a.get("dtype")?.as_str()?)?;
    let elems = as_u64(a.get("In msg nelems"))
        .into_iter()
        .chain(as_u64(a.get("Out msg nelems")))
        .max()?;
    elems.checked_mul(size).filter(|b| *b > 0)
}

/// Per class: `(kernel count, total GPU seconds)`, keyed by [`KernelClass::name`]; only classes
/// present in the trace.
pub fn class_totals(trace: &KinetoTrace) -> BTreeMap<&'static str, (usize, f64)> {
    let mut out: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
    for k in &trace.kernels {
        let e = out.entry(k.class.name()).or_default();
        e.0 += 1;
        e.1 += k.duration_s;
    }
    out
}

/// Fraction of `class`'s GPU time whose records carry a recovered `shape` (compute classes) or
/// `bytes` (NCCL classes); `None` when the class has no time in the trace.
pub fn coverage(trace: &KinetoTrace, class: KernelClass) -> Option<f64> {
    let (mut with, mut all) = (0.0, 0.0);
    for k in trace.kernels.iter().filter(|k| k.class == class) {
        all += k.duration_s;
        let known = if class.is_nccl() {
            k.bytes.is_some()
        } else {
            k.shape.is_some()
        };
        if known {
            with += k.duration_s;
        }
    }
    (all > 0.0).then(|| with / all)
}

/// A plain-text table of [`class_totals`]: class, kernel count, total milliseconds and share of
/// all GPU time, in [`KernelClass::ALL`] order, with a total row.
pub fn summary_table(trace: &KinetoTrace) -> String {
    let totals = class_totals(trace);
    let all: f64 = totals.values().map(|t| t.1).sum();
    let count: usize = totals.values().map(|t| t.0).sum();
    let mut out = format!(
        "{:<20} {:>7} {:>11} {:>7}\n",
        "class", "kernels", "total ms", "share"
    );
    for c in KernelClass::ALL {
        if let Some(&(n, s)) = totals.get(c.name()) {
            let share = if all > 0.0 { 100.0 * s / all } else { 0.0 };
            let _ = writeln!(
                out,
                "{:<20} {:>7} {:>11.3} {:>6.2}%",
                c.name(),
                n,
                s * 1e3,
                share
            );
        }
    }
    let _ = writeln!(
        out,
        "{:<20} {:>7} {:>11.3} {:>6.2}%",
        "total",
        count,
        all * 1e3,
        100.0
    );
    out
}

/// Median (the mean of the middle two for an even count); `None` when empty. Sorts `values`.
pub(crate) fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    })
}

/// Launching call (`(0, op_index)`, or `(1, kernel index)` without one) -> summed seconds.
type Calls = BTreeMap<(usize, usize), f64>;

/// Measured kernel table of the trace's GEMMs and fused attention with recovered shapes.
///
/// Kernels launched by the same CPU operator call (`op_index`, e.g. a GEMM and its split-K
/// reduction, or the three kernels of a flash-attention backward) are summed into one sample;
/// each `(op, shape)` gets the median of its samples (the mean of the two middle ones for an
/// even count), which ignores the odd slow launch (first call, clock ramp, contention with a
/// concurrent NCCL kernel). Op names: `"gemm"` for every GEMM shape; `"attention_fwd"` /
/// `"attention_bwd"` (the graph's op names; forward and backward share shape keys) for
/// attention. Other classes have no per-shape key and stay in [`class_totals`].
///
/// `dtype` is written as given; kernel-table files accept `"bf16"` and `"fp8"` only (an fp16
/// trace runs at the bf16 tensor-core rate, so pass `"bf16"` for it).
pub fn to_kernel_table(trace: &KinetoTrace, dtype: &str) -> KernelTable {
    // (op, shape) -> launching call -> summed seconds
    let mut samples: BTreeMap<(&str, &str), Calls> = BTreeMap::new();
    for (i, k) in trace.kernels.iter().enumerate() {
        let Some(shape) = k.shape.as_deref() else {
            continue;
        };
        let op = match k.class {
            KernelClass::Gemm => "gemm",
            KernelClass::Attention => {
                let backward = k.op.as_deref().is_some_and(|o| o.contains("backward"));
                if backward {
                    "attention_bwd"
                } else {
                    "attention_fwd"
                }
            }
            _ => continue,
        };
        // A kernel without a launching call is its own sample.
        let call = k.op_index.map_or((1, i), |o| (0, o));
        *samples
            .entry((op, shape))
            .or_default()
            .entry(call)
            .or_default() += k.duration_s;
    }
    let mut table = KernelTable::new();
    for ((op, shape), calls) in samples {
        let mut v: Vec<f64> = calls.into_values().collect();
        if let Some(m) = median(&mut v).filter(|m| *m > 0.0) {
            table.insert(op, shape, dtype, m);
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn name_rules() {
        let cases = [
            (
                "ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                K::NcclAllReduce,
            ),
            ("ncclKernel_AllGather_RING_LL_Sum_int8_t", K::NcclAllGather),
            (
                "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                K::NcclReduceScatter,
            ),
            ("ncclDevKernel_SendRecv(ncclDevComm*)", K::NcclSendRecv),
            ("ncclDevKernel_Broadcast_RING_LL", K::Other),
            (
                "void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_128x128_32x5_tn_align8>",
                K::Gemm,
            ),
            (
                "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn",
                K::Gemm,
            ),
            (
                "sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize192x128x32_stage4",
                K::Gemm,
            ),
            ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", K::Gemm),
            ("void cublasLt::splitKreduce_kernel<32, 16, int>", K::Gemm),
            (
                "void (anonymous namespace)::scaled_upper_triang_masked_softmax_warp_forward<c10::Half>",
                K::Softmax,
            ),
            (
                "void cuApplyLayerNorm<c10::Half, float, c10::Half>(c10::Half*)",
                K::Norm,
            ),
            (
                "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>",
                K::Norm,
            ),
            (
                "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>",
                K::Attention,
            ),
            ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", K::Attention),
            (
                "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>",
                K::Loss,
            ),
            (
                "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>",
                K::Elementwise,
            ),
            ("triton__0d1d2d3d4de", K::Elementwise),
            (
                "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::Half, long>",
                K::Elementwise,
            ),
            (
                "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>",
                K::Optimizer,
            ),
            (
                "void at::native::embedding_backward_feature_kernel<float>",
                K::Embedding,
            ),
            ("Memcpy DtoD (Device -> Device)", K::Memcpy),
            ("my_mystery_kernel", K::Other),
        ];
        for (name, class) in cases {
            assert_eq!(classify_name(name), class, "{name}");
        }
    }

    #[test]
    fn context_rules() {
        let add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>";
        assert_eq!(
            classify(
                add,
                ["aten::sub", "_VocabParallelCrossEntropy", "ProfilerStep#3"]
            ),
            K::Loss
        );
        assert_eq!(
            classify(add, ["aten::index_select", "aten::embedding"]),
            K::Embedding
        );
        assert_eq!(classify(add, ["Optimizer.step#Adam.step"]), K::Optimizer);
        assert_eq!(
            classify(add, ["aten::add", "ProfilerStep#3"]),
            K::Elementwise
        );
        // Named kernels are not re-classified by their context.
        assert_eq!(
            classify(
                "ampere_fp16_s16816gemm_fp16",
                ["_VocabParallelCrossEntropy"]
            ),
            K::Gemm
        );
        assert_eq!(
            classify(
                "ncclDevKernel_SendRecv",
                ["nccl:all_to_all", "c10d::alltoall_"]
            ),
            K::NcclAllToAll
        );
    }

    fn args(dims: Value, concrete: Value) -> Value {
        json!({ "Input Dims": dims, "Concrete Inputs": concrete })
    }

    #[test]
    fn gemm_shapes() {
        let s = |op: &str, dims: Value| gemm_shape(op, Some(&args(dims, json!([]))));
        assert_eq!(
            s("aten::mm", json!([[8192, 4096], [4096, 1536]])).as_deref(),
            Some("8192x1536x4096")
        );
        assert_eq!(
            s(
                "aten::addmm",
                json!([[1536], [8192, 4096], [4096, 1536], [], []])
            )
            .as_deref(),
            Some("8192x1536x4096")
        );
        assert_eq!(
            s(
                "aten::baddbmm",
                json!([[32, 2048, 2048], [32, 2048, 64], [32, 64, 2048], [], []])
            )
            .as_deref(),
            Some("32x2048x2048x64")
        );
        assert_eq!(
            s("aten::bmm", json!([[1, 8, 4], [1, 4, 2]])).as_deref(),
            Some("8x2x4")
        );
        assert_eq!(
            s("aten::matmul", json!([[2048, 4, 4096], [4096, 1536]])).as_deref(),
            Some("8192x1536x4096")
        );
        assert_eq!(
            s(
                "aten::linear",
                json!([[2048, 4, 4096], [1536, 4096], [1536]])
            )
            .as_deref(),
            Some("8192x1536x4096")
        );
        // Inconsistent reduction dims, wrong ranks, tensor lists, zeros, non-GEMM ops: no shape.
        assert_eq!(s("aten::mm", json!([[8, 4], [5, 2]])), None);
        assert_eq!(s("aten::mm", json!([[8, 4, 1], [4, 2]])), None);
        assert_eq!(s("aten::mm", json!([[[8, 4]], [4, 2]])), None);
        assert_eq!(s("aten::mm", json!([[0, 4], [4, 2]])), None);
        assert_eq!(s("aten::add", json!([[8, 4], [4, 2]])), None);
        assert_eq!(gemm_shape("aten::mm", None), None);
    }

    #[test]
    fn attention_shapes() {
        let a = args(
            json!([
                [4, 16, 2048, 128],
                [4, 4, 2048, 128],
                [4, 4, 2048, 128],
                [],
                [],
                [],
                []
            ]),
            json!(["", "", "", "0.", "True", "False", ""]),
        );
        assert_eq!(
            attention_shape("aten::_scaled_dot_product_flash_attention", Some(&a)).as_deref(),
            Some("b4h16q2048k2048d128c")
        );
        let mut dims = vec![json!([4, 16, 2048, 128]); 6];
        dims.extend(std::iter::repeat_n(json!([]), 7));
        let mut concrete = vec![json!(""); 13];
        concrete[11] = json!("False");
        let b = args(Value::Array(dims), Value::Array(concrete));
        assert_eq!(
            attention_shape(
                "aten::_scaled_dot_product_efficient_attention_backward",
                Some(&b)
            )
            .as_deref(),
            Some("b4h16q2048k2048d128n")
        );
        assert_eq!(attention_shape("aten::mm", Some(&a)), None);
    }

    #[test]
    fn comm_sizes() {
        let a = json!({"Input Dims": [[2048, 4, 4096]], "Input type": ["c10::Half"]});
        assert_eq!(comm_bytes("nccl:all_reduce", Some(&a)), Some(67_108_864));
        let b = json!({"In msg nelems": 1024, "Out msg nelems": 8192, "dtype": "BFloat16"});
        assert_eq!(comm_bytes("record_param_comms", Some(&b)), Some(16384));
        assert_eq!(comm_bytes("c10d::allreduce_", Some(&a)), None);
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&mut []), None);
    }
}
