//! Collective communication cost: NCCL's algorithms and protocols on a two-level topology
//! (NVLink inside a node, one NIC per GPU across nodes), chosen as NCCL's tuner chooses them.
//!
//! A collective over `n` ranks spread as `per_node` ranks on each of `nodes` nodes is priced as
//! a *plan*: a fixed latency (alpha) and the bytes each GPU pushes through NVLink and through its
//! NIC (beta). The engine turns the NIC bytes into a network flow that shares links with other
//! traffic; on an idle network the duration is the closed form [`CommPlan::idle_seconds`].
//!
//! Bytes (S = the full, unsharded buffer):
//! - ring: with `per_node = k` ranks per node NCCL runs `k` channels, each ring leaving every
//!   node through a different NIC, so each NIC carries `1/k` of the ring traffic and NVLink the
//!   rest. All-reduce: each rank sends `2 (n-1)/n S`; reduce-scatter / all-gather: `(n-1)/n S`;
//!   all-to-all: `(n-1)/n S` (the share bound for other nodes over the NIC);
//! - tree (all-reduce; a chain inside a node, NCCL's double binary tree across nodes): `2 S`,
//!   the node's part spread over its `k` NICs;
//! - NVLS (NVLink SHARP, all-reduce on Hopper and later): each byte goes to the NVSwitch once and
//!   comes back reduced once; across nodes (NVLS tree) a tree joins the nodes.
//!
//! Protocols carry payload at a fraction of the line rate (tuning.cc's refinements): Simple 1
//! (0.92 on the tree), LL128 0.92 (0.7 with one rank per node; tree 0.92 x 120/128 across nodes,
//! 0.92 x 7/9 inside one), LL 1/4 (1/3 for an all-gather or reduce-scatter inside a node; tree
//! 0.92/3.8) and at most a per-generation cap. Latency is NCCL's own estimate
//! ([`nccl_latency_s`]): a base cost per algorithm and protocol plus a hop cost per step, the
//! steps across nodes at the network's cost, so it grows linearly with the ring and with
//! `log2(nodes)` for the tree. [`plan_collective`] prices every candidate NCCL would consider
//! and keeps the fastest, as `ncclTopoGetAlgoTime` and the tuner do.
//!
//! Not modelled: CollNet (in-network SHARP across nodes), PAT, NVLS for all-gather and
//! reduce-scatter, the tree's small-size correction factors, per-channel bandwidth caps other
//! than LL's.

use crate::job::Cluster;
use crate::units::{SimTime, ps_from_s};

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// Sum across ranks, result everywhere.
    AllReduce,
    /// Concatenate shards; `bytes` is the gathered (output) size.
    AllGather,
    /// Sum then shard; `bytes` is the (unsharded) input size.
    ReduceScatter,
    /// Personalised exchange; `bytes` is what one rank sends in total.
    AllToAll,
    /// Ring shift: every rank sends `bytes` to the next rank of the group and receives as many
    /// from the previous one (one step of ring attention; NCCL send/recv pairs).
    RingExchange,
}

impl Collective {
    /// Short name for traces and reports.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::RingExchange => "ring_exchange",
        }
    }
}

/// The NCCL algorithm a plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Ring (or, for all-to-all, pairwise exchange).
    Ring,
    /// Double binary tree across nodes.
    Tree,
    /// NVLink SHARP: all-reduce inside the NVSwitch (one node).
    Nvls,
    /// NVLink SHARP inside nodes, a tree across nodes.
    NvlsTree,
    /// Point-to-point send.
    P2p,
}

/// Physical communication parameters (per GPU generation; calibrated elsewhere).
#[derive(Clone, Debug, PartialEq)]
pub struct CommParams {
    /// Fraction of the NVLink line rate a collective achieves as bus bandwidth.
    pub nvlink_efficiency: f64,
    /// Fraction of the NIC line rate a collective achieves as bus bandwidth.
    pub nic_efficiency: f64,
    /// Fixed cost of launching one collective or send (kernel launch, NCCL bookkeeping), us.
    pub launch_us: f64,
    /// Measured collective latency over NCCL's own estimate ([`nccl_latency_s`]). NCCL's tables
    /// rank algorithms; how long a hop really takes on a fabric is a physical figure, calibrated
    /// per GPU generation. The choice of algorithm and protocol uses NCCL's unscaled estimate,
    /// as NCCL does; the priced duration uses the scaled one.
    pub latency_scale: f64,
}

