//! Job files (TOML) -> validated [`Job`].
//!
//! The format is documented key by key in `docs/job-format.md`. Loading runs in stages:
//!
//! 1. parse the TOML into a spanned tree (`toml::de::DeTable`), syntax errors carry line:column;
//! 2. check the structure against the schema below: unknown sections and keys are rejected with a
//!    "did you mean" suggestion, Megatron-LM argument names are mapped to Prism's names;
//! 3. apply `--set section.key=value` overrides;
//! 4. resolve `model.preset` / `model.hf_config` / `cluster.preset` and lay the job's inline keys
//!    over them;
//! 5. convert to typed values (range-checked, never wrapping), derive defaults (`dp`, `schedule`,
//!    `sequence_parallel`), bound every size before anything is sized by it, build the [`Job`]
//!    and call [`Job::validate`].
//!
//! Every error is a [`JobFileError`] naming the origin file, the dotted key and the rule broken,
//! with line:column where the value came from the file.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use prism_core::job::{
    Activation, Cluster, Gpu, Job, JobError, MAX_GPUS, MAX_LAYERS, Model, Moe, Parallel, Precision,
    RankOrder, Recompute, Schedule, Stack, Topology, Training,
};
use prism_core::job::{
    ActivationCache, CpCommType, MemorySaving, MoeDispatcher, OptimizerStateDtype, PipelineP2p,
    Zero3Sync,
};
use prism_core::pipeline_layout::PipelineLayout;
use prism_predict::variability::{
    CommRegime, Dist, FailSlow, Failures, GpuSpeed, KernelJitter, Variability,
};
use prism_resilience::scenario::ResilienceSettings;
use toml::de::{DeTable, DeValue};

use crate::files::read_limited;
use crate::hf;
use crate::presets;

/// The embedded default job: Llama 3 405B on 16,384 H100 GPUs.
pub const DEFAULT_JOB_TOML: &str = include_str!("../presets/jobs/llama3-405b-16k-h100.toml");

/// The `source` / origin of the embedded default job.
pub const DEFAULT_JOB_ORIGIN: &str = "<embedded default>";

/// Sanity bounds on model sizes (far above any published model). They keep every parameter and
/// FLOP count downstream inside `u64`.
const MAX_HIDDEN: u32 = 1 << 17;
const MAX_FFN: u32 = 1 << 20;
const MAX_HEADS: u32 = 1 << 14;
const MAX_HEAD_DIM: u32 = 1 << 14;
const MAX_VOCAB: u32 = 1 << 24;
const MAX_SEQ_LEN: u32 = 1 << 24;
const MAX_EXPERTS: u32 = 1 << 12;

/// A loaded, validated job.
#[derive(Clone, Debug)]
pub struct LoadedJob {
    /// The validated job.
    pub job: Job,
    /// `cost.kernel_table`, resolved against the job file's directory.
    pub kernel_table: Option<PathBuf>,
    /// The `[published]` section: what a real run of this job measured, printed beside the
    /// prediction.
    pub published: Option<Published>,
    /// The job file path, or `<embedded default>`.
    pub source: String,
    /// The `[variability]` section; `Default` (deterministic) when absent.
    pub variability: Variability,
    /// `variability.seed`: the default seed of stochastic runs, when given.
    pub variability_seed: Option<u64>,
    /// `variability.distributions.table`, resolved against the job file's directory: a table of
    /// fitted distributions written by `prism fit`.
    pub dist_table: Option<PathBuf>,
    /// The `[resilience]` section; defaults when absent.
    pub resilience: ResilienceSettings,
}

/// A job file that could not be loaded: where, which key, which rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobFileError {
    /// The job file (or `<embedded default>`, or the origin given to [`load_job_str`]).
    pub origin: String,
    /// Dotted key, e.g. `parallel.tp`; `None` for file-level errors (unreadable file, bad syntax).
    pub key: Option<String>,
    /// The rule broken, with the values involved.
    pub rule: String,
    /// 1-based line and column in the job file, where the value came from the file.
    pub location: Option<(usize, usize)>,
    /// Where the value came from when not from the file itself: a `--set` override, a preset, an
    /// HF config, a default or a derived value.
    pub via: Option<String>,
}

impl fmt::Display for JobFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some((line, col)) = self.location {
            write!(f, ":{line}:{col}")?;
        }
        f.write_str(": ")?;
        if let Some(key) = &self.key {
            write!(f, "{key}: ")?;
        }
        f.write_str(&self.rule)?;
        if let Some(via) = &self.via {
            write!(f, " ({via})")?;
        }
        Ok(())
    }
}

impl std::error::Error for JobFileError {}

/// Loads, overrides and validates the job file at `path`. Relative paths inside it
/// (`model.hf_config`, `cost.kernel_table`, `variability.distributions.table`) are resolved
/// against its directory.
pub fn load_job_file(path: &Path, sets: &[String]) -> Result<LoadedJob, JobFileError> {
    let origin = path.display().to_string();
    let text = read_limited(path).map_err(|rule| JobFileError {
        origin: origin.clone(),
        key: None,
        rule: format!("cannot read job file: {rule}"),
        location: None,
        via: None,
    })?;
    let base = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    load_job_str(&text, &origin, Some(&base), sets)
}

/// Loads, overrides and validates a job given as text. `origin` names it in errors and becomes
/// [`LoadedJob::source`]; relative paths inside it are resolved against `base_dir` (or the current
/// directory when `None`).
pub fn load_job_str(
    text: &str,
    origin: &str,
    base_dir: Option<&Path>,
    sets: &[String],
) -> Result<LoadedJob, JobFileError> {
    let ctx = Ctx { origin, text };
    let mut doc = parse_doc(&ctx)?;
    for set in sets {
        apply_override(&ctx, &mut doc, set)?;
    }
    build(&ctx, &doc, base_dir)
}

/// The embedded default job ([`DEFAULT_JOB_TOML`]) with `sets` applied.
pub fn default_job(sets: &[String]) -> Result<LoadedJob, JobFileError> {
    load_job_str(DEFAULT_JOB_TOML, DEFAULT_JOB_ORIGIN, None, sets)
}

// ---------------------------------------------------------------------------------------------
// Schema
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ty {
    Str,
    U32,
    U64,
    F64,
    Bool,
    /// A distribution: an inline table `{ dist = "...", <parameters> }` or a number (constant).
    Dist,
    /// A sub-table (`[variability.failures]`), checked against its own field list.
    Table,
    /// An array (`[wan]`'s per-datacenter and per-link lists), checked where it is read.
    List,
}

impl Ty {
    fn expected(self) -> &'static str {
        match self {
            Ty::Str => "a string",
            Ty::U32 | Ty::U64 => "a non-negative integer",
            Ty::F64 => "a number",
            Ty::Bool => "a boolean (true or false)",
            Ty::Dist => {
                "a distribution (a table such as { dist = \"normal\", mean = 1.0, std = 0.03 }, \
                 or a number for a constant)"
            }
            Ty::Table => "a table",
            Ty::List => "an array",
        }
    }
}

#[derive(Debug)]
struct Field {
    name: &'static str,
    ty: Ty,
    /// Megatron-LM argument names accepted for the same setting.
    aliases: &'static [&'static str],
}

const fn fld(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        aliases: &[],
    }
}

const fn alias(name: &'static str, ty: Ty, aliases: &'static [&'static str]) -> Field {
    Field { name, ty, aliases }
}

const TOP_FIELDS: &[Field] = &[fld("name", Ty::Str)];

const MODEL_FIELDS: &[Field] = &[
    fld("preset", Ty::Str),
    fld("hf_config", Ty::Str),
    fld("name", Ty::Str),
    alias("layers", Ty::U32, &["num_layers"]),
    alias("hidden", Ty::U32, &["hidden_size"]),
    alias("ffn_hidden", Ty::U32, &["ffn_hidden_size"]),
    alias("heads", Ty::U32, &["num_attention_heads"]),
    alias("kv_heads", Ty::U32, &["num_query_groups"]),
    alias("head_dim", Ty::U32, &["kv_channels"]),
    fld("vocab", Ty::U32),
    alias("seq_len", Ty::U32, &["seq_length"]),
    fld("activation", Ty::Str),
    alias("moe_experts", Ty::U32, &["num_experts"]),
    alias("moe_top_k", Ty::U32, &["moe_router_topk"]),
    alias("moe_ffn_hidden", Ty::U32, &["moe_ffn_hidden_size"]),
    fld("tied_embeddings", Ty::Bool),
    fld("dropout", Ty::Bool),
    // Architecture features (prism_core::arch; docs/job-format.md "Model families").
    alias("mla_q_lora_rank", Ty::U32, &["q_lora_rank"]),
    alias("mla_kv_lora_rank", Ty::U32, &["kv_lora_rank"]),
    alias("mla_qk_nope_head_dim", Ty::U32, &["qk_head_dim"]),
    alias("mla_qk_rope_head_dim", Ty::U32, &["qk_pos_emb_head_dim"]),
    alias("mla_v_head_dim", Ty::U32, &["v_head_dim"]),
    fld("moe_first_dense_layers", Ty::U32),
    fld("moe_layer_step", Ty::U32),
    alias(
        "moe_shared_ffn_hidden",
        Ty::U32,
        &["moe_shared_expert_intermediate_size"],
    ),
    fld("moe_capacity_factor", Ty::F64),
    fld("moe_imbalance", Ty::F64),
    fld("moe_groups", Ty::U32),
    fld("moe_groups_per_token", Ty::U32),
    fld("attention_window", Ty::U32),
    fld("attention_window_kind", Ty::Str),
    fld("attention_global_every", Ty::U32),
    alias("mtp_depth", Ty::U32, &["mtp_num_layers"]),
    fld("qk_norm", Ty::Bool),
    fld("expert_bias", Ty::Bool),
];

const CLUSTER_FIELDS: &[Field] = &[
    fld("preset", Ty::Str),
    fld("gpu", Ty::Str),
    fld("gpus_per_node", Ty::U32),
    fld("nodes", Ty::U32),
    fld("peak_tflops_bf16", Ty::F64),
    fld("peak_tflops_fp8", Ty::F64),
    fld("hbm_gib", Ty::F64),
    fld("hbm_tbps", Ty::F64),
    fld("nvlink_gbps", Ty::F64),
    fld("nic_gbps", Ty::F64),
    fld("nic_latency_us", Ty::F64),
    fld("nvlink_latency_us", Ty::F64),
    fld("gpu_speed_cv", Ty::F64),
    fld("topology", Ty::Str),
    fld("rail_group_nodes", Ty::U32),
    fld("oversubscription", Ty::F64),
    fld("pod_nodes", Ty::U32),
    fld("pod_oversubscription", Ty::F64),
    fld("ecmp_flows", Ty::U32),
];

const PARALLEL_FIELDS: &[Field] = &[
    alias("tp", Ty::U32, &["tensor_model_parallel_size"]),
    alias("pp", Ty::U32, &["pipeline_model_parallel_size"]),
    alias("cp", Ty::U32, &["context_parallel_size"]),
    alias("ep", Ty::U32, &["expert_model_parallel_size"]),
    fld("dp", Ty::U32),
    alias(
        "vpp",
        Ty::U32,
        &[
            "virtual_pipeline_model_parallel_size",
            "num_virtual_stages_per_pipeline_rank",
        ],
    ),
    fld("num_layers_per_virtual_pipeline_stage", Ty::U32),
    alias("micro_batch", Ty::U32, &["micro_batch_size"]),
    fld("sequence_parallel", Ty::Bool),
    alias("recompute", Ty::Str, &["recompute_granularity"]),
    alias(
        "distributed_optimizer",
        Ty::Bool,
        &["use_distributed_optimizer"],
    ),
    fld("schedule", Ty::Str),
    alias(
        "first_stage_layers",
        Ty::U32,
        &["decoder_first_pipeline_num_layers"],
    ),
    alias(
        "last_stage_layers",
        Ty::U32,
        &["decoder_last_pipeline_num_layers"],
    ),
    alias(
        "pipeline_layout",
        Ty::Str,
        &["pipeline_model_parallel_layout"],
    ),
    alias(
        "layers_per_stage",
        Ty::U32,
        &["pipeline_parallel_layers_per_stage"],
    ),
    alias(
        "first_stage_less_layers",
        Ty::U32,
        &["pipeline_parallel_first_stage_less_layers"],
    ),
    alias(
        "last_stage_less_layers",
        Ty::U32,
        &["pipeline_parallel_last_stage_less_layers"],
    ),
    fld("account_for_embedding_in_pipeline_split", Ty::Bool),
    fld("account_for_loss_in_pipeline_split", Ty::Bool),
    fld("deallocate_stage_input", Ty::Bool),
    fld("dp_bucket_mparams", Ty::F64),
    fld("dp_buckets_every_stage", Ty::Bool),
    alias("align_grad_reduce", Ty::Bool, &["delay_grad_reduce"]),
    fld("overlap_grad_reduce", Ty::Bool),
    fld("overlap_param_gather", Ty::Bool),
    fld("tp_comm_overlap", Ty::Bool),
    fld("comm_sms", Ty::U32),
    fld("order", Ty::Str),
    fld("use_tp_pp_dp_mapping", Ty::Bool),
    fld("overlap_moe_expert_parallel_comm", Ty::Bool),
    fld("zero_stage", Ty::U32),
    fld("grad_reduce_in_bf16", Ty::Bool),
    fld("gradient_accumulation_fusion", Ty::Bool),
    fld("pp_scatter_gather", Ty::Bool),
    alias("overlap_p2p_comm", Ty::Bool, &["overlap_p2p_communication"]),
    fld("batch_p2p_comm", Ty::Bool),
    alias(
        "overlap_p2p_comm_warmup_flush",
        Ty::Bool,
        &["overlap_p2p_communication_warmup_flush"],
    ),
    fld("reshard_after_forward", Ty::Bool),
    fld("zero3_grad_sync", Ty::Str),
    fld("pipeline_rounds", Ty::U32),
    fld("moe_dispatcher", Ty::Str),
    fld("cp_comm_type", Ty::Str),
    alias(
        "fp8_param_gather",
        Ty::Bool,
        &["enable_fsdp_float8_all_gather"],
    ),
];

const TRAINING_FIELDS: &[Field] = &[
    alias("global_batch", Ty::U32, &["global_batch_size"]),
    fld("precision", Ty::Str),
    fld("flash_attention", Ty::Bool),
    fld("stack", Ty::Str),
    fld("recompute_norm_upproj", Ty::Bool),
    fld("activation_cache", Ty::Str),
    fld("fp8_recipe", Ty::Str),
    fld("attention_backend", Ty::Str),
    alias(
        "cross_entropy_fusion",
        Ty::Str,
        &["cross_entropy_fusion_impl"],
    ),
    fld("fp8_weight_cache", Ty::Bool),
    fld("optimizer_state_dtype", Ty::Str),
    fld("master_weights", Ty::Bool),
    fld("master_weight_remainders", Ty::Bool),
];

const COST_FIELDS: &[Field] = &[fld("kernel_table", Ty::Str)];

const PUBLISHED_FIELDS: &[Field] = &[
    fld("source", Ty::Str),
    fld("tflops_per_gpu", Ty::F64),
    fld("mfu", Ty::F64),
    fld("iteration_time_s", Ty::F64),
    fld("attention_flops", Ty::Str),
];

const VARIABILITY_FIELDS: &[Field] = &[
    fld("seed", Ty::U64),
    fld("gpu_speed", Ty::Dist),
    fld("gpu_outlier_fraction", Ty::F64),
    fld("gpu_outlier_slowdown", Ty::F64),
    fld("comm_regime", Ty::Dist),
    fld("kernel_jitter", Ty::Table),
    fld("fail_slow", Ty::Table),
    fld("failures", Ty::Table),
    fld("distributions", Ty::Table),
];

/// Op classes of `[variability.kernel_jitter]` (`prism_core::ops::OpClass` names) and `all`.
const KERNEL_JITTER_FIELDS: &[Field] = &[
    fld("all", Ty::Dist),
    fld("gemm", Ty::Dist),
    fld("attention", Ty::Dist),
    fld("norm", Ty::Dist),
    fld("softmax", Ty::Dist),
    fld("elementwise", Ty::Dist),
    fld("embedding", Ty::Dist),
    fld("loss", Ty::Dist),
    fld("router", Ty::Dist),
    fld("optimizer", Ty::Dist),
    fld("framework", Ty::Dist),
];

const FAIL_SLOW_FIELDS: &[Field] = &[
    fld("rate_per_gpu_hour", Ty::F64),
    fld("duration_s", Ty::Dist),
    fld("slowdown", Ty::F64),
];

const FAILURES_FIELDS: &[Field] = &[
    fld("rate_per_gpu_hour", Ty::F64),
    fld("rate_per_node_day", Ty::F64),
    fld("checkpoint_interval_s", Ty::F64),
    fld("checkpoint_write_s", Ty::F64),
    fld("restart_s", Ty::F64),
];

const DISTRIBUTIONS_FIELDS: &[Field] = &[fld("table", Ty::Str)];

/// Distribution kinds (`dist = "..."`) and the parameters each takes.
const DISTS: &[(&str, &[&str])] = &[
    ("constant", &["value"]),
    ("normal", &["mean", "std"]),
    ("lognormal", &["mu", "sigma"]),
    ("gamma", &["shape", "scale"]),
    ("exponential", &["mean"]),
    ("empirical", &["values"]),
];

/// Every key a distribution table may hold.
const DIST_PARAMS: &[&str] = &[
    "dist", "value", "mean", "std", "mu", "sigma", "shape", "scale", "values",
];

const SECTIONS: &[(&str, &[Field])] = &[
    ("model", MODEL_FIELDS),
    ("cluster", CLUSTER_FIELDS),
    ("parallel", PARALLEL_FIELDS),
    ("training", TRAINING_FIELDS),
    ("cost", COST_FIELDS),
    ("published", PUBLISHED_FIELDS),
    ("variability", VARIABILITY_FIELDS),
    ("resilience", RESILIENCE_FIELDS),
    ("wan", WAN_FIELDS),
];

/// `[resilience]`: workload and restart figures of `prism resilience` and `prism detect`
/// (docs/job-format.md); no effect on any other command.
const RESILIENCE_FIELDS: &[Field] = &[
    fld("seq_len_median", Ty::F64),
    fld("seq_len_sigma", Ty::F64),
    fld("state_bytes_per_param", Ty::U64),
    fld("reconfig_restart_s", Ty::F64),
    fld("checkpoint_restart_s", Ty::F64),
    fld("checkpoint_period_s", Ty::F64),
    fld("stage_tp", Ty::Str),
    fld("memory_fraction", Ty::F64),
];

/// `[wan]`: datacenters and the WAN links between them (`prism_core::wan`). The per-link
/// figures take one number for every link or an array with one per link.
const WAN_FIELDS: &[Field] = &[
    fld("datacenters", Ty::List),
    fld("datacenter_nodes", Ty::List),
    fld("links", Ty::List),
    fld("link_gbps", Ty::List),
    fld("link_rtt_ms", Ty::List),
    fld("tcp_window_mib", Ty::List),
    fld("connections", Ty::List),
    fld("sharing", Ty::Str),
];

/// Sub-sections: the fields of type [`Ty::Table`] of a section, stored in [`Doc::sections`]
/// under their dotted name.
const SUBSECTIONS: &[(&str, &[Field])] = &[
    ("variability.kernel_jitter", KERNEL_JITTER_FIELDS),
    ("variability.fail_slow", FAIL_SLOW_FIELDS),
    ("variability.failures", FAILURES_FIELDS),
    ("variability.distributions", DISTRIBUTIONS_FIELDS),
];

fn section_fields(name: &str) -> Option<(&'static str, &'static [Field])> {
    SECTIONS.iter().find(|(n, _)| *n == name).copied()
}

fn subsection_fields(name: &str) -> Option<(&'static str, &'static [Field])> {
    SUBSECTIONS.iter().find(|(n, _)| *n == name).copied()
}

fn find_field<'f>(fields: &'f [Field], key: &str) -> Option<&'f Field> {
    fields
        .iter()
        .find(|f| f.name == key || f.aliases.contains(&key))
}

