//! The cluster model: nodes, their GPUs and links, live utilization, and who holds what.
//!
//! Every change goes through [`Cluster::allocate`] and [`Cluster::release`], which check capacity
//! before touching anything: a refused change leaves the model exactly as it was.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::assignment::{share_fraction, share_milli, Footprint, PodAssignment};
use crate::isolation::IsolationMode;
use crate::topology::GpuTopology;

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub uuid: String,
    /// NVML index on the node.
    pub index: u32,
    pub model: String,
    pub memory_mib: u64,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    pub healthy: bool,
}

/// What the device plugin last measured on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UtilSample {
    /// SM utilization in percent of the whole GPU.
    pub sm_pct: u32,
    pub mem_used_mib: u64,
    /// When it was taken, in Unix milliseconds.
    pub at_unix_ms: i64,
}

/// Allocated capacity on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct GpuUsage {
    pub mem_mib: u64,
    pub core_pct: u32,
    pub exclusive: bool,
    /// How many pods hold a slice of this GPU.
    pub holders: u32,
    /// How many device-plugin slots (kubelet devices) its containers hold: at most the node's
    /// [`slots_per_gpu`](Node::slots_per_gpu).
    pub slots: u32,
}

impl GpuUsage {
    /// Used fraction of a GPU of `capacity_mib`: 1 when held whole, else the larger of its compute
    /// and memory fractions (see [`share_fraction`]).
    #[inline]
    pub fn used_fraction(&self, capacity_mib: u64) -> f64 {
        let shared = share_fraction(self.mem_mib, self.core_pct, capacity_mib);
        // a select rather than an early return: which GPUs are held whole looks random to the branch
        // predictor, and mispredictions cost more than the division
        if self.exclusive {
            1.0
        } else {
            shared
        }
    }
}

/// What placement reads about one GPU on every node it looks at, copied out of [`Gpu`]: `Gpu` records
/// are 96 bytes, so reading capacity, health and NUMA node from them touched a cache line per GPU,
/// and that was a fifth of filtering thousands of nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuFacts {
    pub memory_mib: u64,
    pub numa_node: Option<u32>,
    pub healthy: bool,
}

impl GpuFacts {
    fn of(g: &Gpu) -> Self {
        Self { memory_mib: g.memory_mib, numa_node: g.numa_node, healthy: g.healthy }
    }
}

/// GPUs a node's per-GPU records hold inline (beyond it they go to the heap): scanning thousands of
/// nodes then reads each node as one contiguous stretch of the cluster's node list, which the CPU
/// streams ahead of use, rather than chasing a pointer per record (those cache misses were a quarter
/// of filtering).
const INLINE_GPUS: usize = 8;

/// Per-GPU records of one node.
#[derive(Clone)]
enum PerGpu<T> {
    Inline(u8, [T; INLINE_GPUS]),
    Heap(Vec<T>),
}

impl<T: Copy + Default> PerGpu<T> {
    fn filled(n: usize) -> Self {
        if n <= INLINE_GPUS {
            PerGpu::Inline(n as u8, [T::default(); INLINE_GPUS])
        } else {
            PerGpu::Heap(vec![T::default(); n])
        }
    }
}

impl<T> std::ops::Deref for PerGpu<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            PerGpu::Inline(n, items) => items.get(..usize::from(*n)).unwrap_or(&[]),
            PerGpu::Heap(v) => v,
        }
    }
}

impl<T> std::ops::DerefMut for PerGpu<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            PerGpu::Inline(n, items) => items.get_mut(..usize::from(*n)).unwrap_or(&mut []),
            PerGpu::Heap(v) => v,
        }
    }
}

impl<T: PartialEq> PartialEq for PerGpu<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for PerGpu<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A GPU's used share, as a fraction and in thousandths.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct UsedShare {
    fraction: f64,
    milli: u32,
}