impl Default for CommParams {
    /// Initial values: NCCL all-reduce inside an 8-GPU NVSwitch node reaches about 75-80% of
    /// the NVLink rate as bus bandwidth and about 90% of an InfiniBand/RoCE NIC's rate across
    /// nodes (nccl-tests reports on DGX A100/H100); launch about 10 us.
    fn default() -> Self {
        CommParams {
            nvlink_efficiency: 0.78,
            nic_efficiency: 0.90,
            launch_us: 10.0,
            latency_scale: 1.0,
        }
    }
}

impl CommParams {
    /// Calibrated values for a GPU generation (see docs/calibration.md); the defaults for
    /// generations without calibration data.
    pub fn for_gpu(gpu: &crate::job::Gpu) -> Self {
        let name = gpu.name.to_ascii_uppercase();
        if name.contains("A100") || name.contains("A800") {
            CommParams::a100()
        } else if name.contains("H100") || name.contains("H800") || name.contains("H200") {
            CommParams::h100()
        } else {
            CommParams::default()
        }
    }

    /// A100 (DGX A100: NVLink 3 + NVSwitch, HDR InfiniBand).
    pub fn a100() -> Self {
        // Fitted on the published A100 runs with NCCL's tuning model (docs/calibration.md,
        // "Refit with the loss and gradient accumulation (2026-11-25)").
        CommParams {
            nvlink_efficiency: 0.725,
            nic_efficiency: 0.950,
            launch_us: 10.0,
            latency_scale: 0.558,
        }
    }

    /// H100/H200 (DGX H100: NVLink 4 + NVSwitch, NDR InfiniBand / 400G RoCE).
    pub fn h100() -> Self {
        // Fitted on the published H100 runs with NCCL's tuning model (docs/calibration.md,
        // "Interleaved Megatron-Core runs and the userbuffers SM margin (2026-11-25)").
        CommParams {
            nvlink_efficiency: 0.901,
            nic_efficiency: 0.938,
            launch_us: 10.0,
            latency_scale: 0.0515,
        }
    }
}

/// How a group's members sit on nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupShape {
    /// Ranks in the group.
    pub ranks: u32,
    /// Distinct nodes the group spans.
    pub nodes: u32,
    /// Most members on one node.
    pub per_node: u32,
}

/// The price of one collective or send, before network sharing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommPlan {
    /// Algorithm chosen.
    pub algorithm: Algorithm,
    /// Protocol chosen.
    pub protocol: Protocol,
    /// Fixed latency (alpha), picoseconds.
    pub latency_ps: SimTime,
    /// Time the NVLink part takes alone, picoseconds (it does not share links).
    pub nvlink_ps: SimTime,
    /// Bytes each participating NIC sends (and receives), 0 when the group is inside a node.
    pub nic_bytes: u64,
}

impl CommPlan {
    /// Duration on an otherwise idle network, seconds: `alpha + max(NVLink time, NIC bytes /
    /// NIC bandwidth)`.
    pub fn idle_seconds(&self, cluster: &Cluster, params: &CommParams) -> f64 {
        let nic = self.nic_bytes as f64 / nic_bytes_per_s(cluster, params) as f64;
        let nic_ps = if self.nic_bytes == 0 {
            0
        } else {
            ps_from_s(nic).max(1)
        };
        (self.latency_ps + self.nvlink_ps.max(nic_ps)) as f64 * 1e-12
    }
}

/// Effective NIC bandwidth of one GPU, bytes per second (integer, as the network model uses).
pub fn nic_bytes_per_s(cluster: &Cluster, params: &CommParams) -> u64 {
    (cluster.nic_gbps * 1e9 / 8.0 * params.nic_efficiency)
        .round()
        .max(1.0) as u64
}

/// Effective NVLink bandwidth of one GPU, bytes per second.
pub fn nvlink_bytes_per_s(cluster: &Cluster, params: &CommParams) -> f64 {
    cluster.nvlink_gbps * 1e9 / 8.0 * params.nvlink_efficiency
}

fn ps(seconds: f64) -> SimTime {
    if seconds <= 0.0 {
        0
    } else {
        ps_from_s(seconds)
    }
}

