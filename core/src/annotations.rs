//! The annotations gpuplace keeps on Kubernetes objects: the schema, defined once here and shared by
//! the extender, the API-server watchers and the device plugin (docs/contracts.md is its statement).
//!
//! - [`ANNOTATION_ASSIGNMENT`] on a pod: which GPUs each container got, written by the extender at
//!   bind, read back by the watchers after a restart and by the device plugin in `Allocate`.
//! - [`ANNOTATION_INVENTORY`] on a node: its GPUs and their links, published by the device plugin.
//! - [`ANNOTATION_UTILIZATION`] on a node: the last live sample per GPU, published by the device plugin.
//! - [`ANNOTATION_ALLOCATED`] on a pod: which of its containers the device plugin has given their GPUs
//!   (kubelet's `Allocate`), so a restarted plugin never matches one of them again, and the extender
//!   knows the pod admitted (`core::admission`).
//! - [`ANNOTATION_ALLOCATION_COUNTS`] on a node: the device plugin's cross-check counts, kept across
//!   its restarts.
//! - [`ANNOTATION_REQUEUED`] on a pending pod: the extender's nudge to kube-scheduler to retry it
//!   (`scheduler::requeue`). Plain text (`NODE UNIX_MS`), never read back: the change is the signal.
//!
//! Each other value is JSON with a `version`. A reader refuses a version it does not know (a typed error,
//! never a guess); fields may be added within a version, so unknown fields are skipped.
//!
//! Annotations are writable by anyone who can edit the object, so an assignment is never trusted as
//! read: the extender first checks its MAC (`sig`, [`crate::signing`]: only gpuplace's key
//! can make one), then [`AssignmentAnnotation::validate`] checks it against the pod's own request,
//! the node it is bound to and that node's GPUs before it becomes a [`PodAssignment`]. Collisions between pods (two
//! pods claiming one exclusive GPU) are caught when the record is counted, by
//! [`Cluster::allocate`](crate::cluster::Cluster::allocate) / `rebuild`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use crate::cluster::{Gpu, Node, UtilSample};
use crate::isolation::IsolationMode;
use crate::resources::{ContainerDemand, PodRequest};
use crate::topology::{GpuTopology, Link, NvlinkFabric, PcieLevel, TopologyError};

/// Pod annotation: the GPUs the pod was given (JSON, [`AssignmentAnnotation`]).
pub const ANNOTATION_ASSIGNMENT: &str = "gpuplace.io/assignment";
/// Node annotation: the node's GPUs and links (JSON, [`NodeInventory`]).
pub const ANNOTATION_INVENTORY: &str = "gpuplace.io/inventory";
/// Node annotation: live utilization per GPU (JSON, [`UtilizationAnnotation`]).
pub const ANNOTATION_UTILIZATION: &str = "gpuplace.io/utilization";
/// Pod annotation: the containers the device plugin has allocated (JSON, [`AllocatedAnnotation`]).
pub const ANNOTATION_ALLOCATED: &str = "gpuplace.io/allocated";
/// Pod annotation: GPUs the pod was just turned away from were freed (`NODE UNIX_MS`, never read).
pub const ANNOTATION_REQUEUED: &str = "gpuplace.io/requeued";
/// Node annotation: the device plugin's cross-check counts over its restarts (JSON,
/// [`AllocationCounts`]).
pub const ANNOTATION_ALLOCATION_COUNTS: &str = "gpuplace.io/allocation-counts";

pub const ASSIGNMENT_VERSION: u32 = 1;
pub const INVENTORY_VERSION: u32 = 1;
pub const UTILIZATION_VERSION: u32 = 1;
pub const ALLOCATED_VERSION: u32 = 1;
pub const ALLOCATION_COUNTS_VERSION: u32 = 1;

