//! Pipeline schedules with overlapped forward and backward chunks: DeepSeek's DualPipe and
//! Megatron-Core's 1F1B with expert-parallel communication overlap.
//!
//! Both produce, per pipeline rank, a list of [`PipeStep`]s. A [`PipeStep::ForwardBackward`]
//! is a forward chunk of one micro-batch and a backward chunk of another run together: the
//! graph builder ([`crate::graph`]) emits both and interleaves their ops at every point where
//! one of them would wait for its own communication (an all-to-all, a tensor-parallel
//! collective, a pipeline receive), so one chunk's communication runs under the other's
//! compute, as DeepSeek's `overlapped_forward_backward` and Megatron's combined 1F1B do.
//!
//! **DualPipe** (DeepSeek-AI 2024, arXiv:2412.19437 Sec. 3.2.1; the reference implementation
//! `dualpipe/dualpipe.py` of github.com/deepseek-ai/DualPipe, whose eight phases
//! [`dualpipe_steps`] follows): rank `r` holds chunk 0 = stage `r` of the forward-direction
//! pipeline and chunk 1 = stage `pp - 1 - r` (the reverse direction enters at the last rank);
//! micro-batches `0 .. m/2` flow forward, `m/2 .. m` in reverse. As the reference, a pair
//! starts once both its chunks' inputs have arrived and sends its outputs when done, and some
//! backward chunks are split (zero bubble) into an input-gradient step
//! ([`PipeStep::BackwardInput`]) and a deferred weight-gradient step ([`PipeStep::Weight`],
//! first in first out): step 3's, the second half of step 6's and step 7's; the graph builder
//! emits a split backward's weight-gradient ops (and what only they need) at its weight step.
//! Parameters are held twice (two stages per rank); activations of `PP + 1` micro-batch stages
//! at the peak (the split does not raise it).
//!
//! Bubble: the engine gives exactly [`dualpipe_bubble_exact`],
//! `n max(B - W, 0) + max(2n F, (n - 1) F + n B)` with `n = PP/2 - 1` (uniform chunks,
//! communication free; derivation on that function). The report's `(PP/2 - 1)(F&B + B - 3W)`
//! ([`dualpipe_bubble`]) is one forward chunk `F` more where the input gradient is the
//! longest step (e.g. 5.04 against 4.77 chunk times `F + B + W` at PP 16, 2.16 against 1.89
//! at PP 8; docs/models.md), and below it when `W > B` or forwards are long.
//!
//! **1F1B with EP overlap** (Megatron-Core's combined 1F1B, `--overlap-moe-expert-parallel-comm`,
//! `megatron/core/pipeline_parallel/combined_1f1b.py`): the 1F1B order with one more warm-up
//! forward, after which every steady-state step runs the next forward and the next backward as
//! one overlapped pair. On one pipeline stage that is forward `k + 1` with backward `k`. With
//! pipeline stages Megatron-Core requires the interleaved schedule (it asserts
//! `virtual_pipeline_model_parallel_size` is set when `pp > 1`): the warm-up is the interleaved
//! one plus one, `2 (pp - r - 1) + (vpp - 1) pp + 1` chunk forwards on rank `r`, and the pairs
//! follow the interleaved order ([`overlapped_1f1b_steps`]). Without virtual stages a pair on
//! stage `s` would wait for the backward input from stage `s + 1`'s pair of the same step, which
//! waits for stage `s + 2`'s, so every step would chain through all stages and the bubble would
//! grow with the micro-batch count (tested); the virtual stages make the backward input arrive
//! a round earlier. With communication free and a pair taking `F + B` (its kernels share one
//! compute stream, outputs sent when it ends) the bubble is the interleaved schedule's,
//! `(pp - 1)(F + B) / vpp` in stage times ([`overlapped_1f1b_bubble`]): the extra warm-up
//! forward costs no time, only one more chunk of activations in flight.

use crate::job::{Job, JobError, Schedule};

/// One step of a rank's pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipeStep {
    /// Forward of `(micro_batch, chunk)`.
    Forward(u32, u32),
    /// Backward of `(micro_batch, chunk)`: input and weight gradients.
    Backward(u32, u32),
    /// Forward of the first `(micro_batch, chunk)` overlapped with the backward of the second.
    ForwardBackward((u32, u32), (u32, u32)),
    /// Input-gradient part of the backward of `(micro_batch, chunk)` (zero bubble: the
    /// data-gradient GEMMs, attention backward, norms, elementwise kernels and the
    /// communication the gradient passes through); its weight gradients wait for the
    /// [`PipeStep::Weight`] of the same `(micro_batch, chunk)`.
    BackwardInput(u32, u32),
    /// The deferred weight-gradient part of `(micro_batch, chunk)`'s backward (after its
    /// [`PipeStep::BackwardInput`]).
    Weight(u32, u32),
}

impl PipeStep {
    /// The same step with every micro-batch number raised by `off` (a later run of the schedule
    /// within one iteration, `parallel.pipeline_rounds`).
    pub fn shifted(self, off: u32) -> PipeStep {
        let s = |(mb, c): (u32, u32)| (mb + off, c);
        match self {
            PipeStep::Forward(mb, c) => PipeStep::Forward(mb + off, c),
            PipeStep::Backward(mb, c) => PipeStep::Backward(mb + off, c),
            PipeStep::ForwardBackward(f, b) => PipeStep::ForwardBackward(s(f), s(b)),
            PipeStep::BackwardInput(mb, c) => PipeStep::BackwardInput(mb + off, c),
            PipeStep::Weight(mb, c) => PipeStep::Weight(mb + off, c),
        }
    }
}