/// A GPU node.
#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub gpus: Vec<Gpu>,
    pub topology: Arc<GpuTopology>,
    /// Host CPU (millicores) and memory (MiB) capacity; 0 means "not tracked here".
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// K: the device plugin advertises each GPU as K kubelet devices and each container holds one
    /// device of every GPU it uses, so at most K containers can share a GPU. `None`: not limited
    /// (nodes without the device plugin's word on it, and the simulator).
    pub slots_per_gpu: Option<u32>,
    /// The node's device plugin confirms each Allocate on the pod (its inventory's
    /// `confirmsAllocations`): bind then never leaves two pods it could confuse waiting for their
    /// Allocate on the node at once (`core::admission`).
    pub confirms_allocations: bool,
    /// What enforces shares' limits on the node (its inventory's `isolation`); `None`: not published
    /// (older plugins, the simulator), which counts as [`IsolationMode::Advisory`].
    pub isolation: Option<IsolationMode>,
    cpu_used: u64,
    mem_used: u64,
    usage: PerGpu<GpuUsage>,
    /// `gpus` in compact form. Brought up to date wherever `gpus` can change: construction,
    /// insertion into a cluster, `set_gpu_health` and the end of a [`NodeMut`] borrow.
    facts: PerGpu<GpuFacts>,
    /// Each GPU's used share, worked out from `usage` and `facts` whenever either changes (as `usage`
    /// is summed from the pods when they change): placement reads it for every GPU of every node, and
    /// the divisions were a good part of filtering.
    used: PerGpu<UsedShare>,
    utilization: PerGpu<Option<UtilSample>>,
    pods: BTreeMap<String, PodAssignment>,
    /// A stamp taken from one process-wide counter on every change (and when a node enters a
    /// cluster), so callers can cache per-node results: two nodes with the same stamp are the same
    /// node in the same state, even across clusters and clones, so a cache keyed by node index and
    /// stamp cannot serve a verdict for a node that was replaced or edited.
    generation: u64,
}

/// The next node stamp (see `Node::generation`). Relaxed is enough: only uniqueness matters, and the
/// stamp is read under the same lock as the node it describes.
fn next_stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl PartialEq for Node {
    /// Two nodes are equal when they have the same GPUs and the same allocations (the link graph is
    /// derived data and the generation counter is bookkeeping).
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.labels == other.labels
            && self.gpus == other.gpus
            && self.cpu_milli == other.cpu_milli
            && self.memory_mib == other.memory_mib
            && self.slots_per_gpu == other.slots_per_gpu
            && self.confirms_allocations == other.confirms_allocations
            && self.isolation == other.isolation
            && self.cpu_used == other.cpu_used
            && self.mem_used == other.mem_used
            && self.usage == other.usage
            && self.utilization == other.utilization
            && self.pods == other.pods
    }
}

/// Why a change to the model was refused. The model is untouched when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("unknown node {0:?}")]
    UnknownNode(String),
    #[error("pod {pod} already holds GPUs on node {node}")]
    AlreadyAllocated { pod: String, node: String },
    #[error("pod {0} holds nothing")]
    NotAllocated(String),
    #[error("pod {pod}: node {node} has no GPU {gpu}")]
    UnknownGpu { pod: String, node: String, gpu: u32 },
    #[error("pod {pod}: GPU {gpu} on {node} is held exclusively by another pod")]
    GpuExclusive { pod: String, node: String, gpu: u32 },
    #[error("pod {pod}: GPU {gpu} on {node} is shared, so it cannot be given exclusively")]
    GpuShared { pod: String, node: String, gpu: u32 },
    #[error("pod {pod}: GPU {gpu} on {node} would hold {need} MiB of {capacity} MiB")]
    MemoryOvercommit { pod: String, node: String, gpu: u32, need: u64, capacity: u64 },
    #[error("pod {pod}: GPU {gpu} on {node} would hold {need}% compute")]
    CoreOvercommit { pod: String, node: String, gpu: u32, need: u32 },
    #[error(
        "pod {pod}: GPU {gpu} on {node} would have {need} containers, but the device plugin gives it {slots} slots"
    )]
    SlotsExhausted { pod: String, node: String, gpu: u32, need: u32, slots: u32 },
    #[error("pod {pod}: node {node} would hold {need} of {capacity} {what}")]
    HostOvercommit { pod: String, node: String, what: &'static str, need: u64, capacity: u64 },
}

