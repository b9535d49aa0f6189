//! Which GPUs of one node a pod gets: a share goes on one GPU chosen by the GPU policy; a set of
//! several GPUs is the best-connected set in the NVLink/NVSwitch/PCIe graph.
//!
//! Set choice is lexicographic, so it is exact on the oracle boards:
//! 1. the highest set score (sum of pair scores, NVSwitch lanes counted);
//! 2. fewest NUMA nodes (the pair score already ranks cross-socket paths lowest);
//! 3. packing: shared slices go where GPUs are already busy (or idle, under `spread`);
//! 4. look-ahead: among equals, leave the GPUs that split best into more sets of this size
//!    (go-gpuallocator's measure of a partition), then those whose best quad and the best pair
//!    beside it score highest, then take the GPUs least connected to the GPUs that stay free;
//! 5. lowest indices.

use crate::placement::mix::{HostFree, WorkloadMix};
use gpuplace_core::assignment::share_milli;
use gpuplace_core::cluster::Node;
use gpuplace_core::resources::{GpuDemand, NumaPolicy, PackingPolicy};
use gpuplace_core::topology::GpuTopology;

/// Free capacity of the GPUs of one node while a pod's containers are being placed.
#[derive(Debug, Clone)]
pub struct FreeState {
    pub mem: Vec<u64>,
    pub core: Vec<u32>,
    /// Nobody holds anything on the GPU.
    pub idle: Vec<bool>,
    /// Healthy and of an allowed model.
    pub eligible: Vec<bool>,
    /// Containers that can still join the GPU (device-plugin slots; `u32::MAX` when unlimited).
    pub slots: Vec<u32>,
}

impl FreeState {
    /// The node as it is now.
    pub fn current(node: &Node, allows_model: impl Fn(&str) -> bool) -> Self {
        let n = node.gpus.len();
        let mut s = Self::empty(node, allows_model);
        for g in 0..n {
            let u = node.usage(g);
            s.mem[g] = if u.exclusive { 0 } else { node.free_mem(g) };
            s.core[g] = if u.exclusive { 0 } else { node.free_core(g) };
            s.idle[g] = u.holders == 0;
            s.slots[g] = node.free_slots(g);
        }
        s
    }

    /// The node with every allocation removed: "would it ever fit here?"
    pub fn empty(node: &Node, allows_model: impl Fn(&str) -> bool) -> Self {
        Self {
            mem: node.gpus.iter().map(|g| g.memory_mib).collect(),
            core: vec![100; node.gpus.len()],
            idle: vec![true; node.gpus.len()],
            eligible: node.gpus.iter().map(|g| g.healthy && allows_model(&g.model)).collect(),
            slots: vec![node.slot_capacity(); node.gpus.len()],
        }
    }

    /// Whether GPU `g` can take one slice of `demand`.
    pub fn fits(&self, node: &Node, g: usize, demand: &GpuDemand) -> bool {
        self.slots[g] > 0 && self.has_room(node, g, demand)
    }

    /// [`fits`](Self::fits) but for the device-plugin slots: usable, and idle (a whole GPU) or with
    /// the slice's memory and compute free. Tells "no room" from "no slot" in rejections.
    pub fn has_room(&self, node: &Node, g: usize, demand: &GpuDemand) -> bool {
        if !self.eligible[g] {
            return false;
        }
        if demand.is_whole() {
            return self.idle[g];
        }
        self.mem[g] >= demand.mem_on(node.gpus[g].memory_mib) && self.core[g] >= demand.core_on()
    }

    /// Takes one slice of `demand` from GPU `g`; returns (MiB, percent).
    pub fn take(&mut self, node: &Node, g: usize, demand: &GpuDemand) -> (u64, u32) {
        let mem = demand.mem_on(node.gpus[g].memory_mib);
        let core = demand.core_on();
        self.mem[g] = self.mem[g].saturating_sub(mem);
        self.core[g] = self.core[g].saturating_sub(core);
        self.idle[g] = false;
        self.slots[g] = self.slots[g].saturating_sub(1);
        if demand.is_whole() {
            self.mem[g] = 0;
            self.core[g] = 0;
        }
        (mem, core)
    }

    /// Free share of GPU `g` in thousandths: 1000 minus the share of what is taken (rounded down).
    pub fn free_milli(&self, node: &Node, g: usize) -> u32 {
        free_milli_of(self.mem[g], self.core[g], node.gpus[g].memory_mib)
    }
}

