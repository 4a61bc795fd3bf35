//! Flow-level network: links with capacities, flows that cross them, and max-min fair sharing.
//!
//! The scale-out fabric is a rail-optimized fat tree: GPU `g`'s NIC has a transmit and a receive
//! link; the NICs of local index `r` (a rail) on a group of `rail_group_nodes` nodes hang off one
//! leaf switch, whose uplink and downlink to the spine have `rail_group_nodes x NIC / oversubscription`
//! capacity. Above the spine, an optional aggregation tier joins *pods* of `pod_nodes` nodes
//! (a three-tier Clos, as Meta's clusters: pods of 3,072 GPUs at full bisection joined at 1:7,
//! Dubey et al. 2024 Sec. 3.3.1): each pod has one uplink and one downlink of
//! `pod GPUs x NIC / pod_oversubscription`, crossed by every transfer between pods. With
//! `ecmp_flows > 0` those are the pod's real ports instead (`pod GPUs / pod_oversubscription`
//! of NIC rate each), and every connection's traffic is split into `ecmp_flows` flows (RoCE
//! queue pairs; Meta's E-ECMP uses 16) each hashed onto one port, deterministically from
//! (source, destination, flow): large flows that collide on a port share it. NVLink inside a
//! node is non-blocking and priced by the cost model, not here.
//!
//! A *flow* is a unit of traffic with one rate that crosses a set of links, each `count` times:
//! a point-to-point send crosses `nic_tx(src)`, maybe `up(leaf src)`/`down(leaf dst)`, and
//! `nic_rx(dst)` once each; a ring collective is one flow (its steps move in lock step) crossing
//! every edge of the ring. Rates are the max-min fair allocation (progressive filling): every
//! unfrozen flow's rate rises together until a link saturates, whose flows then freeze.
//!
//! Everything is integer: capacities in bytes/s, progress in byte-picoseconds-per-second, so
//! results are exact and independent of the order flows were added in. Rates are recomputed
//! only for the connected component (flows linked through shared links) that changed.

use crate::job::Cluster;
use crate::units::SimTime;

/// A link id.
pub type LinkId = u32;
/// A flow id (slot in the flow table; reused after the flow ends).
pub type FlowId = u32;

/// The scale-out links of a cluster and how GPUs route over them.
#[derive(Clone, Debug)]
pub struct Fabric {
    gpus_per_node: u32,
    rail_group_nodes: u32,
    nodes: u32,
    /// Leaf up/down links can limit traffic (oversubscription > 1). At 1:1 or better they
    /// never can: every flow through a leaf's uplink also leaves through one of that leaf's
    /// NICs, whose capacities add up to the uplink's, so max-min rates are the same without
    /// them and routes leave them out.
    leaf_links_bind: bool,
    /// Nodes per pod (the whole cluster when there is no aggregation tier).
    pod_nodes: u32,
    /// Pod up/down links can limit traffic: more than one pod and oversubscription > 1 (the
    /// same argument as for leaf links).
    pod_links_bind: bool,
    /// First pod link id.
    pod_base: LinkId,
    /// ECMP flows per connection (0: no hashing, one aggregated link per pod and direction).
    ecmp: u32,
    /// With ECMP: each pod's first port link and its port count.
    pod_ports: Vec<(LinkId, u32)>,
    /// Capacity of every link, bytes per second.
    pub capacity: Vec<u64>,
    /// Multi-DC clusters: the WAN links ([`crate::wan`]).
    wan: WanFabric,
}

/// The WAN part of a [`Fabric`]: datacenter of each node and the directed WAN links (empty for
/// a single-DC cluster).
#[derive(Clone, Debug, Default)]
struct WanFabric {
    /// Datacenter of each node; empty with one datacenter.
    dc_of_node: Vec<u32>,
    /// First WAN link id (directed link `d` of the job's WAN is `base + d`).
    base: LinkId,
    /// Directed WAN links (relative) from DC `a` to DC `b`: `paths[a][b]`.
    paths: Vec<Vec<Vec<u32>>>,
    /// One-way latency of each directed WAN link, ps.
    latency: Vec<SimTime>,
    /// Per-transfer throughput cap of each directed WAN link, bytes/s.
    cap: Vec<u64>,
    /// Pipeline sends take turns on WAN links.
    temporal: bool,
}

