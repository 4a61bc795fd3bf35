//! `prism geo plan`: ATLAS placement across datacenters, with temporal WAN sharing and several
//! TCP connections per transfer, against three baselines, every candidate simulated by the
//! engine.
//!
//! Designs (docs/geo.md defines them precisely):
//! - **ATLAS**: pipeline stages span DCs, DP and TP stay inside a DC. DCs are taken largest
//!   first (SAILOR's port of ATLAS's planner): each DC takes as many whole consecutive stages,
//!   each with all its DP replicas, as fit. Search over `pp`, `dp`, micro-batch and (optionally)
//!   the DC order; pipeline sends take turns on the WAN ([`WanSharing::Temporal`]) and a
//!   transfer uses the job's connections.
//! - **DP across DCs**: every pipeline inside one DC, data-parallel replicas spread over the
//!   DCs, so the gradient all-reduce crosses the WAN; fair sharing.
//! - **PP across DCs, fair sharing**: ATLAS's placement (largest-first DC order) with max-min
//!   fair sharing of the WAN.
//! - **One TCP connection per transfer**: ATLAS (largest-first DC order, temporal sharing) with
//!   `connections = 1` on every WAN link.

use prism_core::engine::{Mode, SimError, SimOptions, WanTransfer, simulate};
use prism_core::job::{Job, RankOrder, Recompute, Schedule};
use prism_core::memory;
use prism_core::wan::{Datacenter, Wan, WanSharing};
use rayon::prelude::*;

/// A design: how the job is placed over the datacenters and how the WAN is shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Design {
    /// ATLAS (with the switches of [`PlanOptions`]).
    Atlas,
    /// Baseline: data parallelism across DCs (gradient all-reduce over the WAN).
    DpAcrossDcs,
    /// Baseline: pipeline stages across DCs, WAN shared max-min fairly.
    PpFairSharing,
    /// Baseline: ATLAS with one TCP connection per transfer.
    OneConnection,
}

impl Design {
    /// Name in reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Design::Atlas => "atlas",
            Design::DpAcrossDcs => "dp-across-dcs",
            Design::PpFairSharing => "pp-across-dcs-fair",
            Design::OneConnection => "one-connection",
        }
    }
}

/// Switches and search bounds of `geo plan`.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// ATLAS shares WAN links in turns (off: fair sharing).
    pub temporal: bool,
    /// ATLAS splits a transfer over the job's `wan.connections` (off: one connection).
    pub multi_connection: bool,
    /// ATLAS searches the DC order (off: largest first only).
    pub dc_order_search: bool,
    /// Micro-batch sizes searched.
    pub micro_batches: Vec<u32>,
    /// Iterations of the training run (for the training time).
    pub iterations: u64,
    /// Simulate the baselines too.
    pub baselines: bool,
    /// Every design must use at least this many datacenters (the premise of geo-distributed
    /// training: one DC is not enough); clamped to the job's datacenter count.
    pub min_dcs: u32,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            temporal: true,
            multi_connection: true,
            dc_order_search: true,
            micro_batches: vec![1, 2, 4, 8],
            iterations: 10_000,
            baselines: true,
            min_dcs: 2,
        }
    }
}

/// Where a candidate puts the work.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// Pipeline stages.
    pub pp: u32,
    /// Data-parallel replicas.
    pub dp: u32,
    /// Sequences per micro-batch.
    pub micro_batch: u32,
    /// Datacenters used, in pipeline order (indices into the job's `wan.datacenters`).
    pub dcs: Vec<u32>,
    /// Pipeline stages (ATLAS) or pipelines (DP across DCs) in each used datacenter.
    pub per_dc: Vec<u32>,
    /// Full activation recomputation was needed to fit memory.
    pub recompute_full: bool,
}

