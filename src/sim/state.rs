//! The simulated cluster: gpuplace's [`Cluster`] (every placement is checked there, so nothing can
//! be over-committed) plus a compact mirror in thousandths of a GPU that the baselines score from.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::placement::mix::WorkloadMix;
use crate::sim::trace::{model_memory_mib, TraceNode, TracePod};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::{network_labels, Cluster, Gpu, Node};
use gpuplace_core::inventory::synthetic_uuid;
use gpuplace_core::topology::{GpuTopology, Link, NvlinkFabric, PcieLevel};

/// A node as the FGD simulator sees it.
#[derive(Debug, Clone)]
pub struct SimNode {
    pub model: String,
    /// Host CPU (millicores) and memory (MiB) of the node, and what is left of them.
    pub cpu_total: u64,
    pub cpu_left: u64,
    pub mem_total: u64,
    pub mem_left: u64,
    /// Free share of each GPU in thousandths.
    pub left: Vec<u32>,
    /// Pods placed here by kind: index 0 for shares, N for N whole GPUs (GPU clustering).
    pub kinds: BTreeMap<u32, u32>,
    /// Bumped on every placement, for per-node caches.
    pub generation: u64,
}

impl SimNode {
    pub fn gpu_left(&self) -> u32 {
        self.left.iter().sum()
    }

    /// FGD's filter: host CPU and memory, model, and GPU room.
    pub fn fits(&self, pod: &TracePod, models: &[String]) -> bool {
        if self.cpu_left < pod.cpu_milli || self.mem_left < pod.memory_mib {
            return false;
        }
        let milli = pod.milli();
        if milli == 0 {
            return true;
        }
        if self.left.is_empty() || !(models.is_empty() || models.contains(&self.model)) {
            return false;
        }
        if pod.num_gpu == 1 && milli < 1000 {
            self.left.iter().any(|&l| l >= milli)
        } else {
            self.left.iter().filter(|&&l| l >= 1000).count() >= pod.num_gpu as usize
        }
    }

    /// The first `n` idle GPUs by index (FGD and the baselines give whole GPUs this way).
    pub fn first_idle(&self, n: u32) -> Vec<usize> {
        (0..self.left.len()).filter(|&g| self.left[g] >= 1000).take(n as usize).collect()
    }

    /// Best fit for a share: the GPU with the least room that still fits, lowest index on ties.
    pub fn best_fit_gpu(&self, milli: u32) -> Option<usize> {
        (0..self.left.len()).filter(|&g| self.left[g] >= milli).min_by_key(|&g| (self.left[g], g))
    }

    /// GPUs a pod takes under best fit.
    pub fn best_fit(&self, pod: &TracePod) -> Vec<usize> {
        let milli = pod.milli();
        if milli == 0 {
            Vec::new()
        } else if pod.num_gpu == 1 && milli < 1000 {
            self.best_fit_gpu(milli).into_iter().collect()
        } else {
            self.first_idle(pod.num_gpu)
        }
    }
}

/// Nodes per leaf switch and per spine in the simulated network: the trace has no network, so nodes
/// are put under switches in node-list order (16 per ToR, 8 ToRs per spine). Only groups' plans
/// and their closeness figures read it.
pub const SYNTHETIC_TOR: usize = 16;
pub const SYNTHETIC_SPINE: usize = 128;

/// The boards the simulated nodes have. The trace publishes no topology, and its replays treat every
/// node as flat (the paper's protocol); `Hgx` is a what-if of a training cluster, in which every
/// 8-GPU node is an HGX board (8 GPUs joined by NVSwitch), so that the room such nodes keep for
/// node-sized jobs counts (`placement::whole_units`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Boards {
    /// Every node flat: its GPUs on one host bridge, no NVLink.
    #[default]
    Flat,
    /// 8-GPU nodes are HGX boards (NVSwitch); the others flat.
    Hgx,
}

impl Boards {
    pub fn name(self) -> &'static str {
        match self {
            Boards::Flat => "flat",
            Boards::Hgx => "hgx",
        }
    }

    /// Marks the nodes the what-if makes HGX boards.
    pub fn apply(self, nodes: &mut [TraceNode]) {
        if self == Boards::Hgx {
            for n in nodes.iter_mut().filter(|n| n.gpu == 8) {
                n.nvswitch = true;
            }
        }
    }
}

/// `n` GPUs joined by NVSwitch, each pair with 18 NVLinks (an HGX H100 board's, as
/// `core::inventory`'s `nvswitch` board).
fn nvswitch_board(n: usize) -> GpuTopology {
    let links =
        (0..n as u32).flat_map(|a| (a + 1..n as u32).map(move |b| (a, b, Link { nvlinks: 18, pcie: PcieLevel::Sys })));
    GpuTopology::new(n, NvlinkFabric::Nvswitch, links, PcieLevel::Sys).unwrap_or_else(|_| GpuTopology::flat(n))
}

/// The cluster under simulation.
#[derive(Debug, Clone)]
pub struct SimState {
    pub cluster: Cluster,
    pub nodes: Vec<SimNode>,
    pub mix: WorkloadMix,
    /// Cached fragmentation per node and its sum.
    frag: Vec<f64>,
    pub frag_total: f64,
    pub idle_total: u64,
    pub capacity_milli: u64,
}

