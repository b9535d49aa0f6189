//! What a front end passes to the online scheduler: the pod, as a [`PodView`] over whatever object
//! the front end holds (the extender's wire pod, the watchers' k8s-openapi pod), and per verb the
//! candidates ([`NodeQuery`]), the bind ([`BindOrder`]) or the victims ([`PreemptQuery`]).
//!
//! A view rather than one pod struct: each front end's object already holds the fields, so nothing
//! is copied or re-encoded to cross (the watchers' pods went through JSON before), and the costly
//! parts (the request, the node constraints) are computed only where a decision reads them.

use std::collections::BTreeMap;

use gpuplace_core::node_constraints::NodeConstraints;
use gpuplace_core::resources::PodRequest;

/// A pod as the scheduler reads it. Strings are empty where the object has none.
pub trait PodView {
    fn namespace(&self) -> &str;
    fn name(&self) -> &str;
    fn uid(&self) -> &str;
    /// An annotation's value.
    fn annotation(&self, key: &str) -> Option<&str>;
    /// `spec.nodeName` (empty until bound).
    fn node_name(&self) -> &str;
    /// `Succeeded` or `Failed`: its containers are gone and hold no GPUs.
    fn is_finished(&self) -> bool;
    /// Its GPU request under the resource contract (docs/resources.md), or the contract's refusal,
    /// naming the pod and the container.
    fn request(&self) -> Result<PodRequest, String>;
    /// What it requires of its node that bind checks: `nodeSelector`, required node affinity,
    /// tolerations.
    fn node_constraints(&self) -> Result<NodeConstraints, String>;
    /// Whether kube-scheduler's score plugins have preferences to weigh between the nodes that fit
    /// (preferred affinity or anti-affinity, a topology spread that may be broken).
    fn has_soft_preferences(&self) -> bool;

    /// `namespace/name`, the key the cluster model and placement logs use.
    fn key(&self) -> String {
        format!("{}/{}", self.namespace(), self.name())
    }
}

/// A candidate's Node object, where the front end has it (kube-scheduler's `nodeCacheCapable:
/// false`): its inventory annotation defines the node, and it says why an unknown node is unknown.
#[derive(Debug, Clone, Copy)]
pub struct NodeObject<'a> {
    pub name: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub annotations: &'a BTreeMap<String, String>,
    /// It advertises `gpuplace.io/gpu` in its allocatable resources.
    pub advertises_gpus: bool,
}

/// Filter's and prioritize's input: the pod and its candidate nodes, in the order the front end
/// got them (a name may repeat: it is judged once).
pub struct NodeQuery<'a> {
    pub pod: &'a dyn PodView,
    pub names: Vec<&'a str>,
    /// The candidates' Node objects, position for position, when they came with the request.
    pub objects: Option<Vec<NodeObject<'a>>>,
}

impl NodeQuery<'_> {
    /// How the candidates came, for the placement log: `nodes` (objects) or `names`.
    pub fn mode(&self) -> &'static str {
        if self.objects.is_some() {
            "nodes"
        } else {
            "names"
        }
    }
}

/// Bind's input: this pod onto this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindOrder {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
}

impl BindOrder {
    /// `namespace/name`.
    pub fn pod_key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// One victim kube-scheduler proposes to evict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    pub uid: String,
    /// `namespace/name` and priority, when the front end has the pod (kube-scheduler's full
    /// victims); otherwise the scheduler's records name it.
    pub pod: Option<(String, Option<i32>)>,
}

/// The victims proposed on one node, and how many PodDisruptionBudgets evicting them all breaks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeVictims {
    pub pods: Vec<Victim>,
    pub pdb_violations: i64,
}

/// Preempt's input: the pod, and per node the victims whose eviction kube-scheduler proposes.
pub struct PreemptQuery<'a> {
    pub pod: &'a dyn PodView,
    pub nodes: BTreeMap<String, NodeVictims>,
}
