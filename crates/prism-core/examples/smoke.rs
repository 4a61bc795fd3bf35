use prism_core::job::fixtures::*;
use prism_core::job::*;
use prism_core::{Mode, SimOptions, simulate};
fn llama405(nodes: u32) -> Job {
    let mut j = small_job(nodes, 8, 16, 2048);
    j.model = Model {
        name: "llama3-405b".into(),
        layers: 126,
        hidden: 16384,
        ffn_hidden: 53248,
        heads: 128,
        kv_heads: 8,
        head_dim: 128,
        vocab: 128256,
        seq_len: 8192,
        activation: Activation::SwiGlu,
        moe: None,
        tied_embeddings: false,
    };
    j.parallel.first_stage_layers = Some(7);
    j.parallel.last_stage_layers = Some(7);
    j.parallel.dp = nodes * 8 / 128;
    j.training.global_batch = 16 * j.parallel.dp;
    j
}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes: u32 = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(16);
    let mode = args.get(2).map(|s| s.as_str()).unwrap_or("full");
    let j = small_job(2, 2, 2, 16);
    j.validate().unwrap();
    let r = simulate(&j, &SimOptions::default()).unwrap();
    println!("small: {:?}", r.summary.iteration_time_s);
    let j = llama405(nodes);
    j.validate().unwrap();
    let t = std::time::Instant::now();
    let opts = SimOptions {
        mode: if mode == "full" {
            Mode::Full
        } else {
            Mode::Reduced
        },
        ..Default::default()
    };
    let r = simulate(&j, &opts).unwrap();
    println!(
        "405b {} gpus: iter {:.3}s mfu {:.3} bubble {:.3} events {} wall {:?}",
        j.num_gpus(),
        r.summary.iteration_time_s,
        r.summary.mfu,
        r.summary.bubble_fraction,
        r.events,
        t.elapsed()
    );
    println!("{:?}", r.summary.breakdown);
}
