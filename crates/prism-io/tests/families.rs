//! Model families read from their published HuggingFace `config.json` (fixtures under
//! `tests/data/hf/`, written from the public configs' values): parameter counts against the
//! published totals, the architecture features each family turns on, and a simulation of each.

use std::path::PathBuf;

use prism_core::arch::WindowKind;
use prism_core::job::Model;
use prism_io::hf::model_from_hf_config;

fn data(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(p)
}

fn read(p: &str) -> Model {
    let path = data(p);
    let text = std::fs::read_to_string(&path).unwrap();
    model_from_hf_config(&text, &path.display().to_string()).unwrap()
}

fn b(x: u64) -> f64 {
    x as f64 / 1e9
}

/// `x` (parameters) in billions, checked to be within `tol` (relative) of `published`.
fn assert_published(what: &str, x: u64, published: f64, tol: f64) {
    let got = b(x);
    let err = (got / published - 1.0).abs();
    eprintln!(
        "[{what}] {got:.3} B vs published {published} B ({:+.2}%)",
        100.0 * (got / published - 1.0)
    );
    assert!(err <= tol, "{what}: {got:.3} B vs {published} B ({err:.4})");
}

/// Active parameters in the convention DeepSeek and OpenAI publish: without the input
/// embedding (a lookup, no matrix multiply), with the output head.
/// Routed experts, top-k and expert width of `m` (None for a dense model).
fn experts(m: &Model) -> Option<(u32, u32, u32)> {
    m.moe.as_ref().map(|e| (e.experts, e.top_k, e.ffn_hidden))
}

fn active_without_embedding(m: &Model) -> u64 {
    m.active_params_without_input_embedding()
}

/// DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 4.2 and the model card): 671 B total
/// parameters, 37 B activated per token, plus 14 B of multi-token-prediction weights.
#[test]
fn deepseek_v3() {
    let m = read("hf/deepseek-v3.json");
    let mla = m.arch.mla.expect("MLA");
    assert_eq!(
        (
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim
        ),
        (1536, 512, 128, 64, 128)
    );
    assert_eq!(experts(&m), Some((256, 8, 2048)));
    assert_eq!(
        (
            m.arch.moe_first_dense_layers,
            m.arch.moe_shared_ffn_hidden,
            m.arch.mtp_depth
        ),
        (3, 2048, 1)
    );
    assert_eq!((m.moe_layers(), m.ffn_hidden), (58, 18432));
    // n_group 8, topk_group 4: node-limited routing.
    assert_eq!((m.arch.moe_groups, m.arch.moe_groups_per_token), (8, 4));
    assert_published("DeepSeek-V3 total", m.params(), 671.0, 0.01);
    // 36.63 B: 1.01% below the published figure, which is given in whole billions (any count
    // in [36.5, 37.5) is published as 37 B).
    assert_published(
        "DeepSeek-V3 active",
        active_without_embedding(&m),
        37.0,
        0.011,
    );
    // MTP module: one MoE layer, the 2h x h projection, norms (11.6 B), plus the copies of
    // the embedding and head its checkpoint holds (1.85 B), against the model card's "14B of
    // MTP module weights" (its exact composition is not documented, hence the wider bound).
    assert_published(
        "DeepSeek-V3 MTP (+ checkpoint copies of embedding/head)",
        m.mtp_params() + m.embedding_params(),
        14.0,
        0.05,
    );
}

/// DeepSeek-V2 (Liu et al. 2024, arXiv:2405.04434): 236 B total, 21 B activated.
#[test]
fn deepseek_v2() {
    let m = read("hf/deepseek-v2.json");
    assert_eq!(
        (m.arch.moe_first_dense_layers, m.arch.moe_shared_ffn_hidden),
        (1, 2 * 1536)
    );
    assert_published("DeepSeek-V2 total", m.params(), 236.0, 0.01);
    assert_published(
        "DeepSeek-V2 active",
        active_without_embedding(&m),
        21.0,
        0.01,
    );
}

/// Qwen3-235B-A22B (Qwen3 technical report, arXiv:2505.09388, Table 2): 235 B total, 22 B
/// activated; Qwen3-8B: 8.2 B.
#[test]
fn qwen3() {
    let m = read("hf/qwen3-235b-a22b.json");
    assert!(m.arch.qk_norm);
    assert_eq!(experts(&m), Some((128, 8, 1536)));
    assert_published("Qwen3-235B-A22B total", m.params(), 235.0, 0.01);
    assert_published("Qwen3-235B-A22B active", m.active_params(), 22.0, 0.01);
    let d = read("hf/qwen3-8b.json");
    assert_eq!(d.arch.attention_window, 0);
    assert_published("Qwen3-8B total", d.params(), 8.2, 0.01);
}

