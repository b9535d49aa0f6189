//! The cluster model: nodes, their GPUs and links, live utilization, and who holds what.
//!
//! Every change goes through [`Cluster::allocate`] and [`Cluster::release`], which check capacity
//! before touching anything: a refused change leaves the model exactly as it was.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::core::topology::GpuTopology;

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

/// The slice of one GPU given to one container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuSlice {
    /// GPU index on the node.
    pub gpu: u32,
    pub mem_mib: u64,
    pub core_pct: u32,
    /// A whole GPU that nobody else may use.
    pub exclusive: bool,
}

/// The GPUs one container got.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContainerAssignment {
    pub name: String,
    /// Init containers run alone before the app containers and reuse their slices.
    #[serde(default)]
    pub init: bool,
    pub slices: Vec<GpuSlice>,
}

/// Everything one pod holds on one node: the allocation record that bind writes and restarts read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodAssignment {
    /// `namespace/name`.
    pub pod: String,
    pub node: String,
    pub containers: Vec<ContainerAssignment>,
    #[serde(default)]
    pub cpu_milli: u64,
    #[serde(default)]
    pub memory_mib: u64,
    /// The group (`namespace/label`) the pod belongs to, for network locality.
    #[serde(default)]
    pub group: Option<String>,
}

/// What a pod takes from one GPU while it lives: app containers hold their slices together, and each
/// init container runs alone, so the footprint is the larger of the two in each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Footprint {
    mem_mib: u64,
    core_pct: u32,
    exclusive: bool,
}

impl PodAssignment {
    fn footprints(&self) -> BTreeMap<u32, Footprint> {
        let mut app: BTreeMap<u32, Footprint> = BTreeMap::new();
        let mut init: BTreeMap<u32, Footprint> = BTreeMap::new();
        for c in &self.containers {
            for s in &c.slices {
                if c.init {
                    let f = init.entry(s.gpu).or_default();
                    f.mem_mib = f.mem_mib.max(s.mem_mib);
                    f.core_pct = f.core_pct.max(s.core_pct);
                    f.exclusive |= s.exclusive;
                } else {
                    let f = app.entry(s.gpu).or_default();
                    f.mem_mib = f.mem_mib.saturating_add(s.mem_mib);
                    f.core_pct = f.core_pct.saturating_add(s.core_pct);
                    f.exclusive |= s.exclusive;
                }
            }
        }
        for (gpu, i) in init {
            let f = app.entry(gpu).or_default();
            f.mem_mib = f.mem_mib.max(i.mem_mib);
            f.core_pct = f.core_pct.max(i.core_pct);
            f.exclusive |= i.exclusive;
        }
        app
    }

    /// GPU indices the app containers use, without repeats.
    pub fn gpus(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self.containers.iter().flat_map(|c| c.slices.iter().map(|s| s.gpu)).collect();
        g.sort_unstable();
        g.dedup();
        g
    }
}

