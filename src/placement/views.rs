//! What scorers may read of the whole cluster besides the node they score, worked out once per pod
//! (or per cluster state) rather than once per node: where the pod's group stands ([`GroupView`],
//! for `scorers::network`) and which reserve classes and model lists are scarce ([`ReserveView`],
//! for `scorers::reserve` and `scorers::model_supply`, kept by `placement::scarcity`) and which nodes
//! and switches are whole ([`WholeView`], for `scorers::whole`, kept by `placement::whole_units`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::placement::mix::ReserveClass;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::GroupSpec;

/// A node's network path: its value for each configured level, coarse to fine.
pub type NetPath = Vec<Option<String>>;

/// Where a group stands, computed once per pod rather than once per node.
#[derive(Debug, Clone, Default)]
pub struct GroupView {
    /// Network paths of the nodes holding the group's placed pods.
    pub peer_paths: Vec<NetPath>,
    pub placed: usize,
    pub size: usize,
    /// Idle healthy GPUs under each leaf switch (full path; nodes missing a label are left out).
    pub idle_by_leaf: HashMap<NetPath, usize>,
    pub levels: usize,
}

pub fn path_of(cluster: &Cluster, node: &Node) -> NetPath {
    cluster.network_path(node).map(|v| v.map(str::to_string)).collect()
}

impl GroupView {
    pub fn new(cluster: &Cluster, group: &GroupSpec) -> Self {
        let mut v = Self { size: group.size as usize, levels: cluster.network_levels.len(), ..Self::default() };
        for n in cluster.nodes() {
            let path = path_of(cluster, n);
            let holds = n.pods().filter(|p| p.group.as_deref() == Some(group.key.as_str())).count();
            if holds > 0 {
                v.placed += holds;
                v.peer_paths.push(path.clone());
            }
            // a node missing a label is under no known leaf: pooling all such nodes would promise room
            // near it that may be anywhere in the network
            if path.iter().all(Option::is_some) {
                *v.idle_by_leaf.entry(path).or_default() += n.idle_gpus();
            }
        }
        v
    }
}

/// What `scorers::whole` reads: per node, how many whole units a placement there would break.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct WholeView {
    /// Per node index: 0 when the node is not whole; else 1 (the node) plus its whole switches.
    pub breaks: Arc<[u8]>,
    /// Units a node can be part of: itself and one switch per network level.
    pub units: u8,
    /// Some node built for jobs is whole (else nothing is left to keep and the scorer is left out).
    pub any: bool,
    /// Differs whenever a switch's wholeness or `any` does (a node's own wholeness is part of the
    /// node's state, which a verdict cache already keys on).
    pub key: u64,
}

/// At most this many reserve classes are looked at (a bit each in the scarcity mask).
pub const MAX_CLASSES: usize = 64;

/// Bit `k` set: class `k` of a [`ReserveView`] is scarce (at most `keep` free hosts left).
pub type ScarceMask = u64;

/// The reserve classes that hold for a cluster state, and which of them are scarce.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ReserveView {
    /// The mix's classes (learned from requests), then those of the node inventory
    /// ([`inventory_classes`]), at most [`MAX_CLASSES`].
    pub classes: Vec<ReserveClass>,
    pub scarce: ScarceMask,
    /// The lists of GPU models whose free GPUs are short of what the pods bound to them need
    /// ([`model_supply::short_lists`]).
    pub short: Vec<Vec<String>>,
    /// The GPU models of the cluster's nodes (each node's first GPU's), each once.
    pub models: Vec<String>,
    /// The whole nodes and switches (`scorers::whole`).
    pub whole: WholeView,
}

impl ReserveView {
    /// A key that differs whenever scores may: the whole switches, the scarce classes (what the
    /// reserve scorer reads; a class's `keep` only decides whether it is scarce) and the short lists.
    pub fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.whole.key.hash(&mut h);
        if self.scarce == 0 && self.short.is_empty() {
            // nothing scarce or short: both scorers are left out, whatever the classes
            return h.finish() | 1;
        }
        for (k, c) in self.classes.iter().enumerate().filter(|(k, _)| (self.scarce >> k) & 1 == 1) {
            (k, c.gpus, c.milli, c.cpu_milli, c.memory_mib, &c.models).hash(&mut h);
        }
        self.short.hash(&mut h);
        h.finish() | 1
    }
}
