//! HuggingFace `config.json` -> [`Model`].
//!
//! Accepts the configs of these `model_type`s as they are published:
//! - gated MLP (gate, up and down projections), dense: `llama`, `mistral`, `qwen2`, `qwen3`,
//!   `gemma`, `gemma2`, `gemma3` (and `gemma3_text`), `phi3`, `olmo`, `olmo2`, `olmo3`,
//!   `granite`, `cohere` (Command R), `cohere2`, `glm4`, `smollm3`, `internlm2`, `exaone4`,
//!   `seed_oss`, `hunyuan_v1_dense`, `ernie4_5`;
//! - gated MLP, mixture of experts: `mixtral`, `qwen2_moe` (Qwen1.5-MoE, Qwen2-MoE),
//!   `qwen3_moe`, `llama4` (and `llama4_text`), `gpt_oss`, `deepseek_v2`, `deepseek_v3`,
//!   `kimi_k2` (DeepSeek-V3's architecture), `glm4_moe` (GLM-4.5 and GLM-4.5-Air: DeepSeek-V3's
//!   MoE layout with grouped-query attention instead of MLA), `dots1` (the same layout), `olmoe`,
//!   `phimoe` (Phi-3.5-MoE), `granitemoe`, `granitemoeshared`, `ernie4_5_moe`;
//! - plain MLP (up and down projections, costed as [`Activation::Gelu`] whatever the
//!   elementwise function): `gpt2`, `gpt_bigcode` (StarCoder, SantaCoder), `gpt_neox` (Pythia),
//!   `falcon`, `phi` (Phi-1/2), `starcoder2`, `nemotron` (squared ReLU), `apertus`, `arcee`.
//!
//! Vision-language configs are read through their `text_config` (its own `model_type`, or the
//! wrapper's default text model when it names none): `gemma3`, `llama4`, `llava`, `llava_next`,
//! `mistral3`, `paligemma`, `internvl`, `qwen2_vl` / `qwen2_5_vl` (flat or nested), `qwen3_vl`,
//! `qwen3_vl_moe`. Prism simulates the language model; the vision encoder (`vision_config`) is
//! not part of the simulated training step. Architectures Prism cannot model are refused with the
//! reason: cross-attention to vision (`mllama`), linear or lightning attention (`minimax`,
//! `qwen3_next`), Mamba / state-space layers (`granitemoehybrid`, `jamba`, `nemotron_h`, ...),
//! DeepSeek's sparse attention (`deepseek_v32`), encoder-decoder models.
//!
//! Not modelled, and below 1% of a layer's time: a parallel attention + MLP block (`gpt_neox`,
//! `falcon`, `phi`, `cohere`) is costed as the sequential block (one norm more per layer);
//! OLMo 2's and GLM-4's extra post-norms, Granite's and Cohere's scaling multipliers, learned
//! position embeddings (`gpt2`) and biases are elementwise work or parameters below 0.1%.
//! Keys this module does not use are ignored (HF configs carry many); a key that changes
//! FLOPs, memory or communication and that Prism cannot model is an error naming it. Keys read:
//!
//! | key | use |
//! |---|---|
//! | `model_type` (or `architectures[0]`) | the family (above) |
//! | `text_config` | vision-language wrappers: the object holding every key below |
//! | `num_hidden_layers` (`n_layer`) | layers |
//! | `hidden_size` (`n_embd`) | hidden |
//! | `intermediate_size` (`n_inner`, `ffn_hidden_size`) | ffn_hidden (dense MLP; Mixtral, gpt-oss, OLMoE, Phi-3.5-MoE, Granite MoE: the expert width; Llama 4: the expert and shared-expert width). GPT-2, GPT-BigCode, Falcon: 4 x hidden when absent or null |
//! | `intermediate_size_mlp` | Llama 4: ffn_hidden of the dense layers |
//! | `num_attention_heads` (`n_head`) | heads |
//! | `num_key_value_heads` (`num_kv_heads`, `n_head_kv`) | kv_heads (default: heads); `multi_query` (GPT-BigCode, Falcon before its new decoder architecture): 1 |
//! | `head_dim` | head_dim (default: hidden / heads; Gemma 3 default 256) |
//! | `vocab_size` | vocab (Gemma 3 default 262208) |
//! | `max_position_embeddings` (`n_positions`) | seq_len of the model alone (Falcon default 2048); a job must give its own `seq_len` (the longest context is not the training length) |
//! | `hidden_act` / `hidden_activation` / `activation_function` / `activation` | gated families: `silu`, `swish`, `relu` or `gelu*`, each `swiglu` in cost (three matrices); plain families: any (two matrices, `gelu` in cost) |
//! | `attention_dropout`, `hidden_dropout`, `resid_pdrop`, `embd_pdrop`, `attn_pdrop`, `residual_dropout`, `embedding_dropout` | dropout when any is above 0 |
//! | `tie_word_embeddings` | tied_embeddings (in a wrapper: the text config's, else the wrapper's); default false, true for Gemma, Cohere, SmolLM3, ERNIE 4.5, StarCoder2, GPT-2, GPT-BigCode and Falcon (their classes' defaults) |
//! | `num_local_experts` / `num_experts` / `n_routed_experts` / `moe_num_experts`, `num_experts_per_tok` (`experts_per_token`, `moe_k`) | routed experts and top-k |
//! | `moe_intermediate_size` | expert width (DeepSeek, Qwen-MoE, dots1, ERNIE 4.5) |
//! | `n_shared_experts` / `moe_num_shared_experts` | DeepSeek, dots1 / ERNIE 4.5: shared experts, `moe_shared_ffn_hidden = n x moe_intermediate_size` |
//! | `shared_expert_intermediate_size` / `shared_intermediate_size` | shared-expert width (Qwen-MoE / Granite MoE shared) |
//! | `first_k_dense_replace` / `moe_layer_start_index` | DeepSeek, dots1 / ERNIE 4.5: leading dense layers (ERNIE: `moe_layer_interval` must be 1 and `moe_layer_end_index` the last layer) |
//! | `moe_layer_freq` | DeepSeek: must be 1 (every later layer MoE) |
//! | `decoder_sparse_step`, `mlp_only_layers` | Qwen3-MoE: MoE every `step` layers; `mlp_only_layers` must be empty |
//! | `interleave_moe_layer_step`, `moe_layers` | Llama 4: MoE every `step` layers (`moe_layers`, when given, must match) |
//! | `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` | DeepSeek: multi-head latent attention |
//! | `num_nextn_predict_layers` | DeepSeek-V3, GLM-4.5: multi-token-prediction depth |
//! | `n_group`, `topk_group` | DeepSeek: group-limited routing (`moe_groups`, `moe_groups_per_token`; V3's node-limited routing when groups sit on nodes) |
//! | `sliding_window` (with `use_sliding_window`, default true except for Qwen and SmolLM3) | local attention window: every layer (Mistral, Phi-3, Phi-3.5-MoE, StarCoder2), every layer but every 2nd (Gemma 2), every `sliding_window_pattern`-th (Gemma 3: 6; Cohere 2, EXAONE 4, OLMo 3: 4), or per `layer_types`; OLMo 3 and Cohere 2 default to their classes' 4096 |
//! | `layer_types` | `sliding_attention` / `chunked_attention` / `full_attention` per layer: must be a regular pattern (every `n`-th layer global) |
//! | `attention_chunk_size`, `no_rope_layers`, `no_rope_layer_interval` | Llama 4: chunked attention on the RoPE layers, global attention on every `interval`-th (NoPE) layer |
//! | `max_window_layers` | Qwen: with `use_sliding_window = true` refused; dots1: a window on layers from `max_window_layers` on is refused (its per-layer split is not modelled) |
//! | `use_qk_norm` / family | query/key norms (Qwen3, Gemma 3, OLMo 2/3, OLMoE, dots1, EXAONE 4, Hunyuan, Apertus; GLM-4.5 and Cohere when `use_qk_norm`; Llama 4's L2 norm has no weights) |
//! | `partial_rotary_factor` | read, costed as free (RoPE on part of each head is elementwise work fused into the attention prologue) |
//! | `attn_logit_softcapping`, `final_logit_softcapping` | read, costed as free (an elementwise op fused into the attention / loss kernels) |
//! | family `gpt_oss` | `expert_bias`: biases on both expert projections (their adds cost time on stacks without a bias epilogue) |
//!
//! Not counted in the parameters: biases (`attention_bias`, gpt-oss' expert biases; below 0.01% of the
//! parameters) and Gemma's extra pre/post-feed-forward norms (`2h` per layer).

