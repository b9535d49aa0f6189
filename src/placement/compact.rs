//! The hot path of filter and score: whether a pod fits on one node and which GPUs it gets, worked out
//! on a compact copy of the node's free capacity (fixed arrays, GPU sets as bitmasks) without
//! allocating.
//!
//! It makes exactly the choices of [`place_on_node`](crate::placement::feasibility::place_on_node),
//! which stays the general path: nodes of more than [`MAX_COMPACT_GPUS`] GPUs, and the text of every
//! rejection (rejections are many and their text is rarely read, so it is written only when asked
//! for). tests/fast_path.rs holds the two equal on random clusters.
//!
//! Whole-GPU choices (the exhaustive set search and the look-ahead) are pure functions of the board,
//! its NUMA layout, the candidate and free GPU masks, the set size and the NUMA policy; at ordinary
//! allocation levels the same masks recur on many nodes, so they are memoized per thread.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::placement::feasibility::{container_order, GpuChoice, Placement};
use crate::placement::gpu_select::{self, free_milli_of, FreeState, ShareChoice};
use crate::placement::mix::HostFree;
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Node;
use gpuplace_core::resources::{GpuDemand, NumaPolicy, PackingPolicy, PodRequest};
use gpuplace_core::topology::GpuTopology;

/// Nodes with at most this many GPUs take the compact path (a GPU set is one `u64`).
pub const MAX_COMPACT_GPUS: usize = 64;
const M: usize = MAX_COMPACT_GPUS;

/// Iterates the set bits of a mask, lowest first.
pub(crate) fn bits(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let g = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        Some(g)
    })
}

fn bit(g: usize) -> u64 {
    1 << g
}

/// Set score (sum of pair scores) of the GPUs in `mask`.
pub(crate) fn mask_set_score(topo: &GpuTopology, mask: u64) -> u32 {
    let mut s = 0;
    for a in bits(mask) {
        // the GPUs above `a`, so each pair counts once
        for b in bits(mask & u64::MAX.checked_shl(a as u32 + 1).unwrap_or(0)) {
            s += topo.pair_score(a, b);
        }
    }
    s
}

/// [`FreeState`] in fixed arrays: free capacity of a node's GPUs while a pod is being placed. Only the
/// node's first `n` entries are meaningful; they are overwritten for each node.
#[derive(Clone)]
struct Free {
    /// Memory of each GPU, copied from the node's compact facts.
    cap: [u64; M],
    mem: [u64; M],
    core: [u32; M],
    /// Free share in thousandths (`free_milli_of` the two above), as the node keeps it for its
    /// current state; GPUs this pod has taken from (`taken`) are worked out again when asked.
    milli: [u32; M],
    taken: u64,
    /// Nobody holds anything on the GPU.
    idle: u64,
    /// Healthy and of an allowed model.
    eligible: u64,
    /// Containers that can still join each GPU (device-plugin slots; `u32::MAX` when unlimited),
    /// and the GPUs where one more can.
    slots: [u32; M],
    slotted: u64,
}

impl Free {
    const ZERO: Free = Free {
        cap: [0; M],
        mem: [0; M],
        core: [0; M],
        milli: [0; M],
        taken: 0,
        idle: 0,
        eligible: 0,
        slots: [0; M],
        slotted: 0,
    };

    /// Loads the node as it is now; false when no GPU is of an allowed model (or the node's isolation
    /// mode is not one the pod accepts). One pass over the GPUs:
    /// this is where a node's data is first touched. Free memory and compute are loaded only when some
    /// container asks for a share (`shares`): choices of whole GPUs never read them.
    fn load_current(&mut self, node: &Node, req: &PodRequest, shares: bool) -> bool {
        if !req.accepts_isolation(node.isolation) {
            return false;
        }
        let any_model = req.allowed_models.is_empty();
        let mut model_seen = any_model;
        let (mut idle, mut eligible, mut slotted) = (0, 0, 0);
        let k = node.slot_capacity();
        // bit arithmetic rather than branches: which GPUs are busy looks random to the branch
        // predictor, and mispredictions were most of the cost here
        for (g, ((f, u), used)) in node.gpu_facts().iter().zip(node.usages()).zip(node.used_milli()).enumerate() {
            let allowed = any_model || node.gpus.get(g).is_some_and(|gpu| req.allows_model(&gpu.model));
            model_seen |= allowed;
            eligible |= u64::from(allowed & f.healthy) << g;
            idle |= u64::from(u.holders == 0) << g;
            self.cap[g] = f.memory_mib;
            if shares {
                // nothing is free on a GPU held whole
                let shared = u64::from(!u.exclusive).wrapping_neg();
                self.mem[g] = f.memory_mib.saturating_sub(u.mem_mib) & shared;
                self.core[g] = 100u32.saturating_sub(u.core_pct) & shared as u32;
                self.milli[g] = 1000 - used;
                self.slots[g] = k.saturating_sub(u.slots);
                slotted |= u64::from(self.slots[g] > 0) << g;
            }
        }
        if !shares {
            // whole GPUs go only where nobody holds a slot, so each has all K: a fill, not a pass
            let n = node.gpus.len().min(M);
            self.slots[..n].fill(k);
            slotted = if k > 0 { u64::MAX.checked_shr(64 - n as u32).unwrap_or(0) } else { 0 };
        }
        (self.idle, self.eligible, self.slotted, self.taken) = (idle, eligible, slotted, 0);
        model_seen
    }

