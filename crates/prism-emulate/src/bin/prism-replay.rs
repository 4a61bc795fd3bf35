//! `prism-replay GRAPH [--sleep]`: a scripted real rank. Reads its rank, the world size and the
//! coordinator's address from `PRISM_RANK`, `PRISM_WORLD_SIZE` and `PRISM_COORDINATOR` (as
//! `prism emulate -- COMMAND` sets them), and replays its class's recorded calls from the
//! sliced graph, instantiated for its rank; `--sleep` spends each recorded compute segment as
//! wall time first.

use std::process::ExitCode;
use std::time::Duration;

use prism_emulate::graph_file::SlicedGraph;
use prism_emulate::protocol::Bye;
use prism_emulate::replay::{ReplayOptions, replay};
use prism_emulate::slice::instantiate;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prism-replay: {e}");
            ExitCode::from(1)
        }
    }
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .ok_or("usage: prism-replay GRAPH [--sleep]")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let graph = SlicedGraph::from_json(&text, path)?;
    let rank: u32 = env("PRISM_RANK")?
        .parse()
        .map_err(|_| "PRISM_RANK is not a rank")?;
    let world: u32 = env("PRISM_WORLD_SIZE")?
        .parse()
        .map_err(|_| "PRISM_WORLD_SIZE is not a number")?;
    let addr = env("PRISM_COORDINATOR")?;
    let calls = instantiate(&graph, rank)?;
    let class = graph.class_of(rank);
    let bye = Bye {
        compute_s: class.tail_ps as f64 * 1e-12,
        peak_memory_bytes: class.peak_memory_bytes,
    };
    let opts = ReplayOptions {
        sleep: args.iter().any(|a| a == "--sleep"),
        connect_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    replay(&addr, rank, world, &calls, &bye, &opts).map(|_| ())
}