/// Why an annotation was not accepted. Each message names the annotation and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    #[error("{key}: not valid JSON of the expected shape: {message}")]
    Json { key: &'static str, message: String },
    #[error("{key}: version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion { key: &'static str, found: u32, supported: u32 },
    #[error("{ANNOTATION_ASSIGNMENT}: written for pod UID {annotated:?}, but the pod's UID is {actual:?}")]
    WrongPod { annotated: String, actual: String },
    #[error("{ANNOTATION_ASSIGNMENT}: names node {annotated:?}, but the pod is bound to {bound:?}")]
    WrongNode { annotated: String, bound: String },
    #[error("{ANNOTATION_ASSIGNMENT}: GPU {uuid} is not on node {node}")]
    UnknownGpu { uuid: String, node: String },
    #[error("{ANNOTATION_ASSIGNMENT}: GPU {uuid} has index {actual} on node {node}, not {annotated}")]
    IndexMismatch { uuid: String, node: String, annotated: u32, actual: u32 },
    #[error("{ANNOTATION_ASSIGNMENT}: {what} container {container:?} is not in the pod's GPU request")]
    UnexpectedContainer { container: String, what: &'static str },
    #[error("{ANNOTATION_ASSIGNMENT}: {what} container {container:?} asks for GPUs but has no assignment")]
    MissingContainer { container: String, what: &'static str },
    #[error("{ANNOTATION_ASSIGNMENT}: container {container:?}: {detail}")]
    ContainerMismatch { container: String, detail: String },
    #[error("{ANNOTATION_ASSIGNMENT}: not signed by gpuplace's assignment key: {0}")]
    NotSigned(SignatureProblem),
    #[error("{ANNOTATION_INVENTORY}: {0}")]
    BadInventory(String),
    #[error("{ANNOTATION_INVENTORY}: links: {0}")]
    BadLinks(#[from] TopologyError),
    #[error("{ANNOTATION_UTILIZATION}: {0}")]
    BadUtilization(String),
}

/// Why a signature does not make an assignment trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureProblem {
    #[error("it has no `sig`")]
    Missing,
    #[error("`sig` is malformed: {0}")]
    Malformed(String),
    #[error("`sig` names key {0:?}, which is not in the key Secret (forged, or signed with a key since removed)")]
    UnknownKey(String),
    #[error("the signature does not verify (key {0:?}): the assignment was altered, copied or forged")]
    BadSignature(String),
    #[error("no assignment key is loaded to check it with")]
    NoKeys,
}

/// Only the version, read first so that an unknown version is reported as such rather than as
/// whatever shape error the newer layout would cause.
#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

fn parse_versioned<T: serde::de::DeserializeOwned>(
    key: &'static str,
    text: &str,
    supported: u32,
) -> Result<T, AnnotationError> {
    let json = |e: serde_json::Error| AnnotationError::Json { key, message: e.to_string() };
    let v: VersionOnly = serde_json::from_str(text).map_err(json)?;
    if v.version != supported {
        return Err(AnnotationError::UnsupportedVersion { key, found: v.version, supported });
    }
    serde_json::from_str(text).map_err(json)
}

// ---------------------------------------------------------------------------------------------------
// Pod assignment
// ---------------------------------------------------------------------------------------------------

/// `gpuplace.io/assignment`: the GPUs a pod holds, written at bind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssignmentAnnotation {
    pub version: u32,
    /// The UID of the pod it was written for: an annotation copied onto another pod is refused.
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    pub node: String,
    /// Per-node bind order, from 1, increasing (gaps allowed): the device plugin serves kubelet's
    /// `Allocate` calls in this order when several pods wait on one node.
    pub bind_seq: u64,
    /// App containers first, then init containers, each in spec order.
    pub containers: Vec<AssignedContainer>,
    /// `<keyId>:<base64url HMAC-SHA256>` over every field above ([`crate::signing`]); absent
    /// on annotations of versions that did not sign. Readers that do not check it (the device plugin)
    /// skip it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

/// One container's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssignedContainer {
    pub name: String,
    /// An init container: it runs alone, before the app containers, and may reuse their GPUs.
    #[serde(default)]
    pub init: bool,
    pub gpus: Vec<AssignedGpu>,
}

/// One GPU (or slice of one) given to a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssignedGpu {
    /// NVML UUID: the device plugin hands this device to the container.
    pub uuid: String,
    /// NVML index on the node (a cross-check of the UUID).
    pub index: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    pub core_percent: u32,
    /// A whole GPU nobody else may use.
    pub exclusive: bool,
}