    /// Loads the node with every allocation removed (after [`load_current`](Self::load_current) for the
    /// same node, whose capacities it keeps); `k`: the node's slots per GPU ([`Node::slot_capacity`]).
    fn load_empty(&mut self, n: usize, eligible: u64, k: u32) {
        self.mem[..n].copy_from_slice(&self.cap[..n]);
        self.core[..n].fill(100);
        self.slots[..n].fill(k);
        for g in 0..n {
            self.milli[g] = free_milli_of(self.cap[g], 100, self.cap[g]);
        }
        self.idle = u64::MAX.checked_shr(64 - n as u32).unwrap_or(0);
        self.slotted = if k > 0 { self.idle } else { 0 };
        self.eligible = eligible;
        self.taken = 0;
    }

    /// GPUs that can take one slice of `demand`.
    fn fit_mask(&self, n: usize, demand: &GpuDemand) -> u64 {
        if demand.is_whole() {
            return self.eligible & self.idle & self.slotted;
        }
        let core = demand.core_on();
        let mut m = 0;
        for g in 0..n.min(M) {
            let room = (self.mem[g] >= demand.mem_on(self.cap[g])) & (self.core[g] >= core);
            m |= u64::from(room) << g;
        }
        m & self.eligible & self.slotted
    }

    /// Takes one slice of `demand` from GPU `g` (as [`FreeState::take`]).
    fn take(&mut self, g: usize, demand: &GpuDemand) {
        self.mem[g] = self.mem[g].saturating_sub(demand.mem_on(self.cap[g]));
        self.core[g] = self.core[g].saturating_sub(demand.core_on());
        self.idle &= !bit(g);
        self.slots[g] = self.slots[g].saturating_sub(1);
        if self.slots[g] == 0 {
            self.slotted &= !bit(g);
        }
        if demand.is_whole() {
            self.mem[g] = 0;
            self.core[g] = 0;
        }
        self.taken |= bit(g);
    }

    fn free_milli(&self, g: usize) -> u32 {
        if self.taken & bit(g) != 0 {
            free_milli_of(self.mem[g], self.core[g], self.cap[g])
        } else {
            self.milli[g]
        }
    }

    /// The general path's form, for the rare choices that are neither memoized nor computed here.
    fn to_state(&self, node: &Node) -> FreeState {
        let n = node.gpus.len();
        FreeState {
            mem: self.mem[..n].to_vec(),
            core: self.core[..n].to_vec(),
            idle: (0..n).map(|g| self.idle & bit(g) != 0).collect(),
            eligible: (0..n).map(|g| self.eligible & bit(g) != 0).collect(),
            slots: self.slots[..n].to_vec(),
        }
    }
}

/// What the placement of one pod needs to know, worked out once for all nodes.
pub(crate) struct Plan<'a> {
    pub req: &'a PodRequest,
    pub how: GpuChoice<'a>,
    /// App containers in the order they are placed.
    order: Vec<usize>,
    /// Some container asks for a share of a GPU.
    shares: bool,
}

impl<'a> Plan<'a> {
    pub fn new(req: &'a PodRequest, how: GpuChoice<'a>) -> Self {
        let shares = req.containers.iter().chain(&req.init_containers).any(|c| !c.demand.is_whole());
        Self { req, how, order: container_order(req), shares }
    }
}

/// Where a pod stands on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It fits; the masks hold its GPUs.
    Fits,
    Rejected {
        unresolvable: bool,
    },
    /// More GPUs than a mask holds: use the general path.
    TooLarge,
}

