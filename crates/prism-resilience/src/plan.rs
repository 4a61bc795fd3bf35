//! Adapting the parallel plan to slow and failed devices (ResiHP's scheduler), its baselines
//! and an oracle, every candidate evaluated on the engine (`prism_core::hetero`).
//!
//! The job starts as `replicas x stages` tensor-parallel groups of `tp` devices (one node
//! each), `layers` decoder layers split evenly, `micro_batches` micro-batches per iteration
//! split evenly over the replicas. A [`Fleet`] holds every device's speed and failure. A
//! [`Plan`] says, per replica, which devices of which node form each stage, how many layers
//! each stage holds, and how many micro-batches the replica runs (or that it is dropped).
//!
//! ResiHP's three mechanisms ([`Strategy::Resihp`] chooses among their combinations):
//! - **TP resize** ([`tp_resize`]): among a group's live devices, the `k`-subgroup of the
//!   fastest devices maximising `k x min speed` over degrees `k = 2^q` dividing the heads,
//!   memory-feasible; ties keep the larger group.
//! - **PP repartition** ([`repartition`]): each stage's target is
//!   `floor(L_old x c_new / c_old)` with capacity `c = TP degree x slowest speed`; every spare
//!   layer goes to the stage minimising `(layers + 1) / c` (lowest index on ties), skipping
//!   stages whose memory would overflow. A middle stage whose TP halves turns (4,4,4) into
//!   (5,2,5).
//! - **DP re-routing** ([`reroute`]): one micro-batch at a time from the replica that finishes
//!   last to the one that would finish first with it, while the iteration shortens.
//!
//! The candidates (each mechanism on or off, and dropping the degraded replicas) are scored by
//! the engine's throughput over the planning horizon after paying the reconfiguration cost
//! (restart plus state movement, [`prism_core::hetero::ReconfigCost`]).

use std::collections::BTreeMap;

use prism_core::hetero::{
    Device, HeteroPipeline, LayerCost, MicroBatch, ReconfigCost, Replica, Stage, backward_s,
    forward_s, simulate_hetero,
};
use prism_core::job::{Cluster, Schedule};

/// Fixed description of the job being adapted.
#[derive(Clone, Debug, PartialEq)]
pub struct Setup {
    /// Cluster (GPU, NVLink, NIC).
    pub cluster: Cluster,
    /// Per-layer costs.
    pub cost: LayerCost,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Data-parallel replicas.
    pub replicas: u32,
    /// Pipeline stages per replica.
    pub stages: u32,
    /// Tensor-parallel degree of each healthy stage (its node's devices; stages may differ).
    pub stage_tp: Vec<u32>,
    /// Layers of each stage in the healthy plan.
    pub stage_layers: Vec<u32>,
    /// Decoder layers.
    pub layers: u32,
    /// Attention heads (TP degrees must divide them).
    pub heads: u32,
    /// Micro-batches per iteration (all replicas).
    pub micro_batches: u32,
    /// The planning micro-batch (mean packed composition).
    pub micro_batch: MicroBatch,
    /// Usable device memory, bytes.
    pub hbm_bytes: f64,
    /// Activation bytes per token per layer held for backward (before TP sharding).
    pub act_bytes_per_token_layer: f64,
    /// Reconfiguration cost.
    pub reconfig: ReconfigCost,
    /// Checkpoint interval, seconds (checkpoint-restart loses half of it on average).
    pub checkpoint_interval_s: f64,
}

impl Setup {
    /// Global id of member `i` of node `n` of replica `r` (devices numbered replica by
    /// replica, node by node).
    pub fn device_id(&self, r: u32, n: u32, i: u32) -> u32 {
        let per_replica: u32 = self.stage_tp.iter().sum();
        r * per_replica + self.stage_tp[..n as usize].iter().sum::<u32>() + i
    }

    /// Devices in the job.
    pub fn devices(&self) -> u32 {
        self.replicas * self.stage_tp.iter().sum::<u32>()
    }
}

/// Every device's state, `[replica][stage node][member]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fleet {
    /// Devices.
    pub devices: Vec<Vec<Vec<Device>>>,
}

