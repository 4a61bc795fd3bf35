//! Model-family features (prism_core::arch) against closed forms: multi-head latent
//! attention, shared and routed experts with leading dense layers, sliding-window and chunked
//! attention; the execution graph against the FLOP counts; memory against parameter counts;
//! reduced and sliced simulations against the full one for MoE jobs with expert parallelism.

use prism_core::arch::fixtures::{small_deepseek_job, small_gemma_job};
use prism_core::arch::{Arch, WindowKind};
use prism_core::cost::comm::Collective;
use prism_core::flops;
use prism_core::graph::{ExecutionGraph, OpKind};
use prism_core::job::{Job, Recompute};
use prism_core::layout::GroupKind;
use prism_core::memory;
use prism_core::report::graph_flops;
use prism_core::{Mode, SimOptions, simulate};

fn rel(a: f64, b: f64) -> f64 {
    if a == b { 0.0 } else { ((a - b) / b).abs() }
}

fn valid(job: Job) -> Job {
    job.validate()
        .unwrap_or_else(|e| panic!("invalid test job: {e}"));
    job
}

/// Forward attention-core FLOPs per iteration (unmasked convention): what selective recompute
/// adds to the hardware FLOPs.
fn core_flops(job: &Job) -> f64 {
    let mut sel = job.clone();
    sel.parallel.recompute = Recompute::Selective;
    flops::hardware_flops_per_iteration(&sel) - flops::model_flops_per_iteration(&sel)
}

#[test]
fn deepseek_style_parameters_by_hand() {
    let m = valid(small_deepseek_job(1, 1, 1, 8, 1)).model;
    // h 1024, 16 heads, q rank 256, kv rank 128, widths 64 (nope) + 32 (rope), values 64:
    //   query  1024*256 + 256 + 256*16*96          =   655,616
    //   kv     1024*(128+32) + 128 + 128*16*(64+64) =   426,112
    //   output 16*64*1024                           = 1,048,576   -> attention 2,130,304
    assert_eq!(m.attention_params(), 2_130_304);
    // Expert 3*1024*512 = 1,572,864; MoE MLP 8 experts + router 8*1024 + shared 1,572,864.
    assert_eq!(m.expert_params(), 1_572_864);
    let moe_layer = 2_130_304 + 8 * 1_572_864 + 8 * 1024 + 1_572_864 + 2 * 1024;
    let dense_layer = 2_130_304 + 3 * 1024 * 4096 + 2 * 1024;
    assert_eq!(m.layer_params_at(0), dense_layer);
    assert_eq!(m.layer_params_at(1), moe_layer);
    assert_eq!(m.moe_layers(), 7);
    let emb = 2 * 32000 * 1024;
    assert_eq!(m.params(), dense_layer + 7 * moe_layer + emb + 1024);
    // Active: 6 of the 8 routed experts idle in each of the 7 MoE layers.
    assert_eq!(m.active_params(), m.params() - 7 * 6 * 1_572_864);
}

#[test]
fn deepseek_style_flops_per_token_by_hand() {
    let job = valid(small_deepseek_job(1, 1, 1, 8, 1));
    let per_token = flops::model_flops_per_iteration(&job) / job.tokens_per_iteration() as f64;
    // Forward per token (s = 2048):
    //   MLA projections 2*(1024*256 + 256*16*96 + 1024*160 + 128*16*128) = 2,162,688
    //   output          2*16*64*1024                                     = 2,097,152
    //   core            2*2048*(16*96 + 16*64)                           = 10,485,760
    //   MoE MLP  2*1024*8 + 2 * 3*2*1024*512 + 3*2*1024*512 (shared)     = 9,453,568
    //   dense MLP       3*2*1024*4096                                    = 25,165,824
    //   LM head         2*1024*32000                                     = 65,536,000
    let attn = 2_162_688.0 + 2_097_152.0 + 10_485_760.0;
    let fwd = (attn + 25_165_824.0) + 7.0 * (attn + 9_453_568.0) + 65_536_000.0;
    assert_eq!(per_token, 3.0 * fwd);
    // The causal convention counts (s + 1) / 2s of the core.
    let causal = flops::model_flops_per_iteration_causal(&job) / job.tokens_per_iteration() as f64;
    let core_causal = 10_485_760.0 * 2049.0 / 4096.0;
    assert!(rel(causal, 3.0 * (fwd - 8.0 * 10_485_760.0 + 8.0 * core_causal)) < 1e-12);
}

#[test]
fn sliding_window_flops_by_hand() {
    let job = valid(small_gemma_job(1, 1, 1, 8));
    let m = &job.model;
    // Layers 0, 2, 4, 6 local (window 512 of 2048), 1, 3, 5, 7 global.
    let local: Vec<bool> = (0..8).map(|l| m.local_attention(l).is_some()).collect();
    assert_eq!(local, [true, false, true, false, true, false, true, false]);
    let mut plain = job.clone();
    plain.model.arch = Arch {
        qk_norm: true,
        ..Arch::default()
    };
    let (s, w, hq, b) = (2048.0, 512.0, 1024.0, 8.0);
    // Unmasked convention: a local layer's core is 4 s w hq instead of 4 s² hq.
    let saved = 3.0 * b * 4.0 * 4.0 * s * (s - w) * hq;
    let d = flops::model_flops_per_iteration(&plain) - flops::model_flops_per_iteration(&job);
    assert!(rel(d, saved) < 1e-12, "{d} vs {saved}");
    // Causal convention: pairs w(w+1)/2 + (s-w)w instead of s(s+1)/2.
    let pairs_local = w * (w + 1.0) / 2.0 + (s - w) * w;
    let pairs_full = s * (s + 1.0) / 2.0;
    let saved = 3.0 * b * 4.0 * 4.0 * (pairs_full - pairs_local) * hq;
    let d = flops::model_flops_per_iteration_causal(&plain)
        - flops::model_flops_per_iteration_causal(&job);
    assert!(rel(d, saved) < 1e-12, "{d} vs {saved}");
}