impl SimState {
    pub fn new(trace_nodes: &[TraceNode], mix: WorkloadMix) -> Self {
        let mut boards: BTreeMap<(usize, bool), Arc<GpuTopology>> = BTreeMap::new();
        let mut nodes = Vec::with_capacity(trace_nodes.len());
        let mut sim = Vec::with_capacity(trace_nodes.len());
        for t in trace_nodes {
            let n = t.gpu as usize;
            let topo = boards
                .entry((n, t.nvswitch))
                .or_insert_with(|| Arc::new(if t.nvswitch { nvswitch_board(n) } else { GpuTopology::flat(n) }))
                .clone();
            let mem = model_memory_mib(&t.model);
            let gpus = (0..t.gpu)
                .map(|i| Gpu {
                    uuid: synthetic_uuid(&t.name, i),
                    index: i,
                    model: t.model.clone(),
                    memory_mib: mem,
                    numa_node: Some(0),
                    pci_bus_id: String::new(),
                    healthy: true,
                })
                .collect();
            // the trace has no network: a synthetic one, in node-list order (see `SYNTHETIC_TOR`)
            let i = nodes.len();
            let labels = network_labels(format!("spine-{}", i / SYNTHETIC_SPINE), format!("tor-{}", i / SYNTHETIC_TOR));
            nodes.push(Node::new(t.name.clone(), labels, gpus, topo, t.cpu_milli, t.memory_mib));
            sim.push(SimNode {
                model: t.model.clone(),
                cpu_total: t.cpu_milli,
                cpu_left: t.cpu_milli,
                mem_total: t.memory_mib,
                mem_left: t.memory_mib,
                left: vec![1000; n],
                kinds: BTreeMap::new(),
                generation: 0,
            });
        }
        let frag: Vec<f64> = sim.iter().map(|n| mix.fgd_fragmentation(&n.left, Some(n.cpu_left), &n.model)).collect();
        let capacity_milli = sim.iter().map(|n| 1000 * n.left.len() as u64).sum();
        Self {
            cluster: Cluster::new(nodes),
            frag_total: frag.iter().sum(),
            frag,
            idle_total: capacity_milli,
            capacity_milli,
            nodes: sim,
            mix,
        }
    }

    pub fn used_milli(&self) -> u64 {
        self.capacity_milli - self.idle_total
    }

    /// Places `pod` on `node` using `gpus`; the cluster model checks it first, so a policy bug can
    /// never over-commit a GPU (it fails loudly instead).
    pub fn apply(
        &mut self,
        node: usize,
        pod: &TracePod,
        gpus: &[usize],
    ) -> Result<(), gpuplace_core::cluster::AllocError> {
        let req = pod.request(&pod.name);
        let n = &self.cluster.nodes()[node];
        let containers = req
            .containers
            .iter()
            .map(|c| ContainerAssignment {
                name: c.name.clone(),
                init: false,
                slices: gpus
                    .iter()
                    .map(|&g| GpuSlice {
                        gpu: g as u32,
                        mem_mib: c.demand.mem_on(n.gpus[g].memory_mib),
                        core_pct: c.demand.core_on(),
                        exclusive: c.demand.is_whole(),
                    })
                    .collect(),
            })
            .collect();
        self.cluster.allocate(PodAssignment {
            pod: pod.name.clone(),
            node: n.name.clone(),
            containers,
            cpu_milli: pod.cpu_milli,
            memory_mib: pod.memory_mib,
            group: pod.group.clone(),
        })?;
        let s = &mut self.nodes[node];
        s.cpu_left -= pod.cpu_milli;
        s.mem_left -= pod.memory_mib;
        let milli = pod.milli();
        for &g in gpus {
            s.left[g] -= milli.min(s.left[g]);
            self.idle_total -= u64::from(milli);
        }
        if milli > 0 {
            let kind = if pod.num_gpu == 1 && milli < 1000 { 0 } else { pod.num_gpu };
            *s.kinds.entry(kind).or_default() += 1;
        }
        s.generation += 1;
        let f = self.mix.fgd_fragmentation(&s.left, Some(s.cpu_left), &s.model);
        self.frag_total += f - self.frag[node];
        self.frag[node] = f;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::whole_units::built_for_jobs;

    fn node(name: &str, gpu: u32) -> TraceNode {
        TraceNode {
            name: name.into(),
            cpu_milli: 64_000,
            memory_mib: 262_144,
            gpu,
            model: "V100M32".into(),
            nvswitch: false,
        }
    }

    #[test]
    fn the_hgx_what_if_makes_8_gpu_nodes_nvswitch_boards_and_leaves_the_others_flat() {
        let mut nodes = vec![node("a", 8), node("b", 4), node("c", 8)];
        Boards::Flat.apply(&mut nodes);
        assert!(nodes.iter().all(|n| !n.nvswitch));
        Boards::Hgx.apply(&mut nodes);
        let state = SimState::new(&nodes, WorkloadMix::default());
        let jobs: Vec<bool> = state.cluster.nodes().iter().map(built_for_jobs).collect();
        assert_eq!(jobs, [true, false, true]);
        let t = &state.cluster.nodes()[0].topology;
        assert_eq!(t.fabric(), NvlinkFabric::Nvswitch);
        assert!(t.links().all(|(_, _, l)| l.nvlinks == 18));
    }
}
