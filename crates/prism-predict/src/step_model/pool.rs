//! Pooled lane races: the approximation that makes kernel jitter without per-GPU speeds fast.
//!
//! Without per-GPU speeds the lanes of a tensor-parallel group are i.i.d., and most segments'
//! lanes collapse into one order-statistic draw. What does not collapse is a *race*: in a
//! backward block the weight-gradient GEMM runs on each lane while the group's collective runs,
//! so the lanes leave the block at different times and every lane is drawn (six per-lane
//! segments per layer; 50 million lane draws per sample at 65,536 GPUs).
//!
//! Such a block is a *region* of the replica program: instructions that one time shared by
//! every lane (the *entry*) starts, that read nothing else from outside, and whose ends are read
//! outside only at a few *exits* (per lane or shared). Relative to the entry, the exits are a
//! random vector whose law depends only on the region's instructions, so every block with the
//! same instructions (the same layer in every micro-batch and replica) has the same law,
//! independently of the others.
//!
//! A pooled sample draws, for each such *shape* used often enough, `n` exit vectors exactly
//! (65,536 by default, [`PoolSettings`]; every lane, as the fast sampler does, at the sample's
//! communication regime), and each block of the sample takes one of them uniformly at random. Each block is then exactly
//! distributed (an element of an i.i.d. sample picked independently of the values has the law
//! of the elements); what is approximate is the independence between blocks of one sample,
//! which share the pool. Its sampling error is common to them all: the pool's mean is off by
//! `N(0, sigma^2/n)` (`sigma` the block's standard deviation), so with `K` pooled blocks on the
//! critical path an iteration moves by about `K sigma/sqrt(n)`, and by more than four times
//! that with probability 6e-5. `docs/predict.md` ("Pooled lane races") works this out for the
//! 65,536-GPU job; the tests compare the pooled and exact samplers' distributions.
//!
//! Exact, before any pooling: an input of an instruction that is an ancestor of another of its
//! inputs never ends later (every duration is non-negative), so it is dropped. That is what
//! makes a block's entry one value (a segment's stream predecessor is usually an ancestor of
//! the collective it also waits for).

use super::*;

use std::collections::BTreeSet;

/// When and how large the pools are ([`StepModel::fast_stats_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    /// Exact draws of each pooled shape per sample (at most 2^20; 0: no pools).
    pub size: usize,
    /// Pool a shape only when one sample uses it at least this many times.
    pub min_uses: u64,
}

impl PoolSettings {
    /// No pools: every lane race drawn exactly, lane by lane.
    pub const OFF: PoolSettings = PoolSettings {
        size: 0,
        min_uses: u64::MAX,
    };
}

impl Default for PoolSettings {
    /// 65,536 draws per pool, for shapes used at least four times as often (the pool then costs
    /// at most a quarter of drawing every block exactly).
    fn default() -> Self {
        PoolSettings {
            size: 1 << 16,
            min_uses: 4 << 16,
        }
    }
}

/// The most instructions a pooled region may hold, and the most exits.
const MAX_REGION: usize = 64;
const MAX_EXITS: usize = 4;

/// One pooled shape: its instructions as a program of their own (value 0 is the entry, at
/// time 0) and where its exits land in that program.
#[derive(Clone, Debug)]
pub(super) struct Region {
    pub(super) tape: Tape,
    pub(super) exits: Vec<Val>,
    /// Blocks of this shape in one sample.
    pub(super) uses: u64,
}

/// The replica program with its pooled blocks replaced by draws from the pools.
#[derive(Clone, Debug)]
pub(super) struct Pooled {
    pub(super) tape: Tape,
    pub(super) regions: Vec<Region>,
    /// Draws per pool.
    pub(super) size: usize,
}

/// The stream of pool draw `i` of shape `k` (beyond every replica's and the tail's stream).
fn pool_stream(k: usize, i: usize) -> usize {
    (1 << 40) + (k << 20) + i
}

/// Values a row of a pool holds for exits `exits` with `l` lanes.
pub(super) fn row_width(exits: &[Val], l: usize) -> usize {
    exits.iter().map(|v| v.width(l)).sum()
}

/// One pooled shape of a sample ([`StepModel::pool_summary`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolSummary {
    /// Blocks of this shape in one sample (all drawn from its pool).
    pub blocks_per_sample: u64,
    /// Instructions of the block (segments and collectives).
    pub instructions: usize,
    /// Mean and standard deviation over the pool of the block's duration (entry to latest
    /// exit), seconds.
    pub mean_s: f64,
    pub sd_s: f64,
}