/// Free share in thousandths of a GPU of `capacity_mib` with `mem` MiB and `core` percent left.
pub fn free_milli_of(mem: u64, core: u32, capacity_mib: u64) -> u32 {
    1000 - share_milli(capacity_mib.saturating_sub(mem), 100u32.saturating_sub(core), capacity_mib)
}

/// How the GPU of a single-GPU share is picked.
#[derive(Debug, Clone, Copy)]
pub enum ShareChoice<'a> {
    Pack(PackingPolicy),
    /// Minimize the node's fragmentation for the workload mix (FGD's GPU choice).
    /// `host` is what the node's CPU and memory leave after this pod: it decides which GPUs the
    /// mix's requests could still be fed on.
    Fragmentation {
        mix: &'a WorkloadMix,
        host_cpu_milli: u64,
        host_memory_mib: u64,
    },
}

/// Upper bound on subsets examined exactly; larger searches use a greedy seed and swap search.
const EXACT_SEARCH_LIMIT: u64 = 300_000;

fn binomial(n: u64, k: u64) -> u64 {
    let k = k.min(n - k.min(n));
    let mut r: u64 = 1;
    for i in 0..k {
        r = r.saturating_mul(n - i) / (i + 1);
    }
    r
}

/// The primary key sets are compared by; larger is better.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
struct SetKey {
    score: u32,
    neg_numa: i32,
    pack: f64,
}

/// Tied sets kept for the look-ahead; more are very unlikely to differ in what they leave.
const MAX_TIES: usize = 4096;
/// Tied sets whose leftovers are examined in full (the rest are ranked by connectivity only).
const LOOKAHEAD_CANDIDATES: usize = 24;

struct SetSearch<'a> {
    node: &'a Node,
    cands: &'a [usize],
    k: usize,
    numa: NumaPolicy,
    pack_value: &'a [f64],
    best: Option<SetKey>,
    ties: Vec<Vec<usize>>,
    stack: Vec<usize>,
}

impl SetSearch<'_> {
    fn key(&self, set: &[usize], score: u32) -> Option<SetKey> {
        // GPUs without a known NUMA node are taken as NUMA node 0 (single-socket hosts report none)
        let numas: u64 = set.iter().fold(0, |m, &g| m | 1 << self.node.gpus[g].numa_node.unwrap_or(0).min(63));
        let numa_count = numas.count_ones() as i32;
        if self.numa == NumaPolicy::Required && numa_count > 1 {
            return None;
        }
        Some(SetKey {
            score,
            neg_numa: if self.numa == NumaPolicy::None { 0 } else { -numa_count },
            pack: set.iter().map(|&g| self.pack_value[g]).sum(),
        })
    }

    fn consider(&mut self, set: &[usize], score: u32) {
        let Some(key) = self.key(set, score) else { return };
        match self.best.map(|b| key.partial_cmp(&b)) {
            None | Some(Some(std::cmp::Ordering::Greater)) => {
                self.best = Some(key);
                self.ties.clear();
                self.ties.push(set.to_vec());
            }
            Some(Some(std::cmp::Ordering::Equal)) if self.ties.len() < MAX_TIES => self.ties.push(set.to_vec()),
            _ => {}
        }
    }

    fn exhaustive(&mut self, start: usize, score: u32) {
        if self.stack.len() == self.k {
            let set = std::mem::take(&mut self.stack);
            self.consider(&set, score);
            self.stack = set;
            return;
        }
        let need = self.k - self.stack.len();
        for i in start..=self.cands.len() - need {
            let g = self.cands[i];
            let add: u32 = self.stack.iter().map(|&s| self.node.topology.pair_score(s, g)).sum();
            self.stack.push(g);
            self.exhaustive(i + 1, score + add);
            self.stack.pop();
        }
    }

    /// For very large nodes: grow a set greedily from every seed, then improve by single swaps.
    fn heuristic(&mut self) {
        let topo = &self.node.topology;
        for &seed in self.cands {
            let mut set = vec![seed];
            while set.len() < self.k {
                let next =
                    self.cands.iter().filter(|g| !set.contains(g)).max_by_key(|&&g| {
                        (set.iter().map(|&s| topo.pair_score(s, g)).sum::<u32>(), std::cmp::Reverse(g))
                    });
                match next {
                    Some(&g) => set.push(g),
                    None => return,
                }
            }
            topo.improve_by_swaps(&mut set, self.cands, 0);
            set.sort_unstable();
            let score = topo.set_score(&set);
            self.consider(&set, score);
        }
    }
}

