//! HuggingFace `config.json` -> [`Model`].
//!
//! Accepts the configs of these `model_type`s as they are published: `llama`, `mistral`,
//! `qwen2`, `mixtral`, `qwen3`, `qwen3_moe`, `qwen2_moe` (Qwen1.5-MoE, Qwen2-MoE), `gemma2`, `gemma3` (and `gemma3_text`), `phi3`,
//! `llama4` (and `llama4_text`), `gpt_oss`, `deepseek_v2`, `deepseek_v3`, `kimi_k2` (DeepSeek-V3's
//! architecture) and `glm4_moe` (GLM-4.5 and GLM-4.5-Air: DeepSeek-V3's MoE layout with grouped-query
//! attention instead of MLA). A multimodal config
//! (`gemma3`, `llama4`) is read through its `text_config`: Prism simulates the language model
//! (its vision encoder, under `vision_config`, is not part of the simulated training step).
//! Keys this module does not use are ignored (HF configs carry many); a key that changes
//! FLOPs, memory or communication and that Prism cannot model is an error naming it. Keys read:
//!
//! | key | use |
//! |---|---|
//! | `model_type` (or `architectures[0]`) | the family (above) |
//! | `text_config` | for `gemma3` / `llama4`: the object holding every key below |
//! | `num_hidden_layers` | layers |
//! | `hidden_size` | hidden |
//! | `intermediate_size` | ffn_hidden (dense MLP; Mixtral / gpt-oss: the expert width; Llama 4: the expert and shared-expert width) |
//! | `intermediate_size_mlp` | Llama 4: ffn_hidden of the dense layers |
//! | `num_attention_heads` | heads |
//! | `num_key_value_heads` | kv_heads (default: heads) |
//! | `head_dim` | head_dim (default: hidden / heads; Gemma 3 default 256) |
//! | `vocab_size` | vocab (Gemma 3 default 262208) |
//! | `max_position_embeddings` | seq_len of the model alone; a job must give its own `seq_len` (the longest context is not the training length) |
//! | `hidden_act` / `hidden_activation` | `silu`, `swish`, `relu` or `gelu*`: every family here has a gated MLP (three matrices), so each is `swiglu` in cost |
//! | `attention_dropout`, `hidden_dropout`, `resid_pdrop`, `embd_pdrop` | dropout when any is above 0 |
//! | `tie_word_embeddings` | tied_embeddings (default false; Gemma: true) |
//! | `num_local_experts` / `num_experts` / `n_routed_experts`, `num_experts_per_tok` (`experts_per_token`) | routed experts and top-k |
//! | `moe_intermediate_size` | expert width (DeepSeek, Qwen3-MoE) |
//! | `n_shared_experts` | DeepSeek: shared experts, `moe_shared_ffn_hidden = n x moe_intermediate_size` |
//! | `shared_expert_intermediate_size` | shared-expert width (Qwen-MoE style) |
//! | `first_k_dense_replace` | DeepSeek: leading dense layers |
//! | `moe_layer_freq` | DeepSeek: must be 1 (every later layer MoE) |
//! | `decoder_sparse_step`, `mlp_only_layers` | Qwen3-MoE: MoE every `step` layers; `mlp_only_layers` must be empty |
//! | `interleave_moe_layer_step`, `moe_layers` | Llama 4: MoE every `step` layers (`moe_layers`, when given, must match) |
//! | `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` | DeepSeek: multi-head latent attention |
//! | `num_nextn_predict_layers` | DeepSeek-V3, GLM-4.5: multi-token-prediction depth |
//! | `n_group`, `topk_group` | DeepSeek: group-limited routing (`moe_groups`, `moe_groups_per_token`; V3's node-limited routing when groups sit on nodes) |
//! | `sliding_window` (with `use_sliding_window`) | local attention window: every layer (Mistral, Phi-3), every layer but every 2nd (Gemma 2), every 6th (`sliding_window_pattern`, Gemma 3), or per `layer_types` |
//! | `layer_types` | `sliding_attention` / `chunked_attention` / `full_attention` per layer: must be a regular pattern (every `n`-th layer global) |
//! | `attention_chunk_size`, `no_rope_layers`, `no_rope_layer_interval` | Llama 4: chunked attention on the RoPE layers, global attention on every `interval`-th (NoPE) layer |
//! | `max_window_layers` | Qwen: with `use_sliding_window = true` refused (its per-layer split is not modelled) |
//! | `use_qk_norm` / family | query/key RMS norms (Qwen3, Gemma 3, GLM-4.5 when `use_qk_norm`; Llama 4's L2 norm has no weights) |
//! | `partial_rotary_factor` | read, costed as free (RoPE on part of each head is elementwise work fused into the attention prologue) |
//! | `attn_logit_softcapping`, `final_logit_softcapping` | read, costed as free (an elementwise op fused into the attention / loss kernels) |
//! | family `gpt_oss` | `expert_bias`: biases on both expert projections (their adds cost time on stacks without a bias epilogue) |
//!
//! Not counted in the parameters: biases (`attention_bias`, gpt-oss' expert biases; below 0.01% of the
//! parameters) and Gemma's extra pre/post-feed-forward norms (`2h` per layer).