impl Fabric {
    /// Builds the fabric for `cluster` with a NIC rate of `nic_bytes_per_s`.
    pub fn new(cluster: &Cluster, nic_bytes_per_s: u64) -> Self {
        let gpus = cluster.num_gpus() as u32;
        let gpn = cluster.gpus_per_node;
        let rg = cluster.topology.rail_group_nodes.max(1);
        let groups = cluster.nodes.div_ceil(rg);
        let mut capacity = vec![nic_bytes_per_s; 2 * gpus as usize];
        for g in 0..groups {
            let nodes_in_group = rg.min(cluster.nodes - g * rg) as f64;
            let up = (nodes_in_group * nic_bytes_per_s as f64 / cluster.topology.oversubscription)
                .round()
                .max(1.0) as u64;
            for _rail in 0..gpn {
                capacity.push(up);
                capacity.push(up);
            }
        }
        let t = &cluster.topology;
        let pod_nodes = if t.pod_nodes == 0 {
            cluster.nodes
        } else {
            t.pod_nodes.min(cluster.nodes)
        };
        let pods = cluster.nodes.div_ceil(pod_nodes);
        let pod_base = capacity.len() as LinkId;
        // Aggregated pod links bind only when oversubscribed; hashed ports can collide at any
        // ratio.
        let ecmp = if pods > 1 { t.ecmp_flows } else { 0 };
        let pod_links_bind = pods > 1 && (t.pod_oversubscription > 1.0 || ecmp > 0);
        let mut pod_ports = Vec::new();
        if pod_links_bind {
            for p in 0..pods {
                let nodes_in_pod = pod_nodes.min(cluster.nodes - p * pod_nodes) as f64;
                let trunk =
                    nodes_in_pod * gpn as f64 * nic_bytes_per_s as f64 / t.pod_oversubscription;
                if ecmp > 0 {
                    let ports = (trunk / nic_bytes_per_s as f64).round().max(1.0) as u32;
                    pod_ports.push((capacity.len() as LinkId, ports));
                    for _ in 0..ports {
                        capacity.push(nic_bytes_per_s);
                        capacity.push(nic_bytes_per_s);
                    }
                } else {
                    let up = trunk.round().max(1.0) as u64;
                    capacity.push(up);
                    capacity.push(up);
                }
            }
        }
        let w = &cluster.topology.wan;
        let mut wan = WanFabric::default();
        if w.is_multi() {
            wan.dc_of_node = w.dc_of_nodes(cluster.nodes);
            wan.base = capacity.len() as LinkId;
            wan.paths = w
                .paths()
                .into_iter()
                .map(|row| row.into_iter().map(Option::unwrap_or_default).collect())
                .collect();
            for l in &w.links {
                for _dir in 0..2 {
                    capacity.push(l.bytes_per_s());
                    wan.latency.push(l.one_way_ps());
                    wan.cap.push(l.transfer_cap());
                }
            }
            wan.temporal = w.sharing == crate::wan::WanSharing::Temporal;
        }
        Fabric {
            wan,
            leaf_links_bind: cluster.topology.oversubscription > 1.0,
            pod_nodes,
            pod_links_bind,
            pod_base,
            ecmp,
            pod_ports,
            gpus_per_node: gpn,
            rail_group_nodes: rg,
            nodes: cluster.nodes,
            capacity,
        }
    }

    /// Number of links.
    pub fn num_links(&self) -> usize {
        self.capacity.len()
    }

    /// Transmit link of GPU `g`'s NIC.
    pub fn nic_tx(&self, g: u32) -> LinkId {
        2 * g
    }

    /// Receive link of GPU `g`'s NIC.
    pub fn nic_rx(&self, g: u32) -> LinkId {
        2 * g + 1
    }

    fn leaf(&self, g: u32) -> u32 {
        let node = g / self.gpus_per_node;
        let rail = g % self.gpus_per_node;
        (node / self.rail_group_nodes) * self.gpus_per_node + rail
    }

    fn leaf_up(&self, leaf: u32) -> LinkId {
        2 * self.nodes * self.gpus_per_node + 2 * leaf
    }

    fn pod(&self, g: u32) -> u32 {
        g / self.gpus_per_node / self.pod_nodes
    }

    fn pod_up(&self, pod: u32) -> LinkId {
        self.pod_base + 2 * pod
    }

    /// The flows one connection's traffic is split into: every link of a route is crossed
    /// this many times (once per flow), and a transfer of `B` bytes is a flow of `B / split`
    /// bytes at the per-flow rate ([`Fabric::flow_bytes`]). 1 without ECMP.
    pub fn flow_split(&self) -> u32 {
        self.ecmp.max(1)
    }