/// Working memory for placing one pod on node after node: the compact state is 1.5 KiB, and moving
/// it around by value showed in profiles.
pub(crate) struct Scratch {
    free: Free,
    /// What was free before the pod, for init containers.
    before: Free,
    init: Free,
    /// One GPU mask per container: app containers, then init containers, in spec order.
    pub masks: Vec<u64>,
}

impl Scratch {
    pub fn new() -> Box<Self> {
        Box::new(Self { free: Free::ZERO, before: Free::ZERO, init: Free::ZERO, masks: Vec::new() })
    }
}

/// Places the pod on `node`: on [`Outcome::Fits`], `sc.masks` holds its GPUs.
pub(crate) fn place(node: &Node, plan: &Plan<'_>, memo: &mut Memo, sc: &mut Scratch) -> Outcome {
    let n = node.gpus.len();
    // (the lists always agree for nodes built through `Node::new`)
    if n > M || node.gpu_facts().len() != n || node.usages().len() != n || node.used_milli().len() != n {
        return Outcome::TooLarge;
    }
    let req = plan.req;
    if !sc.free.load_current(node, req, plan.shares) {
        return Outcome::Rejected { unresolvable: true };
    }
    let eligible = sc.free.eligible;
    sc.masks.clear();
    sc.masks.resize(req.containers.len() + req.init_containers.len(), 0);
    let mut ctx = NodeCtx { node, numa: None, memo };
    if assign(&mut ctx, plan, sc) {
        return match host_shortfall(node, req) {
            None => Outcome::Fits,
            Some(unresolvable) => Outcome::Rejected { unresolvable },
        };
    }
    // an unresolvable host shortfall outranks a GPU shortfall that preemption could fix
    if host_shortfall(node, req) == Some(true) {
        return Outcome::Rejected { unresolvable: true };
    }
    sc.free.load_empty(n, eligible, node.slot_capacity());
    let ever = assign(&mut ctx, plan, sc);
    Outcome::Rejected { unresolvable: !ever }
}

/// `Some(unresolvable)` when host CPU or memory is short (the general path's `host_check`).
fn host_shortfall(node: &Node, req: &PodRequest) -> Option<bool> {
    for (need, cap, free) in
        [(req.cpu_milli, node.cpu_milli, node.cpu_free()), (req.memory_mib, node.memory_mib, node.mem_free())]
    {
        if cap == 0 || need == 0 {
            continue;
        }
        if need > cap {
            return Some(true);
        }
        if need > free {
            return Some(false);
        }
    }
    None
}

struct NodeCtx<'a, 'm> {
    node: &'a Node,
    /// The NUMA layout as a memo key part, worked out on first need.
    numa: Option<Option<u64>>,
    memo: &'m mut Memo,
}

impl NodeCtx<'_, '_> {
    /// Each GPU's NUMA node in four bits, when that describes the node exactly.
    fn numa_layout(&mut self) -> Option<u64> {
        let node = self.node;
        *self.numa.get_or_insert_with(|| {
            if node.gpus.len() > 16 {
                return None;
            }
            let mut sig = 0u64;
            for (g, f) in node.gpu_facts().iter().enumerate() {
                // as the set search reads it: none is NUMA node 0
                let id = u64::from(f.numa_node.unwrap_or(0).min(63));
                if id >= 16 {
                    return None;
                }
                sig |= id << (4 * g);
            }
            Some(sig)
        })
    }
}

/// Places every container, starting from `sc.free` (the general path's `assign`); false when one
/// does not fit.
fn assign(ctx: &mut NodeCtx<'_, '_>, plan: &Plan<'_>, sc: &mut Scratch) -> bool {
    let req = plan.req;
    if !req.init_containers.is_empty() {
        sc.before.clone_from(&sc.free);
    }
    let mut app = 0;
    for &i in &plan.order {
        match place_container(ctx, &mut sc.free, &req.containers[i].demand, &plan.how, 0) {
            Some(m) => {
                sc.masks[i] = m;
                app |= m;
            }
            None => return false,
        }
    }
    // each init container runs alone on what was free before the pod, preferring the app's GPUs
    for (j, c) in req.init_containers.iter().enumerate() {
        sc.init.clone_from(&sc.before);
        match place_container(ctx, &mut sc.init, &c.demand, &plan.how, app) {
            Some(m) => sc.masks[req.containers.len() + j] = m,
            None => return false,
        }
    }
    true
}

