//! NeMo training configs (YAML) -> Prism job files (`prism import nemo`).
//!
//! Reads the Hydra/OmegaConf training config of NeMo 1.x's Megatron GPT models as NeMo
//! Framework Launcher ships it (`launcher_scripts/conf/training/<family>/<model>.yaml`) and as
//! NeMo's own `megatron_gpt_config.yaml` lays it out: a `trainer:` section (nodes, GPUs per
//! node, precision) and a `model:` section (architecture, parallel layout, batch, recompute,
//! Transformer Engine switches, `optim:`, `tokenizer:`). A file that holds the whole launcher
//! config (the training config under `training:`) is read from that section.
//!
//! The keys are NeMo's names for Megatron-Core's arguments, so each one read is translated to
//! the Megatron-LM argument it stands for and the job is written by the same code as
//! `prism import megatron` ([`crate::megatron_args`]), with NeMo's defaults where a key is
//! absent (which differ from Megatron's in places: `gradient_accumulation_fusion` and
//! `overlap_p2p_comm` are off in NeMo unless set). Every comment in the job file names the
//! config key and line it came from. OmegaConf interpolations (`${.encoder_seq_length}`,
//! `${training.model.tensor_model_parallel_size}`, `${model.encoder_seq_length}`) are resolved;
//! resolvers (`${multiply:...}`) and the launcher's own variables (`${data_dir}`) are not, and
//! a key Prism needs that holds one is an error naming it. Hydra-style overrides
//! (`model.tensor_model_parallel_size=8`) are applied before reading.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use yaml_rust2::Event;
use yaml_rust2::parser::{MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use crate::megatron_args::{ImportOptions, Imported, MegatronArgsError, Reader, Seen, build};

/// What the config does not say, and what the caller overrides.
#[derive(Clone, Debug, Default)]
pub struct NemoOptions {
    /// The machine (cluster preset, nodes, GPUs per node), the job name and a measured
    /// iteration time; `vars` and `extra_args` are not used.
    pub machine: ImportOptions,
    /// Hydra-style overrides `(key, value)`, e.g. `("model.micro_batch_size", "2")`; a
    /// launcher prefix `training.` and Hydra's `+` are accepted.
    pub overrides: Vec<(String, String)>,
    /// The tokenizer's vocabulary before padding, when the config cannot say (a SentencePiece
    /// model file).
    pub vocab_size: Option<u32>,
}

/// One scalar of the YAML document.
#[derive(Clone, Debug)]
struct Scalar {
    /// `None`: YAML null (`null`, `~`, empty).
    value: Option<String>,
    /// 1-based line; 0 for an override.
    line: usize,
}

/// The document flattened to dotted paths (`model.optim.name`); sequence items are numbered.
#[derive(Debug, Default)]
struct Doc {
    scalars: BTreeMap<String, Scalar>,
    maps: BTreeSet<String>,
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, index: usize },
}

/// Builds a [`Doc`] from the parser's events.
struct Flatten {
    doc: Doc,
    stack: Vec<Frame>,
    /// Events after the first document are ignored.
    done: bool,
    /// A key given twice: (path, first line, second line).
    duplicate: Option<(String, usize, usize)>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

impl Flatten {
    /// The path of the next value in the innermost collection.
    fn child(&mut self) -> String {
        match self.stack.last_mut() {
            Some(Frame::Map { path, key }) => join(path, &key.take().unwrap_or_default()),
            Some(Frame::Seq { path, index }) => {
                *index += 1;
                join(path, &(*index - 1).to_string())
            }
            None => String::new(),
        }
    }

    fn expects_key(&self) -> bool {
        matches!(self.stack.last(), Some(Frame::Map { key: None, .. }))
    }
}

impl MarkedEventReceiver for Flatten {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        if self.done {
            return;
        }
        match ev {
            Event::MappingStart(..) => {
                let path = self.child();
                self.doc.maps.insert(path.clone());
                self.stack.push(Frame::Map { path, key: None });
            }
            Event::SequenceStart(..) => {
                let path = self.child();
                self.stack.push(Frame::Seq { path, index: 0 });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::Scalar(v, ..) if self.expects_key() => {
                if let Some(Frame::Map { key, .. }) = self.stack.last_mut() {
                    *key = Some(v);
                }
            }
            Event::Scalar(v, style, ..) => {
                let path = self.child();
                let null = style == TScalarStyle::Plain
                    && matches!(v.as_str(), "" | "~" | "null" | "Null" | "NULL");
                let scalar = Scalar {
                    value: (!null).then_some(v),
                    line: mark.line(),
                };
                if let Some(old) = self.doc.scalars.insert(path.clone(), scalar)
                    && self.duplicate.is_none()
                {
                    self.duplicate = Some((path, old.line, mark.line()));
                }
            }
            Event::Alias(_) => {
                // Anchors are not expanded: the value reads as unresolved.
                let path = self.child();
                self.doc.scalars.insert(
                    path,
                    Scalar {
                        value: Some("*alias".into()),
                        line: mark.line(),
                    },
                );
            }
            Event::DocumentEnd => self.done = true,
            _ => {}
        }
    }
}

/// A value read for a key: resolved text (`None`: null) and its line.
struct Got {
    value: Option<String>,
    line: usize,
}

/// The config, read under its training section.
struct Config<'a> {
    doc: Doc,
    /// `training.` when the file is a whole launcher config, else empty.
    prefix: &'static str,
    origin: &'a str,
    /// Every key looked up, set or not: the other `model.*` / `trainer.*` keys are listed in
    /// the job file as not used.
    read: RefCell<BTreeSet<String>>,
}