/// What a set of free GPUs is worth to the next requests: its best quad plus the best pair left
/// beside that quad (both could be asked for), or its best pair when no quad is left.
fn leftover_value(node: &Node, left: &[usize]) -> u32 {
    let topo = &node.topology;
    match topo.best_subset(left, 4) {
        Some((quad, set)) => {
            let rest: Vec<usize> = left.iter().copied().filter(|g| !set.contains(g)).collect();
            quad + topo.best_subset(&rest, 2).map_or(0, |(p, _)| p)
        }
        None => topo.best_subset(left, 2).map_or(0, |(p, _)| p),
    }
}

/// Splits of the GPUs left examined at most by [`partition_value`]; beyond, it is left out.
const PARTITION_LIMIT: f64 = 5_000.0;

/// What the GPUs `left` are worth to more requests of `k` GPUs: the best total score of a split of
/// them into sets of `k` (one set short when `k` does not divide their number), go-gpuallocator's
/// own measure. 0 for single GPUs (every split scores 0) and where the splits are too many to
/// examine (large boards): then [`leftover_value`] alone decides.
fn partition_value(node: &Node, left: &[usize], k: usize) -> u32 {
    let m = left.len();
    if k < 2 || !(2..64).contains(&m) {
        return 0;
    }
    let sets = m.div_ceil(k);
    // splits of the padded list: (sets*k)! / (k!^sets * sets!)
    let ln_fact = |n: usize| (1..=n).map(|i| (i as f64).ln()).sum::<f64>();
    let ln_count = ln_fact(sets * k) - sets as f64 * ln_fact(k) - ln_fact(sets);
    if ln_count > PARTITION_LIMIT.ln() {
        return 0;
    }
    let short = m - (sets - 1) * k;
    let all = if m == 64 { u64::MAX } else { (1u64 << m) - 1 };
    best_split(&node.topology, left, all, k, short, true)
}

/// The best split of the positions `mask` of `left` into sets of `k`, with one set of `short`
/// while `short_open`: the lowest position goes into a full set or the short one, with every
/// choice of the other members.
fn best_split(topo: &GpuTopology, left: &[usize], mask: u64, k: usize, short: usize, short_open: bool) -> u32 {
    if mask == 0 {
        return 0;
    }
    let first = mask.trailing_zeros() as usize;
    let rest = mask & !(1 << first);
    let mut top = 0;
    for size in [k, short] {
        let closes_short = size < k;
        if closes_short && !short_open {
            continue;
        }
        let mut set = vec![left[first]];
        for_each_subset(rest, size - 1, &mut Vec::new(), &mut |members| {
            set.truncate(1);
            set.extend(members.iter().map(|&i| left[i]));
            let used = members.iter().fold(1u64 << first, |m, &i| m | 1 << i);
            let after = best_split(topo, left, mask & !used, k, short, short_open && !closes_short);
            top = top.max(topo.set_score(&set) + after);
        });
        if short == k {
            break;
        }
    }
    top
}

/// Calls `f` with every `need` positions among the bits of `avail`, in increasing order.
fn for_each_subset(avail: u64, need: usize, pick: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
    if need == 0 {
        f(pick);
        return;
    }
    let mut a = avail;
    while a.count_ones() as usize >= need {
        let i = a.trailing_zeros() as usize;
        a &= !(1 << i);
        pick.push(i);
        for_each_subset(a, need - 1, pick, f);
        pick.pop();
    }
}

/// Among equally good sets, the one that leaves the most for later (see the module comment).
fn pick_lookahead(node: &Node, free: &[usize], mut ties: Vec<Vec<usize>>) -> Option<Vec<usize>> {
    if ties.len() <= 1 {
        return ties.pop();
    }
    let topo = &node.topology;
    let connect = |set: &[usize]| -> i64 {
        set.iter()
            .map(|&g| free.iter().filter(|o| !set.contains(o)).map(|&o| i64::from(topo.pair_score(g, o))).sum::<i64>())
            .sum()
    };
    // cheap pre-rank: weakly tied to what stays free first (stable, so index order breaks ties)
    ties.sort_by_cached_key(|s| connect(s));
    ties.truncate(LOOKAHEAD_CANDIDATES);
    let mut best: Option<((u32, u32), Vec<usize>)> = None;
    for set in ties {
        let left: Vec<usize> = free.iter().copied().filter(|g| !set.contains(g)).collect();
        let v = (partition_value(node, &left, set.len()), leftover_value(node, &left));
        if best.as_ref().is_none_or(|(b, _)| v > *b) {
            best = Some((v, set));
        }
    }
    best.map(|(_, s)| s)
}

