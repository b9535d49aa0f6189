//! Building nodes from topology files and from the example cluster format (`examples/clusters/`).
//!
//! A cluster file lists node groups, each a board, a count and labels. A board is either a topology
//! file (the `shared/topologies/` schema) or one of the generators below, so examples need no data
//! from outside the repository. Boards are written `{kind: nvswitch, gpus: 8, ...}`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::annotations::MAX_SLOTS_PER_GPU;
use crate::cluster::{Cluster, Gpu, Node};
use crate::topology::{GpuTopology, Link, NvlinkFabric, PcieLevel, TopologyError, TopologyFile};

/// Why an inventory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("parsing {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{context}: {source}")]
    Topology { context: String, source: TopologyError },
    #[error("{0}")]
    Invalid(String),
}

/// A GPU board: what one node of a group looks like inside.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Board {
    /// A topology file, relative to the cluster file.
    File { path: PathBuf },
    /// All GPUs on NVSwitch with `nvlinks` lanes each; PCIe NODE inside a socket, SYS across.
    Nvswitch { gpus: u32, model: String, memory_mib: u64, numa_nodes: u32, nvlinks: u32 },
    /// PCIe only: sockets x switches x GPUs; PIX under one switch, NODE in a socket, SYS across.
    Pcie { model: String, memory_mib: u64, sockets: u32, switches_per_socket: u32, gpus_per_switch: u32 },
    /// No topology known: every pair PHB, no NVLink.
    Flat { gpus: u32, model: String, memory_mib: u64 },
}

/// A group of identical nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeGroup {
    /// Nodes are named `{prefix}{i}` for i in 0..count.
    pub prefix: String,
    pub count: u32,
    pub board: Board,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Host CPU in millicores and memory in MiB; 0 leaves them untracked.
    #[serde(default)]
    pub cpu_milli: u64,
    #[serde(default)]
    pub memory_mib: u64,
    /// K, the device plugin's `--slots-per-gpu` on these nodes: at most K containers share a GPU.
    /// Absent: not limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_per_gpu: Option<u32>,
    /// Overrides per node index, e.g. to put half the nodes under another ToR.
    #[serde(default)]
    pub label_overrides: Vec<LabelOverride>,
}

/// Extra labels for nodes `from..to` (exclusive) of a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelOverride {
    pub from: u32,
    pub to: u32,
    pub labels: BTreeMap<String, String>,
}

/// The example cluster format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Node label keys for the network, coarse to fine; defaults to spine then ToR.
    #[serde(default)]
    pub network_levels: Option<Vec<String>>,
    pub node_groups: Vec<NodeGroup>,
}

fn read(path: &Path) -> Result<String, InventoryError> {
    std::fs::read_to_string(path).map_err(|source| InventoryError::Io { path: path.to_path_buf(), source })
}