impl Config<'_> {
    fn err(&self, key: &str, line: Option<usize>, rule: impl Into<String>) -> MegatronArgsError {
        MegatronArgsError {
            origin: self.origin.to_string(),
            line: line.filter(|&l| l > 0),
            flag: key.to_string(),
            rule: rule.into(),
        }
    }

    fn has_map(&self, key: &str) -> bool {
        self.doc.maps.contains(&format!("{}{key}", self.prefix))
    }

    /// Records `key` as read without looking it up (a setting used only when another is set).
    fn mark_read(&self, key: &str) {
        self.read.borrow_mut().insert(key.to_string());
    }

    /// The value of `key` (relative to the training section), interpolations resolved.
    fn get(&self, key: &str) -> Result<Option<Got>, MegatronArgsError> {
        self.mark_read(key);
        let full = format!("{}{key}", self.prefix);
        let Some(s) = self.doc.scalars.get(&full) else {
            return Ok(None);
        };
        let value = match &s.value {
            Some(v) => self.eval(v, &full, 0).map_err(|rule| {
                self.err(
                    key,
                    Some(s.line),
                    format!("{rule} (give the value with --override {key}=VALUE)"),
                )
            })?,
            None => None,
        };
        Ok(Some(Got {
            value,
            line: s.line,
        }))
    }

    /// Evaluates the value `v` of the scalar at `at`: an interpolation `${path}` (absolute,
    /// or relative with leading dots) or one of the resolvers NeMo and its launcher register
    /// (`multiply`, `divide_floor`, `divide_ceil`), nested to any depth; other text as is.
    fn eval(&self, v: &str, at: &str, depth: usize) -> Result<Option<String>, String> {
        if depth > 16 {
            return Err(format!("`{v}`: the interpolations do not end (a cycle)"));
        }
        let t = v.trim();
        let Some(inner) = t.strip_prefix("${").and_then(|r| r.strip_suffix('}')) else {
            if t.contains("${") {
                return Err(format!(
                    "`{v}` interpolates inside a string, which Prism does not evaluate"
                ));
            }
            return Ok(Some(v.to_string()));
        };
        if !balanced(inner) {
            return Err(format!(
                "`{v}` interpolates inside a string, which Prism does not evaluate"
            ));
        }
        if let Some((name, args)) = inner.split_once(':')
            && !name.contains("${")
        {
            let name = name.trim();
            if !matches!(name, "multiply" | "divide_floor" | "divide_ceil") {
                return Err(format!(
                    "`{v}` uses the resolver `{name}`, which Prism does not evaluate (it knows \
                     multiply, divide_floor and divide_ceil)"
                ));
            }
            let args = split_args(args);
            let mut nums = Vec::new();
            for a in &args {
                let val = self.eval(a, at, depth + 1)?;
                let n = val
                    .as_deref()
                    .and_then(|x| x.trim().parse::<f64>().ok())
                    .ok_or_else(|| format!("`{v}`: argument `{a}` is not a number"))?;
                nums.push(n);
            }
            let r = match (name, nums.as_slice()) {
                ("multiply", [a, b]) => a * b,
                ("divide_floor", [a, b]) if *b != 0.0 => (a / b).floor(),
                ("divide_ceil", [a, b]) if *b != 0.0 => (a / b).ceil(),
                _ => {
                    return Err(format!(
                        "`{v}`: `{name}` takes two numbers (and a divisor other than 0)"
                    ));
                }
            };
            return Ok(Some(if r.fract() == 0.0 && r.abs() < 1e15 {
                format!("{}", r as i64)
            } else {
                r.to_string()
            }));
        }
        let target = if let Some(rel) = inner.strip_prefix('.') {
            // `${.x}`: a sibling; each further dot goes one mapping up.
            let ups = rel.len() - rel.trim_start_matches('.').len();
            let mut base: Vec<&str> = at.split('.').collect();
            base.pop();
            for _ in 0..ups {
                base.pop();
            }
            join(&base.join("."), rel.trim_start_matches('.'))
        } else if self.prefix.is_empty() {
            // The launcher composes the training config under `training`.
            inner.strip_prefix("training.").unwrap_or(inner).to_string()
        } else {
            inner.to_string()
        };
        match self.doc.scalars.get(&target) {
            Some(Scalar {
                value: Some(tv), ..
            }) => self.eval(tv, &target, depth + 1),
            Some(Scalar { value: None, .. }) => Ok(None),
            None => Err(format!(
                "`{v}` refers to `{inner}`, which is not in this file"
            )),
        }
    }

    /// The value of `key` when it is set and not null.
    fn str(&self, key: &str) -> Result<Option<(String, usize)>, MegatronArgsError> {
        Ok(self
            .get(key)?
            .and_then(|g| g.value.map(|v| (v, g.line)))
            .filter(|(v, _)| !v.is_empty()))
    }

    /// A YAML boolean (`true`/`false` in any case, as OmegaConf reads them).
    fn bool(&self, key: &str) -> Result<Option<(bool, usize)>, MegatronArgsError> {
        let Some((v, line)) = self.str(key)? else {
            return Ok(None);
        };
        match v.to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" => Ok(Some((true, line))),
            "false" | "no" | "off" => Ok(Some((false, line))),
            _ => Err(self.err(key, Some(line), format!("`{v}` is not a boolean"))),
        }
    }
}