impl AllocError {
    /// The record is sound but does not fit what is left (memory, compute, slots, host).
    pub fn is_over_capacity(&self) -> bool {
        matches!(
            self,
            AllocError::MemoryOvercommit { .. }
                | AllocError::CoreOvercommit { .. }
                | AllocError::SlotsExhausted { .. }
                | AllocError::HostOvercommit { .. }
        )
    }
}

impl Node {
    pub fn new(
        name: impl Into<String>,
        labels: BTreeMap<String, String>,
        gpus: Vec<Gpu>,
        topology: Arc<GpuTopology>,
        cpu_milli: u64,
        memory_mib: u64,
    ) -> Self {
        let n = gpus.len();
        debug_assert_eq!(topology.len(), n, "topology must describe every GPU");
        let mut node = Self {
            name: name.into(),
            labels,
            gpus,
            topology,
            cpu_milli,
            memory_mib,
            slots_per_gpu: None,
            confirms_allocations: false,
            isolation: None,
            cpu_used: 0,
            mem_used: 0,
            usage: PerGpu::filled(n),
            facts: PerGpu::filled(n),
            used: PerGpu::filled(n),
            utilization: PerGpu::filled(n),
            pods: BTreeMap::new(),
            generation: next_stamp(),
        };
        node.refresh_facts();
        node
    }

    fn refresh_facts(&mut self) {
        self.facts = PerGpu::filled(self.gpus.len());
        for (f, g) in self.facts.iter_mut().zip(&self.gpus) {
            *f = GpuFacts::of(g);
        }
        self.used = PerGpu::filled(self.gpus.len());
        for g in 0..self.used.len() {
            self.usage_changed(g);
        }
    }

    /// Brings GPU `gpu`'s used share up to date with its usage and capacity.
    fn usage_changed(&mut self, gpu: usize) {
        let (Some(u), Some(f), Some(slot)) = (self.usage.get(gpu), self.facts.get(gpu), self.used.get_mut(gpu)) else {
            return;
        };
        *slot = UsedShare {
            fraction: u.used_fraction(f.memory_mib),
            milli: if u.exclusive { 1000 } else { share_milli(u.mem_mib, u.core_pct, f.memory_mib) },
        };
    }