/// A region found in the replica program.
struct Found {
    shape: usize,
    entry: Val,
    members: Vec<u32>,
    exits: Vec<u32>,
}

impl StepModel {
    /// The pooled program of a fast tape without per-GPU speeds (`tape.orig`, unfused), or
    /// `None` when no shape is used often enough.
    pub(super) fn pool_regions(&self, tape: &Tape, settings: PoolSettings) -> Option<Pooled> {
        if settings.size == 0 || settings.size > 1 << 20 {
            return None;
        }
        let orig = &tape.orig;
        let n = orig.len();
        let inputs = self.reduced_inputs(tape);
        let lanes_in: Vec<bool> = inputs.iter().map(|i| i.iter().any(|v| v.lanes)).collect();
        let lane_ins: Vec<bool> = (0..n).map(|i| lanes_in[i] || orig[i].out.lanes).collect();
        // Consumers of each value, and values read where no region can see (the tail's
        // boundary, sinks, gates).
        let mut consumers: Vec<Vec<u32>> = vec![Vec::new(); tape.len];
        for (i, ins) in inputs.iter().enumerate() {
            for v in ins {
                consumers[v.at as usize].push(i as u32);
            }
        }
        let mut observed = vec![false; tape.len];
        for v in tape.sinks.iter().chain(tape.gates.iter().map(|(_, v)| v)) {
            observed[v.at as usize] = true;
        }
        for (s, st) in self.stages.iter().enumerate() {
            for v in st
                .boundary_ops
                .iter()
                .filter_map(|&op| tape.val[s][op as usize])
            {
                observed[v.at as usize] = true;
            }
        }
        let poolable = |i: usize| {
            let ins = &orig[i];
            match ins.code {
                Code::Seg { g0, g1, pk, .. } => g0 == g1 && !pk,
                Code::Tp { .. } | Code::Cp { .. } => true,
                Code::Add { .. } => !matches!(
                    self.stages[ins.stage as usize].kind[ins.op as usize],
                    MKind::Send { .. } | MKind::Recv { .. }
                ),
                Code::Run { .. } | Code::Pool { .. } => false,
            }
        };
        // Regions, grown from a seed (a per-lane instruction whose only input is one time for
        // every lane: the entry). An instruction joins when it is a lane instruction and every
        // input is the entry or a member's end.
        let mut claimed = vec![false; n];
        let mut shape_of: BTreeMap<Vec<u64>, usize> = BTreeMap::new();
        let mut regions: Vec<Region> = Vec::new();
        let mut found: Vec<Found> = Vec::new();
        for seed in 0..n {
            let entry = match inputs[seed].as_slice() {
                [v] if !v.lanes => *v,
                _ => continue,
            };
            if claimed[seed] || !orig[seed].out.lanes || !poolable(seed) {
                continue;
            }
            let mut inside = BTreeSet::from([seed as u32]);
            let mut frontier: BTreeSet<u32> = consumers[orig[seed].out.at as usize]
                .iter()
                .copied()
                .collect();
            while let Some(i) = frontier.pop_first() {
                let iu = i as usize;
                if claimed[iu] || !lane_ins[iu] || !poolable(iu) {
                    continue;
                }
                let joins = (inputs[iu].iter())
                    .all(|v| *v == entry || inside.contains(&tape.producer[v.at as usize]));
                if joins && inside.insert(i) {
                    frontier.extend(consumers[orig[iu].out.at as usize].iter().copied());
                    if inside.len() > MAX_REGION {
                        break;
                    }
                }
            }
            if !(2..=MAX_REGION).contains(&inside.len()) {
                continue;
            }
            let members: Vec<u32> = inside.iter().copied().collect();
            let exits: Vec<u32> = (members.iter().copied())
                .filter(|&m| {
                    let at = orig[m as usize].out.at as usize;
                    observed[at] || consumers[at].iter().any(|c| !inside.contains(c))
                })
                .collect();
            if exits.is_empty() || exits.len() > MAX_EXITS {
                continue;
            }
            for &m in &members {
                claimed[m as usize] = true;
            }
            let key = shape_key(orig, &inputs, &members, &exits);
            let next = shape_of.len();
            let shape = *shape_of.entry(key).or_insert(next);
            if shape == regions.len() {
                regions.push(self.region_tape(orig, &inputs, &members, &exits));
            }
            regions[shape].uses += self.layout.dp as u64;
            found.push(Found {
                shape,
                entry,
                members,
                exits,
            });
        }
        // The pooled program: a pooled region becomes one draw where its seed was (its entry
        // is known there, and every reader of an exit comes after the seed).
        let mut number = vec![u32::MAX; regions.len()];
        let mut kept = Vec::new();
        for (k, r) in regions.into_iter().enumerate() {
            if r.uses >= settings.min_uses {
                number[k] = kept.len() as u32;
                kept.push(r);
            }
        }
        if kept.is_empty() {
            return None;
        }
        let mut out = Tape {
            gates: tape.gates.clone(),
            len: tape.len,
            val: tape.val.clone(),
            sinks: tape.sinks.clone(),
            id: NEXT_TAPE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ..Tape::default()
        };
        let mut at_seed: BTreeMap<u32, &Found> = BTreeMap::new();
        let mut dropped = vec![false; n];
        for f in found.iter().filter(|f| number[f.shape] != u32::MAX) {
            for &m in &f.members {
                dropped[m as usize] = true;
            }
            at_seed.insert(f.members[0], f);
        }
        for (i, ins) in orig.iter().enumerate() {
            let i0 = out.inputs.len() as u32;
            let (code, lanes_in, val) = match at_seed.get(&(i as u32)) {
                Some(f) => {
                    out.inputs.push(f.entry);
                    let o0 = out.pool_outs.len() as u32;
                    out.pool_outs
                        .extend(f.exits.iter().map(|&e| orig[e as usize].out));
                    let code = Code::Pool {
                        shape: number[f.shape],
                        o0,
                        o1: out.pool_outs.len() as u32,
                    };
                    (code, false, orig[f.exits[0] as usize].out)
                }
                None if dropped[i] => continue,
                None => {
                    out.inputs.extend_from_slice(&inputs[i]);
                    (ins.code, lanes_in[i], ins.out)
                }
            };
            out.orig.push(Ins {
                code,
                out: val,
                i0,
                i1: out.inputs.len() as u32,
                lanes_in,
                ..ins.clone()
            });
        }
        out.producer = vec![u32::MAX; out.len];
        for (i, ins) in out.orig.iter().enumerate() {
            let outs = match ins.code {
                Code::Pool { o0, o1, .. } => &out.pool_outs[o0 as usize..o1 as usize],
                _ => std::slice::from_ref(&ins.out),
            };
            for v in outs {
                out.producer[v.at as usize] = i as u32;
            }
        }
        out.ins = out.orig.clone();
        out.fuse();
        Some(Pooled {
            tape: out,
            regions: kept,
            size: settings.size,
        })
    }

