//! The link graph inside one node: every GPU pair's NVLink count, NVSwitch fabric and PCIe level.
//!
//! Pair scores use go-gpuallocator's scale (PCIe points plus 100 per NVLink lane) so that our choices
//! can be compared with NVIDIA's, but NVSwitch lanes are counted, which upstream misses.

use std::cmp::Reverse;

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
    #[inline]
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

/// Why [`GpuTopology::best_subset_including`] has no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubsetError {
    #[error("a request for 0 GPUs has no set")]
    EmptyRequest,
    #[error("GPU {gpu} is not on this board (it has {n})")]
    UnknownGpu { gpu: usize, n: usize },
    #[error("required GPU {gpu} is not available")]
    RequiredUnavailable { gpu: usize },
    #[error("{required} GPUs are required but only {request} requested")]
    TooManyRequired { required: usize, request: usize },
    #[error("{request} GPUs requested but only {available} available")]
    NotEnoughAvailable { available: usize, request: usize },
}

/// Candidate sets [`GpuTopology::best_subset_including`] enumerates before it turns greedy: a few
/// milliseconds, and more than any board up to 16 GPUs needs.
pub const SUBSET_SEARCH_LIMIT: u64 = 300_000;

/// Whether `n` choose `k` is above `limit` (without overflow).
fn combinations_exceed(n: usize, k: usize, limit: u64) -> bool {
    let k = k.min(n.saturating_sub(k)) as u64;
    let mut c: u64 = 1;
    for i in 0..k {
        // exact at every step: c * (n - i) is divisible by (i + 1)
        c = match c.checked_mul(n as u64 - i) {
            Some(x) => x / (i + 1),
            None => return true,
        };
        if c > limit {
            return true;
        }
    }
    false
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

    #[inline]
    pub fn len(&self) -> usize {
        self.n
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// An identifier no other constructed topology has (a clone keeps it: it has the same links).
    #[inline]
    pub fn id(&self) -> u64 {
        self.id
    }

    #[inline]
    pub fn fabric(&self) -> NvlinkFabric {
        self.fabric
    }

    /// The link between two distinct GPUs.
    #[inline]
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        let e = self.graph.find_edge(NodeIndex::new(a), NodeIndex::new(b))?;
        Some(self.graph[e])
    }

    /// Iterates over every GPU pair with its link.
    #[inline]
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
    #[inline]
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
        if k == 0 || gpus.len() < k {
            return None;
        }
        Some(self.exhaustive_subset(gpus, &[], k))
    }

    /// The highest-scoring set of `k` GPUs drawn from `available` that holds every GPU of `required`
    /// (kubelet's must-include devices in `GetPreferredAllocation`), sorted by index. Exhaustive up to
    /// [`SUBSET_SEARCH_LIMIT`] candidate sets, greedy with single swaps beyond. Bad input is an error,
    /// never a panic: the lists come from outside the process.
    pub fn best_subset_including(
        &self,
        available: &[usize],
        required: &[usize],
        k: usize,
    ) -> Result<(u32, Vec<usize>), SubsetError> {
        if k == 0 {
            return Err(SubsetError::EmptyRequest);
        }
        if let Some(&gpu) = available.iter().chain(required).find(|&&g| g >= self.n) {
            return Err(SubsetError::UnknownGpu { gpu, n: self.n });
        }
        let mut available = available.to_vec();
        available.sort_unstable();
        available.dedup();
        let mut required = required.to_vec();
        required.sort_unstable();
        required.dedup();
        if let Some(&gpu) = required.iter().find(|g| available.binary_search(g).is_err()) {
            return Err(SubsetError::RequiredUnavailable { gpu });
        }
        if required.len() > k {
            return Err(SubsetError::TooManyRequired { required: required.len(), request: k });
        }
        if available.len() < k {
            return Err(SubsetError::NotEnoughAvailable { available: available.len(), request: k });
        }
        let rest: Vec<usize> = available.into_iter().filter(|g| required.binary_search(g).is_err()).collect();
        let (score, mut set) = if combinations_exceed(rest.len(), k - required.len(), SUBSET_SEARCH_LIMIT) {
            self.greedy_subset(&rest, &required, k)
        } else {
            self.exhaustive_subset(&rest, &required, k)
        };
        set.sort_unstable();
        Ok((score, set))
    }

    /// Best `k`-set made of `fixed` plus GPUs of `gpus` (first found on ties). Callers guarantee
    /// `fixed.len() <= k <= fixed.len() + gpus.len()`.
    fn exhaustive_subset(&self, gpus: &[usize], fixed: &[usize], k: usize) -> (u32, Vec<usize>) {
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
        let mut set = Vec::with_capacity(k);
        set.extend_from_slice(fixed);
        let mut best = None;
        rec(self, gpus, 0, k, &mut set, self.set_score(fixed), &mut best);
        // unreachable under the caller's guarantee; the fixed set alone is the safe answer
        best.unwrap_or_else(|| (self.set_score(fixed), fixed.to_vec()))
    }

    /// For searches too large to enumerate: grow from `fixed` by the best-connected GPU, then swap
    /// single free GPUs while the score improves (the fixed GPUs never move).
    fn greedy_subset(&self, gpus: &[usize], fixed: &[usize], k: usize) -> (u32, Vec<usize>) {
        let gain = |set: &[usize], g: usize| set.iter().map(|&o| self.pair_score(o, g)).sum::<u32>();
        let mut set = fixed.to_vec();
        while set.len() < k {
            // with nothing fixed, the first pick is the GPU best connected to all the others
            let base: &[usize] = if set.is_empty() { gpus } else { &set };
            let next = gpus.iter().copied().filter(|g| !set.contains(g)).max_by_key(|&g| (gain(base, g), Reverse(g)));
            match next {
                Some(g) => set.push(g),
                None => break,
            }
        }
        self.improve_by_swaps(&mut set, gpus, fixed.len());
        (self.set_score(&set), set)
    }

    /// Local search for large boards: swaps single members of `set` from position `keep` on for GPUs
    /// of `gpus` outside it while that raises the set score (the first `keep` members never move).
    pub fn improve_by_swaps(&self, set: &mut Vec<usize>, gpus: &[usize], keep: usize) {
        let mut improved = true;
        while improved {
            improved = false;
            for i in keep..set.len() {
                for &g in gpus {
                    if set.contains(&g) {
                        continue;
                    }
                    let mut trial = set.clone();
                    trial[i] = g;
                    if self.set_score(&trial) > self.set_score(set) {
                        *set = trial;
                        improved = true;
                    }
                }
            }
        }
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

    /// Two quads joined by NVLink inside (0-3, 4-7) and SYS between them.
    fn two_quads() -> GpuTopology {
        let nv = Link { nvlinks: 1, pcie: PcieLevel::Node };
        let links = (0..8u32)
            .flat_map(|a| (a + 1..8).map(move |b| (a, b)))
            .filter(|(a, b)| a / 4 == b / 4)
            .map(|(a, b)| (a, b, nv));
        GpuTopology::new(8, NvlinkFabric::Direct, links, PcieLevel::Sys).unwrap()
    }

    #[test]
    fn required_gpus_are_kept_and_the_rest_chosen_around_them() {
        let t = two_quads();
        let all: Vec<usize> = (0..8).collect();
        // without a requirement the best pair is inside a quad; requiring 5 pulls it into the second quad
        let (s, set) = t.best_subset_including(&all, &[5], 2).unwrap();
        assert!(set.contains(&5) && set.iter().all(|&g| g >= 4), "{set:?}");
        assert_eq!(s, 120);
        // requiring one GPU of each quad: the other two go with whichever quad gains most (a tie, so
        // either way the score is the optimum over all 4-sets holding 0 and 4)
        let (s, set) = t.best_subset_including(&all, &[0, 4], 4).unwrap();
        assert!(set.contains(&0) && set.contains(&4) && set.len() == 4, "{set:?}");
        let brute = (0..8)
            .flat_map(|a| (a + 1..8).map(move |b| (a, b)))
            .filter(|&(a, b)| ![a, b].iter().any(|g| [0, 4].contains(g)))
            .map(|(a, b)| t.set_score(&[0, 4, a, b]))
            .max()
            .unwrap();
        assert_eq!(s, brute);
        assert_eq!(s, t.set_score(&set));
        // the whole request required: the answer is exactly the required set, in index order
        assert_eq!(t.best_subset_including(&all, &[6, 1, 3], 3).unwrap().1, vec![1, 3, 6]);
        // nothing required is the plain best subset
        assert_eq!(t.best_subset_including(&all, &[], 4).unwrap().0, t.best_subset(&all, 4).unwrap().0);
    }

    #[test]
    fn required_gpus_bad_input_is_an_error_not_a_panic() {
        let t = two_quads();
        let e = |a: &[usize], r: &[usize], k| t.best_subset_including(a, r, k).unwrap_err();
        assert_eq!(e(&[1, 2, 3], &[0], 2), SubsetError::RequiredUnavailable { gpu: 0 });
        assert_eq!(e(&[0, 1, 2, 3], &[0, 1, 2], 2), SubsetError::TooManyRequired { required: 3, request: 2 });
        assert_eq!(e(&[0, 1], &[], 3), SubsetError::NotEnoughAvailable { available: 2, request: 3 });
        assert_eq!(e(&[0, 1], &[], 0), SubsetError::EmptyRequest);
        assert_eq!(e(&[0, 8], &[], 1), SubsetError::UnknownGpu { gpu: 8, n: 8 });
        assert_eq!(e(&[0, 1], &[99], 1), SubsetError::UnknownGpu { gpu: 99, n: 8 });
        // duplicates are one GPU, not two
        assert_eq!(e(&[1, 1, 1], &[], 2), SubsetError::NotEnoughAvailable { available: 1, request: 2 });
        assert!(e(&[1, 2], &[3], 1).to_string().contains("required GPU 3"));
        assert_eq!(t.best_subset_including(&[2, 1, 2], &[1, 1], 2).unwrap().1, vec![1, 2]);
    }

    #[test]
    fn large_searches_turn_greedy_and_still_honour_required() {
        // 64 GPUs in 8 NVLink islands: C(63, 7) sets is far past the exhaustive limit
        let nv = Link { nvlinks: 2, pcie: PcieLevel::Pix };
        let links = (0..64u32)
            .flat_map(|a| (a + 1..64).map(move |b| (a, b)))
            .filter(|(a, b)| a / 8 == b / 8)
            .map(|(a, b)| (a, b, nv));
        let t = GpuTopology::new(64, NvlinkFabric::Direct, links, PcieLevel::Sys).unwrap();
        assert!(combinations_exceed(63, 7, SUBSET_SEARCH_LIMIT));
        let all: Vec<usize> = (0..64).collect();
        let (s, set) = t.best_subset_including(&all, &[42], 8).unwrap();
        // the required GPU's island is the only optimum
        assert_eq!(set, (40..48).collect::<Vec<_>>());
        assert_eq!(s, 28 * 250);
        let (_, set) = t.best_subset_including(&all, &[3, 60], 8).unwrap();
        assert!(set.contains(&3) && set.contains(&60) && set.len() == 8, "{set:?}");
    }

    #[test]
    fn combination_counts() {
        assert!(!combinations_exceed(16, 8, SUBSET_SEARCH_LIMIT)); // 12,870
        assert!(combinations_exceed(40, 10, SUBSET_SEARCH_LIMIT));
        assert!(!combinations_exceed(3, 5, 0)); // no sets at all
        assert!(combinations_exceed(10_000, 5_000, u64::MAX)); // overflow counts as too many
        assert!(!combinations_exceed(5, 2, 10) && combinations_exceed(5, 2, 9));
    }
}
