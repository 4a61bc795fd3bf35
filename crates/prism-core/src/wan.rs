//! Several datacenters joined by a wide-area network (WAN).
//!
//! A multi-DC cluster is the same cluster of identical nodes, split into datacenters that own
//! consecutive node ranges (DC 0 the first `nodes[0]` nodes, and so on). Traffic between two
//! GPUs in different DCs crosses, besides its NICs, the WAN links of the shortest path (fewest
//! hops, ties broken by link order) between the two DCs. A WAN link is a pair of directed links
//! in the flow-level [`Network`](crate::network::Network) with:
//!
//! - a capacity (`gbps`), shared max-min fairly like any link, or taken in turns
//!   ([`WanSharing::Temporal`], ATLAS's temporal bandwidth sharing, applied by the engine to
//!   pipeline sends);
//! - a one-way latency of `rtt / 2`, added to every transfer that crosses it (per hop);
//! - a per-flow throughput cap: one TCP connection moves at most `window / RTT` (the
//!   bandwidth-delay product), so a transfer split over `connections` connections moves at most
//!   `connections x window / RTT`. Max-min sharing honours the cap: a capped flow takes
//!   `min(cap, fair share)` and what it leaves goes to the others.
//!
//! The default [`Wan`] has no datacenter: the cluster is one DC and nothing changes.

use crate::job::JobError;
use crate::units::SimTime;

/// One datacenter.
#[derive(Clone, Debug, PartialEq)]
pub struct Datacenter {
    /// Name (job file key `wan.datacenters`).
    pub name: String,
    /// Nodes in it.
    pub nodes: u32,
}

/// A WAN link between two datacenters (both directions, each with the full capacity).
#[derive(Clone, Debug, PartialEq)]
pub struct WanLink {
    /// One end (datacenter index).
    pub a: u32,
    /// The other end (datacenter index).
    pub b: u32,
    /// Capacity per direction, Gb/s (gigabits).
    pub gbps: f64,
    /// Round-trip time, milliseconds.
    pub rtt_ms: f64,
    /// TCP window of one connection, MiB.
    pub tcp_window_mib: f64,
    /// TCP connections one transfer is split over.
    pub connections: u32,
}

impl WanLink {
    /// Capacity per direction, bytes/s.
    pub fn bytes_per_s(&self) -> u64 {
        ((self.gbps * 1e9 / 8.0).round() as u64).max(1)
    }

    /// One-way latency (RTT / 2), ps.
    pub fn one_way_ps(&self) -> SimTime {
        (self.rtt_ms * 1e-3 / 2.0 * 1e12).round() as SimTime
    }

    /// Throughput cap of one transfer: `connections x window / RTT`, bytes/s (unbounded when
    /// the RTT is zero).
    pub fn transfer_cap(&self) -> u64 {
        if self.rtt_ms <= 0.0 {
            return u64::MAX;
        }
        let per_conn = self.tcp_window_mib * 1024.0 * 1024.0 / (self.rtt_ms * 1e-3);
        ((self.connections as f64 * per_conn).round() as u64).max(1)
    }
}

/// How pipeline transfers share a WAN link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WanSharing {
    /// Max-min fair sharing among everything in flight.
    #[default]
    Fair,
    /// Temporal sharing (ATLAS): pipeline sends that cross a WAN link take turns owning it,
    /// in the order the 1F1B schedules reach it; a transfer moves alone at the link rate (or its
    /// cap) and the next pipeline's transfer starts when it ends. Collectives still share fairly.
    Temporal,
}

impl WanSharing {
    /// The job-file name.
    pub fn name(self) -> &'static str {
        match self {
            WanSharing::Fair => "fair",
            WanSharing::Temporal => "temporal",
        }
    }
}

/// Datacenters and the WAN between them. Empty: a single-DC cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Wan {
    /// Datacenters in node order; empty for a single-DC cluster.
    pub datacenters: Vec<Datacenter>,
    /// WAN links.
    pub links: Vec<WanLink>,
    /// How pipeline transfers share the links.
    pub sharing: WanSharing,
}