fn field_names(fields: &[Field]) -> Vec<&'static str> {
    fields
        .iter()
        .flat_map(|f| std::iter::once(f.name).chain(f.aliases.iter().copied()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Spanned values
// ---------------------------------------------------------------------------------------------

/// Where a value came from.
#[derive(Clone, Debug)]
enum Src {
    /// The job file; byte spans of the key and the value.
    Doc {
        key: Range<usize>,
        val: Range<usize>,
    },
    /// A `--set` override (its text).
    Set(String),
    /// A preset, e.g. "model preset `llama3-8b`".
    Preset(String),
    /// An HF config file.
    Hf(String),
    /// A default value.
    Default,
    /// Derived from other values (description).
    Derived(String),
}

#[derive(Clone, Debug)]
enum Val {
    Str(String),
    Int(i128),
    /// An integer too large even for i128 (its text).
    BigInt(String),
    Float(f64),
    Bool(bool),
    Table(Vec<Entry>),
    /// An array: its elements with where each came from.
    Array(Vec<(Val, Src)>),
    Other(&'static str),
}

impl Val {
    fn kind(&self) -> String {
        match self {
            Val::Str(s) => format!("string \"{s}\""),
            Val::Int(i) => format!("integer {i}"),
            Val::BigInt(s) => format!("integer {s}"),
            Val::Float(x) => format!("float {x}"),
            Val::Bool(b) => format!("boolean {b}"),
            Val::Table(_) => "a table".into(),
            Val::Array(_) => "an array".into(),
            Val::Other(t) => (*t).to_string(),
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    /// The key as written (may be a Megatron alias).
    key: String,
    val: Val,
    src: Src,
}

fn convert_value(v: &DeValue<'_>, mk: &dyn Fn(Range<usize>, Range<usize>) -> Src) -> Val {
    match v {
        DeValue::String(s) => Val::Str(s.to_string()),
        DeValue::Integer(i) => match i128::from_str_radix(i.as_str(), i.radix()) {
            Ok(n) => Val::Int(n),
            Err(_) => Val::BigInt(i.to_string()),
        },
        DeValue::Float(x) => Val::Float(x.as_str().replace('_', "").parse().unwrap_or(f64::NAN)),
        DeValue::Boolean(b) => Val::Bool(*b),
        DeValue::Datetime(_) => Val::Other("a datetime"),
        DeValue::Array(a) => Val::Array(
            a.iter()
                .map(|v| {
                    let span = v.span();
                    (convert_value(v.get_ref(), mk), mk(span.clone(), span))
                })
                .collect(),
        ),
        DeValue::Table(t) => Val::Table(convert_table(t, mk)),
    }
}

/// The entries of a table in source order.
fn convert_table(t: &DeTable<'_>, mk: &dyn Fn(Range<usize>, Range<usize>) -> Src) -> Vec<Entry> {
    let mut out: Vec<(usize, Entry)> = t
        .iter()
        .map(|(k, v)| {
            let src = mk(k.span(), v.span());
            let entry = Entry {
                key: k.get_ref().to_string(),
                val: convert_value(v.get_ref(), mk),
                src,
            };
            (k.span().start, entry)
        })
        .collect();
    out.sort_by_key(|(start, _)| *start);
    out.into_iter().map(|(_, e)| e).collect()
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

struct Ctx<'a> {
    origin: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let before = self.text.get(..offset).unwrap_or(self.text);
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let col = before
            .get(line_start..)
            .map_or(1, |s| s.chars().count() + 1);
        (line, col)
    }

    fn error(&self, key: Option<&str>, rule: impl Into<String>) -> JobFileError {
        JobFileError {
            origin: self.origin.to_string(),
            key: key.map(str::to_string),
            rule: rule.into(),
            location: None,
            via: None,
        }
    }

    /// An error about a value: located at the value (or described by its source).
    fn at_value(&self, src: &Src, key: &str, rule: impl Into<String>) -> JobFileError {
        let mut e = self.error(Some(key), rule);
        self.locate(&mut e, src, false);
        e
    }

    /// An error about a key itself (unknown, duplicated): located at the key.
    fn at_key(&self, src: &Src, key: &str, rule: impl Into<String>) -> JobFileError {
        let mut e = self.error(Some(key), rule);
        self.locate(&mut e, src, true);
        e
    }

    fn locate(&self, e: &mut JobFileError, src: &Src, at_key: bool) {
        match src {
            Src::Doc { key, val } => {
                let span = if at_key { key } else { val };
                e.location = Some(self.line_col(span.start));
            }
            Src::Set(s) => e.via = Some(format!("set by `--set {s}`")),
            Src::Preset(p) => e.via = Some(format!("value from {p}")),
            Src::Hf(p) => e.via = Some(format!("value from HF config `{p}`")),
            Src::Default => e.via = Some("default value".into()),
            Src::Derived(d) => e.via = Some(format!("derived: {d}")),
        }
    }
}

fn suggestion(name: &str, candidates: &[&'static str], fmt_item: fn(&str) -> String) -> String {
    suggestion_listing(name, candidates, candidates, fmt_item)
}

/// "did you mean X?" when a candidate is close to `name`, else the list of `listed` names.
fn suggestion_listing(
    name: &str,
    candidates: &[&'static str],
    listed: &[&'static str],
    fmt_item: fn(&str) -> String,
) -> String {
    match presets::closest(name, candidates.iter().copied()) {
        Some(c) => format!("did you mean {}?", fmt_item(c)),
        None => {
            let all: Vec<String> = listed.iter().map(|c| fmt_item(c)).collect();
            format!("expected one of {}", all.join(", "))
        }
    }
}

/// Unknown key in a section: suggest among names and Megatron aliases, list the names.
fn unknown_field_rule(key: &str, fields: &[Field]) -> String {
    let names: Vec<&'static str> = fields.iter().map(|f| f.name).collect();
    format!(
        "unknown key; {}",
        suggestion_listing(key, &field_names(fields), &names, backticked)
    )
}

fn backticked(s: &str) -> String {
    format!("`{s}`")
}

fn bracketed(s: &str) -> String {
    format!("`[{s}]`")
}

// ---------------------------------------------------------------------------------------------
// Stage 1-2: parse and check the structure
// ---------------------------------------------------------------------------------------------

/// A section after structure checks: canonical field name -> entry.
#[derive(Debug, Default)]
struct Section {
    fields: BTreeMap<&'static str, Entry>,
}

#[derive(Debug, Default)]
struct Doc {
    name: Option<Entry>,
    sections: BTreeMap<&'static str, Section>,
}

fn parse_doc(ctx: &Ctx<'_>) -> Result<Doc, JobFileError> {
    let table = DeTable::parse(ctx.text).map_err(|e| {
        let mut err = ctx.error(None, format!("invalid TOML: {}", e.message()));
        err.location = e.span().map(|s| ctx.line_col(s.start));
        err
    })?;
    let mk = |key: Range<usize>, val: Range<usize>| Src::Doc { key, val };
    let entries = convert_table(table.get_ref(), &mk);
    let mut doc = Doc::default();
    for entry in entries {
        if entry.key == "name" {
            doc.name = Some(entry);
            continue;
        }
        let Some((sname, fields)) = section_fields(&entry.key) else {
            return Err(unknown_top_level(ctx, &entry));
        };
        let Val::Table(items) = &entry.val else {
            return Err(ctx.at_value(
                &entry.src,
                sname,
                format!(
                    "must be a section (`[{sname}]`), found {}",
                    entry.val.kind()
                ),
            ));
        };
        let mut section = normalize_section(ctx, sname, fields, items, &[])?;
        split_subsections(ctx, sname, fields, &mut section, &mut doc)?;
        doc.sections.insert(sname, section);
    }
    Ok(doc)
}

/// Moves the sub-table fields ([`Ty::Table`]) of section `sname` into their own sections of
/// `doc` (`variability.failures`), checking their keys.
fn split_subsections(
    ctx: &Ctx<'_>,
    sname: &'static str,
    fields: &'static [Field],
    section: &mut Section,
    doc: &mut Doc,
) -> Result<(), JobFileError> {
    for field in fields.iter().filter(|f| f.ty == Ty::Table) {
        let Some(entry) = section.fields.remove(field.name) else {
            continue;
        };
        let dotted = format!("{sname}.{}", field.name);
        let Some((sub, sub_fields)) = subsection_fields(&dotted) else {
            continue;
        };
        let Val::Table(items) = &entry.val else {
            return Err(ctx.at_value(
                &entry.src,
                sub,
                format!("must be a section (`[{sub}]`), found {}", entry.val.kind()),
            ));
        };
        let subsection = normalize_section(ctx, sub, sub_fields, items, &[])?;
        doc.sections.insert(sub, subsection);
    }
    Ok(())
}

fn unknown_top_level(ctx: &Ctx<'_>, entry: &Entry) -> JobFileError {
    let key = entry.key.as_str();
    if let Some(home) = other_section_of(key, None) {
        return ctx.at_key(
            &entry.src,
            key,
            format!("unknown top-level key; `{key}` belongs in `[{home}]`"),
        );
    }
    if matches!(entry.val, Val::Table(_)) {
        let names: Vec<&'static str> = SECTIONS.iter().map(|(n, _)| *n).collect();
        ctx.at_key(
            &entry.src,
            key,
            format!(
                "unknown section `[{key}]`; {}",
                suggestion(key, &names, bracketed)
            ),
        )
    } else {
        let mut names: Vec<&'static str> = field_names(TOP_FIELDS);
        names.extend(SECTIONS.iter().map(|(n, _)| *n));
        ctx.at_key(
            &entry.src,
            key,
            format!("unknown key; {}", suggestion(key, &names, backticked)),
        )
    }
}

/// The section (other than `except`) that has a field called `key`, if any.
fn other_section_of(key: &str, except: Option<&str>) -> Option<&'static str> {
    SECTIONS
        .iter()
        .chain(SUBSECTIONS)
        .filter(|(n, _)| Some(*n) != except)
        .find(|(_, fields)| find_field(fields, key).is_some())
        .map(|(n, _)| *n)
}

/// Checks a section's keys against its schema, maps aliases, rejects a setting given twice.
/// `forbidden` lists keys not allowed in this context (e.g. `nodes` in a cluster preset).
fn normalize_section(
    ctx: &Ctx<'_>,
    sname: &'static str,
    fields: &'static [Field],
    items: &[Entry],
    forbidden: &[&str],
) -> Result<Section, JobFileError> {
    let mut section = Section::default();
    for entry in items {
        let dotted = format!("{sname}.{}", entry.key);
        let Some(field) = find_field(fields, &entry.key).filter(|f| !forbidden.contains(&f.name))
        else {
            if forbidden.contains(&entry.key.as_str()) {
                return Err(ctx.at_key(&entry.src, &dotted, "not allowed here"));
            }
            let rule = match other_section_of(&entry.key, Some(sname)) {
                Some(home) => format!(
                    "unknown key in `[{sname}]`; `{}` belongs in `[{home}]`",
                    entry.key
                ),
                None => unknown_field_rule(&entry.key, fields),
            };
            return Err(ctx.at_key(&entry.src, &dotted, rule));
        };
        if let Some(prev) = section.fields.get(field.name) {
            return Err(ctx.at_key(
                &entry.src,
                &dotted,
                format!(
                    "`{sname}.{}` and `{sname}.{}` are the same setting ({sname}.{}); give only one",
                    prev.key, entry.key, field.name
                ),
            ));
        }
        section.fields.insert(field.name, entry.clone());
    }
    Ok(section)
}

// ---------------------------------------------------------------------------------------------
// Stage 3: overrides
// ---------------------------------------------------------------------------------------------

fn apply_override(ctx: &Ctx<'_>, doc: &mut Doc, set: &str) -> Result<(), JobFileError> {
    let src = Src::Set(set.to_string());
    let bad = |key: Option<&str>, rule: String| {
        let mut e = ctx.error(key, rule);
        e.via = Some(format!("in `--set {set}`"));
        e
    };
    let Some((raw_key, raw_val)) = set.split_once('=') else {
        return Err(bad(
            None,
            "bad override: expected `section.key=value`, e.g. `parallel.tp=4`".into(),
        ));
    };
    let key = raw_key.trim();
    let text = raw_val.trim();
    let parts: Vec<&str> = key.split('.').map(str::trim).collect();
    if key.is_empty() || parts.iter().any(|p| p.is_empty()) {
        return Err(bad(
            None,
            "bad override: expected `section.key=value`, e.g. `parallel.tp=4`".into(),
        ));
    }
    // A distribution parameter set on its own: `variability.gpu_speed.std=0.05`.
    let mut param: Option<&str> = None;
    let (section, field): (Option<&'static str>, &'static Field) = match parts.as_slice() {
        [name] => match find_field(TOP_FIELDS, name) {
            Some(f) => (None, f),
            None if section_fields(name).is_some() => {
                return Err(bad(
                    Some(name),
                    format!(
                        "bad override: name a key inside the section, e.g. `{name}.<key>=value`"
                    ),
                ));
            }
            None => {
                let rule = match other_section_of(name, None) {
                    Some(home) => format!("unknown key; did you mean `{home}.{name}`?"),
                    None => {
                        let mut names = field_names(TOP_FIELDS);
                        names.extend(SECTIONS.iter().map(|(n, _)| *n));
                        format!("unknown key; {}", suggestion(name, &names, backticked))
                    }
                };
                return Err(bad(Some(name), rule));
            }
        },
        [sec, rest @ ..] => {
            let form_error = || {
                bad(
                    Some(key),
                    "bad override: keys have the form `section.key` (or `name`; \
                     `variability.<table>.key`, `variability.<distribution>.parameter`)"
                        .into(),
                )
            };
            let Some((top, top_fields)) = section_fields(sec) else {
                if rest.len() > 1 {
                    return Err(form_error());
                }
                let names: Vec<&'static str> = SECTIONS.iter().map(|(n, _)| *n).collect();
                return Err(bad(
                    Some(key),
                    format!(
                        "unknown section `{sec}`; {}",
                        suggestion(sec, &names, backticked)
                    ),
                ));
            };
            // A sub-section key: `variability.failures.restart_s`.
            let (sname, fields, rest) = match rest {
                [sub, tail @ ..] if !tail.is_empty() => {
                    match subsection_fields(&format!("{top}.{sub}")) {
                        Some((n, f)) => (n, f, tail),
                        None => (top, top_fields, rest),
                    }
                }
                _ => (top, top_fields, rest),
            };
            let Some((name, tail)) = rest.split_first() else {
                return Err(form_error());
            };
            let Some(field) = find_field(fields, name) else {
                let rule = match other_section_of(name, Some(sname)) {
                    Some(home) => format!("unknown key; `{name}` belongs in `[{home}]`"),
                    None => unknown_field_rule(name, fields),
                };
                return Err(bad(Some(key), rule));
            };
            match (field.ty, tail) {
                (Ty::Table, _) => {
                    return Err(bad(
                        Some(key),
                        format!(
                            "bad override: name a key inside the table, e.g. \
                             `{sname}.{name}.<key>=value`"
                        ),
                    ));
                }
                (_, []) => {}
                (Ty::Dist, [p]) => {
                    if !DIST_PARAMS.contains(p) {
                        return Err(bad(
                            Some(key),
                            format!(
                                "unknown distribution parameter; {}",
                                suggestion(p, DIST_PARAMS, backticked)
                            ),
                        ));
                    }
                    param = Some(*p);
                }
                _ => return Err(form_error()),
            }
            (Some(sname), field)
        }
        [] => {
            return Err(bad(
                Some(key),
                "bad override: keys have the form `section.key` (or `name`)".into(),
            ));
        }
    };
    // `--set section.key=` (nothing after `=`) unsets the key: it takes its default, or for
    // `parallel.dp` is derived again from the GPU count.
    if text.is_empty() && param.is_none() {
        match section {
            None => doc.name = None,
            Some(sname) => {
                if let Some(sec) = doc.sections.get_mut(sname) {
                    sec.fields.remove(field.name);
                }
            }
        }
        return Ok(());
    }
    let raw_text = match param {
        Some(p) => p == "dist",
        None => field.ty == Ty::Str,
    };
    let val = match DeValue::parse(text) {
        Ok(v) => {
            let parsed = convert_value(v.get_ref(), &|_, _| src.clone());
            match (&parsed, raw_text) {
                (Val::Str(_), _) => parsed,
                (_, true) => Val::Str(text.to_string()),
                _ => parsed,
            }
        }
        Err(_) => Val::Str(text.to_string()),
    };
    let written = parts.last().copied().unwrap_or(field.name).to_string();
    let entry = Entry {
        key: written,
        val,
        src,
    };
    match section {
        None => doc.name = Some(entry),
        Some(sname) => {
            let sec = doc.sections.entry(sname).or_default();
            // Choosing a model source replaces the other one.
            if matches!(sname, "model") && field.name == "preset" {
                sec.fields.remove("hf_config");
            }
            if matches!(sname, "model") && field.name == "hf_config" {
                sec.fields.remove("preset");
            }
            match param {
                None => {
                    sec.fields.insert(field.name, entry);
                }
                Some(p) => {
                    // Replace one parameter of the distribution table (created if absent).
                    let slot = sec.fields.entry(field.name).or_insert_with(|| Entry {
                        key: field.name.to_string(),
                        val: Val::Table(Vec::new()),
                        src: entry.src.clone(),
                    });
                    if !matches!(slot.val, Val::Table(_)) {
                        slot.val = Val::Table(Vec::new());
                        slot.src = entry.src.clone();
                    }
                    if let Val::Table(items) = &mut slot.val {
                        items.retain(|e| e.key != p);
                        items.push(entry);
                    }
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Stage 4-5: resolve and convert
// ---------------------------------------------------------------------------------------------

/// Typed access to one section's resolved fields.
struct Getter<'a> {
    ctx: &'a Ctx<'a>,
    section: &'a str,
    fields: &'a BTreeMap<&'static str, Entry>,
}

impl Getter<'_> {
    fn dotted(&self, key: &str) -> String {
        format!("{}.{key}", self.section)
    }

    fn entry(&self, key: &str) -> Option<&Entry> {
        self.fields.get(key)
    }

    fn type_error(&self, key: &str, entry: &Entry, ty: Ty) -> JobFileError {
        let alias_note = if entry.key != key {
            format!(" (given as `{}`)", entry.key)
        } else {
            String::new()
        };
        self.ctx.at_value(
            &entry.src,
            &self.dotted(key),
            format!(
                "expected {}, found {}{alias_note}",
                ty.expected(),
                entry.val.kind()
            ),
        )
    }

    fn u32(&self, key: &str) -> Result<Option<u32>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        let too_large = |shown: &str| {
            self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("is too large (got {shown}; at most {})", u32::MAX),
            )
        };
        match &e.val {
            Val::Int(i) if *i < 0 => Err(self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("must not be negative (got {i})"),
            )),
            Val::Int(i) => u32::try_from(*i)
                .map(Some)
                .map_err(|_| too_large(&i.to_string())),
            Val::BigInt(s) if s.starts_with('-') => Err(self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("must not be negative (got {s})"),
            )),
            Val::BigInt(s) => Err(too_large(s)),
            _ => Err(self.type_error(key, e, Ty::U32)),
        }
    }

    fn f64(&self, key: &str) -> Result<Option<f64>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        let x = match &e.val {
            Val::Float(x) => *x,
            Val::Int(i) => *i as f64,
            Val::BigInt(_) => f64::INFINITY,
            _ => return Err(self.type_error(key, e, Ty::F64)),
        };
        if !x.is_finite() {
            return Err(self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("must be a finite number (got {})", fmt_val(&e.val)),
            ));
        }
        Ok(Some(x))
    }

    fn u64(&self, key: &str) -> Result<Option<u64>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        let negative = |shown: &str| {
            self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("must not be negative (got {shown})"),
            )
        };
        let too_large = |shown: &str| {
            self.ctx.at_value(
                &e.src,
                &self.dotted(key),
                format!("is too large (got {shown}; at most {})", u64::MAX),
            )
        };
        match &e.val {
            Val::Int(i) if *i < 0 => Err(negative(&i.to_string())),
            Val::Int(i) => u64::try_from(*i)
                .map(Some)
                .map_err(|_| too_large(&i.to_string())),
            Val::BigInt(s) if s.starts_with('-') => Err(negative(s)),
            Val::BigInt(s) => Err(too_large(s)),
            _ => Err(self.type_error(key, e, Ty::U64)),
        }
    }

    /// A number that must satisfy `ok`; `rule` says how ("must be positive").
    fn f64_where(
        &self,
        key: &str,
        ok: fn(f64) -> bool,
        rule: &str,
    ) -> Result<Option<f64>, JobFileError> {
        let Some(x) = self.f64(key)? else {
            return Ok(None);
        };
        if ok(x) {
            return Ok(Some(x));
        }
        let e = self.entry(key).expect("f64() returned Some");
        Err(self
            .ctx
            .at_value(&e.src, &self.dotted(key), format!("{rule} (got {x})")))
    }

    /// A distribution: a number (a constant) or a table `{ dist = "<kind>", <parameters> }`.
    /// The parameters are checked against the kind (unknown ones get a suggestion, missing ones
    /// are named) and validated; every draw of the distribution must be positive, so constants,
    /// means, shapes and scales must be positive and spreads non-negative.
    fn dist(&self, key: &str) -> Result<Option<Dist>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        let dotted = self.dotted(key);
        let items = match &e.val {
            Val::Float(_) | Val::Int(_) | Val::BigInt(_) => {
                let x =
                    self.f64_where(key, positive, "a constant distribution must be positive")?;
                return Ok(x.map(Dist::Constant));
            }
            Val::Table(items) => items,
            _ => return Err(self.type_error(key, e, Ty::Dist)),
        };
        let mut params: BTreeMap<&'static str, Entry> = BTreeMap::new();
        for item in items {
            let Some(name) = DIST_PARAMS.iter().copied().find(|p| *p == item.key) else {
                return Err(self.ctx.at_key(
                    &item.src,
                    &format!("{dotted}.{}", item.key),
                    format!(
                        "unknown distribution parameter; {}",
                        suggestion(&item.key, DIST_PARAMS, backticked)
                    ),
                ));
            };
            params.insert(name, item.clone());
        }
        let g = Getter {
            ctx: self.ctx,
            section: &dotted,
            fields: &params,
        };
        // A missing parameter is located at the distribution's table.
        let missing = |p: &str, rule: &str| {
            let mut err = g.missing(p, rule);
            self.ctx.locate(&mut err, &e.src, false);
            err
        };
        let kinds: Vec<&'static str> = DISTS.iter().map(|(n, _)| *n).collect();
        let Some(kind) = g.str("dist")? else {
            let quoted: Vec<String> = kinds.iter().map(|n| format!("\"{n}\"")).collect();
            return Err(missing(
                "dist",
                &format!(
                    "a distribution table needs `dist`, one of {}",
                    quoted.join(", ")
                ),
            ));
        };
        let lower = kind.trim().to_ascii_lowercase();
        let Some((kind, takes)) = DISTS.iter().copied().find(|(n, _)| *n == lower) else {
            let quoted: Vec<String> = kinds.iter().map(|n| format!("\"{n}\"")).collect();
            let hint = match presets::closest(&lower, kinds.iter().copied()) {
                Some(c) => format!("; did you mean \"{c}\"?"),
                None => String::new(),
            };
            let de = g.entry("dist").expect("str() returned Some");
            return Err(self.ctx.at_value(
                &de.src,
                &g.dotted("dist"),
                format!(
                    "unknown distribution; must be one of {} (got \"{kind}\"){hint}",
                    quoted.join(", ")
                ),
            ));
        };
        let listed: Vec<String> = takes.iter().map(|p| format!("`{p}`")).collect();
        let listed = listed.join(" and ");
        for item in items {
            if item.key != "dist" && !takes.contains(&item.key.as_str()) {
                return Err(self.ctx.at_key(
                    &item.src,
                    &g.dotted(&item.key),
                    format!(
                        "not a parameter of dist \"{kind}\" (which takes {listed}){}",
                        match presets::closest(&item.key, takes.iter().copied()) {
                            Some(c) => format!("; did you mean `{c}`?"),
                            None => String::new(),
                        }
                    ),
                ));
            }
        }
        let need = |p: &str, ok: fn(f64) -> bool, rule: &str| -> Result<f64, JobFileError> {
            g.f64_where(p, ok, rule)?
                .ok_or_else(|| missing(p, &format!("dist \"{kind}\" needs {listed}")))
        };
        const POS: &str = "must be positive";
        const NONNEG: &str = "must not be negative";
        let d = match kind {
            "constant" => Dist::Constant(need("value", positive, POS)?),
            "normal" => Dist::Normal {
                mean: need("mean", positive, POS)?,
                std: need("std", nonneg, NONNEG)?,
            },
            "lognormal" => Dist::LogNormal {
                mu: need("mu", |_| true, "")?,
                sigma: need("sigma", nonneg, NONNEG)?,
            },
            "gamma" => Dist::Gamma {
                shape: need("shape", positive, POS)?,
                scale: need("scale", positive, POS)?,
            },
            "exponential" => Dist::Exponential {
                mean: need("mean", positive, POS)?,
            },
            _ => match g.entry("values") {
                None => {
                    return Err(missing(
                        "values",
                        &format!("dist \"{kind}\" needs {listed}"),
                    ));
                }
                Some(_) => Dist::Empirical(g.values("values")?),
            },
        };
        Ok(Some(d))
    }

    /// The non-empty array of positive numbers of an empirical distribution.
    fn values(&self, key: &str) -> Result<Vec<f64>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(Vec::new());
        };
        let dotted = self.dotted(key);
        let Val::Array(items) = &e.val else {
            return Err(self.ctx.at_value(
                &e.src,
                &dotted,
                format!("expected an array of numbers, found {}", e.val.kind()),
            ));
        };
        if items.is_empty() {
            return Err(self
                .ctx
                .at_value(&e.src, &dotted, "must hold at least one value"));
        }
        let mut out = Vec::with_capacity(items.len());
        for (i, (v, src)) in items.iter().enumerate() {
            let x = match v {
                Val::Float(x) => *x,
                Val::Int(n) => *n as f64,
                Val::BigInt(_) => f64::INFINITY,
                other => {
                    return Err(self.ctx.at_value(
                        src,
                        &dotted,
                        format!("element {i}: expected a number, found {}", other.kind()),
                    ));
                }
            };
            if !(x.is_finite() && x > 0.0) {
                return Err(self.ctx.at_value(
                    src,
                    &dotted,
                    format!(
                        "element {i}: must be a positive finite number (got {})",
                        fmt_val(v)
                    ),
                ));
            }
            out.push(x);
        }
        Ok(out)
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        match &e.val {
            Val::Bool(b) => Ok(Some(*b)),
            _ => Err(self.type_error(key, e, Ty::Bool)),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>, JobFileError> {
        let Some(e) = self.entry(key) else {
            return Ok(None);
        };
        match &e.val {
            Val::Str(s) => Ok(Some(s.as_str())),
            _ => Err(self.type_error(key, e, Ty::Str)),
        }
    }

    fn choice<T: Copy>(
        &self,
        key: &str,
        options: &[(&'static str, T)],
    ) -> Result<Option<T>, JobFileError> {
        let Some(s) = self.str(key)? else {
            return Ok(None);
        };
        let lower = s.trim().to_ascii_lowercase();
        if let Some((_, v)) = options.iter().find(|(n, _)| *n == lower) {
            return Ok(Some(*v));
        }
        let names: Vec<&'static str> = options.iter().map(|(n, _)| *n).collect();
        let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
        let hint = match presets::closest(&lower, names.iter().copied()) {
            Some(c) => format!("; did you mean \"{c}\"?"),
            None => String::new(),
        };
        let e = self.entry(key).expect("str() returned Some");
        Err(self.ctx.at_value(
            &e.src,
            &self.dotted(key),
            format!("must be one of {} (got \"{s}\"){hint}", quoted.join(", ")),
        ))
    }

    fn missing(&self, key: &str, rule: &str) -> JobFileError {
        self.ctx.error(
            Some(&self.dotted(key)),
            format!("missing required key; {rule}"),
        )
    }

    fn req_u32(&self, key: &str, rule: &str) -> Result<u32, JobFileError> {
        self.u32(key)?.ok_or_else(|| self.missing(key, rule))
    }

    fn req_f64(&self, key: &str, rule: &str) -> Result<f64, JobFileError> {
        self.f64(key)?.ok_or_else(|| self.missing(key, rule))
    }

    /// Fails when `key` is present and above `max`.
    fn bound(&self, key: &str, value: u64, max: u64, why: &str) -> Result<(), JobFileError> {
        if value <= max {
            return Ok(());
        }
        Err(self.error_at(key, format!("must be at most {max} (got {value}; {why})")))
    }

    /// An error on `key` that broke `rule`: at its value when the section gives it, else at
    /// the key alone (a default or derived value).
    fn error_at(&self, key: &str, rule: impl Into<String>) -> JobFileError {
        let dotted = self.dotted(key);
        match self.entry(key) {
            Some(e) => self.ctx.at_value(&e.src, &dotted, rule),
            None => self.ctx.error(Some(&dotted), rule),
        }
    }
}

fn positive(x: f64) -> bool {
    x > 0.0
}

fn nonneg(x: f64) -> bool {
    x >= 0.0
}

fn fraction(x: f64) -> bool {
    (0.0..=1.0).contains(&x)
}

fn at_least_one(x: f64) -> bool {
    x >= 1.0
}

fn fmt_val(v: &Val) -> String {
    match v {
        Val::Float(x) => format!("{x}"),
        Val::BigInt(s) => s.clone(),
        other => other.kind(),
    }
}

/// Parses a preset's TOML into the fields of section `sname`.
fn preset_fields(
    origin_ctx: &Ctx<'_>,
    sname: &'static str,
    fields: &'static [Field],
    label: &str,
    text: &str,
    forbidden: &[&str],
) -> Result<BTreeMap<&'static str, Entry>, JobFileError> {
    let pctx = Ctx {
        origin: label,
        text,
    };
    let table = DeTable::parse(text).map_err(|e| {
        let mut err = pctx.error(None, format!("invalid TOML in {label}: {}", e.message()));
        err.location = e.span().map(|s| pctx.line_col(s.start));
        err.origin = origin_ctx.origin.to_string();
        err
    })?;
    let lbl = label.to_string();
    let mk = move |_: Range<usize>, _: Range<usize>| Src::Preset(lbl.clone());
    let entries = convert_table(table.get_ref(), &mk);
    let section = normalize_section(origin_ctx, sname, fields, &entries, forbidden)?;
    Ok(section.fields)
}

/// Turns a model read from an HF config into `[model]` fields.
fn model_fields(m: &Model, src: &Src) -> BTreeMap<&'static str, Entry> {
    let mut out = BTreeMap::new();
    let mut put = |k: &'static str, val: Val| {
        out.insert(
            k,
            Entry {
                key: k.to_string(),
                val,
                src: src.clone(),
            },
        );
    };
    put("name", Val::Str(m.name.clone()));
    put("layers", Val::Int(m.layers.into()));
    put("hidden", Val::Int(m.hidden.into()));
    put("ffn_hidden", Val::Int(m.ffn_hidden.into()));
    put("heads", Val::Int(m.heads.into()));
    put("kv_heads", Val::Int(m.kv_heads.into()));
    put("head_dim", Val::Int(m.head_dim.into()));
    put("vocab", Val::Int(m.vocab.into()));
    put("seq_len", Val::Int(m.seq_len.into()));
    let act = match m.activation {
        Activation::SwiGlu => "swiglu",
        Activation::Gelu => "gelu",
    };
    put("activation", Val::Str(act.into()));
    if let Some(moe) = &m.moe {
        put("moe_experts", Val::Int(moe.experts.into()));
        put("moe_top_k", Val::Int(moe.top_k.into()));
        put("moe_ffn_hidden", Val::Int(moe.ffn_hidden.into()));
    }
    put("tied_embeddings", Val::Bool(m.tied_embeddings));
    put("dropout", Val::Bool(m.dropout));
    // Architecture keys, only where they differ from the plain decoder.
    let a = &m.arch;
    let d = prism_core::arch::Arch::default();
    if let Some(mla) = &a.mla {
        put("mla_q_lora_rank", Val::Int(mla.q_lora_rank.into()));
        put("mla_kv_lora_rank", Val::Int(mla.kv_lora_rank.into()));
        put(
            "mla_qk_nope_head_dim",
            Val::Int(mla.qk_nope_head_dim.into()),
        );
        put(
            "mla_qk_rope_head_dim",
            Val::Int(mla.qk_rope_head_dim.into()),
        );
        put("mla_v_head_dim", Val::Int(mla.v_head_dim.into()));
    }
    for (k, v, dv) in [
        (
            "moe_first_dense_layers",
            a.moe_first_dense_layers,
            d.moe_first_dense_layers,
        ),
        ("moe_layer_step", a.moe_layer_step, d.moe_layer_step),
        (
            "moe_shared_ffn_hidden",
            a.moe_shared_ffn_hidden,
            d.moe_shared_ffn_hidden,
        ),
        ("attention_window", a.attention_window, d.attention_window),
        (
            "attention_global_every",
            a.attention_global_every,
            d.attention_global_every,
        ),
        ("mtp_depth", a.mtp_depth, d.mtp_depth),
    ] {
        if v != dv {
            put(k, Val::Int(v.into()));
        }
    }
    if a.attention_window > 0 {
        put(
            "attention_window_kind",
            Val::Str(a.attention_window_kind.name().into()),
        );
    }
    if a.qk_norm {
        put("qk_norm", Val::Bool(true));
    }
    if a.expert_bias {
        put("expert_bias", Val::Bool(true));
    }
    out
}