/// A simulated candidate.
#[derive(Clone, Debug)]
pub struct Evaluated {
    /// Design.
    pub design: Design,
    /// Placement.
    pub placement: Placement,
    /// The job as simulated (its cluster holds only the GPUs used).
    pub job: Job,
    /// Iteration time, s.
    pub iteration_s: f64,
    /// Mean share of the iteration GPUs spend in the pipeline bubble.
    pub bubble_fraction: f64,
    /// MFU.
    pub mfu: f64,
    /// Bytes per iteration over each directed WAN link of the simulated job
    /// (`2 i`, `2 i + 1`: the two directions of its link `i`).
    pub wan_bytes: Vec<u64>,
    /// Capacity of each directed WAN link, bytes/s.
    pub wan_capacity: Vec<f64>,
    /// WAN transfers of the iteration.
    pub wan_transfers: Vec<WanTransfer>,
}

impl Evaluated {
    /// Mean utilisation of the directed WAN links that carry traffic: bytes / (capacity x
    /// iteration time). 0 when nothing crosses the WAN.
    pub fn wan_utilisation(&self) -> f64 {
        let used: Vec<f64> = self
            .wan_bytes
            .iter()
            .zip(&self.wan_capacity)
            .filter(|(b, _)| **b > 0)
            .map(|(&b, &c)| b as f64 / (c * self.iteration_s))
            .collect();
        if used.is_empty() {
            0.0
        } else {
            used.iter().sum::<f64>() / used.len() as f64
        }
    }

    /// GPUs used.
    pub fn gpus(&self) -> u64 {
        self.job.num_gpus()
    }
}

/// Result of `geo plan`.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The best ATLAS candidate.
    pub atlas: Evaluated,
    /// The best candidate of each baseline (those with a feasible placement).
    pub baselines: Vec<Evaluated>,
    /// Candidates simulated.
    pub simulated: usize,
    /// Options used.
    pub options: PlanOptions,
}

impl Plan {
    /// Iteration time of a baseline over ATLAS's.
    pub fn speedup_over(&self, design: Design) -> Option<f64> {
        self.baselines
            .iter()
            .find(|b| b.design == design)
            .map(|b| b.iteration_s / self.atlas.iteration_s)
    }
}

/// Why no plan could be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The job has no datacenters.
    #[error("the job has no `[wan]` datacenters; geo plan needs a multi-datacenter job")]
    SingleDc,
    /// Nothing fits.
    #[error("no ATLAS placement fits: {0}")]
    NoPlacement(String),
    /// An option breaks a rule; the message names it.
    #[error("{0}")]
    Invalid(String),
    /// The engine refused a candidate.
    #[error("simulation failed: {0}")]
    Sim(#[from] SimError),
}

fn divisors(n: u32) -> Vec<u32> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Layer split of `pp` stages: even, or Llama-style one layer fewer on the first and last
/// stage (for the embedding and LM head). `None` when neither works.
fn split(layers: u32, pp: u32) -> Option<Option<u32>> {
    if pp > layers {
        return None;
    }
    if layers.is_multiple_of(pp) {
        return Some(None);
    }
    if pp > 2 && (layers + 2).is_multiple_of(pp) && (layers + 2) / pp >= 2 {
        return Some(Some((layers + 2) / pp - 1));
    }
    None
}

/// The job's datacenters, largest first (ties: job order).
pub fn largest_first(wan: &Wan) -> Vec<u32> {
    let mut order: Vec<u32> = (0..wan.datacenters.len() as u32).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(wan.datacenters[i as usize].nodes));
    order
}

/// Every order of the datacenters (largest first comes first), at most `limit`.
fn orders(wan: &Wan, search: bool, limit: usize) -> Vec<Vec<u32>> {
    let first = largest_first(wan);
    if !search {
        return vec![first];
    }
    let mut out = vec![first.clone()];
    let mut perm = first.clone();
    perm.sort_unstable();
    loop {
        if perm != first {
            out.push(perm.clone());
        }
        if out.len() >= limit || !next_permutation(&mut perm) {
            break;
        }
    }
    out
}

fn next_permutation(v: &mut [u32]) -> bool {
    let Some(i) = (1..v.len()).rev().find(|&i| v[i - 1] < v[i]) else {
        return false;
    };
    let j = (i..v.len())
        .rev()
        .find(|&j| v[j] > v[i - 1])
        .expect("exists");
    v.swap(i - 1, j);
    v[i..].reverse();
    true
}