    /// Each instruction's inputs without those that are ancestors of another of its inputs
    /// (they never end later). An instruction whose output is per lane keeps its per-lane
    /// inputs unless it is a segment (a segment with no per-lane input starts every lane
    /// together; a collective's per-lane output needs per-lane inputs).
    fn reduced_inputs(&self, tape: &Tape) -> Vec<Vec<Val>> {
        (tape.orig.iter())
            .map(|ins| {
                let all = &tape.inputs[ins.i0 as usize..ins.i1 as usize];
                let mut keep: Vec<Val> = Vec::with_capacity(all.len());
                for (j, v) in all.iter().enumerate() {
                    let pv = tape.producer[v.at as usize];
                    let dominated = all.iter().enumerate().any(|(k, w)| {
                        if w.at == v.at {
                            return k < j;
                        }
                        let pw = tape.producer[w.at as usize];
                        pw != u32::MAX && tape.is_ancestor(pv, pw)
                    });
                    if !dominated {
                        keep.push(*v);
                    }
                }
                let per_lane = keep.iter().any(|v| v.lanes);
                if ins.lanes_in
                    && !per_lane
                    && ins.out.lanes
                    && !matches!(ins.code, Code::Seg { .. })
                {
                    return all.to_vec();
                }
                keep
            })
            .collect()
    }