use prism_core::arch::{Arch, Mla, WindowKind};
use prism_core::job::{Activation, Model, Moe};
use serde::Deserialize;

/// `model_type` values this module accepts (the language models; vision-language wrappers are
/// read through their `text_config`, see [`WRAPPERS`]).
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
    "gemma",
    "olmo",
    "olmo2",
    "olmo3",
    "granite",
    "cohere",
    "cohere2",
    "glm4",
    "smollm3",
    "internlm2",
    "exaone4",
    "seed_oss",
    "hunyuan_v1_dense",
    "ernie4_5",
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen3_vl_text",
    "dots1",
    "olmoe",
    "phimoe",
    "granitemoe",
    "granitemoeshared",
    "ernie4_5_moe",
    "qwen3_vl_moe_text",
    "gpt2",
    "gpt_bigcode",
    "gpt_neox",
    "falcon",
    "phi",
    "starcoder2",
    "nemotron",
    "apertus",
    "arcee",
];

/// Vision-language wrappers whose language model sits under `text_config`, with the text
/// model's `model_type` their classes assume when the text config names none.
pub const WRAPPERS: &[(&str, &str)] = &[
    ("gemma3", "gemma3_text"),
    ("llama4", "llama4_text"),
    ("llava", "llama"),
    ("llava_next", "llama"),
    ("llava_onevision", "qwen2"),
    ("mistral3", "mistral"),
    ("paligemma", "gemma"),
    ("internvl", "qwen2"),
    ("qwen2_vl", "qwen2_vl_text"),
    ("qwen2_5_vl", "qwen2_5_vl_text"),
    ("qwen3_vl", "qwen3_vl_text"),
    ("qwen3_vl_moe", "qwen3_vl_moe_text"),
];