/// Checks the rules of the DualPipe schedule (its reference implementation's assertions).
pub fn validate_dualpipe(job: &Job) -> Result<(), JobError> {
    let p = &job.parallel;
    if p.pp < 2 || !p.pp.is_multiple_of(2) {
        return Err(JobError::new(
            "parallel.pp",
            format!("DualPipe needs an even pp >= 2 (got {})", p.pp),
        ));
    }
    if p.vpp != 1 {
        return Err(JobError::new(
            "parallel.vpp",
            "DualPipe places two chunks per rank itself; vpp must be 1",
        ));
    }
    if p.pipeline_layout.is_some() {
        return Err(JobError::new(
            "parallel.pipeline_layout",
            "cannot be combined with DualPipe (give first/last_stage_layers instead)",
        ));
    }
    let m = job.micro_batches();
    if !m.is_multiple_of(2) || m < 2 * p.pp as u64 {
        return Err(JobError::new(
            "training.global_batch",
            format!(
                "DualPipe needs an even number of micro-batches per pipeline, at least 2 x pp = \
                 {} (got {m})",
                2 * p.pp
            ),
        ));
    }
    Ok(())
}

/// DualPipe's steps on rank `rank` of `pp` with `m` micro-batches (`m` even, `m >= 2 pp`):
/// the eight phases of the reference implementation with its zero-bubble split. The
/// reference runs a backward chunk with `enable_zb` (input gradient now, weight gradient
/// queued) in step 3 (`nB1W1F1`: each such backward's weight gradient runs right after it),
/// in the second half of the backward chunks of step 6 (`nB1B0`) and in step 7 (`nWB0`);
/// `_weight_chunk` pops the oldest queued weight gradient (first in, first out) in steps 3
/// and 7 and drains the queue in step 8 (`nW`). Those backwards are
/// [`PipeStep::BackwardInput`] here, the pops [`PipeStep::Weight`]; every other backward
/// (and the backward of every overlapped pair) runs whole.
pub fn dualpipe_steps(rank: u32, pp: u32, m: u32) -> Vec<PipeStep> {
    dualpipe_schedule(rank, pp, m, true)
}

/// DualPipe's steps without the zero-bubble split: [`dualpipe_steps`] with every backward
/// whole (each weight gradient folded into its backward chunk, no [`PipeStep::Weight`]);
/// the schedule Prism ran before the split, kept for comparisons.
pub fn dualpipe_steps_whole(rank: u32, pp: u32, m: u32) -> Vec<PipeStep> {
    dualpipe_schedule(rank, pp, m, false)
}

/// What one entry of DualPipe's local phase order runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Local {
    Forward,
    /// A backward; `true` with the zero-bubble split (`enable_zb`).
    Backward(bool),
    /// Pop the oldest deferred weight gradient (`_weight_chunk`).
    Weight,
}

fn dualpipe_schedule(rank: u32, pp: u32, m: u32, zb: bool) -> Vec<PipeStep> {
    let half_ranks = pp / 2;
    let half_rank = rank.min(pp - 1 - rank);
    let second_half = (rank >= half_ranks) as u32;
    let half_chunks = m / 2;
    let middle = rank == half_ranks - 1 || rank == half_ranks;
    // (what, local phase, overlapped with the next step), in schedule order.
    let mut order: Vec<(Local, u32, bool)> = Vec::with_capacity(3 * m as usize);
    let mut push = |what: Local, phase: u32, paired: bool| order.push((what, phase, paired));
    let (fwd, whole) = (Local::Forward, Local::Backward(false));
    let split = Local::Backward(zb);
    // Step 1: nF0.
    for _ in 0..(half_ranks - half_rank - 1) * 2 {
        push(fwd, 0, false);
    }
    // Step 2: nF0F1.
    for _ in 0..half_rank + 1 {
        push(fwd, 0, false);
        push(fwd, 1, false);
    }
    // Step 3: nB1W1F1 (zero bubble: each weight gradient right after its backward).
    for _ in 0..half_ranks - half_rank - 1 {
        push(split, 1, false);
        if zb {
            push(Local::Weight, 0, false);
        }
        push(fwd, 1, false);
    }
    // Step 4 (main): nF0B1F1B0.
    for i in 0..half_chunks + half_rank + 1 - pp {
        if i == 0 && middle {
            // The reference does not overlap these two chunks on the middle ranks.
            push(fwd, 0, false);
            push(whole, 1, false);
        } else {
            push(fwd, 0, true);
            push(whole, 1, false);
        }
        push(fwd, 1, true);
        push(whole, 0, false);
    }
    // Step 5: nB1F1B0.
    for _ in 0..half_ranks - half_rank - 1 {
        push(whole, 1, false);
        push(fwd, 1, true);
        push(whole, 0, false);
    }
    // Step 6: nB1B0, the second half of these backward chunks with the split (from the
    // middle pair on: before its B1 when `half_rank` is odd, before its B0 when even).
    let step_6 = half_rank + 1;
    let mut enable = false;
    for i in 0..step_6 {
        if i == step_6 / 2 && !half_rank.is_multiple_of(2) {
            enable = zb;
        }
        push(Local::Backward(enable), 1, false);
        if i == step_6 / 2 && half_rank.is_multiple_of(2) {
            enable = zb;
        }
        push(Local::Backward(enable), 0, false);
    }
    // Step 7: nWB0.
    for _ in 0..half_ranks - half_rank - 1 {
        if zb {
            push(Local::Weight, 0, false);
        }
        push(split, 0, false);
    }
    // Step 8: nW, draining the queue.
    if zb {
        for _ in 0..half_rank + 1 {
            push(Local::Weight, 0, false);
        }
    }
    // Local phase -> chunk (direction: phase ^ second half); micro-batches numbered per
    // direction, first in first out; weight gradients popped first in, first out.
    let mut next = [[0u32; 2]; 2]; // [forward?][chunk]
    let mut queue = std::collections::VecDeque::new();
    let ids: Vec<(Local, (u32, u32), bool)> = order
        .iter()
        .map(|&(what, phase, paired)| {
            if what == Local::Weight {
                let id = queue
                    .pop_front()
                    .expect("a deferred weight gradient to run");
                return (what, id, paired);
            }
            let c = phase ^ second_half;
            let n = &mut next[(what == Local::Forward) as usize][c as usize];
            let mb = c * half_chunks + *n;
            *n += 1;
            if what == Local::Backward(true) {
                queue.push_back((mb, c));
            }
            (what, (mb, c), paired)
        })
        .collect();
    debug_assert!(queue.is_empty(), "every deferred weight gradient runs");
    let mut out = Vec::with_capacity(ids.len());
    let mut k = 0;
    while k < ids.len() {
        let (what, (mb, c), paired) = ids[k];
        if paired && k + 1 < ids.len() {
            out.push(PipeStep::ForwardBackward((mb, c), ids[k + 1].1));
            k += 2;
            continue;
        }
        out.push(match what {
            Local::Forward => PipeStep::Forward(mb, c),
            Local::Backward(false) => PipeStep::Backward(mb, c),
            Local::Backward(true) => PipeStep::BackwardInput(mb, c),
            Local::Weight => PipeStep::Weight(mb, c),
        });
        k += 1;
    }
    out
}