/// GPU generations NCCL's tuning tables distinguish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Volta and older.
    Volta,
    /// Ampere (A100, A800).
    Ampere,
    /// Hopper (H100, H800, H200): NVLink SHARP (NVLS) in the NVSwitch.
    Hopper,
    /// Blackwell (B200, GB200): treated as Hopper by the tables, NVLS available.
    Blackwell,
}

impl Arch {
    /// The generation of a GPU, from its name (Ampere when the name says nothing known).
    pub fn of(gpu: &crate::job::Gpu) -> Arch {
        let n = gpu.name.to_ascii_uppercase();
        if n.contains("V100") || n.contains("P100") {
            Arch::Volta
        } else if n.contains("H100")
            || n.contains("H800")
            || n.contains("H200")
            || n.contains("H20")
        {
            Arch::Hopper
        } else if n.contains("B200") || n.contains("B100") || n.contains("B300") {
            Arch::Blackwell
        } else {
            Arch::Ampere
        }
    }

    fn row(self) -> usize {
        match self {
            Arch::Volta => 0,
            Arch::Ampere => 1,
            Arch::Hopper | Arch::Blackwell => 2,
        }
    }

    /// NVLink SHARP: multimem reductions in the NVSwitch (sm90 and later).
    fn has_nvls(self) -> bool {
        matches!(self, Arch::Hopper | Arch::Blackwell)
    }
}

/// NCCL's wire protocols.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    /// Low latency: 8-byte stores carrying 4 bytes of data and a flag.
    Ll,
    /// 128-byte lines carrying 120 bytes of data.
    Ll128,
    /// Plain copies with fences: full bandwidth, highest latency.
    Simple,
}

const PROTOCOLS: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

/// NCCL's tuning tables (`src/graph/tuning.cc`, NCCL 2.18-2.21), microseconds, indexed by
/// protocol (LL, LL128, Simple). `BASE_*`: fixed cost of one collective; `NVLINK_*` / `NET_*`:
/// the cost of one algorithm step over NVLink or over the network.
mod nccl {
    pub(super) const BASE_TREE: [f64; 3] = [6.8, 14.0, 0.0];
    pub(super) const BASE_RING: [f64; 3] = [6.6, 14.0, 8.4];
    pub(super) const BASE_NVLS: [f64; 3] = [0.0, 0.0, 0.0];
    pub(super) const NVLINK_TREE: [f64; 3] = [0.6, 1.25, 4.0];
    pub(super) const NVLINK_RING: [f64; 3] = [0.6, 1.9, 3.4];
    pub(super) const NVLINK_NVLS: [f64; 3] = [0.0, 0.0, 25.0];
    pub(super) const NET_TREE: [f64; 3] = [5.0, 8.5, 14.0];
    pub(super) const NET_RING: [f64; 3] = [2.7, 4.0, 14.0];
    pub(super) const NET_NVLS: [f64; 3] = [0.0, 0.0, 18.0];
    pub(super) const NET_NVLS_TREE: [f64; 3] = [0.0, 0.0, 19.0];
    /// CPU-side cost of posting a network operation (x86), us; three times that for Simple.
    pub(super) const NET_OVERHEAD_US: f64 = 1.0;
    /// Cap on the LL protocol's algorithm bandwidth, GB/s, by generation (Volta, Ampere,
    /// Hopper) and by node count (1, 2, more).
    pub(super) const LL_MAX_BW: [[f64; 3]; 3] =
        [[39.0, 39.0, 20.4], [87.7, 22.5, 19.0], [141.0, 45.0, 35.0]];
    /// A multi-node Simple ring all-reduce's latency grows by this factor (NCCL's "plateau
    /// effect of ring"), 1.9 before sm80.
    pub(super) const RING_PLATEAU: [f64; 3] = [1.9, 1.4, 1.4];
    /// Channels NCCL opens on an 8-GPU NVSwitch node with 8 NICs (for the plateau rule).
    pub(super) const CHANNELS: f64 = 16.0;
}