const CROSS_ATTENTION: &str =
    "cross-attention layers to the vision encoder (Llama 3.2 Vision) are not modelled";
const MAMBA: &str = "Mamba (state-space) layers are not modelled";
const ENCODER_DECODER: &str = "encoder-decoder models are not modelled";

/// `model_type`s known and refused, with the architecture feature Prism does not model.
const UNMODELLED: &[(&str, &str)] = &[
    ("mllama", CROSS_ATTENTION),
    ("mllama_text_model", CROSS_ATTENTION),
    (
        "minimax",
        "lightning (linear) attention layers are not modelled",
    ),
    (
        "qwen3_next",
        "Gated DeltaNet (linear attention) layers are not modelled",
    ),
    ("granitemoehybrid", MAMBA),
    ("jamba", MAMBA),
    ("bamba", MAMBA),
    ("falcon_h1", MAMBA),
    ("falcon_mamba", MAMBA),
    ("mamba", MAMBA),
    ("mamba2", MAMBA),
    ("nemotron_h", MAMBA),
    ("zamba", MAMBA),
    ("zamba2", MAMBA),
    (
        "deepseek_v32",
        "DeepSeek sparse attention (the indexer's top-k token selection) is not modelled",
    ),
    ("t5", ENCODER_DECODER),
    ("mt5", ENCODER_DECODER),
    ("umt5", ENCODER_DECODER),
    ("bart", ENCODER_DECODER),
];

