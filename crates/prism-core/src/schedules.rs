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
//! micro-batches `0 .. m/2` flow forward, `m/2 .. m` in reverse. The reference splits some
//! backward chunks into input and weight gradients (zero bubble); Prism runs every backward
//! whole, which is the schedule with `W = 0` in the paper's bubble
//! `(PP/2 - 1)(F&B + B - 3W)` ([`dualpipe_bubble`]). Parameters are held twice (two stages
//! per rank); activations of `PP + 1` micro-batch stages at the peak.
//!
//! **1F1B with EP overlap** (Megatron-Core's combined 1F1B): on one pipeline stage, forward
//! `k + 1` overlapped with backward `k`. With several stages Megatron-Core pairs chunks of
//! different virtual stages; pairing a stage's forward and backward of the same step would
//! chain every stage's pair behind the next stage's, so Prism accepts it for `pp = 1` only.

use crate::job::{Job, JobError, Schedule};

/// One step of a rank's pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipeStep {
    /// Forward of `(micro_batch, chunk)`.
    Forward(u32, u32),
    /// Backward of `(micro_batch, chunk)`.
    Backward(u32, u32),
    /// Forward of the first `(micro_batch, chunk)` overlapped with the backward of the second.
    ForwardBackward((u32, u32), (u32, u32)),
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
/// the eight phases of the reference implementation, weight-gradient steps folded into their
/// backward chunks.
pub fn dualpipe_steps(rank: u32, pp: u32, m: u32) -> Vec<PipeStep> {
    let half_ranks = pp / 2;
    let half_rank = rank.min(pp - 1 - rank);
    let second_half = (rank >= half_ranks) as u32;
    let half_chunks = m / 2;
    let middle = rank == half_ranks - 1 || rank == half_ranks;
    // (forward, local phase, overlapped with the next step), in schedule order.
    let mut order: Vec<(bool, u32, bool)> = Vec::with_capacity(2 * m as usize);
    let mut push = |forward: bool, phase: u32, paired: bool| order.push((forward, phase, paired));
    // Step 1: nF0.
    for _ in 0..(half_ranks - half_rank - 1) * 2 {
        push(true, 0, false);
    }
    // Step 2: nF0F1.
    for _ in 0..half_rank + 1 {
        push(true, 0, false);
        push(true, 1, false);
    }
    // Step 3: nB1W1F1.
    for _ in 0..half_ranks - half_rank - 1 {
        push(false, 1, false);
        push(true, 1, false);
    }
    // Step 4 (main): nF0B1F1B0.
    for i in 0..half_chunks + half_rank + 1 - pp {
        if i == 0 && middle {
            // The reference does not overlap these two chunks on the middle ranks.
            push(true, 0, false);
            push(false, 1, false);
        } else {
            push(true, 0, true);
            push(false, 1, false);
        }
        push(true, 1, true);
        push(false, 0, false);
    }
    // Step 5: nB1F1B0.
    for _ in 0..half_ranks - half_rank - 1 {
        push(false, 1, false);
        push(true, 1, true);
        push(false, 0, false);
    }
    // Step 6: nB1B0.
    for _ in 0..half_rank + 1 {
        push(false, 1, false);
        push(false, 0, false);
    }
    // Step 7: nWB0.
    for _ in 0..half_ranks - half_rank - 1 {
        push(false, 0, false);
    }
    // Local phase -> chunk (direction: phase ^ second half); micro-batches numbered per
    // direction, first in first out.
    let mut next = [[0u32; 2]; 2]; // [forward?][chunk]
    let ids: Vec<(bool, (u32, u32), bool)> = order
        .iter()
        .map(|&(forward, phase, paired)| {
            let c = phase ^ second_half;
            let n = &mut next[forward as usize][c as usize];
            let mb = c * half_chunks + *n;
            *n += 1;
            (forward, (mb, c), paired)
        })
        .collect();
    let mut out = Vec::with_capacity(2 * m as usize);
    let mut k = 0;
    while k < ids.len() {
        let (forward, step, paired) = ids[k];
        if paired && k + 1 < ids.len() {
            out.push(PipeStep::ForwardBackward(step, ids[k + 1].1));
            k += 2;
        } else {
            out.push(if forward {
                PipeStep::Forward(step.0, step.1)
            } else {
                PipeStep::Backward(step.0, step.1)
            });
            k += 1;
        }
    }
    out
}