/// Megatron's (interleaved) 1F1B order: the (micro-batch, chunk) of the `k`-th forward
/// (`forward`) or backward on a rank of `p` with `v` model chunks. Micro-batches go in groups of
/// `p` through the chunks (Megatron's default `microbatch_group_size_per_vp_stage`), forwards
/// from the first chunk, backwards from the last; with one chunk the `k`-th is micro-batch `k`.
pub fn one_f_one_b_order(k: u32, p: u32, v: u32, forward: bool) -> (u32, u32) {
    let micro_batch = (k / (p * v)) * p + k % p;
    let c = (k % (p * v)) / p;
    (micro_batch, if forward { c } else { v - 1 - c })
}

/// Forwards Megatron's (interleaved) 1F1B runs on rank `stage` of `p` before its first
/// backward, before the cap at the rank's chunk forwards: `p - stage - 1` with one chunk,
/// `2 (p - stage - 1) + (v - 1) p` with `v`.
pub fn one_f_one_b_warmup(stage: u32, p: u32, v: u32) -> u32 {
    if v == 1 {
        p - stage - 1
    } else {
        2 * (p - stage - 1) + (v - 1) * p
    }
}

/// 1F1B with expert-parallel communication overlap on pipeline rank `stage` of `p` with `m`
/// micro-batches over `v` model chunks (jobs: `v = 1` only with `p = 1`): Megatron-Core's combined
/// 1F1B. The warm-up runs the plain (interleaved when `v > 1`) schedule's warm-up forwards plus
/// one, `min(2 (p - stage - 1) + (v - 1) p + 1, m v)`; each steady-state step then pairs the next
/// forward with the next backward in the interleaved order (micro-batches in groups of `p`,
/// Megatron's default `microbatch_group_size_per_vp_stage`); the cool-down runs the remaining
/// backwards. A pair never holds a forward and the backward that depends on it (the forward is
/// at least one full round ahead).
pub fn overlapped_1f1b_steps(stage: u32, p: u32, m: u32, v: u32) -> Vec<PipeStep> {
    let total = m * v;
    let fwd = |k: u32| one_f_one_b_order(k, p, v, true);
    let bwd = |k: u32| one_f_one_b_order(k, p, v, false);
    // Plain 1F1B's warm-up with one chunk (jobs allow that for `p = 1` only; the schedule
    // itself is defined for any `p`, which the tests use), the interleaved one with more.
    let warmup = (one_f_one_b_warmup(stage, p, v) + 1).min(total);
    let mut out = Vec::with_capacity(2 * total as usize);
    out.extend((0..warmup).map(|k| {
        let (mb, c) = fwd(k);
        PipeStep::Forward(mb, c)
    }));
    out.extend((0..total - warmup).map(|j| PipeStep::ForwardBackward(fwd(warmup + j), bwd(j))));
    out.extend((total - warmup..total).map(|j| {
        let (mb, c) = bwd(j);
        PipeStep::Backward(mb, c)
    }));
    out
}

