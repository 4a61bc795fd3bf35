//! `prism import megatron`: launch scripts read into jobs, against the models and layouts they
//! describe (the presets of the same models) and Megatron's own rules (vocabulary padding,
//! defaults of its switches).

use std::path::PathBuf;

use prism_core::job::Job;
use prism_io::megatron_args::{ImportOptions, import_megatron};

fn data(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/megatron")
        .join(p)
}

fn opts() -> ImportOptions {
    ImportOptions {
        cluster: "dgx-h100".into(),
        ..Default::default()
    }
}

fn import(file: &str, o: &ImportOptions) -> (String, Job) {
    let text = std::fs::read_to_string(data(file)).unwrap();
    import_text(&text, file, o)
}

/// A script imported and its job file loaded (both must succeed): the file and the job.
fn import_text(script: &str, name: &str, o: &ImportOptions) -> (String, Job) {
    let imported = import_megatron(script, name, o).unwrap_or_else(|e| panic!("{e}"));
    let job = prism_io::jobfile::load_job_str(&imported.toml, name, None, &[])
        .unwrap_or_else(|e| panic!("{e}\n{}", imported.toml))
        .job;
    (imported.toml, job)
}

fn preset(name: &str) -> prism_core::job::Model {
    let text = format!(
        "[model]\npreset = \"{name}\"\n[cluster]\npreset = \"dgx-h100\"\nnodes = 1\n\
         [parallel]\ntp = 1\npp = 1\ndp = 8\n[training]\nglobal_batch = 8\n"
    );
    prism_io::jobfile::load_job_str(&text, "p", None, &[])
        .unwrap()
        .job
        .model
}