impl Fleet {
    /// All healthy.
    pub fn healthy(s: &Setup) -> Self {
        Fleet {
            devices: (0..s.replicas)
                .map(|r| {
                    (0..s.stages)
                        .map(|n| {
                            (0..s.stage_tp[n as usize])
                                .map(|i| Device::healthy(s.device_id(r, n, i)))
                                .collect()
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// The device with global id `id`.
    pub fn device_mut(&mut self, id: u32) -> Option<&mut Device> {
        self.devices
            .iter_mut()
            .flat_map(|r| r.iter_mut())
            .flat_map(|n| n.iter_mut())
            .find(|d| d.id == id)
    }

    /// True when some device of replica `r` is slow (speed below 1) or failed.
    pub fn degraded(&self, r: usize) -> bool {
        self.devices[r]
            .iter()
            .flatten()
            .any(|d| d.failed || d.speed < 1.0)
    }
}

/// A stage of a plan: members of one node and a layer count.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StagePlan {
    /// Node (original stage index) of the replica.
    pub node: u32,
    /// Member indices on the node.
    pub members: Vec<u32>,
    /// Layers.
    pub layers: u32,
}

/// A replica of a plan.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReplicaPlan {
    /// Stages in pipeline order (layers contiguous in this order).
    pub stages: Vec<StagePlan>,
    /// Micro-batches per iteration.
    pub micro_batches: u32,
}

/// A parallel plan: per replica, `None` when dropped.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Plan {
    /// Replicas.
    pub replicas: Vec<Option<ReplicaPlan>>,
}

/// `n` items split as evenly as possible over `parts` (the first ones get the remainder).
pub fn even_split(n: u32, parts: u32) -> Vec<u32> {
    (0..parts)
        .map(|i| n / parts + u32::from(i < n % parts))
        .collect()
}

impl Plan {
    /// The healthy plan: even layers, even micro-batches, full TP groups.
    pub fn initial(s: &Setup) -> Self {
        let layers = &s.stage_layers;
        let mbs = even_split(s.micro_batches, s.replicas);
        Plan {
            replicas: (0..s.replicas as usize)
                .map(|r| {
                    Some(ReplicaPlan {
                        stages: (0..s.stages)
                            .map(|n| StagePlan {
                                node: n,
                                members: (0..s.stage_tp[n as usize]).collect(),
                                layers: layers[n as usize],
                            })
                            .collect(),
                        micro_batches: mbs[r],
                    })
                })
                .collect(),
        }
    }
}

fn stage_of(rp: &StagePlan, fleet: &Fleet, r: usize) -> Stage {
    Stage {
        layers: rp.layers,
        devices: (rp.members.iter())
            .map(|&i| fleet.devices[r][rp.node as usize][i as usize])
            .collect(),
    }
}

/// Peak memory of a stage's device: state of its layers over its TP degree plus the
/// activations of the micro-batches in flight (1F1B: `stages - position`; GPipe: all).
pub fn stage_memory(s: &Setup, layers: u32, tp: u32, position: usize, depth: usize, m: u32) -> f64 {
    let in_flight = match s.schedule {
        Schedule::GPipe => m as f64,
        _ => ((depth - position) as f64).min(m as f64),
    };
    layers as f64
        * (s.cost.state_bytes_per_layer as f64
            + in_flight * s.micro_batch.tokens as f64 * s.act_bytes_per_token_layer)
        / tp.max(1) as f64
}

/// True when every stage of the plan fits in device memory.
pub fn memory_ok(plan: &Plan, s: &Setup) -> bool {
    plan.replicas.iter().flatten().all(|rp| {
        (rp.stages.iter().enumerate()).all(|(i, st)| {
            stage_memory(
                s,
                st.layers,
                st.members.len() as u32,
                i,
                rp.stages.len(),
                rp.micro_batches,
            ) <= s.hbm_bytes
        })
    })
}

/// The engine pipeline of `plan` on `fleet` (dropped replicas and replicas without
/// micro-batches take no part).
pub fn pipeline(plan: &Plan, fleet: &Fleet, s: &Setup) -> HeteroPipeline {
    HeteroPipeline {
        replicas: (plan.replicas.iter().enumerate())
            .filter_map(|(r, rp)| rp.as_ref().map(|rp| (r, rp)))
            .filter(|(_, rp)| rp.micro_batches > 0)
            .map(|(r, rp)| Replica {
                stages: rp.stages.iter().map(|st| stage_of(st, fleet, r)).collect(),
                micro_batches: vec![s.micro_batch; rp.micro_batches as usize],
            })
            .collect(),
        schedule: s.schedule,
        cost: s.cost,
    }
}

/// Iteration time of `plan` on the engine, seconds; `None` when it cannot run (a failed
/// device in use, memory overflow, no micro-batch placed).
pub fn iteration_s(plan: &Plan, fleet: &Fleet, s: &Setup) -> Option<f64> {
    let total: u32 = plan
        .replicas
        .iter()
        .flatten()
        .map(|r| r.micro_batches)
        .sum();
    if total != s.micro_batches || !memory_ok(plan, s) {
        return None;
    }
    simulate_hetero(&pipeline(plan, fleet, s), &s.cluster, false)
        .ok()
        .map(|r| r.iteration_s)
}

/// Tokens per second of `plan`; 0 when it cannot run.
pub fn throughput(plan: &Plan, fleet: &Fleet, s: &Setup) -> f64 {
    iteration_s(plan, fleet, s)
        .map(|t| s.micro_batches as f64 * s.micro_batch.tokens as f64 / t)
        .unwrap_or(0.0)
}

/// Seconds to go from `old` to `new`: the restart plus the state every device must receive
/// (layers it did not hold, or all its layers when its TP degree changed), the busiest
/// receiver setting the pace; 0 when only micro-batch counts change.
pub fn reconfig_s(old: &Plan, new: &Plan, s: &Setup) -> f64 {
    // Per device (replica, node, member): (layer range, TP degree).
    let holdings = |p: &Plan| {
        let mut m: BTreeMap<(usize, u32, u32), (u32, u32, u32)> = BTreeMap::new();
        for (r, rp) in p.replicas.iter().enumerate() {
            let Some(rp) = rp else { continue };
            let mut lo = 0;
            for st in &rp.stages {
                for &i in &st.members {
                    m.insert(
                        (r, st.node, i),
                        (lo, lo + st.layers, st.members.len() as u32),
                    );
                }
                lo += st.layers;
            }
        }
        m
    };
    let (ho, hn) = (holdings(old), holdings(new));
    let mut bytes = Vec::new();
    let mut changed = false;
    for (dev, &(lo, hi, k)) in &hn {
        let per_layer = s.cost.state_bytes_per_layer / k.max(1) as u64;
        let need = match ho.get(dev) {
            Some(&(olo, ohi, ok)) if ok == k => {
                let overlap = hi.min(ohi).saturating_sub(lo.max(olo));
                if (olo, ohi) != (lo, hi) {
                    changed = true;
                }
                (hi - lo - overlap) as u64 * per_layer
            }
            _ => {
                changed = true;
                (hi - lo) as u64 * per_layer
            }
        };
        bytes.push(need);
    }
    changed |= ho.keys().any(|d| !hn.contains_key(d));
    if !changed {
        return 0.0;
    }
    if bytes.iter().all(|&b| b == 0) {
        // Regrouping without moving state still restarts the job.
        return s.reconfig.restart_s;
    }
    s.reconfig.seconds(&bytes, &s.cluster)
}

/// ResiHP's TP choice for a group (module docs): the member indices of the best subgroup, or
/// `None` when no degree fits (`fits(k)` says whether a degree fits in memory).
pub fn tp_resize(devices: &[Device], heads: u32, fits: impl Fn(u32) -> bool) -> Option<Vec<u32>> {
    let mut live: Vec<(u32, f64)> = (devices.iter().enumerate())
        .filter(|(_, d)| !d.failed)
        .map(|(i, d)| (i as u32, d.speed))
        .collect();
    // Fastest first (stable: lower index first on equal speed).
    live.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut best: Option<(f64, u32)> = None;
    let mut k = 1u32;
    while k as usize <= live.len() {
        if heads.is_multiple_of(k) && fits(k) {
            let score = k as f64 * live[k as usize - 1].1;
            if best.is_none_or(|(b, _)| score >= b * (1.0 - 1e-12)) {
                best = Some((score, k));
            }
        }
        k *= 2;
    }
    let (_, k) = best?;
    let mut m: Vec<u32> = live[..k as usize].iter().map(|x| x.0).collect();
    m.sort_unstable();
    Some(m)
}

/// ResiHP's layer repartition (module docs): `old` layers per stage, capacities before and
/// after, and the largest layer count each stage may hold (memory).
pub fn repartition(old: &[u32], cap_old: &[f64], cap_new: &[f64], max_layers: &[u32]) -> Vec<u32> {
    let total: u32 = old.iter().sum();
    let mut new: Vec<u32> = (0..old.len())
        .map(|i| {
            ((old[i] as f64 * cap_new[i] / cap_old[i]).floor() as u32)
                .min(max_layers[i])
                .max(u32::from(cap_new[i] > 0.0))
        })
        .collect();
    let mut assigned: u32 = new.iter().sum();
    while assigned > total {
        // Too many (minimum one layer per stage): take from the most loaded.
        let i = (0..new.len())
            .filter(|&i| new[i] > 1)
            .max_by(|&a, &b| (new[a] as f64 / cap_new[a]).total_cmp(&(new[b] as f64 / cap_new[b])))
            .expect("a stage with spare layers");
        new[i] -= 1;
        assigned -= 1;
    }
    while assigned < total {
        let pick = (0..new.len())
            .filter(|&i| new[i] < max_layers[i] && cap_new[i] > 0.0)
            .min_by(|&a, &b| {
                ((new[a] + 1) as f64 / cap_new[a]).total_cmp(&((new[b] + 1) as f64 / cap_new[b]))
            });
        let Some(i) = pick else { break };
        new[i] += 1;
        assigned += 1;
    }
    new
}

/// Layers a stage at `position` of `depth` with `tp` devices can hold in memory.
fn max_layers(s: &Setup, tp: u32, position: usize, depth: usize, m: u32) -> u32 {
    let per = stage_memory(s, 1, tp, position, depth, m);
    (s.hbm_bytes / per).floor().min(s.layers as f64) as u32
}

/// Per-micro-batch time of a stage (forward + backward) in a plan.
fn stage_time(st: &StagePlan, fleet: &Fleet, r: usize, s: &Setup) -> f64 {
    let stage = stage_of(st, fleet, r);
    forward_s(&stage, &s.micro_batch, &s.cost, &s.cluster)
        + backward_s(&stage, &s.micro_batch, &s.cost, &s.cluster)
}

/// A replica's shape (per stage: layers and member speed bits) and micro-batch count.
type ClockKey = (Vec<(u32, Vec<u64>)>, u32);

/// Engine time of one replica running `m` micro-batches (cached by replica shape).
#[derive(Debug, Default)]
pub struct ReplicaClock {
    cache: BTreeMap<ClockKey, f64>,
}

impl ReplicaClock {
    /// Pipeline time of replica `r` of `rp` with `m` micro-batches (0 when `m` is 0).
    pub fn time(&mut self, rp: &ReplicaPlan, fleet: &Fleet, r: usize, m: u32, s: &Setup) -> f64 {
        if m == 0 {
            return 0.0;
        }
        let key = (
            (rp.stages.iter())
                .map(|st| {
                    let d = stage_of(st, fleet, r);
                    (
                        st.layers,
                        d.devices
                            .iter()
                            .map(|d| d.speed.to_bits() | u64::from(d.failed))
                            .collect(),
                    )
                })
                .collect(),
            m,
        );
        if let Some(&t) = self.cache.get(&key) {
            return t;
        }
        let p = HeteroPipeline {
            replicas: vec![Replica {
                stages: rp.stages.iter().map(|st| stage_of(st, fleet, r)).collect(),
                micro_batches: vec![s.micro_batch; m as usize],
            }],
            schedule: s.schedule,
            cost: s.cost,
        };
        let t = simulate_hetero(&p, &s.cluster, false)
            .map(|x| x.iteration_s - x.dp_sync_s)
            .unwrap_or(f64::INFINITY);
        self.cache.insert(key, t);
        t
    }
}

/// ResiHP's micro-batch re-routing (module docs), on the engine's per-replica times.
pub fn reroute(plan: &mut Plan, fleet: &Fleet, s: &Setup, clock: &mut ReplicaClock) {
    let live: Vec<usize> = (0..plan.replicas.len())
        .filter(|&r| plan.replicas[r].is_some())
        .collect();
    if live.len() < 2 {
        return;
    }
    let t = |plan: &Plan, r: usize, m: u32, clock: &mut ReplicaClock| {
        clock.time(plan.replicas[r].as_ref().expect("live"), fleet, r, m, s)
    };
    let cap = 2 * s.micro_batches.div_ceil(s.replicas);
    loop {
        let times: Vec<f64> = (live.iter())
            .map(|&r| {
                t(
                    plan,
                    r,
                    plan.replicas[r].as_ref().expect("live").micro_batches,
                    clock,
                )
            })
            .collect();
        let (hi_i, &hi_t) = (times.iter().enumerate())
            .max_by(|a, b| a.1.total_cmp(b.1))
            .expect("replicas");
        let from = live[hi_i];
        let m_from = plan.replicas[from].as_ref().expect("live").micro_batches;
        if m_from == 0 {
            break;
        }
        let best = (live.iter())
            .filter(|&&r| r != from)
            .map(|&r| {
                let m = plan.replicas[r].as_ref().expect("live").micro_batches;
                (
                    r,
                    if m + 1 > cap {
                        f64::INFINITY
                    } else {
                        t(plan, r, m + 1, clock)
                    },
                )
            })
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((to, to_t)) = best else { break };
        let new_from = t(plan, from, m_from - 1, clock);
        if to_t.max(new_from) >= hi_t * (1.0 - 1e-9) {
            break;
        }
        plan.replicas[from].as_mut().expect("live").micro_batches -= 1;
        plan.replicas[to].as_mut().expect("live").micro_batches += 1;
    }
}

/// Every adaptation policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Strategy {
    /// ResiHP: TP resize, PP repartition and DP re-routing chosen jointly on the engine.
    Resihp,
    /// Restart from the last checkpoint on the healthy replicas (fail-slow ignored).
    CheckpointRestart,
    /// Oobleck-style: a replica that lost a node runs a pipeline template on its remaining
    /// nodes (layers even), micro-batches by pipeline throughput (fail-slow ignored).
    Oobleck,
    /// ReCycle-style: micro-batches re-routed between replicas only (a replica with a failed
    /// device is idle).
    Recycle,
    /// TP resize only (memory-feasible with the layers in place).
    TpOnly,
    /// Layer repartition only (a failed device's node is left out).
    PpOnly,
    /// Exhaustive search on the engine (the best plan found).
    Oracle,
}

impl Strategy {
    /// Every strategy, ResiHP first.
    pub const ALL: [Strategy; 7] = [
        Strategy::Resihp,
        Strategy::CheckpointRestart,
        Strategy::Oobleck,
        Strategy::Recycle,
        Strategy::TpOnly,
        Strategy::PpOnly,
        Strategy::Oracle,
    ];

    /// Name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Resihp => "resihp",
            Strategy::CheckpointRestart => "checkpoint-restart",
            Strategy::Oobleck => "oobleck",
            Strategy::Recycle => "recycle",
            Strategy::TpOnly => "tp-only",
            Strategy::PpOnly => "pp-only",
            Strategy::Oracle => "oracle",
        }
    }
}

