//! Runs the reference workload all-real (the first half of `prism emulate validate`) and prints
//! per-rank iteration times and peak memory:
//!
//!     cargo build -p prism-emulate --bins --examples
//!     target/debug/examples/all_real [--layout 2,2,2] [--iters 3] [--warmup 1] [--repeats 3] [--no-lock]
//!
//! Communication is priced by Prism's engine on one DGX H100 node
//! (`prism_core::job::fixtures::h100_cluster`); the worker is `prism-gpt-worker` beside the
//! examples directory. Workers compute one at a time (a compute lock) unless `--no-lock`.

use std::time::Duration;

use prism_emulate::validate::{AllRealOptions, EngineCost, WorkerCommand, run_all_real};
use prism_emulate::workload::Config;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str, d: &str| -> String {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| d.to_string())
    };
    let num = |k: &str, d: &str| -> u32 {
        get(k, d).parse().unwrap_or_else(|_| {
            eprintln!("{k}: expected an integer");
            std::process::exit(2)
        })
    };
    let config = match Config::reference().with_layout(&get("--layout", "2,2,2")) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2)
        }
    };
    let exe = std::env::current_exe().expect("current exe");
    let worker = exe
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("prism-gpt-worker"))
        .expect("worker path");
    let opts = AllRealOptions {
        config,
        warmup: num("--warmup", "1"),
        iters: num("--iters", "3"),
        repeats: num("--repeats", "3"),
        worker: WorkerCommand {
            program: worker,
            args: vec![],
        },
        timeout: Duration::from_secs(300),
        work_dir: std::env::temp_dir().join(format!("prism-all-real-{}", std::process::id())),
        compute_lock: !args.iter().any(|a| a == "--no-lock"),
    };
    let cluster = prism_core::job::fixtures::h100_cluster(1);
    match run_all_real(&opts, &EngineCost::new(&cluster)) {
        Ok(res) => {
            for r in &res.ranks {
                println!(
                    "rank {}: iteration {:.6} s (logical clock), compute {:.6} s, wall {:.6} s, peak {} B",
                    r.rank, r.iteration_time_s, r.compute_s, r.wall_s, r.peak_memory_bytes
                );
            }
            println!(
                "job: median iteration {:.6} s over {} samples {:?}",
                res.iteration_time_s,
                res.samples_s.len(),
                res.samples_s
            );
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
    let _ = std::fs::remove_dir_all(&opts.work_dir);
}