impl Wan {
    /// Datacenters `dc0, dc1, ...` with `nodes` nodes each, every pair joined by a link with
    /// `link`'s figures (its ends are overwritten); fair sharing.
    pub fn full_mesh(nodes: &[u32], link: &WanLink) -> Wan {
        let n = nodes.len() as u32;
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                links.push(WanLink {
                    a,
                    b,
                    ..link.clone()
                });
            }
        }
        Wan {
            datacenters: nodes
                .iter()
                .enumerate()
                .map(|(i, &nodes)| Datacenter {
                    name: format!("dc{i}"),
                    nodes,
                })
                .collect(),
            links,
            sharing: WanSharing::Fair,
        }
    }

    /// True when the cluster spans more than one datacenter.
    pub fn is_multi(&self) -> bool {
        self.datacenters.len() > 1
    }

    /// Datacenter of each node (all 0 without datacenters).
    pub fn dc_of_nodes(&self, nodes: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(nodes as usize);
        for (i, dc) in self.datacenters.iter().enumerate() {
            out.extend(std::iter::repeat_n(i as u32, dc.nodes as usize));
        }
        out.resize(nodes as usize, 0);
        out
    }

    /// For every ordered pair of datacenters, the directed WAN links (`2 i` for `a -> b` of link
    /// `i`, `2 i + 1` for `b -> a`) of the shortest path; `None` where unreachable.
    pub fn paths(&self) -> Vec<Vec<Option<Vec<u32>>>> {
        let n = self.datacenters.len();
        let mut out = vec![vec![None; n]; n];
        for (src, row) in out.iter_mut().enumerate() {
            // Breadth-first search; neighbours in link order (deterministic).
            let mut prev: Vec<Option<(usize, u32)>> = vec![None; n];
            let mut seen = vec![false; n];
            seen[src] = true;
            let mut queue = std::collections::VecDeque::from([src]);
            while let Some(u) = queue.pop_front() {
                for (i, l) in self.links.iter().enumerate() {
                    let (a, b) = (l.a as usize, l.b as usize);
                    let (v, dir) = if a == u {
                        (b, 2 * i as u32)
                    } else if b == u {
                        (a, 2 * i as u32 + 1)
                    } else {
                        continue;
                    };
                    if !seen[v] {
                        seen[v] = true;
                        prev[v] = Some((u, dir));
                        queue.push_back(v);
                    }
                }
            }
            for (dst, slot) in row.iter_mut().enumerate() {
                if dst == src {
                    *slot = Some(Vec::new());
                    continue;
                }
                if !seen[dst] {
                    continue;
                }
                let mut path = Vec::new();
                let mut v = dst;
                while let Some((u, dir)) = prev[v] {
                    path.push(dir);
                    v = u;
                }
                path.reverse();
                *slot = Some(path);
            }
        }
        out
    }

    /// Checks the datacenters and links against a cluster of `nodes` nodes.
    pub fn validate(&self, nodes: u32) -> Result<(), JobError> {
        if self.datacenters.is_empty() {
            if !self.links.is_empty() {
                return Err(JobError::new(
                    "wan.links",
                    "needs wan.datacenters (links join named datacenters)",
                ));
            }
            return Ok(());
        }
        if self.datacenters.len() > 64 {
            return Err(JobError::new(
                "wan.datacenters",
                format!("at most 64 datacenters (got {})", self.datacenters.len()),
            ));
        }
        let mut total = 0u64;
        for (i, dc) in self.datacenters.iter().enumerate() {
            if dc.nodes == 0 {
                return Err(JobError::new(
                    "wan.datacenter_nodes",
                    format!("datacenter `{}` must have at least one node", dc.name),
                ));
            }
            if self.datacenters[..i].iter().any(|d| d.name == dc.name) {
                return Err(JobError::new(
                    "wan.datacenters",
                    format!("datacenter `{}` is named twice", dc.name),
                ));
            }
            total += dc.nodes as u64;
        }
        if total != nodes as u64 {
            return Err(JobError::new(
                "wan.datacenter_nodes",
                format!(
                    "the datacenters' nodes must add up to cluster.nodes = {nodes} (they add up \
                     to {total})"
                ),
            ));
        }
        let n = self.datacenters.len() as u32;
        for (i, l) in self.links.iter().enumerate() {
            if l.a >= n || l.b >= n || l.a == l.b {
                return Err(JobError::new(
                    "wan.links",
                    format!("link {i} must join two different datacenters"),
                ));
            }
            if self.links[..i]
                .iter()
                .any(|m| (m.a, m.b) == (l.a, l.b) || (m.a, m.b) == (l.b, l.a))
            {
                return Err(JobError::new(
                    "wan.links",
                    format!(
                        "datacenters `{}` and `{}` are joined twice",
                        self.datacenters[l.a as usize].name, self.datacenters[l.b as usize].name
                    ),
                ));
            }
            for (key, v, lo, hi) in [
                ("wan.link_gbps", l.gbps, 1e-3, 1e6),
                ("wan.link_rtt_ms", l.rtt_ms, 0.0, 1e4),
                ("wan.tcp_window_mib", l.tcp_window_mib, 1e-3, 1e6),
            ] {
                if !(v.is_finite() && (lo..=hi).contains(&v)) {
                    return Err(JobError::new(
                        key,
                        format!("link {i}: must be in [{lo}, {hi}] (got {v})"),
                    ));
                }
            }
            if l.connections == 0 || l.connections > 65_536 {
                return Err(JobError::new(
                    "wan.connections",
                    format!("link {i}: must be in [1, 65536] (got {})", l.connections),
                ));
            }
        }
        let paths = self.paths();
        for (a, row) in paths.iter().enumerate() {
            if let Some(b) = row.iter().position(|p| p.is_none()) {
                return Err(JobError::new(
                    "wan.links",
                    format!(
                        "datacenters `{}` and `{}` are not connected by any path of WAN links",
                        self.datacenters[a].name, self.datacenters[b].name
                    ),
                ));
            }
        }
        Ok(())
    }
}