/// True when every `${` in `s` is closed inside it.
fn balanced(s: &str) -> bool {
    let mut depth = 0i32;
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' && b.get(i + 1) == Some(&b'{') {
            depth += 1;
            i += 1;
        } else if b[i] == b'}' {
            depth -= 1;
            if depth < 0 {
                return false;
            }
        }
        i += 1;
    }
    depth == 0
}

/// A resolver's arguments: split at the commas outside nested `${...}`.
fn split_args(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim());
    out
}

/// Parses `text` into a [`Doc`].
fn parse(text: &str, origin: &str) -> Result<Doc, MegatronArgsError> {
    let mut f = Flatten {
        doc: Doc::default(),
        stack: Vec::new(),
        done: false,
        duplicate: None,
    };
    Parser::new_from_str(text)
        .load(&mut f, false)
        .map_err(|e| MegatronArgsError {
            origin: origin.to_string(),
            line: Some(e.marker().line()),
            flag: "YAML".into(),
            rule: e.info().to_string(),
        })?;
    if let Some((path, first, second)) = f.duplicate {
        return Err(MegatronArgsError {
            origin: origin.to_string(),
            line: Some(second),
            flag: path,
            rule: format!("given twice (lines {first} and {second}); keep one"),
        });
    }
    Ok(f.doc)
}

/// Config keys read as the Megatron-LM argument with a value.
const VALUES: &[(&str, &str)] = &[
    ("model.num_layers", "--num-layers"),
    ("model.hidden_size", "--hidden-size"),
    ("model.ffn_hidden_size", "--ffn-hidden-size"),
    ("model.num_attention_heads", "--num-attention-heads"),
    ("model.kv_channels", "--kv-channels"),
    (
        "model.make_vocab_size_divisible_by",
        "--make-vocab-size-divisible-by",
    ),
    ("model.attention_dropout", "--attention-dropout"),
    ("model.hidden_dropout", "--hidden-dropout"),
    ("model.num_moe_experts", "--num-experts"),
    ("model.moe_router_topk", "--moe-router-topk"),
    ("model.moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    (
        "model.moe_shared_expert_intermediate_size",
        "--moe-shared-expert-intermediate-size",
    ),
    (
        "model.moe_token_dispatcher_type",
        "--moe-token-dispatcher-type",
    ),
    ("model.cp_comm_type", "--cp-comm-type"),
    (
        "model.cross_entropy_fusion_impl",
        "--cross-entropy-fusion-impl",
    ),
    (
        "model.tensor_model_parallel_size",
        "--tensor-model-parallel-size",
    ),
    (
        "model.pipeline_model_parallel_size",
        "--pipeline-model-parallel-size",
    ),
    ("model.context_parallel_size", "--context-parallel-size"),
    (
        "model.expert_model_parallel_size",
        "--expert-model-parallel-size",
    ),
    (
        "model.virtual_pipeline_model_parallel_size",
        "--virtual-pipeline-model-parallel-size",
    ),
    ("model.micro_batch_size", "--micro-batch-size"),
    ("model.global_batch_size", "--global-batch-size"),
    (
        "model.activations_checkpoint_granularity",
        "--recompute-granularity",
    ),
    ("model.activations_checkpoint_method", "--recompute-method"),
    (
        "model.activations_checkpoint_num_layers",
        "--recompute-num-layers",
    ),
    ("trainer.num_nodes", "--nnodes"),
    ("trainer.devices", "--nproc_per_node"),
];

/// Config keys whose `true` is the Megatron-LM switch.
const SWITCHES: &[(&str, &str)] = &[
    ("model.sequence_parallel", "--sequence-parallel"),
    ("model.ub_tp_comm_overlap", "--tp-comm-overlap"),
    ("model.use_tp_pp_dp_mapping", "--use-tp-pp-dp-mapping"),
    ("model.fp8_params", "--fp8-param-gather"),
    // A Megatron-Core TransformerConfig field: NeMo hands every such key of the model config
    // to Megatron-Core (`build_transformer_config`), whose default is off.
    (
        "model.cross_entropy_loss_fusion",
        "--cross-entropy-loss-fusion",
    ),
];

/// Config keys whose `false` is the Megatron-LM switch, with NeMo's default.
const NEGATED: &[(&str, &str, bool)] = &[
    (
        "model.share_embeddings_and_output_weights",
        "--untie-embeddings-and-output-weights",
        true,
    ),
    // NeMo passes its own defaults (off) to Megatron-Core for these two.
    (
        "model.gradient_accumulation_fusion",
        "--no-gradient-accumulation-fusion",
        false,
    ),
    (
        "model.overlap_p2p_comm",
        "--no-overlap-p2p-communication",
        false,
    ),
];