fn resolve_path(base_dir: Option<&Path>, p: &str) -> PathBuf {
    let path = PathBuf::from(p);
    match base_dir {
        Some(b) if path.is_relative() => b.join(path),
        _ => path,
    }
}

/// Records which source every final key came from, to locate errors from `Job::validate`.
type Sources = BTreeMap<String, Src>;

fn record(sources: &mut Sources, section: &str, fields: &BTreeMap<&'static str, Entry>) {
    for (k, e) in fields {
        sources.insert(format!("{section}.{k}"), e.src.clone());
    }
}

const NO_SECTION: &BTreeMap<&'static str, Entry> = &BTreeMap::new();

fn build(ctx: &Ctx<'_>, doc: &Doc, base_dir: Option<&Path>) -> Result<LoadedJob, JobFileError> {
    let mut sources = Sources::new();
    let (model, model_fields) = build_model(ctx, doc, base_dir)?;
    record(&mut sources, "model", &model_fields);
    let (mut cluster, cluster_fields) = build_cluster(ctx, doc)?;
    record(&mut sources, "cluster", &cluster_fields);
    if let Some(sec) = doc.sections.get("wan") {
        record(&mut sources, "wan", &sec.fields);
        cluster.topology.wan = build_wan(ctx, &sec.fields)?;
    }
    check_model_bounds(ctx, &model_fields, &model)?;

    let training_fields = doc
        .sections
        .get("training")
        .map_or(NO_SECTION, |s| &s.fields);
    record(&mut sources, "training", training_fields);
    let training = build_training(ctx, training_fields)?;

    let parallel_fields = doc
        .sections
        .get("parallel")
        .map_or(NO_SECTION, |s| &s.fields);
    record(&mut sources, "parallel", parallel_fields);
    let parallel = build_parallel(
        ctx,
        parallel_fields,
        &model,
        &cluster,
        &training,
        &mut sources,
    )?;

    let cost_fields = doc.sections.get("cost").map_or(NO_SECTION, |s| &s.fields);
    let cost = Getter {
        ctx,
        section: "cost",
        fields: cost_fields,
    };
    let kernel_table = match cost.str("kernel_table")? {
        None => None,
        Some(p) => {
            let path = resolve_path(base_dir, p);
            if !path.is_file() {
                let e = cost.entry("kernel_table").expect("present");
                return Err(ctx.at_value(
                    &e.src,
                    "cost.kernel_table",
                    format!("file not found: {}", path.display()),
                ));
            }
            Some(path)
        }
    };

    let var = build_variability(ctx, doc, &cluster, base_dir)?;
    let resilience = build_resilience(ctx, doc, &parallel, &model, &cluster)?;
    let published = build_published(ctx, doc)?;

    let name = match &doc.name {
        None => format!(
            "{} on {} x {}",
            model.name,
            cluster.num_gpus(),
            cluster.gpu.name
        ),
        Some(e) => match &e.val {
            Val::Str(s) => s.clone(),
            _ => {
                return Err(ctx.at_value(
                    &e.src,
                    "name",
                    format!("expected a string, found {}", e.val.kind()),
                ));
            }
        },
    };
    if let Some(e) = &doc.name {
        sources.insert("name".into(), e.src.clone());
    }

    let job = Job {
        name,
        model,
        cluster,
        parallel,
        training,
    };
    job.validate().map_err(|JobError { key, rule }| {
        let mut e = ctx.error(Some(&key), rule);
        if let Some(src) = sources.get(&key) {
            ctx.locate(&mut e, src, false);
        }
        e
    })?;
    Ok(LoadedJob {
        job,
        kernel_table,
        published,
        source: ctx.origin.to_string(),
        variability: var.variability,
        variability_seed: var.seed,
        dist_table: var.dist_table,
        resilience,
    })
}

