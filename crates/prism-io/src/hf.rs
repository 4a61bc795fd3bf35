//! HuggingFace `config.json` -> [`Model`].
//!
//! Accepts the configs of Llama, Mistral, Qwen2 (dense, gated SiLU MLP) and Mixtral (MoE) as they
//! are published; keys this module does not use are ignored (HF configs carry many). Keys read:
//!
//! | key | use |
//! |---|---|
//! | `model_type` (or `architectures[0]`) | must be `llama`, `mistral`, `qwen2` or `mixtral` |
//! | `num_hidden_layers` | layers |
//! | `hidden_size` | hidden |
//! | `intermediate_size` | ffn_hidden (and the expert size for Mixtral) |
//! | `num_attention_heads` | heads |
//! | `num_key_value_heads` | kv_heads (default: heads) |
//! | `head_dim` | head_dim (default: hidden / heads) |
//! | `vocab_size` | vocab |
//! | `max_position_embeddings` | seq_len of the model alone; a job must give its own `seq_len` (the longest context is not the training length) |
//! | `hidden_act` | `silu`, `swish`, `relu` or `gelu*`: the MLP of these model types is always gated (three matrices), so each is `swiglu` in cost |
//! | `sliding_window` (with `use_sliding_window`) | a window shorter than the job's `seq_len` is refused by name (sliding-window attention is not modelled) |
//! | `tie_word_embeddings` | tied_embeddings (default false) |
//! | `num_local_experts`, `num_experts_per_tok` | Mixtral experts and top-k |

use prism_core::job::{Activation, Model, Moe};
use serde::Deserialize;

/// `model_type` values this module accepts.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "mixtral"];

/// A `config.json` that could not be turned into a model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {path}: {rule}")]
pub struct HfConfigError {
    /// The file (or other origin) the config came from.
    pub origin: String,
    /// JSON path of the offending key, e.g. `num_hidden_layers` (`.` for the document itself).
    pub path: String,
    /// What is wrong.
    pub rule: String,
}

impl HfConfigError {
    fn new(origin: &str, path: impl Into<String>, rule: impl Into<String>) -> Self {
        HfConfigError {
            origin: origin.to_string(),
            path: path.into(),
            rule: rule.into(),
        }
    }
}

/// The subset of an HF config Prism reads. Everything is optional here so that a missing key is
/// reported by name below; types are checked by serde (with the path recorded).
#[derive(Deserialize, Debug)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    #[serde(rename = "_name_or_path")]
    name_or_path: Option<String>,
    num_hidden_layers: Option<u32>,
    hidden_size: Option<u32>,
    intermediate_size: Option<u32>,
    num_attention_heads: Option<u32>,
    num_key_value_heads: Option<u32>,
    head_dim: Option<u32>,
    vocab_size: Option<u32>,
    max_position_embeddings: Option<u32>,
    hidden_act: Option<String>,
    tie_word_embeddings: Option<bool>,
    attention_dropout: Option<f64>,
    hidden_dropout: Option<f64>,
    num_local_experts: Option<u32>,
    num_experts_per_tok: Option<u32>,
    sliding_window: Option<u32>,
    use_sliding_window: Option<bool>,
}

/// The attention window a config turns on (`sliding_window`, active unless
/// `use_sliding_window = false`, which Qwen2 configs set), or `None`. The caller compares it
/// with the training sequence length: a window shorter than the sequence is not modelled.
pub fn sliding_window(text: &str) -> Option<u32> {
    let cfg: HfConfig = serde_json::from_str(text).ok()?;
    match (cfg.sliding_window, cfg.use_sliding_window) {
        (Some(w), None | Some(true)) => Some(w),
        _ => None,
    }
}

fn model_type_from_arch(arch: &str) -> Option<&'static str> {
    match arch {
        "LlamaForCausalLM" => Some("llama"),
        "MistralForCausalLM" => Some("mistral"),
        "Qwen2ForCausalLM" => Some("qwen2"),
        "MixtralForCausalLM" => Some("mixtral"),
        _ => None,
    }
}

/// A display name: `_name_or_path` when present, else the directory holding `config.json`, else
/// the model type.
fn display_name(cfg: &HfConfig, origin: &str, model_type: &str) -> String {
    if let Some(n) = cfg.name_or_path.as_deref().filter(|n| !n.trim().is_empty()) {
        return n.trim().to_string();
    }
    let p = std::path::Path::new(origin);
    let file_is_config = p.file_name().is_some_and(|f| f == "config.json");
    let from_path = if file_is_config {
        p.parent().and_then(|d| d.file_name())
    } else {
        p.file_stem()
    };
    match from_path.and_then(|s| s.to_str()).filter(|s| !s.is_empty()) {
        Some(s) => s.to_string(),
        None => model_type.to_string(),
    }
}