/// Config keys that change a step's time or memory but that Prism does not read, when set to
/// something other than their inactive value.
const NOT_MODELLED: &[(&str, &str)] = &[
    (
        "model.fsdp",
        "PyTorch FSDP is not read from a NeMo config (set parallel.zero_stage = 3)",
    ),
    (
        "model.cpu_offloading",
        "activation / weight offloading to the host is not modelled",
    ),
    (
        "model.enable_cuda_graph",
        "CUDA graphs (no host launch cost) are not modelled",
    ),
    (
        "model.window_size",
        "sliding-window attention is not read (set model.attention_window)",
    ),
    (
        "model.moe_expert_capacity_factor",
        "the capacity factor is not read (set model.moe_capacity_factor)",
    ),
    (
        "model.num_micro_batches_with_partial_activation_checkpoints",
        "partial activation checkpointing is not read (recompute is none, selective or full)",
    ),
    (
        "model.activations_checkpoint_layers_per_pipeline",
        "per-stage activation checkpointing is not read (recompute is none, selective or full)",
    ),
    (
        "model.rampup_batch_size",
        "batch-size ramp-up: Prism simulates an iteration at the final global batch",
    ),
];

/// Vocabulary sizes of HuggingFace tokenizers NeMo's launcher configs name (`len(tokenizer)`,
/// which NeMo pads; from each repository's tokenizer and `config.json`).
const HF_VOCAB: &[(&str, u32)] = &[
    ("meta-llama/Meta-Llama-3", 128_256),
    ("meta-llama/Llama-3", 128_256),
    ("meta-llama/Meta-Llama-3.1", 128_256),
    ("meta-llama/Llama-3.1", 128_256),
    ("meta-llama/Llama-2", 32_000),
    ("mistralai/Mistral-7B-v0.1", 32_000),
    ("mistralai/Mixtral-8x7B", 32_000),
    ("mistral-community/Mixtral-8x22B-v0.1", 32_000),
    ("mistralai/Mistral-Nemo", 131_072),
    ("tiiuae/falcon", 65_024),
    ("THUDM/chatglm2-6b", 65_024),
    ("THUDM/chatglm3-6b", 65_024),
    ("bigcode/starcoder2-tokenizer", 49_152),
];

/// The vocabulary of a HuggingFace tokenizer NeMo's configs name: the longest prefix of
/// [`HF_VOCAB`] that `name` starts with.
fn hf_vocab(name: &str) -> Option<u32> {
    HF_VOCAB
        .iter()
        .filter(|(p, _)| name.starts_with(p))
        .max_by_key(|(p, _)| p.len())
        .map(|(_, n)| *n)
}

/// Records Megatron argument `flag` as read from the config (`from` names the key and value).
fn set(
    r: &mut Reader,
    flag: &'static str,
    value: Option<String>,
    line: usize,
    from: impl Into<String>,
) {
    r.seen.insert(
        flag,
        Seen {
            value,
            line,
            from: Some(from.into()),
        },
    );
}

/// Records Megatron argument `flag` as read from config key `key`.
fn put(r: &mut Reader, flag: &'static str, key: &str, value: Option<String>, line: usize) {
    let from = match &value {
        Some(v) if line == 0 => format!("{key}={v} (--override)"),
        Some(v) => format!("{key}: {v}"),
        None => key.to_string(),
    };
    set(r, flag, value, line, from);
}

/// Reads a NeMo training config into a Prism job file.
pub fn import_nemo(
    text: &str,
    origin: &str,
    opts: &NemoOptions,
) -> Result<Imported, MegatronArgsError> {
    let mut doc = parse(text, origin)?;
    let prefix = if doc.maps.contains("training.model") {
        "training."
    } else {
        ""
    };
    // Overrides replace (or add) scalars.
    for (key, value) in &opts.overrides {
        let key = key.trim().trim_start_matches('+');
        let key = key.strip_prefix("training.").unwrap_or(key);
        if key.is_empty() {
            return Err(MegatronArgsError {
                origin: "--override".into(),
                line: None,
                flag: "--override".into(),
                rule: "expected KEY=VALUE with a key such as model.micro_batch_size".into(),
            });
        }
        let null = matches!(value.trim(), "null" | "~" | "");
        doc.scalars.insert(
            format!("{prefix}{key}"),
            Scalar {
                value: (!null).then(|| value.trim().to_string()),
                line: 0,
            },
        );
    }
    let cfg = Config {
        doc,
        prefix,
        origin,
        read: RefCell::default(),
    };
    if !cfg.has_map("model") {
        return Err(cfg.err(
            "model",
            None,
            "no `model:` section: not a NeMo training config (expected `trainer:` and `model:`, \
             as in NeMo Framework Launcher's conf/training/*/*.yaml)",
        ));
    }
    refuse_unmodelled(&cfg)?;

    let mut r = Reader::nemo(origin);
    architecture_and_layout(&cfg, &mut r)?;
    precision_and_kernels(&cfg, &mut r)?;
    optimizer(&cfg, &mut r)?;
    vocabulary(&cfg, &mut r, opts.vocab_size)?;
    notes_and_unused(&cfg, &mut r)?;

    let mut machine = opts.machine.clone();
    if machine.name.is_none() {
        // The launcher's `run.name`, else NeMo's top-level `name`.
        machine.name = ["run.name", "name"]
            .iter()
            .filter_map(|k| cfg.str(k).ok().flatten())
            .map(|(n, _)| n)
            .find(|n| !n.contains("${"));
    }
    build(r, &machine, origin)
}

