//! The link graph inside one node: every GPU pair's NVLink count, NVSwitch fabric and PCIe level.
//!
//! Pair scores use go-gpuallocator's scale (PCIe points plus 100 per NVLink lane) so that our choices
//! can be compared with NVIDIA's, but NVSwitch lanes are counted, which upstream misses.

use petgraph::graph::{NodeIndex, UnGraph};
use serde::{Deserialize, Serialize};

/// PCIe path between two GPUs, named as `nvidia-smi topo -m` names it, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PcieLevel {
    /// Through at most one PCIe switch.
    #[serde(rename = "PIX")]
    Pix,
    /// Through several PCIe switches, no host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Through a PCIe host bridge (the CPU).
    #[serde(rename = "PHB")]
    Phb,
    /// Between host bridges inside one NUMA node.
    #[serde(rename = "NODE")]
    Node,
    /// Across the inter-socket link.
    #[serde(rename = "SYS")]
    Sys,
}

impl PcieLevel {
    pub fn points(self) -> u32 {
        match self {
            PcieLevel::Pix => 50,
            PcieLevel::Pxb => 40,
            PcieLevel::Phb => 30,
            PcieLevel::Node => 20,
            PcieLevel::Sys => 10,
        }
    }
}

/// How NVLink lanes end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NvlinkFabric {
    /// Lanes go straight to the peer GPU.
    Direct,
    /// Lanes go into NVSwitch chips: every pair talks at the switch's bandwidth.
    Nvswitch,
    #[default]
    None,
}

/// One GPU pair's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Link {
    pub nvlinks: u32,
    pub pcie: PcieLevel,
}

impl Link {
    /// PCIe points plus 100 per NVLink lane (direct or through NVSwitch).
    pub fn score(&self) -> u32 {
        self.pcie.points() + 100 * self.nvlinks
    }
}

/// The GPU link graph of one node, with a dense pair-score table for the hot paths.
#[derive(Debug, Clone)]
pub struct GpuTopology {
    graph: UnGraph<u32, Link>,
    fabric: NvlinkFabric,
    n: usize,
    pair_scores: Vec<u32>,
    /// Best set score per set size on the empty board, computed on first use.
    best_by_size: std::sync::OnceLock<Vec<u32>>,
    /// `connect(g, free)` for every GPU and free set of small boards, computed on first use.
    connect_table: std::sync::OnceLock<Vec<u32>>,
    /// Unique per constructed graph (clones share it: same content), so memoized GPU choices can be
    /// keyed by board without comparing graphs.
    id: u64,
}

static NEXT_TOPOLOGY_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Why a topology description was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("link {a}-{b} names a GPU outside 0..{n}")]
    LinkOutOfRange { a: u32, b: u32, n: usize },
    #[error("link {a}-{b} joins a GPU to itself")]
    SelfLink { a: u32, b: u32 },
    #[error("link {a}-{b} is given twice")]
    DuplicateLink { a: u32, b: u32 },
}