use prism_core::arch::{Arch, Mla, WindowKind};
use prism_core::job::{Activation, Model, Moe};
use serde::Deserialize;

/// `model_type` values this module accepts.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "llama4",
    "llama4_text",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
];

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
#[derive(Deserialize, Debug, Default)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    #[serde(rename = "_name_or_path")]
    name_or_path: Option<String>,
    num_hidden_layers: Option<u32>,
    hidden_size: Option<u32>,
    intermediate_size: Option<u32>,
    intermediate_size_mlp: Option<u32>,
    num_attention_heads: Option<u32>,
    num_key_value_heads: Option<u32>,
    head_dim: Option<u32>,
    vocab_size: Option<u32>,
    max_position_embeddings: Option<u32>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    tie_word_embeddings: Option<bool>,
    attention_dropout: Option<f64>,
    hidden_dropout: Option<f64>,
    resid_pdrop: Option<f64>,
    embd_pdrop: Option<f64>,
    num_local_experts: Option<u32>,
    num_experts: Option<u32>,
    n_routed_experts: Option<u32>,
    num_experts_per_tok: Option<u32>,
    experts_per_token: Option<u32>,
    moe_intermediate_size: Option<u32>,
    n_shared_experts: Option<u32>,
    shared_expert_intermediate_size: Option<u32>,
    first_k_dense_replace: Option<u32>,
    moe_layer_freq: Option<u32>,
    decoder_sparse_step: Option<u32>,
    mlp_only_layers: Option<Vec<u32>>,
    interleave_moe_layer_step: Option<u32>,
    moe_layers: Option<Vec<u32>>,
    q_lora_rank: Option<u32>,
    kv_lora_rank: Option<u32>,
    qk_nope_head_dim: Option<u32>,
    qk_rope_head_dim: Option<u32>,
    v_head_dim: Option<u32>,
    num_nextn_predict_layers: Option<u32>,
    n_group: Option<u32>,
    topk_group: Option<u32>,
    sliding_window: Option<u32>,
    use_sliding_window: Option<bool>,
    sliding_window_pattern: Option<u32>,
    layer_types: Option<Vec<String>>,
    attention_chunk_size: Option<u32>,
    no_rope_layers: Option<Vec<u32>>,
    no_rope_layer_interval: Option<u32>,
    use_qk_norm: Option<bool>,
}

