//! Collective communication cost: NCCL-style ring and tree algorithms on a two-level topology
//! (NVLink inside a node, one NIC per GPU across nodes), in the alpha-beta form.
//!
//! A collective over `n` ranks spread as `per_node` ranks on each of `nodes` nodes is priced as
//! a *plan*: a fixed latency (alpha: launch overhead plus one hop latency per algorithm step) and
//! the bytes each GPU pushes through NVLink and through its NIC (beta). The engine turns the NIC
//! bytes into a network flow that shares links with other traffic; on an idle network the
//! duration is the closed form [`CommPlan::idle_seconds`].
//!
//! Ring (NCCL): with `per_node = k` ranks per node NCCL runs `k` channels, each ring leaving
//! every node through a different NIC, so each NIC carries `1/k` of the ring traffic and NVLink
//! carries the rest:
//! - all-reduce: each rank sends `2 (n-1)/n * S`; reduce-scatter / all-gather: `(n-1)/n * S`
//!   (S = the full, unsharded buffer); all-to-all: `(n-1)/n * S`.
//! - steps: all-reduce `2 (n-1)`, reduce-scatter / all-gather `n - 1`; all-to-all 1 (pairwise
//!   exchanges proceed concurrently).
//!
//! Tree (all-reduce only, NCCL's double binary tree across nodes, chain inside a node): the same
//! bytes per NIC as the ring at large sizes, but `2 * ceil(log2(nodes))` inter-node steps instead
//! of `2 (n - 1)`, so it wins for small messages on many nodes. The cheaper of the two is used,
//! as NCCL's tuner does.

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
}

impl Collective {
    /// Short name for traces and reports.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
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
        // NVLink from the fastest 64 MiB all-reduce of the Megatron A100 Kineto trace (582 us
        // over 8 GPUs); the NIC from the published A100 runs (docs/calibration.md).
        CommParams {
            nvlink_efficiency: 0.702,
            nic_efficiency: 0.947,
            launch_us: 10.0,
        }
    }

    /// H100/H200 (DGX H100: NVLink 4 + NVSwitch, NDR InfiniBand / 400G RoCE).
    pub fn h100() -> Self {
        // Fitted on the published H100 runs (docs/calibration.md).
        CommParams {
            nvlink_efficiency: 0.865,
            nic_efficiency: 0.943,
            launch_us: 10.0,
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

/// Plans a collective of `bytes` over a group of `shape` on `cluster`.
pub fn plan_collective(
    op: Collective,
    bytes: u64,
    shape: GroupShape,
    cluster: &Cluster,
    params: &CommParams,
) -> CommPlan {
    let n = shape.ranks.max(1) as f64;
    let k = shape.per_node.max(1) as f64;
    let launch = params.launch_us * 1e-6;
    if shape.ranks <= 1 {
        return CommPlan {
            algorithm: Algorithm::Ring,
            latency_ps: 0,
            nvlink_ps: 0,
            nic_bytes: 0,
        };
    }
    let s = bytes as f64;
    let (factor, steps) = match op {
        Collective::AllReduce => (2.0 * (n - 1.0) / n, 2.0 * (n - 1.0)),
        Collective::AllGather | Collective::ReduceScatter => ((n - 1.0) / n, n - 1.0),
        Collective::AllToAll => ((n - 1.0) / n, 1.0),
    };
    let per_rank = factor * s;
    let nvl_bw = nvlink_bytes_per_s(cluster, params);
    let nvl_lat = cluster.nvlink_latency_us * 1e-6;
    let nic_lat = cluster.nic_latency_us * 1e-6;
    if shape.nodes <= 1 {
        let t = per_rank / nvl_bw;
        return CommPlan {
            algorithm: Algorithm::Ring,
            latency_ps: ps(launch + steps * nvl_lat),
            nvlink_ps: ps(t),
            nic_bytes: 0,
        };
    }
    // Across nodes. All-to-all: the share of a rank's data bound for other nodes crosses its NIC.
    let (nic_bytes, nvl_bytes) = match op {
        Collective::AllToAll => {
            let remote = (n - k) / n * s;
            (remote, (k - 1.0) / n * s)
        }
        _ => (per_rank / k, per_rank * (k - 1.0) / k),
    };
    let ring_latency = launch + steps * nic_lat.max(nvl_lat);
    let mut plan = CommPlan {
        algorithm: Algorithm::Ring,
        latency_ps: ps(ring_latency),
        nvlink_ps: ps(nvl_bytes / nvl_bw),
        nic_bytes: nic_bytes.ceil() as u64,
    };
    if op == Collective::AllReduce {
        let depth = (shape.nodes as f64).log2().ceil();
        let tree_latency = launch + 2.0 * depth * nic_lat + 2.0 * (k - 1.0) * nvl_lat;
        if tree_latency < ring_latency {
            plan.algorithm = Algorithm::Tree;
            plan.latency_ps = ps(tree_latency);
        }
    }
    plan
}

/// Plans a point-to-point send of `bytes`; `same_node` selects NVLink.
pub fn plan_p2p(bytes: u64, same_node: bool, cluster: &Cluster, params: &CommParams) -> CommPlan {
    let launch = params.launch_us * 1e-6;
    if same_node {
        CommPlan {
            algorithm: Algorithm::P2p,
            latency_ps: ps(launch + cluster.nvlink_latency_us * 1e-6),
            nvlink_ps: ps(bytes as f64 / nvlink_bytes_per_s(cluster, params)),
            nic_bytes: 0,
        }
    } else {
        CommPlan {
            algorithm: Algorithm::P2p,
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

    #[test]
    fn intra_node_all_reduce_matches_alpha_beta() {
        let c = h100_cluster(1);
        let p = CommParams::default();
        let bytes = 64u64 << 20;
        let plan = plan_collective(
            Collective::AllReduce,
            bytes,
            GroupShape {
                ranks: 8,
                nodes: 1,
                per_node: 8,
            },
            &c,
            &p,
        );
        let alpha = p.launch_us * 1e-6 + 14.0 * c.nvlink_latency_us * 1e-6;
        let beta =
            2.0 * 7.0 / 8.0 * bytes as f64 / (c.nvlink_gbps * 1e9 / 8.0 * p.nvlink_efficiency);
        let got = plan.idle_seconds(&c, &p);
        assert!(
            (got - (alpha + beta)).abs() < 1e-9,
            "{got} vs {}",
            alpha + beta
        );
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