/// A chosen plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The plan.
    pub plan: Plan,
    /// Tokens per second on the engine (0: cannot run).
    pub tokens_per_s: f64,
    /// Pause before it runs: reconfiguration, or restart plus lost progress, seconds.
    pub pause_s: f64,
}

fn decision(plan: Plan, prev: &Plan, fleet: &Fleet, s: &Setup) -> Decision {
    let tokens_per_s = throughput(&plan, fleet, s);
    let pause_s = reconfig_s(prev, &plan, s);
    Decision {
        plan,
        tokens_per_s,
        pause_s,
    }
}

/// Tokens over `horizon_s` seconds (pause first).
pub fn horizon_tokens(d: &Decision, horizon_s: f64) -> f64 {
    d.tokens_per_s * (horizon_s - d.pause_s).max(0.0)
}

/// Applies TP resize to every degraded group of `plan` (memory-feasible with the group's
/// current layers when `layers_fixed`, else with the layers it could hold after moving).
fn with_tp_resize(plan: &Plan, fleet: &Fleet, s: &Setup, layers_fixed: bool) -> Plan {
    let mut p = plan.clone();
    for (r, rp) in p.replicas.iter_mut().enumerate() {
        let Some(rp) = rp else { continue };
        let depth = rp.stages.len();
        let m = rp.micro_batches;
        for (i, st) in rp.stages.iter_mut().enumerate() {
            let devs = &fleet.devices[r][st.node as usize];
            if !devs.iter().any(|d| d.failed || d.speed < 1.0) {
                continue;
            }
            let layers = st.layers;
            let min_layers = if layers_fixed { layers } else { 1 };
            let fits = |k: u32| stage_memory(s, min_layers, k, i, depth, m) <= s.hbm_bytes;
            if let Some(members) = tp_resize(devs, s.heads, fits) {
                st.members = members;
            }
        }
    }
    p
}