    /// Region `members` of `orig` as a program of its own, with its exits.
    fn region_tape(
        &self,
        orig: &[Ins],
        inputs: &[Vec<Val>],
        members: &[u32],
        exits: &[u32],
    ) -> Region {
        let l = lanes(&self.layout);
        let mut t = Tape {
            len: 1,
            id: NEXT_TAPE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ..Tape::default()
        };
        let entry = Val {
            at: 0,
            lanes: false,
        };
        let mut local: BTreeMap<u32, Val> = BTreeMap::new();
        for &i in members {
            let ins = &orig[i as usize];
            let i0 = t.inputs.len() as u32;
            for v in &inputs[i as usize] {
                t.inputs.push(local.get(&v.at).copied().unwrap_or(entry));
            }
            let out = Val {
                at: t.len as u32,
                lanes: ins.out.lanes,
            };
            t.len += out.width(l);
            local.insert(ins.out.at, out);
            let code = match ins.code {
                // Members have no gates: none in this program's gate list either.
                Code::Seg {
                    m,
                    sd,
                    collapsible,
                    pk,
                    ..
                } => Code::Seg {
                    m,
                    sd,
                    collapsible,
                    pk,
                    g0: 0,
                    g1: 0,
                },
                other => other,
            };
            t.ins.push(Ins {
                code,
                out,
                i0,
                i1: t.inputs.len() as u32,
                lanes_in: inputs[i as usize].iter().any(|v| v.lanes),
                ..ins.clone()
            });
        }
        t.orig = t.ins.clone();
        Region {
            tape: t,
            exits: (exits.iter())
                .map(|e| local[&orig[*e as usize].out.at])
                .collect(),
            uses: 0,
        }
    }

    /// The pooled shapes of these statistics with their block durations in one sample's pools
    /// (regime `comm_factor`, stream `seed`); empty when nothing is pooled.
    pub fn pool_summary(
        &self,
        fast: &FastStats,
        comm_factor: f64,
        seed: u64,
    ) -> Result<Vec<PoolSummary>, SimError> {
        let Some(pooled) = &fast.pooled else {
            return Ok(Vec::new());
        };
        let mut draw = self.fast_draw(fast, &[], comm_factor, seed)?;
        let scale = Scale::new(comm_factor, &draw);
        let pools = self.fill_pools(pooled, &mut draw, scale);
        let l = lanes(&self.layout);
        Ok((pooled.regions.iter().zip(&pools))
            .map(|(region, pool)| {
                let w = row_width(&region.exits, l);
                let d: Vec<f64> = (pool.chunks_exact(w))
                    .map(|row| row.iter().copied().fold(0.0, mx) * 1e-12)
                    .collect();
                let k = d.len() as f64;
                let mean = d.iter().sum::<f64>() / k;
                let var = d.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (k - 1.0);
                let sd = var.sqrt();
                PoolSummary {
                    blocks_per_sample: region.uses,
                    instructions: region.tape.ins.len(),
                    mean_s: mean,
                    sd_s: sd,
                }
            })
            .collect())
    }

    /// The pools of one sample: `pooled.size` exact rows (the exits' ends) of each pooled
    /// shape, drawn with `draw` (fast, no per-GPU speeds) at communication regime `scale`.
    pub(super) fn fill_pools(
        &self,
        pooled: &Pooled,
        draw: &mut Draw,
        scale: Scale,
    ) -> Vec<Vec<f64>> {
        let l = lanes(&self.layout);
        (pooled.regions.iter().enumerate())
            .map(|(k, region)| {
                let mut work = Work::new(self, &region.tape);
                let mut pool = Vec::with_capacity(pooled.size * row_width(&region.exits, l));
                for i in 0..pooled.size {
                    self.replica(&region.tape, pool_stream(k, i), draw, scale, &mut work);
                    for v in &region.exits {
                        let at = v.at as usize;
                        pool.extend_from_slice(&work.vals[at..at + v.width(l)]);
                    }
                }
                pool
            })
            .collect()
    }
}

/// What makes two regions alike: every member's code, its output's kind and its inputs by
/// position in the region (0: the entry), and which members are exits.
fn shape_key(orig: &[Ins], inputs: &[Vec<Val>], members: &[u32], exits: &[u32]) -> Vec<u64> {
    let pos = |at: u32| members.iter().position(|&m| orig[m as usize].out.at == at);
    let mut key: Vec<u64> = exits
        .iter()
        .map(|&e| members.iter().position(|&m| m == e).unwrap_or(0) as u64)
        .collect();
    key.push(u64::MAX);
    for &i in members {
        let ins = &orig[i as usize];
        match ins.code {
            Code::Seg {
                m, sd, collapsible, ..
            } => key.extend([1, m.to_bits(), sd.to_bits(), collapsible as u64]),
            Code::Tp { d } => key.extend([2, d]),
            Code::Cp { d } => key.extend([3, d]),
            Code::Add { d } => key.extend([4, d]),
            Code::Run { .. } | Code::Pool { .. } => unreachable!("not poolable"),
        }
        key.push(ins.out.lanes as u64);
        key.push(inputs[i as usize].len() as u64);
        key.extend(inputs[i as usize].iter().map(|v| match pos(v.at) {
            Some(k) => ((k as u64 + 1) << 1) | v.lanes as u64,
            None => 0,
        }));
    }
    key
}