/// Gemma 2 27B (Gemma Team 2024, arXiv:2408.00118, Table 1: 27.2 B with embeddings) and
/// Gemma 3 27B (arXiv:2503.19786: 27 B, the text decoder; the 0.4 B vision encoder is not
/// simulated).
#[test]
fn gemma() {
    let g2 = read("hf/gemma2-27b.json");
    assert!(g2.tied_embeddings);
    assert_eq!(
        (g2.arch.attention_window, g2.arch.attention_global_every),
        (4096, 2)
    );
    assert_published("Gemma 2 27B total", g2.params(), 27.2, 0.01);
    let g3 = read("hf/gemma3-27b.json");
    assert_eq!(g3.name, "gemma3-27b");
    assert!(g3.tied_embeddings && g3.arch.qk_norm);
    assert_eq!((g3.vocab, g3.head_dim, g3.layers), (262_208, 128, 62));
    assert_eq!(
        (g3.arch.attention_window, g3.arch.attention_global_every),
        (1024, 6)
    );
    // Five local layers, then a global one.
    let mut g3s = g3.clone();
    g3s.seq_len = 4096;
    let pattern: Vec<bool> = (0..12).map(|l| g3s.local_attention(l).is_some()).collect();
    assert_eq!(
        pattern,
        [
            true, true, true, true, true, false, true, true, true, true, true, false
        ]
    );
    assert_published("Gemma 3 27B total", g3.params(), 27.0, 0.01);
}

/// Phi-3 (Abdin et al. 2024, arXiv:2404.14219): mini 3.8 B, medium 14 B; a 2047-token sliding
/// window on every layer.
#[test]
fn phi3() {
    let mini = read("hf/phi3-mini-4k.json");
    assert_eq!(
        (mini.arch.attention_window, mini.arch.attention_global_every),
        (2047, 0)
    );
    assert_published("Phi-3-mini total", mini.params(), 3.8, 0.01);
    let medium = read("hf/phi3-medium-4k.json");
    assert_published("Phi-3-medium total", medium.params(), 14.0, 0.01);
}

/// Llama 4 Maverick (Meta, 2025 model card): 400 B total, 17 B active, 128 routed experts
/// (top-1) and a shared expert on every second layer, chunked attention (8192) on three of
/// four layers.
#[test]
fn llama4_maverick() {
    let m = read("hf/llama4-maverick.json");
    assert_eq!(
        (m.moe_layers(), m.ffn_hidden, m.arch.moe_shared_ffn_hidden),
        (24, 16384, 8192)
    );
    assert!(!m.is_moe_layer(0) && m.is_moe_layer(1));
    assert_eq!(
        (
            m.arch.attention_window,
            m.arch.attention_window_kind,
            m.arch.attention_global_every
        ),
        (8192, WindowKind::Chunked, 4)
    );
    assert_published("Llama 4 Maverick total", m.params(), 400.0, 0.01);
    // 17.19 B: published in whole billions.
    assert_published("Llama 4 Maverick active", m.active_params(), 17.0, 0.015);
}

/// gpt-oss-120b (OpenAI 2025 model card, Table 1): 116.83 B total, 5.13 B active per token;
/// sliding window of 128 on every other layer.
#[test]
fn gpt_oss() {
    let m = read("hf/gpt-oss-120b.json");
    assert_eq!(experts(&m), Some((128, 4, 2880)));
    assert_eq!(
        (m.arch.attention_window, m.arch.attention_global_every),
        (128, 2)
    );
    // Its experts carry biases (the architecture; no config key says so), no other family's.
    assert!(m.arch.expert_bias);
    assert!(!read("hf/qwen3-30b-a3b.json").arch.expert_bias);
    assert_published("gpt-oss-120b total", m.params(), 116.83, 0.01);
    assert_published(
        "gpt-oss-120b active",
        active_without_embedding(&m),
        5.13,
        0.01,
    );
}

/// Settings Prism cannot model are refused by the key that sets them.
#[test]
fn unmodelled_settings_are_refused_by_name() {
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "deepseek-v3.json",
            "\"moe_layer_freq\": 1",
            "\"moe_layer_freq\": 2",
            "moe_layer_freq",
        ),
        (
            "qwen3-235b-a22b.json",
            "\"mlp_only_layers\": []",
            "\"mlp_only_layers\": [3]",
            "mlp_only_layers",
        ),
        (
            "qwen3-8b.json",
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true, \"sliding_window\": 4096",
            "use_sliding_window",
        ),
        (
            "gpt-oss-120b.json",
            "\"sliding_attention\",\n    \"full_attention\"",
            "\"full_attention\",\n    \"full_attention\"",
            "layer_types",
        ),
        (
            "llama4-maverick.json",
            "\"no_rope_layers\": [\n      1,",
            "\"no_rope_layers\": [\n      0,",
            "text_config.no_rope_layers",
        ),
        (
            "deepseek-v3.json",
            "\"kv_lora_rank\": 512,",
            "",
            "kv_lora_rank",
        ),
    ];
    for (file, from, to, key) in cases {
        let text = std::fs::read_to_string(data(&format!("hf/{file}"))).unwrap();
        assert!(text.contains(from), "{file}: fixture lacks {from}");
        let changed = text.replacen(from, to, 1);
        let e = model_from_hf_config(&changed, file).unwrap_err();
        assert_eq!(e.path, *key, "{file}: {e}");
    }
}