/// Applies ResiHP's repartition to every degraded replica.
fn with_repartition(plan: &Plan, fleet: &Fleet, s: &Setup) -> Plan {
    let mut p = plan.clone();
    for (r, rp) in p.replicas.iter_mut().enumerate() {
        let Some(rp) = rp else { continue };
        if !fleet.degraded(r) {
            continue;
        }
        let depth = rp.stages.len();
        let old: Vec<u32> = rp.stages.iter().map(|st| st.layers).collect();
        let cap_old: Vec<f64> = (rp.stages.iter())
            .map(|st| s.stage_tp[st.node as usize] as f64)
            .collect();
        let cap_new: Vec<f64> = (rp.stages.iter())
            .map(|st| {
                let d = stage_of(st, fleet, r);
                if d.devices.iter().any(|x| x.failed) {
                    0.0
                } else {
                    d.tp() as f64 * d.speed()
                }
            })
            .collect();
        let maxl: Vec<u32> = (rp.stages.iter().enumerate())
            .map(|(i, st)| max_layers(s, st.members.len() as u32, i, depth, rp.micro_batches))
            .collect();
        let new = repartition(&old, &cap_old, &cap_new, &maxl);
        for (st, l) in rp.stages.iter_mut().zip(new) {
            st.layers = l;
        }
    }
    p
}

/// Drops every stage whose node has a failed device in use; its layers are spread evenly
/// over the replica's remaining stages (a pipeline template on fewer nodes).
fn with_template(plan: &Plan, fleet: &Fleet, s: &Setup) -> Plan {
    let mut p = plan.clone();
    for (r, rp) in p.replicas.iter_mut().enumerate() {
        let Some(rpl) = rp else { continue };
        let kept: Vec<StagePlan> = (rpl.stages.iter())
            .filter(|st| {
                !st.members
                    .iter()
                    .any(|&i| fleet.devices[r][st.node as usize][i as usize].failed)
            })
            .cloned()
            .collect();
        if kept.len() == rpl.stages.len() {
            continue;
        }
        if kept.is_empty() {
            *rp = None;
            continue;
        }
        let split = even_split(s.layers, kept.len() as u32);
        rpl.stages = kept
            .into_iter()
            .zip(split)
            .map(|(mut st, l)| {
                st.members = (0..s.stage_tp[st.node as usize]).collect();
                st.layers = l;
                st
            })
            .collect();
    }
    p
}

/// Micro-batches spread evenly over the live replicas that can run.
fn even_micro_batches(plan: &mut Plan, fleet: &Fleet, total: u32) {
    let usable: Vec<usize> = (0..plan.replicas.len())
        .filter(|&r| {
            plan.replicas[r].as_ref().is_some_and(|rp| {
                !rp.stages.iter().any(|st| {
                    st.members
                        .iter()
                        .any(|&i| fleet.devices[r][st.node as usize][i as usize].failed)
                })
            })
        })
        .collect();
    for rp in plan.replicas.iter_mut().flatten() {
        rp.micro_batches = 0;
    }
    if usable.is_empty() {
        return;
    }
    for (k, m) in even_split(total, usable.len() as u32)
        .into_iter()
        .enumerate()
    {
        plan.replicas[usable[k]]
            .as_mut()
            .expect("usable")
            .micro_batches = m;
    }
}