impl AssignmentAnnotation {
    /// Reads the annotation's JSON (shape and version only; see [`validate`](Self::validate)).
    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        parse_versioned(ANNOTATION_ASSIGNMENT, text, ASSIGNMENT_VERSION)
    }

    /// The annotation value.
    pub fn to_json(&self) -> String {
        // plain structs of strings and integers: serializing cannot fail
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The annotation for an allocation record on `node` (which must hold every GPU it names).
    pub fn from_assignment(
        a: &PodAssignment,
        pod_uid: &str,
        node: &Node,
        bind_seq: u64,
    ) -> Result<Self, AnnotationError> {
        let mut containers: Vec<AssignedContainer> = Vec::with_capacity(a.containers.len());
        // app containers first, as documented, whatever order the record keeps them in
        for c in a.containers.iter().filter(|c| !c.init).chain(a.containers.iter().filter(|c| c.init)) {
            let mut gpus = Vec::with_capacity(c.slices.len());
            for s in &c.slices {
                let g = node.gpus.get(s.gpu as usize).ok_or_else(|| AnnotationError::UnknownGpu {
                    uuid: format!("#{}", s.gpu),
                    node: node.name.clone(),
                })?;
                gpus.push(AssignedGpu {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    memory_mib: s.mem_mib,
                    core_percent: s.core_pct,
                    exclusive: s.exclusive,
                });
            }
            containers.push(AssignedContainer { name: c.name.clone(), init: c.init, gpus });
        }
        Ok(Self {
            version: ASSIGNMENT_VERSION,
            pod_uid: pod_uid.to_string(),
            node: a.node.clone(),
            bind_seq,
            containers,
            sig: None,
        })
    }

    /// Checks the annotation against the pod it is on and the node that pod is bound to, and turns
    /// it into the allocation record the cluster model counts. Refused (with the first problem found)
    /// when it was written for another pod or node, names a GPU the node does not have, or does not
    /// give each GPU container of `request` exactly what the request asks for.
    pub fn validate(
        &self,
        pod_uid: &str,
        bound_node: &str,
        request: &PodRequest,
        node: &Node,
    ) -> Result<PodAssignment, AnnotationError> {
        if self.pod_uid != pod_uid {
            return Err(AnnotationError::WrongPod { annotated: self.pod_uid.clone(), actual: pod_uid.into() });
        }
        for bound in [bound_node, node.name.as_str()] {
            if self.node != bound {
                return Err(AnnotationError::WrongNode { annotated: self.node.clone(), bound: bound.into() });
            }
        }
        let by_uuid: BTreeMap<&str, &Gpu> = node.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
        let mut containers = Vec::with_capacity(self.containers.len());
        for (init, demands, what) in [(false, &request.containers, "app"), (true, &request.init_containers, "init")] {
            let annotated: Vec<&AssignedContainer> = self.containers.iter().filter(|c| c.init == init).collect();
            let mut seen = BTreeSet::new();
            for c in &annotated {
                if !seen.insert(c.name.as_str()) {
                    return Err(AnnotationError::ContainerMismatch {
                        container: c.name.clone(),
                        detail: "listed twice".into(),
                    });
                }
                let Some(d) = demands.iter().find(|d| d.name == c.name) else {
                    return Err(AnnotationError::UnexpectedContainer { container: c.name.clone(), what });
                };
                containers.push(check_container(c, d, &by_uuid, node)?);
            }
            if let Some(d) = demands.iter().find(|d| !seen.contains(d.name.as_str())) {
                return Err(AnnotationError::MissingContainer { container: d.name.clone(), what });
            }
        }
        Ok(PodAssignment {
            pod: request.key.clone(),
            node: node.name.clone(),
            containers,
            cpu_milli: request.cpu_milli,
            memory_mib: request.memory_mib,
            group: request.group.as_ref().map(|g| g.key.clone()),
        })
    }
}

fn check_container(
    c: &AssignedContainer,
    d: &ContainerDemand,
    by_uuid: &BTreeMap<&str, &Gpu>,
    node: &Node,
) -> Result<ContainerAssignment, AnnotationError> {
    let mismatch = |detail: String| AnnotationError::ContainerMismatch { container: c.name.clone(), detail };
    let want = d.demand.gpus() as usize;
    if c.gpus.len() != want {
        return Err(mismatch(format!("{} GPU(s) assigned, {want} requested", c.gpus.len())));
    }
    let mut slices = Vec::with_capacity(want);
    let mut indices = BTreeSet::new();
    for a in &c.gpus {
        let g = by_uuid
            .get(a.uuid.as_str())
            .ok_or_else(|| AnnotationError::UnknownGpu { uuid: a.uuid.clone(), node: node.name.clone() })?;
        if g.index != a.index {
            return Err(AnnotationError::IndexMismatch {
                uuid: a.uuid.clone(),
                node: node.name.clone(),
                annotated: a.index,
                actual: g.index,
            });
        }
        if !indices.insert(g.index) {
            return Err(mismatch(format!("GPU {} assigned twice", a.uuid)));
        }
        let (mem, core, exclusive) = (d.demand.mem_on(g.memory_mib), d.demand.core_on(), d.demand.is_whole());
        if (a.memory_mib, a.core_percent, a.exclusive) != (mem, core, exclusive) {
            return Err(mismatch(format!(
                "GPU {}: assigned {} MiB, {}%, exclusive {}; the request means {mem} MiB, {core}%, exclusive {exclusive}",
                a.uuid, a.memory_mib, a.core_percent, a.exclusive
            )));
        }
        slices.push(GpuSlice { gpu: g.index, mem_mib: mem, core_pct: core, exclusive });
    }
    Ok(ContainerAssignment { name: c.name.clone(), init: c.init, slices })
}

// ---------------------------------------------------------------------------------------------------
// Node inventory
// ---------------------------------------------------------------------------------------------------

