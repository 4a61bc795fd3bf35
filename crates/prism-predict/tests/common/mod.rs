//! Shared by the integration tests.

use prism_core::engine::{Mode, SimOptions, simulate};
use prism_core::job::Job;
use prism_core::job::fixtures::small_job;
use prism_core::ops::OpClass;

/// The closed form of one GPU with i.i.d. normal GEMM jitter of standard deviation `sigma`:
/// the iteration is one chain of kernels, so its time is normal with mean `T` (the
/// deterministic time; the factors have mean 1) and variance `sigma^2 sum d_k^2` over the GEMM
/// kernels, whose nominal durations `d_k` come from the engine's recorded timeline. Returns the
/// job, `T` and the standard deviation (seconds).
pub fn one_gpu_gemm_jitter(sigma: f64) -> (Job, f64, f64) {
    let mut job = small_job(1, 1, 1, 8);
    job.cluster.gpus_per_node = 1;
    job.parallel.dp = 1;
    let run = simulate(
        &job,
        &SimOptions {
            mode: Mode::Full,
            record_ranks: vec![0],
            ..SimOptions::default()
        },
    )
    .unwrap();
    let prog = &run.graph.programs[0];
    let tl = &run.timelines[0];
    let mut var = 0.0;
    let mut busy = 0.0;
    for r in &tl.ops {
        let d = (r.end - r.start) as f64 * 1e-12;
        busy += d;
        if let prism_core::graph::OpKind::Compute(c) = prog.kind[r.op as usize]
            && c.class == OpClass::Gemm
        {
            var += (sigma * d).powi(2);
        }
    }
    let t = run.summary.iteration_time_s;
    // One chain: the ops fill the iteration without gaps or overlap.
    assert!((busy - t).abs() < 1e-9 * t, "busy {busy} vs {t}");
    (job, t, var.sqrt())
}