/// Chooses `k` GPUs among `cands` (sorted by index) for one container. `None` when no set satisfies
/// the NUMA policy.
pub fn choose_set(
    node: &Node,
    state: &FreeState,
    cands: &[usize],
    k: usize,
    numa: NumaPolicy,
    pack: PackingPolicy,
    demand: &GpuDemand,
) -> Option<Vec<usize>> {
    if k == 0 || cands.len() < k {
        return None;
    }
    let n = node.gpus.len();
    let free: Vec<usize> = (0..n).filter(|&g| state.fits(node, g, demand)).collect();
    // Packing value: busier GPUs first under binpack, idler ones under spread.
    let mut pack_value = vec![0.0; n];
    if !demand.is_whole() {
        for &g in cands {
            let free_frac = f64::from(state.free_milli(node, g)) / 1000.0;
            pack_value[g] = match pack {
                PackingPolicy::Binpack => -free_frac,
                PackingPolicy::Spread => free_frac,
            };
        }
    }
    let mut search = SetSearch {
        node,
        cands,
        k,
        numa,
        pack_value: &pack_value,
        best: None,
        ties: Vec::new(),
        stack: Vec::with_capacity(k),
    };
    if binomial(cands.len() as u64, k as u64) <= EXACT_SEARCH_LIMIT {
        search.exhaustive(0, 0);
    } else {
        search.heuristic();
    }
    let mut best = pick_lookahead(node, &free, search.ties)?;
    best.sort_unstable();
    Some(best)
}

/// Picks the GPU for a one-GPU container.
pub fn choose_one(
    node: &Node,
    state: &FreeState,
    cands: &[usize],
    demand: &GpuDemand,
    how: ShareChoice<'_>,
) -> Option<usize> {
    if cands.is_empty() {
        return None;
    }
    let topo = &node.topology;
    let free: Vec<usize> = (0..node.gpus.len()).filter(|&g| state.fits(node, g, demand)).collect();
    let connect =
        |g: usize| -> i64 { free.iter().filter(|&&o| o != g).map(|&o| i64::from(topo.pair_score(g, o))).sum() };
    match how {
        ShareChoice::Pack(_) if demand.is_whole() => {
            // all candidates are idle: only what stays free for later decides
            pick_lookahead(node, &free, cands.iter().map(|&g| vec![g]).collect()).map(|s| s[0])
        }
        ShareChoice::Pack(policy) => {
            let mut best: Option<(i64, i64, usize)> = None;
            for &g in cands {
                let left = i64::from(state.free_milli(node, g));
                let pack = match policy {
                    PackingPolicy::Binpack => -left,
                    PackingPolicy::Spread => left,
                };
                let key = (pack, -connect(g), g);
                if best.is_none_or(|(p, c, _)| (key.0, key.1) > (p, c)) {
                    best = Some(key);
                }
            }
            best.map(|(_, _, g)| g)
        }
        ShareChoice::Fragmentation { mix, host_cpu_milli, host_memory_mib } => {
            let host = HostFree::of(node, host_cpu_milli, host_memory_mib);
            let mut best: Option<(f64, i64, usize)> = None;
            let mut trial = state.clone();
            for &g in cands {
                let before = (trial.mem[g], trial.core[g], trial.idle[g], trial.slots[g]);
                trial.take(node, g, demand);
                let frag = node_fragmentation(mix, node, &trial, host);
                (trial.mem[g], trial.core[g], trial.idle[g], trial.slots[g]) = before;
                let key = (-frag, -connect(g), g);
                if best.is_none_or(|(f, c, _)| (key.0, key.1) > (f, c)) {
                    best = Some(key);
                }
            }
            best.map(|(_, _, g)| g)
        }
    }
}

/// Fragmentation of a node in the given free GPU state with `host` free.
fn node_fragmentation(mix: &WorkloadMix, node: &Node, state: &FreeState, host: HostFree) -> f64 {
    let mut free = [0u32; 64];
    let n = node.gpus.len().min(64);
    for (g, slot) in free.iter_mut().enumerate().take(n) {
        *slot = if node.gpus[g].healthy { state.free_milli(node, g) } else { 0 };
    }
    mix.fragmentation(&free[..n], host, node.gpus.first().map_or("", |g| g.model.as_str()))
}