/// `gpuplace.io/inventory`: a node's GPUs and the links between them, as the device plugin reads them
/// from NVML.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventory {
    pub version: u32,
    /// How NVLink lanes end: `nvswitch` (every pair at the switch's bandwidth), `direct`, or `none`.
    #[serde(default)]
    pub fabric: NvlinkFabric,
    /// Every GPU, indices 0..n each once (unhealthy ones included, marked).
    pub gpus: Vec<InventoryGpu>,
    /// GPU pairs; a pair left out is taken as `SYS` without NVLink, the safe guess.
    #[serde(default)]
    pub links: Vec<InventoryLink>,
    /// K: the device plugin advertises each GPU as K devices, so at most K containers can hold one
    /// GPU. Absent when the publisher does not say (inventories written before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_per_gpu: Option<u32>,
    /// The node's device plugin applies assignments in kubelet's `Allocate` and confirms each one on
    /// the pod (`gpuplace.io/allocated`): it runs with an API server in assignments mode and a kubelet
    /// has registered it. The extender then never binds a pod the plugin could confuse with one still
    /// waiting for its Allocate there (`core::admission`). Absent (false) where no kubelet calls
    /// Allocate, such as the e2e suite's nodes, and in inventories of older plugins.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub confirms_allocations: bool,
    /// What enforces shares' limits on the node (`driver-limits`, `mps`, `guard`, `advisory`), as its
    /// device plugin chose at start (docs/isolation.md). Absent in inventories of older plugins:
    /// read as `advisory`, as is a mode this reader does not know (a newer plugin's): the node's
    /// GPUs stay usable, only not for pods that require enforcement.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "known_or_advisory")]
    pub isolation: Option<IsolationMode>,
}

fn known_or_advisory<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IsolationMode>, D::Error> {
    let name = Option::<String>::deserialize(d)?;
    Ok(name.map(|n| n.parse().unwrap_or(IsolationMode::Advisory)))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryGpu {
    pub uuid: String,
    pub index: u32,
    pub model: String,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(default)]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub pci_bus_id: String,
    #[serde(default = "yes")]
    pub healthy: bool,
}

fn yes() -> bool {
    true
}

/// One GPU pair: NVLink lanes (through the NVSwitch on `nvswitch` boards) and the PCIe path, named as
/// `nvidia-smi topo -m` names it (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryLink {
    pub a: u32,
    pub b: u32,
    #[serde(default)]
    pub nvlinks: u32,
    pub pcie: PcieLevel,
}

/// More GPUs than any board has: an inventory claiming more is refused rather than searched over.
const MAX_GPUS_PER_NODE: usize = 64;

/// The most slots per GPU a device plugin may advertise: device IDs `<uuid>::<slot>` must stay within
/// kubelet's 63 characters, and MPS serves 48 clients per GPU anyway.
pub const MAX_SLOTS_PER_GPU: u32 = 1000;

impl NodeInventory {
    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        parse_versioned(ANNOTATION_INVENTORY, text, INVENTORY_VERSION)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// What a node of the cluster model publishes (for the device plugin's tests and for tools).
    pub fn from_node(node: &Node) -> Self {
        Self {
            version: INVENTORY_VERSION,
            fabric: node.topology.fabric(),
            gpus: node
                .gpus
                .iter()
                .map(|g| InventoryGpu {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node,
                    pci_bus_id: g.pci_bus_id.clone(),
                    healthy: g.healthy,
                })
                .collect(),
            links: node
                .topology
                .links()
                .map(|(a, b, l)| InventoryLink { a: a as u32, b: b as u32, nvlinks: l.nvlinks, pcie: l.pcie })
                .collect(),
            slots_per_gpu: node.slots_per_gpu,
            confirms_allocations: node.confirms_allocations,
            isolation: node.isolation,
        }
    }

    /// The cluster model's node. Host CPU and memory are left untracked: kube-scheduler checks them.
    pub fn to_node(&self, name: &str, labels: BTreeMap<String, String>) -> Result<Node, AnnotationError> {
        let bad = |m: String| AnnotationError::BadInventory(m);
        if self.gpus.is_empty() {
            return Err(bad("no GPUs listed".into()));
        }
        if self.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(bad(format!("{} GPUs listed, at most {MAX_GPUS_PER_NODE} supported", self.gpus.len())));
        }
        if let Some(k) = self.slots_per_gpu.filter(|k| !(1..=MAX_SLOTS_PER_GPU).contains(k)) {
            return Err(bad(format!("slotsPerGpu is {k}; it must be 1 to {MAX_SLOTS_PER_GPU}")));
        }
        let mut gpus = self.gpus.clone();
        gpus.sort_by_key(|g| g.index);
        let mut uuids = BTreeSet::new();
        for (i, g) in gpus.iter().enumerate() {
            // the model addresses GPUs by position, so indices must be exactly 0..n
            if g.index as usize != i {
                return Err(bad(format!(
                    "GPU indices must be 0..{} each once; index {i} is missing or repeated",
                    gpus.len()
                )));
            }
            if g.uuid.trim().is_empty() || !uuids.insert(g.uuid.as_str()) {
                return Err(bad(format!("GPU {}: UUID {:?} is empty or repeated", g.index, g.uuid)));
            }
            if g.memory_mib == 0 {
                return Err(bad(format!("GPU {}: memoryMiB is 0", g.index)));
            }
        }
        let links = self.links.iter().map(|l| (l.a, l.b, Link { nvlinks: l.nvlinks, pcie: l.pcie }));
        let topology = GpuTopology::new(gpus.len(), self.fabric, links, PcieLevel::Sys)?;
        let gpus = gpus
            .into_iter()
            .map(|g| Gpu {
                uuid: g.uuid,
                index: g.index,
                model: g.model,
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id,
                healthy: g.healthy,
            })
            .collect();
        Ok(Node::new(name, labels, gpus, Arc::new(topology), 0, 0)
            .with_slots_per_gpu(self.slots_per_gpu)
            .with_confirms_allocations(self.confirms_allocations)
            .with_isolation(self.isolation))
    }
}