/// The typed `[resilience]` section.
fn build_resilience(
    ctx: &Ctx<'_>,
    doc: &Doc,
    parallel: &Parallel,
    model: &Model,
    cluster: &Cluster,
) -> Result<ResilienceSettings, JobFileError> {
    let g = Getter {
        ctx,
        section: "resilience",
        fields: doc
            .sections
            .get("resilience")
            .map(|s| &s.fields)
            .unwrap_or(NO_SECTION),
    };
    const POS: &str = "must be a positive finite number";
    const NONNEG: &str = "must be a finite number >= 0";
    let d = ResilienceSettings::default();
    let state = g
        .u64("state_bytes_per_param")?
        .unwrap_or(d.state_bytes_per_param);
    if !(1..=64).contains(&state) {
        let e = g.entry("state_bytes_per_param").expect("given");
        return Err(ctx.at_value(
            &e.src,
            "resilience.state_bytes_per_param",
            format!(
                "must be in 1..=64 bytes per parameter (got {state}; mixed-precision Adam: 16)"
            ),
        ));
    }
    let stage_tp = match g.str("stage_tp")? {
        None => None,
        Some(text) => {
            let e = g.entry("stage_tp").expect("given");
            let at = |rule: String| ctx.at_value(&e.src, "resilience.stage_tp", rule);
            let mut v = Vec::new();
            for (i, part) in text.split(',').enumerate() {
                let k: u32 = part.trim().parse().map_err(|_| {
                    at(format!(
                        "element {i} (\"{}\") is not a positive integer; write e.g. \"8,4,8,8\"",
                        part.trim()
                    ))
                })?;
                if k == 0
                    || !k.is_power_of_two()
                    || k > cluster.gpus_per_node
                    || !model.heads.is_multiple_of(k)
                {
                    return Err(at(format!(
                        "element {i} ({k}) must be a power of two that divides the heads ({}) and is at most the GPUs per node ({})",
                        model.heads, cluster.gpus_per_node
                    )));
                }
                v.push(k);
            }
            if v.len() != parallel.pp as usize {
                return Err(at(format!(
                    "must give one TP degree per pipeline stage: {} given, parallel.pp = {}",
                    v.len(),
                    parallel.pp
                )));
            }
            Some(v)
        }
    };
    Ok(ResilienceSettings {
        seq_len_median: g.f64_where(
            "seq_len_median",
            |x| x.is_finite() && x >= 1.0,
            "must be a finite number >= 1 (tokens)",
        )?,
        seq_len_sigma: g
            .f64_where(
                "seq_len_sigma",
                |x| x.is_finite() && (0.0..=5.0).contains(&x),
                "must be in [0, 5]",
            )?
            .unwrap_or(d.seq_len_sigma),
        state_bytes_per_param: state,
        restart_s: g
            .f64_where("reconfig_restart_s", |x| x.is_finite() && x >= 0.0, NONNEG)?
            .unwrap_or(d.restart_s),
        checkpoint_restart_s: g
            .f64_where(
                "checkpoint_restart_s",
                |x| x.is_finite() && x >= 0.0,
                NONNEG,
            )?
            .unwrap_or(d.checkpoint_restart_s),
        checkpoint_interval_s: g
            .f64_where("checkpoint_period_s", |x| x.is_finite() && x > 0.0, POS)?
            .unwrap_or(d.checkpoint_interval_s),
        stage_tp,
        memory_fraction: g
            .f64_where(
                "memory_fraction",
                |x| x > 0.0 && x <= 1.0,
                "must be a fraction in (0, 1]",
            )?
            .unwrap_or(d.memory_fraction),
    })
}