/// The WAN of the used datacenters `dcs` (in order) holding `nodes[k]` nodes each: the job's
/// links among them, renumbered. `None` when they are not connected among themselves.
fn sub_wan(
    wan: &Wan,
    dcs: &[u32],
    nodes: &[u32],
    sharing: WanSharing,
    one_conn: bool,
) -> Option<Wan> {
    if dcs.len() < 2 {
        return Some(Wan::default());
    }
    let pos = |d: u32| dcs.iter().position(|&x| x == d).map(|p| p as u32);
    let links = wan
        .links
        .iter()
        .filter_map(|l| {
            let (a, b) = (pos(l.a)?, pos(l.b)?);
            let mut l = l.clone();
            (l.a, l.b) = (a, b);
            if one_conn {
                l.connections = 1;
            }
            Some(l)
        })
        .collect();
    let w = Wan {
        datacenters: dcs
            .iter()
            .zip(nodes)
            .map(|(&d, &n)| Datacenter {
                name: wan.datacenters[d as usize].name.clone(),
                nodes: n,
            })
            .collect(),
        links,
        sharing,
    };
    w.validate(nodes.iter().sum()).ok().map(|_| w)
}

/// Applies memory: the job as is, or with full recomputation when it does not fit; `None` when
/// neither fits.
fn fit_memory(mut job: Job) -> Option<(Job, bool)> {
    let hbm = (job.cluster.gpu.hbm_gib * (1u64 << 30) as f64) as u64;
    let fits = |j: &Job| (0..j.parallel.pp).all(|s| memory::stage_memory(j, s).total() <= hbm);
    if job.validate().is_ok() && fits(&job) {
        return Some((job, false));
    }
    if job.parallel.recompute != Recompute::Full {
        job.parallel.recompute = Recompute::Full;
        if job.validate().is_ok() && fits(&job) {
            return Some((job, true));
        }
    }
    None
}

fn base_parallel(job: &mut Job, pp: u32, dp: u32, mb: u32, layers: Option<u32>, order: RankOrder) {
    let p = &mut job.parallel;
    p.pp = pp;
    p.dp = dp;
    p.micro_batch = mb;
    p.vpp = 1;
    p.pipeline_layout = None;
    p.first_stage_layers = layers;
    p.last_stage_layers = layers;
    p.order = order;
    // One model chunk per rank: the interleaved schedule, and the combined 1F1B with pipeline
    // stages (which needs several chunks), become plain 1F1B.
    if p.schedule == Schedule::Interleaved || (p.schedule == Schedule::OneFOneBOverlap && pp > 1) {
        p.schedule = Schedule::OneFOneB;
    }
    // Experts stay inside the data-parallel group as given (ep must divide dp).
    if !dp.is_multiple_of(p.ep) {
        p.ep = 1;
    }
}

/// ATLAS placement: `pp` stages of `dp` replicas over the DCs in `order`, each DC taking as
/// many whole stages as fit.
pub fn pp_across(
    job: &Job,
    pp: u32,
    dp: u32,
    mb: u32,
    order: &[u32],
    sharing: WanSharing,
    one_conn: bool,
) -> Option<(Job, Placement)> {
    place(job, pp, dp, mb, order, Spread::Stages, sharing, one_conn)
}

/// What a placement spreads over the DCs.
#[derive(Clone, Copy)]
enum Spread {
    /// `pp` pipeline stages of `dp` replicas each (PP across DCs; ranks DP-major inside a
    /// stage).
    Stages,
    /// `dp` whole pipelines of `pp` stages each (DP across DCs; ranks PP-major inside a
    /// pipeline).
    Pipelines,
}