/// Allocated capacity on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct GpuUsage {
    pub mem_mib: u64,
    pub core_pct: u32,
    pub exclusive: bool,
    /// How many pods hold a slice of this GPU.
    pub holders: u32,
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
    cpu_used: u64,
    mem_used: u64,
    usage: Vec<GpuUsage>,
    utilization: Vec<Option<UtilSample>>,
    pods: BTreeMap<String, PodAssignment>,
    /// Bumped on every change, so callers can cache per-node results.
    generation: u64,
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
    #[error("pod {pod}: node {node} would hold {need} of {capacity} {what}")]
    HostOvercommit { pod: String, node: String, what: &'static str, need: u64, capacity: u64 },
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
        Self {
            name: name.into(),
            labels,
            gpus,
            topology,
            cpu_milli,
            memory_mib,
            cpu_used: 0,
            mem_used: 0,
            usage: vec![GpuUsage::default(); n],
            utilization: vec![None; n],
            pods: BTreeMap::new(),
            generation: 0,
        }
    }

    pub fn usage(&self, gpu: usize) -> GpuUsage {
        self.usage[gpu]
    }

    pub fn usages(&self) -> &[GpuUsage] {
        &self.usage
    }

    pub fn free_mem(&self, gpu: usize) -> u64 {
        self.gpus[gpu].memory_mib.saturating_sub(self.usage[gpu].mem_mib)
    }

    pub fn free_core(&self, gpu: usize) -> u32 {
        100u32.saturating_sub(self.usage[gpu].core_pct)
    }

    /// Whether nobody holds any of this GPU.
    pub fn is_gpu_free(&self, gpu: usize) -> bool {
        self.usage[gpu].holders == 0
    }

    pub fn cpu_free(&self) -> u64 {
        self.cpu_milli.saturating_sub(self.cpu_used)
    }

    pub fn mem_free(&self) -> u64 {
        self.memory_mib.saturating_sub(self.mem_used)
    }

    pub fn cpu_used(&self) -> u64 {
        self.cpu_used
    }

    pub fn mem_used(&self) -> u64 {
        self.mem_used
    }

    pub fn pods(&self) -> impl Iterator<Item = &PodAssignment> {
        self.pods.values()
    }

    pub fn pod(&self, key: &str) -> Option<&PodAssignment> {
        self.pods.get(key)
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn utilization(&self, gpu: usize) -> Option<UtilSample> {
        self.utilization.get(gpu).copied().flatten()
    }

    /// Records a live sample; out-of-range GPU indices are ignored (a stale inventory).
    pub fn set_utilization(&mut self, gpu: usize, sample: Option<UtilSample>) {
        if let Some(slot) = self.utilization.get_mut(gpu) {
            *slot = sample;
            self.generation += 1;
        }
    }

    pub fn set_gpu_health(&mut self, gpu: usize, healthy: bool) {
        if let Some(g) = self.gpus.get_mut(gpu) {
            g.healthy = healthy;
            self.generation += 1;
        }
    }

    /// Allocated share of the node's GPU capacity, 0.0..=1.0 (compute and memory averaged per GPU,
    /// whichever is larger on each GPU).
    pub fn gpu_load(&self) -> f64 {
        if self.gpus.is_empty() {
            return 0.0;
        }
        let used: f64 = (0..self.gpus.len()).map(|g| self.gpu_used_fraction(g)).sum();
        used / self.gpus.len() as f64
    }

    /// Used fraction of one GPU: the larger of its compute and memory fractions.
    pub fn gpu_used_fraction(&self, gpu: usize) -> f64 {
        let u = self.usage[gpu];
        if u.exclusive {
            return 1.0;
        }
        let mem =
            if self.gpus[gpu].memory_mib == 0 { 0.0 } else { u.mem_mib as f64 / self.gpus[gpu].memory_mib as f64 };
        (f64::from(u.core_pct) / 100.0).max(mem).min(1.0)
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
    pub fn can_allocate(&self, a: &PodAssignment) -> Result<(), AllocError> {
        self.check(a).map(|_| ())
    }

    fn allocate(&mut self, a: PodAssignment) -> Result<(), AllocError> {
        let fps = self.check(&a)?;
        for (gpu, fp) in fps {
            let u = &mut self.usage[gpu as usize];
            u.mem_mib += fp.mem_mib;
            u.core_pct += fp.core_pct;
            u.exclusive |= fp.exclusive;
            u.holders += 1;
        }
        self.cpu_used += a.cpu_milli;
        self.mem_used += a.memory_mib;
        self.pods.insert(a.pod.clone(), a);
        self.generation += 1;
        Ok(())
    }

    fn release(&mut self, pod: &str) -> Option<PodAssignment> {
        let a = self.pods.remove(pod)?;
        for (gpu, fp) in a.footprints() {
            let u = &mut self.usage[gpu as usize];
            u.mem_mib -= fp.mem_mib;
            u.core_pct -= fp.core_pct;
            u.holders -= 1;
            if fp.exclusive {
                u.exclusive = false;
            }
        }
        self.cpu_used -= a.cpu_milli;
        self.mem_used -= a.memory_mib;
        self.generation += 1;
        Some(a)
    }
}

/// A record that [`Cluster::rebuild`] could not apply, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildConflict {
    pub pod: String,
    pub reason: AllocError,
}

/// The whole cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    nodes: Vec<Node>,
    by_name: HashMap<String, usize>,
    pod_node: HashMap<String, usize>,
    /// Node label keys that describe the network, coarse to fine (e.g. spine, then ToR).
    pub network_levels: Vec<String>,
}