    /// Bytes of one of the [`Fabric::flow_split`] flows a transfer of `bytes` is split into.
    pub fn flow_bytes(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.flow_split() as u64)
    }

    /// ECMP: the port link (up, or down with `down`) of `pod` that flow `q` of the connection
    /// `src -> dst` hashes to.
    fn pod_port(&self, pod: u32, src: u32, dst: u32, q: u32, down: bool) -> LinkId {
        let (base, ports) = self.pod_ports[pod as usize];
        let key = (src as u64) << 32 | dst as u64;
        let h = mix64(key ^ mix64(((q as u64) << 1 | down as u64) + 0x9e37_79b9_7f4a_7c15));
        base + 2 * (h % ports as u64) as LinkId + down as LinkId
    }

    /// What a link is, for symmetry checks: 0/1 NIC transmit/receive, 2/3 leaf up/down, 4/5
    /// pod up/down, 6/7 WAN (one direction / the other).
    pub fn link_type(&self, l: LinkId) -> usize {
        if self.is_wan(l) {
            return 6 + ((l - self.wan.base) % 2) as usize;
        }
        let base = if l < 2 * self.nodes * self.gpus_per_node {
            0
        } else if l < self.pod_base {
            2
        } else {
            4
        };
        base + (l % 2) as usize
    }

    /// True when link `l` is a WAN link.
    pub fn is_wan(&self, l: LinkId) -> bool {
        !self.wan.dc_of_node.is_empty() && l >= self.wan.base
    }

    /// Index of WAN link `l` among the directed WAN links (`2 i` and `2 i + 1` for the two
    /// directions of the job's link `i`); `None` for other links.
    pub fn wan_index(&self, l: LinkId) -> Option<u32> {
        self.is_wan(l).then(|| l - self.wan.base)
    }

    /// True when the cluster spans several datacenters.
    pub fn is_multi_dc(&self) -> bool {
        !self.wan.dc_of_node.is_empty()
    }

    /// Pipeline sends take turns on WAN links ([`crate::wan::WanSharing::Temporal`]).
    pub fn wan_temporal(&self) -> bool {
        self.wan.temporal
    }

    /// Datacenter of GPU `g` (0 in a single-DC cluster).
    pub fn dc(&self, g: u32) -> u32 {
        if self.wan.dc_of_node.is_empty() {
            0
        } else {
            self.wan.dc_of_node[(g / self.gpus_per_node) as usize]
        }
    }

    /// One-way WAN latency from GPU `src` to GPU `dst`: the sum of RTT / 2 over the WAN links
    /// of the path (0 inside a datacenter).
    pub fn wan_latency_ps(&self, src: u32, dst: u32) -> SimTime {
        let (a, b) = (self.dc(src), self.dc(dst));
        if a == b {
            return 0;
        }
        self.wan.paths[a as usize][b as usize]
            .iter()
            .map(|&d| self.wan.latency[d as usize])
            .sum()
    }

    /// The throughput cap of one flow over `links` (bytes/s): the tightest per-transfer cap of
    /// the WAN links it crosses, divided over the connection's [`Fabric::flow_split`] flows;
    /// `u64::MAX` when it crosses none.
    pub fn flow_cap(&self, links: &[(LinkId, u32)]) -> u64 {
        links
            .iter()
            .filter(|&&(l, _)| self.is_wan(l))
            .map(|&(l, _)| self.wan.cap[(l - self.wan.base) as usize] / self.flow_split() as u64)
            .min()
            .map_or(u64::MAX, |c| c.max(1))
    }

    fn push_wan_path(&self, src: u32, dst: u32, count: u32, out: &mut Vec<(LinkId, u32)>) {
        let (a, b) = (self.dc(src), self.dc(dst));
        if a != b {
            for &d in &self.wan.paths[a as usize][b as usize] {
                out.push((self.wan.base + d, count));
            }
        }
    }

    /// True when `a` and `b` are on one node (the transfer uses NVLink, not the fabric).
    pub fn same_node(&self, a: u32, b: u32) -> bool {
        a / self.gpus_per_node == b / self.gpus_per_node
    }

    /// Appends the links a transfer from GPU `src` to GPU `dst` on different nodes crosses.
    pub fn route(&self, src: u32, dst: u32, out: &mut Vec<(LinkId, u32)>) {
        debug_assert!(!self.same_node(src, dst));
        let k = self.flow_split();
        out.push((self.nic_tx(src), k));
        let (ls, ld) = (self.leaf(src), self.leaf(dst));
        if ls != ld && self.leaf_links_bind {
            out.push((self.leaf_up(ls), k));
            out.push((self.leaf_up(ld) + 1, k));
        }
        let (ps, pd) = (self.pod(src), self.pod(dst));
        if ps != pd && self.pod_links_bind {
            if self.ecmp > 0 {
                for q in 0..self.ecmp {
                    out.push((self.pod_port(ps, src, dst, q, false), 1));
                    out.push((self.pod_port(pd, src, dst, q, true), 1));
                }
            } else {
                out.push((self.pod_up(ps), 1));
                out.push((self.pod_up(pd) + 1, 1));
            }
        }
        if self.is_multi_dc() {
            self.push_wan_path(src, dst, k, out);
        }
        out.push((self.nic_rx(dst), k));
    }

    /// Appends the links of a ring collective over `members` (ring order) that spans nodes:
    /// one channel per member slot on a node, each crossing every node boundary once.
    pub fn ring_links(&self, members: &[u32], out: &mut Vec<(LinkId, u32)>) {
        // Members grouped by node, in ring order of first appearance.
        let mut nodes: Vec<(u32, Vec<u32>)> = Vec::new();
        for &m in members {
            let node = m / self.gpus_per_node;
            match nodes.iter_mut().find(|(n, _)| *n == node) {
                Some((_, v)) => v.push(m),
                None => nodes.push((node, vec![m])),
            }
        }
        if nodes.len() < 2 {
            return;
        }
        let channels = nodes.iter().map(|(_, v)| v.len()).max().unwrap_or(1);
        for c in 0..channels {
            for j in 0..nodes.len() {
                let a = &nodes[j].1;
                let b = &nodes[(j + 1) % nodes.len()].1;
                self.route(a[c % a.len()], b[c % b.len()], out);
            }
        }
        normalize(out);
    }

    /// Appends the links of an all-to-all over `members` spanning nodes: every member's NIC in
    /// both directions, plus each leaf's uplink/downlink for the share of peers behind other leaves.
    pub fn all_to_all_links(&self, members: &[u32], out: &mut Vec<(LinkId, u32)>) {
        let n = members.len() as u32;
        let mut leaves: Vec<(u32, u32)> = Vec::new();
        let mut pods: Vec<(u32, u32)> = Vec::new();
        let count = |v: &mut Vec<(u32, u32)>, k: u32| match v.iter_mut().find(|(x, _)| *x == k) {
            Some((_, c)) => *c += 1,
            None => v.push((k, 1)),
        };
        let k = self.flow_split();
        for &m in members {
            out.push((self.nic_tx(m), k));
            out.push((self.nic_rx(m), k));
            count(&mut leaves, self.leaf(m));
            count(&mut pods, self.pod(m));
        }
        // c members of a leaf (pod) each send (n - c)/n of their bytes outside it; counted in
        // whole flows.
        let crossing = |c: u32| (c as u64 * (n - c) as u64).div_ceil(n as u64) as u32;
        if leaves.len() > 1 && self.leaf_links_bind {
            for &(l, c) in &leaves {
                if crossing(c) > 0 {
                    out.push((self.leaf_up(l), k * crossing(c)));
                    out.push((self.leaf_up(l) + 1, k * crossing(c)));
                }
            }
        }
        if pods.len() > 1 && self.pod_links_bind {
            for &(p, c) in &pods {
                let units = crossing(c);
                if units == 0 {
                    continue;
                }
                if self.ecmp > 0 {
                    // Many pairs' flows: spread round-robin over the pod's ports from a
                    // hashed start (no pair dominates a port).
                    let (base, ports) = self.pod_ports[p as usize];
                    let start = mix64(members[0] as u64 ^ (p as u64) << 32) % ports as u64;
                    for u in 0..(units * k) as u64 {
                        let port = base + 2 * ((start + u) % ports as u64) as LinkId;
                        out.push((port, 1));
                        out.push((port + 1, 1));
                    }
                } else {
                    out.push((self.pod_up(p), units));
                    out.push((self.pod_up(p) + 1, units));
                }
            }
        }
        if self.is_multi_dc() {
            // c_a members in DC a send c_b / n of their bytes to DC b over the path a -> b.
            let mut dcs: Vec<(u32, u32, u32)> = Vec::new(); // (dc, count, a member)
            for &m in members {
                let d = self.dc(m);
                match dcs.iter_mut().find(|(x, _, _)| *x == d) {
                    Some((_, c, _)) => *c += 1,
                    None => dcs.push((d, 1, m)),
                }
            }
            for &(_, ca, ma) in &dcs {
                for &(_, cb, mb) in &dcs {
                    if ma != mb {
                        let units = (ca as u64 * cb as u64).div_ceil(n as u64) as u32;
                        self.push_wan_path(ma, mb, k * units, out);
                    }
                }
            }
        }
        normalize(out);
    }
}

