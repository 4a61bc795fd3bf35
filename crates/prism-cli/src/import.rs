//! `prism import megatron` / `prism import nemo`: a Megatron-LM launch script or a NeMo training
//! config -> a Prism job file.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

#[derive(Debug, clap::Subcommand)]
pub enum ImportCommand {
    /// Read a Megatron-LM launch script (or a `pretrain_gpt.py` command line) and write the job
    /// file it describes: model, parallel layout, batch, precision and overlaps, each key
    /// commented with the argument it came from. The script's variables, arrays and
    /// `$(( ))` arithmetic are expanded; the GPU type comes from `--cluster`.
    Megatron(MegatronArgs),
    /// Read a NeMo training config (YAML: NeMo Framework Launcher's
    /// `conf/training/<family>/<model>.yaml`, or NeMo's `megatron_gpt_config.yaml` layout) and
    /// write the job file it describes, each key commented with the config key and line it came
    /// from. OmegaConf interpolations between keys are resolved; the GPU type comes from
    /// `--cluster`.
    Nemo(NemoArgs),
}

#[derive(Debug, clap::Args)]
pub struct NemoArgs {
    /// The training config (YAML).
    config: PathBuf,
    /// Cluster preset the job runs on (the config does not name the GPU).
    #[arg(long, default_value = "dgx-h100")]
    cluster: String,
    /// Nodes (default: the config's `trainer.num_nodes`).
    #[arg(long)]
    nodes: Option<u32>,
    /// GPUs per node (default: the config's `trainer.devices`, else the preset's).
    #[arg(long)]
    gpus_per_node: Option<u32>,
    /// Override a config key before reading, Hydra style, e.g. `--override
    /// model.micro_batch_size=2` (repeatable; a `training.` prefix is accepted).
    #[arg(long = "override", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// The tokenizer's vocabulary size before padding, for configs whose tokenizer is a model
    /// file (SentencePiece) Prism cannot read.
    #[arg(long)]
    vocab_size: Option<u32>,
    /// Job name (default: the config's `run.name`, else its file name).
    #[arg(long)]
    name: Option<String>,
    /// Write the job file here instead of printing it.
    #[arg(long, short, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct MegatronArgs {
    /// The launch script (bash) or a file holding the command line.
    script: PathBuf,
    /// Cluster preset the job runs on (the arguments do not name the GPU).
    #[arg(long, default_value = "dgx-h100")]
    cluster: String,
    /// Nodes (default: the script's torchrun `--nnodes`).
    #[arg(long)]
    nodes: Option<u32>,
    /// GPUs per node (default: torchrun's `--nproc_per_node`, else the preset's).
    #[arg(long)]
    gpus_per_node: Option<u32>,
    /// Set a script variable, e.g. `--var NUM_NODES=64` (repeatable; wins over the script).
    #[arg(long = "var", value_name = "NAME=VALUE")]
    vars: Vec<String>,
    /// Add a Megatron argument, e.g. `--arg "--vocab-size 151936"` (repeatable; wins over the
    /// script's value of the same argument).
    #[arg(long = "arg", value_name = "ARGUMENTS", allow_hyphen_values = true)]
    args: Vec<String>,
    /// The run's training log (Megatron-LM iteration lines or Prism's CSV timing log): its
    /// median iteration time becomes the job's `[published]` figure, printed by `simulate`
    /// beside the prediction.
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Job name (default: the script's file name).
    #[arg(long)]
    name: Option<String>,
    /// Write the job file here instead of printing it.
    #[arg(long, short, value_name = "FILE")]
    out: Option<PathBuf>,
}

pub fn run(cmd: &ImportCommand) -> Result<()> {
    match cmd {
        ImportCommand::Megatron(a) => megatron(a),
        ImportCommand::Nemo(a) => nemo(a),
    }
}

/// `NAME=VALUE` pairs of a repeatable option (`--var`, `--override`).
fn pairs(option: &str, items: &[String]) -> Result<Vec<(String, String)>> {
    items
        .iter()
        .map(|o| match o.split_once('=') {
            Some((key, value)) => Ok((key.trim().to_string(), value.to_string())),
            None => bail!("{option} {o}: expected NAME=VALUE"),
        })
        .collect()
}

fn nemo(a: &NemoArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.config)
        .with_context(|| format!("cannot read {}", a.config.display()))?;
    let overrides = pairs("--override", &a.overrides)?;
    let opts = prism_io::nemo::NemoOptions {
        machine: prism_io::megatron_args::ImportOptions {
            cluster: a.cluster.clone(),
            nodes: a.nodes,
            gpus_per_node: a.gpus_per_node,
            name: a.name.clone(),
            ..Default::default()
        },
        overrides,
        vocab_size: a.vocab_size,
    };
    let origin = a.config.display().to_string();
    let imported = prism_io::nemo::import_nemo(&text, &origin, &opts)?;
    write(
        &imported,
        &origin,
        a.out.as_ref(),
        "config",
        "keys of the config",
    )
}

fn megatron(a: &MegatronArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.script)
        .with_context(|| format!("cannot read {}", a.script.display()))?;
    let vars = pairs("--var", &a.vars)?;
    let measured = match &a.log {
        Some(log) => {
            let text = std::fs::read_to_string(log)
                .with_context(|| format!("cannot read {}", log.display()))?;
            Some(prism_io::megatron_args::measured_iteration_time(
                &text,
                &log.display().to_string(),
            )?)
        }
        None => None,
    };
    let opts = prism_io::megatron_args::ImportOptions {
        cluster: a.cluster.clone(),
        nodes: a.nodes,
        gpus_per_node: a.gpus_per_node,
        vars,
        name: a.name.clone(),
        extra_args: a.args.clone(),
        measured,
    };
    let origin = a.script.display().to_string();
    let imported = prism_io::megatron_args::import_megatron(&text, &origin, &opts)?;
    write(
        &imported,
        &origin,
        a.out.as_ref(),
        "script",
        "arguments of the script",
    )
}

/// Checks that the job loads, then writes it (or prints it).
fn write(
    imported: &prism_io::megatron_args::Imported,
    origin: &str,
    out: Option<&PathBuf>,
    what: &str,
    unused: &str,
) -> Result<()> {
    // The file must load as a job: check it now, so that a bad combination is reported here.
    let written = format!("the job written from {origin}");
    prism_io::jobfile::load_job_str(&imported.toml, &written, None, &[])
        .with_context(|| format!("the job read from the {what} does not load"))?;
    match out {
        Some(out) => {
            std::fs::write(out, &imported.toml)
                .with_context(|| format!("cannot write {}", out.display()))?;
            eprintln!(
                "wrote {} ({} {unused} not used{})",
                out.display(),
                imported.unused.len(),
                if imported.notes.is_empty() {
                    String::new()
                } else {
                    format!(", {} notes", imported.notes.len())
                }
            );
            for n in &imported.notes {
                eprintln!("note: {n}");
            }
        }
        None => out!("{}", imported.toml)?,
    }
    Ok(())
}