fn model_type_from_arch(arch: &str) -> Option<&'static str> {
    match arch {
        "LlamaForCausalLM" => Some("llama"),
        "MistralForCausalLM" => Some("mistral"),
        "Qwen2ForCausalLM" => Some("qwen2"),
        "MixtralForCausalLM" => Some("mixtral"),
        "Qwen3ForCausalLM" => Some("qwen3"),
        "Qwen3MoeForCausalLM" => Some("qwen3_moe"),
        "Qwen2MoeForCausalLM" => Some("qwen2_moe"),
        "Gemma2ForCausalLM" => Some("gemma2"),
        "Gemma3ForCausalLM" => Some("gemma3_text"),
        "Gemma3ForConditionalGeneration" => Some("gemma3"),
        "Phi3ForCausalLM" => Some("phi3"),
        "Llama4ForConditionalGeneration" => Some("llama4"),
        "Llama4ForCausalLM" => Some("llama4_text"),
        "GptOssForCausalLM" => Some("gpt_oss"),
        "DeepseekV2ForCausalLM" => Some("deepseek_v2"),
        "DeepseekV3ForCausalLM" => Some("deepseek_v3"),
        "Glm4MoeForCausalLM" => Some("glm4_moe"),
        _ => None,
    }
}

/// A display name: `_name_or_path` when present, else the directory holding `config.json`, else
/// the model type.
fn display_name(name_or_path: Option<&str>, origin: &str, model_type: &str) -> String {
    if let Some(n) = name_or_path.filter(|n| !n.trim().is_empty()) {
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

/// Deserializes `value` into an [`HfConfig`], error paths prefixed with `prefix`.
fn parse_config(
    value: serde_json::Value,
    origin: &str,
    prefix: &str,
) -> Result<HfConfig, HfConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let rule = if path == "." && !inner.to_string().starts_with("missing") {
            format!("the config must be a JSON object ({inner})")
        } else {
            inner.to_string()
        };
        let path = if prefix.is_empty() {
            path
        } else if path == "." {
            prefix.to_string()
        } else {
            format!("{prefix}.{path}")
        };
        HfConfigError::new(origin, path, rule)
    })
}

/// `every` such that layer `l` is global exactly when `(l + 1) % every == 0` (0: no layer
/// global), or `None` when `global` follows no such pattern.
fn global_every(global: &[bool]) -> Option<u32> {
    let n = global.len() as u32;
    let every = match global.iter().position(|&g| g) {
        None => 0,
        Some(i) => i as u32 + 1,
    };
    let fits = (0..n).all(|l| global[l as usize] == (every > 0 && (l + 1) % every == 0));
    fits.then_some(every)
}