/// Places the units `spread` names over the DCs in `order` (each DC taking as many whole
/// units as fit) and derives the job: its nodes, the WAN of the DCs used, the parallel
/// settings and, where needed to fit memory, full recompute.
#[allow(clippy::too_many_arguments)]
fn place(
    job: &Job,
    pp: u32,
    dp: u32,
    mb: u32,
    order: &[u32],
    spread: Spread,
    sharing: WanSharing,
    one_conn: bool,
) -> Option<(Job, Placement)> {
    let layers = split(job.model.layers, pp)?;
    let wan = &job.cluster.topology.wan;
    let (unit, count, rank_order) = match spread {
        Spread::Stages => (dp, pp, RankOrder::TpCpEpDpPp),
        Spread::Pipelines => (pp, dp, RankOrder::TpCpEpPpDp),
    };
    let unit_nodes = unit_nodes(job, unit as u64, dp, mb)?;
    let (dcs, per_dc, nodes) = fill_dcs(wan, order, unit_nodes, count)?;
    let mut j = job.clone();
    j.cluster.nodes = count * unit_nodes;
    j.cluster.topology.wan = sub_wan(wan, &dcs, &nodes, sharing, one_conn)?;
    base_parallel(&mut j, pp, dp, mb, layers, rank_order);
    let (j, recompute_full) = fit_memory(j)?;
    Some((
        j,
        Placement {
            pp,
            dp,
            micro_batch: mb,
            dcs,
            per_dc,
            recompute_full,
        },
    ))
}

/// Nodes of one placement unit of `tp x cp x count` GPUs (a pipeline stage of `count = dp`
/// replicas, or a whole pipeline of `count = pp` stages), or `None` when the unit does not fill
/// whole nodes or the global batch does not split into `dp` replicas of `mb`-sequence
/// micro-batches.
fn unit_nodes(job: &Job, count: u64, dp: u32, mb: u32) -> Option<u32> {
    let gpn = job.cluster.gpus_per_node as u64;
    let gpus = job.parallel.tp as u64 * job.parallel.cp as u64 * count;
    (gpus.is_multiple_of(gpn)
        && (job.training.global_batch as u64).is_multiple_of(dp as u64 * mb as u64))
    .then_some((gpus / gpn) as u32)
}

/// Places `count` units of `unit_nodes` nodes each on the DCs in `order`, each DC taking as
/// many as fit: the DCs used, units per DC and nodes per DC, or `None` when they do not all fit.
fn fill_dcs(
    wan: &Wan,
    order: &[u32],
    unit_nodes: u32,
    count: u32,
) -> Option<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let mut left = count;
    let (mut dcs, mut per_dc, mut nodes) = (Vec::new(), Vec::new(), Vec::new());
    for &d in order {
        if left == 0 {
            break;
        }
        let k = (wan.datacenters[d as usize].nodes / unit_nodes).min(left);
        if k > 0 {
            dcs.push(d);
            per_dc.push(k);
            nodes.push(k * unit_nodes);
            left -= k;
        }
    }
    (left == 0).then_some((dcs, per_dc, nodes))
}

/// DP-across-DCs placement: whole pipelines of `pp` stages inside a DC, `dp` of them spread
/// over the DCs in `order` (each taking as many as fit), fair-shared WAN with the job's
/// connections.
pub fn dp_across(job: &Job, pp: u32, dp: u32, mb: u32, order: &[u32]) -> Option<(Job, Placement)> {
    place(
        job,
        pp,
        dp,
        mb,
        order,
        Spread::Pipelines,
        WanSharing::Fair,
        false,
    )
}

/// Simulates one candidate (one representative per stage: exact for these symmetric
/// placements).
pub fn evaluate(design: Design, job: Job, placement: Placement) -> Result<Evaluated, SimError> {
    let r = simulate(
        &job,
        &SimOptions {
            mode: Mode::Reduced,
            ..Default::default()
        },
    )?;
    let w = &job.cluster.topology.wan;
    let mut wan_bytes = vec![0u64; 2 * w.links.len()];
    for t in &r.wan {
        wan_bytes[t.link as usize] += t.bytes;
    }
    let wan_capacity = w
        .links
        .iter()
        .flat_map(|l| [l.bytes_per_s() as f64; 2])
        .collect();
    Ok(Evaluated {
        design,
        placement,
        iteration_s: r.summary.iteration_time_s,
        bubble_fraction: r.summary.bubble_fraction,
        mfu: r.summary.mfu,
        wan_bytes,
        wan_capacity,
        wan_transfers: r.wan,
        job,
    })
}