/// Drops replicas with a failed device in use.
fn drop_failed(plan: &mut Plan, fleet: &Fleet) {
    for (r, rp) in plan.replicas.iter_mut().enumerate() {
        if let Some(rpl) = rp
            && rpl.stages.iter().any(|st| {
                st.members
                    .iter()
                    .any(|&i| fleet.devices[r][st.node as usize][i as usize].failed)
            })
        {
            *rp = None;
        }
    }
}

/// Chooses the plan of `strategy` for `fleet`, coming from `current`, planning for
/// `horizon_s` seconds.
pub fn adapt(
    strategy: Strategy,
    current: &Plan,
    fleet: &Fleet,
    s: &Setup,
    horizon_s: f64,
) -> Decision {
    let base = Plan::initial(s);
    let mut clock = ReplicaClock::default();
    let any_failed = fleet.devices.iter().flatten().flatten().any(|d| d.failed);
    match strategy {
        Strategy::Resihp => {
            let mut cands = Vec::new();
            for tp in [false, true] {
                for pp in [false, true] {
                    for dp in [false, true] {
                        let mut p = base.clone();
                        if tp {
                            p = with_tp_resize(&p, fleet, s, !pp);
                        }
                        if pp {
                            p = with_repartition(&p, fleet, s);
                        }
                        if dp {
                            even_micro_batches(&mut p, fleet, s.micro_batches);
                            reroute(&mut p, fleet, s, &mut clock);
                        }
                        cands.push(p);
                    }
                }
            }
            let mut dropped = base.clone();
            drop_failed(&mut dropped, fleet);
            even_micro_batches(&mut dropped, fleet, s.micro_batches);
            reroute(&mut dropped, fleet, s, &mut clock);
            cands.push(dropped);
            // Keeping the plan in place (no pause) is always a candidate, and so is
            // re-routing micro-batches on it.
            cands.push(current.clone());
            let mut kept = current.clone();
            reroute(&mut kept, fleet, s, &mut clock);
            cands.push(kept);
            best_of(cands, current, fleet, s, horizon_s)
        }
        Strategy::CheckpointRestart => {
            if !any_failed {
                // Back to the full job at the next planned restart (nothing lost).
                let mut d = decision(base.clone(), current, fleet, s);
                if base != *current {
                    d.pause_s = s.reconfig.checkpoint_restart_s;
                }
                return d;
            }
            let mut p = base.clone();
            drop_failed(&mut p, fleet);
            even_micro_batches(&mut p, fleet, s.micro_batches);
            let mut d = decision(p, current, fleet, s);
            d.pause_s = s.reconfig.checkpoint_restart_s + s.checkpoint_interval_s / 2.0;
            d
        }
        Strategy::Oobleck => {
            if !any_failed {
                return decision(base.clone(), current, fleet, s);
            }
            let mut p = with_template(&base, fleet, s);
            // Micro-batches in proportion to pipeline throughput (bottleneck stage).
            let rates: Vec<f64> = (p.replicas.iter().enumerate())
                .map(|(r, rp)| {
                    rp.as_ref().map_or(0.0, |rp| {
                        1.0 / (rp.stages.iter())
                            .map(|st| stage_time(st, fleet, r, s))
                            .fold(0.0, f64::max)
                    })
                })
                .collect();
            proportional(&mut p, &rates, s.micro_batches);
            decision(p, current, fleet, s)
        }
        Strategy::Recycle => {
            let mut p = base.clone();
            even_micro_batches(&mut p, fleet, s.micro_batches);
            reroute(&mut p, fleet, s, &mut clock);
            decision(p, current, fleet, s)
        }
        Strategy::TpOnly => {
            let p = with_tp_resize(&base, fleet, s, true);
            decision(p, current, fleet, s)
        }
        Strategy::PpOnly => {
            let mut p = with_template(&base, fleet, s);
            p = with_repartition(&p, fleet, s);
            even_micro_batches(&mut p, fleet, s.micro_batches);
            decision(p, current, fleet, s)
        }
        Strategy::Oracle => oracle(current, fleet, s, horizon_s),
    }
}

/// Distributes `total` micro-batches over the live replicas in proportion to `rates`
/// (largest remainders).
fn proportional(plan: &mut Plan, rates: &[f64], total: u32) {
    let sum: f64 = rates.iter().sum();
    if sum <= 0.0 {
        return;
    }
    let share: Vec<f64> = rates.iter().map(|r| r / sum * total as f64).collect();
    let mut m: Vec<u32> = share.iter().map(|x| x.floor() as u32).collect();
    let mut left = total - m.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..m.len()).collect();
    order.sort_by(|&a, &b| (share[b] - share[b].floor()).total_cmp(&(share[a] - share[a].floor())));
    for &r in &order {
        if left == 0 {
            break;
        }
        if rates[r] > 0.0 {
            m[r] += 1;
            left -= 1;
        }
    }
    for (rp, m) in plan.replicas.iter_mut().zip(m) {
        if let Some(rp) = rp {
            rp.micro_batches = m;
        }
    }
}

/// The candidate with the most tokens over the horizon, counting its pause and the pause of
/// going back to the healthy plan once the devices recover (a degraded plan is undone later).
fn best_of(cands: Vec<Plan>, current: &Plan, fleet: &Fleet, s: &Setup, horizon_s: f64) -> Decision {
    let mut best: Option<(f64, Decision)> = None;
    let mut seen = std::collections::BTreeSet::new();
    let base = Plan::initial(s);
    for p in cands {
        if !seen.insert(p.clone()) {
            continue;
        }
        let back = reconfig_s(&p, &base, s);
        let d = decision(p, current, fleet, s);
        let v = d.tokens_per_s * (horizon_s - d.pause_s - back).max(0.0);
        if best.as_ref().is_none_or(|(b, _)| v > *b) {
            best = Some((v, d));
        }
    }
    best.expect("a candidate").1
}