/// Reads a topology file.
pub fn load_topology_file(path: &Path) -> Result<TopologyFile, InventoryError> {
    serde_json::from_str(&read(path)?)
        .map_err(|e| InventoryError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

/// A deterministic UUID-shaped id for a simulated GPU (real nodes publish NVML's).
pub fn synthetic_uuid(node: &str, index: u32) -> String {
    // FNV-1a, twice with different seeds, to fill 128 bits
    let h = |seed: u64| {
        let mut x = seed;
        for b in node.bytes().chain(index.to_le_bytes()) {
            x ^= u64::from(b);
            x = x.wrapping_mul(0x100000001b3);
        }
        x
    };
    let (a, b) = (h(0xcbf29ce484222325), h(0x84222325cbf29ce4));
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// A board resolved to GPUs (without UUIDs) and a link graph.
#[derive(Debug, Clone)]
pub struct ResolvedBoard {
    pub gpus: Vec<Gpu>,
    pub topology: Arc<GpuTopology>,
}

impl ResolvedBoard {
    /// From a topology file.
    pub fn from_file(file: &TopologyFile) -> Result<Self, InventoryError> {
        let topology = file
            .graph()
            .map_err(|source| InventoryError::Topology { context: format!("topology {}", file.name), source })?;
        let gpus = file
            .gpus
            .iter()
            .map(|g| Gpu {
                uuid: g.uuid.clone().unwrap_or_default(),
                index: g.index,
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
                healthy: true,
            })
            .collect();
        Ok(Self { gpus, topology: Arc::new(topology) })
    }

    /// Builds a node named `name` on this board.
    pub fn node(&self, name: &str, labels: BTreeMap<String, String>, cpu_milli: u64, memory_mib: u64) -> Node {
        let gpus = self
            .gpus
            .iter()
            .map(|g| Gpu {
                uuid: if g.uuid.is_empty() { synthetic_uuid(name, g.index) } else { g.uuid.clone() },
                ..g.clone()
            })
            .collect();
        Node::new(name, labels, gpus, self.topology.clone(), cpu_milli, memory_mib)
    }
}

fn gpu(index: u32, model: &str, memory_mib: u64, numa: u32) -> Gpu {
    Gpu {
        uuid: String::new(),
        index,
        model: model.to_string(),
        memory_mib,
        numa_node: Some(numa),
        pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + index * 0x10 % 0xf0),
        healthy: true,
    }
}

impl Board {
    pub fn resolve(&self, base: &Path) -> Result<ResolvedBoard, InventoryError> {
        let topo_err = |source| InventoryError::Topology { context: "board".into(), source };
        match self {
            Board::File { path } => ResolvedBoard::from_file(&load_topology_file(&base.join(path))?),
            Board::Nvswitch { gpus, model, memory_mib, numa_nodes, nvlinks } => {
                let per = gpus.div_ceil((*numa_nodes).max(1)).max(1);
                let list: Vec<Gpu> = (0..*gpus).map(|i| gpu(i, model, *memory_mib, i / per)).collect();
                let mut links = Vec::new();
                for a in 0..*gpus {
                    for b in a + 1..*gpus {
                        let pcie = if a / per == b / per { PcieLevel::Node } else { PcieLevel::Sys };
                        links.push((a, b, Link { nvlinks: *nvlinks, pcie }));
                    }
                }
                let t =
                    GpuTopology::new(list.len(), NvlinkFabric::Nvswitch, links, PcieLevel::Sys).map_err(topo_err)?;
                Ok(ResolvedBoard { gpus: list, topology: Arc::new(t) })
            }
            Board::Pcie { model, memory_mib, sockets, switches_per_socket, gpus_per_switch } => {
                let per_socket = switches_per_socket * gpus_per_switch;
                let n = sockets * per_socket;
                let list: Vec<Gpu> = (0..n).map(|i| gpu(i, model, *memory_mib, i / per_socket.max(1))).collect();
                let mut links = Vec::new();
                for a in 0..n {
                    for b in a + 1..n {
                        let pcie = if a / per_socket != b / per_socket {
                            PcieLevel::Sys
                        } else if a / gpus_per_switch == b / gpus_per_switch {
                            PcieLevel::Pix
                        } else {
                            PcieLevel::Node
                        };
                        links.push((a, b, Link { nvlinks: 0, pcie }));
                    }
                }
                let t = GpuTopology::new(list.len(), NvlinkFabric::None, links, PcieLevel::Sys).map_err(topo_err)?;
                Ok(ResolvedBoard { gpus: list, topology: Arc::new(t) })
            }
            Board::Flat { gpus, model, memory_mib } => {
                let list: Vec<Gpu> = (0..*gpus).map(|i| gpu(i, model, *memory_mib, 0)).collect();
                Ok(ResolvedBoard { topology: Arc::new(GpuTopology::flat(list.len())), gpus: list })
            }
        }
    }
}

impl ClusterFile {
    pub fn load(path: &Path) -> Result<(Self, PathBuf), InventoryError> {
        let text = read(path)?;
        let file: ClusterFile = serde_norway::from_str(&text)
            .map_err(|e| InventoryError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok((file, base))
    }

    /// Builds the cluster; board paths are relative to `base`.
    pub fn build(&self, base: &Path) -> Result<Cluster, InventoryError> {
        let mut nodes = Vec::new();
        let mut names = std::collections::HashSet::new();
        for g in &self.node_groups {
            let board = g.board.resolve(base)?;
            if let Some(k) = g.slots_per_gpu.filter(|k| !(1..=MAX_SLOTS_PER_GPU).contains(k)) {
                return Err(InventoryError::Invalid(format!(
                    "node group {}: slots_per_gpu is {k}; it must be 1 to {MAX_SLOTS_PER_GPU}",
                    g.prefix
                )));
            }
            for i in 0..g.count {
                let name = format!("{}{}", g.prefix, i);
                if !names.insert(name.clone()) {
                    return Err(InventoryError::Invalid(format!("node {name} is defined twice")));
                }
                let mut labels = g.labels.clone();
                for o in g.label_overrides.iter().filter(|o| (o.from..o.to).contains(&i)) {
                    labels.extend(o.labels.clone());
                }
                nodes.push(board.node(&name, labels, g.cpu_milli, g.memory_mib).with_slots_per_gpu(g.slots_per_gpu));
            }
        }
        let mut cluster = Cluster::new(nodes);
        if let Some(levels) = &self.network_levels {
            cluster.network_levels = levels.clone();
        }
        Ok(cluster)
    }
}

/// Loads a cluster file and builds the cluster.
pub fn load_cluster(path: &Path) -> Result<Cluster, InventoryError> {
    let (file, base) = ClusterFile::load(path)?;
    file.build(&base)
}