/// A Llama 3 70B script (variables with defaults, `$(( ))`, arrays, an `if` on the precision,
/// torchrun's node count): the model is the `llama3-70b` preset but for the vocabulary, which
/// Megatron pads to a multiple of 128 x tp = 1024 (128,256 -> 129,024); the layout, batch and
/// overlaps are the script's.
#[test]
fn llama3_70b_script() {
    let (toml, job) = import("llama3-70b-h100.sh", &opts());
    let p = preset("llama3-70b");
    assert_eq!(job.model.vocab, 129_024);
    assert_eq!(
        prism_core::job::Model {
            name: p.name.clone(),
            vocab: p.vocab,
            ..job.model.clone()
        },
        p,
        "{toml}"
    );
    let par = &job.parallel;
    // 64 nodes (SLURM_NNODES unset: the default), tp 8 x pp 4: dp 16; 5 layers per virtual
    // stage: vpp = 80 / 4 / 5 = 4, interleaved.
    assert_eq!(job.cluster.nodes, 64);
    assert_eq!((par.tp, par.pp, par.dp, par.vpp), (8, 4, 16, 4));
    assert_eq!(par.schedule, prism_core::job::Schedule::Interleaved);
    assert!(par.sequence_parallel && par.distributed_optimizer && par.tp_comm_overlap);
    assert!(par.overlap_grad_reduce && par.overlap_param_gather);
    assert!(
        !par.grad_reduce_in_bf16,
        "Megatron reduces BF16 gradients in FP32"
    );
    assert_eq!(job.training.global_batch, 1024);
    assert_eq!(job.training.precision, prism_core::job::Precision::Bf16);
    assert!(toml.contains("--num-query-groups 8 (line"), "{toml}");
    // The simulation runs on the imported job.
    let r = prism_core::simulate(
        &job,
        &prism_core::SimOptions {
            mode: prism_core::Mode::Reduced,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.summary.iteration_time_s > 0.0 && r.summary.mfu < 1.0);
}

/// The caller's variables win over the script's: the `if` follows DTYPE into the FP8 branch,
/// and the node count follows SLURM_NNODES.
#[test]
fn variables_from_the_caller_choose_branches() {
    let o = ImportOptions {
        vars: vec![
            ("DTYPE".into(), "fp8".into()),
            ("SLURM_NNODES".into(), "128".into()),
        ],
        ..opts()
    };
    let (_, job) = import("llama3-70b-h100.sh", &o);
    assert_eq!(job.training.precision, prism_core::job::Precision::Fp8);
    assert_eq!((job.cluster.nodes, job.parallel.dp), (128, 32));
    // --nodes wins over the script's torchrun --nnodes.
    let (_, job) = import(
        "llama3-70b-h100.sh",
        &ImportOptions {
            nodes: Some(16),
            ..opts()
        },
    );
    assert_eq!(job.parallel.dp, 4);
}

/// GPT-3 175B as one command line with Megatron's defaults: GeLU MLP of 4h, tied embeddings,
/// dropout 0.1, the GPT-2 vocabulary (50,257) padded at TP 8 to 51,200 (what Megatron logs),
/// FP16 gradients reduced in FP16, none of the overlaps: the `gpt3-175b` preset's model.
#[test]
fn gpt3_command_line_with_megatron_defaults() {
    let (toml, job) = import(
        "gpt3-175b.cmd",
        &ImportOptions {
            nodes: Some(128),
            ..opts()
        },
    );
    let p = preset("gpt3-175b");
    assert_eq!(
        prism_core::job::Model {
            name: p.name.clone(),
            ..job.model.clone()
        },
        p,
        "{toml}"
    );
    let par = &job.parallel;
    assert_eq!((par.tp, par.pp, par.dp), (8, 16, 8));
    assert!(!par.sequence_parallel && !par.distributed_optimizer);
    assert!(!par.overlap_grad_reduce && !par.overlap_param_gather);
    assert!(
        par.grad_reduce_in_bf16,
        "FP16 gradients are reduced in FP16"
    );
    assert_eq!(job.training.precision, prism_core::job::Precision::Fp16);
    assert!(toml.contains("--lr"), "unused arguments are listed");
}

/// Bad scripts: the error names the argument, the line where there is one, and the rule.
#[test]
fn bad_scripts_name_the_argument() {
    let fails = |text: &str, o: &ImportOptions| import_megatron(text, "s.sh", o).unwrap_err();
    let base = std::fs::read_to_string(data("gpt3-175b.cmd")).unwrap();
    let o = ImportOptions {
        nodes: Some(128),
        ..opts()
    };
    // A required argument missing.
    let e = fails(&base.replace("--num-layers 96 ", ""), &o);
    assert_eq!(e.flag, "--num-layers");
    assert!(e.rule.contains("not found"), "{e}");
    // Two different values outside any branch that can be followed.
    let e = fails(&format!("{base}--seq-length 4096\n"), &o);
    assert_eq!((e.flag.as_str(), e.line), ("--seq-length", Some(2)));
    assert!(e.rule.contains("2048") && e.rule.contains("4096"), "{e}");
    // A value that is a variable the script never sets.
    let e = fails(&base.replace("--num-layers 96", "--num-layers $LAYERS"), &o);
    assert_eq!(e.flag, "--num-layers");
    assert!(e.rule.contains("--var"), "{e}");
    // ... which the caller can set.
    let ok = import_megatron(
        &base.replace("--num-layers 96", "--num-layers $LAYERS"),
        "s.sh",
        &ImportOptions {
            vars: vec![("LAYERS".into(), "48".into())],
            ..o.clone()
        },
    )
    .unwrap();
    assert!(ok.toml.contains("layers = 48"), "{}", ok.toml);
    // FP32 training, an unknown tokenizer without a vocabulary size, an unknown cluster, no
    // node count, a value-less argument.
    let e = fails(&base.replace("--fp16", ""), &o);
    assert_eq!(e.flag, "--bf16");
    let e = fails(
        &format!("{base} --tokenizer-type SentencePieceTokenizer"),
        &o,
    );
    assert_eq!(e.flag, "--vocab-size");
    let e = fails(
        &base,
        &ImportOptions {
            cluster: "dgx-h10".into(),
            ..o.clone()
        },
    );
    assert_eq!(e.flag, "--cluster");
    assert!(e.rule.contains("dgx-h100"), "{e}");
    let e = fails(&base, &opts());
    assert_eq!(e.flag, "--nodes");
    let e = fails(&format!("{base} --micro-batch-size"), &o);
    assert!(e.rule.contains("expects a value"), "{e}");
    // A hybrid Mamba model.
    let e = fails(&format!("{base} --hybrid-override-pattern M-M-M-"), &o);
    assert_eq!(e.flag, "--hybrid-override-pattern");
    assert!(e.rule.contains("Mamba"), "{e}");
    // An encoder-decoder model.
    let e = fails(&format!("{base} --encoder-num-layers 12"), &o);
    assert_eq!(e.flag, "--encoder-num-layers");
    // An MoE layer pattern Prism cannot express, and one it can (every second layer).
    let moe = format!("{base} --num-experts 8 --moe-layer-freq ([1,0]*48)");
    assert_eq!(fails(&moe, &o).flag, "--moe-layer-freq");
    let ok = import_megatron(&moe.replace("[1,0]", "[0,1]"), "s.sh", &o).unwrap();
    assert!(ok.toml.contains("moe_layer_step = 2"), "{}", ok.toml);
    // --arg adds an argument and replaces the script's value of one.
    let ok = import_megatron(
        &base,
        "s.sh",
        &ImportOptions {
            extra_args: vec!["--seq-length 4096".into(), "--sequence-parallel".into()],
            ..o.clone()
        },
    )
    .unwrap();
    assert!(
        ok.toml
            .contains("seq_len = 4096  # --seq-length 4096 (--arg)"),
        "{}",
        ok.toml
    );
    assert!(ok.toml.contains("sequence_parallel = true"), "{}", ok.toml);
}

/// What the reader cannot model is said, not dropped: arguments that change a step's time,
/// partial recomputation, and a variable assigned two values.
#[test]
fn notes_report_what_is_not_modelled() {
    let text = "TP=4\nTP=8\npython pretrain_gpt.py --tensor-model-parallel-size $TP \
                --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \
                --micro-batch-size 1 --global-batch-size 64 --bf16 --vocab-size 32000 \
                --recompute-granularity full --recompute-method block --recompute-num-layers 2 \
                --expert-tensor-parallel-size 1 --enable-cuda-graph\n";
    let o = ImportOptions {
        nodes: Some(4),
        ..opts()
    };
    let imported = import_megatron(text, "n.sh", &o).unwrap();
    let notes = imported.notes.join("\n");
    for want in [
        "TP is assigned \"4\" (line 1) and \"8\" (line 2)",
        "--recompute-method block",
        "--expert-tensor-parallel-size",
        "--enable-cuda-graph",
    ] {
        assert!(notes.contains(want), "{want}: {notes}");
    }
    assert!(imported.toml.contains("tp = 8"), "{}", imported.toml);
    assert!(imported.toml.contains("# Notes:"), "{}", imported.toml);
}

/// Nested and one-line `if`s: branches whose tests can be evaluated are followed, so each of
/// the three model sizes gets its own layer count, and a one-line `if` that does not hold is
/// skipped.
#[test]
fn branches_are_followed() {
    let script = r#"
MODEL=${MODEL:-8b}
if [[ "$MODEL" == "8b" ]]; then
    LAYERS=32
    if [ "$LONG" = "1" ]; then SEQ=32768; else SEQ=8192; fi
elif [[ "$MODEL" == "70b" ]]; then
    LAYERS=80
    SEQ=8192
else
    LAYERS=126
    SEQ=8192
fi
if [ 2 -gt 4 ]; then EXTRA="--recompute-activations"; fi
python pretrain_gpt.py --num-layers $LAYERS --hidden-size 4096 --num-attention-heads 32 \
    --seq-length $SEQ --micro-batch-size 1 --global-batch-size 64 --bf16 --vocab-size 32000 \
    $EXTRA
"#;
    let run = |vars: &[(&str, &str)]| {
        let o = ImportOptions {
            nodes: Some(8),
            vars: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..opts()
        };
        import_text(script, "b.sh", &o).1
    };
    let j = run(&[("LONG", "0")]);
    assert_eq!((j.model.layers, j.model.seq_len), (32, 8192));
    assert_eq!(j.parallel.recompute, prism_core::job::Recompute::None);
    let j = run(&[("LONG", "1")]);
    assert_eq!(j.model.seq_len, 32768);
    let j = run(&[("MODEL", "70b"), ("LONG", "0")]);
    assert_eq!(j.model.layers, 80);
    let j = run(&[("MODEL", "405b"), ("LONG", "0")]);
    assert_eq!(j.model.layers, 126);
}

/// A training log's median iteration time becomes the job's `[published]` figure: the warm-up
/// record (21.5 s) is skipped, the median of the rest (15.85-16.15 s) is taken.
#[test]
fn log_gives_the_published_iteration_time() {
    let text = std::fs::read_to_string(data("llama3-70b.log")).unwrap();
    let m = prism_io::megatron_args::measured_iteration_time(&text, "llama3-70b.log").unwrap();
    assert_eq!((m.records, m.skipped, m.iterations), (36, 4, (50, 400)));
    assert!((15.85..16.15).contains(&m.iteration_time_s), "{m:?}");
    let (toml, job) = import(
        "llama3-70b-h100.sh",
        &ImportOptions {
            measured: Some(m.clone()),
            ..opts()
        },
    );
    let p = job_published(&toml);
    assert_eq!(p, m.iteration_time_s);
    assert_eq!(job.model.layers, 80);
    // Not a log: an error naming the file.
    let e = prism_io::megatron_args::measured_iteration_time("hello\n", "x.log").unwrap_err();
    assert!(e.to_string().contains("x.log"), "{e}");
}

fn job_published(toml: &str) -> f64 {
    let loaded = prism_io::jobfile::load_job_str(toml, "j", None, &[]).unwrap();
    loaded
        .published
        .expect("[published]")
        .iteration_time_s
        .expect("iteration_time_s")
}

/// Megatron-Core's precision-aware optimizer (`--use-precision-aware-optimizer`, Transformer
/// Engine's FusedAdam): with BF16 weights it keeps the FP32 master weights as 16-bit remainders
/// (`store_param_remainders`, on since February 2025), BF16 moments come from `--exp-avg-dtype`
/// and `--exp-avg-sq-dtype`, BF16 main gradients from `--main-grads-dtype`. Against the memory
/// model's closed forms: 10 bytes of optimizer state per parameter (6 with BF16 moments)
/// against 12. FP8 recipes that make Megatron-Core keep its own FP32 masters turn the
/// remainders off; the dtypes without the switch, or of a type Megatron does not offer, are
/// errors naming the argument.
#[test]
fn precision_aware_optimizer() {
    let base = "python pretrain_gpt.py --tensor-model-parallel-size 8 --num-layers 32 \
                --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \
                --micro-batch-size 1 --global-batch-size 64 --bf16 --vocab-size 32000 \
                --use-distributed-optimizer";
    let o = ImportOptions {
        nodes: Some(4),
        ..opts()
    };
    let job = |args: &str| {
        let imported = import_megatron(&format!("{base} {args}\n"), "p.sh", &o)
            .unwrap_or_else(|e| panic!("{e}"));
        let job = prism_io::jobfile::load_job_str(&imported.toml, "p.sh", None, &[])
            .unwrap_or_else(|e| panic!("{e}\n{}", imported.toml))
            .job;
        (imported, job)
    };
    let (_, plain) = job("");
    assert_eq!(plain.optimizer_bytes_per_param(), 12);
    let (imported, aware) = job("--use-precision-aware-optimizer");
    assert!(aware.training.master_weight_remainders, "{}", imported.toml);
    assert_eq!(aware.optimizer_bytes_per_param(), 10);
    assert!(!aware.parallel.grad_reduce_in_bf16);
    let (imported, low) = job(
        "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
         --main-grads-dtype bf16",
    );
    assert_eq!(low.optimizer_bytes_per_param(), 6, "{}", imported.toml);
    assert!(low.parallel.grad_reduce_in_bf16);
    assert_eq!(low.grad_accum_bytes(), 2);
    // Mixed moment types are counted at the wider one, and said.
    let (imported, mixed) = job("--use-precision-aware-optimizer --exp-avg-dtype bf16");
    assert_eq!(mixed.optimizer_bytes_per_param(), 10);
    assert!(
        imported.notes.iter().any(|n| n.contains("--exp-avg-dtype")),
        "{:?}",
        imported.notes
    );
    // Block-wise FP8 makes Megatron-Core keep FP32 masters itself; delayed scaling does not.
    let (_, fp8) =
        job("--use-precision-aware-optimizer --fp8-format hybrid --fp8-recipe blockwise");
    assert!(!fp8.training.master_weight_remainders);
    assert_eq!(
        fp8.training.fp8_recipe,
        prism_core::job::Fp8Recipe::Blockwise
    );
    let (_, fp8) = job("--use-precision-aware-optimizer --fp8-format hybrid --fp8-recipe delayed");
    assert!(fp8.training.master_weight_remainders);
    // FP8 weights (--fp8-param-gather) keep whole masters.
    let (_, fp8) = job("--use-precision-aware-optimizer --fp8-format hybrid --fp8-param-gather");
    assert!(!fp8.training.master_weight_remainders);
    // Errors.
    for (args, flag, rule) in [
        (
            "--exp-avg-dtype bf16",
            "--exp-avg-dtype",
            "--use-precision-aware-optimizer",
        ),
        (
            "--use-precision-aware-optimizer --main-params-dtype bf16",
            "--main-params-dtype",
            "fp32, fp16",
        ),
        (
            "--fp8-format hybrid --fp8-recipe fancy",
            "--fp8-recipe",
            "blockwise",
        ),
    ] {
        let e = import_megatron(&format!("{base} {args}\n"), "p.sh", &o).unwrap_err();
        assert_eq!(e.flag, flag, "{e}");
        assert!(e.rule.contains(rule), "{e}");
    }
}

/// Truth: Megatron-Core's `--cp-comm-type` (p2p, the default, all_gather or a2a, one for
/// every layer; hierarchical a2a+p2p and per-layer mixes are refused with the rule), and Transformer Engine's `NVTE_FUSED_ATTN=0` in the script, which leaves
/// the flash-attn kernels (and with `NVTE_FLASH_ATTN=0` the unfused attention) unless
/// `--attention-backend` names one.
#[test]
fn cp_comm_type_and_te_attention_switches() {
    let base = "python pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 32 \
                --hidden-size 4096 --num-attention-heads 32 --seq-length 8192 \
                --micro-batch-size 1 --global-batch-size 64 --bf16 --vocab-size 32000 \
                --context-parallel-size 2";
    let o = ImportOptions {
        nodes: Some(1),
        ..opts()
    };
    let job = |pre: &str, args: &str| import_text(&format!("{pre}{base} {args}\n"), "cp.sh", &o).1;
    use prism_core::job::{AttentionBackend, CpCommType};
    let plain = job("", "");
    assert_eq!(plain.parallel.cp_comm_type, CpCommType::P2p);
    assert_eq!(plain.training.attention_backend, AttentionBackend::Cudnn);
    assert_eq!(
        job("", "--cp-comm-type all_gather").parallel.cp_comm_type,
        CpCommType::AllGather
    );
    assert_eq!(
        job("", "--cp-comm-type a2a").parallel.cp_comm_type,
        CpCommType::A2a
    );
    // Megatron's nargs='+': one type per layer, read when every layer has the same one; the
    // list ends at the next flag or at the shell's redirections after the last one.
    for (args, want) in [
        ("--cp-comm-type a2a a2a a2a --bf16", CpCommType::A2a),
        ("--cp-comm-type a2a 2>&1 | tee log.txt", CpCommType::A2a),
        (
            "--cp-comm-type all_gather > out.log &",
            CpCommType::AllGather,
        ),
    ] {
        assert_eq!(job("", args).parallel.cp_comm_type, want, "{args}");
    }
    for (args, rule) in [
        ("--cp-comm-type a2a+p2p", "hierarchical"),
        ("--cp-comm-type p2p a2a", "per layer"),
        ("--cp-comm-type allgather", "`allgather` is not modelled"),
    ] {
        let err =
            import_megatron(&format!("{base} {args}\n"), "cp.sh", &o).expect_err("not modelled");
        assert_eq!(err.flag, "--cp-comm-type", "{err}");
        assert!(err.rule.contains(rule), "{args}: {err}");
    }
    let flash = job("export NVTE_FUSED_ATTN=0\n", "");
    assert_eq!(flash.training.attention_backend, AttentionBackend::Flash2);
    assert!(flash.training.flash_attention);
    let unfused = job("NVTE_FUSED_ATTN=0\nNVTE_FLASH_ATTN=0\n", "");
    assert!(!unfused.training.flash_attention);
    // --attention-backend wins over the variables (Megatron sets them from it).
    let fused = job("export NVTE_FUSED_ATTN=0\n", "--attention-backend fused");
    assert_eq!(fused.training.attention_backend, AttentionBackend::Cudnn);
}

#[test]
fn cross_entropy_loss_fusion_and_its_implementation() {
    let base = "python pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 4 \
                --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 \
                --micro-batch-size 1 --global-batch-size 8 --bf16 --vocab-size 128256";
    let o = ImportOptions {
        nodes: Some(1),
        ..opts()
    };
    let job = |args: &str| import_text(&format!("{base} {args}\n"), "ce.sh", &o).1;
    use prism_core::job::CrossEntropyFusion;
    assert_eq!(
        job("").training.cross_entropy_fusion,
        CrossEntropyFusion::None
    );
    // Megatron's default implementation is its own (`native`).
    assert_eq!(
        job("--cross-entropy-loss-fusion")
            .training
            .cross_entropy_fusion,
        CrossEntropyFusion::Native
    );
    assert_eq!(
        job("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
            .training
            .cross_entropy_fusion,
        CrossEntropyFusion::Te
    );
    // The implementation alone does not fuse anything.
    assert_eq!(
        job("--cross-entropy-fusion-impl te")
            .training
            .cross_entropy_fusion,
        CrossEntropyFusion::None
    );
    // A choice Megatron's argparse refuses is an error with or without the fusion switch.
    for fusion in ["--cross-entropy-loss-fusion ", ""] {
        let err = import_megatron(
            &format!("{base} {fusion}--cross-entropy-fusion-impl triton\n"),
            "ce.sh",
            &o,
        )
        .expect_err("not a Megatron choice");
        let msg = err.to_string();
        assert!(
            msg.contains("--cross-entropy-fusion-impl") && msg.contains("triton"),
            "{msg}"
        );
    }
}

/// Truth: Megatron-Core's sliding-window attention (`is_layer_window_attention` in
/// `megatron/core/transformer/utils.py`): `--window-size (left,right)` is Transformer Engine's
/// window, on every layer unless `--window-attn-skip-freq N` makes each N-th layer (1-indexed)
/// attend to the whole sequence. `(4095,0)` lets a query see itself and 4,095 keys before it:
/// a window of 4,096 in HF's count. Windows that look ahead and list patterns are refused
/// with the flag named.
#[test]
fn window_size_and_skip_frequency() {
    let base = "python pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 8 \
                --hidden-size 1024 --num-attention-heads 16 --seq-length 16384 \
                --micro-batch-size 1 --global-batch-size 16 --bf16 --vocab-size 32000";
    let o = ImportOptions {
        nodes: Some(1),
        ..opts()
    };
    let job = |args: &str| import_text(&format!("{base} {args}\n"), "w.sh", &o).1;
    let every = job("--window-size '(4095,0)'");
    assert_eq!(every.model.arch.attention_window, 4096);
    assert_eq!(every.model.arch.attention_global_every, 0);
    assert!((0..8).all(|l| every.model.local_attention(l).is_some()));
    let skip = job("--window-size 4095,0 --window-attn-skip-freq 4");
    let local: Vec<bool> = (0..8)
        .map(|l| skip.model.local_attention(l).is_some())
        .collect();
    // Megatron: layer_number % 4 != 0 is windowed, layer_number = l + 1.
    assert_eq!(
        local,
        [true, true, true, false, true, true, true, false],
        "{skip:?}"
    );
    // A negative left size is TE's "no window".
    assert_eq!(job("--window-size (-1,0)").model.arch.attention_window, 0);
    for (args, rule) in [
        ("--window-size (128,128)", "ahead"),
        ("--window-size 128", "pair"),
        (
            "--window-size (4095,0) --window-attn-skip-freq '[1,1,0]*2'",
            "integer N",
        ),
    ] {
        let err = import_megatron(&format!("{base} {args}\n"), "w.sh", &o).expect_err(args);
        assert!(err.flag.starts_with("--window"), "{err}");
        assert!(err.rule.contains(rule), "{args}: {err}");
    }
}

/// Truth: Megatron-Core's capacity factor (`--moe-expert-capacity-factor`): with
/// `--moe-pad-expert-input-to-capacity` every expert computes its full capacity (Prism's
/// `model.moe_capacity_factor`); without padding the tokens beyond it are dropped, which the
/// import says in a note and prices dropless.
#[test]
fn moe_capacity_factor_with_and_without_padding() {
    let base = "python pretrain_gpt.py --tensor-model-parallel-size 1 --num-layers 4 \
                --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 \
                --micro-batch-size 1 --global-batch-size 16 --bf16 --vocab-size 32000 \
                --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 \
                --moe-expert-capacity-factor 1.25";
    let o = ImportOptions {
        nodes: Some(1),
        ..opts()
    };
    let (_, padded) = import_text(
        &format!("{base} --moe-pad-expert-input-to-capacity\n"),
        "m.sh",
        &o,
    );
    assert_eq!(padded.model.arch.moe_capacity_factor, 1.25);
    let imported = import_megatron(&format!("{base}\n"), "m.sh", &o).unwrap();
    let (_, dropping) = import_text(&format!("{base}\n"), "m.sh", &o);
    assert_eq!(dropping.model.arch.moe_capacity_factor, 0.0);
    assert!(
        imported
            .notes
            .iter()
            .any(|n| n.contains("--moe-expert-capacity-factor 1.25")),
        "{:?}",
        imported.notes
    );
}

/// A long-context script with a sliding window and Ulysses context parallelism (arrays, a
/// quoted tuple): the window, the CP form and the layout are the script's, and the job runs
/// with each layer's attention on the whole 32k sequence, 4 of the rank's 16 query heads and
/// the 4,096-token window, between all-to-alls over the CP group.
#[test]
fn long_context_a2a_script() {
    use prism_core::job::CpCommType;
    use prism_core::layout::GroupKind;
    use prism_core::ops::Work;
    let o = ImportOptions {
        nodes: None,
        ..opts()
    };
    let (toml, job) = import("mistral-7b-32k-a2a.sh", &o);
    assert_eq!(job.parallel.cp_comm_type, CpCommType::A2a, "{toml}");
    assert_eq!(
        (job.parallel.tp, job.parallel.cp, job.parallel.dp),
        (2, 4, 4)
    );
    assert_eq!(job.model.arch.attention_window, 4096);
    let r = prism_core::simulate(
        &job,
        &prism_core::SimOptions {
            mode: prism_core::Mode::Reduced,
            ..Default::default()
        },
    )
    .expect("simulates");
    let p = &r.graph.programs[0];
    let mut kernels = 0;
    let mut all_to_alls = 0;
    for k in &p.kind {
        match k {
            prism_core::graph::OpKind::Compute(op) => {
                if let Work::Attention {
                    heads,
                    seq_q,
                    window,
                    ..
                } = op.work
                {
                    assert_eq!((heads, seq_q, window), (4, 32768, 4096), "{}", op.name);
                    kernels += 1;
                }
            }
            prism_core::graph::OpKind::Collective {
                group: GroupKind::Cp,
                op,
                ..
            } => {
                assert_eq!(*op, prism_core::cost::comm::Collective::AllToAll);
                all_to_alls += 1;
            }
            _ => {}
        }
    }
    // Forward, the selective recompute of the core attention, and backward; two exchanges each.
    assert_eq!(kernels, 32 * 16 * 3);
    assert_eq!(all_to_alls, 2 * kernels);
    assert!(r.summary.breakdown.cp_s > 0.0);
}

/// Found by the fuzzer: the null tokenizer's end-of-document token on the largest vocabulary
/// a `u32` holds overflowed; the import now answers without panicking.
#[test]
fn null_tokenizer_on_the_largest_vocabulary() {
    let text = "python pretrain_gpt.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 \
                --seq-length 1024 --micro-batch-size 1 --global-batch-size 8 --bf16 \
                --tokenizer-type NullTokenizer --vocab-size 4294967295\n";
    let o = ImportOptions {
        nodes: Some(1),
        ..opts()
    };
    if let Ok(imported) = import_megatron(text, "v.sh", &o) {
        assert!(
            imported.toml.contains("vocab = 4294967295"),
            "{}",
            imported.toml
        );
    }
}