impl GpuTopology {
    /// Builds the graph; pairs without a link entry are taken as `default_pcie` with no NVLink.
    pub fn new(
        n: usize,
        fabric: NvlinkFabric,
        links: impl IntoIterator<Item = (u32, u32, Link)>,
        default_pcie: PcieLevel,
    ) -> Result<Self, TopologyError> {
        let mut graph = UnGraph::<u32, Link>::with_capacity(n, n * n.saturating_sub(1) / 2);
        for i in 0..n {
            graph.add_node(i as u32);
        }
        let mut seen = vec![false; n * n];
        for (a, b, link) in links {
            if a as usize >= n || b as usize >= n {
                return Err(TopologyError::LinkOutOfRange { a, b, n });
            }
            if a == b {
                return Err(TopologyError::SelfLink { a, b });
            }
            let (lo, hi) = (a.min(b) as usize, a.max(b) as usize);
            if std::mem::replace(&mut seen[lo * n + hi], true) {
                return Err(TopologyError::DuplicateLink { a, b });
            }
            graph.add_edge(NodeIndex::new(lo), NodeIndex::new(hi), link);
        }
        for lo in 0..n {
            for hi in lo + 1..n {
                if !seen[lo * n + hi] {
                    graph.add_edge(NodeIndex::new(lo), NodeIndex::new(hi), Link { nvlinks: 0, pcie: default_pcie });
                }
            }
        }
        let mut pair_scores = vec![0; n * n];
        for e in graph.edge_indices() {
            let (a, b) = graph.edge_endpoints(e).expect("edge from edge_indices");
            let s = graph[e].score();
            pair_scores[a.index() * n + b.index()] = s;
            pair_scores[b.index() * n + a.index()] = s;
        }
        let id = NEXT_TOPOLOGY_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            graph,
            fabric,
            n,
            pair_scores,
            best_by_size: std::sync::OnceLock::new(),
            connect_table: std::sync::OnceLock::new(),
            id,
        })
    }

    /// A node whose GPUs all hang off one host bridge and have no NVLink: the assumption for nodes
    /// that publish no topology (the trace's nodes, for instance).
    pub fn flat(n: usize) -> Self {
        Self::new(n, NvlinkFabric::None, [], PcieLevel::Phb).expect("a flat topology has no links to refuse")
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// An identifier no other constructed topology has (a clone keeps it: it has the same links).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn fabric(&self) -> NvlinkFabric {
        self.fabric
    }

    /// The link between two distinct GPUs.
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        let e = self.graph.find_edge(NodeIndex::new(a), NodeIndex::new(b))?;
        Some(self.graph[e])
    }

    /// Iterates over every GPU pair with its link.
    pub fn links(&self) -> impl Iterator<Item = (usize, usize, Link)> + '_ {
        self.graph.edge_indices().filter_map(move |e| {
            let (a, b) = self.graph.edge_endpoints(e)?;
            Some((a.index().min(b.index()), a.index().max(b.index()), self.graph[e]))
        })
    }

    #[inline]
    pub fn pair_score(&self, a: usize, b: usize) -> u32 {
        self.pair_scores[a * self.n + b]
    }

    /// How strongly GPU `g` is linked to the GPUs in `set` (a bitmask of GPU indices below 64): the
    /// sum of its pair scores with them. The share choice asks this for every candidate GPU of every
    /// node, so boards of up to 8 GPUs answer from a table (8 KiB) built on first use.
    pub fn connect(&self, g: usize, set: u64) -> u64 {
        const TABLE_GPUS: usize = 8;
        if self.n <= TABLE_GPUS && g < self.n {
            let masks = 1usize << self.n;
            // u32 entries keep the table at 8 KiB; it stays empty if a sum would not fit
            let table = self.connect_table.get_or_init(|| {
                let mut t = Vec::with_capacity(masks * self.n);
                for a in 0..self.n {
                    for m in 0..masks {
                        match u32::try_from(self.connect_by_row(a, m as u64)) {
                            Ok(v) => t.push(v),
                            Err(_) => return Vec::new(),
                        }
                    }
                }
                t
            });
            let m = (set & (masks as u64 - 1)) as usize;
            if let Some(&v) = table.get(g * masks + m) {
                return u64::from(v);
            }
        }
        self.connect_by_row(g, set)
    }

    fn connect_by_row(&self, g: usize, set: u64) -> u64 {
        let row = self.pair_scores.get(g * self.n..(g + 1) * self.n).unwrap_or(&[]);
        row.iter().take(64).enumerate().map(|(o, &p)| u64::from(p) * ((set >> o) & 1)).sum()
    }

    /// The highest set score any `k` GPUs of this board reach (0 for k < 2 or k > n): the yardstick
    /// for "how good is this set" that does not depend on the board type.
    pub fn best_set_score(&self, k: usize) -> u32 {
        let table = self.best_by_size.get_or_init(|| (0..=self.n).map(|k| self.search_best(k)).collect());
        table.get(k).copied().unwrap_or(0)
    }

    fn search_best(&self, k: usize) -> u32 {
        if k < 2 || k > self.n {
            return 0;
        }
        if self.n <= 16 {
            let all: Vec<usize> = (0..self.n).collect();
            self.best_subset(&all, k).map_or(0, |(score, _)| score)
        } else {
            // boards this large are rare; a greedy set is a fine yardstick there
            let mut set = vec![0];
            while set.len() < k {
                let next = (0..self.n)
                    .filter(|g| !set.contains(g))
                    .max_by_key(|&g| set.iter().map(|&s| self.pair_score(s, g)).sum::<u32>());
                set.extend(next);
            }
            self.set_score(&set)
        }
    }

    /// The highest-scoring set of `k` GPUs drawn from `gpus`, by exhaustive search (first found on
    /// ties); `None` when `k` is 0 or more than `gpus` holds.
    pub fn best_subset(&self, gpus: &[usize], k: usize) -> Option<(u32, Vec<usize>)> {
        fn rec(
            t: &GpuTopology,
            gpus: &[usize],
            start: usize,
            k: usize,
            set: &mut Vec<usize>,
            score: u32,
            best: &mut Option<(u32, Vec<usize>)>,
        ) {
            if set.len() == k {
                if best.as_ref().is_none_or(|(b, _)| score > *b) {
                    *best = Some((score, set.clone()));
                }
                return;
            }
            for i in start..=gpus.len() - (k - set.len()) {
                let g = gpus[i];
                let add: u32 = set.iter().map(|&o| t.pair_score(o, g)).sum();
                set.push(g);
                rec(t, gpus, i + 1, k, set, score + add, best);
                set.pop();
            }
        }
        if k == 0 || gpus.len() < k {
            return None;
        }
        let mut best = None;
        rec(self, gpus, 0, k, &mut Vec::with_capacity(k), 0, &mut best);
        best
    }

    /// Sum of pair scores over every unordered pair of the set (0 for a single GPU).
    pub fn set_score(&self, gpus: &[usize]) -> u32 {
        let mut s = 0;
        for (i, &a) in gpus.iter().enumerate() {
            for &b in &gpus[i + 1..] {
                s += self.pair_score(a, b);
            }
        }
        s
    }
}

