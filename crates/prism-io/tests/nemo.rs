//! `prism import nemo`: NeMo training configs read into jobs, checked against the models they
//! describe (Prism's presets of the same models), the job a Megatron-LM command line with the
//! same settings gives (`prism import megatron`), and NeMo's own defaults.

use std::path::PathBuf;

use prism_core::job::{Job, PipelineP2p, Precision, Schedule};
use prism_io::megatron_args::{ImportOptions, import_megatron};
use prism_io::nemo::{NemoOptions, import_nemo};

fn data(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/nemo")
        .join(p)
}

fn opts() -> NemoOptions {
    NemoOptions {
        machine: ImportOptions {
            cluster: "dgx-h100".into(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn load(toml: &str) -> Job {
    prism_io::jobfile::load_job_str(toml, "imported", None, &[])
        .unwrap_or_else(|e| panic!("{e}\n{toml}"))
        .job
}

fn import_text(text: &str, o: &NemoOptions) -> (String, Job) {
    let imported = import_nemo(text, "config.yaml", o).unwrap_or_else(|e| panic!("{e}"));
    let job = load(&imported.toml);
    (imported.toml, job)
}

fn import(file: &str, o: &NemoOptions) -> (String, Job) {
    import_text(&std::fs::read_to_string(data(file)).unwrap(), o)
}

/// Asserts that `model` is preset `name`'s but for the name and the (padded) vocabulary.
fn assert_preset_but_vocab(model: &prism_core::job::Model, name: &str, toml: &str) {
    let p = load(&format!(
        "[model]\npreset = \"{name}\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 1\n\
         [parallel]\ntp = 1\npp = 1\ndp = 8\n[training]\nglobal_batch = 8\n"
    ))
    .model;
    assert_eq!(
        prism_core::job::Model {
            name: p.name.clone(),
            vocab: p.vocab,
            ..model.clone()
        },
        p,
        "{toml}"
    );
}

/// Llama 3 70B in a launcher-style config: the model is the `llama3-70b` preset but for the
/// vocabulary, which NeMo pads as Megatron does (128,256 to a multiple of 128 x tp 4 =
/// 128,512); the layout, batch and overlaps are the config's, and each key names its line.
#[test]
fn llama3_70b_config_is_the_preset_model() {
    let (toml, job) = import("llama3-70b.yaml", &opts());
    assert_eq!(job.model.vocab, 128_512);
    assert_preset_but_vocab(&job.model, "llama3-70b", &toml);
    assert_eq!(job.name, "llama3_70b_test", "the run's name");
    let par = &job.parallel;
    // 128 nodes x 8 = 1,024 GPUs over tp 4 x pp 4 x cp 2: dp 32.
    assert_eq!(job.cluster.nodes, 128);
    assert_eq!((par.tp, par.pp, par.cp, par.dp, par.vpp), (4, 4, 2, 32, 5));
    assert_eq!(par.schedule, Schedule::Interleaved);
    assert!(par.sequence_parallel && par.distributed_optimizer && par.tp_comm_overlap);
    assert!(par.overlap_grad_reduce && par.overlap_param_gather);
    assert!(par.dp_buckets_every_stage, "DistributedFusedAdam's buckets");
    assert!(!par.grad_reduce_in_bf16, "no grad_sync_dtype: FP32");
    assert!(par.gradient_accumulation_fusion);
    assert_eq!(par.pipeline_p2p, PipelineP2p::SteadyState);
    assert_eq!(job.training.global_batch, 2048);
    assert_eq!(job.training.precision, Precision::Bf16);
    assert!(
        toml.contains("kv_heads = 8  # model.num_query_groups: 8 (line 32)"),
        "{toml}"
    );
    assert!(toml.contains("seq_len = 8192  # model.encoder_seq_length: 8192 (line 26)"));
    assert!(
        toml.contains("model.normalization"),
        "unused keys are listed:\n{toml}"
    );
}

/// The same settings as a Megatron-LM command line give the same job: the two readers share
/// Megatron's rules, and NeMo's names map one to one onto its arguments.
#[test]
fn nemo_and_megatron_readers_agree() {
    let (_, nemo) = import("llama3-70b.yaml", &opts());
    let cmd = "torchrun --nnodes 128 --nproc_per_node 8 pretrain_gpt.py \
        --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
        --group-query-attention --num-query-groups 8 --seq-length 8192 \
        --tokenizer-type HuggingFaceTokenizer --vocab-size 128256 --swiglu \
        --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 \
        --context-parallel-size 2 --num-virtual-stages-per-pipeline-rank 5 \
        --sequence-parallel --micro-batch-size 1 --global-batch-size 2048 \
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
        --tp-comm-overlap --bf16 --use-precision-aware-optimizer";
    let megatron = import_megatron(
        cmd,
        "cmd",
        &ImportOptions {
            cluster: "dgx-h100".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut megatron = load(&megatron.toml);
    // Both keep the FP32 master weights as remainders (NeMo's DistributedFusedAdam set-up,
    // Megatron-Core's precision-aware optimizer).
    assert!(nemo.training.master_weight_remainders);
    // What only NeMo's optimizer says: DistributedFusedAdam's bucket timing.
    assert!(!megatron.parallel.dp_buckets_every_stage);
    megatron.parallel.dp_buckets_every_stage = true;
    assert_eq!(nemo.model, megatron.model);
    assert_eq!(nemo.parallel, megatron.parallel);
    assert_eq!(nemo.training, megatron.training);
    assert_eq!(nemo.cluster, megatron.cluster);
}

/// A whole launcher config (the training config under `training:`): NeMo's `multiply` resolver
/// gives the ffn size, FP8 comes from `fp8` / `fp8_hybrid`, gradients are reduced in BF16 as
/// `grad_sync_dtype` says, and the GPT-2 vocabulary is padded to 128 x tp 4.
#[test]
fn launcher_config_with_resolvers() {
    let (toml, job) = import("gpt3-175b-launcher.yaml", &opts());
    assert_eq!(job.model.ffn_hidden, 4 * 12288, "{toml}");
    assert_eq!(job.model.vocab, 50_688);
    assert_preset_but_vocab(&job.model, "gpt3-175b", &toml);
    assert_eq!(job.name, "gpt3_175b_fp8");
    assert_eq!(job.training.precision, Precision::Fp8);
    assert!(job.parallel.grad_reduce_in_bf16);
    assert_eq!(
        (job.parallel.tp, job.parallel.pp, job.parallel.dp),
        (4, 8, 4)
    );
    assert_eq!(job.parallel.vpp, 6);
    // NeMo's defaults where the config is silent: no gradient-accumulation fusion, blocking
    // pipeline exchanges, tied embeddings.
    assert!(!job.parallel.gradient_accumulation_fusion);
    assert_eq!(job.parallel.pipeline_p2p, PipelineP2p::Blocking);
    assert!(job.model.tied_embeddings);
    assert!(
        toml.contains("NeMo's default (no model.overlap_p2p_comm: false)"),
        "{toml}"
    );
}

/// Hydra-style overrides replace the file's values (a launcher's `training.` prefix and `+`
/// accepted) and are named as such in the job file.
#[test]
fn overrides_win() {
    let o = NemoOptions {
        overrides: vec![
            ("model.micro_batch_size".into(), "2".into()),
            (
                "training.model.tensor_model_parallel_size".into(),
                "8".into(),
            ),
            ("+model.context_parallel_size".into(), "1".into()),
        ],
        ..opts()
    };
    let (toml, job) = import("llama3-70b.yaml", &o);
    assert_eq!((job.parallel.tp, job.parallel.cp), (8, 1));
    assert_eq!(job.parallel.micro_batch, 2);
    // 1,024 / (8 x 4) = 32 data-parallel ranks.
    assert_eq!(job.parallel.dp, 32);
    assert!(
        toml.contains("micro_batch = 2  # model.micro_batch_size=2 (--override)"),
        "{toml}"
    );
    // The vocabulary is padded for the overridden tp: 128,256 -> multiple of 1,024.
    assert_eq!(job.model.vocab, 129_024);
}

/// The imported job simulates (reduced mode equals the full run's representative ranks).
#[test]
fn imported_job_simulates() {
    let (_, job) = import("gpt3-175b-launcher.yaml", &opts());
    let r = prism_core::simulate(
        &job,
        &prism_core::SimOptions {
            mode: prism_core::Mode::Reduced,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.summary.iteration_time_s > 0.0 && r.summary.iteration_time_s.is_finite());
}

const MINIMAL: &str = "trainer:\n  num_nodes: 2\n  devices: 8\n  precision: bf16-mixed\n\
model:\n  micro_batch_size: 1\n  global_batch_size: 64\n  tensor_model_parallel_size: 2\n  \
pipeline_model_parallel_size: 1\n  encoder_seq_length: 4096\n  num_layers: 24\n  \
hidden_size: 2048\n  ffn_hidden_size: 8192\n  num_attention_heads: 16\n  tokenizer:\n    \
library: megatron\n    type: GPT2BPETokenizer\n";

/// NeMo's defaults for what a config leaves out: dropout 0.1, one KV group per head, tied
/// embeddings, GeLU, no distributed optimizer.
#[test]
fn nemo_defaults() {
    let (toml, job) = import_text(MINIMAL, &opts());
    assert!(job.model.dropout);
    assert_eq!(job.model.kv_heads, job.model.heads);
    assert!(job.model.tied_embeddings);
    assert!(!job.parallel.distributed_optimizer);
    assert_eq!(job.parallel.dp, 8);
    assert!(
        toml.contains("NeMo's default (no model.activation): GeLU"),
        "{toml}"
    );
    // Importing twice gives the same file.
    assert_eq!(toml, import_text(MINIMAL, &opts()).0);
    // Switches turned off in the file, and a non-distributed optimizer, are named as such.
    let text = MINIMAL.replace(
        "hidden_size: 2048",
        "hidden_size: 2048\n  sequence_parallel: False\n  optim:\n    name: fused_adam",
    );
    let (toml, job) = import_text(&text, &opts());
    assert!(!job.parallel.sequence_parallel && !job.parallel.distributed_optimizer);
    assert!(
        toml.contains("sequence_parallel = false  # model.sequence_parallel: false (line 13)"),
        "{toml}"
    );
    assert!(
        toml.contains("model.optim.name: fused_adam (line 15): not a distributed optimizer"),
        "{toml}"
    );
}

/// NeMo's set-up of Apex's DistributedFusedAdam (`MegatronBaseModel.setup_optimization`,
/// October 2022 to NeMo 2.0): an FP32 optimizer on an O2 BF16 model keeps the master weights'
/// low 16 bits only (10 bytes of optimizer state per parameter against 12); one in the model's
/// own type keeps no master copy, BF16 moments and, unless `grad_sync_dtype` says otherwise,
/// BF16 gradient sync (4 bytes, gradients 2); FP8 weights, O1, `fused_adam` or an explicit
/// `store_params` keep whole masters.
#[test]
fn optimizer_master_copy_follows_nemo() {
    // `model` keys after hidden_size, and keys of `optim`.
    let cfg = |model: &str, optim: &str| {
        MINIMAL.replace(
            "hidden_size: 2048",
            &format!(
                "hidden_size: 2048\n  megatron_amp_O2: true{model}\n  optim:\n    \
                 name: distributed_fused_adam{optim}"
            ),
        )
    };
    let bytes = |text: &str| {
        let (toml, job) = import_text(text, &opts());
        (
            job.optimizer_bytes_per_param(),
            job.grad_accum_bytes(),
            job.training.master_weight_remainders,
            toml,
        )
    };
    let (opt, grad, rem, toml) = bytes(&cfg("", ""));
    assert_eq!((opt, grad, rem), (10, 4, true), "{toml}");
    assert!(toml.contains("store_param_remainders"), "{toml}");
    // The optimizer in the model's type: no master copy.
    let (opt, grad, rem, toml) = bytes(&cfg("", "\n    dtype: bf16"));
    assert_eq!((opt, grad, rem), (4, 2, false), "{toml}");
    assert!(
        toml.contains("master_weights = false  # model.optim.dtype: bf16 (line"),
        "{toml}"
    );
    // Whole FP32 masters: explicit store_params, FP8 weights, O1, a non-distributed optimizer.
    for text in [
        cfg("", "\n    store_params: true"),
        cfg("\n  fp8: true\n  fp8_params: true", ""),
        cfg("", "").replace("megatron_amp_O2: true", "megatron_amp_O2: false"),
        cfg("", "").replace("distributed_fused_adam", "fused_adam"),
    ] {
        let (opt, _, rem, toml) = bytes(&text);
        assert_eq!((opt, rem), (12, false), "{toml}");
    }
    // Explicit remainders with store_params off.
    let (opt, _, rem, _) = bytes(&cfg(
        "",
        "\n    store_params: false\n    store_param_remainders: true",
    ));
    assert_eq!((opt, rem), (10, true));
    // A dtype Apex does not take.
    let e = import_nemo(&cfg("", "\n    dtype: fp64"), "c.yaml", &opts()).unwrap_err();
    assert_eq!(e.flag, "model.optim.dtype", "{e}");
    assert!(
        e.rule.contains("fp32, bf16, fp16") && e.line.is_some(),
        "{e}"
    );
}

/// Bad configs are errors naming the key (and line) and the rule.
#[test]
fn bad_configs_name_the_key() {
    let cases: &[(&str, &str, Option<usize>, &str)] = &[
        (
            "trainer:\n  num_nodes: 1\n",
            "model",
            None,
            "no `model:` section",
        ),
        (
            "model:\n  num_layers: 2\n  hidden_size: 8\n  encoder:\n    num_layers: 2\n",
            "model.encoder",
            None,
            "encoder-decoder",
        ),
        (
            "model:\n  num_layers: 2\n  hidden_size: 8\n  tokenizer:\n    library: megatron\n    \
             type: BertWordPieceLowerCase\n",
            "model",
            None,
            "encoder-only",
        ),
        (
            "model:\n  hidden_size: 8\n",
            "model.num_layers",
            None,
            "not a Megatron GPT config",
        ),
        ("model: [1, 2\n", "YAML", Some(2), ""),
        (
            "model:\n  num_layers: 2\n  num_layers: 3\n",
            "model.num_layers",
            Some(3),
            "given twice (lines 2 and 3)",
        ),
    ];
    for (text, key, line, rule) in cases {
        let e = import_nemo(text, "c.yaml", &opts()).expect_err(text);
        assert_eq!(e.flag, *key, "{text}: {e}");
        assert_eq!(e.line, *line, "{text}: {e}");
        assert!(e.to_string().contains(rule), "{text}: {e}");
    }
    // Edits of the minimal config, each breaking one rule.
    let edits: &[(&str, &str, &str, &str)] = &[
        (
            "    library: megatron\n    type: GPT2BPETokenizer\n",
            "    library: sentencepiece\n    model: /data/tok.model\n",
            "model.tokenizer",
            "pass --vocab-size N",
        ),
        (
            "precision: bf16-mixed",
            "precision: 32",
            "trainer.precision",
            "FP32 training is not modelled",
        ),
        (
            "ffn_hidden_size: 8192",
            "ffn_hidden_size: ${multiply:4, ${.hidden}}",
            "model.ffn_hidden_size",
            "refers to `.hidden`, which is not in this file",
        ),
        (
            "ffn_hidden_size: 8192",
            "ffn_hidden_size: ${oc.env:FFN}",
            "model.ffn_hidden_size",
            "resolver `oc.env`",
        ),
        (
            "num_layers: 24",
            "num_layers: ${.num_layers}",
            "model.num_layers",
            "do not end",
        ),
        (
            "num_layers: 24",
            "num_layers: ${data_dir}/x",
            "model.num_layers",
            "interpolates inside a string",
        ),
        (
            "num_layers: 24",
            "num_layers: many",
            "model.num_layers",
            "not a valid number",
        ),
        (
            "hidden_size: 2048",
            "hidden_size: 2048\n  activation: mish",
            "model.activation",
            "not a NeMo activation",
        ),
        (
            "hidden_size: 2048",
            "hidden_size: 2048\n  optim:\n    name: distributed_fused_adam\n    grad_sync_dtype: fp8",
            "model.optim.grad_sync_dtype",
            "not one of bf16, fp16, fp32",
        ),
        (
            "  num_attention_heads: 16\n",
            "",
            "model.num_attention_heads",
            "not found in the config",
        ),
    ];
    for (from, to, key, rule) in edits {
        assert!(MINIMAL.contains(from), "{from}");
        let text = MINIMAL.replace(from, to);
        let e = import_nemo(&text, "c.yaml", &opts()).expect_err(&text);
        assert_eq!(e.flag, *key, "{text}: {e}");
        assert!(e.to_string().contains(rule), "{text}: {e}");
    }
    // A vocabulary given by the caller makes the SentencePiece config import.
    let text = MINIMAL.replace(
        "    library: megatron\n    type: GPT2BPETokenizer\n",
        "    library: sentencepiece\n    model: /data/tok.model\n",
    );
    let (_, job) = import_text(
        &text,
        &NemoOptions {
            vocab_size: Some(32_000),
            ..opts()
        },
    );
    assert_eq!(job.model.vocab, 32_000);
}

/// Settings Prism does not model are reported, not silently dropped.
#[test]
fn notes_report_what_is_not_modelled() {
    let text = MINIMAL.replace(
        "hidden_size: 2048",
        "hidden_size: 2048\n  cpu_offloading: true\n  rampup_batch_size: [16, 16, 1000]\n  \
         activation: geglu\n  megatron_amp_O2: false",
    );
    let imported = import_nemo(&text, "c.yaml", &opts()).unwrap();
    let notes = imported.notes.join("\n");
    for needle in [
        "model.cpu_offloading",
        "geglu",
        "megatron_amp_O2: false",
        "model.rampup_batch_size",
    ] {
        assert!(notes.contains(needle), "{needle}: {notes}");
    }
}

/// Truth: the NeMo launcher exports its config's `env_vars` to the job, and its 24.03-24.07
/// conf/config.yaml held `NVTE_FUSED_ATTN: 0`, so Transformer Engine ran flash-attn; and
/// `model.cp_comm_type` is Megatron-Core's `--cp-comm-type`.
#[test]
fn launcher_env_vars_and_cp_comm_type() {
    use prism_core::job::{AttentionBackend, CpCommType};
    let (_, plain) = import_text(MINIMAL, &opts());
    assert_eq!(plain.training.attention_backend, AttentionBackend::Cudnn);
    let text = format!("env_vars:\n  NVTE_FUSED_ATTN: 0\n{MINIMAL}");
    let (toml, job) = import_text(&text, &opts());
    assert_eq!(
        job.training.attention_backend,
        AttentionBackend::Flash2,
        "{toml}"
    );
    let text = MINIMAL.replace(
        "hidden_size: 2048",
        "hidden_size: 2048\n  context_parallel_size: 2\n  cp_comm_type: all_gather",
    );
    let (toml, job) = import_text(&text, &opts());
    assert_eq!(job.parallel.cp, 2, "{toml}");
    assert_eq!(job.parallel.cp_comm_type, CpCommType::AllGather, "{toml}");
    let (toml, job) = import_text(&text.replace("all_gather", "a2a"), &opts());
    assert_eq!(job.parallel.cp_comm_type, CpCommType::A2a, "{toml}");
}

/// Megatron-Core's fused cross entropy as a NeMo config sets it: NeMo hands every
/// TransformerConfig field of `model:` to Megatron-Core (`build_transformer_config`), so
/// `cross_entropy_loss_fusion` turns the fusion on with Megatron's own kernels unless
/// `cross_entropy_fusion_impl` says `te`; absent, it is Megatron-Core's default (off). A choice
/// Megatron does not have is an error naming the key and its line.
#[test]
fn cross_entropy_fusion_keys() {
    use prism_core::job::CrossEntropyFusion;
    let with =
        |extra: &str| MINIMAL.replace("hidden_size: 2048", &format!("hidden_size: 2048{extra}"));
    let fusion = |extra: &str| {
        import_text(&with(extra), &opts())
            .1
            .training
            .cross_entropy_fusion
    };
    assert_eq!(fusion(""), CrossEntropyFusion::None);
    assert_eq!(
        fusion("\n  cross_entropy_loss_fusion: True"),
        CrossEntropyFusion::Native
    );
    assert_eq!(
        fusion("\n  cross_entropy_loss_fusion: True\n  cross_entropy_fusion_impl: te"),
        CrossEntropyFusion::Te
    );
    assert_eq!(
        fusion("\n  cross_entropy_loss_fusion: False\n  cross_entropy_fusion_impl: te"),
        CrossEntropyFusion::None
    );
    let (toml, _) = import_text(&with("\n  cross_entropy_loss_fusion: True"), &opts());
    assert!(
        toml.contains(
            "cross_entropy_fusion = \"native\"  # model.cross_entropy_loss_fusion: true (line 13)"
        ),
        "{toml}"
    );
    let err = import_nemo(
        &with("\n  cross_entropy_fusion_impl: triton"),
        "config.yaml",
        &opts(),
    )
    .expect_err("not a Megatron choice");
    let msg = err.to_string();
    assert!(
        msg.contains("cross_entropy_fusion_impl") && msg.contains("triton") && msg.contains("13"),
        "{msg}"
    );
}