fn place_container(
    ctx: &mut NodeCtx<'_, '_>,
    st: &mut Free,
    demand: &GpuDemand,
    how: &GpuChoice<'_>,
    prefer: u64,
) -> Option<u64> {
    let k = demand.gpus() as usize;
    let all = st.fit_mask(ctx.node.gpus.len(), demand);
    if (all.count_ones() as usize) < k {
        return None;
    }
    let chosen = pick(ctx, st, demand, how, all & prefer, all).or_else(|| pick(ctx, st, demand, how, all, all))?;
    for g in bits(chosen) {
        st.take(g, demand);
    }
    Some(chosen)
}

/// `k` GPUs among `cands` (`free`: every GPU that fits the demand), as the general path chooses.
fn pick(
    ctx: &mut NodeCtx<'_, '_>,
    st: &Free,
    demand: &GpuDemand,
    how: &GpuChoice<'_>,
    cands: u64,
    free: u64,
) -> Option<u64> {
    let k = demand.gpus() as usize;
    if k == 0 || (cands.count_ones() as usize) < k {
        return None;
    }
    let node = ctx.node;
    if demand.is_whole() {
        // packing plays no part for whole GPUs, and NUMA none for a single one
        let numa = if k == 1 { NumaPolicy::None } else { how.numa };
        let layout = if numa == NumaPolicy::None { Some(0) } else { ctx.numa_layout() };
        let key = layout.map(|numa_layout| MemoKey { topo: node.topology.id(), numa_layout, cands, free, k, numa });
        if let Some(hit) = key.and_then(|key| ctx.memo.sets.get(&key)) {
            return *hit;
        }
        let chosen = general_pick(node, st, demand, how, cands, k);
        if let Some(key) = key {
            ctx.memo.insert(key, chosen);
        }
        return chosen;
    }
    if k > 1 {
        return general_pick(node, st, demand, how, cands, k);
    }
    let topo = &node.topology;
    // connection to the other GPUs that stay free (weakly connected ones go first; a GPU's pair score
    // with itself is 0)
    let connect = |g: usize| -> i64 { i64::try_from(topo.connect(g, free)).unwrap_or(i64::MAX) };
    match how.share {
        ShareChoice::Pack(policy) => {
            // the first best (pack, -connect) in index order, as the general path's strict comparison
            let (mut bp, mut bc, mut bg) = (i64::MIN, i64::MIN, None);
            for g in bits(cands) {
                let left = i64::from(st.free_milli(g));
                let pack = match policy {
                    PackingPolicy::Binpack => -left,
                    PackingPolicy::Spread => left,
                };
                let c = -connect(g);
                let better = (pack > bp) | ((pack == bp) & (c > bc));
                bp = if better { pack } else { bp };
                bc = if better { c } else { bc };
                bg = if better { Some(g) } else { bg };
            }
            bg.map(bit)
        }
        ShareChoice::Fragmentation { mix, host_cpu_milli, host_memory_mib } => {
            // the node's fragmentation after the share, as `WorkloadMix::node_fragmentation` measures it
            let facts = node.gpu_facts();
            let n = facts.len();
            let mut free_milli = [0u32; M];
            for (g, (slot, f)) in free_milli.iter_mut().zip(facts).enumerate() {
                *slot = if f.healthy { st.free_milli(g) } else { 0 };
            }
            let host = HostFree::of(node, host_cpu_milli, host_memory_mib);
            let model = node.gpus.first().map_or("", |g| g.model.as_str());
            let mut best: Option<(f64, i64, usize)> = None;
            for g in bits(cands) {
                let keep = free_milli[g];
                // candidates are eligible, so healthy: the share comes off this GPU's free room
                let cap = st.cap[g];
                let mem = st.mem[g].saturating_sub(demand.mem_on(cap));
                let core = st.core[g].saturating_sub(demand.core_on());
                free_milli[g] = free_milli_of(mem, core, cap);
                let frag = mix.fragmentation(&free_milli[..n], host, model);
                free_milli[g] = keep;
                let key = (-frag, -connect(g), g);
                if best.is_none_or(|(f, c, _)| (key.0, key.1) > (f, c)) {
                    best = Some(key);
                }
            }
            best.map(|(_, _, g)| bit(g))
        }
    }
}

