//! `prism-fuzz`: runs the mutation fuzzer (see the library docs) and exits 1 on any finding.
//!
//! ```sh
//! cargo run --release -p prism-fuzz -- --cases 20000            # every target
//! cargo run --release -p prism-fuzz -- --target job --cases 1000 --seed 7 --keep crashes/
//! ```

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use prism_fuzz::{Target, fuzz, quiet_panics};

#[derive(Debug, Parser)]
#[command(
    name = "prism-fuzz",
    about = "Mutation fuzzer over Prism's readers and entry points"
)]
struct Args {
    /// Cases per target.
    #[arg(long, default_value_t = 2000)]
    cases: u64,
    /// First case index (replay one case with `--start I --cases 1`).
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Seed of every mutation.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Targets (default: all): job, hf, kernel-table, samples, dist-table, cases, kineto,
    /// resilience-log, scenario, kernel-bench, megatron, nemo.
    #[arg(long, value_delimiter = ',')]
    target: Vec<String>,
    /// Write each finding's input to DIR/<target>-<seed>-<index>.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let targets: Vec<Target> = if args.target.is_empty() {
        Target::ALL.to_vec()
    } else {
        let mut v = Vec::new();
        for name in &args.target {
            match Target::from_name(name) {
                Some(t) => v.push(t),
                None => {
                    eprintln!(
                        "error: --target: unknown target `{name}`; one of {}",
                        Target::ALL.map(|t| t.name()).join(", ")
                    );
                    std::process::exit(2);
                }
            }
        }
        v
    };
    if let Some(dir) = &args.keep
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        eprintln!("error: --keep: cannot create {}: {e}", dir.display());
        std::process::exit(2);
    }
    quiet_panics();
    let t0 = Instant::now();
    let mut findings = 0;
    let mut total = 0;
    println!(
        "{:<14} {:>8} {:>9} {:>9} {:>9} {:>10}",
        "target", "cases", "accepted", "refused", "findings", "slowest s"
    );
    for t in targets {
        let keep = |i: u64, input: &str| {
            if let Some(dir) = &args.keep {
                let p = dir.join(format!("{}-{}-{i}", t.name(), args.seed));
                let _ = std::fs::write(p, input);
            }
        };
        let tally = fuzz(t, args.seed, args.start, args.cases, &keep);
        println!(
            "{:<14} {:>8} {:>9} {:>9} {:>9} {:>10.3}",
            t.name(),
            tally.cases,
            tally.accepted,
            tally.refused,
            tally.findings.len(),
            tally.slowest_s
        );
        for (i, what) in &tally.findings {
            println!(
                "  finding: target {} seed {} case {i}: {what}",
                t.name(),
                args.seed
            );
        }
        findings += tally.findings.len();
        total += tally.cases;
    }
    println!(
        "{total} cases ({} jobs simulated and predicted), {findings} findings, {:.1} s",
        prism_fuzz::SIMULATED.load(std::sync::atomic::Ordering::Relaxed),
        t0.elapsed().as_secs_f64()
    );
    if findings > 0 {
        std::process::exit(1);
    }
}