/// Truth: the graph's kernels add up to the closed-form FLOP counts (plus FlashAttention's
/// backward recompute of the scores, half a forward core), for every layer kind. The graph
/// prices the router's backward as one GEMM (its weight gradient is not a separate kernel, as
/// before this module), so one router forward per MoE layer is missing from it; MLA's
/// down-projections are duplicated on every tensor-parallel rank (Megatron-Core builds them
/// with `parallel_mode = "duplicated"`), so the graph does `tp - 1` extra copies of them.
#[test]
fn graph_flops_match_closed_forms() {
    let mut chunked = small_gemma_job(2, 2, 2, 16);
    chunked.model.arch.attention_window_kind = WindowKind::Chunked;
    chunked.model.arch.attention_global_every = 4;
    let mut capacity = small_deepseek_job(2, 1, 2, 16, 4);
    capacity.model.arch.moe_capacity_factor = 1.0;
    let mut mtp = small_deepseek_job(2, 2, 2, 16, 4);
    mtp.model.arch.mtp_depth = 1;
    let mut mtp2 = small_deepseek_job(1, 1, 1, 8, 1);
    mtp2.model.arch.mtp_depth = 2;
    for job in [
        mtp,
        mtp2,
        small_deepseek_job(1, 1, 1, 8, 1),
        small_deepseek_job(2, 2, 2, 16, 4),
        small_deepseek_job(4, 1, 4, 32, 8),
        capacity,
        small_gemma_job(1, 1, 1, 8),
        small_gemma_job(2, 2, 2, 16),
        chunked,
    ] {
        let job = valid(job);
        let g = ExecutionGraph::build(&job);
        let gf = graph_flops(&g, false);
        let mf = flops::model_flops_per_iteration(&job);
        let fa = 0.5 * core_flops(&job);
        let m = &job.model;
        let router_wgrad = m.moe.as_ref().map_or(0.0, |e| {
            job.tokens_per_iteration() as f64
                * m.moe_layers() as f64
                * 2.0
                * m.hidden as f64
                * e.experts as f64
        });
        let layers = (m.layers + m.arch.mtp_depth) as f64;
        let router_wgrad = router_wgrad / m.moe_layers().max(1) as f64
            * (m.moe_layers() + m.arch.mtp_depth) as f64;
        let duplicated = m.arch.mla.map_or(0.0, |mla| {
            let down = (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim) as f64;
            (job.parallel.tp - 1) as f64
                * 3.0
                * job.tokens_per_iteration() as f64
                * layers
                * 2.0
                * m.hidden as f64
                * down
        });
        let mf = mf - router_wgrad + duplicated;
        assert!(
            rel(gf - fa, mf) < 1e-9,
            "{} {:?}: graph {gf} - {fa} vs model {mf}",
            job.model.name,
            job.parallel
        );
    }
}

/// Truth: every GPU's parameters, summed over the pipeline stages and divided back by the
/// tensor and expert parallel sizes, are the model's parameters.
#[test]
fn stage_parameters_add_up_to_the_model() {
    let mut mtp = small_deepseek_job(2, 1, 4, 16, 4);
    mtp.model.arch.mtp_depth = 1;
    for (job, tp, ep) in [
        (mtp, 1, 4),
        (small_deepseek_job(1, 1, 1, 8, 1), 1, 1),
        (small_deepseek_job(2, 1, 4, 16, 4), 1, 4),
        (small_gemma_job(2, 1, 2, 16), 1, 1),
    ] {
        let job = valid(job);
        let m = &job.model;
        let (mut dense, mut expert) = (0, 0);
        for s in 0..job.parallel.pp {
            let p = memory::stage_params(&job, s);
            dense += p.dense * tp;
            expert += p.expert * tp * ep;
        }
        let tied_copy = if m.tied_embeddings && job.parallel.pp > 1 {
            m.vocab as u64 * m.hidden as u64
        } else {
            0
        };
        assert_eq!(
            dense + expert,
            m.params() + m.mtp_params() + tied_copy,
            "{}",
            m.name
        );
    }
}

/// Truth: each MoE layer's dispatch all-to-all carries `tokens x top_k x h` BF16 values per
/// rank, times the capacity factor when one is set; dense layers have none.
#[test]
fn all_to_all_sized_by_top_k_and_capacity() {
    for cf in [0.0, 1.25] {
        let mut job = small_deepseek_job(2, 1, 1, 16, 4);
        job.model.arch.moe_capacity_factor = cf;
        let job = valid(job);
        let g = ExecutionGraph::build(&job);
        let p = g.program_of(0);
        let mut sizes = Vec::new();
        for k in &p.kind {
            if let OpKind::Collective {
                group: GroupKind::Ep,
                op: Collective::AllToAll,
                bytes,
            } = k
            {
                sizes.push(*bytes);
            }
        }
        let tokens = 2048u64; // micro-batch 1 x seq 2048, tp 1
        let load = if cf > 0.0 { cf } else { 1.0 };
        let want = (tokens as f64 * 2.0 * load).ceil() as u64 * 1024 * 2;
        // 7 MoE layers x (dispatch + combine) x (forward + backward) x micro-batches.
        let mbs = job.micro_batches() as usize;
        assert_eq!(sizes.len(), 7 * 4 * mbs, "cf {cf}");
        assert!(
            sizes.iter().all(|&b| b == want),
            "cf {cf}: {sizes:?} vs {want}"
        );
    }
}

/// Truth: MLA activations by hand (no recompute, flash attention, tp 1, one sequence).
#[test]
fn mla_activation_bytes_by_hand() {
    let mut job = small_deepseek_job(1, 1, 1, 8, 1);
    job.parallel.recompute = Recompute::None;
    let job = valid(job);
    let (s, h) = (2048.0, 1024.0);
    // Replicated: norm1 in, QKV in, norm2 in, expert input x top_k 2, router probs 4 s E,
    // latents 2 s (256 + 128 + 32), shared expert input 2 s h.
    let rep = 2.0 * s * h * 3.0 + 2.0 * s * h * 2.0 + 4.0 * s * 8.0 + 2.0 * s * 416.0 + 2.0 * s * h;
    // Split: Q, K (16 x 96 each), V (16 x 64), out-proj input (16 x 64), expert activations
    // 6 s f k, shared expert activations 6 s f_s.
    let split = 2.0 * s * (1536.0 + 1536.0)
        + 2.0 * s * 1024.0
        + 2.0 * s * 1024.0
        + 6.0 * s * 512.0 * 2.0
        + 6.0 * s * 512.0;
    let core = 4.0 * 16.0 * s; // log-sum-exp per query and head
    let got = memory::layer_activation_bytes_at(&job, Recompute::None, 1);
    assert!(
        rel(got, rep + split + core) < 1e-12,
        "{got} vs {}",
        rep + split + core
    );
}