/// What a real run of the job measured (the `[published]` section); every figure optional.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Published {
    /// Where the figures come from.
    pub source: Option<String>,
    /// Model TFLOP/s per GPU, counted as `attention_flops` says.
    pub tflops_per_gpu: Option<f64>,
    /// Model FLOPs utilisation, as a fraction (counted as `attention_flops` says).
    pub mfu: Option<f64>,
    /// Seconds per iteration.
    pub iteration_time_s: Option<f64>,
    /// How the published model FLOPs count a causal attention.
    pub attention_flops: AttentionFlops,
}

/// How a published model-FLOP figure counts a causal attention's score and value products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionFlops {
    /// In full, as if unmasked: Megatron-LM's and PaLM's formula (Prism's `mfu`).
    #[default]
    Full,
    /// Only the unmasked half that a causal kernel computes (Prism's `mfu_causal`).
    Causal,
}

impl AttentionFlops {
    /// Job-file names.
    pub const NAMES: [(&'static str, AttentionFlops); 2] = [
        ("full", AttentionFlops::Full),
        ("causal", AttentionFlops::Causal),
    ];

    /// The job-file spelling.
    pub fn name(self) -> &'static str {
        prism_core::job::spelling(&Self::NAMES, self)
    }
}

fn build_published(ctx: &Ctx<'_>, doc: &Doc) -> Result<Option<Published>, JobFileError> {
    let Some(section) = doc.sections.get("published") else {
        return Ok(None);
    };
    let g = Getter {
        ctx,
        section: "published",
        fields: &section.fields,
    };
    let p = Published {
        source: g.str("source")?.map(str::to_string),
        tflops_per_gpu: g.f64_where("tflops_per_gpu", positive, "must be positive")?,
        mfu: g.f64_where(
            "mfu",
            |x| x > 0.0 && x <= 1.0,
            "must be a fraction in (0, 1]",
        )?,
        iteration_time_s: g.f64_where("iteration_time_s", positive, "must be positive")?,
        attention_flops: g
            .choice("attention_flops", &AttentionFlops::NAMES)?
            .unwrap_or_default(),
    };
    Ok(Some(p))
}

/// The typed `[variability]` section.
struct LoadedVariability {
    variability: Variability,
    seed: Option<u64>,
    dist_table: Option<PathBuf>,
}

fn build_variability(
    ctx: &Ctx<'_>,
    doc: &Doc,
    cluster: &Cluster,
    base_dir: Option<&Path>,
) -> Result<LoadedVariability, JobFileError> {
    let section = |name: &str| doc.sections.get(name).map(|s| &s.fields);
    let g = Getter {
        ctx,
        section: "variability",
        fields: section("variability").unwrap_or(NO_SECTION),
    };
    const POS: &str = "must be positive";
    const NONNEG: &str = "must not be negative";
    let seed = g.u64("seed")?;

    let factor = g.dist("gpu_speed")?;
    let outlier_fraction = g.f64_where(
        "gpu_outlier_fraction",
        fraction,
        "must be a fraction in [0, 1]",
    )?;
    let outlier_slowdown = g.f64_where("gpu_outlier_slowdown", positive, POS)?;
    let gpu_speed = if factor.is_none() && outlier_fraction.is_none() && outlier_slowdown.is_none()
    {
        None
    } else {
        let outlier_fraction = outlier_fraction.unwrap_or(0.0);
        if outlier_fraction > 0.0 && outlier_slowdown.is_none() {
            return Err(g.missing(
                "gpu_outlier_slowdown",
                "gpu_outlier_fraction > 0 needs the time factor of an outlier GPU (e.g. 1.2)",
            ));
        }
        Some(GpuSpeed {
            factor: factor.unwrap_or(Dist::Constant(1.0)),
            outlier_fraction,
            outlier_slowdown: outlier_slowdown.unwrap_or(1.0),
        })
    };
    let comm_regime = g.dist("comm_regime")?.map(|factor| CommRegime { factor });

    let mut kernel_jitter = Vec::new();
    if let Some(fields) = section("variability.kernel_jitter") {
        let kj = Getter {
            ctx,
            section: "variability.kernel_jitter",
            fields,
        };
        for f in KERNEL_JITTER_FIELDS {
            if let Some(factor) = kj.dist(f.name)? {
                kernel_jitter.push(KernelJitter {
                    class: f.name.to_string(),
                    factor,
                });
            }
        }
    }

    let fail_slow = match section("variability.fail_slow") {
        None => None,
        Some(fields) => {
            let fs = Getter {
                ctx,
                section: "variability.fail_slow",
                fields,
            };
            Some(FailSlow {
                rate_per_gpu_hour: fs
                    .f64_where("rate_per_gpu_hour", nonneg, NONNEG)?
                    .ok_or_else(|| fs.missing("rate_per_gpu_hour", "episodes per GPU-hour"))?,
                duration_s: fs.dist("duration_s")?.ok_or_else(|| {
                    fs.missing(
                        "duration_s",
                        "the episode duration in seconds, a distribution or a number",
                    )
                })?,
                slowdown: fs
                    .f64_where("slowdown", at_least_one, "must be at least 1")?
                    .ok_or_else(|| {
                        fs.missing("slowdown", "the time factor while slow (e.g. 2.0)")
                    })?,
            })
        }
    };

    let failures = match section("variability.failures") {
        None => None,
        Some(fields) => {
            let fl = Getter {
                ctx,
                section: "variability.failures",
                fields,
            };
            let per_gpu_hour = fl.f64_where("rate_per_gpu_hour", nonneg, NONNEG)?;
            let per_node_day = fl.f64_where("rate_per_node_day", nonneg, NONNEG)?;
            let rate_per_gpu_hour = match (per_gpu_hour, per_node_day) {
                (Some(_), Some(_)) => {
                    let e = fl.entry("rate_per_node_day").expect("present");
                    return Err(ctx.at_key(
                        &e.src,
                        "variability.failures.rate_per_node_day",
                        "variability.failures.rate_per_gpu_hour and rate_per_node_day are both \
                         given; give only one",
                    ));
                }
                (Some(r), None) => r,
                (None, Some(r)) => r / (24.0 * f64::from(cluster.gpus_per_node.max(1))),
                (None, None) => {
                    return Err(fl.missing(
                        "rate_per_gpu_hour",
                        "give the failure rate as rate_per_gpu_hour or rate_per_node_day",
                    ));
                }
            };
            Some(Failures {
                rate_per_gpu_hour,
                checkpoint_interval_s: fl
                    .f64_where("checkpoint_interval_s", positive, POS)?
                    .ok_or_else(|| {
                        fl.missing(
                            "checkpoint_interval_s",
                            "seconds of training between checkpoints",
                        )
                    })?,
                checkpoint_write_s: fl
                    .f64_where("checkpoint_write_s", nonneg, NONNEG)?
                    .unwrap_or(0.0),
                restart_s: fl.f64_where("restart_s", nonneg, NONNEG)?.unwrap_or(0.0),
            })
        }
    };

    let dist_table = match section("variability.distributions") {
        None => None,
        Some(fields) => {
            let dt = Getter {
                ctx,
                section: "variability.distributions",
                fields,
            };
            match dt.str("table")? {
                None => None,
                Some(p) => {
                    let path = resolve_path(base_dir, p);
                    if !path.is_file() {
                        let e = dt.entry("table").expect("present");
                        return Err(ctx.at_value(
                            &e.src,
                            "variability.distributions.table",
                            format!("file not found: {}", path.display()),
                        ));
                    }
                    Some(path)
                }
            }
        }
    };

    Ok(LoadedVariability {
        variability: Variability {
            gpu_speed,
            kernel_jitter,
            op_jitter: Vec::new(),
            comm_regime,
            fail_slow,
            failures,
        },
        seed,
        dist_table,
    })
}

const MODEL_SOURCE_RULE: &str =
    "give model.preset, model.hf_config, or the inline model sizes (see docs/job-format.md)";

fn build_model(
    ctx: &Ctx<'_>,
    doc: &Doc,
    base_dir: Option<&Path>,
) -> Result<(Model, BTreeMap<&'static str, Entry>), JobFileError> {
    let Some(section) = doc.sections.get("model") else {
        return Err(ctx.error(
            Some("model"),
            format!("missing section `[model]`; {MODEL_SOURCE_RULE}"),
        ));
    };
    let g = Getter {
        ctx,
        section: "model",
        fields: &section.fields,
    };
    let preset = g.str("preset")?;
    let hf_config = g.str("hf_config")?;
    let mut fields: BTreeMap<&'static str, Entry> = match (preset, hf_config) {
        (Some(_), Some(_)) => {
            let e = g.entry("hf_config").expect("present");
            return Err(ctx.at_key(
                &e.src,
                "model.hf_config",
                "model.preset and model.hf_config are both given; give only one",
            ));
        }
        (Some(name), None) => {
            let Some(text) = presets::model_preset(name) else {
                let e = g.entry("preset").expect("present");
                return Err(ctx.at_value(
                    &e.src,
                    "model.preset",
                    unknown_preset("model", name, &presets::model_preset_names()),
                ));
            };
            let label = format!("model preset `{name}`");
            preset_fields(
                ctx,
                "model",
                MODEL_FIELDS,
                &label,
                text,
                &["preset", "hf_config"],
            )?
        }
        (None, Some(p)) => {
            let e = g.entry("hf_config").expect("present");
            let path = resolve_path(base_dir, p);
            let shown = path.display().to_string();
            let text = read_limited(&path).map_err(|why| {
                ctx.at_value(
                    &e.src,
                    "model.hf_config",
                    format!("cannot read `{shown}`: {why}"),
                )
            })?;
            let m = hf::model_from_hf_config(&text, &shown).map_err(|he| {
                ctx.at_value(&e.src, "model.hf_config", format!("bad HF config: {he}"))
            })?;
            if !section.fields.iter().any(|(k, _)| *k == "seq_len") {
                return Err(ctx.at_value(
                    &e.src,
                    "model.seq_len",
                    format!(
                        "required with model.hf_config: the config's max_position_embeddings \
                         ({}) is the longest context the model supports, not the training \
                         sequence length; set seq_len in [model]",
                        m.seq_len
                    ),
                ));
            }
            model_fields(&m, &Src::Hf(shown))
        }
        (None, None) => BTreeMap::new(),
    };
    // Inline keys override the preset / HF values.
    for (k, e) in &section.fields {
        if !matches!(*k, "preset" | "hf_config") {
            fields.insert(k, e.clone());
        }
    }
    let g = Getter {
        ctx,
        section: "model",
        fields: &fields,
    };
    let req = |k: &str| g.req_u32(k, MODEL_SOURCE_RULE);

    let name = g.str("name")?.unwrap_or("custom model").to_string();
    let layers = req("layers")?;
    let hidden = req("hidden")?;
    let heads = req("heads")?;
    let kv_heads = g.u32("kv_heads")?.unwrap_or(heads);
    let head_dim = match g.u32("head_dim")? {
        Some(d) => d,
        None if heads > 0 && hidden.is_multiple_of(heads) => hidden / heads,
        None => {
            return Err(g.missing(
                "head_dim",
                &format!("it defaults to hidden / heads, but {hidden} / {heads} is not an integer"),
            ));
        }
    };
    let vocab = req("vocab")?;
    let seq_len = req("seq_len")?;
    let activation = g
        .choice(
            "activation",
            &[("swiglu", Activation::SwiGlu), ("gelu", Activation::Gelu)],
        )?
        .ok_or_else(|| g.missing("activation", "one of \"swiglu\", \"gelu\""))?;
    let experts = g.u32("moe_experts")?;
    let top_k = g.u32("moe_top_k")?;
    let moe_ffn = g.u32("moe_ffn_hidden")?;
    let ffn_hidden = match (g.u32("ffn_hidden")?, experts, moe_ffn) {
        (Some(f), _, _) => f,
        (None, Some(_), Some(f)) => f,
        (None, _, _) => req("ffn_hidden")?,
    };
    let moe = match experts {
        Some(experts) => Some(Moe {
            experts,
            top_k: top_k.ok_or_else(|| {
                g.missing(
                    "moe_top_k",
                    "a mixture-of-experts model (model.moe_experts) needs it",
                )
            })?,
            ffn_hidden: moe_ffn.unwrap_or(ffn_hidden),
        }),
        None => {
            for k in ["moe_top_k", "moe_ffn_hidden"] {
                if let Some(e) = g.entry(k) {
                    return Err(ctx.at_value(
                        &e.src,
                        &format!("model.{k}"),
                        "needs model.moe_experts (the number of experts)",
                    ));
                }
            }
            None
        }
    };
    let tied_embeddings = g.bool("tied_embeddings")?.unwrap_or(false);
    let dropout = g.bool("dropout")?.unwrap_or(false);
    let arch = build_arch(ctx, &g, moe.is_some())?;
    let model = Model {
        name,
        layers,
        hidden,
        ffn_hidden,
        heads,
        kv_heads,
        head_dim,
        vocab,
        seq_len,
        activation,
        moe,
        tied_embeddings,
        dropout,
        arch,
    };
    Ok((model, fields))
}

