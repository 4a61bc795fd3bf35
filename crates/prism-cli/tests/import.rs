//! `prism import nemo` from the command line: the written job
//! simulates, and a bad input exits non-zero with an error naming the key and the rule.

use std::path::PathBuf;
use std::process::{Command, Output};

fn prism(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .output()
        .expect("run prism")
}

fn data(p: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../prism-io/tests/data")
        .join(p)
        .display()
        .to_string()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prism-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// NeMo config -> job file -> `simulate --json`: the iteration is the one the job describes
/// (1,024 GPUs, the config's global batch of 2,048 sequences of 8,192 tokens).
#[test]
fn nemo_config_imports_and_simulates() {
    let out = tmp("llama3.toml");
    let o = prism(&[
        "import",
        "nemo",
        &data("nemo/llama3-70b.yaml"),
        "--override",
        "model.virtual_pipeline_model_parallel_size=null",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("wrote"));
    let s = prism(&["simulate", out.to_str().unwrap(), "--reduced", "--json"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let v: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(v["num_gpus"].as_u64(), Some(1024), "{v}");
    assert_eq!(v["tokens_per_iteration"].as_u64(), Some(2048 * 8192), "{v}");
}

/// A SentencePiece config without `--vocab-size` is refused, naming the key, the line and the
/// option that fixes it.
#[test]
fn nemo_refusals_name_the_key() {
    let bad = tmp("sp.yaml");
    let text = std::fs::read_to_string(data("nemo/llama3-70b.yaml"))
        .unwrap()
        .replace(
            "    library: huggingface\n    type: meta-llama/Meta-Llama-3-70B\n",
            "    library: sentencepiece\n    model: /data/tok.model\n",
        );
    std::fs::write(&bad, text).unwrap();
    let o = prism(&["import", "nemo", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("sp.yaml:42: model.tokenizer:") && err.contains("--vocab-size"),
        "{err}"
    );
    let ok = prism(&[
        "import",
        "nemo",
        bad.to_str().unwrap(),
        "--vocab-size",
        "32000",
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("vocab = 32256"));
    // A malformed override.
    let o = prism(&[
        "import",
        "nemo",
        bad.to_str().unwrap(),
        "--override",
        "model.x",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("expected NAME=VALUE"));
}