/// Refuses the architectures Prism does not model, naming the key that shows them.
fn refuse_unmodelled(cfg: &Config) -> Result<(), MegatronArgsError> {
    // Architectures Prism does not model.
    if cfg.has_map("model.encoder") || cfg.has_map("model.decoder") {
        return Err(cfg.err(
            "model.encoder",
            None,
            "an encoder-decoder model (T5): encoder-decoder models are not modelled",
        ));
    }
    let tokenizer_type = cfg.str("model.tokenizer.type")?;
    let bert = tokenizer_type
        .as_ref()
        .is_some_and(|(t, _)| t.starts_with("Bert"))
        || cfg.get("model.bert_binary_head")?.is_some()
        || cfg.get("model.num_tokentypes")?.is_some();
    if bert {
        return Err(cfg.err(
            "model",
            None,
            "an encoder-only model (BERT: bidirectional attention, token-type embeddings): only \
             decoder-only models are modelled",
        ));
    }
    for (key, what) in [
        (
            "model.mm_cfg",
            "a vision-language model (NeVA): the vision encoder and projector are not modelled \
             (import its language model's config instead)",
        ),
        (
            "model.vision_pretraining_type",
            "a vision transformer (ViT): image models are not modelled",
        ),
        (
            "model.retro",
            "a retrieval model (RETRO): chunked cross-attention to retrieved neighbours is not \
             modelled",
        ),
    ] {
        if cfg.has_map(key) || cfg.get(key)?.is_some() {
            return Err(cfg.err(key, None, what));
        }
    }
    if cfg.get("model.num_layers")?.is_none() || cfg.get("model.hidden_size")?.is_none() {
        return Err(cfg.err(
            "model.num_layers",
            None,
            "no model.num_layers / model.hidden_size: not a Megatron GPT config (vision, \
             diffusion and other NeMo models are not modelled)",
        ));
    }
    for key in ["model.hybrid_override_pattern", "model.mamba_ssm_ngroups"] {
        if let Some((_, line)) = cfg.str(key)? {
            return Err(cfg.err(
                key,
                Some(line),
                "a hybrid Mamba model: Mamba (state-space) layers are not modelled",
            ));
        }
    }
    Ok(())
}

/// The architecture, the parallel layout, the batch and the recomputation.
fn architecture_and_layout(cfg: &Config, r: &mut Reader) -> Result<(), MegatronArgsError> {
    for &(key, flag) in VALUES {
        r.names.insert(flag, key);
        if let Some((v, line)) = cfg.str(key)? {
            put(r, flag, key, Some(v), line);
        }
    }
    r.names.insert(
        "--recompute-activations",
        "model.activations_checkpoint_granularity",
    );
    // The sequence length: the model's, else the data's.
    r.names.insert("--seq-length", "model.encoder_seq_length");
    for key in [
        "model.encoder_seq_length",
        "model.seq_length",
        "model.data.seq_length",
    ] {
        if let Some((v, line)) = cfg.str(key)? {
            put(r, "--seq-length", key, Some(v), line);
            break;
        }
    }
    for &(key, flag) in SWITCHES {
        r.names.insert(flag, key);
        match cfg.bool(key)? {
            Some((true, line)) => set(r, flag, None, line, format!("{key}: true")),
            Some((false, line)) => {
                let at = if line == 0 {
                    "--override".to_string()
                } else {
                    format!("line {line}")
                };
                r.off.insert(flag, format!("{key}: false ({at})"));
            }
            None => {}
        }
    }
    for &(key, flag, default) in NEGATED {
        r.names.insert(flag, key);
        match cfg.bool(key)? {
            Some((false, line)) => {
                set(r, flag, None, line, format!("{key}: false"));
            }
            None if !default => {
                set(
                    r,
                    flag,
                    None,
                    0,
                    format!("NeMo's default (no {key}: false)"),
                );
            }
            _ => {}
        }
    }

    // Grouped-query attention.
    r.names
        .insert("--num-query-groups", "model.num_query_groups");
    if let Some((g, line)) = cfg.str("model.num_query_groups")? {
        put(
            r,
            "--group-query-attention",
            "model.num_query_groups",
            None,
            line,
        );
        put(
            r,
            "--num-query-groups",
            "model.num_query_groups",
            Some(g),
            line,
        );
    }

    // The MLP.
    r.names.insert("--swiglu", "model.activation");
    if let Some((act, line)) = cfg.str("model.activation")? {
        match act.as_str() {
            "gelu" | "fast-gelu" | "openai-gelu" | "approx-gelu" | "relu" => {
                put(r, "--activation", "model.activation", Some(act), line)
            }
            "swiglu" | "fast-swiglu" => put(r, "--swiglu", "model.activation", Some(act), line),
            "geglu" | "fast-geglu" | "reglu" | "fast-reglu" => {
                r.notes.push(format!(
                    "model.activation: {act} (line {line}) is a gated MLP with three matrices, \
                     modelled as SwiGLU (same GEMMs; the gate's elementwise function differs)"
                ));
                put(r, "--swiglu", "model.activation", Some(act), line);
            }
            "squared-relu" => put(r, "--squared-relu", "model.activation", Some(act), line),
            other => {
                return Err(cfg.err(
                    "model.activation",
                    Some(line),
                    format!(
                        "`{other}` is not a NeMo activation Prism knows (gelu, fast-gelu, \
                         openai-gelu, swiglu, fast-swiglu, geglu, reglu, squared-relu)"
                    ),
                ));
            }
        }
    }

    Ok(())
}