/// How much of a protocol's line traffic is payload, relative to Simple, for `algo` on a
/// group with `nodes` nodes and `per_node` ranks on each (NCCL's model refinements).
fn protocol_efficiency(
    algo: Algorithm,
    proto: Protocol,
    op: Collective,
    nodes: u32,
    per_node: u32,
) -> f64 {
    match (algo, proto) {
        // NVLS moves each byte once to the switch and once back (no ring pipeline), at the
        // switch's reduction rate.
        (Algorithm::Nvls | Algorithm::NvlsTree, _) => NVLS_EFFICIENCY,
        (Algorithm::Tree, Protocol::Simple) => 0.92,
        (_, Protocol::Simple) => 1.0,
        (Algorithm::Ring, Protocol::Ll) => {
            if nodes > 1 || op == Collective::AllReduce {
                1.0 / 4.0
            } else {
                1.0 / 3.0
            }
        }
        (Algorithm::Ring, Protocol::Ll128) => {
            if per_node < 2 {
                0.7
            } else {
                0.92
            }
        }
        (Algorithm::Tree, Protocol::Ll) => 0.92 / 3.8,
        (Algorithm::Tree, Protocol::Ll128) => {
            0.92 * if nodes == 1 { 7.0 / 9.0 } else { 120.0 / 128.0 }
        }
        (Algorithm::P2p, _) => unreachable!("sends are planned by plan_p2p"),
    }
}

/// NCCL's latency estimate (seconds) of `op` with `algo` and `proto` on a group of `shape`
/// ranks: a base cost plus one hop cost per algorithm step, the steps that cross nodes at the
/// network's cost. Ring: `2 (n - 1)` steps for an all-reduce (`2 nodes` of them across nodes),
/// `n - 1` for all-gather and reduce-scatter (`nodes - 1` across); tree: `2 ((n/nodes - 1)
/// intra + floor(log2 nodes) inter)`; NVLS: the base cost, plus one network step across nodes
/// (NVLS tree: `2 (nodes - 1)` of them). This latency grows with the group, linearly for the
/// ring and logarithmically for the tree.
pub fn nccl_latency_s(
    op: Collective,
    algo: Algorithm,
    proto: Protocol,
    shape: GroupShape,
    arch: Arch,
    bytes: u64,
) -> f64 {
    let p = proto as usize;
    let n = shape.ranks.max(1) as f64;
    let nodes = shape.nodes.max(1) as f64;
    let (steps, inter_steps) = match op {
        Collective::AllReduce => (
            2.0 * (n - 1.0),
            if shape.nodes > 1 { 2.0 * nodes } else { 0.0 },
        ),
        Collective::AllGather | Collective::ReduceScatter => (n - 1.0, nodes - 1.0),
        Collective::AllToAll => (1.0, 0.0),
        Collective::RingExchange => (1.0, if shape.nodes > 1 { 1.0 } else { 0.0 }),
    };
    let us = match algo {
        Algorithm::Ring => {
            let mut intra = nccl::NVLINK_RING[p];
            if shape.nodes > 1 {
                let overhead =
                    nccl::NET_OVERHEAD_US * if proto == Protocol::Simple { 3.0 } else { 1.0 };
                intra = intra.max(overhead);
            }
            let mut lat = nccl::BASE_RING[p]
                + (steps - inter_steps) * intra
                + inter_steps * nccl::NET_RING[p];
            if proto == Protocol::Simple
                && shape.nodes > 1
                && op == Collective::AllReduce
                && bytes as f64 / (nccl::CHANNELS * n) >= 64.0
            {
                lat *= nccl::RING_PLATEAU[arch.row()];
            }
            lat
        }
        Algorithm::Tree => {
            let depth = (shape.nodes.max(1)).ilog2() as f64;
            nccl::BASE_TREE[p]
                + 2.0 * ((n / nodes - 1.0) * nccl::NVLINK_TREE[p] + depth * nccl::NET_TREE[p])
        }
        Algorithm::Nvls => {
            nccl::BASE_NVLS[p]
                + nccl::NVLINK_NVLS[p]
                + if shape.nodes > 1 {
                    nccl::NET_NVLS[p]
                } else {
                    0.0
                }
        }
        Algorithm::NvlsTree => {
            nccl::BASE_NVLS[p] + nccl::NVLINK_NVLS[p] + 2.0 * (nodes - 1.0) * nccl::NET_NVLS_TREE[p]
        }
        Algorithm::P2p => 0.0,
    };
    us * 1e-6
}