// ---------------------------------------------------------------------------------------------------
// Live utilization
// ---------------------------------------------------------------------------------------------------

/// `gpuplace.io/utilization`: one NVML sweep over the node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UtilizationAnnotation {
    pub version: u32,
    /// When the sweep was taken, Unix milliseconds.
    pub at_unix_ms: i64,
    pub gpus: Vec<GpuUtilization>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuUtilization {
    /// By UUID, not index: a sample must never land on another GPU after a re-enumeration.
    pub uuid: String,
    /// SM utilization, percent of the whole GPU (0..=100).
    pub sm_percent: u32,
    #[serde(rename = "memoryUsedMiB")]
    pub memory_used_mib: u64,
}

impl UtilizationAnnotation {
    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        let u: Self = parse_versioned(ANNOTATION_UTILIZATION, text, UTILIZATION_VERSION)?;
        if let Some(g) = u.gpus.iter().find(|g| g.sm_percent > 100) {
            return Err(AnnotationError::BadUtilization(format!(
                "GPU {}: smPercent {} is above 100",
                g.uuid, g.sm_percent
            )));
        }
        Ok(u)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Records the samples on the node's GPUs; returns the UUIDs the node does not have (ignored: the
    /// inventory may be newer or older than the sample).
    pub fn apply_to(&self, node: &mut Node) -> Vec<String> {
        let mut unknown = Vec::new();
        for s in &self.gpus {
            match node.gpus.iter().position(|g| g.uuid == s.uuid) {
                Some(i) => node.set_utilization(
                    i,
                    Some(UtilSample {
                        sm_pct: s.sm_percent,
                        mem_used_mib: s.memory_used_mib,
                        at_unix_ms: self.at_unix_ms,
                    }),
                ),
                None => unknown.push(s.uuid.clone()),
            }
        }
        unknown
    }
}

// ---------------------------------------------------------------------------------------------------
// Allocated containers
// ---------------------------------------------------------------------------------------------------

/// `gpuplace.io/allocated`: the containers of a pod that the device plugin has given their GPUs.
///
/// Written by the device plugin in `Allocate` (a merge patch with the pod's UID as precondition)
/// before it answers kubelet, so a pod whose containers are all listed is never matched again, even
/// by a restarted plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocatedAnnotation {
    pub version: u32,
    /// The UID of the pod it was written for: a marker copied onto another pod means nothing there.
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// Container names, sorted, each once.
    pub containers: BTreeSet<String>,
    /// Those of `containers` matched when interchangeable pods (`core::admission`) waited for the
    /// same GPUs: either match gave the right limits, but which pod got the devices is known only
    /// once kubelet's pod-resources API lists them, and the plugin then confirms or moves the mark.
    /// The extender counts the pod as admitted only when this is empty. Absent when empty.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub unconfirmed: BTreeSet<String>,
}

impl AllocatedAnnotation {
    pub fn new(pod_uid: &str, containers: impl IntoIterator<Item = String>) -> Self {
        Self {
            version: ALLOCATED_VERSION,
            pod_uid: pod_uid.to_string(),
            containers: containers.into_iter().collect(),
            unconfirmed: BTreeSet::new(),
        }
    }

    /// The marker with `unconfirmed` set (each must be among `containers`; others are dropped).
    pub fn with_unconfirmed(mut self, unconfirmed: impl IntoIterator<Item = String>) -> Self {
        self.unconfirmed = unconfirmed.into_iter().filter(|c| self.containers.contains(c)).collect();
        self
    }

    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        parse_versioned(ANNOTATION_ALLOCATED, text, ALLOCATED_VERSION)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------------
// Allocation cross-check counts
// ---------------------------------------------------------------------------------------------------

/// `gpuplace.io/allocation-counts`: what the node's device plugin found comparing its Allocate grants
/// with kubelet's pod-resources, since it first ran there. Written and read only by that plugin, so
/// that `gpuplace_allocation_mismatches_total` and `gpuplace_allocation_corrections_total` continue
/// across its restarts instead of starting again from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocationCounts {
    pub version: u32,
    /// Devices a container got with another pod's limits (or unknown ones).
    pub mismatches: u64,
    /// Devices matched to one of several pods with the same limits, given to another of them: the
    /// record corrected.
    pub corrections: u64,
}

