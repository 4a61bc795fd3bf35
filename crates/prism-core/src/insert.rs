//! Extra compute work in a program: ops inserted on the compute stream at chosen places (the
//! inference prefill BUBBLETEA admits into pipeline bubbles), so the engine can check what they
//! do to the iteration.

use crate::graph::{NONE, OpKind, OpTag, Phase, Program, Stream};
use crate::ops::ComputeOp;

/// A copy of `program` with compute ops inserted on its compute stream: `(after, op)` puts `op`
/// right after the compute-stream op at position `after` (`None`: before the first). Inserted
/// ops depend on nothing else, so an op placed after compute op `i` starts when `i` ends and
/// delays the next compute op only if that one would have started earlier. Several ops at one
/// place keep their order. Every other op, stream order and dependency is kept.
pub fn with_compute_inserted(program: &Program, inserts: &[(Option<u32>, ComputeOp)]) -> Program {
    let mut out = Program::default();
    let mut new_id = vec![0u32; program.len()];
    let tag = OpTag {
        phase: Phase::Forward,
        micro_batch: NONE,
        layer: NONE,
    };
    let put = |out: &mut Program, at: Option<u32>| {
        for (_, op) in inserts.iter().filter(|(a, _)| *a == at) {
            out.push(OpKind::Compute(*op), Stream::Compute, tag, &[]);
        }
    };
    put(&mut out, None);
    let mut deps = Vec::new();
    for op in 0..program.len() as u32 {
        deps.clear();
        deps.extend(program.deps_of(op).iter().map(|&d| new_id[d as usize]));
        let id = out.push(
            program.kind[op as usize],
            program.stream[op as usize],
            program.tag[op as usize],
            &deps,
        );
        new_id[op as usize] = id;
        if program.stream[op as usize] == Stream::Compute {
            put(&mut out, Some(program.pos[op as usize]));
        }
    }
    out.recv_slots = program.recv_slots;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Mode, SimOptions, simulate, simulate_with_graph};
    use crate::graph::ExecutionGraph;
    use crate::job::fixtures::small_job;
    use crate::ops::{OpClass, Work};

    fn measured(ps: u64) -> ComputeOp {
        ComputeOp {
            name: "extra",
            class: OpClass::Elementwise,
            work: Work::Measured { ps },
            recompute: false,
            sm_margin: false,
        }
    }

    /// Rebuilding with nothing inserted gives the same program and the same iteration; an op
    /// appended after the last compute op of every stage lengthens the iteration by exactly
    /// its duration when it sits on the critical path's end (the last stage finishes last).
    #[test]
    fn inserted_compute_runs_where_placed() {
        let job = small_job(2, 2, 2, 16);
        let opts = SimOptions {
            mode: Mode::Reduced,
            ..Default::default()
        };
        let base = simulate(&job, &opts).unwrap();
        let g = ExecutionGraph::build(&job);
        let same = ExecutionGraph {
            layout: g.layout,
            ep_nic_scale: g.ep_nic_scale,
            programs: g
                .programs
                .iter()
                .map(|p| with_compute_inserted(p, &[]))
                .collect(),
        };
        assert_eq!(same.programs, g.programs);
        let again = simulate_with_graph(&job, same, &opts).unwrap();
        assert_eq!(
            again.summary.iteration_time_s,
            base.summary.iteration_time_s
        );
        // 1 ms after the very last compute op of every stage.
        let extra = 1_000_000_000u64;
        let longer = ExecutionGraph {
            layout: g.layout,
            ep_nic_scale: g.ep_nic_scale,
            programs: g
                .programs
                .iter()
                .map(|p| {
                    let last = p.stream_ops[Stream::Compute as usize].len() as u32 - 1;
                    with_compute_inserted(p, &[(Some(last), measured(extra))])
                })
                .collect(),
        };
        let r = simulate_with_graph(&job, longer, &opts).unwrap();
        let d = r.summary.iteration_time_s - base.summary.iteration_time_s;
        assert!(d > 0.0 && d <= 1e-3 + 1e-12, "added {d} s");
    }
}