/// The family a supported `model_type` reads as: aliases and the text models of wrappers folded
/// onto the family whose rules apply.
fn family_of(model_type: &str) -> &str {
    match model_type {
        "gemma3_text" => "gemma3",
        "llama4_text" => "llama4",
        // Moonshot's Kimi K2 is the DeepSeek-V3 architecture (its config names
        // DeepseekV3ForCausalLM) with other sizes.
        "kimi_k2" => "deepseek_v3",
        // Qwen2-VL / Qwen2.5-VL: a Qwen2 language model (M-RoPE costs as RoPE).
        "qwen2_vl" | "qwen2_vl_text" | "qwen2_5_vl" | "qwen2_5_vl_text" => "qwen2",
        "qwen3_vl_text" => "qwen3",
        "qwen3_vl_moe_text" => "qwen3_moe",
        t => t,
    }
}

/// Families whose MLP has two matrices (up and down) instead of three (gate, up, down).
fn plain_mlp(family: &str) -> bool {
    matches!(
        family,
        "gpt2"
            | "gpt_bigcode"
            | "gpt_neox"
            | "falcon"
            | "phi"
            | "starcoder2"
            | "nemotron"
            | "apertus"
            | "arcee"
    )
}

/// `tie_word_embeddings` when the config omits it: the default of the family's config class.
fn tied_by_default(family: &str) -> bool {
    matches!(
        family,
        "gemma"
            | "gemma2"
            | "gemma3"
            | "cohere"
            | "cohere2"
            | "smollm3"
            | "ernie4_5"
            | "ernie4_5_moe"
            | "starcoder2"
            | "gpt2"
            | "gpt_bigcode"
            | "falcon"
    )
}

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
    n_layer: Option<u32>,
    hidden_size: Option<u32>,
    n_embd: Option<u32>,
    intermediate_size: Option<u32>,
    n_inner: Option<u32>,
    ffn_hidden_size: Option<u32>,
    intermediate_size_mlp: Option<u32>,
    num_attention_heads: Option<u32>,
    n_head: Option<u32>,
    num_key_value_heads: Option<u32>,
    num_kv_heads: Option<u32>,
    n_head_kv: Option<u32>,
    multi_query: Option<bool>,
    new_decoder_architecture: Option<bool>,
    head_dim: Option<u32>,
    vocab_size: Option<u32>,
    max_position_embeddings: Option<u32>,
    n_positions: Option<u32>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    activation_function: Option<String>,
    activation: Option<String>,
    tie_word_embeddings: Option<bool>,
    attention_dropout: Option<f64>,
    hidden_dropout: Option<f64>,
    resid_pdrop: Option<f64>,
    embd_pdrop: Option<f64>,
    attn_pdrop: Option<f64>,
    residual_dropout: Option<f64>,
    embedding_dropout: Option<f64>,
    num_local_experts: Option<u32>,
    num_experts: Option<u32>,
    n_routed_experts: Option<u32>,
    moe_num_experts: Option<u32>,
    num_experts_per_tok: Option<u32>,
    experts_per_token: Option<u32>,
    moe_k: Option<u32>,
    moe_intermediate_size: Option<u32>,
    n_shared_experts: Option<u32>,
    moe_num_shared_experts: Option<u32>,
    shared_expert_intermediate_size: Option<u32>,
    shared_intermediate_size: Option<u32>,
    first_k_dense_replace: Option<u32>,
    moe_layer_start_index: Option<u32>,
    moe_layer_end_index: Option<i64>,
    moe_layer_interval: Option<u32>,
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
    max_window_layers: Option<u32>,
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
        "Dots1ForCausalLM" => Some("dots1"),
        "GemmaForCausalLM" => Some("gemma"),
        "OlmoForCausalLM" => Some("olmo"),
        "Olmo2ForCausalLM" => Some("olmo2"),
        "Olmo3ForCausalLM" => Some("olmo3"),
        "OlmoeForCausalLM" => Some("olmoe"),
        "GraniteForCausalLM" => Some("granite"),
        "GraniteMoeForCausalLM" => Some("granitemoe"),
        "GraniteMoeSharedForCausalLM" => Some("granitemoeshared"),
        "CohereForCausalLM" => Some("cohere"),
        "Cohere2ForCausalLM" => Some("cohere2"),
        "Glm4ForCausalLM" => Some("glm4"),
        "SmolLM3ForCausalLM" => Some("smollm3"),
        "InternLM2ForCausalLM" => Some("internlm2"),
        "Exaone4ForCausalLM" => Some("exaone4"),
        "SeedOssForCausalLM" => Some("seed_oss"),
        "HunYuanDenseV1ForCausalLM" => Some("hunyuan_v1_dense"),
        "Ernie4_5ForCausalLM" => Some("ernie4_5"),
        "Ernie4_5_MoeForCausalLM" => Some("ernie4_5_moe"),
        "PhimoeForCausalLM" => Some("phimoe"),
        "GPT2LMHeadModel" => Some("gpt2"),
        "GPTBigCodeForCausalLM" => Some("gpt_bigcode"),
        "GPTNeoXForCausalLM" => Some("gpt_neox"),
        "FalconForCausalLM" => Some("falcon"),
        "PhiForCausalLM" => Some("phi"),
        "Starcoder2ForCausalLM" => Some("starcoder2"),
        "NemotronForCausalLM" => Some("nemotron"),
        "ApertusForCausalLM" => Some("apertus"),
        "ArceeForCausalLM" => Some("arcee"),
        "Qwen2VLForConditionalGeneration" => Some("qwen2_vl"),
        "Qwen2_5_VLForConditionalGeneration" => Some("qwen2_5_vl"),
        "Qwen3VLForConditionalGeneration" => Some("qwen3_vl"),
        "Qwen3VLMoeForConditionalGeneration" => Some("qwen3_vl_moe"),
        "LlavaForConditionalGeneration" => Some("llava"),
        "LlavaNextForConditionalGeneration" => Some("llava_next"),
        "Mistral3ForConditionalGeneration" => Some("mistral3"),
        "MllamaForConditionalGeneration" => Some("mllama"),
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
    value: &serde_json::Value,
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
    // Vision-language configs hold the language model under `text_config`.
    let nested = value.get("text_config").filter(|t| t.is_object());
    let top = parse_config(&value, origin, "")?;
    let unsupported = |path: String, t: &str| {
        let rule = match UNMODELLED.iter().find(|(u, _)| *u == t) {
            Some((_, why)) => format!("model_type `{t}`: {why}"),
            None => format!(
                "unsupported model_type `{t}`; supported: {} (and the vision-language wrappers \
                 {} through their text_config)",
                SUPPORTED_MODEL_TYPES.join(", "),
                WRAPPERS.iter().map(|w| w.0).collect::<Vec<_>>().join(", ")
            ),
        };
        HfConfigError::new(origin, path, rule)
    };
    // The top level's type, named or read from `architectures`.
    let top_type = match (&top.model_type, &top.architectures) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(archs)) if !archs.is_empty() => match model_type_from_arch(&archs[0]) {
            Some(t) => Some(t.to_string()),
            None => {
                return Err(HfConfigError::new(
                    origin,
                    "architectures[0]",
                    format!(
                        "unsupported architecture `{}` (no model_type given); supported \
                         model_type values: {}",
                        archs[0],
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                ));
            }
        },
        _ => None,
    };
    if let Some(t) = &top_type
        && UNMODELLED.iter().any(|(u, _)| u == t)
    {
        return Err(unsupported("model_type".into(), t));
    }
    let top_tie = top.tie_word_embeddings;
    let top_name = top.name_or_path.clone();
    let (cfg, p, model_type, raw) = match nested {
        Some(t) => {
            let text = parse_config(t, origin, "text_config")?;
            let wrapper_default = top_type
                .as_deref()
                .and_then(|w| WRAPPERS.iter().find(|(n, _)| *n == w))
                .map(|(_, d)| d.to_string());
            let text_type = match (&text.model_type, wrapper_default) {
                (Some(tt), _) => tt.clone(),
                (None, Some(d)) => d,
                (None, None) => {
                    return Err(HfConfigError::new(
                        origin,
                        "text_config.model_type",
                        format!(
                            "missing required key (the wrapper `{}` has no default text model); \
                             supported: {}",
                            top_type.as_deref().unwrap_or("(none)"),
                            SUPPORTED_MODEL_TYPES.join(", ")
                        ),
                    ));
                }
            };
            (text, "text_config.", text_type, t)
        }
        None => match top_type {
            Some(t) => (top, "", t, &value),
            None => {
                return Err(HfConfigError::new(
                    origin,
                    "model_type",
                    format!(
                        "missing required key (nor is `architectures` given); supported: {}",
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                ));
            }
        },
    };
    let key = |k: &str| format!("{p}{k}");
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(unsupported(key("model_type"), &model_type));
    }
    // Whether the config object names a key at all (null included), where the class default
    // differs from "absent".
    let present = |k: &str| raw.get(k).is_some();
    let family = family_of(&model_type);
    let plain = plain_mlp(family);

    let err = |k: &str, rule: String| HfConfigError::new(origin, key(k), rule);
    let req = |v: Option<u32>, k: &str| -> Result<u32, HfConfigError> {
        v.ok_or_else(|| err(k, "missing required key".into()))
    };
    let layers = req(cfg.num_hidden_layers.or(cfg.n_layer), "num_hidden_layers")?;
    let hidden = req(cfg.hidden_size.or(cfg.n_embd), "hidden_size")?;
    let heads = req(
        cfg.num_attention_heads.or(cfg.n_head),
        "num_attention_heads",
    )?;
    // Gemma 3's text config omits keys whose class defaults apply (transformers'
    // Gemma3TextConfig: vocab 262208, head_dim 256, 131072 positions).
    let vocab = match (cfg.vocab_size, family) {
        (Some(v), _) => v,
        (None, "gemma3") => 262_208,
        (None, _) => req(None, "vocab_size")?,
    };
    let seq_len = match (cfg.max_position_embeddings.or(cfg.n_positions), family) {
        (Some(v), _) => v,
        (None, "gemma3") => 131_072,
        // FalconConfig's default (falcon-7b's config omits the key).
        (None, "falcon") => 2048,
        (None, _) => req(None, "max_position_embeddings")?,
    };
    if heads == 0 {
        return Err(err("num_attention_heads", "must be at least 1".into()));
    }
    let kv_heads = match family {
        // GPT-BigCode: one key/value head with multi_query (its default).
        "gpt_bigcode" if cfg.multi_query.unwrap_or(true) => 1,
        // Falcon: multi-query (the default) unless the new decoder architecture, which has
        // num_kv_heads groups.
        "falcon"
            if !cfg.new_decoder_architecture.unwrap_or(false)
                && cfg.multi_query.unwrap_or(true) =>
        {
            1
        }
        _ => cfg
            .num_key_value_heads
            .or(cfg.num_kv_heads)
            .or(cfg.n_head_kv)
            .unwrap_or(heads),
    };
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
    // A gated MLP (gate, up and down projections) whatever the gate's elementwise function, which
    // costs the same; a plain MLP (up and down) likewise, whatever its activation.
    let (act_key, act) = match (
        &cfg.hidden_act,
        &cfg.hidden_activation,
        &cfg.activation_function,
        &cfg.activation,
    ) {
        (Some(a), _, _, _) => ("hidden_act", a.as_str()),
        (None, Some(a), _, _) => ("hidden_activation", a.as_str()),
        (None, None, Some(a), _) => ("activation_function", a.as_str()),
        (None, None, None, Some(a)) => ("activation", a.as_str()),
        (None, None, None, None) => ("hidden_act", "silu"),
    };
    let activation = match act {
        _ if plain => Activation::Gelu,
        "silu" | "swish" | "relu" => Activation::SwiGlu,
        a if a.starts_with("gelu") => Activation::SwiGlu,
        other => {
            return Err(err(
                act_key,
                format!(
                    "unsupported activation `{other}` for the gated MLP of model_type \
                     `{model_type}`; supported: silu, swish, relu, gelu*"
                ),
            ));
        }
    };

    let mut arch = Arch::default();
    // The MLP width; GPT-2, GPT-BigCode (`n_inner`) and Falcon (`ffn_hidden_size`) default to
    // 4 x hidden when absent or null.
    let mut ffn = cfg
        .intermediate_size
        .or(cfg.n_inner)
        .or(cfg.ffn_hidden_size)
        .or_else(|| {
            matches!(family, "gpt2" | "gpt_bigcode" | "falcon").then(|| hidden.saturating_mul(4))
        });
    // Routed experts.
    let experts = match family {
        "mixtral" | "llama4" | "gpt_oss" | "phimoe" | "granitemoe" | "granitemoeshared" => {
            cfg.num_local_experts
        }
        "qwen3_moe" | "qwen2_moe" => cfg.num_experts,
        // OlmoeConfig maps num_local_experts onto num_experts.
        "olmoe" => cfg.num_experts.or(cfg.num_local_experts),
        "deepseek_v2" | "deepseek_v3" | "glm4_moe" | "dots1" => cfg.n_routed_experts,
        "ernie4_5_moe" => cfg.moe_num_experts,
        _ => {
            for (k, v) in [
                ("num_local_experts", cfg.num_local_experts),
                ("num_experts", cfg.num_experts),
                ("n_routed_experts", cfg.n_routed_experts),
                ("moe_num_experts", cfg.moe_num_experts),
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
    if experts == Some(0) {
        let key = match family {
            "qwen3_moe" | "qwen2_moe" => "num_experts",
            "olmoe" if cfg.num_experts.is_some() => "num_experts",
            "deepseek_v2" | "deepseek_v3" | "glm4_moe" | "dots1" => "n_routed_experts",
            "ernie4_5_moe" => "moe_num_experts",
            _ => "num_local_experts",
        };
        return Err(err(
            key,
            format!(
                "0 routed experts: model_type `{model_type}` is a mixture of experts and needs at \
                 least 1 (a dense model is another model_type)"
            ),
        ));
    }
    let moe = match experts {
        None | Some(0) => None,
        Some(experts) => {
            let top_k = match (cfg.num_experts_per_tok, cfg.experts_per_token, cfg.moe_k) {
                (Some(k), _, _) | (None, Some(k), _) | (None, None, Some(k)) => k,
                (None, None, None) => req(None, "num_experts_per_tok")?,
            };
            let expert_ffn = match family {
                "qwen3_moe" | "qwen2_moe" | "deepseek_v2" | "deepseek_v3" | "glm4_moe"
                | "dots1" | "ernie4_5_moe" => {
                    req(cfg.moe_intermediate_size, "moe_intermediate_size")?
                }
                _ => req(cfg.intermediate_size, "intermediate_size")?,
            };
            match family {
                "deepseek_v2" | "deepseek_v3" | "glm4_moe" | "dots1" => {
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
                "granitemoeshared" => {
                    arch.moe_shared_ffn_hidden = cfg.shared_intermediate_size.unwrap_or(0);
                }
                "ernie4_5_moe" => {
                    // MoE on layers start..=end every `interval`-th (Ernie4_5_MoeConfig).
                    arch.moe_first_dense_layers = cfg.moe_layer_start_index.unwrap_or(1);
                    arch.moe_shared_ffn_hidden =
                        cfg.moe_num_shared_experts.unwrap_or(0) * expert_ffn;
                    if let Some(i) = cfg.moe_layer_interval.filter(|&i| i != 1) {
                        return Err(err(
                            "moe_layer_interval",
                            format!(
                                "{i} is not modelled (every layer from moe_layer_start_index on \
                                 is an MoE layer; moe_layer_interval must be 1)"
                            ),
                        ));
                    }
                    if let Some(e) = cfg
                        .moe_layer_end_index
                        .filter(|&e| e != -1 && e != i64::from(layers) - 1)
                    {
                        return Err(err(
                            "moe_layer_end_index",
                            format!(
                                "{e} is not modelled (dense layers after the MoE layers); it \
                                 must be -1 or the last layer ({})",
                                layers.saturating_sub(1)
                            ),
                        ));
                    }
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
        "qwen3" | "qwen3_moe" | "gemma3" | "olmo2" | "olmo3" | "olmoe" | "dots1" | "exaone4"
        | "hunyuan_v1_dense" | "apertus" => true,
        // GLM-4.5 sets `use_qk_norm: true`, GLM-4.5-Air false (transformers' default); Cohere's
        // default is false.
        "glm4_moe" | "cohere" => cfg.use_qk_norm.unwrap_or(false),
        _ => false,
    };
    // gpt-oss' experts have biases on both projections (no config key; the architecture).
    arch.expert_bias = family == "gpt_oss";

    // Local attention.
    // `use_sliding_window` defaults to false in the Qwen and SmolLM3 classes, where the window
    // is an option; elsewhere a `sliding_window` is the architecture's.
    let window_by_default = !matches!(
        family,
        "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "smollm3"
    );
    let window_on = match (cfg.sliding_window, cfg.use_sliding_window) {
        (Some(w), Some(true)) if w > 0 => Some(w),
        (Some(w), None) if w > 0 && window_by_default => Some(w),
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
    if family == "smollm3" && window_on.is_some() {
        return Err(err(
            "use_sliding_window",
            "SmolLM3's sliding window on its NoPE layers only is not modelled (the published \
             config sets use_sliding_window = false)"
                .into(),
        ));
    }
    // dots1 (Qwen's attention): the window covers the layers from max_window_layers on, none
    // by default (max_window_layers = num_hidden_layers).
    let window_on = if family == "dots1" {
        if window_on.is_some() && cfg.max_window_layers.is_some_and(|m| m < layers) {
            return Err(err(
                "max_window_layers",
                "a sliding window on the layers from max_window_layers on is not modelled \
                 (set max_window_layers = num_hidden_layers)"
                    .into(),
            ));
        }
        None
    } else {
        window_on
    };
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
            "cohere2" | "exaone4" | "olmo3" => cfg.sliding_window_pattern.unwrap_or(4),
            _ => 0,
        };
    } else if family == "gemma3" {
        // Gemma3TextConfig's default window.
        arch.attention_window = 4096;
        arch.attention_global_every = cfg.sliding_window_pattern.unwrap_or(6);
    } else if matches!(family, "cohere2" | "olmo3") && !present("sliding_window") {
        // Their classes' default: a 4096-token window on three layers of four.
        arch.attention_window = 4096;
        arch.attention_global_every = cfg.sliding_window_pattern.unwrap_or(4);
    }

    let name_or_path = if p.is_empty() {
        cfg.name_or_path.as_deref()
    } else {
        top_name.as_deref()
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
        tied_embeddings: cfg
            .tie_word_embeddings
            .or(top_tie)
            .unwrap_or_else(|| tied_by_default(family)),
        dropout: [
            cfg.attention_dropout,
            cfg.hidden_dropout,
            cfg.resid_pdrop,
            cfg.embd_pdrop,
            cfg.attn_pdrop,
            cfg.residual_dropout,
            cfg.embedding_dropout,
        ]
        .iter()
        .any(|d| d.unwrap_or(0.0) > 0.0),
        arch,
    })
}