    /// Used fraction of each GPU, by index (see [`gpu_used_fraction`](Self::gpu_used_fraction)).
    #[inline]
    pub fn used_fractions(&self) -> impl ExactSizeIterator<Item = f64> + '_ {
        self.used.iter().map(|u| u.fraction)
    }

    /// Used share of each GPU in thousandths, by index: 1000 when held whole, else the share of what
    /// is allocated on it (see [`share_milli`]); health plays no part.
    #[inline]
    pub fn used_milli(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.used.iter().map(|u| u.milli)
    }

    /// Capacity, health and NUMA node of each GPU, by index (as in `gpus`).
    #[inline]
    pub fn gpu_facts(&self) -> &[GpuFacts] {
        &self.facts
    }

    #[inline]
    pub fn usage(&self, gpu: usize) -> GpuUsage {
        self.usage[gpu]
    }

    #[inline]
    pub fn usages(&self) -> &[GpuUsage] {
        &self.usage
    }

    #[inline]
    pub fn free_mem(&self, gpu: usize) -> u64 {
        self.gpus[gpu].memory_mib.saturating_sub(self.usage[gpu].mem_mib)
    }

    #[inline]
    pub fn free_core(&self, gpu: usize) -> u32 {
        100u32.saturating_sub(self.usage[gpu].core_pct)
    }

    /// The node with at most `k` containers per GPU (see [`slots_per_gpu`](Self::slots_per_gpu)).
    pub fn with_slots_per_gpu(mut self, k: Option<u32>) -> Self {
        self.slots_per_gpu = k;
        self.generation = next_stamp();
        self
    }

    /// The node whose device plugin does (or does not) confirm Allocates (see
    /// [`confirms_allocations`](Self::confirms_allocations)).
    pub fn with_confirms_allocations(mut self, confirms: bool) -> Self {
        self.confirms_allocations = confirms;
        self.generation = next_stamp();
        self
    }

    /// The node with its published isolation mode (see [`isolation`](Self::isolation)).
    pub fn with_isolation(mut self, mode: Option<IsolationMode>) -> Self {
        self.isolation = mode;
        self.generation = next_stamp();
        self
    }

    /// K as a number: `u32::MAX` when the node sets no limit.
    #[inline]
    pub fn slot_capacity(&self) -> u32 {
        self.slots_per_gpu.unwrap_or(u32::MAX)
    }

    /// Containers that can still join GPU `gpu` (`u32::MAX` when the node sets no limit).
    #[inline]
    pub fn free_slots(&self, gpu: usize) -> u32 {
        match self.slots_per_gpu {
            Some(k) => k.saturating_sub(self.usage[gpu].slots),
            None => u32::MAX,
        }
    }

    /// Free share of a GPU now, in thousandths: 0 when it is held whole or unhealthy (nobody can use
    /// it), else 1000 minus the share of what is allocated on it.
    #[inline]
    pub fn free_milli(&self, gpu: usize) -> u32 {
        if !self.facts[gpu].healthy {
            return 0;
        }
        1000 - self.used[gpu].milli
    }

    /// Whether nobody holds any of this GPU.
    #[inline]
    pub fn is_gpu_free(&self, gpu: usize) -> bool {
        self.usage[gpu].holders == 0
    }

    /// GPUs nobody holds that are healthy.
    #[inline]
    pub fn idle_gpus(&self) -> usize {
        (0..self.gpus.len()).filter(|&g| self.is_gpu_free(g) && self.gpus[g].healthy).count()
    }

    /// Every GPU idle and healthy (and at least one): what a node-sized pod needs.
    #[inline]
    pub fn is_whole(&self) -> bool {
        !self.gpus.is_empty() && self.idle_gpus() == self.gpus.len()
    }

    #[inline]
    pub fn cpu_free(&self) -> u64 {
        self.cpu_milli.saturating_sub(self.cpu_used)
    }

    #[inline]
    pub fn mem_free(&self) -> u64 {
        self.memory_mib.saturating_sub(self.mem_used)
    }

    #[inline]
    pub fn cpu_used(&self) -> u64 {
        self.cpu_used
    }

    #[inline]
    pub fn mem_used(&self) -> u64 {
        self.mem_used
    }

    #[inline]
    pub fn pods(&self) -> impl Iterator<Item = &PodAssignment> {
        self.pods.values()
    }

    #[inline]
    pub fn pod(&self, key: &str) -> Option<&PodAssignment> {
        self.pods.get(key)
    }

    /// This node state's stamp: it changes whenever anything placement reads about the node
    /// changes (allocations, GPUs, labels, utilization), and is never reused for another state.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    #[inline]
    pub fn utilization(&self, gpu: usize) -> Option<UtilSample> {
        self.utilization.get(gpu).copied().flatten()
    }

    /// Records a live sample; out-of-range GPU indices are ignored (a stale inventory).
    pub fn set_utilization(&mut self, gpu: usize, sample: Option<UtilSample>) {
        if let Some(slot) = self.utilization.get_mut(gpu) {
            *slot = sample;
            self.generation = next_stamp();
        }
    }

    pub fn set_gpu_health(&mut self, gpu: usize, healthy: bool) {
        if let Some(g) = self.gpus.get_mut(gpu) {
            g.healthy = healthy;
            self.generation = next_stamp();
            self.refresh_facts();
        }
    }

    /// Allocated share of the node's GPU capacity, 0.0..=1.0 (compute and memory averaged per GPU,
    /// whichever is larger on each GPU).
    #[inline]
    pub fn gpu_load(&self) -> f64 {
        if self.gpus.is_empty() {
            return 0.0;
        }
        let used: f64 = (0..self.gpus.len()).map(|g| self.gpu_used_fraction(g)).sum();
        used / self.gpus.len() as f64
    }

    /// Used fraction of one GPU: the larger of its compute and memory fractions.
    #[inline]
    pub fn gpu_used_fraction(&self, gpu: usize) -> f64 {
        self.used[gpu].fraction
    }

    fn check(&self, a: &PodAssignment) -> Result<BTreeMap<u32, Footprint>, AllocError> {
        let err_ctx = || (a.pod.clone(), self.name.clone());
        if self.pods.contains_key(&a.pod) {
            return Err(AllocError::AlreadyAllocated { pod: a.pod.clone(), node: self.name.clone() });
        }
        let fps = a.footprints();
        for (&gpu, fp) in &fps {
            let (pod, node) = err_ctx();
            let g = gpu as usize;
            let Some(info) = self.gpus.get(g) else { return Err(AllocError::UnknownGpu { pod, node, gpu }) };
            let u = self.usage[g];
            if u.exclusive {
                return Err(AllocError::GpuExclusive { pod, node, gpu });
            }
            if fp.exclusive && u.holders > 0 {
                return Err(AllocError::GpuShared { pod, node, gpu });
            }
            let mem = u.mem_mib.saturating_add(fp.mem_mib);
            if mem > info.memory_mib {
                return Err(AllocError::MemoryOvercommit { pod, node, gpu, need: mem, capacity: info.memory_mib });
            }
            let core = u.core_pct.saturating_add(fp.core_pct);
            if core > 100 {
                return Err(AllocError::CoreOvercommit { pod, node, gpu, need: core });
            }
            let slots = u.slots.saturating_add(fp.slots);
            if let Some(k) = self.slots_per_gpu.filter(|&k| slots > k) {
                return Err(AllocError::SlotsExhausted { pod, node, gpu, need: slots, slots: k });
            }
        }
        if self.cpu_milli > 0 && self.cpu_used + a.cpu_milli > self.cpu_milli {
            let (pod, node) = err_ctx();
            return Err(AllocError::HostOvercommit {
                pod,
                node,
                what: "millicores",
                need: self.cpu_used + a.cpu_milli,
                capacity: self.cpu_milli,
            });
        }
        if self.memory_mib > 0 && self.mem_used + a.memory_mib > self.memory_mib {
            let (pod, node) = err_ctx();
            return Err(AllocError::HostOvercommit {
                pod,
                node,
                what: "MiB of host memory",
                need: self.mem_used + a.memory_mib,
                capacity: self.memory_mib,
            });
        }
        Ok(fps)
    }

    /// Whether the assignment fits, without changing anything.
    #[inline]
    pub fn can_allocate(&self, a: &PodAssignment) -> Result<(), AllocError> {
        self.check(a).map(|_| ())
    }

    fn allocate(&mut self, a: PodAssignment) -> Result<(), AllocError> {
        let fps = self.check(&a)?;
        self.apply(a, fps);
        Ok(())
    }

    /// Counts a record that fitted the node before its capacity shrank (fewer device-plugin slots,
    /// less memory): its pod still holds the GPUs, so it keeps counting, and the node is full until it
    /// goes. `Ok(Some(why))`: counted over capacity; `Err`: refused as `check` refuses anything else
    /// (an unknown GPU, an exclusivity clash).
    fn allocate_over_capacity(&mut self, a: PodAssignment) -> Result<Option<AllocError>, AllocError> {
        let (fps, over) = match self.check(&a) {
            Ok(fps) => (fps, None),
            Err(e) if e.is_over_capacity() => (a.footprints(), Some(e)),
            Err(e) => return Err(e),
        };
        self.apply(a, fps);
        Ok(over)
    }

    fn apply(&mut self, a: PodAssignment, fps: BTreeMap<u32, Footprint>) {
        for (gpu, fp) in fps {
            let u = &mut self.usage[gpu as usize];
            u.mem_mib += fp.mem_mib;
            u.core_pct += fp.core_pct;
            u.exclusive |= fp.exclusive;
            u.holders += 1;
            u.slots += fp.slots;
            self.usage_changed(gpu as usize);
        }
        self.cpu_used += a.cpu_milli;
        self.mem_used += a.memory_mib;
        self.pods.insert(a.pod.clone(), a);
        self.generation = next_stamp();
    }

    fn release(&mut self, pod: &str) -> Option<PodAssignment> {
        let a = self.pods.remove(pod)?;
        for (gpu, fp) in a.footprints() {
            let u = &mut self.usage[gpu as usize];
            u.mem_mib -= fp.mem_mib;
            u.core_pct -= fp.core_pct;
            u.holders -= 1;
            u.slots -= fp.slots;
            if fp.exclusive {
                u.exclusive = false;
            }
            self.usage_changed(gpu as usize);
        }
        self.cpu_used -= a.cpu_milli;
        self.mem_used -= a.memory_mib;
        self.generation = next_stamp();
        Some(a)
    }
}