/// Plans a collective of `bytes` over a group of `shape` on `cluster`, choosing the algorithm
/// and protocol as NCCL's tuner does: every candidate NCCL would consider for this operation,
/// generation and group is priced (latency from [`nccl_latency_s`], bandwidth from the
/// cluster's links scaled by the protocol's payload efficiency), and the fastest on an idle
/// network is kept (the first in NCCL's order on ties: tree, ring, NVLS, NVLS tree; LL, LL128,
/// Simple).
pub fn plan_collective(
    op: Collective,
    bytes: u64,
    shape: GroupShape,
    cluster: &Cluster,
    params: &CommParams,
) -> CommPlan {
    if shape.ranks <= 1 {
        return CommPlan {
            algorithm: Algorithm::Ring,
            protocol: Protocol::Simple,
            latency_ps: 0,
            nvlink_ps: 0,
            nic_bytes: 0,
        };
    }
    if op == Collective::RingExchange {
        // Send/recv pairs: every rank's message crosses one link at once. When the ring spans
        // nodes, the messages that cross them (one per node, each through its own NIC) set
        // the step's time.
        return plan_p2p(bytes, shape.nodes <= 1, cluster, params);
    }
    let arch = Arch::of(&cluster.gpu);
    // Candidates in NCCL's order: all-to-all is a pairwise exchange (the ring's bytes, Simple);
    // all-reduce adds the tree and, on Hopper and later with more than one GPU of the group
    // on each node, NVLS (NVLS tree across nodes).
    let mut algos = Vec::with_capacity(3);
    if op == Collective::AllReduce {
        algos.push(Algorithm::Tree);
    }
    algos.push(Algorithm::Ring);
    if op == Collective::AllReduce && arch.has_nvls() && shape.per_node > 1 {
        algos.push(if shape.nodes == 1 {
            Algorithm::Nvls
        } else {
            Algorithm::NvlsTree
        });
    }
    let mut best: Option<(f64, CommPlan)> = None;
    for algo in algos {
        for proto in PROTOCOLS {
            let nvls = matches!(algo, Algorithm::Nvls | Algorithm::NvlsTree);
            // NVLS and all-to-all are Simple; LL128 is enabled by default on Volta, Ampere and
            // Hopper only.
            if ((nvls || op == Collective::AllToAll) && proto != Protocol::Simple)
                || (proto == Protocol::Ll128 && arch == Arch::Blackwell)
            {
                continue;
            }
            let plan = price(op, algo, proto, bytes, shape, cluster, params, arch);
            let t = plan.idle_seconds(cluster, params);
            if best.as_ref().is_none_or(|(b, _)| t < *b) {
                best = Some((t, plan));
            }
        }
    }
    let mut plan = best.expect("ring Simple is always a candidate").1;
    plan.latency_ps = (plan.latency_ps as f64 * params.latency_scale).round() as SimTime;
    plan
}

/// One candidate's plan: NCCL's latency and the bytes each GPU moves over NVLink and its NIC,
/// inflated by the protocol's overhead.
#[allow(clippy::too_many_arguments)]
fn price(
    op: Collective,
    algo: Algorithm,
    proto: Protocol,
    bytes: u64,
    shape: GroupShape,
    cluster: &Cluster,
    params: &CommParams,
    arch: Arch,
) -> CommPlan {
    let n = shape.ranks.max(1) as f64;
    let k = shape.per_node.max(1) as f64;
    let s = bytes as f64;
    let factor = match op {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => (n - 1.0) / n,
        Collective::RingExchange => 1.0,
    };
    let per_rank = factor * s;
    let nvl_bw = nvlink_bytes_per_s(cluster, params);
    let latency = nccl_latency_s(op, algo, proto, shape, arch, bytes);
    let eff = protocol_efficiency(algo, proto, op, shape.nodes, shape.per_node);
    let (nvl_bytes, nic_bytes) = if shape.nodes <= 1 {
        match algo {
            Algorithm::Nvls => (s, 0.0),
            // NCCL's tree (a chain inside a node) moves twice the buffer: algorithm bandwidth
            // half the bus bandwidth.
            Algorithm::Tree => (2.0 * s, 0.0),
            _ => (per_rank, 0.0),
        }
    } else {
        match (op, algo) {
            // All-to-all: the share of a rank's data bound for other nodes crosses its NIC.
            (Collective::AllToAll, _) => ((k - 1.0) / n * s, (n - k) / n * s),
            (_, Algorithm::NvlsTree) => (s, 2.0 * s / k),
            // The double binary tree: every node sends and receives the whole buffer, spread
            // over its NICs.
            (_, Algorithm::Tree) => (2.0 * s * (k - 1.0) / k, 2.0 * s / k),
            // Ring: `k` channels leave every node through different NICs.
            _ => (per_rank * (k - 1.0) / k, per_rank / k),
        }
    };
    let mut nvl_s = nvl_bytes / (nvl_bw * eff);
    if proto == Protocol::Ll {
        // NCCL caps LL's algorithm bandwidth per generation and node count.
        let col = match shape.nodes {
            0 | 1 => 0,
            2 => 1,
            _ => 2,
        };
        nvl_s = nvl_s.max(s / (nccl::LL_MAX_BW[arch.row()][col] * 1e9));
    }
    CommPlan {
        algorithm: algo,
        protocol: proto,
        latency_ps: ps(latency),
        nvlink_ps: ps(nvl_s),
        nic_bytes: (nic_bytes / eff).ceil() as u64,
    }
}

