//! `prism import megatron`: a Megatron-LM launch script -> a Prism job file.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

#[derive(Debug, clap::Subcommand)]
pub enum ImportCommand {
    /// Read a Megatron-LM launch script (or a `pretrain_gpt.py` command line) and write the job
    /// file it describes: model, parallel layout, batch, precision and overlaps, each key
    /// commented with the argument it came from. The script's variables, arrays and
    /// `$(( ))` arithmetic are expanded; the GPU type comes from `--cluster`.
    Megatron(MegatronArgs),
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
    let ImportCommand::Megatron(a) = cmd;
    let text = std::fs::read_to_string(&a.script)
        .with_context(|| format!("cannot read {}", a.script.display()))?;
    let mut vars = Vec::new();
    for v in &a.vars {
        let Some((name, value)) = v.split_once('=') else {
            bail!("--var {v}: expected NAME=VALUE");
        };
        vars.push((name.trim().to_string(), value.to_string()));
    }
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
    // The file must load as a job: check it now, so that a bad combination is reported here.
    prism_io::jobfile::load_job_str(&imported.toml, &origin, None, &[])
        .with_context(|| "the job read from the script does not load".to_string())?;
    match &a.out {
        Some(out) => {
            std::fs::write(out, &imported.toml)
                .with_context(|| format!("cannot write {}", out.display()))?;
            eprintln!(
                "wrote {} ({} arguments of the script not used{})",
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