/// The topology file format of `shared/topologies/` (also used by `examples/`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopologyFile {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub nvlink_fabric: NvlinkFabric,
    pub gpus: Vec<TopologyGpu>,
    #[serde(default)]
    pub links: Vec<TopologyLink>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopologyGpu {
    pub index: u32,
    pub model: String,
    pub memory_mib: u64,
    #[serde(default)]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub pci_bus_id: String,
    #[serde(default)]
    pub uuid: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopologyLink {
    pub a: u32,
    pub b: u32,
    #[serde(default)]
    pub nvlinks: u32,
    pub pcie: PcieLevel,
}

impl TopologyFile {
    /// The link graph; pairs the file leaves out are assumed to cross sockets (`SYS`), the safe guess.
    pub fn graph(&self) -> Result<GpuTopology, TopologyError> {
        GpuTopology::new(
            self.gpus.len(),
            self.nvlink_fabric,
            self.links.iter().map(|l| (l.a, l.b, Link { nvlinks: l.nvlinks, pcie: l.pcie })),
            PcieLevel::Sys,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_follow_upstream_scale_and_count_nvlink() {
        let t = GpuTopology::new(
            3,
            NvlinkFabric::Direct,
            [(0, 1, Link { nvlinks: 2, pcie: PcieLevel::Pix }), (1, 2, Link { nvlinks: 0, pcie: PcieLevel::Sys })],
            PcieLevel::Node,
        )
        .unwrap();
        assert_eq!(t.pair_score(0, 1), 250);
        assert_eq!(t.pair_score(2, 1), 10);
        assert_eq!(t.pair_score(0, 2), 20);
        assert_eq!(t.set_score(&[0, 1, 2]), 280);
        assert_eq!((t.connect(0, 0b110), t.connect(0, 0b111), t.connect(2, 0b011)), (270, 270, 30));
        assert_eq!(t.links().count(), 3);
    }

    #[test]
    fn refuses_bad_links() {
        let l = Link { nvlinks: 0, pcie: PcieLevel::Sys };
        assert!(GpuTopology::new(2, NvlinkFabric::None, [(0, 2, l)], PcieLevel::Sys).is_err());
        assert!(GpuTopology::new(2, NvlinkFabric::None, [(1, 1, l)], PcieLevel::Sys).is_err());
        assert!(GpuTopology::new(2, NvlinkFabric::None, [(0, 1, l), (1, 0, l)], PcieLevel::Sys).is_err());
    }
}