/// A 64-bit mixing function (SplitMix64's finaliser): ECMP's deterministic hash.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sorts link usages and merges duplicates by adding their counts.
pub fn normalize(links: &mut Vec<(LinkId, u32)>) {
    links.sort_unstable();
    let mut w = 0;
    for i in 0..links.len() {
        if w > 0 && links[w - 1].0 == links[i].0 {
            links[w - 1].1 += links[i].1;
        } else {
            links[w] = links[i];
            w += 1;
        }
    }
    links.truncate(w);
}

#[derive(Clone, Debug, Default)]
struct Flow {
    links: Vec<(LinkId, u32)>,
    /// Bytes left x 10^12 (so that rate [B/s] x dt [ps] subtracts exactly).
    remaining: u128,
    rate: u64,
    updated: SimTime,
    generation: u32,
    active: bool,
    token: u64,
    /// Rate alone on its links: its tightest link's capacity per use (and at most `cap`).
    solo_rate: u64,
    /// Throughput cap of the flow itself, bytes/s (`u64::MAX`: none).
    cap: u64,
}

/// A completion the engine must schedule: flow `flow` (of `generation`) ends at `time`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowEnd {
    /// Flow.
    pub flow: FlowId,
    /// Generation; a later rate change makes earlier completions stale.
    pub generation: u32,
    /// Completion time.
    pub time: SimTime,
}

/// Active flows on a [`Fabric`], with max-min fair rates.
#[derive(Clone, Debug)]
pub struct Network {
    capacity: Vec<u64>,
    link_flows: Vec<Vec<FlowId>>,
    flows: Vec<Flow>,
    free: Vec<FlowId>,
    dirty: Vec<LinkId>,
    link_mark: Vec<u32>,
    flow_mark: Vec<u32>,
    epoch: u32,
    // Scratch, reused across recomputations.
    comp_links: Vec<LinkId>,
    comp_flows: Vec<FlowId>,
    rem: Vec<u64>,
    weight: Vec<u64>,
    frozen: Vec<bool>,
    new_rate: Vec<u64>,
    live: Vec<LinkId>,
    tied: Vec<LinkId>,
    /// Number of rate recomputations (for diagnostics).
    pub recomputations: u64,
    /// Progressive-filling rounds and links scanned (for diagnostics).
    pub rounds: u64,
    /// Links scanned by progressive filling (for diagnostics).
    pub scanned: u64,
    /// Settle calls (for diagnostics).
    pub settles: u64,
    /// Flows added (for diagnostics).
    pub adds: u64,
    /// Flows in recomputed components (for diagnostics).
    pub comp_flow_total: u64,
}

impl Network {
    /// An idle network over `capacity` (bytes/s per link).
    pub fn new(capacity: Vec<u64>) -> Self {
        assert!(
            capacity.iter().all(|&c| c > 0),
            "links need positive capacity"
        );
        let n = capacity.len();
        Network {
            capacity,
            link_flows: vec![Vec::new(); n],
            flows: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            link_mark: vec![0; n],
            flow_mark: Vec::new(),
            epoch: 0,
            comp_links: Vec::new(),
            comp_flows: Vec::new(),
            rem: vec![0; n],
            weight: vec![0; n],
            frozen: Vec::new(),
            new_rate: Vec::new(),
            live: Vec::new(),
            tied: Vec::new(),
            recomputations: 0,
            rounds: 0,
            scanned: 0,
            settles: 0,
            adds: 0,
            comp_flow_total: 0,
        }
    }

    /// Starts a flow of `bytes` over `links` at `now`; `token` comes back when it ends.
    /// Its rate is set by the next [`Network::settle`].
    pub fn add(&mut self, now: SimTime, links: &[(LinkId, u32)], bytes: u64, token: u64) -> FlowId {
        self.add_capped(now, links, bytes, token, u64::MAX)
    }