/// Truth: reduced (one rank per stage) and sliced runs give the full run's times bit for bit
/// for MoE jobs with expert parallelism and for local-attention jobs.
#[test]
fn reduced_and_slice_equal_full_moe_ep() {
    let mut imb = small_deepseek_job(4, 2, 2, 32, 4);
    imb.model.arch.moe_imbalance = 1.3;
    imb.model.arch.mtp_depth = 1;
    for job in [
        small_deepseek_job(4, 2, 2, 32, 4),
        small_deepseek_job(4, 1, 2, 32, 8),
        imb,
        small_gemma_job(4, 2, 2, 32),
    ] {
        let job = valid(job);
        let full = simulate(&job, &SimOptions::default()).unwrap();
        let red = simulate(
            &job,
            &SimOptions {
                mode: Mode::Reduced,
                ..SimOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            full.summary.iteration_time_s, red.summary.iteration_time_s,
            "{}",
            job.model.name
        );
        for rt in &red.ranks {
            assert_eq!(rt.finish_s, full.ranks[rt.rank as usize].finish_s);
            assert_eq!(rt.compute_s, full.ranks[rt.rank as usize].compute_s);
        }
        let n = job.num_gpus() as u32;
        let wanted = vec![1, n / 2 + 1, n - 1];
        let sl = simulate(
            &job,
            &SimOptions {
                mode: Mode::Slice(wanted.clone()),
                ..SimOptions::default()
            },
        )
        .unwrap();
        assert_eq!(full.summary.iteration_time_s, sl.summary.iteration_time_s);
        for st in &sl.ranks {
            assert_eq!(st.finish_s, full.ranks[st.rank as usize].finish_s);
            assert_eq!(st.compute_s, full.ranks[st.rank as usize].compute_s);
        }
    }
}

/// Truth: load imbalance slows the expert GEMMs and the all-to-alls, never speeds anything
/// up; a local window never makes an iteration slower than global attention.
#[test]
fn imbalance_and_window_move_time_the_right_way() {
    let t = |job: &Job| {
        simulate(&valid(job.clone()), &SimOptions::default())
            .unwrap()
            .summary
            .iteration_time_s
    };
    let base = small_deepseek_job(2, 1, 2, 16, 4);
    let mut imb = base.clone();
    imb.model.arch.moe_imbalance = 1.5;
    assert!(t(&imb) > t(&base));
    let g = small_gemma_job(2, 1, 2, 16);
    let mut global = g.clone();
    global.model.arch.attention_window = 0;
    assert!(t(&g) < t(&global));
}

/// A DeepSeek-style job on `pp` stages of one node each (ep 8 inside the node), `m`
/// micro-batches per pipeline, with `schedule`.
fn pipe_job(pp: u32, m: u32, schedule: prism_core::job::Schedule) -> Job {
    let mut job = small_deepseek_job(pp, 1, pp, 8 * m, 8);
    job.model.layers = 2 * pp;
    job.model.arch.moe_first_dense_layers = 0;
    job.parallel.schedule = schedule;
    valid(job)
}

/// Truth: the DualPipe and overlapped-1F1B graphs run (no deadlock), reduced == full and a
/// slice == full, for MoE jobs with expert parallelism.
#[test]
fn overlapping_schedules_reduced_and_slice_equal_full() {
    use prism_core::job::Schedule;
    // DualPipe with its weight gradients deferred through every path: tensor parallel with
    // sequence parallelism (gathered weight gradients), with TP overlap, with ZeRO-3, with MTP.
    let variants = [(2, false, 1), (2, true, 1), (2, false, 3)].map(|(tp, overlap, zero)| {
        let mut job = small_deepseek_job(4, tp, 4, 8 * 16 / tp, 2);
        job.parallel.schedule = Schedule::DualPipe;
        job.parallel.tp_comm_overlap = overlap;
        job.parallel.set_zero_stage(zero);
        job.model.arch.mtp_depth = 1;
        valid(job)
    });
    for job in [
        pipe_job(4, 8, Schedule::DualPipe),
        pipe_job(2, 4, Schedule::DualPipe),
        pipe_job(1, 8, Schedule::OneFOneBOverlap),
        interleaved_overlap_job(4, 2, 8),
        interleaved_overlap_job(2, 3, 4),
    ]
    .into_iter()
    .chain(variants)
    {
        let n = job.num_gpus() as u32;
        let full = modes_agree(&job, vec![3, n - 2]);
        eprintln!(
            "[{:?} pp {}] {:.6} s, bubble {:.4}",
            job.parallel.schedule,
            job.parallel.pp,
            full.summary.iteration_time_s,
            full.summary.breakdown.bubble_s
        );
    }
}

/// Modelled compute time of stage `stage`'s kernels tagged `phase` and micro-batch `mb`
/// (`mb = u32::MAX` with the optimizer phase: the step after the last backward).
fn phase_time(
    g: &ExecutionGraph,
    cm: &prism_core::cost::compute::ComputeModel,
    stage: u32,
    phase: prism_core::graph::Phase,
    mb: u32,
) -> f64 {
    let p = &g.programs[stage as usize];
    let mut t = 0.0;
    for (i, k) in p.kind.iter().enumerate() {
        if let OpKind::Compute(op) = k
            && p.tag[i].phase == phase
            && (p.tag[i].micro_batch == mb || mb == u32::MAX)
        {
            t += cm.time_ps(op) as f64 * 1e-12;
        }
    }
    t
}

/// The iteration time of a pipeline schedule evaluated step by step (a second method: no
/// graph, no engine): each rank runs its steps in order, a forward after the same
/// micro-batch's forward on the upstream rank, a backward after its own forward and the
/// downstream rank's backward, an overlapped pair after both its inputs; step costs are the kernels' modelled times; communication is
/// free; the optimizer step follows the last backward. A split backward's deferred weight
/// gradient (`PipeStep::Weight`) runs where the schedule puts it, after nothing but the rank's
/// previous step. An overlapped forward-backward pair
/// runs as its forward then its backward; with `pair_end` its forward's output counts as
/// ready only when the whole pair is done (the overlapped kernels interleave, so the
/// forward's last kernel ends between the two bounds).
fn step_timeline(job: &Job, pair_end: bool) -> f64 {
    use prism_core::cost::compute::{ComputeModel, ComputeParams};
    use prism_core::graph::{Phase, schedule};
    let g = ExecutionGraph::build(job);
    let cm = ComputeModel::new(job, ComputeParams::for_gpu(&job.cluster.gpu), None);
    let pp = job.parallel.pp;
    let m = job.micro_batches() as u32;
    let dual = job.parallel.schedule == prism_core::job::Schedule::DualPipe;
    use prism_core::schedules::{PipeStep, pipe_steps};
    // (phase, micro-batch, chunk) per rank, in order.
    let steps: Vec<Vec<(Phase, u32, u32)>> = (0..pp)
        .map(|r| match pipe_steps(job.parallel.schedule, r, pp, m, 1) {
            Some(steps) => steps
                .into_iter()
                .flat_map(|st| match st {
                    PipeStep::Forward(a, c) => vec![(Phase::Forward, a, c)],
                    PipeStep::Backward(a, c) | PipeStep::BackwardInput(a, c) => {
                        vec![(Phase::Backward, a, c)]
                    }
                    PipeStep::Weight(a, c) => vec![(Phase::Weight, a, c)],
                    PipeStep::ForwardBackward(f, b) => {
                        vec![(Phase::Forward, f.0, f.1), (Phase::Backward, b.0, b.1)]
                    }
                })
                .collect(),
            None => schedule(job.parallel.schedule, r, pp, m, 1)
                .into_iter()
                .map(|s| {
                    let ph = if s.forward {
                        Phase::Forward
                    } else {
                        Phase::Backward
                    };
                    (ph, s.micro_batch, s.chunk)
                })
                .collect(),
        })
        .collect();
    // Forwards overlapped with the backward after them: (rank, micro-batch, chunk).
    let mut paired = std::collections::BTreeSet::new();
    for r in 0..pp {
        for st in prism_core::schedules::pipe_steps(job.parallel.schedule, r, pp, m, 1)
            .unwrap_or_default()
        {
            if let prism_core::schedules::PipeStep::ForwardBackward(f, _) = st {
                paired.insert((r, f.0, f.1));
            }
        }
    }
    let mut pending: Option<(u32, u32)> = None; // a paired forward awaiting its backward
    // Upstream rank of a forward of `chunk` on rank r (None at the pipeline's entry).
    let up = |r: u32, chunk: u32| -> Option<u32> {
        if dual && chunk == 1 {
            (r + 1 < pp).then_some(r + 1)
        } else {
            r.checked_sub(1)
        }
    };
    let down = |r: u32, chunk: u32| -> Option<u32> {
        if dual && chunk == 1 {
            r.checked_sub(1)
        } else {
            (r + 1 < pp).then_some(r + 1)
        }
    };
    let mut done = std::collections::BTreeMap::new(); // (forward, mb, rank) -> end time
    let mut pc = vec![0usize; pp as usize];
    let mut t = vec![0.0f64; pp as usize];
    let mut progress = true;
    while progress {
        progress = false;
        for r in 0..pp {
            while let Some(&(phase, mb, c)) = steps[r as usize].get(pc[r as usize]) {
                let forward = phase == Phase::Forward;
                let mut deps: Vec<(bool, u32, u32)> = match phase {
                    Phase::Forward => up(r, c).map(|u| (true, mb, u)).into_iter().collect(),
                    Phase::Weight => Vec::new(),
                    _ => std::iter::once((true, mb, r))
                        .chain(down(r, c).map(|d| (false, mb, d)))
                        .collect(),
                };
                if forward && paired.contains(&(r, mb, c)) {
                    // A pair starts once both its inputs are received (DualPipe's
                    // `_forward_backward_chunk`): also the partner backward's gradient.
                    let (_, bmb, bc) = steps[r as usize][pc[r as usize] + 1];
                    deps.extend(down(r, bc).map(|d| (false, bmb, d)));
                }
                if deps.iter().any(|d| !done.contains_key(d)) {
                    break;
                }
                let start = deps.iter().map(|d| done[d]).fold(t[r as usize], f64::max);
                t[r as usize] = start + phase_time(&g, &cm, r, phase, mb);
                if phase == Phase::Weight {
                    pc[r as usize] += 1;
                    progress = true;
                    continue;
                }
                done.insert((forward, mb, r), t[r as usize]);
                if pair_end {
                    if forward && paired.contains(&(r, mb, c)) {
                        pending = Some((mb, r));
                    } else if !forward
                        && let Some((fmb, fr)) = pending.take()
                        && fr == r
                    {
                        done.insert((true, fmb, r), t[r as usize]);
                    }
                }
                pc[r as usize] += 1;
                progress = true;
            }
        }
    }
    assert!(
        (0..pp as usize).all(|r| pc[r] == steps[r].len()),
        "step timeline deadlocked"
    );
    (0..pp)
        .map(|r| t[r as usize] + phase_time(&g, &cm, r, Phase::Optimizer, u32::MAX))
        .fold(0.0, f64::max)
}

/// Forward and backward compute time of one chunk of micro-batch `mb` on pipeline stage
/// `stage` (sum of its kernels' modelled durations; a split backward's deferred weight
/// gradients included).
fn chunk_times(job: &Job, stage: u32, mb: u32) -> (f64, f64) {
    use prism_core::cost::compute::{ComputeModel, ComputeParams};
    use prism_core::graph::Phase;
    let g = ExecutionGraph::build(job);
    let cm = ComputeModel::new(job, ComputeParams::for_gpu(&job.cluster.gpu), None);
    let p = &g.programs[stage as usize];
    let (mut f, mut b) = (0.0, 0.0);
    for (i, k) in p.kind.iter().enumerate() {
        if let OpKind::Compute(op) = k
            && p.tag[i].micro_batch == mb
        {
            match p.tag[i].phase {
                Phase::Forward => f += cm.time_ps(op) as f64 * 1e-12,
                Phase::Backward | Phase::Weight => b += cm.time_ps(op) as f64 * 1e-12,
                _ => {}
            }
        }
    }
    (f, b)
}

/// Truth: with communication free, the simulated iteration of DualPipe (and of 1F1B) equals
/// the step-by-step timeline of its schedule (`step_timeline`); DualPipe on 2 ranks has no
/// bubble (the closed form `(PP/2 - 1)(...)` is 0), and its bubble on more ranks is below
/// 1F1B's `(PP - 1)(F + B)`.
#[test]
fn bubbles_match_the_step_timeline() {
    use prism_core::job::Schedule;
    use prism_core::schedules::one_f_one_b_bubble;
    for (schedule, pp, m) in [
        (Schedule::DualPipe, 2, 4),
        (Schedule::DualPipe, 4, 8),
        (Schedule::DualPipe, 8, 16),
        (Schedule::DualPipe, 8, 24),
        (Schedule::OneFOneBOverlap, 1, 8),
    ] {
        let mut job = pipe_job(pp, m, schedule);
        job.model.vocab = 8; // a negligible head and embedding
        let job = valid(job);
        let r = simulate(
            &job,
            &SimOptions {
                ideal_network: true,
                ..SimOptions::default()
            },
        )
        .unwrap();
        let t = r.summary.iteration_time_s;
        let lower = step_timeline(&job, false);
        let upper = step_timeline(&job, true);
        let want = lower;
        let (f, b) = chunk_times(&job, (pp / 2).max(1) - 1, m / 2 + 1);
        let bubble = t - m as f64 * (f + b);
        eprintln!(
            "[{schedule:?} pp {pp} m {m}] simulated {t:.6} s, step timeline {want:.6} .. {upper:.6} s; \
             bubble {bubble:.6} s = {:.2} (F + B), 1F1B's {:.2} (F + B)",
            bubble / (f + b),
            one_f_one_b_bubble(pp, f, b) / (f + b)
        );
        assert!(
            t >= lower * (1.0 - 1e-9) && t <= upper * (1.0 + 1e-9),
            "{schedule:?} pp {pp}: {t} not in [{lower}, {upper}]"
        );
        if schedule == Schedule::DualPipe {
            assert!(bubble < one_f_one_b_bubble(pp, f, b));
        }
    }
}

/// The graph of `job`, launch-free compute parameters and a kernel table that makes the
/// embedding, final norm, LM head, loss and optimizer step free, so that every pipeline chunk
/// costs the same and a schedule's bubble can be compared with its closed form (the last
/// stage's optimizer also updates the final norm).
fn free_extras(
    job: &Job,
) -> (
    ExecutionGraph,
    prism_core::cost::compute::ComputeParams,
    prism_core::cost::compute::KernelTable,
) {
    use prism_core::cost::compute::{ComputeParams, KernelTable, shape_key};
    const EXTRAS: [&str; 10] = [
        "optimizer_step",
        "embedding_fwd",
        "embedding_bwd",
        "final_norm_fwd",
        "final_norm_bwd",
        "lm_head_fwd",
        "lm_head_dgrad",
        "lm_head_wgrad",
        "loss_fwd",
        "loss_bwd",
    ];
    let g = ExecutionGraph::build(job);
    let mut table = KernelTable::new();
    for p in &g.programs {
        for k in &p.kind {
            if let OpKind::Compute(op) = k
                && EXTRAS.contains(&op.name)
            {
                table.insert(op.name, &shape_key(&op.work), "bf16", 0.0);
            }
        }
    }
    let params = ComputeParams {
        launch_overhead_s: 0.0,
        ..ComputeParams::for_gpu(&job.cluster.gpu)
    };
    (g, params, table)
}

/// With the extras free ([`free_extras`]) and communication free: the whole forward and
/// backward compute time of one micro-batch on pipeline stage `stage` (all its chunks), and the
/// simulated run.
fn free_stage_times_and_run(job: &Job, stage: u32) -> (f64, f64, prism_core::engine::SimResult) {
    use prism_core::cost::compute::ComputeModel;
    use prism_core::graph::Phase;
    let (g, params, table) = free_extras(job);
    let cm = ComputeModel::new(job, params.clone(), Some(table.clone()));
    let p = &g.programs[stage as usize];
    let (mut f, mut b) = (0u64, 0u64);
    for (i, k) in p.kind.iter().enumerate() {
        if let OpKind::Compute(op) = k
            && p.tag[i].micro_batch == 1
        {
            match p.tag[i].phase {
                Phase::Forward => f += cm.time_ps(op),
                Phase::Backward | Phase::Weight => b += cm.time_ps(op),
                _ => {}
            }
        }
    }
    let opts = SimOptions {
        ideal_network: true,
        compute: Some(params),
        kernel_table: Some(table),
        ..SimOptions::default()
    };
    let r = simulate(job, &opts).unwrap();
    (f as f64 * 1e-12, b as f64 * 1e-12, r)
}

/// Truth: DualPipe's bubble in the engine equals the exact closed form of its schedule
/// (`schedules::dualpipe_bubble_exact`, derived and checked against a max-plus evaluation of
/// the steps in `schedules.rs`, with and without the split), at PP = 2, 4, 8, 16, for the
/// schedule with its zero-bubble split (the engine has no switch to run it whole).
/// The job makes every chunk alike: one MoE/MLA layer per chunk, communication free, the
/// embedding, head and loss kernels costed 1 ps (a kernel table row of 0 s, no launch
/// overhead), no MTP. `F`, `B` (input gradient) and `W` (deferred weight gradient) are the
/// modelled kernel times of one split chunk on a middle rank (picoseconds, as the engine
/// adds them). The bubble is an end rank's idle time (`breakdown.bubble_s`: iteration time
/// less its kernel time; the end ranks finish last). Also records the report's
/// `(PP/2 - 1)(F&B + B' - 3W)` (`F&B = F + B + W`, `B'` = `B + W` the full backward), which
/// is one `F` more where `B >= W` and `(PP/2 - 1) B >= (PP/2) F` (PP = 8, 16 here).
#[test]
fn dualpipe_bubble_equals_the_exact_closed_form() {
    use prism_core::cost::compute::ComputeModel;
    use prism_core::graph::Phase;
    use prism_core::job::Schedule;
    use prism_core::schedules::{dualpipe_bubble, dualpipe_bubble_exact};
    for pp in [2u32, 4, 8, 16] {
        let m = 2 * pp + 2;
        let mut job = pipe_job(pp, m, Schedule::DualPipe);
        job.model.vocab = 8;
        job.model.arch.mtp_depth = 0;
        let job = valid(job);
        let (g, params, table) = free_extras(&job);
        let cm = ComputeModel::new(&job, params.clone(), Some(table.clone()));
        // One split chunk (the last of direction 0) on a middle rank.
        let (mid, mb) = (pp / 2 - 1, m / 2 - 1);
        let p = &g.programs[mid as usize];
        let mut fbw = [0u64; 3];
        for (i, k) in p.kind.iter().enumerate() {
            if let OpKind::Compute(op) = k
                && p.tag[i].micro_batch == mb
            {
                let slot = match p.tag[i].phase {
                    Phase::Forward => 0,
                    Phase::Backward => 1,
                    Phase::Weight => 2,
                    ph => panic!("unexpected {ph:?} kernel {}", op.name),
                };
                fbw[slot] += cm.time_ps(op);
            }
        }
        let [f, b, w] = fbw.map(|x| x as f64 * 1e-12);
        assert!(w > 0.0 && b > w, "pp {pp}: B {b} W {w}");
        let opts = SimOptions {
            ideal_network: true,
            compute: Some(params),
            kernel_table: Some(table),
            ..SimOptions::default()
        };
        let split = simulate(&job, &opts).unwrap();
        let exact = dualpipe_bubble_exact(pp, f, b, w);
        let exact_whole = dualpipe_bubble_exact(pp, f, b + w, 0.0);
        let paper = dualpipe_bubble(pp, f + b + w, b + w, w);
        let bubble = split.ranks[0].breakdown.bubble_s;
        let idle = split.summary.iteration_time_s - split.ranks[0].compute_s;
        assert!(
            (bubble - idle).abs() < 1e-12,
            "pp {pp}: idle only (communication free)"
        );
        eprintln!(
            "[DualPipe pp {pp} m {m}] F {:.1} us, B {:.1} us, W {:.1} us; bubble: engine {:.3} us, \
             exact {:.3} us, paper {:.3} us; in (F + B + W): engine {:.4}, exact {:.4}, \
             paper {:.4}, exact without the split {:.4}",
            f * 1e6,
            b * 1e6,
            w * 1e6,
            bubble * 1e6,
            exact * 1e6,
            paper * 1e6,
            bubble / (f + b + w),
            exact / (f + b + w),
            paper / (f + b + w),
            exact_whole / (f + b + w),
        );
        // Within 1 ns (the 1 ps extras and rounding) of the exact form.
        assert!(
            (bubble - exact).abs() < 1e-9,
            "pp {pp}: {bubble} vs {exact}"
        );
        // Where the input gradient is the longest step the report's form is one forward
        // chunk more; at PP = 4 here `B < 2F` and the warm-up's `2F` sets the bubble.
        let n = pp as f64 / 2.0 - 1.0;
        if pp > 2 && b >= w && n * b >= (n + 1.0) * f {
            assert!((paper - exact - f).abs() < 1e-9, "pp {pp}: paper {paper}");
        }
    }
}

/// A DeepSeek-style MoE job on `pp` stages of one node each (ep 8 inside the node) running
/// Megatron-Core's combined 1F1B over `v` virtual stages (two layers per chunk), `m`
/// micro-batches per pipeline.
fn interleaved_overlap_job(pp: u32, v: u32, m: u32) -> Job {
    use prism_core::job::Schedule;
    let mut job = small_deepseek_job(pp, 1, pp, 8 * m, 8);
    job.model.layers = 2 * pp * v;
    job.model.arch.moe_first_dense_layers = 0;
    job.parallel.vpp = v;
    job.parallel.schedule = Schedule::OneFOneBOverlap;
    valid(job)
}

/// Truth: on an interleaved pipeline, Megatron-Core's combined 1F1B (1F1B with EP overlap,
/// one more warm-up forward, then forward/backward pairs) has the interleaved schedule's
/// bubble `(PP - 1)(F + B) / VPP` (`schedules::overlapped_1f1b_bubble`, derived from the
/// schedule's max-plus recurrence) when communication is free and every chunk is alike: the
/// engine's idle time equals it within 1 ns.
#[test]
fn interleaved_1f1b_overlap_bubble_equals_the_closed_form() {
    use prism_core::schedules::overlapped_1f1b_bubble;
    for (pp, v, m) in [(2u32, 2u32, 4u32), (4, 2, 8), (4, 3, 12), (8, 2, 16)] {
        let mut job = interleaved_overlap_job(pp, v, m);
        job.model.vocab = 8;
        let job = valid(job);
        let (f, b, r) = free_stage_times_and_run(&job, pp / 2);
        let want = overlapped_1f1b_bubble(pp, v, f, b);
        for rank in [0, r.ranks.len() - 1] {
            let bubble = r.ranks[rank].breakdown.bubble_s;
            let idle = r.summary.iteration_time_s - r.ranks[rank].compute_s;
            assert!((bubble - idle).abs() < 1e-12, "pp {pp}: idle only");
            eprintln!(
                "[1F1B-overlap pp {pp} vpp {v} m {m} rank {rank}] F {:.1} us, B {:.1} us; bubble: \
                 engine {:.3} us, closed form {:.3} us",
                f * 1e6,
                b * 1e6,
                bubble * 1e6,
                want * 1e6
            );
            assert!(
                (bubble - want).abs() < 1e-9,
                "pp {pp} vpp {v}: {bubble} vs {want}"
            );
        }
    }
}

/// Truth: running the pipeline schedule `R` times per iteration (`parallel.pipeline_rounds`,
/// gradient accumulation outside the schedule) pays its warm-up and cool-down `R` times. With
/// communication free and uniform chunks the engine's idle time is `R (PP - 1)(F + B) / VPP`
/// (interleaved, and 1F1B with EP overlap; `F`, `B` a stage's whole forward and backward)
/// within 1 ns; the memory peak is that of one run's micro-batches; reduced == full and
/// slice == full.
#[test]
fn pipeline_rounds_pay_the_bubble_each_run() {
    use prism_core::job::Schedule;
    for (schedule, pp, v, m, rounds) in [
        (Schedule::Interleaved, 4u32, 2u32, 16u32, 2u32),
        (Schedule::Interleaved, 2, 3, 12, 3),
        (Schedule::OneFOneBOverlap, 2, 2, 8, 2),
    ] {
        let mut job = interleaved_overlap_job(pp, v, m);
        job.parallel.schedule = schedule;
        job.parallel.pipeline_rounds = rounds;
        job.model.vocab = 8;
        let job = valid(job);
        let (f, b, r) = free_stage_times_and_run(&job, pp / 2);
        let want = rounds as f64 * (pp as f64 - 1.0) * (f + b) / v as f64;
        for rank in [0, r.ranks.len() - 1] {
            let bubble = r.ranks[rank].breakdown.bubble_s;
            eprintln!(
                "[{schedule:?} pp {pp} vpp {v} m {m} rounds {rounds} rank {rank}] bubble: engine \
                 {:.3} us, R (PP-1)(F+B)/VPP {:.3} us",
                bubble * 1e6,
                want * 1e6
            );
            assert!(
                (bubble - want).abs() < 1e-9,
                "{schedule:?}: {bubble} vs {want}"
            );
        }
        // Memory: the peak of one run's micro-batches.
        let mut one = job.clone();
        one.parallel.pipeline_rounds = 1;
        one.training.global_batch /= rounds;
        let one = valid(one);
        for stage in 0..pp {
            assert_eq!(
                memory::stage_memory(&job, stage).activations,
                memory::stage_memory(&one, stage).activations,
                "stage {stage}"
            );
        }
        // Reduced and slice modes agree with the full run.
        let n = job.num_gpus() as u32;
        modes_agree(&job, vec![1, n - 1]);
    }
}

/// Simulates `job` in full, reduced and slice (`slice` ranks) mode and checks that they agree:
/// the same iteration time, and every sliced rank finishing when it does in the full run.
/// Returns the full run.
fn modes_agree(job: &Job, slice: Vec<u32>) -> prism_core::engine::SimResult {
    let full = simulate(job, &SimOptions::default()).unwrap();
    let red = simulate(
        job,
        &SimOptions {
            mode: Mode::Reduced,
            ..SimOptions::default()
        },
    )
    .unwrap();
    assert_eq!(full.summary.iteration_time_s, red.summary.iteration_time_s);
    let sl = simulate(
        job,
        &SimOptions {
            mode: Mode::Slice(slice),
            ..SimOptions::default()
        },
    )
    .unwrap();
    assert_eq!(full.summary.iteration_time_s, sl.summary.iteration_time_s);
    for st in &sl.ranks {
        assert_eq!(st.finish_s, full.ranks[st.rank as usize].finish_s);
    }
    full
}

/// Truth: overlapping the expert all-to-all with the other chunk's compute never slows an
/// iteration and hides all-to-all time: DualPipe against 1F1B on the same pipeline, and
/// 1F1B-overlap against 1F1B on one stage, for an MoE job whose expert parallelism crosses
/// nodes.
#[test]
fn overlap_hides_all_to_all() {
    use prism_core::job::Schedule;
    let run = |job: &Job| simulate(job, &SimOptions::default()).unwrap().summary;
    for (a, b) in [
        (Schedule::DualPipe, Schedule::OneFOneB),
        (Schedule::OneFOneBOverlap, Schedule::OneFOneB),
    ] {
        let pp = if a == Schedule::DualPipe { 4 } else { 1 };
        // ep 16 over two nodes per stage.
        let mut ja = small_deepseek_job(2 * pp, 1, pp, 16 * 16, 16);
        ja.model.arch.moe_first_dense_layers = 0;
        if let Some(e) = ja.model.moe.as_mut() {
            e.experts = 16;
        }
        ja.parallel.schedule = a;
        let ja = valid(ja);
        let mut jb = ja.clone();
        jb.parallel.schedule = b;
        let jb = valid(jb);
        let (sa, sb) = (run(&ja), run(&jb));
        eprintln!(
            "[{a:?} vs {b:?}] {:.6} s (exposed EP {:.6}) vs {:.6} s (exposed EP {:.6})",
            sa.iteration_time_s, sa.breakdown.ep_s, sb.iteration_time_s, sb.breakdown.ep_s
        );
        assert!(sa.iteration_time_s < sb.iteration_time_s, "{a:?}");
        assert!(sa.breakdown.ep_s < sb.breakdown.ep_s, "{a:?}");
    }
    // The combined 1F1B on an interleaved pipeline (pp 2, vpp 2) against the interleaved
    // schedule itself, ep 16 over two nodes per stage.
    let mut ja = small_deepseek_job(4, 1, 2, 16 * 16, 16);
    ja.model.layers = 8;
    ja.model.arch.moe_first_dense_layers = 0;
    if let Some(e) = ja.model.moe.as_mut() {
        e.experts = 16;
    }
    ja.parallel.vpp = 2;
    ja.parallel.schedule = Schedule::OneFOneBOverlap;
    let ja = valid(ja);
    let mut jb = ja.clone();
    jb.parallel.schedule = Schedule::Interleaved;
    let jb = valid(jb);
    let (sa, sb) = (run(&ja), run(&jb));
    eprintln!(
        "[interleaved 1F1B-overlap vs interleaved] {:.6} s (exposed EP {:.6}) vs {:.6} s \
         (exposed EP {:.6})",
        sa.iteration_time_s, sa.breakdown.ep_s, sb.iteration_time_s, sb.breakdown.ep_s
    );
    assert!(sa.iteration_time_s < sb.iteration_time_s);
    assert!(sa.breakdown.ep_s < sb.breakdown.ep_s);
    // One more chunk forward in flight: 1/vpp of a stage's activations more on every rank.
    for stage in 0..2 {
        let (a, b) = (
            memory::in_flight_microbatches(&ja, stage),
            memory::in_flight_microbatches(&jb, stage),
        );
        assert_eq!(a, b + 0.5, "stage {stage}");
        assert!(
            memory::stage_memory(&ja, stage).activations
                > memory::stage_memory(&jb, stage).activations
        );
    }
}

/// Truth: the multi-token-prediction module's activations on the last stage are one more
/// layer of the last layer's kind, the projection input `4sbh` and one more head (`4sbh` +
/// FP32 logits `4sbV`), per micro-batch in flight; other stages are unchanged.
#[test]
fn mtp_activation_memory_by_hand() {
    let base = valid(small_deepseek_job(2, 1, 2, 16, 4));
    let mut mtp = base.clone();
    mtp.model.arch.mtp_depth = 1;
    let mtp = valid(mtp);
    let a0 = memory::stage_memory(&base, 0).activations;
    assert_eq!(memory::stage_memory(&mtp, 0).activations, a0);
    let d = memory::stage_memory(&mtp, 1).activations as f64
        - memory::stage_memory(&base, 1).activations as f64;
    let (s, h, v) = (2048.0, 1024.0, 32000.0);
    let layer = memory::layer_activation_bytes_at(&mtp, Recompute::None, 7);
    let in_flight = memory::in_flight_microbatches(&mtp, 1);
    let want = (layer + 4.0 * s * h + 4.0 * s * h + 4.0 * s * v) * in_flight;
    assert!((d - want).abs() <= 2.0, "{d} vs {want}");
}

/// Truth: the closed form of group-limited routing's network share, and the engine applying
/// it: less network traffic for the expert all-to-alls, a faster iteration, reduced == full.
#[test]
fn node_limited_routing_cuts_the_all_to_all_network_bytes() {
    use prism_core::arch::Arch;
    // DeepSeek-V3: EP 64 on 8 nodes of 8, top-8 of 256 experts in 8 groups, at most 4 groups
    // per token: r = 4 nodes, 4 (1 - (3/4)^8) distinct, 7/8 of them remote, against
    // 8 x 56/64 copies crossing without the limit.
    let a = Arch {
        moe_groups: 8,
        moe_groups_per_token: 4,
        ..Arch::default()
    };
    let want = 4.0 * (1.0 - 0.75f64.powi(8)) * 7.0 / 8.0 / (8.0 * 56.0 / 64.0);
    assert!((a.node_limited_nic_scale(8, 8, 64, 8, false) - want).abs() < 1e-12);
    assert!((want - 0.4504).abs() < 1e-3);
    // No limit, one node, or a limit wider than the nodes it could reach: no change.
    assert_eq!(
        Arch::default().node_limited_nic_scale(8, 8, 64, 8, false),
        1.0
    );
    assert_eq!(a.node_limited_nic_scale(8, 1, 8, 8, false), 1.0);
    let wide = Arch {
        moe_groups: 8,
        moe_groups_per_token: 8,
        ..Arch::default()
    };
    assert!(wide.node_limited_nic_scale(1, 8, 64, 8, false) <= 1.0);
    // Fewer groups per token, fewer nodes crossed.
    let narrow = Arch {
        moe_groups: 8,
        moe_groups_per_token: 2,
        ..Arch::default()
    };
    assert!(narrow.node_limited_nic_scale(8, 8, 64, 8, false) < want);
    // DeepEP without a group limit: one copy per distinct remote node of all 8, 8 (1 - (7/8)^8)
    // distinct, 7/8 remote, against the 8 x 56/64 copies; group limits set, the same as with
    // them alone.
    let deepep = 8.0 * (1.0 - 0.875f64.powi(8)) * 7.0 / 8.0 / (8.0 * 56.0 / 64.0);
    let free = Arch::default().node_limited_nic_scale(8, 8, 64, 8, true);
    assert!((free - deepep).abs() < 1e-12, "{free} vs {deepep}");
    assert!((deepep - 0.6564).abs() < 1e-3, "{deepep}");
    assert_eq!(a.node_limited_nic_scale(8, 8, 64, 8, true), want);

    // The engine: a small DeepSeek-style job with EP over 2 nodes.
    let mut base = small_deepseek_job(2, 1, 1, 32, 16);
    base.model.moe.as_mut().unwrap().experts = 16;
    let mut limited = base.clone();
    limited.model.arch.moe_groups = 2;
    limited.model.arch.moe_groups_per_token = 1;
    let base = valid(base);
    let limited = valid(limited);
    let g = prism_core::graph::ExecutionGraph::build(&limited);
    // 2 nodes, 8 + 8 ranks, top-2 from 1 of 2 groups (one per node): one node, remote half
    // the time, against 2 x 8/16 copies crossing.
    assert!((g.ep_nic_scale - 0.5).abs() < 1e-12, "{}", g.ep_nic_scale);
    let t = |job: &Job, mode: Mode| {
        simulate(
            job,
            &SimOptions {
                mode,
                ..SimOptions::default()
            },
        )
        .unwrap()
        .summary
        .iteration_time_s
    };
    let (tb, tl) = (t(&base, Mode::Full), t(&limited, Mode::Full));
    assert!(tl < tb, "{tl} vs {tb}");
    assert_eq!(t(&limited, Mode::Reduced), tl);
    // DeepEP's dispatch without a limit: top-2 over both nodes, 2 (1 - 1/4) = 1.5 distinct,
    // half remote (0.75 copies) against 2 x 8/16 = 1: a scale of 0.75, between the two.
    let mut deepep = base.clone();
    deepep.parallel.moe_dispatcher = prism_core::job::MoeDispatcher::DeepEp;
    let deepep = valid(deepep);
    let g = prism_core::graph::ExecutionGraph::build(&deepep);
    assert!((g.ep_nic_scale - 0.75).abs() < 1e-12, "{}", g.ep_nic_scale);
    let td = t(&deepep, Mode::Full);
    assert!(tl < td && td < tb, "{tl} < {td} < {tb}");
    assert_eq!(t(&deepep, Mode::Reduced), td);
}
