//! The guard: GPU memory and compute limits that hold whatever a container's environment says
//! (docs/isolation.md, mode `guard`, and the backstop of `mps`).
//!
//! Every sample it lists each GPU's compute processes (NVML, [`crate::nvml::GpuBackend::processes`]),
//! finds each process's container from its cgroup ([`cgroup`]) and that container's grant from its
//! pod's verified assignment ([`ContainerDirectory`]), and applies [`policy`]: a container over its
//! memory grant gets an Event and a metric at once and, after a short grace, its largest process on
//! that GPU is killed (or the pod evicted); its neighbours are never touched. [`run`] is the I/O.

pub mod cgroup;
pub mod policy;
pub mod run;

use std::collections::BTreeMap;

pub use policy::{Grant, GuardConfig, Holder, OverrunAction};

/// What the guard knows of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A container of a pod gpuplace placed, with what it was granted, by GPU index.
    Granted { holder: Holder, grants: BTreeMap<u32, Grant> },
    /// A container of a pod without a gpuplace assignment it can trust (why, for logs).
    NotGranted(String),
    /// No pod of this node has that UID and container (yet: the pod watch may lag a new container).
    Unknown,
}

/// Pods and their grants, by container ID (and pod UID where the cgroup names it).
pub trait ContainerDirectory: Send + Sync {
    fn lookup(&self, pod_uid: Option<&str>, container_id: &str) -> Lookup;
}