/// Training precision, FP8, the attention kernels and NeMo's model flavour.
fn precision_and_kernels(cfg: &Config, r: &mut Reader) -> Result<(), MegatronArgsError> {
    // Precision.
    r.names.insert("--bf16", "trainer.precision");
    r.names.insert("--fp16", "trainer.precision");
    let (precision, pline) = cfg.str("trainer.precision")?.ok_or_else(|| {
        cfg.err(
            "trainer.precision",
            None,
            "not found in the config (bf16, bf16-mixed, 16 or 16-mixed)",
        )
    })?;
    match precision.as_str() {
        "bf16" | "bf16-mixed" | "bf16-true" => {
            set(
                r,
                "--bf16",
                None,
                pline,
                format!("trainer.precision: {precision}"),
            );
        }
        "16" | "16-mixed" | "fp16" | "16-true" => {
            set(
                r,
                "--fp16",
                None,
                pline,
                format!("trainer.precision: {precision}"),
            );
        }
        other => {
            return Err(cfg.err(
                "trainer.precision",
                Some(pline),
                format!(
                    "`{other}`: FP32 training is not modelled (bf16, bf16-mixed, 16 or 16-mixed)"
                ),
            ));
        }
    }
    r.names.insert("--fp8-format", "model.fp8");
    cfg.mark_read("model.fp8_hybrid");
    if let Some((true, line)) = cfg.bool("model.fp8")? {
        let hybrid = matches!(cfg.bool("model.fp8_hybrid")?, Some((true, _)));
        let format = if hybrid { "hybrid" } else { "e4m3" };
        set(
            r,
            "--fp8-format",
            Some(format.into()),
            line,
            format!("model.fp8: true, fp8_hybrid: {hybrid}"),
        );
    }
    if let Some((false, line)) = cfg.bool("model.megatron_amp_O2")? {
        r.notes.push(format!(
            "model.megatron_amp_O2: false (line {line}): NeMo's O1 keeps FP32 parameters under \
             autocast; Prism models 16-bit weights with FP32 master copies (O2)"
        ));
    }

    // Attention kernels. The launcher exports its config's `env_vars` to the job (its own
    // conf/config.yaml set NVTE_FUSED_ATTN: 0 from 24.03 to 24.07): Transformer Engine reads
    // them as it would from a launch script.
    for name in ["NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"] {
        if let Some((v, _)) = cfg.str(&format!("env_vars.{name}"))? {
            r.vars.insert(name.to_string(), v);
        }
    }
    let te = !matches!(cfg.bool("model.transformer_engine")?, Some((false, _)));
    if let Some((false, line)) = cfg.bool("model.use_flash_attention")?
        && !te
    {
        r.names
            .insert("--attention-backend", "model.use_flash_attention");
        set(
            r,
            "--attention-backend",
            Some("unfused".into()),
            line,
            "model.use_flash_attention: false, transformer_engine: false",
        );
    }
    if let Some((false, line)) = cfg.bool("model.mcore_gpt")? {
        r.notes.push(format!(
            "model.mcore_gpt: false (line {line}): NeMo's legacy (Apex) GPT; Prism models \
             Megatron-Core's kernels and overlaps"
        ));
    }

    Ok(())
}

/// The optimizer: whether it is distributed, its overlaps and its gradient dtype.
fn optimizer(cfg: &Config, r: &mut Reader) -> Result<(), MegatronArgsError> {
    // The optimizer: NeMo's distributed optimizers and their gradient sync.
    let optim = cfg.str("model.optim.name")?;
    r.names
        .insert("--use-distributed-optimizer", "model.optim.name");
    r.names
        .insert("--overlap-grad-reduce", "model.optim.overlap_grad_sync");
    r.names
        .insert("--overlap-param-gather", "model.optim.overlap_param_sync");
    r.names
        .insert("--grad-reduce-in-bf16", "model.optim.grad_sync_dtype");
    match &optim {
        Some((name, line))
            if matches!(
                name.as_str(),
                "distributed_fused_adam" | "mcore_distributed_optim"
            ) =>
        {
            put(
                r,
                "--use-distributed-optimizer",
                "model.optim.name",
                Some(name.clone()),
                *line,
            );
            // Apex's DistributedFusedAdam overlaps the gradient sync unless told not to, and the
            // parameter sync only when asked.
            match cfg.bool("model.optim.overlap_grad_sync")? {
                Some((false, _)) => {}
                Some((true, l)) => {
                    set(
                        r,
                        "--overlap-grad-reduce",
                        None,
                        l,
                        "model.optim.overlap_grad_sync: true",
                    );
                }
                None => {
                    set(
                        r,
                        "--overlap-grad-reduce",
                        None,
                        0,
                        format!("{name}'s default (overlap_grad_sync)"),
                    );
                }
            }
            if let Some((true, l)) = cfg.bool("model.optim.overlap_param_sync")? {
                set(
                    r,
                    "--overlap-param-gather",
                    None,
                    l,
                    "model.optim.overlap_param_sync: true",
                );
            }
            if name == "distributed_fused_adam" {
                master_copy(cfg, r)?;
                r.extra_keys.push((
                    "parallel",
                    "dp_buckets_every_stage",
                    toml::Value::Boolean(true),
                    format!(
                        "model.optim.name: {name} (line {line}): Apex's DistributedFusedAdam \
                     reduces each bucket as backward fills it, on every pipeline stage"
                    ),
                ));
            }
        }
        Some((name, line)) => {
            for flag in [
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
            ] {
                r.off.insert(
                    flag,
                    format!("model.optim.name: {name} (line {line}): not a distributed optimizer"),
                );
            }
            r.notes.push(format!(
                "model.optim.name: {name} (line {line}): not a distributed optimizer; the gradient \
             all-reduce is taken as not overlapped with backward"
            ));
        }
        None => {}
    }
    // Gradients are reduced in the optimizer's sync dtype (FP32 unless said).
    if let Some((d, l)) = cfg.str("model.optim.grad_sync_dtype")? {
        match OptimDtype::parse(&d) {
            Some(OptimDtype::Fp32) => {}
            Some(_) => {
                set(
                    r,
                    "--grad-reduce-in-bf16",
                    None,
                    l,
                    format!("model.optim.grad_sync_dtype: {d}"),
                );
            }
            None => {
                return Err(cfg.err(
                    "model.optim.grad_sync_dtype",
                    Some(l),
                    format!("`{d}` is not one of bf16, fp16, fp32"),
                ));
            }
        }
    }
    // With 16-bit training and no sync dtype given, FP16 gradients stay FP16 in Megatron's
    // rule; NeMo's optimizers reduce in FP32 by default.
    if r.seen.contains_key("--fp16") && !r.seen.contains_key("--grad-reduce-in-bf16") {
        set(
            r,
            "--accumulate-allreduce-grads-in-fp32",
            None,
            0,
            "NeMo's default (no model.optim.grad_sync_dtype: FP32)",
        );
    }

    Ok(())
}