/// The data-parallel degrees worth trying for a stage (or pipeline) of `unit` GPUs per
/// replica over `gpus` GPUs: the `keep` largest that divide the batch and fill whole nodes.
fn dp_candidates(job: &Job, unit: u64, gpus: u64, mb: u32, keep: usize) -> Vec<u32> {
    let per = job.training.global_batch / mb.max(1);
    let gpn = job.cluster.gpus_per_node as u64;
    let mut v: Vec<u32> = divisors(per)
        .into_iter()
        .filter(|&dp| dp as u64 * unit <= gpus)
        .filter(|&dp| (dp as u64 * unit).is_multiple_of(gpn) || unit.is_multiple_of(gpn))
        .collect();
    v.reverse();
    v.truncate(keep);
    v
}

/// Pipeline depths searched: up to 64 stages, splitting the layers evenly or (Llama-style) with
/// one layer fewer on the first and last stage, at least 2 layers per stage.
fn pp_candidates(job: &Job) -> Vec<u32> {
    let l = job.model.layers;
    (2..=l.min(64))
        .filter(|&pp| split(l, pp).is_some() && l / pp >= 2)
        .collect()
}

/// GPUs of one data-parallel replica's unit (a stage or a pipeline) for a given `pp`.
type Unit<'a> = dyn Fn(u32) -> u64 + Sync + 'a;

type Build<'a> = dyn Fn(u32, u32, u32, &[u32]) -> Option<(Job, Placement)> + Sync + 'a;

/// Two-phase search: every `pp` (and DC order) at the largest feasible `dp` and micro-batch 1;
/// then the three best `pp` with every micro-batch and the two largest feasible `dp`. Returns
/// the fastest and the number simulated.
#[allow(clippy::too_many_arguments)]
fn search(
    job: &Job,
    design: Design,
    orders: &[Vec<u32>],
    micro_batches: &[u32],
    unit_of_pp: &Unit<'_>,
    pp_per_dp: bool,
    build: &Build<'_>,
    min_dcs: usize,
) -> Result<(Option<Evaluated>, usize), SimError> {
    let gpus = job.num_gpus();
    // unit: GPUs per dp replica for a given pp (a stage for ATLAS, a pipeline for DP-across).
    let first_round = |pp: u32, order: &Vec<u32>, mb: u32, keep: usize| {
        let unit = unit_of_pp(pp);
        let budget = if pp_per_dp { gpus } else { gpus / pp as u64 };
        dp_candidates(job, unit, budget, mb, 64)
            .into_iter()
            .filter_map(|dp| build(pp, dp, mb, order))
            .filter(|(_, p)| p.dcs.len() >= min_dcs)
            .take(keep)
            .collect::<Vec<_>>()
    };
    let mut cands: Vec<(Job, Placement)> = Vec::new();
    for order in orders {
        for pp in pp_candidates(job) {
            cands.extend(first_round(pp, order, micro_batches[0], 1));
        }
    }
    dedup(&mut cands);
    let mut simulated = cands.len();
    let mut results = run_all(design, cands)?;
    results.sort_by(|a, b| a.iteration_s.total_cmp(&b.iteration_s));
    let mut best_pp: Vec<(u32, Vec<u32>)> = Vec::new();
    for r in &results {
        let key = (r.placement.pp, order_of(r, orders));
        if !best_pp.contains(&key) {
            best_pp.push(key);
        }
        if best_pp.len() == 3 {
            break;
        }
    }
    let mut second: Vec<(Job, Placement)> = Vec::new();
    for (pp, order) in &best_pp {
        for &mb in micro_batches {
            for c in first_round(*pp, order, mb, 2) {
                if !results.iter().any(|r| r.placement == c.1) {
                    second.push(c);
                }
            }
        }
    }
    dedup(&mut second);
    simulated += second.len();
    results.extend(run_all(design, second)?);
    let best = results
        .into_iter()
        .min_by(|a, b| a.iteration_s.total_cmp(&b.iteration_s));
    Ok((best, simulated))
}

fn order_of(r: &Evaluated, orders: &[Vec<u32>]) -> Vec<u32> {
    orders
        .iter()
        .find(|o| {
            let used: Vec<u32> = o
                .iter()
                .copied()
                .filter(|d| r.placement.dcs.contains(d))
                .collect();
            used == r.placement.dcs
        })
        .cloned()
        .unwrap_or_default()
}