/// The `[model]` architecture keys (prism_core::arch), defaults where absent.
fn build_arch(
    ctx: &Ctx<'_>,
    g: &Getter<'_>,
    is_moe: bool,
) -> Result<prism_core::arch::Arch, JobFileError> {
    use prism_core::arch::{Arch, Mla, WindowKind};
    let d = Arch::default();
    let mla_keys = [
        "mla_q_lora_rank",
        "mla_kv_lora_rank",
        "mla_qk_nope_head_dim",
        "mla_qk_rope_head_dim",
        "mla_v_head_dim",
    ];
    let mla = if mla_keys.iter().any(|k| g.entry(k).is_some()) {
        let need = |k: &str| -> Result<u32, JobFileError> {
            g.u32(k)?.ok_or_else(|| {
                g.missing(
                    k,
                    "multi-head latent attention needs mla_kv_lora_rank, mla_qk_nope_head_dim,                      mla_qk_rope_head_dim and mla_v_head_dim (mla_q_lora_rank defaults to 0)",
                )
            })
        };
        Some(Mla {
            q_lora_rank: g.u32("mla_q_lora_rank")?.unwrap_or(0),
            kv_lora_rank: need("mla_kv_lora_rank")?,
            qk_nope_head_dim: need("mla_qk_nope_head_dim")?,
            qk_rope_head_dim: need("mla_qk_rope_head_dim")?,
            v_head_dim: need("mla_v_head_dim")?,
        })
    } else {
        None
    };
    if !is_moe {
        for k in [
            "moe_first_dense_layers",
            "moe_layer_step",
            "moe_shared_ffn_hidden",
            "moe_capacity_factor",
            "moe_imbalance",
            "moe_groups",
            "moe_groups_per_token",
        ] {
            if let Some(e) = g.entry(k) {
                return Err(ctx.at_value(
                    &e.src,
                    &format!("model.{k}"),
                    "needs model.moe_experts (the number of experts)",
                ));
            }
        }
    }
    let kind = g
        .choice(
            "attention_window_kind",
            &[
                ("sliding", WindowKind::Sliding),
                ("chunked", WindowKind::Chunked),
            ],
        )?
        .unwrap_or_default();
    Ok(Arch {
        mla,
        moe_first_dense_layers: g
            .u32("moe_first_dense_layers")?
            .unwrap_or(d.moe_first_dense_layers),
        moe_layer_step: g.u32("moe_layer_step")?.unwrap_or(d.moe_layer_step),
        moe_shared_ffn_hidden: g
            .u32("moe_shared_ffn_hidden")?
            .unwrap_or(d.moe_shared_ffn_hidden),
        moe_capacity_factor: g
            .f64("moe_capacity_factor")?
            .unwrap_or(d.moe_capacity_factor),
        moe_imbalance: g.f64("moe_imbalance")?.unwrap_or(d.moe_imbalance),
        attention_window: g.u32("attention_window")?.unwrap_or(d.attention_window),
        attention_window_kind: kind,
        attention_global_every: g
            .u32("attention_global_every")?
            .unwrap_or(d.attention_global_every),
        mtp_depth: g.u32("mtp_depth")?.unwrap_or(d.mtp_depth),
        qk_norm: g.bool("qk_norm")?.unwrap_or(d.qk_norm),
        expert_bias: g.bool("expert_bias")?.unwrap_or(d.expert_bias),
        moe_groups: g.u32("moe_groups")?.unwrap_or(d.moe_groups),
        moe_groups_per_token: g
            .u32("moe_groups_per_token")?
            .unwrap_or(d.moe_groups_per_token),
    })
}

fn check_model_bounds(
    ctx: &Ctx<'_>,
    fields: &BTreeMap<&'static str, Entry>,
    m: &Model,
) -> Result<(), JobFileError> {
    let g = Getter {
        ctx,
        section: "model",
        fields,
    };
    const WHY: &str = "a sanity bound far above any published model";
    g.bound(
        "layers",
        m.layers.into(),
        MAX_LAYERS.into(),
        "the supported maximum",
    )?;
    g.bound("hidden", m.hidden.into(), MAX_HIDDEN.into(), WHY)?;
    g.bound("ffn_hidden", m.ffn_hidden.into(), MAX_FFN.into(), WHY)?;
    g.bound("heads", m.heads.into(), MAX_HEADS.into(), WHY)?;
    g.bound("kv_heads", m.kv_heads.into(), MAX_HEADS.into(), WHY)?;
    g.bound("head_dim", m.head_dim.into(), MAX_HEAD_DIM.into(), WHY)?;
    g.bound("vocab", m.vocab.into(), MAX_VOCAB.into(), WHY)?;
    g.bound("seq_len", m.seq_len.into(), MAX_SEQ_LEN.into(), WHY)?;
    if let Some(moe) = &m.moe {
        g.bound("moe_experts", moe.experts.into(), MAX_EXPERTS.into(), WHY)?;
        g.bound("moe_ffn_hidden", moe.ffn_hidden.into(), MAX_FFN.into(), WHY)?;
    }
    Ok(())
}