/// Parses a HuggingFace `config.json` (its text) into a [`Model`].
///
/// `origin` names the source in error messages. Missing required keys, wrong types and
/// unsupported `model_type`s are errors naming the JSON path. The model is not validated here
/// (the job loader does that, with the job's keys).
pub fn model_from_hf_config(text: &str, origin: &str) -> Result<Model, HfConfigError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let cfg: HfConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let rule = if inner.is_syntax() || inner.is_eof() {
            format!("not valid JSON: {inner}")
        } else if path == "." && inner.is_data() && !inner.to_string().starts_with("missing") {
            format!("the config must be a JSON object ({inner})")
        } else {
            inner.to_string()
        };
        HfConfigError::new(origin, path, rule)
    })?;

    let model_type = match (&cfg.model_type, &cfg.architectures) {
        (Some(t), _) => t.clone(),
        (None, Some(archs)) if !archs.is_empty() => match model_type_from_arch(&archs[0]) {
            Some(t) => t.to_string(),
            None => {
                return Err(HfConfigError::new(
                    origin,
                    "architectures[0]",
                    format!(
                        "unsupported architecture `{}` (no model_type given); supported model_type \
                         values: {}",
                        archs[0],
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                ));
            }
        },
        _ => {
            return Err(HfConfigError::new(
                origin,
                "model_type",
                format!(
                    "missing required key (nor is `architectures` given); supported: {}",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            ));
        }
    };
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(HfConfigError::new(
            origin,
            "model_type",
            format!(
                "unsupported model_type `{model_type}`; supported: {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        ));
    }

    let req = |v: Option<u32>, key: &str| -> Result<u32, HfConfigError> {
        v.ok_or_else(|| HfConfigError::new(origin, key, "missing required key"))
    };
    let layers = req(cfg.num_hidden_layers, "num_hidden_layers")?;
    let hidden = req(cfg.hidden_size, "hidden_size")?;
    let ffn = req(cfg.intermediate_size, "intermediate_size")?;
    let heads = req(cfg.num_attention_heads, "num_attention_heads")?;
    let vocab = req(cfg.vocab_size, "vocab_size")?;
    let seq_len = req(cfg.max_position_embeddings, "max_position_embeddings")?;
    if heads == 0 {
        return Err(HfConfigError::new(
            origin,
            "num_attention_heads",
            "must be at least 1",
        ));
    }
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let head_dim = match cfg.head_dim {
        Some(d) => d,
        None => {
            if !hidden.is_multiple_of(heads) {
                return Err(HfConfigError::new(
                    origin,
                    "head_dim",
                    format!(
                        "missing, and hidden_size ({hidden}) is not divisible by \
                         num_attention_heads ({heads}) to derive it"
                    ),
                ));
            }
            hidden / heads
        }
    };
    // Every supported model type has a gated MLP (gate, up and down projections); the
    // activation only picks the elementwise function of the gate, which costs the same.
    let act = cfg.hidden_act.as_deref().unwrap_or("silu");
    let activation = match act {
        "silu" | "swish" | "relu" => Activation::SwiGlu,
        a if a.starts_with("gelu") => Activation::SwiGlu,
        other => {
            return Err(HfConfigError::new(
                origin,
                "hidden_act",
                format!("unsupported activation `{other}`; supported: silu, swish, relu, gelu*"),
            ));
        }
    };

    let moe = if model_type == "mixtral" {
        let experts = req(cfg.num_local_experts, "num_local_experts")?;
        let top_k = req(cfg.num_experts_per_tok, "num_experts_per_tok")?;
        Some(Moe {
            experts,
            top_k,
            ffn_hidden: ffn,
        })
    } else {
        if cfg.num_local_experts.is_some_and(|e| e > 1) {
            return Err(HfConfigError::new(
                origin,
                "num_local_experts",
                format!("experts are supported only for model_type `mixtral` (got `{model_type}`)"),
            ));
        }
        None
    };

    Ok(Model {
        name: display_name(&cfg, origin, &model_type),
        layers,
        hidden,
        ffn_hidden: ffn,
        heads,
        kv_heads,
        head_dim,
        vocab,
        seq_len,
        activation,
        moe,
        tied_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
        dropout: cfg.attention_dropout.unwrap_or(0.0) > 0.0
            || cfg.hidden_dropout.unwrap_or(0.0) > 0.0,
    })
}