/// The `keep` partitions of `total` layers over stages with per-layer times `units` (each
/// stage `1..=hi[i]` layers) with the smallest (bottleneck, total time), by depth-first search
/// over every composition, pruning branches whose partial bottleneck already exceeds the
/// worst kept one. Stops after `budget` search nodes (never reached by the examples).
fn best_partitions(
    units: &[f64],
    hi: &[u32],
    total: u32,
    keep: usize,
    budget: u64,
) -> Vec<(f64, f64, Vec<u32>)> {
    struct S<'a> {
        units: &'a [f64],
        hi: &'a [u32],
        suffix_hi: Vec<u32>,
        keep: usize,
        best: Vec<(f64, f64, Vec<u32>)>,
        cur: Vec<u32>,
        nodes: u64,
        budget: u64,
    }
    fn worst(s: &S) -> f64 {
        if s.best.len() < s.keep {
            f64::INFINITY
        } else {
            s.best.last().map_or(f64::INFINITY, |b| b.0)
        }
    }
    fn go(s: &mut S, left: u32, bott: f64, sum: f64) {
        s.nodes += 1;
        if s.nodes > s.budget {
            return;
        }
        let i = s.cur.len();
        let n = s.units.len();
        if i == n {
            if left == 0 {
                let item = (bott, sum, s.cur.clone());
                let pos = s.best.partition_point(|b| (b.0, b.1) <= (bott, sum));
                s.best.insert(pos, item);
                s.best.truncate(s.keep);
            }
            return;
        }
        let rest = (n - i - 1) as u32;
        // This stage takes v: the others must be able to take left - v (>= 1 each, <= their hi).
        let lo = left.saturating_sub(s.suffix_hi[i + 1]).max(1);
        let hi = s.hi[i].min(left.saturating_sub(rest));
        for v in lo..=hi {
            let t = v as f64 * s.units[i];
            let b = bott.max(t);
            if b > worst(s) {
                break;
            }
            s.cur.push(v);
            go(s, left - v, b, sum + t);
            s.cur.pop();
        }
    }
    let mut suffix_hi = vec![0u32; units.len() + 1];
    for i in (0..units.len()).rev() {
        suffix_hi[i] = suffix_hi[i + 1].saturating_add(hi[i]);
    }
    let mut st = S {
        units,
        hi,
        suffix_hi,
        keep,
        best: Vec::new(),
        cur: Vec::new(),
        nodes: 0,
        budget,
    };
    go(&mut st, total, 0.0, 0.0);
    st.best
}

/// Partition-search nodes of the oracle per degraded replica.
const SEARCH_NODES: u64 = 100_000_000;

/// Most TP subgroup combinations the oracle enumerates per replica.
const MAX_TP_COMBINATIONS: usize = 256;