/// A dtype of NeMo's optimizer settings (`dtype`, `grad_sync_dtype`), which
/// `MegatronDistributedFusedAdam` converts with `str_to_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OptimDtype {
    Fp32,
    Bf16,
    Fp16,
}

impl OptimDtype {
    /// The spellings NeMo's configs use (and `32` / `16` as trainer precisions are written);
    /// `None` for anything else.
    fn parse(s: &str) -> Option<Self> {
        match s {
            "fp32" | "float32" | "32" | "torch.float32" => Some(OptimDtype::Fp32),
            "bf16" | "bfloat16" | "torch.bfloat16" => Some(OptimDtype::Bf16),
            "fp16" | "float16" | "16" | "half" | "torch.float16" => Some(OptimDtype::Fp16),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            OptimDtype::Fp32 => "fp32",
            OptimDtype::Bf16 => "bf16",
            OptimDtype::Fp16 => "fp16",
        }
    }
}

/// How Apex's DistributedFusedAdam keeps the master weights, as NeMo sets it up
/// (`MegatronBaseModel.setup_optimization`, the same from October 2022 to NeMo 2.0): an
/// optimizer in the model's own 16-bit type keeps no master copy; an FP32 optimizer (the
/// default) on a BF16 model under `megatron_amp_O2` keeps only the low 16 bits of each master
/// weight (`store_param_remainders`), unless the weights are FP8 (`fp8_params`: whole FP32
/// masters) or the config sets `store_params` / `store_param_remainders` itself.
fn master_copy(cfg: &Config, r: &mut Reader) -> Result<(), MegatronArgsError> {
    let optim16 = match cfg.str("model.optim.dtype")? {
        None => None,
        Some((d, l)) => match OptimDtype::parse(&d) {
            Some(OptimDtype::Fp32) => None,
            Some(t) => Some((t.name(), l)),
            None => {
                return Err(cfg.err(
                    "model.optim.dtype",
                    Some(l),
                    format!("`{d}` is not one of fp32, bf16, fp16"),
                ));
            }
        },
    };
    let o2 = matches!(cfg.bool("model.megatron_amp_O2")?, Some((true, _)));
    let model16 = if !o2 {
        None
    } else if r.seen.contains_key("--bf16") {
        Some(OptimDtype::Bf16.name())
    } else if r.seen.contains_key("--fp16") {
        Some(OptimDtype::Fp16.name())
    } else {
        None
    };
    let fp8_params = matches!(cfg.bool("model.fp8_params")?, Some((true, _)));
    let store_params = cfg.bool("model.optim.store_params")?;
    let remainders = cfg.bool("model.optim.store_param_remainders")?;
    match (optim16, model16) {
        (Some((d, line)), Some(m)) if d == m && !matches!(store_params, Some((true, _))) => {
            let why = format!(
                "model.optim.dtype: {d} (line {line}): DistributedFusedAdam in the model's own \
                 type keeps no master copy (store_params off) and its moments in {d}"
            );
            r.extra_keys.push((
                "training",
                "master_weights",
                toml::Value::Boolean(false),
                why.clone(),
            ));
            r.extra_keys.push((
                "training",
                "optimizer_state_dtype",
                toml::Value::String("bf16".into()),
                why,
            ));
            // Apex syncs gradients in the optimizer's type unless told otherwise.
            if cfg.str("model.optim.grad_sync_dtype")?.is_none() {
                set(
                    r,
                    "--grad-reduce-in-bf16",
                    None,
                    line,
                    format!(
                        "model.optim.dtype: {d}: DistributedFusedAdam's grad_sync_dtype defaults \
                         to its dtype"
                    ),
                );
            }
        }
        (Some((d, line)), _) => {
            r.notes.push(format!(
                "model.optim.dtype: {d} (line {line}): a {d} optimizer that keeps master weights \
                 (store_params, or weights of another type) is not modelled; Prism keeps FP32 \
                 master weights and moments"
            ));
        }
        (None, Some("bf16")) if !fp8_params => {
            let why = match (store_params, remainders) {
                (None, _) => Some(
                    "model.optim.name: distributed_fused_adam with megatron_amp_O2 and BF16: NeMo \
                     sets store_param_remainders (the FP32 master weights' low 16 bits)"
                        .to_string(),
                ),
                (Some((false, _)), Some((true, l))) => Some(format!(
                    "model.optim.store_param_remainders: true (line {l})"
                )),
                _ => None,
            };
            if let Some(why) = why {
                r.extra_keys.push((
                    "training",
                    "master_weight_remainders",
                    toml::Value::Boolean(true),
                    why,
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The vocabulary: the caller's, the config's override, or the named tokenizer's.
fn vocabulary(
    cfg: &Config,
    r: &mut Reader,
    vocab_size: Option<u32>,
) -> Result<(), MegatronArgsError> {
    // The vocabulary: NeMo pads the tokenizer's as Megatron does.
    cfg.mark_read("model.override_vocab_size");
    r.names.insert("--vocab-size", "model.tokenizer");
    let library = cfg.str("model.tokenizer.library")?;
    let tokenizer_type = cfg.str("model.tokenizer.type")?;
    let vocab: (u32, String, usize) = if let Some(v) = vocab_size {
        (v, format!("--vocab-size {v}"), 0)
    } else if let Some((v, line)) = cfg.str("model.override_vocab_size")? {
        let n = v.parse::<u32>().map_err(|_| {
            cfg.err(
                "model.override_vocab_size",
                Some(line),
                format!("`{v}` is not a valid number"),
            )
        })?;
        (n, format!("model.override_vocab_size: {v}"), line)
    } else {
        let lib = library.as_ref().map(|(l, _)| l.as_str()).unwrap_or("");
        let ty = tokenizer_type
            .as_ref()
            .map(|(t, _)| t.as_str())
            .unwrap_or("");
        let line = tokenizer_type
            .as_ref()
            .or(library.as_ref())
            .map(|(_, l)| *l)
            .unwrap_or(0);
        let hf = if lib == "huggingface" {
            hf_vocab(ty)
        } else {
            None
        };
        match (lib, ty, hf) {
            ("megatron", "GPT2BPETokenizer", _) => (
                50_257,
                "model.tokenizer: megatron GPT2BPETokenizer, 50,257 tokens".into(),
                line,
            ),
            (_, t, Some(n)) => (
                n,
                format!("model.tokenizer: huggingface {t}, {n} tokens"),
                line,
            ),
            _ => {
                // The tokenizer file is only named: it may hold launcher variables.
                let file = cfg
                    .doc
                    .scalars
                    .get(&format!("{}model.tokenizer.model", cfg.prefix))
                    .and_then(|s| s.value.clone());
                let what = match (lib, ty, file) {
                    (_, "", Some(m)) => format!("{lib} tokenizer model `{m}`"),
                    (_, "", None) => format!("{lib} tokenizer"),
                    (_, t, _) => format!("{lib} tokenizer `{t}`"),
                };
                return Err(cfg.err(
                    "model.tokenizer",
                    Some(line),
                    format!(
                        "the vocabulary of the {} is not in the config; pass --vocab-size N (the \
                         tokenizer's size before NeMo pads it) or set model.override_vocab_size",
                        what.trim()
                    ),
                ));
            }
        }
    };
    r.seen.insert(
        "--vocab-size",
        Seen {
            value: Some(vocab.0.to_string()),
            line: vocab.2,
            from: Some(vocab.1),
        },
    );

    Ok(())
}

/// Notes for settings Prism does not model, and the list of keys it did not read.
fn notes_and_unused(cfg: &Config, r: &mut Reader) -> Result<(), MegatronArgsError> {
    // What changes a step's time but is not read.
    for &(key, why) in NOT_MODELLED {
        let active = match cfg.get(key)? {
            Some(Got { value: Some(v), .. }) => {
                !matches!(v.to_ascii_lowercase().as_str(), "false" | "0" | "")
            }
            // A list or mapping (`rampup_batch_size: [16, 16, 1000]`).
            Some(Got { value: None, .. }) | None => {
                let inner = format!("{}{key}.", cfg.prefix);
                cfg.doc
                    .scalars
                    .range(inner.clone()..)
                    .next()
                    .is_some_and(|(k, _)| k.starts_with(&inner))
            }
        };
        if active {
            r.notes.push(format!("{key}: {why}"));
        }
    }

    // Keys of `model` and `trainer` not read (nested settings such as data, optim.sched,
    // nsys_profile and the userbuffers config are left out of the list).
    for (path, s) in &cfg.doc.scalars {
        let Some(key) = path.strip_prefix(cfg.prefix) else {
            continue;
        };
        let top = key.split('.').next().unwrap_or("");
        let depth = key.matches('.').count();
        if (top == "model" || top == "trainer")
            && depth == 1
            && !cfg.read.borrow().contains(key)
            && s.value.is_some()
        {
            r.unused.insert(key.to_string());
        }
    }

    Ok(())
}