/// Checks the rules of 1F1B with expert-parallel overlap (Megatron-Core's assertions that
/// concern the schedule): one model chunk without pipeline stages, at least two (an interleaved
/// pipeline, micro-batches divisible by `pp`) with them, and no full recomputation.
pub fn validate_overlapped_1f1b(job: &Job) -> Result<(), JobError> {
    let p = &job.parallel;
    if p.pp == 1 && p.vpp != 1 {
        return Err(JobError::new(
            "parallel.vpp",
            format!(
                "\"1f1b-overlap\" on one pipeline stage needs vpp = 1 (got {})",
                p.vpp
            ),
        ));
    }
    if p.pp > 1 && p.vpp < 2 {
        return Err(JobError::new(
            "parallel.vpp",
            format!(
                "\"1f1b-overlap\" with pp = {} needs vpp >= 2 (got {}): Megatron-Core overlaps \
                 chunks of different virtual stages; with one chunk per rank every pair would \
                 wait for the next stage's pair of the same step",
                p.pp, p.vpp
            ),
        ));
    }
    let m = job.round_micro_batches();
    if p.pp > 1 && !m.is_multiple_of(p.pp as u64) {
        return Err(JobError::new(
            "training.global_batch",
            format!(
                "\"1f1b-overlap\" with pp > 1 runs the interleaved order, which needs the \
                 micro-batch count ({m}) divisible by pp ({})",
                p.pp
            ),
        ));
    }
    if p.recompute == crate::job::Recompute::Full {
        return Err(JobError::new(
            "parallel.recompute",
            "\"1f1b-overlap\" does not run with full recomputation (Megatron-Core refuses the \
             combination); use \"selective\" or \"none\"",
        ));
    }
    Ok(())
}

/// 1F1B-with-EP-overlap's pipeline bubble per rank, `(PP - 1)(F + B) / VPP` with `F` and `B`
/// a stage's whole forward and backward (chunk times `F / VPP`, `B / VPP`): the interleaved
/// schedule's, for uniform chunks, communication free and a pair taking `F + B` of its chunks.
/// Derived by evaluating [`overlapped_1f1b_steps`]' max-plus recurrence (test
/// `overlapped_1f1b_bubble_matches_the_schedule`; the engine in `tests/models.rs`).
pub fn overlapped_1f1b_bubble(pp: u32, vpp: u32, f: f64, b: f64) -> f64 {
    (pp as f64 - 1.0) * (f + b) / vpp as f64
}

/// The steps of an overlapping schedule, or `None` for the plain schedules.
pub fn pipe_steps(kind: Schedule, stage: u32, p: u32, m: u32, v: u32) -> Option<Vec<PipeStep>> {
    match kind {
        Schedule::DualPipe => Some(dualpipe_steps(stage, p, m)),
        Schedule::OneFOneBOverlap => Some(overlapped_1f1b_steps(stage, p, m, v)),
        _ => None,
    }
}

/// DualPipe's pipeline bubble per rank as the DeepSeek-V3 report gives it (Table 2):
/// `(PP/2 - 1)(F&B + B - 3W)`, with `F&B` the time of an overlapped forward and backward
/// chunk, `B` a (full, per the reference's README) backward chunk and `W` its
/// weight-gradient part. The schedule's exact bubble is [`dualpipe_bubble_exact`].
pub fn dualpipe_bubble(pp: u32, f_and_b: f64, b: f64, w: f64) -> f64 {
    (pp as f64 / 2.0 - 1.0) * (f_and_b + b - 3.0 * w)
}

/// The exact pipeline bubble of [`dualpipe_steps`] per rank, `T - m (F + B + W)` (`T` the
/// iteration's makespan), on `pp` ranks whose chunks all take `F` forward, `B` for the input
/// gradient and `W` for the weight gradient, with communication free and an overlapped pair
/// running as its forward then its backward (so `F&B = F + B + W`, the forward's output
/// leaving after `F`), for every even `m >= 2 pp`:
///
/// `n max(B - W, 0) + max(2n F, (n - 1) F + n B)`, with `n = PP/2 - 1`.
///
/// Every rank does the same work, so every rank idles this long. With `W = 0` and `B` the
/// whole backward it is the bubble of [`dualpipe_steps_whole`].
///
/// Derivation: the makespan of a fixed schedule with fixed step times is a max-plus
/// expression of the step times, so the bubble is a maximum of linear forms in `F`, `B`, `W`
/// (homogeneous: scaling all times scales it). Evaluating the schedule's recurrence exactly
/// (rational arithmetic) and differentiating at random points enumerates its linear pieces:
/// for `pp` = 4, 6, 8 and 16 and `m` = `2 pp`, `2 pp + 2`, `4 pp` there are the same four,
/// `2nF + n(B - W)`, `2nF`, `(n - 1)F + 2nB - nW` and `(n - 1)F + nB` (none depends on `m`:
/// the main phase adds the same work to every rank), which is the form above. The test
/// `dualpipe_bubble_exact_matches_the_schedule` re-checks it against a max-plus evaluation
/// of the steps; `crates/prism-core/tests/models.rs` against the engine.
///
/// Against the report's `(PP/2 - 1)(F&B + B' - 3W)` ([`dualpipe_bubble`], `B'` the full
/// backward `B + W` as the reference's README defines it, `F&B = F + B + W`), which is
/// `n (F + 2B - W)`: where `B >= W` and `n B >= (n + 1) F` the exact bubble is one forward
/// chunk less, `n (F + 2B - W) - F` (`F` enters with coefficient `PP/2 - 2`, not
/// `PP/2 - 1`). Past `W = B` a longer weight gradient no longer shortens the bubble (the
/// `n max(B - W, 0)` term), and where `n B < (n + 1) F` the `2n F` piece is the larger; in
/// both cases the report's form can fall below the schedule's bubble.
pub fn dualpipe_bubble_exact(pp: u32, f: f64, b: f64, w: f64) -> f64 {
    let n = pp as f64 / 2.0 - 1.0;
    if n <= 0.0 {
        return 0.0;
    }
    n * (b - w).max(0.0) + (2.0 * n * f).max((n - 1.0) * f + n * b)
}