impl AllocationCounts {
    pub fn new(mismatches: u64, corrections: u64) -> Self {
        Self { version: ALLOCATION_COUNTS_VERSION, mismatches, corrections }
    }

    pub fn parse(text: &str) -> Result<Self, AnnotationError> {
        parse_versioned(ANNOTATION_ALLOCATION_COUNTS, text, ALLOCATION_COUNTS_VERSION)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Board;
    use crate::resources::{GpuDemand, GroupSpec, MemoryDemand};

    fn h100_node(name: &str) -> Node {
        let board = Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 };
        board.resolve(std::path::Path::new(".")).unwrap().node(name, BTreeMap::new(), 0, 0)
    }

    fn request() -> PodRequest {
        let mut r = PodRequest::single("ns/p", GpuDemand::Whole { gpus: 2 });
        r.containers.push(ContainerDemand {
            name: "side".into(),
            demand: GpuDemand::Shared { gpus: 1, memory: MemoryDemand::ProportionalToCore, core_pct: 25 },
        });
        r.init_containers.push(ContainerDemand {
            name: "warm".into(),
            demand: GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(1024), core_pct: 0 },
        });
        r.group = Some(GroupSpec::labelled("ns/job", 2));
        r
    }

    fn record() -> PodAssignment {
        let slice = |gpu, mem_mib, core_pct, exclusive| GpuSlice { gpu, mem_mib, core_pct, exclusive };
        PodAssignment {
            pod: "ns/p".into(),
            node: "n1".into(),
            containers: vec![
                ContainerAssignment {
                    name: "main".into(),
                    init: false,
                    slices: vec![slice(0, 81559, 100, true), slice(1, 81559, 100, true)],
                },
                ContainerAssignment { name: "side".into(), init: false, slices: vec![slice(5, 20389, 25, false)] },
                ContainerAssignment { name: "warm".into(), init: true, slices: vec![slice(0, 1024, 0, false)] },
            ],
            cpu_milli: 0,
            memory_mib: 0,
            group: Some("ns/job".into()),
        }
    }

    #[test]
    fn assignment_round_trips_through_the_annotation() {
        let node = h100_node("n1");
        let a = AssignmentAnnotation::from_assignment(&record(), "uid-1", &node, 7).unwrap();
        let text = a.to_json();
        assert!(text.starts_with(r#"{"version":1,"podUID":"uid-1","node":"n1","bindSeq":7,"containers":[{"name":"main","init":false,"gpus":[{"uuid":"GPU-"#), "{text}");
        let back = AssignmentAnnotation::parse(&text).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.validate("uid-1", "n1", &request(), &node).unwrap(), record());
    }

    #[test]
    fn forged_or_stale_assignments_are_refused() {
        let node = h100_node("n1");
        let good = AssignmentAnnotation::from_assignment(&record(), "uid-1", &node, 1).unwrap();
        let req = request();
        let check = |a: &AssignmentAnnotation| a.validate("uid-1", "n1", &req, &node).unwrap_err();
        assert!(matches!(good.validate("uid-2", "n1", &req, &node), Err(AnnotationError::WrongPod { .. })));
        assert!(matches!(good.validate("uid-1", "n2", &req, &node), Err(AnnotationError::WrongNode { .. })));
        assert!(matches!(good.validate("uid-1", "n1", &req, &h100_node("n2")), Err(AnnotationError::WrongNode { .. })));

        let mut a = good.clone();
        a.containers[0].gpus[0].uuid = "GPU-forged".into();
        assert!(matches!(check(&a), AnnotationError::UnknownGpu { .. }));
        let mut a = good.clone();
        a.containers[0].gpus[0].index = 3;
        assert!(matches!(check(&a), AnnotationError::IndexMismatch { annotated: 3, actual: 0, .. }));
        let mut a = good.clone();
        a.containers[0].gpus[1] = a.containers[0].gpus[0].clone();
        assert!(check(&a).to_string().contains("assigned twice"));
        let mut a = good.clone();
        a.containers[0].gpus.pop();
        assert!(check(&a).to_string().contains("1 GPU(s) assigned, 2 requested"));
        let mut a = good.clone();
        a.containers[1].gpus[0].core_percent = 10;
        assert!(check(&a).to_string().contains("the request means 20389 MiB, 25%"), "{}", check(&a));
        let mut a = good.clone();
        a.containers[0].gpus[0].exclusive = false;
        assert!(matches!(check(&a), AnnotationError::ContainerMismatch { .. }));
        let mut a = good.clone();
        a.containers[1].name = "other".into();
        assert!(matches!(check(&a), AnnotationError::UnexpectedContainer { .. }));
        let mut a = good.clone();
        a.containers.pop();
        assert!(matches!(check(&a), AnnotationError::MissingContainer { what: "init", .. }));
        let mut a = good.clone();
        a.containers.push(a.containers[0].clone());
        assert!(check(&a).to_string().contains("listed twice"));
    }

    #[test]
    fn unknown_versions_and_bad_json_are_typed_errors() {
        assert!(matches!(
            AssignmentAnnotation::parse(r#"{"version":2,"anything":true}"#),
            Err(AnnotationError::UnsupportedVersion { found: 2, supported: 1, .. })
        ));
        for bad in ["", "{", "[]", r#"{"version":"1"}"#, r#"{"version":1}"#, r#"{"version":1,"podUID":5}"#] {
            assert!(matches!(AssignmentAnnotation::parse(bad), Err(AnnotationError::Json { .. })), "{bad}");
            assert!(matches!(NodeInventory::parse(bad), Err(AnnotationError::Json { .. })), "{bad}");
        }
        // fields added within a version are skipped
        let node = h100_node("n1");
        let mut v: serde_json::Value =
            serde_json::from_str(&AssignmentAnnotation::from_assignment(&record(), "u", &node, 1).unwrap().to_json())
                .unwrap();
        v["futureField"] = serde_json::json!({"x": 1});
        assert!(AssignmentAnnotation::parse(&v.to_string()).is_ok());
    }

    #[test]
    fn inventory_round_trips_to_an_equal_node() {
        let node = h100_node("n1");
        let inv = NodeInventory::from_node(&node);
        assert_eq!(inv.links.len(), 28);
        let text = inv.to_json();
        assert!(text.contains(r#""fabric":"nvswitch""#) && text.contains(r#""pcie":"NODE""#), "{text}");
        let back = NodeInventory::parse(&text).unwrap().to_node("n1", BTreeMap::new()).unwrap();
        assert_eq!(back, node);
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    assert_eq!(back.topology.link(a, b), node.topology.link(a, b));
                }
            }
        }
    }

    #[test]
    fn bad_inventories_are_refused() {
        let node = h100_node("n1");
        let inv = NodeInventory::from_node(&node);
        let refuse = |i: &NodeInventory| i.to_node("n1", BTreeMap::new()).unwrap_err();
        let mut i = inv.clone();
        i.gpus[3].index = 9;
        assert!(refuse(&i).to_string().contains("indices must be 0..8"));
        let mut i = inv.clone();
        i.gpus[3].uuid = i.gpus[2].uuid.clone();
        assert!(refuse(&i).to_string().contains("repeated"));
        let mut i = inv.clone();
        i.links.push(i.links[0].clone());
        assert!(matches!(refuse(&i), AnnotationError::BadLinks(TopologyError::DuplicateLink { .. })));
        let mut i = inv.clone();
        i.links[0].b = 40;
        assert!(matches!(refuse(&i), AnnotationError::BadLinks(_)));
        let mut i = inv.clone();
        i.gpus.clear();
        assert!(refuse(&i).to_string().contains("no GPUs"));
        let mut i = inv;
        i.gpus[0].memory_mib = 0;
        assert!(refuse(&i).to_string().contains("memoryMiB is 0"));
        // missing health means healthy; missing links mean SYS
        let minimal = r#"{"version":1,"gpus":[{"uuid":"GPU-a","index":0,"model":"L4","memoryMiB":22491},
            {"uuid":"GPU-b","index":1,"model":"L4","memoryMiB":22491}]}"#;
        let n = NodeInventory::parse(minimal).unwrap().to_node("x", BTreeMap::new()).unwrap();
        assert!(n.gpus.iter().all(|g| g.healthy));
        assert_eq!(n.topology.link(0, 1), Some(Link { nvlinks: 0, pcie: PcieLevel::Sys }));
    }

    #[test]
    fn allocated_marker_round_trips_and_inventory_carries_k() {
        let a = AllocatedAnnotation::new("uid-1", ["main".to_string(), "init".to_string(), "main".to_string()]);
        let text = a.to_json();
        assert_eq!(text, r#"{"version":1,"podUID":"uid-1","containers":["init","main"]}"#);
        assert_eq!(AllocatedAnnotation::parse(&text).unwrap(), a);
        assert!(matches!(
            AllocatedAnnotation::parse(r#"{"version":2}"#),
            Err(AnnotationError::UnsupportedVersion { key: ANNOTATION_ALLOCATED, .. })
        ));
        assert!(matches!(AllocatedAnnotation::parse("main"), Err(AnnotationError::Json { .. })));

        let mut inv = NodeInventory::from_node(&h100_node("n1"));
        assert!(!inv.to_json().contains("slotsPerGpu"));
        inv.slots_per_gpu = Some(10);
        let text = inv.to_json();
        assert!(text.contains(r#""slotsPerGpu":10"#), "{text}");
        assert_eq!(NodeInventory::parse(&text).unwrap().slots_per_gpu, Some(10));
        // K reaches the model, and back
        let node = inv.to_node("n1", BTreeMap::new()).unwrap();
        assert_eq!(node.slots_per_gpu, Some(10));
        assert_eq!(NodeInventory::from_node(&node).slots_per_gpu, Some(10));
        for bad in [0, MAX_SLOTS_PER_GPU + 1] {
            inv.slots_per_gpu = Some(bad);
            let err = inv.to_node("n1", BTreeMap::new()).unwrap_err();
            assert!(err.to_string().contains(&format!("slotsPerGpu is {bad}; it must be 1 to 1000")), "{err}");
        }
    }

    #[test]
    fn unconfirmed_matches_confirms_allocations_and_counts_round_trip() {
        // an older marker reads with nothing unconfirmed; a newer one keeps only listed containers
        let a = AllocatedAnnotation::new("u", ["main".to_string()]).with_unconfirmed(["main".into(), "x".into()]);
        let text = a.to_json();
        assert_eq!(text, r#"{"version":1,"podUID":"u","containers":["main"],"unconfirmed":["main"]}"#);
        assert_eq!(AllocatedAnnotation::parse(&text).unwrap(), a);
        // the flag is written only when set, and reaches the model and back
        let mut inv = NodeInventory::from_node(&h100_node("n1"));
        assert!(!inv.to_json().contains("confirmsAllocations"));
        assert!(!inv.to_node("n1", BTreeMap::new()).unwrap().confirms_allocations);
        inv.confirms_allocations = true;
        let text = inv.to_json();
        assert!(text.contains(r#""confirmsAllocations":true"#), "{text}");
        let node = NodeInventory::parse(&text).unwrap().to_node("n1", BTreeMap::new()).unwrap();
        assert!(node.confirms_allocations && NodeInventory::from_node(&node).confirms_allocations);
        let c = AllocationCounts::new(3, 7);
        assert_eq!(c.to_json(), r#"{"version":1,"mismatches":3,"corrections":7}"#);
        assert_eq!(AllocationCounts::parse(&c.to_json()).unwrap(), c);
        assert!(matches!(AllocationCounts::parse(r#"{"version":2}"#), Err(AnnotationError::UnsupportedVersion { .. })));
    }

    #[test]
    fn isolation_is_written_only_when_known_and_reaches_the_model() {
        let mut inv = NodeInventory::from_node(&h100_node("n1"));
        let older = inv.to_json();
        assert!(!older.contains("isolation"), "{older}");
        assert_eq!(NodeInventory::parse(&older).unwrap().to_node("n1", BTreeMap::new()).unwrap().isolation, None);
        for mode in IsolationMode::ALL {
            inv.isolation = Some(mode);
            let text = inv.to_json();
            assert!(text.contains(&format!(r#""isolation":"{mode}""#)), "{text}");
            let node = NodeInventory::parse(&text).unwrap().to_node("n1", BTreeMap::new()).unwrap();
            assert_eq!(node.isolation, Some(mode));
            assert_eq!(NodeInventory::from_node(&node), inv);
        }
        // a mode this reader does not know keeps the node, as advisory
        let newer = inv.to_json().replace(r#""isolation":"advisory""#, r#""isolation":"magic""#);
        assert_eq!(NodeInventory::parse(&newer).unwrap().isolation, Some(IsolationMode::Advisory));
    }

    #[test]
    fn utilization_lands_on_gpus_by_uuid() {
        let mut node = h100_node("n1");
        let u = UtilizationAnnotation {
            version: 1,
            at_unix_ms: 1_700_000_000_000,
            gpus: vec![
                GpuUtilization { uuid: node.gpus[3].uuid.clone(), sm_percent: 80, memory_used_mib: 4096 },
                GpuUtilization { uuid: "GPU-gone".into(), sm_percent: 10, memory_used_mib: 1 },
            ],
        };
        let back = UtilizationAnnotation::parse(&u.to_json()).unwrap();
        assert_eq!(back, u);
        assert_eq!(back.apply_to(&mut node), vec!["GPU-gone".to_string()]);
        assert_eq!(
            node.utilization(3),
            Some(UtilSample { sm_pct: 80, mem_used_mib: 4096, at_unix_ms: 1_700_000_000_000 })
        );
        assert_eq!(node.utilization(2), None);
        let mut over = u;
        over.gpus[0].sm_percent = 101;
        assert!(matches!(UtilizationAnnotation::parse(&over.to_json()), Err(AnnotationError::BadUtilization(_))));
    }
}