fn unknown_preset(kind: &str, name: &str, names: &[&'static str]) -> String {
    let hint = match presets::closest(name, names.iter().copied()) {
        Some(c) => format!("did you mean `{c}`? "),
        None => String::new(),
    };
    format!(
        "unknown {kind} preset `{name}`; {hint}known {kind} presets: {}",
        names.join(", ")
    )
}

fn build_cluster(
    ctx: &Ctx<'_>,
    doc: &Doc,
) -> Result<(Cluster, BTreeMap<&'static str, Entry>), JobFileError> {
    let Some(section) = doc.sections.get("cluster") else {
        return Err(ctx.error(
            Some("cluster"),
            "missing section `[cluster]`; give cluster.preset (or the inline figures) and cluster.nodes",
        ));
    };
    let g = Getter {
        ctx,
        section: "cluster",
        fields: &section.fields,
    };
    let preset = g.str("preset")?;
    let mut fields = match preset {
        Some(name) => {
            let Some(text) = presets::cluster_preset(name) else {
                let e = g.entry("preset").expect("present");
                return Err(ctx.at_value(
                    &e.src,
                    "cluster.preset",
                    unknown_preset("cluster", name, &presets::cluster_preset_names()),
                ));
            };
            let label = format!("cluster preset `{name}`");
            preset_fields(
                ctx,
                "cluster",
                CLUSTER_FIELDS,
                &label,
                text,
                &["preset", "nodes"],
            )?
        }
        None => BTreeMap::new(),
    };
    for (k, e) in &section.fields {
        if *k != "preset" {
            fields.insert(k, e.clone());
        }
    }
    const RULE: &str = "give cluster.preset or every inline figure (see docs/job-format.md)";
    let g = Getter {
        ctx,
        section: "cluster",
        fields: &fields,
    };
    let gpu_name = g
        .str("gpu")?
        .ok_or_else(|| g.missing("gpu", RULE))?
        .to_string();
    let gpus_per_node = g.req_u32("gpus_per_node", RULE)?;
    let nodes = g.req_u32(
        "nodes",
        "the number of nodes (a cluster preset gives no node count)",
    )?;
    // A cluster needs GPUs: checked here, before the parallel sizes are bounded by the count.
    for (key, v) in [("nodes", nodes), ("gpus_per_node", gpus_per_node)] {
        if v == 0 {
            let e = g.entry(key).expect("present");
            return Err(ctx.at_value(
                &e.src,
                &format!("cluster.{key}"),
                "must be at least 1".to_string(),
            ));
        }
    }
    // Bound the GPU count before anything is derived from it.
    let gpus = u64::from(gpus_per_node) * u64::from(nodes);
    if gpus > MAX_GPUS {
        let key = if g.entry("nodes").is_some() {
            "nodes"
        } else {
            "gpus_per_node"
        };
        let e = g.entry(key).expect("present");
        return Err(ctx.at_value(
            &e.src,
            &format!("cluster.{key}"),
            format!(
                "nodes x gpus_per_node = {nodes} x {gpus_per_node} = {gpus} GPUs exceeds the \
                 supported maximum of {MAX_GPUS}"
            ),
        ));
    }
    // Only one topology so far; the key is checked so that a typo is not silently accepted.
    g.choice("topology", &[("rail-fat-tree", ())])?;
    let cluster = Cluster {
        name: match preset {
            Some(p) => p.to_string(),
            None => format!("custom {gpu_name}"),
        },
        gpu: Gpu {
            name: gpu_name,
            peak_tflops_bf16: g.req_f64("peak_tflops_bf16", RULE)?,
            peak_tflops_fp8: g.f64("peak_tflops_fp8")?,
            hbm_gib: g.req_f64("hbm_gib", RULE)?,
            hbm_tbps: g.req_f64("hbm_tbps", RULE)?,
        },
        gpus_per_node,
        nodes,
        nvlink_gbps: g.req_f64("nvlink_gbps", RULE)?,
        nic_gbps: g.req_f64("nic_gbps", RULE)?,
        nic_latency_us: g.f64("nic_latency_us")?.unwrap_or(5.0),
        nvlink_latency_us: g.f64("nvlink_latency_us")?.unwrap_or(1.0),
        gpu_speed_cv: g
            .f64("gpu_speed_cv")?
            .unwrap_or(prism_core::straggler::DEFAULT_GPU_SPEED_CV),
        topology: Topology {
            rail_group_nodes: g.u32("rail_group_nodes")?.unwrap_or(32),
            oversubscription: g.f64("oversubscription")?.unwrap_or(1.0),
            pod_nodes: g.u32("pod_nodes")?.unwrap_or(0),
            pod_oversubscription: g.f64("pod_oversubscription")?.unwrap_or(1.0),
            ecmp_flows: g.u32("ecmp_flows")?.unwrap_or(0),
            wan: Default::default(),
        },
    };
    Ok((cluster, fields))
}

fn build_training(
    ctx: &Ctx<'_>,
    fields: &BTreeMap<&'static str, Entry>,
) -> Result<Training, JobFileError> {
    let g = Getter {
        ctx,
        section: "training",
        fields,
    };
    let global_batch = g.req_u32("global_batch", "sequences per iteration")?;
    let precision = g
        .choice("precision", &Precision::NAMES)?
        .unwrap_or(Precision::Bf16);
    let names: Vec<(&'static str, Stack)> = Stack::ALL.iter().map(|s| (s.name(), *s)).collect();
    let stack = g.choice("stack", &names)?.unwrap_or_default();
    let flash_attention = g
        .bool("flash_attention")?
        .unwrap_or(stack.defaults().flash_attention);
    // A BF16 model without master weights keeps its Adam moments like its parameters.
    let master_weights = g.bool("master_weights")?.unwrap_or(true);
    let memory_saving = MemorySaving {
        recompute_norm_upproj: g.bool("recompute_norm_upproj")?.unwrap_or(false),
        activation_cache: g
            .choice(
                "activation_cache",
                &[
                    ("bf16", ActivationCache::Bf16),
                    ("fp8", ActivationCache::Fp8),
                ],
            )?
            .unwrap_or_default(),
        optimizer_state: g
            .choice(
                "optimizer_state_dtype",
                &[
                    ("fp32", OptimizerStateDtype::Fp32),
                    ("bf16", OptimizerStateDtype::Bf16),
                ],
            )?
            .unwrap_or(if master_weights {
                OptimizerStateDtype::Fp32
            } else {
                OptimizerStateDtype::Bf16
            }),
    };
    if memory_saving.activation_cache == ActivationCache::Fp8 && precision != Precision::Fp8 {
        let e = g.entry("activation_cache").expect("set to fp8 above");
        return Err(ctx.at_value(
            &e.src,
            "training.activation_cache",
            "\"fp8\" caches the FP8 inputs of FP8 GEMMs; it needs training.precision = \"fp8\""
                .to_string(),
        ));
    }
    let fp8_recipe = g
        .choice("fp8_recipe", &prism_core::job::Fp8Recipe::NAMES)?
        .unwrap_or_default();
    let fp8_weight_cache = g
        .bool("fp8_weight_cache")?
        .unwrap_or(stack.defaults().fp8_weight_cache);
    let attention_backend = g
        .choice(
            "attention_backend",
            &prism_core::job::AttentionBackend::NAMES,
        )?
        .unwrap_or_default();
    let cross_entropy_fusion = g
        .choice(
            "cross_entropy_fusion",
            &prism_core::job::CrossEntropyFusion::NAMES,
        )?
        .unwrap_or_default();
    if cross_entropy_fusion != prism_core::job::CrossEntropyFusion::None
        && stack != prism_core::job::Stack::MegatronCore
    {
        let e = g.entry("cross_entropy_fusion").expect("set above");
        return Err(ctx.at_value(
            &e.src,
            "training.cross_entropy_fusion",
            format!(
                "the fused cross-entropy kernels are Megatron-Core's; training.stack = \"{}\" has only its own loss (\"none\")",
                stack.name()
            ),
        ));
    }
    let master_weight_remainders = g.bool("master_weight_remainders")?.unwrap_or(false);
    Ok(Training {
        global_batch,
        precision,
        flash_attention,
        stack,
        memory_saving,
        fp8_recipe,
        attention_backend,
        cross_entropy_fusion,
        fp8_weight_cache,
        master_weights,
        master_weight_remainders,
    })
}

fn build_parallel(
    ctx: &Ctx<'_>,
    fields: &BTreeMap<&'static str, Entry>,
    model: &Model,
    cluster: &Cluster,
    training: &Training,
    sources: &mut Sources,
) -> Result<Parallel, JobFileError> {
    let stack = training.stack;
    let sd = stack.defaults_for(training.precision);
    let g = Getter {
        ctx,
        section: "parallel",
        fields,
    };
    let gpus = cluster.num_gpus();
    let tp = g.req_u32("tp", "the tensor-parallel size")?;
    let pp = g.req_u32("pp", "the pipeline-parallel size")?;
    let cp = g.u32("cp")?.unwrap_or(1);
    let ep = g.u32("ep")?.unwrap_or(1);
    let pipeline_layout = match g.str("pipeline_layout")? {
        None => None,
        Some(text) => {
            let e = g.entry("pipeline_layout").expect("str() returned Some");
            Some(
                PipelineLayout::parse(text)
                    .map_err(|rule| ctx.at_value(&e.src, "parallel.pipeline_layout", rule))?,
            )
        }
    };
    let per_chunk_key = "num_layers_per_virtual_pipeline_stage";
    let per_chunk = match g.u32(per_chunk_key)? {
        None => None,
        Some(n) => {
            let fail = |rule: String| g.error_at(per_chunk_key, rule);
            if g.entry("vpp").is_some() {
                return Err(fail(
                    "cannot be combined with parallel.vpp (Megatron's \
                     --num-virtual-stages-per-pipeline-rank): give one of them"
                        .into(),
                ));
            }
            if pipeline_layout.is_some() {
                return Err(fail(
                    "cannot be combined with parallel.pipeline_layout (the layout already sets \
                     the virtual stages)"
                        .into(),
                ));
            }
            let layers = u64::from(model.layers);
            let (pp64, n64) = (u64::from(pp), u64::from(n));
            if n == 0
                || pp == 0
                || !layers.is_multiple_of(pp64)
                || !(layers / pp64).is_multiple_of(n64)
            {
                return Err(fail(format!(
                    "must divide the layers per pipeline rank: model.layers / pp = {layers} / {pp} \
                     must be a whole multiple of {n} (Megatron derives vpp = layers / pp / {n})"
                )));
            }
            let v = (layers / pp64 / n64).min(u64::from(u32::MAX)) as u32;
            sources.insert(
                "parallel.vpp".into(),
                Src::Derived(format!(
                    "vpp = layers / pp / {per_chunk_key} = {layers} / {pp} / {n} = {v}"
                )),
            );
            Some(v)
        }
    };
    let (pipeline_layout, split_vpp) = match torchtitan_split(&g, sources, stack, model, pp)? {
        Some((layout, vpp)) => (Some(layout), vpp),
        None => (pipeline_layout, None),
    };
    let vpp = match (g.u32("vpp")?.or(per_chunk).or(split_vpp), &pipeline_layout) {
        (Some(v), _) => v,
        (None, Some(l)) if pp > 0 && (l.stages.len() as u64).is_multiple_of(u64::from(pp)) => {
            let v = (l.stages.len() as u64 / u64::from(pp)).min(u64::from(u32::MAX)) as u32;
            sources.insert(
                "parallel.vpp".into(),
                Src::Derived(format!(
                    "vpp = layout stages / pp = {} / {pp} = {v}",
                    l.stages.len()
                )),
            );
            v
        }
        (None, _) => 1,
    };
    let pipeline_layout = accounted_split(&g, sources, pipeline_layout, model, pp, vpp)?;
    let micro_batch = g.u32("micro_batch")?.unwrap_or(1);
    let given_dp = g.u32("dp")?;

    // No parallel size can exceed the GPU count; checking it here also keeps every product
    // below inside u64 (and Job::validate's u32 arithmetic from overflowing).
    let why = "no parallel dimension can exceed the GPU count";
    for (k, v) in [
        ("tp", tp),
        ("pp", pp),
        ("cp", cp),
        ("ep", ep),
        ("dp", given_dp.unwrap_or(1)),
    ] {
        g.bound(k, v.into(), gpus, why)?;
    }
    let dp = match given_dp {
        Some(dp) => dp,
        None => {
            let mp = u64::from(tp) * u64::from(pp) * u64::from(cp);
            if mp == 0 {
                0 // Job::validate reports the zero size.
            } else if !gpus.is_multiple_of(mp) {
                return Err(ctx.error(
                    Some("parallel.dp"),
                    format!(
                        "not given, and cannot be derived: the GPU count {gpus} is not divisible by \
                         tp x pp x cp = {tp} x {pp} x {cp} = {mp}"
                    ),
                ));
            } else {
                let dp = (gpus / mp) as u32;
                sources.insert(
                    "parallel.dp".into(),
                    Src::Derived(format!("dp = GPUs / (tp x pp x cp) = {gpus} / {mp} = {dp}")),
                );
                dp
            }
        }
    };
    // The running product of tp, pp, cp, dp stays within the GPU count.
    let mut product = 1u64;
    for (k, v) in [("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp)] {
        product *= u64::from(v);
        if product > gpus {
            return Err(g.error_at(
                k,
                format!(
                    "tp x pp x cp x dp grows past the GPU count {gpus} (product {product} at \
                     `{k}`)"
                ),
            ));
        }
    }
    // Every (virtual) pipeline stage needs a layer: keeps pp x vpp (u32 in validate) in range.
    if pipeline_layout.is_none()
        && (1..=MAX_LAYERS).contains(&model.layers)
        && u64::from(pp) * u64::from(vpp) > u64::from(model.layers)
    {
        let k = if vpp > 1 { "vpp" } else { "pp" };
        g.bound(
            k,
            u64::from(pp) * u64::from(vpp),
            model.layers.into(),
            "pp x vpp: every virtual pipeline stage needs at least one of the model's layers",
        )?;
    }
    let first = g.u32("first_stage_layers")?;
    let last = g.u32("last_stage_layers")?;
    if (1..=MAX_LAYERS).contains(&model.layers) {
        for (k, v) in [("first_stage_layers", first), ("last_stage_layers", last)] {
            if let Some(v) = v {
                g.bound(
                    k,
                    v.into(),
                    model.layers.into(),
                    "cannot exceed model.layers",
                )?;
            }
        }
    }
    let sequence_parallel = match g.bool("sequence_parallel")? {
        Some(b) => b,
        None => {
            sources.insert("parallel.sequence_parallel".into(), Src::Default);
            sd.sequence_parallel && tp > 1
        }
    };
    let recompute = g
        .choice("recompute", &Recompute::NAMES)?
        .unwrap_or(Recompute::None);
    let dist_given = g.bool("distributed_optimizer")?;
    let zero_stage = match g.u32("zero_stage")? {
        Some(z) if z > 3 => {
            return Err(g.ctx.error(
                Some("parallel.zero_stage"),
                format!("must be 0, 1, 2 or 3 (got {z})"),
            ));
        }
        Some(z) => z as u8,
        None => match dist_given {
            Some(false) => 0,
            Some(true) => sd.zero_stage.max(1),
            None => sd.zero_stage,
        },
    };
    let distributed_optimizer = dist_given.unwrap_or(zero_stage >= 1);
    let given_schedule = g.choice(
        "schedule",
        &[
            ("1f1b", Schedule::OneFOneB),
            ("interleaved", Schedule::Interleaved),
            ("gpipe", Schedule::GPipe),
            ("dualpipe", Schedule::DualPipe),
            ("1f1b-overlap", Schedule::OneFOneBOverlap),
        ],
    )?;
    // Megatron-Core's flag for the combined 1F1B, accepted as written.
    let ep_overlap = g.bool("overlap_moe_expert_parallel_comm")?;
    let schedule = match (given_schedule, ep_overlap) {
        (Some(s), Some(true)) if s != Schedule::OneFOneBOverlap => {
            return Err(g.ctx.error(
                Some("parallel.overlap_moe_expert_parallel_comm"),
                "true means schedule = \"1f1b-overlap\", which contradicts parallel.schedule \
                 (give one of the two)",
            ));
        }
        (Some(Schedule::OneFOneBOverlap), Some(false)) => {
            return Err(g.ctx.error(
                Some("parallel.overlap_moe_expert_parallel_comm"),
                "false contradicts parallel.schedule = \"1f1b-overlap\" (give one of the two)",
            ));
        }
        (Some(s), _) => s,
        (None, Some(true)) => Schedule::OneFOneBOverlap,
        (None, _) => {
            sources.insert(
                "parallel.schedule".into(),
                Src::Derived(
                    "schedule defaults to \"interleaved\" when vpp > 1, else \"1f1b\"".into(),
                ),
            );
            if vpp > 1 {
                Schedule::Interleaved
            } else {
                Schedule::OneFOneB
            }
        }
    };
    let dp_bucket_mparams = g
        .f64("dp_bucket_mparams")?
        .unwrap_or(stack.dp_bucket_mparams(dp));
    let dp_buckets_every_stage = g
        .bool("dp_buckets_every_stage")?
        .unwrap_or(sd.dp_buckets_every_stage);
    let overlap_grad_reduce = g
        .bool("overlap_grad_reduce")?
        .unwrap_or(sd.overlap_grad_reduce);
    let overlap_param_gather = g
        .bool("overlap_param_gather")?
        .unwrap_or(sd.overlap_param_gather);
    let tp_comm_overlap = g.bool("tp_comm_overlap")?.unwrap_or(false);
    let comm_sms = g.u32("comm_sms")?.unwrap_or(0);
    g.bound(
        "comm_sms",
        comm_sms.into(),
        64,
        "the rest of the GPU computes",
    )?;
    let deallocate_stage_input = g.bool("deallocate_stage_input")?.unwrap_or(false);
    // NeMo's configs give Megatron's `batch_p2p_comm` beside `overlap_p2p_comm`: batched
    // exchanges are the blocking ones, and Megatron refuses both at once.
    let overlap_p2p = match (g.bool("overlap_p2p_comm")?, g.bool("batch_p2p_comm")?) {
        (Some(true), Some(true)) => {
            return Err(g.ctx.error(
                Some("parallel.batch_p2p_comm"),
                "batched (blocking) pipeline exchanges cannot be combined with \
                 parallel.overlap_p2p_comm = true (Megatron: \"Can not use both \
                 overlap_p2p_comm and batch_p2p_comm\")",
            ));
        }
        (None, Some(true)) => Some(false),
        (o, _) => o,
    };
    let pipeline_p2p = match (overlap_p2p, g.bool("overlap_p2p_comm_warmup_flush")?) {
        (Some(false), Some(true)) => {
            return Err(g.ctx.error(
                Some("parallel.overlap_p2p_comm_warmup_flush"),
                "overlaps the warm-up and flush sends of an overlapped schedule; it needs \
                 parallel.overlap_p2p_comm = true (as Megatron requires)",
            ));
        }
        (Some(false), _) => PipelineP2p::Blocking,
        (None, Some(true)) if sd.pipeline_p2p == PipelineP2p::Blocking => {
            return Err(g.ctx.error(
                Some("parallel.overlap_p2p_comm_warmup_flush"),
                format!(
                    "the {} stack sends its pipeline messages blocking; set \
                     parallel.overlap_p2p_comm = true as well to overlap them",
                    stack.name()
                ),
            ));
        }
        (_, Some(true)) => PipelineP2p::Async,
        (Some(true), _) => PipelineP2p::SteadyState,
        (None, Some(false)) if sd.pipeline_p2p == PipelineP2p::Async => PipelineP2p::SteadyState,
        (None, _) => sd.pipeline_p2p,
    };
    let orders = [
        ("tp-cp-ep-dp-pp", RankOrder::TpCpEpDpPp),
        ("tp-cp-ep-pp-dp", RankOrder::TpCpEpPpDp),
        ("tp-cp-dp-pp", RankOrder::TpCpEpDpPp),
        ("tp-cp-pp-dp", RankOrder::TpCpEpPpDp),
        ("tp-dp-pp", RankOrder::TpCpEpDpPp),
        ("tp-pp-dp", RankOrder::TpCpEpPpDp),
    ];
    let order = g.choice("order", &orders)?;
    let mapping = g.bool("use_tp_pp_dp_mapping")?.map(|b| {
        if b {
            RankOrder::TpCpEpPpDp
        } else {
            RankOrder::TpCpEpDpPp
        }
    });
    let order = match (order, mapping) {
        (Some(o), Some(m)) if o != m => {
            return Err(g.ctx.error(
                Some("parallel.order"),
                format!(
                    "\"{}\" contradicts parallel.use_tp_pp_dp_mapping = {} (give one of the two)",
                    o.name(),
                    m == RankOrder::TpCpEpPpDp
                ),
            ));
        }
        (o, m) => o.or(m).unwrap_or_default(),
    };
    Ok(Parallel {
        tp,
        pp,
        cp,
        ep,
        dp,
        vpp,
        micro_batch,
        sequence_parallel,
        recompute,
        distributed_optimizer,
        schedule,
        first_stage_layers: first,
        last_stage_layers: last,
        pipeline_layout,
        deallocate_stage_input,
        dp_bucket_mparams,
        dp_buckets_every_stage,
        align_grad_reduce: g.bool("align_grad_reduce")?.unwrap_or(true),
        overlap_grad_reduce,
        overlap_param_gather,
        tp_comm_overlap,
        comm_sms,
        order,
        zero_stage,
        grad_reduce_in_bf16: g
            .bool("grad_reduce_in_bf16")?
            .unwrap_or(sd.grad_reduce_in_bf16),
        gradient_accumulation_fusion: g
            .bool("gradient_accumulation_fusion")?
            .unwrap_or(sd.gradient_accumulation_fusion),
        pp_scatter_gather: g.bool("pp_scatter_gather")?.unwrap_or(sd.pp_scatter_gather),
        reshard_after_forward: g
            .bool("reshard_after_forward")?
            .unwrap_or(stack.reshard_after_forward(pp)),
        zero3_grad_sync: g
            .choice("zero3_grad_sync", &Zero3Sync::NAMES)?
            .unwrap_or(stack.zero3_grad_sync(pp)),
        pipeline_rounds: g.u32("pipeline_rounds")?.unwrap_or(1),
        fp8_param_gather: g.bool("fp8_param_gather")?.unwrap_or(false),
        pipeline_p2p,
        moe_dispatcher: g
            .choice(
                "moe_dispatcher",
                &[
                    ("alltoall", MoeDispatcher::AllToAll),
                    ("deepep", MoeDispatcher::DeepEp),
                ],
            )?
            .unwrap_or_default(),
        cp_comm_type: g
            .choice("cp_comm_type", &CpCommType::NAMES)?
            .unwrap_or_default(),
    })
}

// ---------------------------------------------------------------------------------------------
// [wan]: datacenters and WAN links
// ---------------------------------------------------------------------------------------------

/// The elements of array `key` of `[wan]` (a single value counts as a one-element array when
/// `scalar_ok`).
fn wan_list<'e>(
    g: &'e Getter<'_>,
    key: &str,
    scalar_ok: bool,
) -> Result<Option<Vec<(&'e Val, &'e Src)>>, JobFileError> {
    let Some(e) = g.entry(key) else {
        return Ok(None);
    };
    match &e.val {
        Val::Array(items) => Ok(Some(items.iter().map(|(v, s)| (v, s)).collect())),
        v if scalar_ok && !matches!(v, Val::Table(_)) => Ok(Some(vec![(v, &e.src)])),
        _ => Err(g.type_error(key, e, Ty::List)),
    }
}

/// A per-link number of `[wan]`: one for all `n` links or one per link; `default` when absent.
fn wan_link_numbers(
    g: &Getter<'_>,
    key: &str,
    n: usize,
    default: Option<f64>,
) -> Result<Vec<f64>, JobFileError> {
    let dotted = g.dotted(key);
    let Some(items) = wan_list(g, key, true)? else {
        return match default {
            _ if n == 0 => Ok(Vec::new()),
            Some(d) => Ok(vec![d; n]),
            None => Err(g.missing(key, "give one number for every WAN link or one per link")),
        };
    };
    let mut out = Vec::with_capacity(items.len());
    for (v, src) in &items {
        let x = match v {
            Val::Float(x) => *x,
            Val::Int(i) => *i as f64,
            other => {
                return Err(g.ctx.at_value(
                    src,
                    &dotted,
                    format!("expected a number, found {}", other.kind()),
                ));
            }
        };
        if !x.is_finite() || x < 0.0 {
            return Err(g.ctx.at_value(
                src,
                &dotted,
                format!("must be a non-negative finite number (got {x})"),
            ));
        }
        out.push(x);
    }
    match (out.len(), g.entry(key).map(|e| &e.val)) {
        (_, Some(Val::Array(_))) if out.len() == n => Ok(out),
        (1, Some(v)) if !matches!(v, Val::Array(_)) => Ok(vec![out[0]; n]),
        (len, _) => Err(g.ctx.at_value(
            &g.entry(key).expect("present").src,
            &dotted,
            format!("has {len} entries for {n} links in wan.links (give one per link, or one number for all)"),
        )),
    }
}

fn build_wan(
    ctx: &Ctx<'_>,
    fields: &BTreeMap<&'static str, Entry>,
) -> Result<prism_core::wan::Wan, JobFileError> {
    use prism_core::wan::{Datacenter, Wan, WanLink, WanSharing};
    let g = Getter {
        ctx,
        section: "wan",
        fields,
    };
    let strings = |key: &str| -> Result<Vec<(String, Src)>, JobFileError> {
        let Some(items) = wan_list(&g, key, false)? else {
            return Ok(Vec::new());
        };
        items
            .into_iter()
            .map(|(v, src)| match v {
                Val::Str(s) => Ok((s.trim().to_string(), src.clone())),
                other => Err(ctx.at_value(
                    src,
                    &format!("wan.{key}"),
                    format!("expected a string, found {}", other.kind()),
                )),
            })
            .collect()
    };
    let names = strings("datacenters")?;
    let nodes = match wan_list(&g, "datacenter_nodes", false)? {
        None if names.is_empty() => Vec::new(),
        None => {
            return Err(g.missing(
                "datacenter_nodes",
                "give the nodes of each datacenter, in the order of wan.datacenters",
            ));
        }
        Some(items) => {
            let mut out = Vec::new();
            for (v, src) in items {
                match v {
                    Val::Int(i) if (1..=u32::MAX as i128).contains(i) => out.push(*i as u32),
                    other => {
                        return Err(ctx.at_value(
                            src,
                            "wan.datacenter_nodes",
                            format!("expected a positive integer, found {}", fmt_val(other)),
                        ));
                    }
                }
            }
            out
        }
    };
    if nodes.len() != names.len() {
        let e = g
            .entry("datacenter_nodes")
            .or(g.entry("datacenters"))
            .expect("one is present");
        return Err(ctx.at_value(
            &e.src,
            "wan.datacenter_nodes",
            format!(
                "has {} entries for {} datacenters in wan.datacenters (give one node count per datacenter)",
                nodes.len(),
                names.len()
            ),
        ));
    }
    let datacenters: Vec<Datacenter> = names
        .iter()
        .zip(&nodes)
        .map(|((name, _), &n)| Datacenter {
            name: name.clone(),
            nodes: n,
        })
        .collect();
    let pairs = strings("links")?;
    let mut ends = Vec::new();
    for (text, src) in &pairs {
        let dc = |name: &str| -> Result<u32, JobFileError> {
            let name = name.trim();
            names
                .iter()
                .position(|(n, _)| n == name)
                .map(|i| i as u32)
                .ok_or_else(|| {
                    let all: Vec<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
                    ctx.at_value(
                        src,
                        "wan.links",
                        format!(
                            "unknown datacenter `{name}` in link \"{text}\" (wan.datacenters: {})",
                            all.join(", ")
                        ),
                    )
                })
        };
        let Some((a, b)) = text.split_once(':') else {
            return Err(ctx.at_value(
                src,
                "wan.links",
                format!("a link is \"A:B\" (two datacenter names), got \"{text}\""),
            ));
        };
        ends.push((dc(a)?, dc(b)?));
    }
    let n = ends.len();
    let gbps = wan_link_numbers(&g, "link_gbps", n, None)?;
    let rtt = wan_link_numbers(&g, "link_rtt_ms", n, None)?;
    let window = wan_link_numbers(&g, "tcp_window_mib", n, Some(16.0))?;
    let conns = wan_link_numbers(&g, "connections", n, Some(1.0))?;
    let links = (0..n)
        .map(|i| WanLink {
            a: ends[i].0,
            b: ends[i].1,
            gbps: gbps[i],
            rtt_ms: rtt[i],
            tcp_window_mib: window[i],
            connections: conns[i].round() as u32,
        })
        .collect();
    let sharing = g
        .choice(
            "sharing",
            &[
                ("fair", WanSharing::Fair),
                ("temporal", WanSharing::Temporal),
            ],
        )?
        .unwrap_or_default();
    Ok(Wan {
        datacenters,
        links,
        sharing,
    })
}

/// torchtitan's pipeline split (`pipeline_parallel_layers_per_stage`,
/// `pipeline_parallel_first_stage_less_layers`, `pipeline_parallel_last_stage_less_layers`;
/// `prism_core::pipeline_layout::torchtitan_stage_layers`), written as the equivalent pipeline
/// layout. It applies when one of the three keys is given, and by default to a
/// `training.stack = "torchtitan"` job with `pp > 1` that places its layers no other way.
/// With `layers_per_stage`, the virtual stages are `ceil((layers + first + last) /
/// layers_per_stage)`, which must be a multiple of `pp`, and give `vpp`; without it, `pp x
/// vpp`. Returns the layout and the `vpp` it derived, or `None` when the split does not apply.
fn torchtitan_split(
    g: &Getter<'_>,
    sources: &mut Sources,
    stack: Stack,
    model: &Model,
    pp: u32,
) -> Result<Option<(PipelineLayout, Option<u32>)>, JobFileError> {
    let keys = [
        "layers_per_stage",
        "first_stage_less_layers",
        "last_stage_less_layers",
    ];
    let per_stage = g.u32(keys[0])?;
    let first_w = g.u32(keys[1])?;
    let last_w = g.u32(keys[2])?;
    let others = [
        "pipeline_layout",
        "num_layers_per_virtual_pipeline_stage",
        "first_stage_layers",
        "last_stage_layers",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
    ];
    let given = keys.iter().find(|k| g.entry(k).is_some()).copied();
    let Some(key) = given else {
        let placed = others.iter().any(|k| g.entry(k).is_some());
        let dualpipe = g.str("schedule")? == Some("dualpipe");
        if stack != Stack::TorchTitan || pp < 2 || placed || dualpipe {
            return Ok(None);
        }
        let key = if g.entry("vpp").is_some() {
            "vpp"
        } else {
            "pp"
        };
        return split_as_torchtitan(g, sources, model, pp, None, (1, 1), (key, true));
    };
    let fail = |rule: String| g.error_at(key, rule);
    if let Some(other) = others.iter().find(|k| g.entry(k).is_some()) {
        return Err(fail(format!(
            "cannot be combined with parallel.{other}: torchtitan's split and that key both \
             place the layers (give one of them)"
        )));
    }
    if pp < 2 {
        return Err(fail(format!(
            "needs pp >= 2 (got {pp}): torchtitan splits the model only across pipeline ranks"
        )));
    }
    split_as_torchtitan(
        g,
        sources,
        model,
        pp,
        per_stage,
        (first_w.unwrap_or(1), last_w.unwrap_or(1)),
        (key, false),
    )
}

/// The body of [`torchtitan_split`] once it applies: `key` is the `parallel` key its errors
/// name, `by_stack` true when the split applies as the torchtitan stack's default.
fn split_as_torchtitan(
    g: &Getter<'_>,
    sources: &mut Sources,
    model: &Model,
    pp: u32,
    per_stage: Option<u32>,
    (first_w, last_w): (u32, u32),
    (key, by_stack): (&str, bool),
) -> Result<Option<(PipelineLayout, Option<u32>)>, JobFileError> {
    if !(1..=MAX_LAYERS).contains(&model.layers) {
        // Job::validate names the bad layer count.
        return Ok(None);
    }
    let fail = |rule: String| g.error_at(key, rule);
    let given_vpp = g.u32("vpp")?;
    let effective = u64::from(model.layers) + u64::from(first_w) + u64::from(last_w);
    let (stages, derived_vpp) = match per_stage {
        Some(0) => return Err(fail("must be at least 1".into())),
        Some(n) => {
            let stages = effective.div_ceil(u64::from(n));
            if !stages.is_multiple_of(u64::from(pp)) {
                return Err(fail(format!(
                    "gives ceil((layers {} + first-stage weight {first_w} + last-stage weight \
                     {last_w}) / {n}) = {stages} virtual stages, which is not a multiple of pp \
                     = {pp} (torchtitan refuses it too)",
                    model.layers
                )));
            }
            let vpp = (stages / u64::from(pp)).min(u64::from(u32::MAX)) as u32;
            if let Some(v) = given_vpp.filter(|&v| v != vpp) {
                return Err(g.error_at(
                    "vpp",
                    format!(
                        "must equal the {stages} virtual stages of parallel.{key} over pp = \
                         {pp}, i.e. {vpp} (got {v}; or leave vpp out)"
                    ),
                ));
            }
            sources.insert(
                "parallel.vpp".into(),
                Src::Derived(format!(
                    "vpp = ceil((layers + first + last) / layers_per_stage) / pp = ceil({effective} \
                     / {n}) / {pp} = {vpp}"
                )),
            );
            (stages, Some(vpp))
        }
        None => (u64::from(pp) * u64::from(given_vpp.unwrap_or(1)), None),
    };
    let stages = u32::try_from(stages)
        .map_err(|_| fail(format!("gives {stages} virtual stages, too many")))?;
    let layers =
        prism_core::pipeline_layout::torchtitan_stage_layers(stages, model.layers, first_w, last_w)
            .map_err(|rule| {
                let stack = if by_stack {
                    " (training.stack = \"torchtitan\" splits the layers as torchtitan does)"
                } else {
                    ""
                };
                fail(format!("torchtitan's split: {rule}{stack}"))
            })?;
    let parsed = PipelineLayout::from_stage_layers(&layers);
    sources.insert(
        "parallel.pipeline_layout".into(),
        Src::Derived(format!(
            "torchtitan's split (from parallel.{key}): {} layers with the embedding counted as {first_w} \
             and the head as {last_w} over {stages} virtual stages = \"{}\"",
            model.layers, parsed.text
        )),
    );
    Ok(Some((parsed, derived_vpp)))
}

/// Megatron-Core's `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split`: the embedding (the loss) counts as one more layer when
/// the layers are split over the `pp x vpp` virtual stages, and the first (last) virtual stage
/// builds one decoder layer fewer (transformer_block.py, `get_num_layers_to_build`). Prism
/// writes the split as the equivalent pipeline layout (shown as the job's layout), so every
/// layout rule and closed form applies; `layers + e + l` must divide by `pp x vpp`, as Megatron
/// asserts. Returns `layout` unchanged when neither key is set.
fn accounted_split(
    g: &Getter<'_>,
    sources: &mut Sources,
    layout: Option<PipelineLayout>,
    model: &Model,
    pp: u32,
    vpp: u32,
) -> Result<Option<PipelineLayout>, JobFileError> {
    let emb_key = "account_for_embedding_in_pipeline_split";
    let loss_key = "account_for_loss_in_pipeline_split";
    let e = g.bool(emb_key)?.unwrap_or(false);
    let l = g.bool(loss_key)?.unwrap_or(false);
    if !(e || l) {
        return Ok(layout);
    }
    let key = if e { emb_key } else { loss_key };
    let dotted = format!("parallel.{key}");
    let fail = |rule: String| g.error_at(key, rule);
    if layout.is_some() {
        return Err(fail(
            "cannot be combined with parallel.pipeline_layout (the layout already places the \
             embedding and the loss; Megatron-Core refuses the combination too)"
                .into(),
        ));
    }
    for other in ["first_stage_layers", "last_stage_layers"] {
        if g.entry(other).is_some() {
            return Err(fail(format!(
                "cannot be combined with parallel.{other} (Megatron-Core refuses uneven first/last \
                 stages with the embedding or loss counted in the split)"
            )));
        }
    }
    if !(1..=MAX_LAYERS).contains(&model.layers) || pp == 0 || vpp == 0 {
        // Job::validate names the bad size.
        return Ok(None);
    }
    let stages = u64::from(pp) * u64::from(vpp);
    let n = u64::from(model.layers) + u64::from(e) + u64::from(l);
    if !n.is_multiple_of(stages) {
        return Err(fail(format!(
            "model.layers{}{} = {n} must be divisible by pp x vpp = {pp} x {vpp} = {stages} \
             (Megatron-Core counts the embedding and the loss as layers of the split)",
            if e { " + 1 (embedding)" } else { "" },
            if l { " + 1 (loss)" } else { "" },
        )));
    }
    let k = n / stages;
    // n <= MAX_LAYERS + 2 and stages divides it: both fit u32.
    let layers: Vec<u32> = if stages == 1 {
        vec![model.layers]
    } else {
        (0..stages)
            .map(|s| {
                let fewer = if s == 0 {
                    u64::from(e)
                } else if s + 1 == stages {
                    u64::from(l)
                } else {
                    0
                };
                (k - fewer) as u32
            })
            .collect()
    };
    let parsed = PipelineLayout::from_stage_layers(&layers);
    let text = &parsed.text;
    sources.insert(
        "parallel.pipeline_layout".into(),
        Src::Derived(format!(
            "from {dotted}: {n} layers (embedding and loss counted) over {stages} virtual stages, \
             {k} each, one fewer decoder layer where the embedding or loss sits = \"{text}\""
        )),
    );
    Ok(Some(parsed))
}