/// 1F1B's pipeline bubble per rank: `(PP - 1)(F + B)`.
pub fn one_f_one_b_bubble(pp: u32, f: f64, b: f64) -> f64 {
    (pp as f64 - 1.0) * (f + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (micro-batch, chunk) pairs.
    type Ids = Vec<(u32, u32)>;

    fn count(steps: &[PipeStep]) -> (Ids, Ids) {
        let (mut f, mut b) = (Vec::new(), Vec::new());
        for s in steps {
            match *s {
                PipeStep::Forward(m, c) => f.push((m, c)),
                PipeStep::Backward(m, c) | PipeStep::BackwardInput(m, c) => b.push((m, c)),
                PipeStep::ForwardBackward(x, y) => {
                    f.push(x);
                    b.push(y);
                }
                PipeStep::Weight(..) => {}
            }
        }
        (f, b)
    }

    /// Every backward of `kind`'s order on stage `r` (`steps`, each overlapped pair as its
    /// forward then its backward) comes after its own forward, and no pair holds the forward
    /// and the backward of the same chunk.
    fn assert_backwards_follow_forwards(
        kind: Schedule,
        steps: &[PipeStep],
        r: u32,
        p: u32,
        m: u32,
        v: u32,
        ctx: &str,
    ) {
        let flat = crate::graph::schedule(kind, r, p, m, v);
        for (i, st) in flat.iter().enumerate().filter(|(_, s)| !s.forward) {
            let fwd = flat
                .iter()
                .position(|x| x.forward && (x.micro_batch, x.chunk) == (st.micro_batch, st.chunk));
            assert!(fwd.is_some_and(|j| j < i), "{ctx}");
        }
        for st in steps {
            if let PipeStep::ForwardBackward(x, y) = st {
                assert_ne!(x, y, "{ctx}");
            }
        }
    }

    #[test]
    fn dualpipe_covers_every_micro_batch_once_per_direction() {
        for pp in [2u32, 4, 8, 16] {
            for m in [2 * pp, 2 * pp + 2, 4 * pp] {
                for r in 0..pp {
                    let steps = dualpipe_steps(r, pp, m);
                    let ctx = format!("pp {pp} m {m} r {r}");
                    assert_backwards_follow_forwards(Schedule::DualPipe, &steps, r, pp, m, 1, &ctx);
                    let (mut f, mut b) = count(&steps);
                    f.sort_unstable();
                    b.sort_unstable();
                    let want: Vec<(u32, u32)> =
                        (0..m).map(|mb| (mb, (mb >= m / 2) as u32)).collect();
                    assert_eq!(f, want, "pp {pp} m {m} r {r}");
                    assert_eq!(b, want, "pp {pp} m {m} r {r}");
                }
            }
        }
    }

    /// Truth: the reference's zero-bubble bookkeeping (`dualpipe.py`): on rank `r` with
    /// `h = min(r, pp - 1 - r)` and `n = pp/2 - 1`, step 3 and step 7 split `n - h` backward
    /// chunks each and step 6 the second half, `h + 1`, of its `2 (h + 1)`; the weight
    /// queue is first in, first out, so each `Weight` follows its own `BackwardInput` and
    /// they run in the same order. Without the split the steps are the same with every
    /// backward whole.
    #[test]
    fn dualpipe_zero_bubble_split_follows_the_reference() {
        for pp in [2u32, 4, 6, 8, 16] {
            for m in [2 * pp, 2 * pp + 2, 4 * pp] {
                for r in 0..pp {
                    let h = r.min(pp - 1 - r);
                    let n = pp / 2 - 1;
                    let steps = dualpipe_steps(r, pp, m);
                    let input: Ids = (steps.iter())
                        .filter_map(|s| match *s {
                            PipeStep::BackwardInput(a, c) => Some((a, c)),
                            _ => None,
                        })
                        .collect();
                    let weight: Ids = (steps.iter())
                        .filter_map(|s| match *s {
                            PipeStep::Weight(a, c) => Some((a, c)),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(input.len() as u32, 2 * (n - h) + h + 1, "pp {pp} r {r}");
                    assert_eq!(input, weight, "FIFO, pp {pp} m {m} r {r}");
                    for (i, st) in steps.iter().enumerate() {
                        if let PipeStep::Weight(a, c) = *st {
                            let b = steps
                                .iter()
                                .position(|x| *x == PipeStep::BackwardInput(a, c));
                            assert!(b.is_some_and(|b| b < i), "pp {pp} m {m} r {r}");
                        }
                    }
                    let folded: Vec<PipeStep> = (steps.iter())
                        .filter_map(|s| match *s {
                            PipeStep::BackwardInput(a, c) => Some(PipeStep::Backward(a, c)),
                            PipeStep::Weight(..) => None,
                            s => Some(s),
                        })
                        .collect();
                    assert_eq!(
                        folded,
                        dualpipe_steps_whole(r, pp, m),
                        "pp {pp} m {m} r {r}"
                    );
                }
            }
        }
    }

    /// Truth: holding a split backward's micro-batch until its deferred weight gradient runs
    /// (the activations the weight-gradient GEMMs read) does not raise the peak number of
    /// micro-batches a rank holds: the weight gradients of step 3 run right after their
    /// backward, the others in the cool-down, after the peak. (So the memory model, which
    /// frees a micro-batch at its input-gradient step, keeps DualPipe's `PP + 1` peak.)
    #[test]
    fn zero_bubble_split_keeps_the_activation_peak() {
        for pp in [2u32, 4, 6, 8, 16] {
            for m in [2 * pp, 2 * pp + 2, 4 * pp] {
                for r in 0..pp {
                    let peak = |free_at_weight: bool| {
                        let (mut live, mut best) = (0i64, 0i64);
                        for st in dualpipe_steps(r, pp, m) {
                            match st {
                                PipeStep::Forward(..) => live += 1,
                                PipeStep::ForwardBackward(..) => {
                                    best = best.max(live + 1);
                                }
                                PipeStep::Backward(..) => live -= 1,
                                PipeStep::BackwardInput(..) => live -= !free_at_weight as i64,
                                PipeStep::Weight(..) => live -= free_at_weight as i64,
                            }
                            best = best.max(live);
                        }
                        assert_eq!(live, 0);
                        best
                    };
                    assert_eq!(peak(true), peak(false), "pp {pp} m {m} r {r}");
                }
            }
        }
    }

    /// Max-plus evaluation of DualPipe's steps (no graph, no engine): each rank runs its
    /// steps in order; a forward waits for the same micro-batch's forward upstream (in its
    /// direction), a backward for the backward downstream; `F`, `B` (input gradient), `W`
    /// (weight gradient), a whole backward `B + W`, a pair `F` then the backward (the
    /// forward's output leaving after `F`); communication free. Returns the bubble
    /// `T - m (F + B + W)`. Integer times, so the result is exact.
    fn max_plus_bubble(pp: u32, m: u32, f: i64, b: i64, w: i64, zb: bool) -> i64 {
        let steps: Vec<Vec<PipeStep>> = (0..pp)
            .map(|r| {
                if zb {
                    dualpipe_steps(r, pp, m)
                } else {
                    dualpipe_steps_whole(r, pp, m)
                }
            })
            .collect();
        // Neighbour a message of direction `c` comes from (forward) / goes to.
        let up = |r: u32, c: u32| -> Option<u32> {
            if c == 0 {
                r.checked_sub(1)
            } else {
                (r + 1 < pp).then_some(r + 1)
            }
        };
        let down = |r: u32, c: u32| -> Option<u32> {
            if c == 0 {
                (r + 1 < pp).then_some(r + 1)
            } else {
                r.checked_sub(1)
            }
        };
        let mut done = std::collections::BTreeMap::new(); // (forward, mb, rank) -> ready
        let (mut pc, mut t) = (vec![0usize; pp as usize], vec![0i64; pp as usize]);
        let mut progress = true;
        while progress {
            progress = false;
            for r in 0..pp {
                let ri = r as usize;
                while let Some(&st) = steps[ri].get(pc[ri]) {
                    let (fw, bw) = match st {
                        PipeStep::Forward(a, c) => (Some((a, c)), None),
                        PipeStep::Backward(a, c) | PipeStep::BackwardInput(a, c) => {
                            (None, Some((a, c)))
                        }
                        PipeStep::ForwardBackward(x, y) => (Some(x), Some(y)),
                        PipeStep::Weight(..) => (None, None),
                    };
                    let mut deps = Vec::new();
                    if let Some((a, c)) = fw {
                        deps.extend(up(r, c).map(|u| (true, a, u)));
                    }
                    if let Some((a, c)) = bw {
                        deps.extend(down(r, c).map(|d| (false, a, d)));
                    }
                    if deps.iter().any(|d| !done.contains_key(d)) {
                        break;
                    }
                    let start = deps.iter().map(|d| done[d]).fold(t[ri], i64::max);
                    let mut now = start;
                    if let Some((a, _)) = fw {
                        now += f;
                        done.insert((true, a, r), now);
                    }
                    now += match st {
                        PipeStep::Backward(..) | PipeStep::ForwardBackward(..) => b + w,
                        PipeStep::BackwardInput(..) => b,
                        PipeStep::Weight(..) => w,
                        PipeStep::Forward(..) => 0,
                    };
                    if let Some((a, _)) = bw {
                        done.insert((false, a, r), now);
                    }
                    t[ri] = now;
                    pc[ri] += 1;
                    progress = true;
                }
            }
        }
        assert!(
            (0..pp as usize).all(|r| pc[r] == steps[r].len()),
            "deadlock"
        );
        t.iter().max().unwrap() - m as i64 * (f + b + w)
    }

    /// Truth: a max-plus evaluation of the schedule ([`max_plus_bubble`]) gives
    /// [`dualpipe_bubble_exact`] for every rank count, micro-batch count and step times
    /// tried (all four regimes of the form: `B` above and below `W`, forwards short and
    /// long), with and without the split; and the report's form is the exact one plus one
    /// forward chunk where `B >= W` and `n B >= (n + 1) F`.
    #[test]
    fn dualpipe_bubble_exact_matches_the_schedule() {
        let times = [
            (10i64, 20, 0),
            (10, 15, 5),
            (10, 10, 10),
            (30, 50, 20),
            (20, 10, 10),
            (10, 5, 15),
            (7, 30, 11),
        ];
        for pp in [2u32, 4, 6, 8, 10, 16] {
            for m in [2 * pp, 2 * pp + 2, 3 * pp + (3 * pp) % 2] {
                for &(f, b, w) in &times {
                    let n = (pp / 2 - 1) as i64;
                    let exact = dualpipe_bubble_exact(pp, f as f64, b as f64, w as f64);
                    let got = max_plus_bubble(pp, m, f, b, w, true);
                    assert_eq!(got as f64, exact, "pp {pp} m {m} F {f} B {b} W {w}");
                    // Whole backwards: the same form with W folded into B.
                    let whole = max_plus_bubble(pp, m, f, b + w, 0, false);
                    let exact_whole = dualpipe_bubble_exact(pp, f as f64, (b + w) as f64, 0.0);
                    assert_eq!(whole as f64, exact_whole, "whole pp {pp} m {m}");
                    if pp > 2 && b >= w && n * b >= (n + 1) * f {
                        let paper =
                            dualpipe_bubble(pp, (f + b + w) as f64, (b + w) as f64, w as f64);
                        assert_eq!(paper - exact, f as f64, "pp {pp} F {f} B {b} W {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn overlapped_1f1b_pairs_each_forward_with_the_previous_backward() {
        for m in [1u32, 2, 5] {
            let steps = overlapped_1f1b_steps(0, 1, m, 1);
            let (f, b) = count(&steps);
            assert_eq!(f, (0..m).map(|k| (k, 0)).collect::<Vec<_>>());
            assert_eq!(b, (0..m).map(|k| (k, 0)).collect::<Vec<_>>());
            for st in steps {
                if let PipeStep::ForwardBackward((x, _), (y, _)) = st {
                    assert_eq!(x, y + 1);
                }
            }
        }
    }

    /// Max-plus evaluation of 1F1B-with-overlap's steps on `p` ranks, `v` chunks each (virtual
    /// stage `c p + r` on rank `r`): a forward waits for the previous virtual stage's forward
    /// of its micro-batch, a backward for the next virtual stage's backward (the last virtual
    /// stage for its own forward); chunk times `f`, `b`; a pair starts when both inputs are in
    /// and the rank is free, takes `f + b` and sends both outputs when it ends, as the graph
    /// builder does; communication free. `overlap = false` evaluates the plain (interleaved)
    /// 1F1B order of [`crate::graph::schedule`] instead. Returns the bubble `T - m v (f + b)`.
    fn overlap_max_plus_bubble(p: u32, m: u32, v: u32, f: i64, b: i64, overlap: bool) -> i64 {
        use std::collections::BTreeMap;
        type Item = (bool, u32, u32); // (forward, micro-batch, chunk)
        let steps: Vec<Vec<Vec<Item>>> = (0..p)
            .map(|r| {
                if overlap {
                    (overlapped_1f1b_steps(r, p, m, v).into_iter())
                        .map(|st| match st {
                            PipeStep::Forward(a, c) => vec![(true, a, c)],
                            PipeStep::Backward(a, c) => vec![(false, a, c)],
                            PipeStep::ForwardBackward(x, y) => {
                                vec![(true, x.0, x.1), (false, y.0, y.1)]
                            }
                            _ => unreachable!(),
                        })
                        .collect()
                } else {
                    let kind = if v == 1 {
                        Schedule::OneFOneB
                    } else {
                        Schedule::Interleaved
                    };
                    (crate::graph::schedule(kind, r, p, m, v).into_iter())
                        .map(|s| vec![(s.forward, s.micro_batch, s.chunk)])
                        .collect()
                }
            })
            .collect();
        let last = p * v - 1;
        let mut done: BTreeMap<(bool, u32, u32), i64> = BTreeMap::new(); // (fwd, mb, vstage)
        let (mut pos, mut free) = (vec![0usize; p as usize], vec![0i64; p as usize]);
        loop {
            let mut progressed = false;
            for r in 0..p {
                let ri = r as usize;
                while let Some(step) = steps[ri].get(pos[ri]) {
                    let mut start = free[ri];
                    let mut ready = true;
                    for &(fw, mb, c) in step {
                        let vs = c * p + r;
                        let need = match (fw, vs) {
                            (true, 0) => None,
                            (true, _) => Some((true, mb, vs - 1)),
                            (false, x) if x == last => Some((true, mb, vs)),
                            (false, _) => Some((false, mb, vs + 1)),
                        };
                        if let Some(n) = need {
                            match done.get(&n) {
                                Some(&t) => start = start.max(t),
                                None => ready = false,
                            }
                        }
                    }
                    if !ready {
                        break;
                    }
                    let dur: i64 = step.iter().map(|&(fw, ..)| if fw { f } else { b }).sum();
                    for &(fw, mb, c) in step {
                        done.insert((fw, mb, c * p + r), start + dur);
                    }
                    free[ri] = start + dur;
                    pos[ri] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                break;
            }
        }
        assert!(
            (0..p as usize).all(|r| pos[r] == steps[r].len()),
            "deadlock p {p} m {m} v {v}"
        );
        free.iter().max().unwrap() - (m * v) as i64 * (f + b)
    }

    /// Truth: Megatron-Core's combined 1F1B covers every (micro-batch, chunk) once forward and
    /// once backward, each backward after its forward and never in the same pair; its warm-up
    /// is the interleaved one plus one forward; and with uniform chunks its bubble is the
    /// interleaved schedule's `(p - 1)(f + b)` for every `m` (max-plus evaluation, exact
    /// integers), while pairing without virtual stages (`v = 1`, `p > 1`) chains the stages and
    /// the bubble grows with `m`, the reason Megatron-Core (and the job check) needs `vpp >= 2`.
    #[test]
    fn overlapped_1f1b_bubble_matches_the_schedule() {
        for (p, v) in [(1u32, 1u32), (2, 2), (4, 2), (4, 3), (8, 4), (16, 8)] {
            for m in [p, 2 * p, 4 * p].map(|x| x.max(2)) {
                for r in 0..p {
                    let steps = overlapped_1f1b_steps(r, p, m, v);
                    let (mut f, mut b) = count(&steps);
                    f.sort_unstable();
                    b.sort_unstable();
                    let want: Ids = (0..m).flat_map(|mb| (0..v).map(move |c| (mb, c))).collect();
                    assert_eq!((&f, &b), (&want, &want), "p {p} v {v} m {m} r {r}");
                    let plain_warmup = if v == 1 {
                        p - r - 1
                    } else {
                        2 * (p - r - 1) + (v - 1) * p
                    };
                    let warm = steps
                        .iter()
                        .take_while(|s| matches!(s, PipeStep::Forward(..)))
                        .count() as u32;
                    assert_eq!(
                        warm,
                        (plain_warmup + 1).min(m * v),
                        "p {p} v {v} m {m} r {r}"
                    );
                    let ctx = format!("p {p} v {v} m {m} r {r}");
                    let kind = Schedule::OneFOneBOverlap;
                    assert_backwards_follow_forwards(kind, &steps, r, p, m, v, &ctx);
                }
                for (fc, bc) in [(1i64, 2i64), (1, 1), (2, 1), (1, 3)] {
                    let got = overlap_max_plus_bubble(p, m, v, fc, bc, true);
                    let plain = overlap_max_plus_bubble(p, m, v, fc, bc, false);
                    let cf = overlapped_1f1b_bubble(
                        p,
                        v,
                        (v as i64 * fc) as f64,
                        (v as i64 * bc) as f64,
                    );
                    assert_eq!(got as f64, cf, "p {p} v {v} m {m} f {fc} b {bc}");
                    assert_eq!(got, plain, "p {p} v {v} m {m}");
                }
            }
        }
        // One chunk per rank on several stages: every step waits for the whole chain.
        for p in [2u32, 4, 8] {
            let small = overlap_max_plus_bubble(p, 2 * p, 1, 1, 2, true);
            let large = overlap_max_plus_bubble(p, 4 * p, 1, 1, 2, true);
            assert!(
                small > overlap_max_plus_bubble(p, 2 * p, 1, 1, 2, false),
                "p {p}"
            );
            assert!(large > small, "p {p}: {large} vs {small}");
        }
    }

    /// Truth: the job check follows Megatron-Core's rules for the combined 1F1B and names the
    /// key: vpp >= 2 with pipeline stages, vpp = 1 without, micro-batches divisible by pp,
    /// no full recomputation.
    #[test]
    fn overlapped_1f1b_job_rules() {
        use crate::arch::fixtures::small_deepseek_job;
        use crate::job::Recompute;
        let base = |pp: u32, vpp: u32, gb: u32| {
            let mut j = small_deepseek_job(pp, 1, pp, gb, 8);
            j.model.layers = 2 * pp * vpp;
            j.model.arch.moe_first_dense_layers = 0;
            j.parallel.vpp = vpp;
            j.parallel.schedule = Schedule::OneFOneBOverlap;
            j
        };
        assert!(base(2, 2, 8 * 4).validate().is_ok());
        assert!(base(1, 1, 8 * 4).validate().is_ok());
        let key = |j: Job| j.validate().unwrap_err().key;
        assert_eq!(key(base(2, 1, 8 * 4)), "parallel.vpp");
        assert_eq!(key(base(1, 2, 8 * 4)), "parallel.vpp");
        assert_eq!(key(base(2, 2, 8 * 3)), "training.global_batch");
        let mut full = base(2, 2, 8 * 4);
        full.parallel.recompute = Recompute::Full;
        assert_eq!(key(full), "parallel.recompute");
    }

    #[test]
    fn bubble_closed_forms() {
        // Table 2 of the DeepSeek-V3 report, PP = 8: DualPipe (8/2 - 1)(F&B + B - 3W).
        assert_eq!(dualpipe_bubble(8, 3.0, 2.0, 0.5), 3.0 * (3.0 + 2.0 - 1.5));
        assert_eq!(one_f_one_b_bubble(8, 1.0, 2.0), 21.0);
        // Two ranks: no bubble in DualPipe.
        assert_eq!(dualpipe_bubble(2, 3.0, 2.0, 0.5), 0.0);
    }
}