/// The general path's choice, for memo misses and multi-GPU shares.
fn general_pick(node: &Node, st: &Free, demand: &GpuDemand, how: &GpuChoice<'_>, cands: u64, k: usize) -> Option<u64> {
    let state = st.to_state(node);
    let cands: Vec<usize> = bits(cands).collect();
    let to_mask = |gs: &[usize]| gs.iter().fold(0, |m, &g| m | bit(g));
    if k == 1 {
        // only whole GPUs come here with one GPU: they are packed by policy (the look-ahead decides)
        let share = if demand.is_whole() { ShareChoice::Pack(how.policy) } else { how.share };
        gpu_select::choose_one(node, &state, &cands, demand, share).map(bit)
    } else {
        gpu_select::choose_set(node, &state, &cands, k, how.numa, how.policy, demand).map(|s| to_mask(&s))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MemoKey {
    topo: u64,
    numa_layout: u64,
    cands: u64,
    free: u64,
    k: usize,
    numa: NumaPolicy,
}

impl std::hash::Hash for MemoKey {
    /// All fields folded into one word, hashed once: collisions only cost an equality check.
    fn hash<H: Hasher>(&self, state: &mut H) {
        let numa = match self.numa {
            NumaPolicy::Required => 1u64,
            NumaPolicy::Preferred => 2,
            NumaPolicy::None => 3,
        };
        state.write_u64(
            self.cands
                ^ self.free.rotate_left(21)
                ^ self.numa_layout.rotate_left(42)
                ^ self.topo.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ (self.k as u64) << 56
                ^ numa << 62,
        );
    }
}

/// Memoized whole-GPU choices, per thread.
#[derive(Debug, Default)]
pub(crate) struct Memo {
    sets: HashMap<MemoKey, Option<u64>, BuildHasherDefault<KeyHasher>>,
}

/// Entries kept before the memo starts over (about 4 MiB); boards of up to 16 GPUs need far fewer.
const MEMO_LIMIT: usize = 1 << 16;

impl Memo {
    fn insert(&mut self, key: MemoKey, value: Option<u64>) {
        if self.sets.len() >= MEMO_LIMIT {
            self.sets.clear();
        }
        self.sets.insert(key, value);
    }
}

/// FxHash-style hashing: the keys are a few integers, and SipHash would cost more than the lookup.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }

    fn write_isize(&mut self, x: isize) {
        self.write_u64(x as u64);
    }
}

thread_local! {
    static MEMO: RefCell<Memo> = RefCell::new(Memo::default());
}

/// Runs `f` with this thread's memo (with a fresh one while it is in use further up the stack, or
/// when the thread is being torn down).
pub(crate) fn with_memo<R>(mut f: impl FnMut(&mut Memo) -> R) -> R {
    match MEMO.try_with(|cell| cell.try_borrow_mut().ok().map(|mut memo| f(&mut memo))) {
        Ok(Some(r)) => r,
        _ => f(&mut Memo::default()),
    }
}

/// A placement record for `req` with no GPUs yet, to be filled node by node.
pub(crate) fn blank_placement(req: &PodRequest) -> Placement {
    let containers = req
        .containers
        .iter()
        .map(|c| (c, false))
        .chain(req.init_containers.iter().map(|c| (c, true)))
        .map(|(c, init)| ContainerAssignment { name: c.name.clone(), init, slices: Vec::new() })
        .collect();
    Placement {
        assignment: PodAssignment {
            pod: req.key.clone(),
            node: String::new(),
            containers,
            cpu_milli: req.cpu_milli,
            memory_mib: req.memory_mib,
            group: req.group.as_ref().map(|g| g.key.clone()),
        },
        set_scores: Vec::new(),
    }
}

/// Writes the GPUs in `masks` into `p` (made by [`blank_placement`] for the same request), reusing
/// its buffers.
pub(crate) fn fill_placement(p: &mut Placement, node: &Node, req: &PodRequest, masks: &[u64]) {
    p.assignment.node.clear();
    p.assignment.node.push_str(&node.name);
    p.set_scores.clear();
    let demands = req.containers.iter().chain(&req.init_containers);
    for ((c, d), &m) in p.assignment.containers.iter_mut().zip(demands).zip(masks) {
        c.slices.clear();
        for g in bits(m) {
            let Some(gpu) = node.gpu_facts().get(g) else { continue };
            c.slices.push(GpuSlice {
                gpu: g as u32,
                mem_mib: d.demand.mem_on(gpu.memory_mib),
                core_pct: d.demand.core_on(),
                exclusive: d.demand.is_whole(),
            });
        }
        p.set_scores.push(mask_set_score(&node.topology, m));
    }
}