fn dedup(c: &mut Vec<(Job, Placement)>) {
    let mut seen: Vec<Placement> = Vec::new();
    c.retain(|(_, p)| {
        if seen.contains(p) {
            false
        } else {
            seen.push(p.clone());
            true
        }
    });
}

fn run_all(design: Design, cands: Vec<(Job, Placement)>) -> Result<Vec<Evaluated>, SimError> {
    let out: Vec<Result<Evaluated, SimError>> = cands
        .into_par_iter()
        .map(|(j, p)| evaluate(design, j, p))
        .collect();
    // Candidates the reduced run cannot take (an asymmetric placement) are skipped.
    let mut ok = Vec::new();
    for r in out {
        match r {
            Ok(e) => ok.push(e),
            Err(SimError::Asymmetric(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ok)
}

/// Plans `job` (a multi-DC job: `[wan]` with at least two datacenters) across its datacenters.
pub fn plan(job: &Job, opts: &PlanOptions) -> Result<Plan, PlanError> {
    let wan = &job.cluster.topology.wan;
    if !wan.is_multi() {
        return Err(PlanError::SingleDc);
    }
    let mbs: Vec<u32> = if opts.micro_batches.is_empty() {
        vec![1]
    } else {
        opts.micro_batches.clone()
    };
    let (tp, cp) = (job.parallel.tp as u64, job.parallel.cp as u64);
    let all_orders = orders(wan, opts.dc_order_search, 24);
    if opts.min_dcs as usize > wan.datacenters.len() {
        return Err(PlanError::Invalid(format!(
            "--min-dcs {}: the job has {} datacenters in [wan]; a design cannot use more",
            opts.min_dcs,
            wan.datacenters.len()
        )));
    }
    let min_dcs = (opts.min_dcs.max(1) as usize).min(wan.datacenters.len());
    let first = vec![largest_first(wan)];
    let sharing = if opts.temporal {
        WanSharing::Temporal
    } else {
        WanSharing::Fair
    };
    let one_conn = !opts.multi_connection;
    let stage_unit = move |_pp: u32| tp * cp;
    let pipe_unit = move |pp: u32| tp * cp * pp as u64;
    let atlas_build = move |pp, dp, mb, o: &[u32]| pp_across(job, pp, dp, mb, o, sharing, one_conn);
    let (atlas, mut simulated) = search(
        job,
        Design::Atlas,
        &all_orders,
        &mbs,
        &stage_unit,
        false,
        &atlas_build,
        min_dcs,
    )?;
    let Some(atlas) = atlas else {
        return Err(PlanError::NoPlacement(format!(
            "no pipeline of whole stages (tp {tp} x cp {cp} x dp GPUs each) over at least \
             {min_dcs} datacenters fits their nodes and the GPU memory for any pp that splits \
             {} layers",
            job.model.layers
        )));
    };
    let mut baselines = Vec::new();
    if opts.baselines {
        let dp_build = move |pp, dp, mb, o: &[u32]| dp_across(job, pp, dp, mb, o);
        let fair_build =
            move |pp, dp, mb, o: &[u32]| pp_across(job, pp, dp, mb, o, WanSharing::Fair, false);
        let one_build =
            move |pp, dp, mb, o: &[u32]| pp_across(job, pp, dp, mb, o, WanSharing::Temporal, true);
        let specs: [(Design, &Unit<'_>, bool, &Build<'_>); 3] = [
            (Design::DpAcrossDcs, &pipe_unit, true, &dp_build),
            (Design::PpFairSharing, &stage_unit, false, &fair_build),
            (Design::OneConnection, &stage_unit, false, &one_build),
        ];
        for (design, unit, per_dp, build) in specs {
            let (b, n) = search(job, design, &first, &mbs, unit, per_dp, build, min_dcs)?;
            simulated += n;
            baselines.extend(b);
        }
    }
    Ok(Plan {
        atlas,
        baselines,
        simulated,
        options: opts.clone(),
    })
}