/// A node borrowed mutably from a cluster; its public fields may be edited, and its compact copy of
/// them is brought up to date when the borrow ends.
#[derive(Debug)]
pub struct NodeMut<'a>(&'a mut Node, &'a mut u64);

impl std::ops::Deref for NodeMut<'_> {
    type Target = Node;
    fn deref(&self) -> &Node {
        self.0
    }
}

impl std::ops::DerefMut for NodeMut<'_> {
    fn deref_mut(&mut self) -> &mut Node {
        self.0
    }
}

impl Drop for NodeMut<'_> {
    fn drop(&mut self) {
        self.0.refresh_facts();
        // any public field may have been edited: results cached for the old state must not match
        self.0.generation = next_stamp();
        *self.1 = self.0.generation;
    }
}

/// A record that [`Cluster::rebuild`] or [`Cluster::upsert_node`] could not apply as it is, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildConflict {
    pub pod: String,
    pub reason: AllocError,
    /// Still counted, over the node's new capacity (see [`Cluster::upsert_node`]); otherwise dropped.
    pub kept: bool,
}

/// The whole cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    nodes: Vec<Node>,
    /// Each node's stamp ([`Node::generation`]), by index, kept in step with `nodes`.
    stamps: Stamps,
    by_name: HashMap<String, usize>,
    pod_node: HashMap<String, usize>,
    /// Node label keys that describe the network, coarse to fine (e.g. spine, then ToR).
    pub network_levels: Vec<String>,
    name_rank: NameRank,
    layout: Layout,
}

