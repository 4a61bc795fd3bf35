//! The engine's hook for external (real) ranks, driven by scripted callbacks and compared with
//! the offline run of the same graph.

use std::collections::BTreeMap;

use prism_core::engine::{External, GraphOptions, Mode, SimError, simulate_graph};
use prism_core::graph::{ExecutionGraph, OpKind};
use prism_core::job::Cluster;
use prism_core::ops::Work;
use prism_core::units::SimTime;
use prism_emulate::graph_file::{ClusterSpec, LayoutSpec};
use prism_emulate::slice;
use prism_emulate::synth::{self, SynthSpec};

fn cluster() -> Cluster {
    let mut c = prism_core::job::fixtures::small_job(1, 1, 1, 8).cluster;
    c.gpus_per_node = 8;
    c.nodes = 1;
    c
}

fn graph(layout: LayoutSpec) -> ExecutionGraph {
    let spec = SynthSpec::small(layout);
    let size = layout.tp * layout.dp;
    let traces: Vec<_> = (0..layout.pp)
        .map(|s| synth::trace(&spec, s * size))
        .collect();
    let cs = ClusterSpec {
        preset: "dgx-h100".into(),
        set: vec![],
    };
    slice::slice(&traces, layout, cs).unwrap().graph(8).unwrap()
}

fn measured(g: &ExecutionGraph, rank: u32, op: u32) -> SimTime {
    match g.program_of(rank).kind[op as usize] {
        OpKind::Compute(c) => match c.work {
            Work::Measured { ps } => ps,
            _ => panic!("not measured"),
        },
        k => panic!("op {op} is {k:?}"),
    }
}

/// Returns the recorded durations (scaled by `scale[rank]`) and notes everything it is told.
struct Scripted<'g> {
    graph: &'g ExecutionGraph,
    scale: BTreeMap<u32, u64>,
    asked: Vec<(u32, u32, SimTime)>,
    done: Vec<(u32, u32, SimTime)>,
    fail_at: Option<(u32, u32)>,
}

impl External for Scripted<'_> {
    fn compute_ps(&mut self, rank: u32, op: u32, start: SimTime) -> Result<SimTime, String> {
        self.asked.push((rank, op, start));
        if self.fail_at == Some((rank, op)) {
            return Err(format!("rank {rank} crashed at op {op}"));
        }
        Ok(measured(self.graph, rank, op) * self.scale.get(&rank).copied().unwrap_or(1))
    }
    fn comm_done(&mut self, rank: u32, op: u32, end: SimTime) -> Result<(), String> {
        self.done.push((rank, op, end));
        Ok(())
    }
}

fn scripted(g: &ExecutionGraph) -> Scripted<'_> {
    Scripted {
        graph: g,
        scale: BTreeMap::new(),
        asked: vec![],
        done: vec![],
        fail_at: None,
    }
}

#[test]
fn recorded_durations_reproduce_the_offline_run() {
    let layout = LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    };
    let g = graph(layout);
    let cl = cluster();
    for mode in [Mode::Full, Mode::Reduced] {
        for real in [vec![5u32], vec![0, 5], vec![2, 3]] {
            let offline = simulate_graph(
                &g,
                &cl,
                &GraphOptions {
                    mode: mode.clone(),
                    record_ranks: if mode == Mode::Full {
                        real.clone()
                    } else {
                        vec![]
                    },
                    ..Default::default()
                },
                None,
            )
            .unwrap();
            let mut hook = scripted(&g);
            let opts = GraphOptions {
                mode: mode.clone(),
                external_ranks: real.clone(),
                ..Default::default()
            };
            let run = simulate_graph(&g, &cl, &opts, Some(&mut hook)).unwrap();
            assert_eq!(run.iteration_ps, offline.iteration_ps, "{mode:?} {real:?}");
            for &r in &real {
                let prog = g.program_of(r);
                // Every compute op asked for once, in program order; every call reported once.
                let asked: Vec<u32> = (hook.asked.iter())
                    .filter(|a| a.0 == r)
                    .map(|a| a.1)
                    .collect();
                assert_eq!(asked, (0..prog.len() as u32).step_by(2).collect::<Vec<_>>());
                let done: Vec<(u32, SimTime)> = (hook.done.iter())
                    .filter(|a| a.0 == r)
                    .map(|a| (a.1, a.2))
                    .collect();
                assert_eq!(done.len(), prog.len() / 2);
                // Each call ends when the next segment starts (the rank blocks in each call)...
                for (k, &(op, end)) in done.iter().enumerate() {
                    assert_eq!(op, 2 * k as u32 + 1);
                    let next = hook
                        .asked
                        .iter()
                        .find(|a| a.0 == r && a.1 == op + 1)
                        .unwrap();
                    assert_eq!(next.2, end);
                }
                // ... and at the time the offline run recorded for it.
                if mode == Mode::Full {
                    let tl = offline.timelines.iter().find(|t| t.rank == r).unwrap();
                    for &(op, end) in &done {
                        let rec = tl.ops.iter().find(|o| o.op == op).unwrap();
                        assert_eq!(rec.end, end, "rank {r} op {op}");
                    }
                }
            }
        }
    }
}

#[test]
fn an_instance_takes_the_slowest_of_its_real_ranks() {
    // Reduced mode: ranks 4 and 6 are both of stage 1; rank 6 reports twice the recorded
    // compute. The run must equal the offline run of the graph whose stage-1 segments are
    // doubled (every rank of the class reuses the slowest real rank's compute).
    let layout = LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    };
    let g = graph(layout);
    let cl = cluster();
    let mut hook = scripted(&g);
    hook.scale.insert(6, 2);
    let opts = GraphOptions {
        mode: Mode::Reduced,
        external_ranks: vec![4, 6],
        ..Default::default()
    };
    let run = simulate_graph(&g, &cl, &opts, Some(&mut hook)).unwrap();
    let mut doubled = g.clone();
    for k in doubled.programs[1].kind.iter_mut() {
        if let OpKind::Compute(c) = k
            && let Work::Measured { ps } = &mut c.work
        {
            *ps *= 2;
        }
    }
    let offline = simulate_graph(&doubled, &cl, &GraphOptions::default(), None).unwrap();
    assert_eq!(run.iteration_ps, offline.iteration_ps);
    // Both real ranks hear of every call, at the same times.
    let of = |r: u32| -> Vec<(u32, SimTime)> {
        (hook.done.iter())
            .filter(|d| d.0 == r)
            .map(|d| (d.1, d.2))
            .collect()
    };
    assert_eq!(of(4), of(6));
    // Deterministic: a second run gives the same answers.
    let mut again = scripted(&g);
    again.scale.insert(6, 2);
    let run2 = simulate_graph(&g, &cl, &opts, Some(&mut again)).unwrap();
    assert_eq!(run2.iteration_ps, run.iteration_ps);
    assert_eq!(again.done, hook.done);
}

#[test]
fn a_failing_hook_ends_the_run_with_its_message() {
    let g = graph(LayoutSpec {
        tp: 2,
        pp: 2,
        dp: 2,
    });
    let mut hook = scripted(&g);
    hook.fail_at = Some((1, 6));
    let opts = GraphOptions {
        external_ranks: vec![1],
        ..Default::default()
    };
    let e = simulate_graph(&g, &cluster(), &opts, Some(&mut hook)).unwrap_err();
    assert_eq!(e, SimError::External("rank 1 crashed at op 6".into()));
    // External ranks without a hook are refused.
    let e = simulate_graph(&g, &cluster(), &opts, None).unwrap_err();
    assert!(matches!(e, SimError::InvalidOption(_)), "{e}");
}