/// The default network levels: spine, then top-of-rack switch.
pub const DEFAULT_NETWORK_LEVELS: [&str; 2] = ["network.gpuplace.io/spine", "network.gpuplace.io/tor"];

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
            by_name: HashMap::new(),
            pod_node: HashMap::new(),
            network_levels: DEFAULT_NETWORK_LEVELS.iter().map(|s| s.to_string()).collect(),
        };
        for n in nodes {
            c.upsert_node(n);
        }
        c
    }

    /// Adds a node, or replaces the node of that name while keeping its allocations where they still
    /// fit (a node whose inventory changed). Returns the records that no longer fit.
    pub fn upsert_node(&mut self, mut node: Node) -> Vec<RebuildConflict> {
        match self.by_name.get(&node.name) {
            None => {
                for p in node.pods.keys() {
                    self.pod_node.insert(p.clone(), self.nodes.len());
                }
                self.by_name.insert(node.name.clone(), self.nodes.len());
                self.nodes.push(node);
                Vec::new()
            }
            Some(&i) => {
                let old = std::mem::take(&mut self.nodes[i].pods);
                let mut conflicts = Vec::new();
                node.pods.clear();
                node.usage = vec![GpuUsage::default(); node.gpus.len()];
                node.cpu_used = 0;
                node.mem_used = 0;
                node.generation = self.nodes[i].generation + 1;
                for (_, a) in old {
                    let pod = a.pod.clone();
                    if let Err(reason) = node.allocate(a) {
                        self.pod_node.remove(&pod);
                        conflicts.push(RebuildConflict { pod, reason });
                    }
                }
                self.nodes[i] = node;
                conflicts
            }
        }
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.by_name.get(name).map(|&i| &self.nodes[i])
    }

    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn node_mut(&mut self, name: &str) -> Option<&mut Node> {
        self.by_name.get(name).map(|&i| &mut self.nodes[i])
    }

    /// Where a pod is allocated.
    pub fn pod_node(&self, pod: &str) -> Option<&Node> {
        self.pod_node.get(pod).map(|&i| &self.nodes[i])
    }

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
        self.pod_node.insert(pod, i);
        Ok(())
    }

    /// Gives back everything a pod holds, restoring the node exactly.
    pub fn release(&mut self, pod: &str) -> Result<PodAssignment, AllocError> {
        let i = self.pod_node.remove(pod).ok_or_else(|| AllocError::NotAllocated(pod.to_string()))?;
        self.nodes[i].release(pod).ok_or_else(|| AllocError::NotAllocated(pod.to_string()))
    }

    /// Forgets every allocation and applies the records in order (sorted by pod for determinism).
    /// Records that conflict with one applied earlier are refused and returned.
    pub fn rebuild(&mut self, mut records: Vec<PodAssignment>) -> Vec<RebuildConflict> {
        for n in &mut self.nodes {
            let pods: Vec<String> = n.pods.keys().cloned().collect();
            for p in pods {
                n.release(&p);
            }
        }
        self.pod_node.clear();
        records.sort_by(|a, b| a.pod.cmp(&b.pod));
        let mut conflicts = Vec::new();
        for r in records {
            let pod = r.pod.clone();
            if let Err(reason) = self.allocate(r) {
                conflicts.push(RebuildConflict { pod, reason });
            }
        }
        conflicts
    }

    /// The node's value for each network level (`None` where the label is missing).
    pub fn network_path<'a>(&'a self, node: &'a Node) -> impl Iterator<Item = Option<&'a str>> + 'a {
        self.network_levels.iter().map(move |k| node.labels.get(k).map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn node(name: &str, gpus: usize) -> Node {
        let g = (0..gpus)
            .map(|i| Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i as u32,
                model: "T".into(),
                memory_mib: 1000,
                numa_node: Some((i / 4) as u32),
                pci_bus_id: String::new(),
                healthy: true,
            })
            .collect();
        Node::new(name, BTreeMap::new(), g, Arc::new(GpuTopology::flat(gpus)), 0, 0)
    }

    fn share(pod: &str, gpu: u32, mem: u64, core: u32) -> PodAssignment {
        PodAssignment {
            pod: pod.into(),
            node: "n".into(),
            containers: vec![ContainerAssignment {
                name: "c".into(),
                init: false,
                slices: vec![GpuSlice { gpu, mem_mib: mem, core_pct: core, exclusive: false }],
            }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        }
    }

    #[test]
    fn refuses_overcommit_and_leaves_state_alone() {
        let mut c = Cluster::new(vec![node("n", 2)]);
        let before = c.clone();
        c.allocate(share("a", 0, 600, 50)).unwrap();
        let mid = c.clone();
        assert!(matches!(c.allocate(share("b", 0, 500, 10)), Err(AllocError::MemoryOvercommit { .. })));
        assert!(matches!(c.allocate(share("b", 0, 100, 60)), Err(AllocError::CoreOvercommit { .. })));
        assert!(matches!(c.allocate(share("a", 1, 1, 1)), Err(AllocError::AlreadyAllocated { .. })));
        let mut whole = share("w", 0, 1000, 100);
        whole.containers[0].slices[0].exclusive = true;
        assert!(matches!(c.allocate(whole.clone()), Err(AllocError::GpuShared { .. })));
        assert_eq!(c, mid);
        c.release("a").unwrap();
        assert_eq!(c, before);
        c.allocate(whole).unwrap();
        assert!(matches!(c.allocate(share("b", 0, 1, 1)), Err(AllocError::GpuExclusive { .. })));
    }

    #[test]
    fn init_containers_reuse_app_slices() {
        let mut c = Cluster::new(vec![node("n", 1)]);
        let mut a = share("a", 0, 300, 30);
        a.containers.push(ContainerAssignment {
            name: "init".into(),
            init: true,
            slices: vec![GpuSlice { gpu: 0, mem_mib: 500, core_pct: 20, exclusive: false }],
        });
        c.allocate(a).unwrap();
        let u = c.node("n").unwrap().usage(0);
        assert_eq!((u.mem_mib, u.core_pct, u.holders), (500, 30, 1));
    }

    #[test]
    fn rebuild_refuses_conflicting_records() {
        let mut c = Cluster::new(vec![node("n", 1)]);
        let conflicts = c.rebuild(vec![share("a", 0, 600, 10), share("b", 0, 600, 10), share("c", 3, 1, 1)]);
        assert_eq!(conflicts.len(), 2);
        assert_eq!(conflicts[0].pod, "b");
        assert!(c.assignment("a").is_some());
        assert!(c.assignment("b").is_none());
    }
}