/// The oracle: for every degraded replica, every TP subgroup choice of its degraded stages
/// (each degree with its fastest members, or dropping the node; at most 256 combinations per
/// replica, further degraded nodes keep ResiHP's TP choice) times every memory-feasible
/// layer partition is enumerated; the 16 with the smallest bottleneck per micro-batch are run
/// on the engine for every micro-batch count, micro-batches are allocated optimally across
/// replicas (greedy on the engine's monotone per-replica times), and the best plan over the
/// horizon wins; the other strategies' plans are candidates too.
pub fn oracle(current: &Plan, fleet: &Fleet, s: &Setup, horizon_s: f64) -> Decision {
    let mut base = Plan::initial(s);
    let mut clock = ReplicaClock::default();
    let cap = 2 * s.micro_batches.div_ceil(s.replicas);
    // Per degraded replica: its candidate replica plans (few, engine-ranked later).
    let mut options: BTreeMap<usize, Vec<ReplicaPlan>> = BTreeMap::new();
    for r in 0..s.replicas as usize {
        if !fleet.degraded(r) {
            continue;
        }
        // Per node: member choices (each power-of-two degree with its fastest live members).
        let mut node_opts: Vec<Vec<Option<Vec<u32>>>> = Vec::new();
        for n in 0..s.stages as usize {
            let devs = &fleet.devices[r][n];
            let mut o: Vec<Option<Vec<u32>>> = Vec::new();
            if !devs.iter().any(|d| d.failed || d.speed < 1.0) {
                o.push(Some((0..s.stage_tp[n]).collect()));
            } else {
                let mut live: Vec<(u32, f64)> = (devs.iter().enumerate())
                    .filter(|(_, d)| !d.failed)
                    .map(|(i, d)| (i as u32, d.speed))
                    .collect();
                live.sort_by(|a, b| b.1.total_cmp(&a.1));
                let mut k = 1;
                while k <= live.len() {
                    if s.heads.is_multiple_of(k as u32) {
                        let mut m: Vec<u32> = live[..k].iter().map(|x| x.0).collect();
                        m.sort_unstable();
                        o.push(Some(m));
                    }
                    k *= 2;
                }
                o.push(None);
            }
            // Bound the product of choices (many degraded nodes in one replica): beyond 256
            // combinations a node keeps only ResiHP's own TP choice.
            let product: usize = node_opts.iter().map(Vec::len).product();
            if product * o.len() > MAX_TP_COMBINATIONS {
                let depth = s.stages as usize;
                let fits = |k: u32| {
                    stage_memory(s, 1, k, n, depth, s.micro_batches / s.replicas) <= s.hbm_bytes
                };
                o = vec![tp_resize(devs, s.heads, fits)];
            }
            node_opts.push(o);
        }
        let mut choice_sets: Vec<Vec<Option<Vec<u32>>>> = vec![Vec::new()];
        for o in &node_opts {
            let mut next = Vec::new();
            for c in &choice_sets {
                for x in o {
                    let mut c2 = c.clone();
                    c2.push(x.clone());
                    next.push(c2);
                }
            }
            choice_sets = next;
        }
        let mut scored: Vec<(f64, f64, ReplicaPlan)> = Vec::new();
        let m_ref = s.micro_batches / s.replicas;
        // Search nodes per replica, shared by its TP choices.
        let budget = (SEARCH_NODES / choice_sets.len().max(1) as u64).max(500_000);
        for cs in choice_sets {
            let nodes: Vec<(u32, Vec<u32>)> = (cs.iter().enumerate())
                .filter_map(|(n, c)| c.clone().map(|m| (n as u32, m)))
                .collect();
            if nodes.is_empty() {
                continue;
            }
            let depth = nodes.len();
            let hi: Vec<u32> = (nodes.iter().enumerate())
                .map(|(i, (_, m))| max_layers(s, m.len() as u32, i, depth, m_ref).min(s.layers))
                .collect();
            // A stage's time is linear in its layers: the time of one layer per stage.
            let units: Vec<f64> = (nodes.iter())
                .map(|(n, m)| {
                    let one = StagePlan {
                        node: *n,
                        members: m.clone(),
                        layers: 1,
                    };
                    stage_time(&one, fleet, r, s)
                })
                .collect();
            for (b, sum, part) in best_partitions(&units, &hi, s.layers, 16, budget) {
                let rp = ReplicaPlan {
                    stages: (nodes.iter().zip(&part))
                        .map(|((n, m), &l)| StagePlan {
                            node: *n,
                            members: m.clone(),
                            layers: l,
                        })
                        .collect(),
                    micro_batches: 0,
                };
                scored.push((b, sum, rp));
            }
        }
        scored.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then_with(|| a.2.cmp(&b.2))
        });
        scored.truncate(16);
        if scored.is_empty() {
            // No stage of the replica can run (every node lost or too small): it is out.
            base.replicas[r] = None;
        } else {
            options.insert(r, scored.into_iter().map(|x| x.2).collect());
        }
    }
    let mut plan = base.clone();
    // For each degraded replica pick the option that, with optimal allocation, gives the
    // shortest iteration (coordinate descent over degraded replicas, two rounds).
    let mut chosen: BTreeMap<usize, usize> = options.keys().map(|&r| (r, 0)).collect();
    let alloc = |chosen: &BTreeMap<usize, usize>, clock: &mut ReplicaClock| -> (f64, Plan) {
        let mut p = base.clone();
        for (&r, &i) in chosen {
            p.replicas[r] = Some(options[&r][i].clone());
        }
        for rp in p.replicas.iter_mut().flatten() {
            rp.micro_batches = 0;
        }
        for _ in 0..s.micro_batches {
            let best = (0..p.replicas.len())
                .filter_map(|r| {
                    let rp = p.replicas[r].as_ref()?;
                    if rp.micro_batches + 1 > cap {
                        return None;
                    }
                    Some((r, clock.time(rp, fleet, r, rp.micro_batches + 1, s)))
                })
                .min_by(|a, b| a.1.total_cmp(&b.1));
            let Some((r, _)) = best else { break };
            p.replicas[r].as_mut().expect("live").micro_batches += 1;
        }
        let t = (p.replicas.iter().enumerate())
            .filter_map(|(r, rp)| {
                rp.as_ref()
                    .map(|rp| clock.time(rp, fleet, r, rp.micro_batches, s))
            })
            .fold(0.0, f64::max);
        (t, p)
    };
    for _ in 0..2 {
        for (&r, opts) in &options {
            let mut best = (f64::INFINITY, 0usize);
            for i in 0..opts.len() {
                let mut c = chosen.clone();
                c.insert(r, i);
                let (t, _) = alloc(&c, &mut clock);
                if t < best.0 {
                    best = (t, i);
                }
            }
            chosen.insert(r, best.1);
        }
    }
    if !options.is_empty() {
        plan = alloc(&chosen, &mut clock).1;
    }
    let mut cands = vec![plan, current.clone()];
    for st in Strategy::ALL {
        if st != Strategy::Oracle && st != Strategy::CheckpointRestart {
            cands.push(adapt(st, current, fleet, s, horizon_s).plan);
        }
    }
    best_of(cands, current, fleet, s, horizon_s)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use prism_core::job::fixtures::{h100_cluster, small_job};

    /// The paper's example: three stages of 4 layers on TP 8; the middle stage's group halves
    /// (TP 8 -> 4): targets (4, 2, 4), the two spare layers go to the stages with the smallest
    /// (layers + 1) / capacity: (5, 2, 5).
    #[test]
    fn repartition_reproduces_4_4_4_to_5_2_5() {
        let new = repartition(
            &[4, 4, 4],
            &[8.0, 8.0, 8.0],
            &[8.0, 4.0, 8.0],
            &[12, 12, 12],
        );
        assert_eq!(new, vec![5, 2, 5]);
        // Memory bounds respected; total kept.
        let new = repartition(&[4, 4, 4], &[8.0, 8.0, 8.0], &[8.0, 4.0, 8.0], &[4, 12, 12]);
        assert_eq!(new.iter().sum::<u32>(), 12);
        assert!(new[0] <= 4);
        // A failed stage (capacity 0) gets nothing.
        let new = repartition(&[4, 4, 4], &[8.0; 3], &[8.0, 0.0, 8.0], &[12, 12, 12]);
        assert_eq!(new, vec![6, 0, 6]);
    }

    /// TP choice against brute force over every subset of the live devices: the best
    /// power-of-two subgroup by `k x min speed`, memory permitting.
    #[test]
    fn tp_choice_matches_brute_force() {
        let cases: Vec<Vec<(f64, bool)>> = vec![
            vec![(1.0, false); 8],
            vec![
                (1.0, false),
                (0.3, false),
                (1.0, false),
                (1.0, false),
                (1.0, false),
                (1.0, false),
                (1.0, false),
                (1.0, false),
            ],
            vec![
                (0.9, false),
                (0.6, false),
                (1.0, false),
                (1.0, true),
                (0.95, false),
                (1.0, false),
                (0.2, false),
                (1.0, false),
            ],
            vec![
                (0.5, false),
                (0.5, false),
                (0.5, false),
                (0.5, false),
                (0.9, false),
                (0.9, false),
                (0.4, true),
                (0.9, false),
            ],
            vec![(0.7, false), (0.8, false), (0.6, false), (0.9, false)],
        ];
        for (ci, c) in cases.iter().enumerate() {
            let devs: Vec<Device> = (c.iter().enumerate())
                .map(|(i, &(speed, failed))| Device {
                    id: i as u32,
                    speed,
                    failed,
                })
                .collect();
            for max_k in [8u32, 4, 2] {
                let fits = |k: u32| k <= max_k;
                let got = tp_resize(&devs, 64, fits).unwrap();
                let score = |m: &[u32]| {
                    m.len() as f64
                        * m.iter()
                            .map(|&i| devs[i as usize].speed)
                            .fold(f64::INFINITY, f64::min)
                };
                // Brute force over all subsets.
                let n = devs.len();
                let mut best = 0.0f64;
                for mask in 1u32..(1 << n) {
                    let m: Vec<u32> = (0..n as u32).filter(|i| mask >> i & 1 == 1).collect();
                    let k = m.len() as u32;
                    if !k.is_power_of_two()
                        || k > max_k
                        || m.iter().any(|&i| devs[i as usize].failed)
                    {
                        continue;
                    }
                    best = best.max(score(&m));
                }
                assert!(
                    (score(&got) - best).abs() < 1e-12,
                    "case {ci} max {max_k}: {got:?} {} vs {best}",
                    score(&got)
                );
                assert!(got.iter().all(|&i| !devs[i as usize].failed));
            }
        }
    }

    pub(crate) fn setup() -> Setup {
        let job = small_job(1, 1, 1, 8);
        let mut cost = LayerCost::from_job(&job, 16);
        cost.token_s *= 50.0;
        cost.sq_s *= 50.0;
        Setup {
            cluster: h100_cluster(4),
            cost,
            schedule: Schedule::OneFOneB,
            replicas: 4,
            stages: 3,
            stage_tp: vec![4; 3],
            stage_layers: vec![4; 3],
            layers: 12,
            heads: 16,
            micro_batches: 16,
            micro_batch: MicroBatch::uniform(2048, 2),
            hbm_bytes: 80e9,
            act_bytes_per_token_layer: 34.0 * 1024.0,
            reconfig: ReconfigCost {
                restart_s: 20.0,
                checkpoint_restart_s: 300.0,
            },
            checkpoint_interval_s: 1800.0,
        }
    }

    /// A very slow device: ResiHP beats doing nothing and every single-mechanism baseline it
    /// contains, and the oracle is at least as good as ResiHP; a failed device: every plan
    /// that runs avoids it.
    #[test]
    fn joint_adaptation_and_oracle() {
        let s = setup();
        let init = Plan::initial(&s);
        let mut fleet = Fleet::healthy(&s);
        let healthy = throughput(&init, &fleet, &s);
        fleet.devices[1][1][2].speed = 0.25;
        let horizon = 3600.0;
        let nothing = decision(init.clone(), &init, &fleet, &s);
        let get = |st| adapt(st, &init, &fleet, &s, horizon);
        let res = get(Strategy::Resihp);
        let orc = get(Strategy::Oracle);
        assert!(
            res.tokens_per_s > nothing.tokens_per_s * 1.05,
            "{} vs {}",
            res.tokens_per_s,
            nothing.tokens_per_s
        );
        assert!(res.tokens_per_s <= healthy * (1.0 + 1e-9));
        for st in [Strategy::Recycle, Strategy::TpOnly, Strategy::PpOnly] {
            let b = get(st);
            assert!(
                horizon_tokens(&res, horizon) >= horizon_tokens(&b, horizon) * (1.0 - 1e-9),
                "{st:?}"
            );
        }
        assert!(horizon_tokens(&orc, horizon) >= horizon_tokens(&res, horizon) * (1.0 - 1e-9));
        fleet.devices[1][1][2].failed = true;
        for st in Strategy::ALL {
            let d = adapt(st, &init, &fleet, &s, horizon);
            assert!(d.tokens_per_s > 0.0, "{st:?} cannot run");
            assert!(iteration_s(&d.plan, &fleet, &s).is_some());
        }
    }

    /// The pruned search returns the same best partitions as brute force over every
    /// composition.
    #[test]
    fn partition_search_matches_brute_force() {
        let units = [1.0, 2.5, 1.0, 0.7];
        let hi = [9, 6, 9, 9];
        let got = best_partitions(&units, &hi, 20, 5, u64::MAX);
        let mut all = Vec::new();
        for a in 1..=9u32 {
            for b in 1..=6u32 {
                for c in 1..=9u32 {
                    if a + b + c < 20 && 20 - a - b - c <= 9 {
                        let p = [a, b, c, 20 - a - b - c];
                        let t: Vec<f64> =
                            p.iter().zip(&units).map(|(&l, u)| l as f64 * u).collect();
                        all.push((
                            t.iter().cloned().fold(0.0, f64::max),
                            t.iter().sum::<f64>(),
                            p.to_vec(),
                        ));
                    }
                }
            }
        }
        all.sort_by(|x, y| (x.0, x.1).partial_cmp(&(y.0, y.1)).unwrap());
        assert_eq!(got.len(), 5);
        for (g, w) in got.iter().zip(&all) {
            assert_eq!((g.0, g.1), (w.0, w.1));
        }
    }

    /// Heterogeneous stages: device ids are dense and unique, the healthy plan uses every
    /// device, and a TP-2 stage holding as many layers as its TP-4 neighbours is the
    /// bottleneck the repartition relieves.
    #[test]
    fn heterogeneous_stage_tp() {
        let mut s = setup();
        s.stage_tp = vec![4, 2, 4];
        assert_eq!(s.devices(), 40);
        let fleet = Fleet::healthy(&s);
        let mut ids: Vec<u32> = fleet
            .devices
            .iter()
            .flatten()
            .flatten()
            .map(|d| d.id)
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..40).collect::<Vec<_>>());
        assert_eq!(s.device_id(1, 2, 3), 10 + 4 + 2 + 3);
        let init = Plan::initial(&s);
        assert_eq!(
            init.replicas[0].as_ref().unwrap().stages[1].members.len(),
            2
        );
        let even = throughput(&init, &fleet, &s);
        let mut moved = init.clone();
        for rp in moved.replicas.iter_mut().flatten() {
            let l: Vec<u32> = repartition(&[4, 4, 4], &[4.0, 4.0, 4.0], &[4.0, 2.0, 4.0], &[12; 3]);
            for (st, l) in rp.stages.iter_mut().zip(l) {
                st.layers = l;
            }
        }
        assert_eq!(
            moved.replicas[0]
                .as_ref()
                .unwrap()
                .stages
                .iter()
                .map(|x| x.layers)
                .collect::<Vec<_>>(),
            vec![5, 2, 5]
        );
        assert!(throughput(&moved, &fleet, &s) > even);
    }

    #[test]
    fn reconfiguration_moves_only_changed_state() {
        let s = setup();
        let a = Plan::initial(&s);
        let mut b = a.clone();
        b.replicas[0].as_mut().unwrap().micro_batches += 1;
        b.replicas[1].as_mut().unwrap().micro_batches -= 1;
        assert_eq!(reconfig_s(&a, &b, &s), 0.0);
        let mut c = a.clone();
        let st = &mut c.replicas[2].as_mut().unwrap().stages;
        st[0].layers += 1;
        st[1].layers -= 1;
        let t = reconfig_s(&a, &c, &s);
        assert!(t > s.reconfig.restart_s);
    }
}
