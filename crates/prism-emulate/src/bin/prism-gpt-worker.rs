//! One rank of the reference GPT workload (`prism_emulate::worker`): recording, all-real over
//! TCP, or emulated against the coordinator.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match prism_emulate::worker::parse(&args, |k| std::env::var(k).ok()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("prism-gpt-worker: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = prism_emulate::worker::run(&parsed, |r| println!("{}", r.json())) {
        eprintln!("prism-gpt-worker: rank {}: {e}", parsed.rank);
        std::process::exit(1);
    }
}