/// NVLS all-reduce bandwidth relative to the NVLink rate a ring achieves: nccl-tests on DGX
/// H100 measure about 480 GB/s NVLS bus bandwidth against about 370 GB/s for the ring, i.e.
/// an algorithm bandwidth of 274 GB/s moving each byte once, 0.70 of the ring's link rate.
const NVLS_EFFICIENCY: f64 = 0.70;

/// Plans a point-to-point send of `bytes`; `same_node` selects NVLink.
pub fn plan_p2p(bytes: u64, same_node: bool, cluster: &Cluster, params: &CommParams) -> CommPlan {
    let launch = params.launch_us * 1e-6;
    if same_node {
        CommPlan {
            algorithm: Algorithm::P2p,
            protocol: Protocol::Simple,
            latency_ps: ps(launch + cluster.nvlink_latency_us * 1e-6),
            nvlink_ps: ps(bytes as f64 / nvlink_bytes_per_s(cluster, params)),
            nic_bytes: 0,
        }
    } else {
        CommPlan {
            algorithm: Algorithm::P2p,
            protocol: Protocol::Simple,
            latency_ps: ps(launch + cluster.nic_latency_us * 1e-6),
            nvlink_ps: 0,
            nic_bytes: bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::fixtures::h100_cluster;

    fn a100_cluster(nodes: u32) -> Cluster {
        let mut c = h100_cluster(nodes);
        c.gpu.name = "A100-SXM4-80GB".into();
        c.nvlink_gbps = 2400.0;
        c.nic_gbps = 200.0;
        c
    }

    fn shape(ranks: u32, nodes: u32, per_node: u32) -> GroupShape {
        GroupShape {
            ranks,
            nodes,
            per_node,
        }
    }

    /// A large all-reduce inside an A100 node (no NVLS) is NCCL's Simple ring: latency
    /// `8.4 + 14 x 3.4` us (tuning.cc's base and NVLink hop costs), bandwidth `2 (n-1)/n S`
    /// over the NVLink rate.
    #[test]
    fn intra_node_all_reduce_is_the_simple_ring_closed_form() {
        let c = a100_cluster(1);
        let p = CommParams::a100();
        let bytes = 64u64 << 20;
        let plan = plan_collective(Collective::AllReduce, bytes, shape(8, 1, 8), &c, &p);
        assert_eq!(
            (plan.algorithm, plan.protocol),
            (Algorithm::Ring, Protocol::Simple)
        );
        let alpha = (8.4 + 14.0 * 3.4) * 1e-6 * p.latency_scale;
        let beta = 2.0 * 7.0 / 8.0 * bytes as f64 / nvlink_bytes_per_s(&c, &p);
        let got = plan.idle_seconds(&c, &p);
        assert!(
            (got - (alpha + beta)).abs() < 1e-9,
            "{got} vs {}",
            alpha + beta
        );
    }

    /// Inside an A100 node the tuner's choice over a sweep of sizes equals the cheapest of the
    /// six closed forms written out from tuning.cc (B = NVLink bandwidth, n = 8):
    /// ring LL `15.0 us + 1.75 S / (B/4)` (and at least `S / 87.7 GB/s`), ring LL128 `40.6 us +
    /// 1.75 S / (0.92 B)`, ring Simple `56.0 us + 1.75 S / B`, tree LL `15.2 us + 2 S / (0.92 B /
    /// 3.8)`, tree LL128 `31.5 us + 2 S / (0.92 x 7/9 B)`, tree Simple `56.0 us + 2 S / (0.92 B)`;
    /// and the protocol only ever moves from LL towards Simple as the size grows.
    #[test]
    fn choice_is_the_cheapest_nccl_closed_form() {
        let c = a100_cluster(1);
        // NCCL's own latency (scale 1): the choice and the price agree.
        let p = CommParams {
            latency_scale: 1.0,
            ..CommParams::a100()
        };
        let bw = nvlink_bytes_per_s(&c, &p);
        let forms = |s: f64| {
            [
                (
                    Algorithm::Tree,
                    Protocol::Ll,
                    15.2e-6 + (2.0 * s / (0.92 / 3.8 * bw)).max(s / 87.7e9),
                ),
                (
                    Algorithm::Tree,
                    Protocol::Ll128,
                    31.5e-6 + 2.0 * s / (0.92 * 7.0 / 9.0 * bw),
                ),
                (
                    Algorithm::Tree,
                    Protocol::Simple,
                    56.0e-6 + 2.0 * s / (0.92 * bw),
                ),
                (
                    Algorithm::Ring,
                    Protocol::Ll,
                    15.0e-6 + (1.75 * s / (bw / 4.0)).max(s / 87.7e9),
                ),
                (
                    Algorithm::Ring,
                    Protocol::Ll128,
                    40.6e-6 + 1.75 * s / (0.92 * bw),
                ),
                (Algorithm::Ring, Protocol::Simple, 56.0e-6 + 1.75 * s / bw),
            ]
        };
        let mut last = Protocol::Ll;
        let mut seen = std::collections::BTreeSet::new();
        for e in 0..=50 {
            let s = 1024.0 * 2f64.powf(e as f64 * 0.5);
            let plan = plan_collective(Collective::AllReduce, s as u64, shape(8, 1, 8), &c, &p);
            let all = forms((s as u64) as f64);
            let best = all
                .iter()
                .fold(all[0], |b, x| if x.2 < b.2 { *x } else { b });
            assert_eq!((plan.algorithm, plan.protocol), (best.0, best.1), "{s} B");
            let got = plan.idle_seconds(&c, &p);
            assert!(
                (got - best.2).abs() < 1e-9 + 1e-9 * best.2,
                "{s} B: {got} vs {}",
                best.2
            );
            assert!(
                plan.protocol >= last,
                "{s} B: {:?} after {last:?}",
                plan.protocol
            );
            last = plan.protocol;
            seen.insert(plan.protocol);
        }
        // All three protocols appear between 1 KiB and 32 GiB.
        assert_eq!(seen.len(), 3);
    }

    /// NVLS (NVLink SHARP) takes a large all-reduce inside a Hopper node, never on Ampere, and
    /// never a small one (its 25 us switch latency loses to LL).
    #[test]
    fn nvls_only_on_hopper_and_for_large_all_reduces() {
        let h = h100_cluster(1);
        let ph = CommParams::h100();
        let big = plan_collective(Collective::AllReduce, 256 << 20, shape(8, 1, 8), &h, &ph);
        assert_eq!(big.algorithm, Algorithm::Nvls);
        let small = plan_collective(Collective::AllReduce, 4096, shape(8, 1, 8), &h, &ph);
        assert_eq!(
            (small.algorithm, small.protocol),
            (Algorithm::Ring, Protocol::Ll)
        );
        let a = a100_cluster(1);
        let pa = CommParams::a100();
        let big_a = plan_collective(Collective::AllReduce, 256 << 20, shape(8, 1, 8), &a, &pa);
        assert_eq!(big_a.algorithm, Algorithm::Ring);
        // All-gather and reduce-scatter stay on the ring.
        let ag = plan_collective(Collective::AllGather, 256 << 20, shape(8, 1, 8), &h, &ph);
        assert_eq!(ag.algorithm, Algorithm::Ring);
    }

    /// Latency terms grow with the group: linearly in ranks for the ring, with `log2(nodes)`
    /// for the tree, exactly as tuning.cc writes them.
    #[test]
    fn latency_grows_with_the_group() {
        let arch = Arch::Hopper;
        for nodes in [2u32, 4, 16, 64, 256] {
            let sh = shape(nodes, nodes, 1);
            let n = nodes as f64;
            // Reduce-scatter ring, Simple: n - 1 steps, all of them across nodes.
            let rs = nccl_latency_s(
                Collective::ReduceScatter,
                Algorithm::Ring,
                Protocol::Simple,
                sh,
                arch,
                1,
            );
            let want = (8.4 + (n - 1.0) * 14.0) * 1e-6;
            assert!((rs - want).abs() < 1e-12, "{nodes}: {rs} vs {want}");
            // All-reduce ring, LL: 2 (n-1) steps, 2 n of them counted across nodes.
            let ar = nccl_latency_s(
                Collective::AllReduce,
                Algorithm::Ring,
                Protocol::Ll,
                sh,
                arch,
                1,
            );
            let want = (6.6 + (2.0 * (n - 1.0) - 2.0 * n) * 1.0 + 2.0 * n * 2.7) * 1e-6;
            assert!((ar - want).abs() < 1e-12, "{nodes}: {ar} vs {want}");
            // Tree, LL: 2 log2(nodes) network hops.
            let tree = nccl_latency_s(
                Collective::AllReduce,
                Algorithm::Tree,
                Protocol::Ll,
                sh,
                arch,
                1,
            );
            let want = (6.8 + 2.0 * n.log2() * 5.0) * 1e-6;
            assert!((tree - want).abs() < 1e-12, "{nodes}: {tree} vs {want}");
        }
        // The plateau of a large multi-node Simple ring all-reduce (x1.4 from sm80 on).
        let sh = shape(16, 2, 8);
        let small = nccl_latency_s(
            Collective::AllReduce,
            Algorithm::Ring,
            Protocol::Simple,
            sh,
            arch,
            1,
        );
        let large = nccl_latency_s(
            Collective::AllReduce,
            Algorithm::Ring,
            Protocol::Simple,
            sh,
            arch,
            1 << 30,
        );
        assert!((large / small - 1.4).abs() < 1e-12);
    }

    #[test]
    fn inter_node_ring_bytes_split_over_nics() {
        let c = h100_cluster(4);
        let p = CommParams::default();
        let bytes = 1u64 << 30;
        // 32 ranks, 8 per node: each NIC carries 1/8 of 2 * 31/32 * S.
        let plan = plan_collective(
            Collective::AllReduce,
            bytes,
            GroupShape {
                ranks: 32,
                nodes: 4,
                per_node: 8,
            },
            &c,
            &p,
        );
        let expect = (2.0 * 31.0 / 32.0 * bytes as f64 / 8.0).ceil() as u64;
        assert_eq!(plan.nic_bytes, expect);
        // Reduce-scatter moves half of an all-reduce.
        let rs = plan_collective(
            Collective::ReduceScatter,
            bytes,
            GroupShape {
                ranks: 32,
                nodes: 4,
                per_node: 8,
            },
            &c,
            &p,
        );
        assert!((rs.nic_bytes as f64 - expect as f64 / 2.0).abs() <= 1.0);
    }

    #[test]
    fn tree_wins_for_small_messages_on_many_nodes() {
        let c = h100_cluster(512);
        let p = CommParams::default();
        let shape = GroupShape {
            ranks: 512,
            nodes: 512,
            per_node: 1,
        };
        let small = plan_collective(Collective::AllReduce, 1024, shape, &c, &p);
        assert_eq!(small.algorithm, Algorithm::Tree);
        let rs = plan_collective(Collective::ReduceScatter, 1024, shape, &c, &p);
        assert_eq!(rs.algorithm, Algorithm::Ring);
        assert!(small.latency_ps < rs.latency_ps);
    }

    #[test]
    fn single_rank_group_is_free() {
        let c = h100_cluster(1);
        let plan = plan_collective(
            Collective::AllReduce,
            1 << 20,
            GroupShape {
                ranks: 1,
                nodes: 1,
                per_node: 1,
            },
            &c,
            &CommParams::default(),
        );
        assert_eq!(plan.idle_seconds(&c, &CommParams::default()), 0.0);
    }
}