/// Parses a HuggingFace `config.json` (its text) into a [`Model`].
///
/// `origin` names the source in error messages. Missing required keys, wrong types,
/// unsupported `model_type`s and settings Prism cannot model are errors naming the JSON path.
/// The model is not validated here (the job loader does that, with the job's keys).
pub fn model_from_hf_config(text: &str, origin: &str) -> Result<Model, HfConfigError> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| HfConfigError::new(origin, ".", format!("not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(HfConfigError::new(
            origin,
            ".",
            "the config must be a JSON object",
        ));
    }
    // Multimodal configs hold the language model under `text_config`.
    let nested = value.get("text_config").filter(|t| t.is_object()).cloned();
    let top = parse_config(value, origin, "")?;
    let (cfg, p) = match nested {
        Some(t) => (parse_config(t, origin, "text_config")?, "text_config."),
        None => (HfConfig::default(), ""),
    };
    let cfg = if p.is_empty() { top } else { cfg };
    let top_type = if p.is_empty() {
        cfg.model_type.clone()
    } else {
        None
    };
    let key = |k: &str| format!("{p}{k}");

    let model_type = match (&top_type, &cfg.model_type, &cfg.architectures) {
        (Some(t), _, _) => t.clone(),
        (None, Some(t), _) => t.clone(),
        (None, None, Some(archs)) if !archs.is_empty() => match model_type_from_arch(&archs[0]) {
            Some(t) => t.to_string(),
            None => {
                return Err(HfConfigError::new(
                    origin,
                    key("architectures[0]"),
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
                key("model_type"),
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
            key("model_type"),
            format!(
                "unsupported model_type `{model_type}`; supported: {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        ));
    }
    // The family, with the multimodal wrappers folded onto their text models.
    let family = match model_type.as_str() {
        "gemma3_text" => "gemma3",
        "llama4_text" => "llama4",
        // Moonshot's Kimi K2 is the DeepSeek-V3 architecture (its config names
        // DeepseekV3ForCausalLM) with other sizes.
        "kimi_k2" => "deepseek_v3",
        t => t,
    };
    let gemma = matches!(family, "gemma2" | "gemma3");

    let err = |k: &str, rule: String| HfConfigError::new(origin, key(k), rule);
    let req = |v: Option<u32>, k: &str| -> Result<u32, HfConfigError> {
        v.ok_or_else(|| err(k, "missing required key".into()))
    };
    let layers = req(cfg.num_hidden_layers, "num_hidden_layers")?;
    let hidden = req(cfg.hidden_size, "hidden_size")?;
    let heads = req(cfg.num_attention_heads, "num_attention_heads")?;
    // Gemma 3's text config omits keys whose class defaults apply (transformers'
    // Gemma3TextConfig: vocab 262208, head_dim 256, 131072 positions).
    let vocab = match (cfg.vocab_size, family) {
        (Some(v), _) => v,
        (None, "gemma3") => 262_208,
        (None, _) => req(None, "vocab_size")?,
    };
    let seq_len = match (cfg.max_position_embeddings, family) {
        (Some(v), _) => v,
        (None, "gemma3") => 131_072,
        (None, _) => req(None, "max_position_embeddings")?,
    };
    if heads == 0 {
        return Err(err("num_attention_heads", "must be at least 1".into()));
    }
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let head_dim = match (cfg.head_dim, family, &cfg.kv_lora_rank) {
        (Some(d), _, _) => d,
        (None, "gemma3", _) => 256,
        // MLA: the query/key head width (the model's own widths are in `arch.mla`).
        (None, _, Some(_)) => cfg.qk_nope_head_dim.unwrap_or(0) + cfg.qk_rope_head_dim.unwrap_or(0),
        (None, _, None) => {
            if !hidden.is_multiple_of(heads) {
                return Err(err(
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
    // Every supported family has a gated MLP (gate, up and down projections); the activation
    // only picks the elementwise function of the gate, which costs the same.
    let (act_key, act) = match (&cfg.hidden_act, &cfg.hidden_activation) {
        (Some(a), _) => ("hidden_act", a.as_str()),
        (None, Some(a)) => ("hidden_activation", a.as_str()),
        (None, None) => ("hidden_act", "silu"),
    };
    let activation = match act {
        "silu" | "swish" | "relu" => Activation::SwiGlu,
        a if a.starts_with("gelu") => Activation::SwiGlu,
        other => {
            return Err(err(
                act_key,
                format!("unsupported activation `{other}`; supported: silu, swish, relu, gelu*"),
            ));
        }
    };

    let mut arch = Arch::default();
    let mut ffn = cfg.intermediate_size;
    // Routed experts.
    let experts = match family {
        "mixtral" | "llama4" | "gpt_oss" => cfg.num_local_experts,
        "qwen3_moe" | "qwen2_moe" => cfg.num_experts,
        "deepseek_v2" | "deepseek_v3" | "glm4_moe" => cfg.n_routed_experts,
        _ => {
            for (k, v) in [
                ("num_local_experts", cfg.num_local_experts),
                ("num_experts", cfg.num_experts),
                ("n_routed_experts", cfg.n_routed_experts),
            ] {
                if v.is_some_and(|e| e > 1) {
                    return Err(err(
                        k,
                        format!("experts are not part of model_type `{model_type}`"),
                    ));
                }
            }
            None
        }
    };
    let moe = match experts {
        None | Some(0) => None,
        Some(experts) => {
            let top_k = match (cfg.num_experts_per_tok, cfg.experts_per_token) {
                (Some(k), _) | (None, Some(k)) => k,
                (None, None) => req(None, "num_experts_per_tok")?,
            };
            let expert_ffn = match family {
                "qwen3_moe" | "qwen2_moe" | "deepseek_v2" | "deepseek_v3" | "glm4_moe" => {
                    req(cfg.moe_intermediate_size, "moe_intermediate_size")?
                }
                _ => req(cfg.intermediate_size, "intermediate_size")?,
            };
            match family {
                "deepseek_v2" | "deepseek_v3" | "glm4_moe" => {
                    arch.moe_shared_ffn_hidden = cfg.n_shared_experts.unwrap_or(0) * expert_ffn;
                    arch.moe_first_dense_layers = cfg.first_k_dense_replace.unwrap_or(0);
                    // Group-limited routing, when it limits anything.
                    if let (Some(g), Some(t)) = (cfg.n_group, cfg.topk_group)
                        && g > 1
                        && t < g
                    {
                        arch.moe_groups = g;
                        arch.moe_groups_per_token = t;
                    }
                    if let Some(f) = cfg.moe_layer_freq.filter(|&f| f != 1) {
                        return Err(err(
                            "moe_layer_freq",
                            format!(
                                "{f} is not modelled (every layer after first_k_dense_replace \
                                 is an MoE layer; moe_layer_freq must be 1)"
                            ),
                        ));
                    }
                }
                "qwen3_moe" | "qwen2_moe" => {
                    arch.moe_layer_step = cfg.decoder_sparse_step.unwrap_or(1).max(1);
                    if cfg.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty()) {
                        return Err(err(
                            "mlp_only_layers",
                            "dense layers at arbitrary positions are not modelled (must be \
                             empty)"
                                .into(),
                        ));
                    }
                    arch.moe_shared_ffn_hidden = cfg.shared_expert_intermediate_size.unwrap_or(0);
                }
                "llama4" => {
                    let step = cfg.interleave_moe_layer_step.unwrap_or(1).max(1);
                    arch.moe_layer_step = step;
                    // One shared expert as wide as a routed one.
                    arch.moe_shared_ffn_hidden = expert_ffn;
                    // The dense layers' MLP.
                    ffn = Some(cfg.intermediate_size_mlp.unwrap_or(expert_ffn));
                    if let Some(list) = &cfg.moe_layers {
                        let expect: Vec<u32> =
                            (0..layers).filter(|l| (l + 1) % step == 0).collect();
                        if *list != expect {
                            return Err(err(
                                "moe_layers",
                                format!(
                                    "must be every {step}-th layer (interleave_moe_layer_step); \
                                     other placements are not modelled"
                                ),
                            ));
                        }
                    }
                }
                _ => {}
            }
            Some(Moe {
                experts,
                top_k,
                ffn_hidden: expert_ffn,
            })
        }
    };
    let ffn = match (ffn, &moe) {
        (Some(f), _) => f,
        (None, Some(m)) => m.ffn_hidden,
        (None, None) => req(None, "intermediate_size")?,
    };

    // Multi-head latent attention.
    if let Some(kv_lora_rank) = cfg.kv_lora_rank {
        if !matches!(family, "deepseek_v2" | "deepseek_v3") {
            return Err(err(
                "kv_lora_rank",
                format!("multi-head latent attention is not part of model_type `{model_type}`"),
            ));
        }
        arch.mla = Some(Mla {
            q_lora_rank: cfg.q_lora_rank.unwrap_or(0),
            kv_lora_rank,
            qk_nope_head_dim: req(cfg.qk_nope_head_dim, "qk_nope_head_dim")?,
            qk_rope_head_dim: req(cfg.qk_rope_head_dim, "qk_rope_head_dim")?,
            v_head_dim: req(cfg.v_head_dim, "v_head_dim")?,
        });
    } else if matches!(family, "deepseek_v2" | "deepseek_v3") {
        return Err(err(
            "kv_lora_rank",
            "missing required key (DeepSeek's multi-head latent attention)".into(),
        ));
    }
    if matches!(family, "deepseek_v3" | "glm4_moe") {
        arch.mtp_depth = cfg.num_nextn_predict_layers.unwrap_or(0);
    }
    arch.qk_norm = match family {
        "qwen3" | "qwen3_moe" | "gemma3" => true,
        // GLM-4.5 sets `use_qk_norm: true`, GLM-4.5-Air false (transformers' default).
        "glm4_moe" => cfg.use_qk_norm.unwrap_or(false),
        _ => false,
    };
    // gpt-oss' experts have biases on both projections (no config key; the architecture).
    arch.expert_bias = family == "gpt_oss";

    // Local attention.
    let window_on = match (cfg.sliding_window, cfg.use_sliding_window) {
        (Some(w), None | Some(true)) if w > 0 => Some(w),
        _ => None,
    };
    if matches!(family, "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe") && window_on.is_some() {
        return Err(err(
            "use_sliding_window",
            "Qwen's sliding window on the layers from max_window_layers on is not modelled \
             (published configs set use_sliding_window = false)"
                .into(),
        ));
    }
    if let Some(types) = &cfg.layer_types
        && family != "llama4"
    {
        if types.len() != layers as usize {
            return Err(err(
                "layer_types",
                format!("has {} entries for {layers} layers", types.len()),
            ));
        }
        let mut global = Vec::with_capacity(types.len());
        let mut kind = None;
        for (i, t) in types.iter().enumerate() {
            let (g, k) = match t.as_str() {
                "full_attention" => (true, None),
                "sliding_attention" => (false, Some(WindowKind::Sliding)),
                "chunked_attention" => (false, Some(WindowKind::Chunked)),
                other => {
                    return Err(err(
                        &format!("layer_types[{i}]"),
                        format!("unsupported layer type `{other}`"),
                    ));
                }
            };
            if k.is_some() {
                kind = k;
            }
            global.push(g);
        }
        let every = global_every(&global).ok_or_else(|| {
            err(
                "layer_types",
                "local and global layers must follow a regular pattern (every n-th layer \
                 global); other placements are not modelled"
                    .into(),
            )
        })?;
        if let Some(kind) = kind {
            let window = match kind {
                WindowKind::Sliding => req(window_on, "sliding_window")?,
                WindowKind::Chunked => req(cfg.attention_chunk_size, "attention_chunk_size")?,
            };
            arch.attention_window = window;
            arch.attention_window_kind = kind;
            arch.attention_global_every = every;
        }
    } else if family == "llama4" {
        if let Some(chunk) = cfg.attention_chunk_size.filter(|&c| c > 0) {
            let every = match &cfg.no_rope_layers {
                Some(list) if !list.is_empty() => {
                    if list.len() != layers as usize {
                        return Err(err(
                            "no_rope_layers",
                            format!("has {} entries for {layers} layers", list.len()),
                        ));
                    }
                    // 1: a RoPE layer with chunked attention, 0: a NoPE layer, global.
                    let global: Vec<bool> = list.iter().map(|&r| r == 0).collect();
                    global_every(&global).ok_or_else(|| {
                        err(
                            "no_rope_layers",
                            "NoPE (global) layers must be every n-th layer; other placements \
                             are not modelled"
                                .into(),
                        )
                    })?
                }
                _ => cfg.no_rope_layer_interval.unwrap_or(4),
            };
            arch.attention_window = chunk;
            arch.attention_window_kind = WindowKind::Chunked;
            arch.attention_global_every = every;
        }
    } else if let Some(w) = window_on {
        arch.attention_window = w;
        arch.attention_global_every = match family {
            "gemma2" => 2,
            "gemma3" => cfg.sliding_window_pattern.unwrap_or(6),
            _ => 0,
        };
    } else if family == "gemma3" {
        // Gemma3TextConfig's default window.
        arch.attention_window = 4096;
        arch.attention_global_every = cfg.sliding_window_pattern.unwrap_or(6);
    }

    let name_or_path = if p.is_empty() {
        cfg.name_or_path.as_deref()
    } else {
        None
    };
    Ok(Model {
        name: display_name(name_or_path, origin, &model_type),
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
        tied_embeddings: cfg.tie_word_embeddings.unwrap_or(gemma),
        dropout: [
            cfg.attention_dropout,
            cfg.hidden_dropout,
            cfg.resid_pdrop,
            cfg.embd_pdrop,
        ]
        .iter()
        .any(|d| d.unwrap_or(0.0) > 0.0),
        arch,
    })
}
