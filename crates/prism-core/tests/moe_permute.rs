//! The token permutations around an MoE layer's experts against their definition: each is a
//! streaming pass over the routed copies of the micro-batch's tokens, forward and mirrored in
//! backward, with the passes each dispatcher runs (Megatron-Core's alltoall dispatcher:
//! permute before the dispatch, reorder by local expert after it, and the reverse around the
//! combine; DeepEP: one permutation of its receive buffer each way, a token arriving once per
//! destination rank). The expected distinct ranks of a token are counted here by enumerating
//! every top-k expert set, independently of the closed form the graph uses.

mod common;

use std::collections::BTreeMap;

use prism_core::arch::fixtures::small_deepseek_job;
use prism_core::graph::{ExecutionGraph, OpKind};
use prism_core::job::{Job, MoeDispatcher};
use prism_core::layout::GroupKind;
use prism_core::{SimOptions, simulate};

const NAMES: [&str; 8] = [
    "moe_permute_fwd",
    "moe_sort_fwd",
    "moe_unsort_fwd",
    "moe_unpermute_fwd",
    "moe_unpermute_bwd",
    "moe_unsort_bwd",
    "moe_sort_bwd",
    "moe_permute_bwd",
];

/// One node, TP 1, 8 micro-batches per rank; 7 MoE layers of 8 experts, top-2, hidden 1024.
fn job(ep: u32, dispatcher: MoeDispatcher) -> Job {
    let mut job = small_deepseek_job(1, 1, 1, 64, ep);
    job.parallel.moe_dispatcher = dispatcher;
    job.validate().expect("valid test job");
    job
}

/// Expected distinct ranks that a uniformly random set of `k` of `experts` experts, `local`
/// per rank, reaches: by enumerating every set.
fn distinct_ranks(experts: u32, local: u32, k: u32) -> f64 {
    let (mut sets, mut ranks) = (0u64, 0u64);
    for mask in 0u32..(1 << experts) {
        if mask.count_ones() != k {
            continue;
        }
        sets += 1;
        ranks += (0..experts / local)
            .filter(|r| (mask >> (r * local)) & ((1 << local) - 1) != 0)
            .count() as u64;
    }
    ranks as f64 / sets as f64
}

#[test]
fn permutation_passes_follow_each_dispatcher() {
    let (h, k, experts) = (1024u64, 2u64, 8u32);
    let moe_layers = 7usize;
    for (ep, dispatcher) in [
        (1, MoeDispatcher::AllToAll),
        (4, MoeDispatcher::AllToAll),
        (8, MoeDispatcher::AllToAll),
        (4, MoeDispatcher::DeepEp),
        (2, MoeDispatcher::DeepEp),
    ] {
        let j = job(ep, dispatcher);
        let t = j.model.seq_len as u64; // micro-batch 1, TP 1, no context parallelism
        let mbs = (j.training.global_batch / j.parallel.dp / j.parallel.micro_batch) as usize;
        let local = experts / ep;
        let copies = t * k;
        let deepep = dispatcher == MoeDispatcher::DeepEp;
        // Source side: read the tokens, write their copies (and the reverse).
        let source = (!deepep).then_some((t + copies) * h * 2);
        let receive = if deepep {
            let unique = (t as f64 * distinct_ranks(experts, local, k as u32)).ceil() as u64;
            Some((unique + copies) * h * 2)
        } else {
            (ep > 1 && local > 1).then_some(2 * copies * h * 2)
        };
        let g = ExecutionGraph::build(&j);
        for name in NAMES {
            // DeepEP's receive-side passes carry the permutation names.
            let want = if name.contains("sort") {
                receive.filter(|_| !deepep)
            } else if deepep {
                receive
            } else {
                source
            };
            let bytes = common::memory_bytes_of(&g.programs[0], name);
            let n = bytes.len();
            match want {
                Some(b) => {
                    assert_eq!(n, moe_layers * mbs, "{name} ep {ep} {dispatcher:?}");
                    assert!(bytes.iter().all(|&x| x == b), "{name}: {bytes:?} vs {b}");
                }
                None => assert_eq!(n, 0, "{name} ep {ep} {dispatcher:?}"),
            }
        }
    }
}

/// Invariant: the shared experts still overlap the expert-parallel all-to-all they were placed
/// beside (the combine in forward, its gradient in backward) now that a permutation pass waits
/// for that all-to-all: each shared-expert GEMM that follows an all-to-all starts before it ends.
#[test]
fn shared_experts_run_while_the_all_to_all_is_in_flight() {
    for dispatcher in [MoeDispatcher::AllToAll, MoeDispatcher::DeepEp] {
        let j = job(4, dispatcher);
        let opts = SimOptions {
            record_ranks: vec![0],
            unfused: true,
            ..SimOptions::default()
        };
        let r = simulate(&j, &opts).expect("simulates");
        let prog = &r.graph.programs[0];
        let times: BTreeMap<u32, (u64, u64)> = r.timelines[0]
            .ops
            .iter()
            .map(|o| (o.op, (o.start, o.end)))
            .collect();
        let mut last_a2a = None;
        let mut checked = 0;
        for op in 0..prog.kind.len() as u32 {
            match &prog.kind[op as usize] {
                OpKind::Collective {
                    group: GroupKind::Ep,
                    ..
                } => last_a2a = Some(op),
                OpKind::Compute(c)
                    if c.name == "shared_fc1_fwd" || c.name == "shared_fc2_dgrad" =>
                {
                    let a2a = last_a2a.expect("an all-to-all before the shared experts");
                    let (start, _) = times[&op];
                    let (a2a_start, a2a_end) = times[&a2a];
                    assert!(a2a_end > a2a_start, "the all-to-all takes time");
                    assert!(
                        start < a2a_end,
                        "{dispatcher:?}: {} starts at {start}, after its all-to-all ends ({a2a_end})",
                        c.name
                    );
                    checked += 1;
                }
                _ => {}
            }
        }
        // 7 MoE layers x 8 micro-batches, forward and backward.
        assert_eq!(checked, 2 * 7 * 8, "{dispatcher:?}");
    }
}