    /// [`Network::add`] for a flow whose own rate may not exceed `cap` bytes/s (a WAN transfer
    /// limited by its TCP windows): max-min sharing gives it `min(cap, fair share)` and the
    /// rest to the others.
    pub fn add_capped(
        &mut self,
        now: SimTime,
        links: &[(LinkId, u32)],
        bytes: u64,
        token: u64,
        cap: u64,
    ) -> FlowId {
        assert!(
            !links.is_empty() && bytes > 0,
            "a flow needs links and bytes"
        );
        self.adds += 1;
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.flows.push(Flow::default());
                self.flow_mark.push(0);
                self.frozen.push(false);
                self.new_rate.push(0);
                (self.flows.len() - 1) as FlowId
            }
        };
        let f = &mut self.flows[id as usize];
        f.links.clear();
        f.links.extend_from_slice(links);
        f.remaining = bytes as u128 * 1_000_000_000_000;
        f.rate = 0;
        f.updated = now;
        f.generation = f.generation.wrapping_add(1);
        f.active = true;
        f.token = token;
        f.solo_rate = links
            .iter()
            .map(|&(l, c)| self.capacity[l as usize] / c as u64)
            .min()
            .unwrap_or(1)
            .min(cap)
            .max(1);
        f.cap = cap.max(1);
        for &(l, _) in links {
            self.link_flows[l as usize].push(id);
        }
        // One link marks the whole component dirty: the flow joins its links into one. (The
        // component is found from the first dirty link popped, the last one pushed, so pushing
        // only the last link keeps the order in which components are recomputed.)
        self.dirty.push(links[links.len() - 1].0);
        id
    }

    /// True when the completion `end` is still the flow's current one.
    pub fn is_current(&self, end: &FlowEnd) -> bool {
        let f = &self.flows[end.flow as usize];
        f.active && f.generation == end.generation
    }

    /// Ends `flow` (its completion fired); returns its token.
    pub fn finish(&mut self, flow: FlowId) -> u64 {
        let f = &mut self.flows[flow as usize];
        assert!(f.active, "finishing an inactive flow");
        f.active = false;
        f.generation = f.generation.wrapping_add(1);
        let token = f.token;
        let links = std::mem::take(&mut f.links);
        for &(l, _) in &links {
            let v = &mut self.link_flows[l as usize];
            let pos = v
                .iter()
                .position(|&x| x == flow)
                .expect("flow registered on its link");
            v.swap_remove(pos);
            // A link left with no flow has nothing to recompute; one that still carries flows
            // may now be in a smaller component of its own.
            if !v.is_empty() {
                self.dirty.push(l);
            }
        }
        self.flows[flow as usize].links = links;
        self.free.push(flow);
        token
    }

    /// True when some rates must be recomputed before time advances.
    pub fn needs_settle(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Current rate of an active flow, bytes/s.
    pub fn rate(&self, flow: FlowId) -> u64 {
        self.flows[flow as usize].rate
    }

    /// Recomputes max-min fair rates of every component touched since the last call, at `now`,
    /// and appends the new completion times of flows whose rate changed to `out`.
    pub fn settle(&mut self, now: SimTime, out: &mut Vec<FlowEnd>) {
        self.settles += 1;
        // Links marked with an epoch after this one were recomputed in this call.
        let mut first = self.epoch;
        while let Some(start) = self.dirty.pop() {
            // Already recomputed with an earlier component of this call.
            if self.link_mark[start as usize] > first {
                continue;
            }
            self.epoch = self.epoch.wrapping_add(1);
            if self.epoch == 0 {
                self.link_mark.iter_mut().for_each(|m| *m = 0);
                self.flow_mark.iter_mut().for_each(|m| *m = 0);
                self.epoch = 1;
                // Earlier components of this call lost their marks; recomputing one again
                // gives the same rates and reports nothing.
                first = 0;
            }
            self.collect_component(start);
            if !self.comp_flows.is_empty() {
                self.fill(now, out);
            }
        }
    }

    fn collect_component(&mut self, start: LinkId) {
        let epoch = self.epoch;
        self.comp_links.clear();
        self.comp_flows.clear();
        self.link_mark[start as usize] = epoch;
        self.comp_links.push(start);
        let mut i = 0;
        while i < self.comp_links.len() {
            let l = self.comp_links[i] as usize;
            i += 1;
            for &f in &self.link_flows[l] {
                if self.flow_mark[f as usize] == epoch {
                    continue;
                }
                self.flow_mark[f as usize] = epoch;
                self.comp_flows.push(f);
                for &(l2, _) in &self.flows[f as usize].links {
                    if self.link_mark[l2 as usize] != epoch {
                        self.link_mark[l2 as usize] = epoch;
                        self.comp_links.push(l2);
                    }
                }
            }
        }
    }

    /// Progressive filling over the current component.
    fn fill(&mut self, now: SimTime, out: &mut Vec<FlowEnd>) {
        self.recomputations += 1;
        self.comp_flow_total += self.comp_flows.len() as u64;
        if let [f] = self.comp_flows[..] {
            // A flow alone on its links runs at its tightest link's rate.
            self.new_rate[f as usize] = self.flows[f as usize].solo_rate;
            self.apply_rates(now, out);
            return;
        }
        for &l in &self.comp_links {
            self.rem[l as usize] = self.capacity[l as usize];
            self.weight[l as usize] = 0;
        }
        for &f in &self.comp_flows {
            self.frozen[f as usize] = false;
            for &(l, c) in &self.flows[f as usize].links {
                self.weight[l as usize] += c as u64;
            }
        }
        let mut unfrozen = self.comp_flows.len();
        let capped = self
            .comp_flows
            .iter()
            .any(|&f| self.flows[f as usize].cap != u64::MAX);
        // Links still carrying unfrozen flows; shrinks as links saturate.
        let mut live = std::mem::take(&mut self.live);
        let mut tied = std::mem::take(&mut self.tied);
        live.clear();
        live.extend_from_slice(&self.comp_links);
        while unfrozen > 0 {
            live.retain(|&l| self.weight[l as usize] > 0);
            self.rounds += 1;
            self.scanned += live.len() as u64;
            // The smallest fair share rem/w, compared exactly as rationals.
            let mut best = live[0];
            for &l in &live[1..] {
                let lhs = self.rem[l as usize] as u128 * self.weight[best as usize] as u128;
                let rhs = self.rem[best as usize] as u128 * self.weight[l as usize] as u128;
                if lhs < rhs {
                    best = l;
                }
            }
            let (br, bw) = (
                self.rem[best as usize] as u128,
                self.weight[best as usize] as u128,
            );
            // Every link at exactly that share saturates in this round (order independent).
            tied.clear();
            tied.extend(live.iter().copied().filter(|&l| {
                self.rem[l as usize] as u128 * bw == br * self.weight[l as usize] as u128
            }));
            let rate = ((br / bw) as u64).max(1);
            if capped {
                // A flow capped below the fair share freezes at its cap first; its leftover
                // stays with the links for the others.
                let min_cap = self
                    .comp_flows
                    .iter()
                    .filter(|&&f| !self.frozen[f as usize])
                    .map(|&f| self.flows[f as usize].cap)
                    .min()
                    .unwrap_or(u64::MAX);
                if (min_cap as u128) * bw < br {
                    for k in 0..self.comp_flows.len() {
                        let f = self.comp_flows[k] as usize;
                        if self.frozen[f] || self.flows[f].cap != min_cap {
                            continue;
                        }
                        self.frozen[f] = true;
                        self.new_rate[f] = min_cap;
                        unfrozen -= 1;
                        for &(l, c) in &self.flows[f].links {
                            let l = l as usize;
                            self.rem[l] = self.rem[l].saturating_sub(min_cap * c as u64);
                            self.weight[l] -= c as u64;
                        }
                    }
                    continue;
                }
            }
            for &link in &tied {
                let on_link = std::mem::take(&mut self.link_flows[link as usize]);
                for &f in &on_link {
                    if self.frozen[f as usize] || self.flow_mark[f as usize] != self.epoch {
                        continue;
                    }
                    self.frozen[f as usize] = true;
                    self.new_rate[f as usize] = rate;
                    unfrozen -= 1;
                    for &(l, c) in &self.flows[f as usize].links {
                        let l = l as usize;
                        self.rem[l] = self.rem[l].saturating_sub(rate * c as u64);
                        self.weight[l] -= c as u64;
                    }
                }
                self.link_flows[link as usize] = on_link;
            }
        }
        self.live = live;
        self.tied = tied;
        self.apply_rates(now, out);
    }

    /// Moves every flow of the component to its new rate, keeping its progress, and reports
    /// the new completion time of each flow whose rate changed.
    fn apply_rates(&mut self, now: SimTime, out: &mut Vec<FlowEnd>) {
        for &f in &self.comp_flows {
            let flow = &mut self.flows[f as usize];
            let rate = self.new_rate[f as usize];
            if flow.rate == rate {
                continue;
            }
            let dt = now - flow.updated;
            flow.remaining = flow
                .remaining
                .saturating_sub(flow.rate as u128 * dt as u128);
            flow.updated = now;
            flow.rate = rate;
            flow.generation = flow.generation.wrapping_add(1);
            // Held at the time range; the engine refuses an event beyond it.
            let left = flow
                .remaining
                .div_ceil(rate as u128)
                .min(crate::units::TIME_LIMIT as u128);
            out.push(FlowEnd {
                flow: f,
                generation: flow.generation,
                time: now + left as u64,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settle(net: &mut Network, now: SimTime) -> Vec<FlowEnd> {
        let mut out = Vec::new();
        net.settle(now, &mut out);
        out
    }

    #[test]
    fn single_flow_gets_the_link() {
        let mut net = Network::new(vec![1_000_000_000, 500_000_000]);
        let f = net.add(0, &[(0, 1), (1, 1)], 1_000_000, 7);
        let ends = settle(&mut net, 0);
        assert_eq!(net.rate(f), 500_000_000);
        // 1 MB at 0.5 GB/s = 2 ms.
        assert_eq!(
            ends,
            vec![FlowEnd {
                flow: f,
                generation: ends[0].generation,
                time: 2_000_000_000
            }]
        );
        assert_eq!(net.finish(f), 7);
    }

    #[test]
    fn max_min_fair_classic_example() {
        // Links A (cap 10) and B (cap 4). f1 on A, f2 on A and B, f3 on B.
        // Max-min: B is the bottleneck: f2 = f3 = 2; then f1 = 10 - 2 = 8.
        let mut net = Network::new(vec![10, 4]);
        let f1 = net.add(0, &[(0, 1)], 100, 1);
        let f2 = net.add(0, &[(0, 1), (1, 1)], 100, 2);
        let f3 = net.add(0, &[(1, 1)], 100, 3);
        settle(&mut net, 0);
        assert_eq!((net.rate(f1), net.rate(f2), net.rate(f3)), (8, 2, 2));
        // When f3 ends, B (4 for f2 alone) is still tighter than A's half (5): f2 = 4, f1 = 6.
        net.finish(f3);
        settle(&mut net, 10);
        assert_eq!((net.rate(f1), net.rate(f2)), (6, 4));
    }

    #[test]
    fn counts_weight_a_link() {
        // A ring crossing a link twice gets half the rate there.
        let mut net = Network::new(vec![100]);
        let f = net.add(0, &[(0, 2)], 100, 0);
        settle(&mut net, 0);
        assert_eq!(net.rate(f), 50);
    }

    #[test]
    fn progress_is_kept_across_rate_changes() {
        let mut net = Network::new(vec![1_000]);
        let a = net.add(0, &[(0, 1)], 1_000, 0); // alone: 1 s
        settle(&mut net, 0);
        // After 0.5 s a second flow arrives: a has 500 B left at 500 B/s -> ends at 1.5 s.
        let b = net.add(500_000_000_000, &[(0, 1)], 1_000, 1);
        let ends = settle(&mut net, 500_000_000_000);
        let ea = ends.iter().find(|e| e.flow == a).unwrap();
        assert_eq!(ea.time, 1_500_000_000_000);
        assert!(ends.iter().any(|e| e.flow == b));
    }

    fn pod_cluster(nodes: u32, pod_nodes: u32, pod_over: f64) -> Cluster {
        let mut c = crate::job::fixtures::h100_cluster(nodes);
        c.topology.rail_group_nodes = 1;
        c.topology.pod_nodes = pod_nodes;
        c.topology.pod_oversubscription = pod_over;
        c
    }

    /// Closed form: the 8 GPUs of node 0 each send B bytes to their rail peer on node 1 in
    /// the other pod. Pods of one node at 1:4 give each pod 8 NICs / 4 = 2 NICs of uplink,
    /// so every flow gets NIC / 4 and ends at 4 B / NIC; without the pod tier, B / NIC.
    #[test]
    fn pod_uplink_shares_its_capacity() {
        let nic = 50_000_000_000u64; // 400 Gb/s
        let bytes = 100_000_000u64;
        for (over, expect_rate) in [(4.0, nic / 4), (1.0, nic)] {
            let fabric = Fabric::new(&pod_cluster(2, 1, over), nic);
            let mut net = Network::new(fabric.capacity.clone());
            let mut flows = Vec::new();
            for g in 0..8 {
                let mut links = Vec::new();
                fabric.route(g, 8 + g, &mut links);
                assert_eq!(
                    links
                        .iter()
                        .filter(|&&(l, _)| fabric.link_type(l) >= 4)
                        .count(),
                    if over > 1.0 { 2 } else { 0 },
                    "pod links on the route at 1:{over}"
                );
                flows.push(net.add(0, &links, bytes, g as u64));
            }
            let ends = settle(&mut net, 0);
            for &f in &flows {
                assert_eq!(net.rate(f), expect_rate, "1:{over}");
            }
            let t = bytes as u128 * 1_000_000_000_000 / expect_rate as u128;
            assert!(
                ends.iter().all(|e| e.time as u128 == t),
                "1:{over}: {ends:?}"
            );
        }
    }

    /// Inside a pod nothing changes; between pods a ring crosses each pod's uplink and
    /// downlink once per channel, as it crosses every node boundary.
    #[test]
    fn rings_cross_pods_once_per_boundary() {
        let fabric = Fabric::new(&pod_cluster(4, 2, 7.0), 1_000);
        let mut links = Vec::new();
        fabric.route(0, 8, &mut links); // nodes 0 and 1: same pod
        assert!(links.iter().all(|&(l, _)| fabric.link_type(l) < 4));
        // One GPU per node on rail 0, nodes 0..4: pods {0,1} and {2,3}; the ring 0-1-2-3-0
        // crosses from pod 0 to pod 1 once and back once.
        links.clear();
        fabric.ring_links(&[0, 8, 16, 24], &mut links);
        let per_type = |t: usize| -> u32 {
            links
                .iter()
                .filter(|&&(l, _)| fabric.link_type(l) == t)
                .map(|&(_, c)| c)
                .sum()
        };
        assert_eq!((per_type(4), per_type(5)), (2, 2));
        assert_eq!((per_type(0), per_type(1)), (4, 4));
        // Uplink capacity: 2 nodes x 8 GPUs x NIC / 7.
        let up = links
            .iter()
            .find(|&&(l, _)| fabric.link_type(l) == 4)
            .unwrap()
            .0;
        assert_eq!(
            fabric.capacity[up as usize],
            (16.0f64 * 1_000.0 / 7.0).round() as u64
        );
    }

    /// ECMP on the pod ports. Two pods of one node at 1:1: 8 ports of NIC rate per pod. The
    /// 8 GPUs of node 0 each send B bytes to their rail peer in the other pod.
    /// Closed forms: a connection split into Q flows crosses its NICs Q times and exactly Q up
    /// and Q down ports; with Q = 1 the flows through the most loaded port (load k, counted
    /// from the routes) get NIC / k under max-min, so the last transfer ends at k B / NIC; more
    /// flows per connection (E-ECMP) spread the load and end no later; nothing beats B / NIC.
    #[test]
    fn ecmp_collisions_follow_the_port_loads() {
        let nic = 50_000_000_000u64;
        let bytes = 64_000_000u64;
        let mut last_end = Vec::new();
        for q in [1u32, 16] {
            let mut c = pod_cluster(2, 1, 1.0);
            c.topology.ecmp_flows = q;
            let fabric = Fabric::new(&c, nic);
            assert_eq!(fabric.flow_split(), q);
            let mut net = Network::new(fabric.capacity.clone());
            let mut port_load: std::collections::BTreeMap<LinkId, u32> = Default::default();
            for g in 0..8 {
                let mut links = Vec::new();
                fabric.route(g, 8 + g, &mut links);
                let mut again = Vec::new();
                fabric.route(g, 8 + g, &mut again);
                assert_eq!(links, again, "hashing is deterministic");
                let count = |t: usize| -> u32 {
                    links
                        .iter()
                        .filter(|&&(l, _)| fabric.link_type(l) == t)
                        .map(|&(_, c)| c)
                        .sum()
                };
                assert_eq!((count(0), count(1), count(4), count(5)), (q, q, q, q));
                for &(l, c) in &links {
                    if fabric.link_type(l) >= 4 {
                        *port_load.entry(l).or_default() += c;
                    }
                }
                normalize(&mut links);
                net.add(0, &links, fabric.flow_bytes(bytes), g as u64);
            }
            let ends = settle(&mut net, 0);
            let end = ends.iter().map(|e| e.time).max().unwrap() as u128;
            let alone = bytes as u128 * 1_000_000_000_000 / nic as u128;
            if q == 1 {
                let k = *port_load.values().max().unwrap() as u128;
                // Integer rates (NIC / k rounded down) may end a picosecond late.
                assert!(
                    end.abs_diff(k * alone) <= 1,
                    "plain ECMP: the most loaded port (load {k}) sets the end: {end} vs {}",
                    k * alone
                );
                assert!(
                    k > 1,
                    "this hash happens to collide; a test of collisions needs one"
                );
            }
            assert!(end + 1 >= alone);
            last_end.push(end);
        }
        assert!(
            last_end[1] <= last_end[0],
            "E-ECMP ended later: {last_end:?}"
        );
    }

    /// A two-DC cluster of `nodes` nodes (half in each), one WAN link.
    fn two_dc(nodes: u32, gbps: f64, rtt_ms: f64, window_mib: f64, conns: u32) -> Cluster {
        let mut c = crate::job::fixtures::h100_cluster(nodes);
        c.topology.wan = crate::wan::Wan {
            datacenters: vec![
                crate::wan::Datacenter {
                    name: "a".into(),
                    nodes: nodes / 2,
                },
                crate::wan::Datacenter {
                    name: "b".into(),
                    nodes: nodes - nodes / 2,
                },
            ],
            links: vec![crate::wan::WanLink {
                a: 0,
                b: 1,
                gbps,
                rtt_ms,
                tcp_window_mib: window_mib,
                connections: conns,
            }],
            sharing: Default::default(),
        };
        c
    }

    /// Closed form: a lone transfer of B bytes between DCs ends at
    /// RTT/2 + B / min(link, connections x window / RTT) (the NICs are faster than both).
    #[test]
    fn lone_wan_transfer_closed_form() {
        let bytes = 1_000_000_000u64;
        let (gbps, rtt_ms, window) = (100.0, 40.0, 16.0);
        for conns in [1u32, 4, 16, 1000] {
            let c = two_dc(2, gbps, rtt_ms, window, conns);
            c.topology.wan.validate(c.nodes).unwrap();
            let fabric = Fabric::new(&c, 50_000_000_000);
            let mut links = Vec::new();
            fabric.route(0, 8, &mut links);
            assert_eq!(links.iter().filter(|&&(l, _)| fabric.is_wan(l)).count(), 1);
            let mut net = Network::new(fabric.capacity.clone());
            let f = net.add_capped(0, &links, bytes, 0, fabric.flow_cap(&links));
            let ends = settle(&mut net, 0);
            let link = gbps * 1e9 / 8.0;
            let cap = conns as f64 * window * 1024.0 * 1024.0 / (rtt_ms * 1e-3);
            let expect_s = rtt_ms * 1e-3 / 2.0 + bytes as f64 / link.min(cap);
            let got_s = (fabric.wan_latency_ps(0, 8) + ends[0].time) as f64 * 1e-12;
            assert!(
                (got_s - expect_s).abs() / expect_s < 1e-9,
                "{conns} connections: {got_s} s vs closed form {expect_s} s"
            );
            assert_eq!(net.rate(f) as f64, link.min(cap).round());
            // Inside a DC nothing crosses the WAN.
            assert_eq!(fabric.wan_latency_ps(0, 7), 0);
        }
    }

    /// Max-min with caps: a flow capped below its fair share takes its cap and the leftover goes
    /// to the others (link 100: caps 10 and none -> 10 and 90; three flows, one capped at 50
    /// above the fair share 33 -> all 33).
    #[test]
    fn capped_flows_leave_their_share_to_others() {
        let mut net = Network::new(vec![100]);
        let a = net.add_capped(0, &[(0, 1)], 1000, 0, 10);
        let b = net.add(0, &[(0, 1)], 1000, 1);
        settle(&mut net, 0);
        assert_eq!((net.rate(a), net.rate(b)), (10, 90));
        let mut net = Network::new(vec![99]);
        let fs = [
            net.add_capped(0, &[(0, 1)], 1000, 0, 50),
            net.add(0, &[(0, 1)], 1000, 1),
            net.add(0, &[(0, 1)], 1000, 2),
        ];
        settle(&mut net, 0);
        assert!(fs.iter().all(|&f| net.rate(f) == 33));
        // Alone, a capped flow runs at its cap.
        let mut net = Network::new(vec![100]);
        let f = net.add_capped(0, &[(0, 1)], 1000, 0, 7);
        settle(&mut net, 0);
        assert_eq!(net.rate(f), 7);
    }

    /// Three DCs in a chain: traffic between the ends crosses both links and both latencies.
    #[test]
    fn wan_paths_cross_intermediate_datacenters() {
        let mut c = two_dc(3, 10.0, 20.0, 16.0, 1);
        let w = &mut c.topology.wan;
        w.datacenters = (0..3)
            .map(|i| crate::wan::Datacenter {
                name: format!("dc{i}"),
                nodes: 1,
            })
            .collect();
        let mut l2 = w.links[0].clone();
        (l2.a, l2.b, l2.rtt_ms) = (1, 2, 30.0);
        w.links.push(l2);
        w.validate(3).unwrap();
        let fabric = Fabric::new(&c, 1_000_000);
        assert_eq!(fabric.wan_latency_ps(0, 16), 25_000_000_000);
        let mut links = Vec::new();
        fabric.route(0, 16, &mut links);
        assert_eq!(links.iter().filter(|&&(l, _)| fabric.is_wan(l)).count(), 2);
        // Unconnected DCs are refused.
        c.topology.wan.links.pop();
        assert!(c.topology.wan.validate(3).is_err());
    }
}
