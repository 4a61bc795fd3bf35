//! Critical-path attribution (`prism_predict::attribution`) against independent truth: the
//! engine's own iteration time, a deliberately slowed rank, and per-rank kernel totals the engine
//! accumulates on its own.

use prism_core::job::fixtures::small_job;
use prism_core::{Mode, SimOptions, simulate};
use prism_predict::attribution::critical_path;
use prism_predict::perturbation::Perturbation;

fn all_ranks(n: u64) -> Vec<u32> {
    (0..n as u32).collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

#[test]
fn path_length_is_the_iteration_time() {
    let job = small_job(2, 2, 2, 16);
    job.validate().unwrap();
    let r = simulate(
        &job,
        &SimOptions {
            mode: Mode::Full,
            record_ranks: all_ranks(job.num_gpus()),
            ..Default::default()
        },
    )
    .unwrap();
    let a = critical_path(&r);
    let t = r.summary.iteration_time_s;
    eprintln!(
        "path {} s, iteration {} s, wait {} s, {} ops; top {:?}",
        a.path_s,
        t,
        a.wait_s,
        a.ops,
        &a.by_op[..a.by_op.len().min(5)]
    );
    assert!(rel(a.path_s, t) < 1e-9, "path {} vs {t}", a.path_s);
    let sum_op: f64 = a.by_op.iter().map(|x| x.1).sum();
    let sum_class: f64 = a.by_class.iter().map(|x| x.1).sum();
    let sum_rank: f64 = a.by_rank.iter().map(|x| x.1).sum();
    for s in [sum_op, sum_class, sum_rank] {
        assert!(rel(s, a.path_s) < 1e-9, "{s} vs {}", a.path_s);
    }
    // With every rank recorded the path is all execution, no unexplained waiting.
    assert!(a.wait_s <= 1e-12 * t, "wait {}", a.wait_s);
    // Sorted, largest first.
    assert!(a.by_op.windows(2).all(|w| w[0].1 >= w[1].1));
    assert!(a.by_rank.windows(2).all(|w| w[0].1 >= w[1].1));
    // The path crosses the pipeline: both stages appear.
    let stage_size = job.num_gpus() as u32 / 2;
    assert!(a.by_rank.iter().any(|(r, _)| *r < stage_size));
    assert!(a.by_rank.iter().any(|(r, _)| *r >= stage_size));
}

#[test]
fn a_slowed_rank_tops_the_ranks() {
    let job = small_job(2, 2, 2, 16);
    let n = job.num_gpus() as usize;
    for slow in [0usize, 5, 9, 15] {
        let mut rank_factor = vec![1.0; n];
        rank_factor[slow] = 2.0;
        let r = simulate(
            &job,
            &SimOptions {
                mode: Mode::Full,
                record_ranks: all_ranks(job.num_gpus()),
                perturbation: Some(std::sync::Arc::new(Perturbation {
                    rank_factor,
                    ..Default::default()
                })),
                ..Default::default()
            },
        )
        .unwrap();
        let a = critical_path(&r);
        eprintln!(
            "slow {slow}: by_rank {:?}",
            &a.by_rank[..a.by_rank.len().min(4)]
        );
        assert_eq!(a.by_rank[0].0, slow as u32);
        assert!(rel(a.path_s, r.summary.iteration_time_s) < 1e-9);
        assert!(a.wait_s <= 1e-12 * a.path_s);
    }
}

#[test]
fn without_communication_the_classes_are_the_kernel_times() {
    // pp 1, tp 1, dp 8 on one node; an ideal network makes the DP collectives free, so the
    // iteration is one rank's kernels back to back.
    let job = small_job(1, 1, 1, 8);
    let r = simulate(
        &job,
        &SimOptions {
            mode: Mode::Full,
            record_ranks: all_ranks(job.num_gpus()),
            ideal_network: true,
            ..Default::default()
        },
    )
    .unwrap();
    let a = critical_path(&r);
    assert!(rel(a.path_s, r.summary.iteration_time_s) < 1e-9);
    // Only kernel classes appear: collectives take no time.
    for (c, t) in &a.by_class {
        assert!(!c.ends_with("comm"), "{c} {t}");
    }
    // Ranks are identical, so the path stays on one rank; compare with the engine's own
    // per-rank kernel accounting.
    assert_eq!(a.by_rank.len(), 1, "{:?}", a.by_rank);
    let rank = a.by_rank[0].0;
    let timing = r.ranks.iter().find(|t| t.rank == rank).unwrap();
    let total: f64 = a.by_class.iter().map(|x| x.1).sum();
    let gemm = a
        .by_class
        .iter()
        .find(|(c, _)| c == "gemm")
        .map_or(0.0, |x| x.1);
    eprintln!(
        "kernels {} s (engine {}), gemm {} s (engine {})",
        total, timing.compute_s, gemm, timing.gemm_s
    );
    assert!(rel(total, timing.compute_s) < 1e-9);
    assert!(rel(gemm, timing.gemm_s) < 1e-9);
    // Every class against the rank's recorded kernel time of that class.
    let prog = r.graph.program_of(rank);
    let tl = r.timelines.iter().find(|t| t.rank == rank).unwrap();
    let mut per_class = std::collections::BTreeMap::<String, f64>::new();
    for rec in &tl.ops {
        if let prism_core::graph::OpKind::Compute(c) = prog.kind[rec.op as usize] {
            *per_class.entry(c.class.name().to_string()).or_default() +=
                (rec.end - rec.start) as f64 * 1e-12;
        }
    }
    per_class.retain(|_, t| *t > 0.0);
    assert_eq!(per_class.len(), a.by_class.len());
    for (c, t) in &a.by_class {
        assert!(rel(*t, per_class[c]) < 1e-9, "{c}: {t} vs {}", per_class[c]);
    }
}

#[test]
fn nothing_recorded_gives_an_empty_attribution() {
    let job = small_job(1, 1, 1, 8);
    let r = simulate(&job, &SimOptions::default()).unwrap();
    let a = critical_path(&r);
    assert_eq!(a.path_s, 0.0);
    assert!(a.by_op.is_empty() && a.by_rank.is_empty());
}