/// Each family simulates from its unmodified config through a job file.
#[test]
fn every_family_simulates_from_its_config() {
    for (file, seq, tp, ep) in [
        ("deepseek-v3.json", 4096, 1, 8),
        ("deepseek-v2.json", 4096, 1, 8),
        ("qwen3-8b.json", 4096, 2, 1),
        ("qwen3-235b-a22b.json", 4096, 4, 8),
        ("gemma2-27b.json", 8192, 8, 1),
        ("gemma3-27b.json", 8192, 8, 1),
        ("phi3-mini-4k.json", 4096, 1, 1),
        ("phi3-medium-4k.json", 4096, 2, 1),
        ("llama4-maverick.json", 8192, 8, 8),
        ("gpt-oss-120b.json", 4096, 8, 8),
        ("glm-4.5-air.json", 4096, 4, 8),
        ("qwen1.5-moe-a2.7b.json", 4096, 1, 4),
        ("gemma-7b.json", 8192, 2, 1),
        ("olmo2-7b.json", 4096, 1, 1),
        ("olmoe-1b-7b.json", 4096, 1, 8),
        ("phi3.5-moe.json", 4096, 2, 8),
        ("pythia-12b.json", 2048, 4, 1),
        ("gpt2-xl.json", 1024, 1, 1),
        ("starcoder-15b.json", 8192, 1, 1),
        ("starcoder2-3b.json", 16384, 1, 1),
        ("falcon-7b.json", 2048, 1, 1),
        ("falcon-40b.json", 2048, 8, 1),
        ("granite-3.0-8b.json", 4096, 2, 1),
        ("command-r.json", 8192, 8, 1),
        ("dots-llm1.json", 4096, 2, 8),
        ("ernie4.5-21b-a3b.json", 4096, 1, 8),
        ("smollm3-3b.json", 4096, 1, 1),
        ("glm4-9b-0414.json", 8192, 2, 1),
        ("phi-2.json", 2048, 1, 1),
        ("nemotron4-340b.json", 4096, 8, 1),
        ("qwen2.5-vl-7b.json", 8192, 2, 1),
        ("llava-1.5-7b.json", 4096, 1, 1),
    ] {
        let path = data(&format!("hf/{file}"));
        let job = format!(
            "[model]\nhf_config = \"{}\"\nseq_len = {seq}\n[cluster]\npreset = \"dgx-h100\"\n\
             nodes = 8\n[parallel]\ntp = {tp}\npp = 1\nep = {ep}\n[training]\nglobal_batch = {}\n",
            path.display(),
            64 / tp
        );
        let loaded = prism_io::jobfile::load_job_str(&job, file, None, &[])
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let j = loaded.job;
        let r = prism_core::simulate(
            &j,
            &prism_core::SimOptions {
                mode: prism_core::Mode::Reduced,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        let s = &r.summary;
        eprintln!(
            "[{file}] {} layers, {:.1} B params: iteration {:.3} s, MFU {:.3}",
            j.model.layers,
            b(j.model.params()),
            s.iteration_time_s,
            s.mfu
        );
        assert!(
            s.iteration_time_s > 0.0 && s.mfu > 0.0 && s.mfu < 1.0,
            "{file}"
        );
    }
}

/// The model presets of the families equal the models read from their configs (the name and
/// the training sequence length aside).
#[test]
fn presets_match_the_configs() {
    for (preset, file) in [
        ("deepseek-v2", "deepseek-v2.json"),
        ("deepseek-v3", "deepseek-v3.json"),
        ("qwen3-235b-a22b", "qwen3-235b-a22b.json"),
        ("gemma3-27b", "gemma3-27b.json"),
        ("llama4-maverick", "llama4-maverick.json"),
        ("qwen3-30b-a3b", "qwen3-30b-a3b.json"),
        ("gpt-oss-120b", "gpt-oss-120b.json"),
        ("kimi-k2", "kimi-k2.json"),
        ("glm-4.5-air", "glm-4.5-air.json"),
        ("nemotron4-340b", "nemotron4-340b.json"),
    ] {
        let p = preset_model(preset);
        let hf = read(&format!("hf/{file}"));
        let hf = Model {
            name: p.name.clone(),
            seq_len: p.seq_len,
            // The HF head_dim of an MLA model is its query/key width, as the preset's.
            ..hf
        };
        assert_eq!(p, hf, "{preset}");
    }
}

/// Qwen3-30B-A3B (Qwen3 technical report, arXiv:2505.09388, Table 2): 30.5 B total, 3.3 B
/// activated (its preset equals this model: `presets_match_the_configs`).
#[test]
fn qwen3_30b_a3b() {
    let m = read("hf/qwen3-30b-a3b.json");
    assert_published("Qwen3-30B-A3B total", m.params(), 30.5, 0.01);
    // 3.35 B with the embeddings (the count Qwen's other figures match, e.g. 22.19 B for
    // 235B-A22B) against the published 3.3 B: +1.6%.
    assert_published("Qwen3-30B-A3B active", m.active_params(), 3.3, 0.02);
}

/// The gpt-oss-20b preset keeps the model card's totals (20.9 B total, 3.61 B active without
/// the input embedding; the 120b preset equals its config: `presets_match_the_configs`).
#[test]
fn gpt_oss_presets() {
    let p20 = preset_model("gpt-oss-20b");
    assert!(p20.arch.expert_bias);
    assert_published("gpt-oss-20b total", p20.params(), 20.91, 0.01);
    assert_published(
        "gpt-oss-20b active",
        active_without_embedding(&p20),
        3.61,
        0.01,
    );
}

/// The model of preset `name`, through a minimal job (as a user's job file would load it).
fn preset_model(name: &str) -> Model {
    let text = format!(
        "name = \"t\"\n[model]\npreset = \"{name}\"\n[cluster]\npreset = \"dgx-h100\"\n\
         nodes = 1\n[parallel]\ntp = 1\npp = 1\ndp = 8\n[training]\nglobal_batch = 8\n"
    );
    prism_io::jobfile::load_job_str(&text, "preset job", None, &[])
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .job
        .model
}

/// Qwen1.5-MoE-A2.7B (Qwen team 2024, model card: 14.3 B total parameters, 2.7 B activated;
/// `model_type` `qwen2_moe`): 60 routed experts of width 1408, top-4, plus one shared expert of
/// width 5632 on every layer, multi-head attention (16 heads), no query/key norms. The fixture
/// holds the architecture keys of the published config.json.
#[test]
fn qwen1_5_moe_a2_7b() {
    let m = read("hf/qwen1.5-moe-a2.7b.json");
    assert_eq!(experts(&m), Some((60, 4, 1408)));
    assert_eq!(
        (
            m.arch.moe_shared_ffn_hidden,
            m.arch.moe_layer_step,
            m.moe_layers()
        ),
        (5632, 1, 24)
    );
    assert!(!m.arch.qk_norm && m.arch.mla.is_none());
    assert_published("Qwen1.5-MoE-A2.7B total", m.params(), 14.3, 0.01);
    assert_published("Qwen1.5-MoE-A2.7B active", m.active_params(), 2.7, 0.01);
}

/// GLM-4.5-Air (Zhipu AI / Z.ai 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation
/// Models", arXiv:2508.06471: 106 B total parameters, 12 B activated; `model_type` `glm4_moe`):
/// DeepSeek-V3's MoE layout (one leading dense layer, 128 routed experts of width 1408 with
/// top-8, one shared expert, one MTP layer) with grouped-query attention (96 query heads of
/// 128, 8 KV heads: the query width 12288 is three times the hidden size 4096). The fixture is
/// the model's config as transformers 4.54.1 loads it.
#[test]
fn glm_4_5_air() {
    let m = read("hf/glm-4.5-air.json");
    assert_eq!(experts(&m), Some((128, 8, 1408)));
    assert_eq!(
        (
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.ffn_hidden,
            m.arch.moe_first_dense_layers,
            m.arch.moe_shared_ffn_hidden,
            m.arch.mtp_depth
        ),
        (96, 8, 128, 10944, 1, 1408, 1)
    );
    assert!(m.arch.mla.is_none() && !m.arch.qk_norm);
    assert_eq!(m.moe_layers(), 45);
    // n_group 1: no group-limited routing.
    assert_eq!(m.arch.moe_groups, 0);
    // Figures published in whole billions (106 B total, 12 B activated); the MTP layer is not
    // part of them, as for DeepSeek-V3, and the activated count leaves out both embedding
    // matrices (with the untied output head, 0.62 B, it would be 12.8 B).
    assert_published("GLM-4.5-Air total", m.params(), 106.0, 0.01);
    let head = m.vocab as u64 * m.hidden as u64;
    assert_published(
        "GLM-4.5-Air active",
        active_without_embedding(&m) - head,
        12.0,
        0.02,
    );
}

/// Kimi K2 (Moonshot AI 2025 model card: 1 T total, 32 B activated; `model_type` `kimi_k2`, the
/// DeepSeek-V3 architecture): read from its config as DeepSeek-V3 with 384 experts and 64
/// heads (the preset equals it: `presets_match_the_configs`).
#[test]
fn kimi_k2() {
    let m = read("hf/kimi-k2.json");
    assert_eq!(experts(&m), Some((384, 8, 2048)));
    assert_eq!(
        (m.heads, m.arch.moe_first_dense_layers, m.arch.mtp_depth),
        (64, 1, 0)
    );
    assert!(m.arch.mla.is_some());
    // 1026.4 B and 32.86 B against figures published in whole units (1 T, 32 B).
    assert_published("Kimi K2 total", m.params(), 1000.0, 0.03);
    assert_published("Kimi K2 active", m.active_params(), 32.0, 0.03);
}

/// More families read from their published configs (fixtures hold the architecture keys of the
/// public `config.json`s), against the totals their authors publish. Prism counts the weight
/// matrices, embeddings and norms; biases and learned position embeddings (GPT-2, StarCoder) are
/// left out, below 0.2% here.
#[test]
fn more_families_match_published_totals() {
    for (file, what, published, tol) in [
        // Gemma Team 2024, arXiv:2403.08295, Table 2: 786,825,216 embedding + 7,751,248,896
        // non-embedding parameters (tied embeddings).
        ("gemma-7b.json", "Gemma 7B", 8.538, 0.001),
        // OLMo 2 7B (model card, allenai/OLMo-2-1124-7B): 7.30 B.
        ("olmo2-7b.json", "OLMo 2 7B", 7.30, 0.01),
        // Muennighoff et al. 2024, "OLMoE", arXiv:2409.02060: 6.9 B total.
        ("olmoe-1b-7b.json", "OLMoE-1B-7B", 6.9, 0.01),
        // Abdin et al. 2024, Phi-3 report, arXiv:2404.14219: Phi-3.5-MoE, 41.9 B total.
        ("phi3.5-moe.json", "Phi-3.5-MoE", 41.9, 0.01),
        // Biderman et al. 2023, Pythia, arXiv:2304.01373, Table 1: 11,846,072,320.
        ("pythia-12b.json", "Pythia 12B", 11.846, 0.001),
        // GPT-2 XL: 1,557,611,200 parameters (transformers' count of the gpt2-xl checkpoint),
        // 1.6 M of them learned positions.
        ("gpt2-xl.json", "GPT-2 XL", 1.5576, 0.005),
        // Li et al. 2023, StarCoder, arXiv:2305.06161: 15.5 B.
        ("starcoder-15b.json", "StarCoder", 15.5, 0.01),
        // Lozhkov et al. 2024, StarCoder2, arXiv:2402.19173: 3 B (3.03 B, tied embeddings).
        ("starcoder2-3b.json", "StarCoder2-3B", 3.03, 0.01),
        // IBM 2024, Granite 3.0 report: Granite-3.0-8B, 8.1 B.
        ("granite-3.0-8b.json", "Granite 3.0 8B", 8.1, 0.01),
        // Cohere, Command R (c4ai-command-r-v01): 35 B.
        ("command-r.json", "Command R", 35.0, 0.01),
        // rednote hilab 2025, dots.llm1 report, arXiv:2506.05767: 142 B total.
        ("dots-llm1.json", "dots.llm1", 142.0, 0.01),
        // GLM-4-9B-0414: 9.4 B.
        ("glm4-9b-0414.json", "GLM-4-9B-0414", 9.4, 0.01),
        // Microsoft 2023, Phi-2: 2.7 B (2.78 B).
        ("phi-2.json", "Phi-2", 2.78, 0.01),
        // NVIDIA 2024, Nemotron-4 340B report, arXiv:2406.11704, Table 1: 9.4 B embedding +
        // 331.6 B non-embedding.
        ("nemotron4-340b.json", "Nemotron-4 340B", 341.0, 0.005),
        // Hugging Face 2025, SmolLM3: 3 B (3.08 B, tied embeddings).
        ("smollm3-3b.json", "SmolLM3-3B", 3.08, 0.01),
        // LLaVA-1.5-7B's language model, Vicuna-7B (Llama 2 7B, 6.74 B; vocabulary 32,064).
        (
            "llava-1.5-7b.json",
            "LLaVA-1.5-7B (language model)",
            6.74,
            0.01,
        ),
    ] {
        let m = read(&format!("hf/{file}"));
        assert_published(what, m.params(), published, tol);
    }
    // Active parameters per token.
    let olmoe = read("hf/olmoe-1b-7b.json");
    assert_published("OLMoE-1B-7B active", olmoe.active_params(), 1.3, 0.02);
    let phimoe = read("hf/phi3.5-moe.json");
    assert_published("Phi-3.5-MoE active", phimoe.active_params(), 6.6, 0.01);
    let dots = read("hf/dots-llm1.json");
    assert_published("dots.llm1 active", dots.active_params(), 14.0, 0.01);
}

/// What each added family turns on: MLP form, key/value heads, experts, windows, norms and
/// tied embeddings, from keys (and class defaults) of its config.
#[test]
fn added_families_read_their_architecture() {
    use prism_core::job::Activation;
    // Plain two-matrix MLPs, whatever the activation (GeLU, squared ReLU).
    for file in [
        "pythia-12b.json",
        "gpt2-xl.json",
        "starcoder-15b.json",
        "starcoder2-3b.json",
        "falcon-7b.json",
        "falcon-40b.json",
        "phi-2.json",
        "nemotron4-340b.json",
    ] {
        assert_eq!(
            read(&format!("hf/{file}")).activation,
            Activation::Gelu,
            "{file}"
        );
    }
    for file in [
        "gemma-7b.json",
        "olmo2-7b.json",
        "granite-3.0-8b.json",
        "command-r.json",
        "glm4-9b-0414.json",
        "smollm3-3b.json",
    ] {
        assert_eq!(
            read(&format!("hf/{file}")).activation,
            Activation::SwiGlu,
            "{file}"
        );
    }
    // GPT-2: the `n_*` keys; 4 x hidden MLP when n_inner is absent; tied; dropout 0.1.
    let g = read("hf/gpt2-xl.json");
    assert_eq!(
        (g.layers, g.hidden, g.heads, g.ffn_hidden, g.seq_len),
        (48, 1600, 25, 6400, 1024)
    );
    assert!(g.tied_embeddings && g.dropout);
    // Multi-query attention: StarCoder (multi_query), Falcon-7B (multi_query, old decoder);
    // Falcon-40B's new decoder architecture has 8 key/value groups.
    assert_eq!(read("hf/starcoder-15b.json").kv_heads, 1);
    let f7 = read("hf/falcon-7b.json");
    assert_eq!(
        (f7.kv_heads, f7.ffn_hidden, f7.seq_len, f7.tied_embeddings),
        (1, 4 * 4544, 2048, true)
    );
    let f40 = read("hf/falcon-40b.json");
    assert_eq!((f40.kv_heads, f40.head_dim), (8, 64));
    // Query/key norms.
    for (file, qk) in [
        ("olmo2-7b.json", true),
        ("olmoe-1b-7b.json", true),
        ("dots-llm1.json", true),
        ("command-r.json", false),
        ("granite-3.0-8b.json", false),
    ] {
        assert_eq!(read(&format!("hf/{file}")).arch.qk_norm, qk, "{file}");
    }
    // Tied embeddings from the class default when the config omits the key.
    assert!(read("hf/gemma-7b.json").tied_embeddings);
    assert!(read("hf/command-r.json").tied_embeddings);
    assert!(read("hf/starcoder2-3b.json").tied_embeddings);
    assert!(!read("hf/olmoe-1b-7b.json").tied_embeddings);
    // Windows: StarCoder2 slides 4096 tokens on every layer; Phi-3.5-MoE's window is its whole
    // context; dots1's window starts at max_window_layers = all layers, so none.
    let sc2 = read("hf/starcoder2-3b.json");
    assert_eq!(
        (sc2.arch.attention_window, sc2.arch.attention_global_every),
        (4096, 0)
    );
    assert_eq!(read("hf/phi3.5-moe.json").arch.attention_window, 131_072);
    assert_eq!(dots_window(&read("hf/dots-llm1.json")), 0);
    // MoE layouts.
    let phimoe = read("hf/phi3.5-moe.json");
    assert_eq!(experts(&phimoe), Some((16, 2, 6400)));
    let olmoe = read("hf/olmoe-1b-7b.json");
    assert_eq!(experts(&olmoe), Some((64, 8, 1024)));
    let dots = read("hf/dots-llm1.json");
    assert_eq!(experts(&dots), Some((128, 6, 1408)));
    assert_eq!(
        (
            dots.arch.moe_first_dense_layers,
            dots.arch.moe_shared_ffn_hidden,
            dots.ffn_hidden
        ),
        (1, 2 * 1408, 10944)
    );
    let ernie = read("hf/ernie4.5-21b-a3b.json");
    assert_eq!(experts(&ernie), Some((64, 6, 1536)));
    assert_eq!(
        (
            ernie.arch.moe_first_dense_layers,
            ernie.arch.moe_shared_ffn_hidden,
            ernie.ffn_hidden,
            ernie.moe_layers(),
            ernie.tied_embeddings
        ),
        (1, 2 * 1536, 12288, 27, true)
    );
}

fn dots_window(m: &Model) -> u32 {
    m.arch.attention_window
}

/// Vision-language configs: the language model under `text_config`, or flat (Qwen2.5-VL) with
/// the vision tower's keys beside it. Qwen2.5-VL-7B's language model has Qwen2-7B's shape.
#[test]
fn vision_language_configs_read_their_language_model() {
    let vl = read("hf/qwen2.5-vl-7b.json");
    let q = read("hf/qwen2-7b.json");
    assert_eq!(
        Model {
            name: q.name.clone(),
            seq_len: q.seq_len,
            ..vl
        },
        q
    );
    // LLaVA: the wrapper's text_config (Vicuna 7B, a Llama) is the model; a text config that
    // names no model_type is the wrapper's default text model (llama).
    let text = std::fs::read_to_string(data("hf/llava-1.5-7b.json")).unwrap();
    let llava = model_from_hf_config(&text, "llava.json").unwrap();
    assert_eq!((llava.layers, llava.hidden, llava.vocab), (32, 4096, 32064));
    let unnamed = text.replacen("\"model_type\": \"llama\",", "", 1);
    assert_ne!(unnamed, text);
    assert_eq!(model_from_hf_config(&unnamed, "llava.json").unwrap(), llava);
    // A text config of an unsupported type is refused at its path.
    let odd = text.replacen("\"model_type\": \"llama\"", "\"model_type\": \"rwkv\"", 1);
    let e = model_from_hf_config(&odd, "llava.json").unwrap_err();
    assert_eq!(e.path, "text_config.model_type", "{e}");
}

/// Architectures Prism does not model are refused with the reason, at `model_type`.
#[test]
fn unmodelled_architectures_say_why() {
    for (cfg, path, why) in [
        (
            r#"{"model_type": "mllama", "text_config": {"model_type": "mllama_text_model",
                "num_hidden_layers": 40, "hidden_size": 4096}}"#,
            "model_type",
            "cross-attention",
        ),
        (
            r#"{"model_type": "llava", "text_config": {"model_type": "mllama_text_model"}}"#,
            "text_config.model_type",
            "cross-attention",
        ),
        (r#"{"model_type": "minimax"}"#, "model_type", "lightning"),
        (
            r#"{"model_type": "qwen3_next"}"#,
            "model_type",
            "linear attention",
        ),
        (
            r#"{"model_type": "granitemoehybrid"}"#,
            "model_type",
            "Mamba",
        ),
        (
            r#"{"architectures": ["MllamaForConditionalGeneration"]}"#,
            "model_type",
            "cross-attention",
        ),
        (
            r#"{"model_type": "deepseek_v32"}"#,
            "model_type",
            "sparse attention",
        ),
    ] {
        let e = model_from_hf_config(cfg, "c.json").unwrap_err();
        assert_eq!(e.path, path, "{e}");
        assert!(e.rule.contains(why), "{e}");
    }
    // ERNIE 4.5's MoE interval and end index beyond what Prism models.
    let text = std::fs::read_to_string(data("hf/ernie4.5-21b-a3b.json")).unwrap();
    for (from, to, key) in [
        (
            "\"moe_layer_interval\": 1",
            "\"moe_layer_interval\": 2",
            "moe_layer_interval",
        ),
        (
            "\"moe_layer_end_index\": 27",
            "\"moe_layer_end_index\": 20",
            "moe_layer_end_index",
        ),
    ] {
        let changed = text.replacen(from, to, 1);
        assert_ne!(changed, text, "{from}");
        let e = model_from_hf_config(&changed, "e.json").unwrap_err();
        assert_eq!(e.path, key, "{e}");
    }
    // dots1 with a window on its upper layers, SmolLM3 with its NoPE-layer window.
    let dots = std::fs::read_to_string(data("hf/dots-llm1.json")).unwrap();
    let changed = dots
        .replacen("\"max_window_layers\": 62", "\"max_window_layers\": 28", 1)
        .replacen("\"sliding_window\": null", "\"sliding_window\": 4096", 1);
    let e = model_from_hf_config(&changed, "d.json").unwrap_err();
    assert_eq!(e.path, "max_window_layers", "{e}");
    let smol = std::fs::read_to_string(data("hf/smollm3-3b.json")).unwrap();
    let changed = smol
        .replacen(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
            1,
        )
        .replacen("\"sliding_window\": null", "\"sliding_window\": 4096", 1);
    let e = model_from_hf_config(&changed, "s.json").unwrap_err();
    assert_eq!(e.path, "use_sliding_window", "{e}");
}

/// The remaining families, each from a config holding its transformers class's default sizes
/// (what `AutoConfig` writes for a fresh model of that type): the feature each turns on.
#[test]
fn families_from_their_class_defaults() {
    let read_str =
        |json: &str| model_from_hf_config(json, "c.json").unwrap_or_else(|e| panic!("{e}"));
    let llama_like = r#""num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096"#;
    // OLMo 3: a 4096-token window on three layers of four (the class default when the config
    // has no sliding_window and no layer_types), query/key norms.
    let m = read_str(&format!(r#"{{"model_type": "olmo3", {llama_like}}}"#));
    assert_eq!(
        (
            m.arch.attention_window,
            m.arch.attention_global_every,
            m.arch.qk_norm
        ),
        (4096, 4, true)
    );
    // ... and per layer_types when given: every 4th layer full.
    let types: Vec<String> = (0..32)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "\"full_attention\"".to_string()
            } else {
                "\"sliding_attention\"".to_string()
            }
        })
        .collect();
    let m = read_str(&format!(
        r#"{{"model_type": "olmo3", {llama_like}, "sliding_window": 2048, "layer_types": [{}]}}"#,
        types.join(",")
    ));
    assert_eq!(
        (m.arch.attention_window, m.arch.attention_global_every),
        (2048, 4)
    );
    // Cohere 2: window 4096, sliding_window_pattern 4; tied embeddings by default.
    let m = read_str(&format!(
        r#"{{"model_type": "cohere2", {llama_like}, "sliding_window": 4096, "sliding_window_pattern": 4}}"#
    ));
    assert_eq!(
        (m.arch.attention_window, m.arch.attention_global_every),
        (4096, 4)
    );
    assert!(m.tied_embeddings);
    // EXAONE 4: the same pattern, query/key norms; no window when sliding_window is null.
    let m = read_str(&format!(
        r#"{{"model_type": "exaone4", {llama_like}, "sliding_window": 4096, "sliding_window_pattern": 4}}"#
    ));
    assert_eq!(
        (
            m.arch.attention_window,
            m.arch.attention_global_every,
            m.arch.qk_norm
        ),
        (4096, 4, true)
    );
    let m = read_str(&format!(
        r#"{{"model_type": "exaone4", {llama_like}, "sliding_window": null}}"#
    ));
    assert_eq!(m.arch.attention_window, 0);
    // Llama-shaped families: a gated MLP and nothing else turned on.
    for t in [
        "olmo",
        "internlm2",
        "hunyuan_v1_dense",
        "ernie4_5",
        "seed_oss",
        "granite",
        "glm4",
    ] {
        let m = read_str(&format!(r#"{{"model_type": "{t}", {llama_like}}}"#));
        assert_eq!(m.activation, prism_core::job::Activation::SwiGlu, "{t}");
        assert!(m.moe.is_none() && m.arch.attention_window == 0, "{t}");
        assert_eq!(m.arch.qk_norm, t == "hunyuan_v1_dense", "{t}");
        assert_eq!(m.tied_embeddings, t == "ernie4_5", "{t}");
    }
    // Seed-OSS trains with residual dropout (its published config: 0.1).
    let m = read_str(&format!(
        r#"{{"model_type": "seed_oss", {llama_like}, "residual_dropout": 0.1}}"#
    ));
    assert!(m.dropout);
    // Plain MLPs: Apertus (xIELU, with query/key norms), Arcee (squared ReLU).
    for (t, act, qk) in [("apertus", "xielu", true), ("arcee", "relu2", false)] {
        let m = read_str(&format!(
            r#"{{"model_type": "{t}", {llama_like}, "hidden_act": "{act}"}}"#
        ));
        assert_eq!(m.activation, prism_core::job::Activation::Gelu, "{t}");
        assert_eq!(m.arch.qk_norm, qk, "{t}");
    }
    // Granite MoE (8 experts, top-2, expert width = intermediate_size); its shared variant adds
    // a gated shared MLP of shared_intermediate_size.
    let m = read_str(&format!(
        r#"{{"model_type": "granitemoe", {llama_like}, "num_local_experts": 8, "num_experts_per_tok": 2}}"#
    ));
    assert_eq!(experts(&m), Some((8, 2, 11008)));
    let m = read_str(&format!(
        r#"{{"model_type": "granitemoeshared", {llama_like}, "num_local_experts": 8,
            "num_experts_per_tok": 2, "shared_intermediate_size": 1024}}"#
    ));
    assert_eq!(m.arch.moe_shared_ffn_hidden, 1024);
    // Qwen3-VL and Qwen3-VL-MoE: their text models are Qwen3 (query/key norms) and Qwen3-MoE.
    let m = read_str(&format!(
        r#"{{"model_type": "qwen3_vl", "text_config": {{"model_type": "qwen3_vl_text", {llama_like},
            "head_dim": 128}}, "vision_config": {{"depth": 27}}}}"#
    ));
    assert!(m.arch.qk_norm && m.moe.is_none());
    let m = read_str(&format!(
        r#"{{"model_type": "qwen3_vl_moe", "text_config": {{"model_type": "qwen3_vl_moe_text",
            {llama_like}, "num_experts": 60, "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408, "decoder_sparse_step": 1, "mlp_only_layers": []}}}}"#
    ));
    assert_eq!(experts(&m), Some((60, 4, 1408)));
    // Mistral 3's text config without a model_type is a Mistral; the wrapper's tie applies
    // when the text config has none.
    let m = read_str(&format!(
        r#"{{"model_type": "mistral3", "tie_word_embeddings": true,
            "text_config": {{{llama_like}, "num_key_value_heads": 8}}}}"#
    ));
    assert_eq!((m.kv_heads, m.tied_embeddings), (8, true));
}