/// 1F1B with expert-parallel communication overlap (one pipeline stage, `p = 1`) with `m`
/// micro-batches: forward 0, then each forward `k + 1` overlapped with backward `k`, then the
/// last backward (Megatron-Core's combined 1F1B; a pair never holds a forward and the
/// backward that depends on it).
pub fn overlapped_1f1b_steps(stage: u32, p: u32, m: u32) -> Vec<PipeStep> {
    debug_assert!(stage == 0 && p == 1, "validated: pp = 1");
    let mut out = Vec::with_capacity(2 * m as usize);
    out.push(PipeStep::Forward(0, 0));
    for k in 0..m.saturating_sub(1) {
        out.push(PipeStep::ForwardBackward((k + 1, 0), (k, 0)));
    }
    out.push(PipeStep::Backward(m - 1, 0));
    out
}

/// Checks the rules of 1F1B with expert-parallel overlap.
pub fn validate_overlapped_1f1b(job: &Job) -> Result<(), JobError> {
    if job.parallel.pp != 1 {
        return Err(JobError::new(
            "parallel.schedule",
            format!(
                "\"1f1b-overlap\" is modelled for pp = 1 only (got pp = {}): with pipeline \
                 stages Megatron-Core overlaps chunks of different virtual stages, which Prism \
                 does not model yet; use \"dualpipe\" or \"1f1b\"",
                job.parallel.pp
            ),
        ));
    }
    Ok(())
}

/// The steps of an overlapping schedule, or `None` for the plain schedules.
pub fn pipe_steps(kind: Schedule, stage: u32, p: u32, m: u32) -> Option<Vec<PipeStep>> {
    match kind {
        Schedule::DualPipe => Some(dualpipe_steps(stage, p, m)),
        Schedule::OneFOneBOverlap => Some(overlapped_1f1b_steps(stage, p, m)),
        _ => None,
    }
}

/// DualPipe's pipeline bubble per rank (DeepSeek-V3 report, Table 2):
/// `(PP/2 - 1)(F&B + B - 3W)`, with `F&B` the time of an overlapped forward and backward
/// chunk, `B` a backward chunk and `W` its weight-gradient part.
pub fn dualpipe_bubble(pp: u32, f_and_b: f64, b: f64, w: f64) -> f64 {
    (pp as f64 / 2.0 - 1.0) * (f_and_b + b - 3.0 * w)
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
                PipeStep::Backward(m, c) => b.push((m, c)),
                PipeStep::ForwardBackward(x, y) => {
                    f.push(x);
                    b.push(y);
                }
            }
        }
        (f, b)
    }

    #[test]
    fn dualpipe_covers_every_micro_batch_once_per_direction() {
        for pp in [2u32, 4, 8, 16] {
            for m in [2 * pp, 2 * pp + 2, 4 * pp] {
                for r in 0..pp {
                    let steps = dualpipe_steps(r, pp, m);
                    // Every backward comes after its own forward (a pair holds a forward and
                    // the backward of another micro-batch).
                    let flat = crate::graph::schedule(Schedule::DualPipe, r, pp, m, 1);
                    for (i, st) in flat.iter().enumerate().filter(|(_, s)| !s.forward) {
                        let fwd = flat.iter().position(|x| {
                            x.forward && (x.micro_batch, x.chunk) == (st.micro_batch, st.chunk)
                        });
                        assert!(fwd.is_some_and(|j| j < i), "pp {pp} m {m} r {r}");
                    }
                    for st in &steps {
                        if let PipeStep::ForwardBackward(x, y) = st {
                            assert_ne!(x, y);
                        }
                    }
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

    #[test]
    fn overlapped_1f1b_pairs_each_forward_with_the_previous_backward() {
        for m in [1u32, 2, 5] {
            let steps = overlapped_1f1b_steps(0, 1, m);
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

    #[test]
    fn bubble_closed_forms() {
        // Table 2 of the DeepSeek-V3 report, PP = 8: DualPipe (8/2 - 1)(F&B + B - 3W).
        assert_eq!(dualpipe_bubble(8, 3.0, 2.0, 0.5), 3.0 * (3.0 + 2.0 - 1.5));
        assert_eq!(one_f_one_b_bubble(8, 1.0, 2.0), 21.0);
        // Two ranks: no bubble in DualPipe.
        assert_eq!(dualpipe_bubble(2, 3.0, 2.0, 0.5), 0.0);
    }
}