/// A stamp of the node indexing, new whenever indices may change (a cluster is built, a node is
/// removed): caches keyed by node index check it before trusting an index. Bookkeeping, so it takes
/// no part in equality.
#[derive(Debug, Clone, Copy)]
struct Layout(u64);

/// Each node's position in name order, computed on first use: ranking breaks score ties by node name,
/// and comparing integers instead of strings keeps that off the hot path. Derived data, so it takes
/// no part in equality.
#[derive(Debug, Clone, Default)]
struct NameRank(std::sync::OnceLock<Vec<u32>>);

/// The nodes' stamps in one array: a cache check per candidate node reads 8 bytes here rather than a
/// cache line of each (scattered) node record. Derived data, so it takes no part in equality.
#[derive(Debug, Clone, Default)]
struct Stamps(Vec<u64>);

// derived data and bookkeeping: no part in equality
macro_rules! always_equal { ($($t:ty),*) => { $(impl PartialEq for $t { fn eq(&self, _: &Self) -> bool { true } })* } }
always_equal!(Layout, NameRank, Stamps);

/// The default network levels: spine, then top-of-rack switch.
pub const DEFAULT_NETWORK_LEVELS: [&str; 2] = ["network.gpuplace.io/spine", "network.gpuplace.io/tor"];

/// The labels that put a node under `spine` and `tor` on the default network levels.
pub fn network_labels(spine: impl Into<String>, tor: impl Into<String>) -> BTreeMap<String, String> {
    BTreeMap::from([
        (DEFAULT_NETWORK_LEVELS[0].to_string(), spine.into()),
        (DEFAULT_NETWORK_LEVELS[1].to_string(), tor.into()),
    ])
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

impl Cluster {
    /// Builds a cluster; a later node with an already used name replaces the earlier one.
    pub fn new(nodes: Vec<Node>) -> Self {
        let mut c = Self {
            nodes: Vec::new(),
            stamps: Stamps::default(),
            by_name: HashMap::new(),
            pod_node: HashMap::new(),
            network_levels: DEFAULT_NETWORK_LEVELS.iter().map(|s| s.to_string()).collect(),
            name_rank: NameRank::default(),
            layout: Layout(next_stamp()),
        };
        for n in nodes {
            c.upsert_node(n);
        }
        c
    }

    /// Adds a node, or replaces the node of that name (its inventory changed) while keeping its
    /// allocations: their pods still hold the GPUs. A record that no longer fits the new capacity
    /// (fewer slots, less memory) keeps counting, over capacity, so nothing is placed beside it until
    /// it goes; one that names a GPU the node no longer has, or clashes with another, is dropped.
    /// Returns both kinds.
    pub fn upsert_node(&mut self, mut node: Node) -> Vec<RebuildConflict> {
        // its public fields may have been edited since it was built (or it is a copy of a node of
        // another cluster): a fresh stamp, so nothing cached for another state matches it
        node.refresh_facts();
        node.generation = next_stamp();
        match self.by_name.get(&node.name) {
            None => {
                for p in node.pods.keys() {
                    self.pod_node.insert(p.clone(), self.nodes.len());
                }
                self.by_name.insert(node.name.clone(), self.nodes.len());
                self.stamps.0.push(node.generation);
                self.nodes.push(node);
                self.name_rank = NameRank::default();
                Vec::new()
            }
            Some(&i) => {
                let old = std::mem::take(&mut self.nodes[i].pods);
                let mut conflicts = Vec::new();
                node.pods.clear();
                node.usage = PerGpu::filled(node.gpus.len());
                node.refresh_facts();
                node.cpu_used = 0;
                node.mem_used = 0;
                for (_, a) in old {
                    let pod = a.pod.clone();
                    match node.allocate_over_capacity(a) {
                        Ok(None) => {}
                        Ok(Some(reason)) => conflicts.push(RebuildConflict { pod, reason, kept: true }),
                        Err(reason) => {
                            self.pod_node.remove(&pod);
                            conflicts.push(RebuildConflict { pod, reason, kept: false });
                        }
                    }
                }
                self.stamps.0[i] = node.generation;
                self.nodes[i] = node;
                conflicts
            }
        }
    }

    /// Removes a node (its Node object was deleted) and returns it with its allocations, which no
    /// longer count anywhere. Node order is kept; indices after it shift down by one.
    pub fn remove_node(&mut self, name: &str) -> Option<Node> {
        let i = self.by_name.remove(name)?;
        let node = self.nodes.remove(i);
        for p in node.pods.keys() {
            self.pod_node.remove(p);
        }
        for v in self.by_name.values_mut().chain(self.pod_node.values_mut()) {
            if *v > i {
                *v -= 1;
            }
        }
        self.stamps.0.remove(i);
        self.name_rank = NameRank::default();
        self.layout = Layout(next_stamp());
        Some(node)
    }

    /// The stamp of the current node indexing: equal stamps mean every index names the same node
    /// (appending a node keeps it: existing indices do not move).
    pub fn layout(&self) -> u64 {
        self.layout.0
    }

    #[inline]
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Each node's position when the nodes are sorted by name (node names are unique).
    pub fn name_rank(&self) -> &[u32] {
        self.name_rank.0.get_or_init(|| {
            let mut order: Vec<usize> = (0..self.nodes.len()).collect();
            order.sort_unstable_by(|&a, &b| self.nodes[a].name.cmp(&self.nodes[b].name));
            let mut rank = vec![0; self.nodes.len()];
            for (r, i) in order.into_iter().enumerate() {
                rank[i] = r as u32;
            }
            rank
        })
    }

    #[inline]
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.by_name.get(name).map(|&i| &self.nodes[i])
    }

    #[inline]
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Mutable access to a node (its name must stay as it is: the cluster finds nodes by name).
    #[inline]
    pub fn node_mut(&mut self, name: &str) -> Option<NodeMut<'_>> {
        let i = *self.by_name.get(name)?;
        Some(NodeMut(&mut self.nodes[i], &mut self.stamps.0[i]))
    }

    /// Each node's [`Node::generation`], by index.
    #[inline]
    pub fn stamps(&self) -> &[u64] {
        &self.stamps.0
    }

    /// Where a pod is allocated.
    #[inline]
    pub fn pod_node(&self, pod: &str) -> Option<&Node> {
        self.pod_node.get(pod).map(|&i| &self.nodes[i])
    }

    #[inline]
    pub fn assignment(&self, pod: &str) -> Option<&PodAssignment> {
        self.pod_node(pod).and_then(|n| n.pod(pod))
    }

    /// Counts an allocation. Refused (and nothing changes) when the pod already holds GPUs, the node
    /// or a GPU is unknown, or any GPU, memory or compute would be over-committed.
    pub fn allocate(&mut self, a: PodAssignment) -> Result<(), AllocError> {
        if let Some(&i) = self.pod_node.get(&a.pod) {
            return Err(AllocError::AlreadyAllocated { pod: a.pod, node: self.nodes[i].name.clone() });
        }
        let i = *self.by_name.get(&a.node).ok_or_else(|| AllocError::UnknownNode(a.node.clone()))?;
        let pod = a.pod.clone();
        self.nodes[i].allocate(a)?;
        self.stamps.0[i] = self.nodes[i].generation;
        self.pod_node.insert(pod, i);
        Ok(())
    }

    /// Counts an allocation that exists in the world (a claim another allocator wrote), even past
    /// capacity: it holds the GPUs. `Ok(Some(why))`: counted over capacity; `Err`: refused as
    /// [`Cluster::allocate`] refuses anything else (unknown node or GPU, counted already, exclusivity).
    pub fn count_observed(&mut self, a: PodAssignment) -> Result<Option<AllocError>, AllocError> {
        if let Some(&i) = self.pod_node.get(&a.pod) {
            return Err(AllocError::AlreadyAllocated { pod: a.pod, node: self.nodes[i].name.clone() });
        }
        let i = *self.by_name.get(&a.node).ok_or_else(|| AllocError::UnknownNode(a.node.clone()))?;
        let pod = a.pod.clone();
        let over = self.nodes[i].allocate_over_capacity(a)?;
        self.stamps.0[i] = self.nodes[i].generation;
        self.pod_node.insert(pod, i);
        Ok(over)
    }

    /// Gives back everything a pod holds, restoring the node exactly.
    pub fn release(&mut self, pod: &str) -> Result<PodAssignment, AllocError> {
        let i = self.pod_node.remove(pod).ok_or_else(|| AllocError::NotAllocated(pod.to_string()))?;
        let a = self.nodes[i].release(pod).ok_or_else(|| AllocError::NotAllocated(pod.to_string()));
        self.stamps.0[i] = self.nodes[i].generation;
        a
    }

    /// Forgets every allocation and applies the records in order (sorted by pod for determinism).
    /// Records that conflict with one applied earlier are refused and returned.
    pub fn rebuild(&mut self, mut records: Vec<PodAssignment>) -> Vec<RebuildConflict> {
        for (n, stamp) in self.nodes.iter_mut().zip(&mut self.stamps.0) {
            let pods: Vec<String> = n.pods.keys().cloned().collect();
            for p in pods {
                n.release(&p);
            }
            *stamp = n.generation;
        }
        self.pod_node.clear();
        records.sort_by(|a, b| a.pod.cmp(&b.pod));
        let mut conflicts = Vec::new();
        for r in records {
            let pod = r.pod.clone();
            if let Err(reason) = self.allocate(r) {
                conflicts.push(RebuildConflict { pod, reason, kept: false });
            }
        }
        conflicts
    }

    /// The node's value for each network level (`None` where the label is missing).
    #[inline]
    pub fn network_path<'a>(&'a self, node: &'a Node) -> impl Iterator<Item = Option<&'a str>> + 'a {
        self.network_levels.iter().map(move |k| node.labels.get(k).map(String::as_str))
    }
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
pub(crate) mod tests;
