//! kube-scheduler's extender protocol, `k8s.io/kube-scheduler/extender/v1` (types.go), field for field.
//!
//! # Names and nulls
//!
//! The Go types carry no JSON tags, so every field travels under its Go name (`Pod`, `NodeNames`,
//! `FailedAndUnresolvableNodes`, `PodUID`, `NumPDBViolations`, `UID`) and none is `omitempty`: Go
//! always writes every field, nil pointers, maps and slices as `null` (the fixtures show
//! `"Nodes": null`, `"NodeNames": null`, `"NodeNameToVictims": null`). So on input every optional field
//! accepts `null` or a missing key, as Go's decoder does. On output we write every field, under its
//! exact Go name; maps and lists we answer with are written as `{}` / `[]` rather than `null`, which
//! Go decodes the same way. Go matches field names case-insensitively when decoding; kube-scheduler
//! always writes the exact names, so we read exact names only.
//!
//! # Pods and Nodes: minimal views, not k8s-openapi
//!
//! `Pod` and `Node` here are views of the fields gpuplace reads (metadata name, namespace, uid,
//! labels, annotations, ownerReferences; pod containers' and init containers' resources, nodeName,
//! priority, phase; node capacity and allocatable); every other field is skipped unread. We chose this
//! over k8s-openapi (0.29, which has a `v1_36` feature) because:
//! - in full-Nodes mode the filter answer must carry the passing Node objects back; k8s-openapi would
//!   re-encode them and drop any field its version does not know, while [`WireNode`] keeps the bytes
//!   kube-scheduler sent (a [`RawValue`]) and echoes them unchanged;
//! - a typed k8s-openapi Pod refuses the whole request over a malformed field we never read (a volume,
//!   a probe); the views fail only on the fields placement depends on;
//! - skipping unread fields (managedFields is most of a Node) keeps 5,000-node requests cheap, and
//!   the core stays free of a large, version-pinned dependency.
//!
//! The kube-rs watchers will bring k8s-openapi anyway; they convert their Pods to the same
//! [`PodSpecView`](gpuplace_core::resources::PodSpecView) the wire pod converts to (`extender::adapt`).
//!
//! Quantities stay strings here: a malformed one is refused later by the resource contract with a
//! [`RequestError`](gpuplace_core::resources::RequestError) that names the container, not by the decoder.
//! Like Go's `resource.Quantity`, a JSON number is also accepted as a quantity.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use gpuplace_core::node_constraints::{NodeConstraints, Toleration};
use serde::de::{self, DeserializeOwned, Deserializer};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;

/// Lowest score an extender may give (`MinExtenderPriority`).
pub const MIN_EXTENDER_PRIORITY: i64 = 0;
/// Highest score an extender may give (`MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// `FailedNodesMap`: node name to a failure message a person reads in the pod's events.
pub type FailedNodesMap = BTreeMap<String, String>;

/// A container's `resources.requests` or `.limits`: resource name to quantity text.
pub type ResourceList = BTreeMap<String, String>;

// ---------------------------------------------------------------------------------------------------
// Envelope types (extender/v1)
// ---------------------------------------------------------------------------------------------------

/// `ExtenderArgs`: the body of filter and prioritize requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderArgs {
    /// `*v1.Pod`, the pod being scheduled. Required: Go would send `null` only from a broken client,
    /// and there is nothing to place without it.
    #[serde(rename = "Pod")]
    pub pod: Pod,
    /// `*v1.NodeList`: the candidates as full objects, set only when `nodeCacheCapable` is false.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// `*[]string`: the candidates by name, set only when `nodeCacheCapable` is true.
    #[serde(rename = "NodeNames", default, deserialize_with = "bounded_opt_vec")]
    pub node_names: Option<Vec<String>>,
}

/// A candidate node name as sent: borrowed from the request body (no copy, no allocation) unless
/// the JSON string had escapes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeName<'a>(#[serde(borrow)] pub Cow<'a, str>);

impl NodeName<'_> {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// [`ExtenderArgs`] as filter and prioritize decode it on their hot path: the same fields and the
/// same rules (objects only, `null` for absent), with `NodeNames` borrowed from the body, as a
/// 5,000-node request would otherwise allocate 5,000 strings. Decode with [`decode_args`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderArgsRef<'a> {
    #[serde(rename = "Pod")]
    pub pod: Pod,
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default, borrow, deserialize_with = "bounded_opt_vec")]
    pub node_names: Option<Vec<NodeName<'a>>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for ExtenderArgsRef<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> de::Visitor<'de> for Visitor<'a> {
            type Value = ExtenderArgsRef<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object (ExtenderArgs)")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                ExtenderArgsRef::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Visitor(PhantomData))
    }
}

impl Serialize for ExtenderArgsRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ExtenderArgsRef::serialize(self, s)
    }
}

impl From<ExtenderArgs> for ExtenderArgsRef<'static> {
    fn from(a: ExtenderArgs) -> Self {
        let node_names = a.node_names.map(|v| v.into_iter().map(|n| NodeName(Cow::Owned(n))).collect());
        Self { pod: a.pod, nodes: a.nodes, node_names }
    }
}

impl ExtenderArgsRef<'_> {
    /// The owned form (names copied).
    pub fn into_owned(self) -> ExtenderArgs {
        let node_names = self.node_names.map(|v| v.into_iter().map(|n| n.0.into_owned()).collect());
        ExtenderArgs { pod: self.pod, nodes: self.nodes, node_names }
    }
}

/// `ExtenderFilterResult`: the filter answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderFilterResult {
    /// `*v1.NodeList`: the passing nodes when the request carried `Nodes`.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// `*[]string`: the passing nodes when the request carried `NodeNames`. kube-scheduler reads it only
    /// when `nodeCacheCapable` is true, and then every name must be one it sent.
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit now but might after preemption.
    #[serde(rename = "FailedNodes", default, deserialize_with = "null_as_default")]
    pub failed_nodes: FailedNodesMap,
    /// Nodes where preemption would not help; wins over `FailedNodes` for a node in both.
    #[serde(rename = "FailedAndUnresolvableNodes", default, deserialize_with = "null_as_default")]
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    /// Non-empty fails the whole scheduling attempt (an extender error, not a node verdict).
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// `HostPriority`: one node's score in a prioritize answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    /// `int64`, 0..=10 for extenders; kube-scheduler multiplies it by the extender's weight and by 10.
    #[serde(rename = "Score")]
    pub score: i64,
}

impl HostPriority {
    /// A score clamped to the extender range, so no scorer bug can send kube-scheduler an out-of-range value.
    pub fn new(host: impl Into<String>, score: i64) -> Self {
        Self { host: host.into(), score: score.clamp(MIN_EXTENDER_PRIORITY, MAX_EXTENDER_PRIORITY) }
    }
}

/// `HostPriorityList`: the prioritize answer, a bare JSON list.
pub type HostPriorityList = Vec<HostPriority>;

/// `ExtenderBindingArgs`: the bind request. All four fields are required: kube-scheduler always
/// sends them and a bind without any one of them cannot be carried out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// `types.UID`, a string.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node kube-scheduler chose.
    #[serde(rename = "Node")]
    pub node: String,
}

/// `ExtenderBindingResult`: the bind answer; an empty `Error` means bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// `ExtenderPreemptionArgs`: the preempt request. kube-scheduler sets `NodeNameToMetaVictims` when
/// `nodeCacheCapable` is true and `NodeNameToVictims` otherwise; the other is `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderPreemptionArgs {
    /// `*v1.Pod`, the preemptor.
    #[serde(rename = "Pod")]
    pub pod: Pod,
    /// `map[string]*Victims`: full victim pods per node.
    #[serde(rename = "NodeNameToVictims", default, deserialize_with = "bounded_opt_map")]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// `map[string]*MetaVictims`: victim UIDs per node.
    #[serde(rename = "NodeNameToMetaVictims", default, deserialize_with = "bounded_opt_map")]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// `Victims`: the pods kube-scheduler would evict on one node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct Victims {
    /// `[]*v1.Pod`.
    #[serde(rename = "Pods", default, deserialize_with = "null_as_default")]
    pub pods: Vec<Pod>,
    #[serde(rename = "NumPDBViolations", default, deserialize_with = "null_as_default")]
    pub num_pdb_violations: i64,
}

/// `MetaPod`: a pod by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct MetaPod {
    #[serde(rename = "UID", default, deserialize_with = "null_as_default")]
    pub uid: String,
}

/// `MetaVictims`: the victims on one node by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct MetaVictims {
    /// `[]*MetaPod`.
    #[serde(rename = "Pods", default, deserialize_with = "null_as_default")]
    pub pods: Vec<MetaPod>,
    #[serde(rename = "NumPDBViolations", default, deserialize_with = "null_as_default")]
    pub num_pdb_violations: i64,
}

/// `ExtenderPreemptionResult`: the preempt answer. A node left out gets no preemption; kube-scheduler
/// looks every UID up among the pods it has on that node and fails the attempt for an unknown one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ExtenderPreemptionResult {
    #[serde(rename = "NodeNameToMetaVictims", default, deserialize_with = "null_as_default")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

// ---------------------------------------------------------------------------------------------------
// Kubernetes object views (core/v1 JSON, camelCase as the API server writes it)
// ---------------------------------------------------------------------------------------------------

/// The fields of `metadata` gpuplace reads. Empty fields are left out when written, as the API server does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub uid: String,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Vec::is_empty")]
    pub owner_references: Vec<OwnerReference>,
}

/// `metadata.ownerReferences[]`: who owns a pod (a Job, a StatefulSet), for grouping and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct OwnerReference {
    #[serde(default, deserialize_with = "null_as_default")]
    pub api_version: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub kind: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub uid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_owner_deletion: Option<bool>,
}

/// A pod as far as placement cares. Everything else in the object is skipped unread.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct Pod {
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    pub spec: PodSpec,
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: PodStatus,
}

/// `spec` of a pod: its containers' resources and where it is bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<Container>,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Vec::is_empty")]
    pub init_containers: Vec<Container>,
    /// Set once bound (victim pods carry it).
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub node_name: String,
    /// Resolved from the PriorityClass by admission; victims are chosen lowest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// `schedulingGroup`: the kube-scheduler PodGroup (gang) the pod belongs to.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Option::is_none")]
    pub scheduling_group: Option<SchedulingGroup>,
    /// `affinity`: whether kube-scheduler's scoring has preferences to weigh
    /// ([`PodSpec::has_soft_preferences`]), and the required node affinity bind checks
    /// ([`PodSpec::node_constraints`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<serde_json::Value>,
    /// `nodeSelector`, which bind checks ([`PodSpec::node_constraints`]).
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// `tolerations`, which bind checks against the node's taints ([`PodSpec::node_constraints`]).
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<serde_json::Value>,
}

impl PodSpec {
    /// What the pod requires of its node that bind can check (`core::node_constraints`).
    pub fn node_constraints(&self) -> Result<NodeConstraints, String> {
        Ok(NodeConstraints::new(self.node_selector.clone(), self.affinity.as_ref())?
            .with_tolerations(self.tolerations.clone()))
    }

    /// Whether the pod states preferences that kube-scheduler's score plugins weigh between nodes
    /// that fit: preferred node affinity, preferred pod affinity or anti-affinity, or a topology
    /// spread constraint that may be broken (`ScheduleAnyway`).
    pub fn has_soft_preferences(&self) -> bool {
        let preferred = |kind: &str| {
            self.affinity
                .as_ref()
                .and_then(|a| a.get(kind)?.get("preferredDuringSchedulingIgnoredDuringExecution")?.as_array())
                .is_some_and(|terms| !terms.is_empty())
        };
        preferred("nodeAffinity")
            || preferred("podAffinity")
            || preferred("podAntiAffinity")
            || self
                .topology_spread_constraints
                .iter()
                .any(|t| t.get("whenUnsatisfiable").and_then(|w| w.as_str()) == Some("ScheduleAnyway"))
    }
}

/// `spec.schedulingGroup` of a pod (core/v1 `PodSchedulingGroup`, Kubernetes 1.36).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingGroup {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_group_name: Option<String>,
}

/// One container's name and resources.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct Container {
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub resources: ResourceRequirements,
}

/// `resources` of a container. Values are quantity text, parsed by the resource contract.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct ResourceRequirements {
    #[serde(default, deserialize_with = "resource_list", skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: ResourceList,
    #[serde(default, deserialize_with = "resource_list", skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: ResourceList,
}

/// `status` of a pod.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`; finished pods hold no GPUs.
    #[serde(default, deserialize_with = "null_as_default", skip_serializing_if = "String::is_empty")]
    pub phase: String,
}

/// A node as far as placement cares: labels (GPU product, network levels), annotations (the inventory
/// the device plugin publishes) and the extended resources it advertises.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct Node {
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    pub status: NodeStatus,
}

/// `status` of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct NodeStatus {
    #[serde(default, deserialize_with = "resource_list", skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity: ResourceList,
    #[serde(default, deserialize_with = "resource_list", skip_serializing_if = "BTreeMap::is_empty")]
    pub allocatable: ResourceList,
}

/// One item of a `NodeList`: the exact JSON kube-scheduler sent, plus the parsed view.
///
/// Serializing writes the original bytes back, so a filter answer in full-Nodes mode returns the
/// Node objects unchanged. Decoding needs serde_json's text decoders (`from_slice`, `from_str`,
/// `from_reader`, as an HTTP body extractor uses); `serde_json::from_value` cannot produce a raw value.
#[derive(Clone)]
pub struct WireNode {
    raw: Box<RawValue>,
    view: Node,
}

impl WireNode {
    /// A node built in code (tests, load generators): its JSON is the view's.
    pub fn from_view(view: Node) -> Result<Self, serde_json::Error> {
        Ok(Self { raw: serde_json::value::to_raw_value(&view)?, view })
    }

    pub fn name(&self) -> &str {
        &self.view.metadata.name
    }

    /// The node's name, without copying it.
    pub fn into_name(self) -> String {
        self.view.metadata.name
    }

    pub fn view(&self) -> &Node {
        &self.view
    }

    /// The object exactly as received.
    pub fn raw_json(&self) -> &str {
        self.raw.get()
    }
}

impl fmt::Debug for WireNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // the raw text is kilobytes of managedFields; the view says what matters
        f.debug_struct("WireNode").field("view", &self.view).field("raw_len", &self.raw.get().len()).finish()
    }
}

impl PartialEq for WireNode {
    fn eq(&self, other: &Self) -> bool {
        self.raw.get() == other.raw.get()
    }
}

impl Serialize for WireNode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.raw.serialize(s)
    }
}

impl<'de> Deserialize<'de> for WireNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        let view = match serde_json::from_str::<Node>(raw.get()) {
            Ok(view) => view,
            Err(first) => {
                // positions in the message are within the node's own text, so name the field as well
                // (tracked only on failure, as in `decode`)
                let mut inner = serde_json::Deserializer::from_str(raw.get());
                let msg = match serde_path_to_error::deserialize::<_, Node>(&mut inner) {
                    Err(e) => format!("Node object{}: {}", at(&e.path().to_string()), e.inner()),
                    Ok(_) => format!("Node object: {first}"),
                };
                return Err(de::Error::custom(msg));
            }
        };
        Ok(Self { raw, view })
    }
}

/// `v1.NodeList`. Its list metadata is kept as sent (kube-scheduler sends `{}`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub struct NodeList {
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Go writes an empty list as `null`. At most the request node limit ([`with_node_limit`]).
    #[serde(default, deserialize_with = "bounded_null_vec")]
    pub items: Vec<WireNode>,
}

// ---------------------------------------------------------------------------------------------------
// Decoding with errors a caller can answer with
// ---------------------------------------------------------------------------------------------------

/// A wire type with its Go name, for error messages.
pub trait GoType: DeserializeOwned {
    const GO_NAME: &'static str;
}

/// Each wire type's Go name is its Rust name.
macro_rules! go_types {
    ($($t:ident),*) => {$(
        impl GoType for $t {
            const GO_NAME: &'static str = stringify!($t);
        }
    )*};
}

go_types!(
    ExtenderArgs,
    ExtenderFilterResult,
    HostPriorityList,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult
);

/// Why a body could not be used. Each message names the expected type and, for a wrong shape, the
/// field (`Pod.spec.containers[0].resources.limits`) and where decoding stopped.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{go_type}: the body ends early (truncated or empty JSON): {source}")]
    Truncated { go_type: &'static str, source: serde_json::Error },
    #[error("{go_type}: the body is not valid JSON: {source}")]
    Syntax { go_type: &'static str, source: serde_json::Error },
    #[error("{go_type}{}: {source}", at(path))]
    Shape {
        go_type: &'static str,
        /// Field path from the top, `.` for the top itself.
        path: String,
        source: serde_json::Error,
    },
    #[error("ExtenderArgs has neither Nodes nor NodeNames; kube-scheduler sends NodeNames when the extender is nodeCacheCapable and Nodes otherwise")]
    NoCandidates,
    #[error("{go_type} names more than {limit} nodes (serve --max-request-nodes); kube-scheduler sends at most the cluster's nodes, so the request was refused")]
    TooManyNodes { go_type: &'static str, limit: usize },
}

impl WireError {
    /// The HTTP status that answers it: 413 for a request over the node limit, else 400.
    pub fn http_status(&self) -> u16 {
        match self {
            WireError::TooManyNodes { .. } => 413,
            _ => 400,
        }
    }
}

fn at(path: &str) -> String {
    if path == "." {
        String::new()
    } else {
        format!(" at {path}")
    }
}

/// Decodes a request or answer body into `T`, classifying failures so that a caller can answer with
/// a clear message (and an HTTP 400) instead of a generic parse error.
pub fn decode<T: GoType>(body: &[u8]) -> Result<T, WireError> {
    NODE_LIMIT_HIT.set(false);
    decode_unbounded_error::<T>(body).map_err(|e| {
        if NODE_LIMIT_HIT.get() {
            WireError::TooManyNodes { go_type: T::GO_NAME, limit: node_limit() }
        } else {
            e
        }
    })
}

fn decode_unbounded_error<T: GoType>(body: &[u8]) -> Result<T, WireError> {
    let go_type = T::GO_NAME;
    let classify = |path: String, source: serde_json::Error| match source.classify() {
        serde_json::error::Category::Eof => WireError::Truncated { go_type, source },
        serde_json::error::Category::Data => WireError::Shape { go_type, path, source },
        serde_json::error::Category::Syntax | serde_json::error::Category::Io => WireError::Syntax { go_type, source },
    };
    let first = match serde_json::from_slice(body) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    // Path tracking costs about half again on the hot path, so only a failed body is decoded again
    // with it, to name the field; the same bytes fail the same way.
    let mut de = serde_json::Deserializer::from_slice(body);
    Err(match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Err(e) => classify(e.path().to_string(), e.into_inner()),
        Ok(_) => classify(".".into(), de.end().err().unwrap_or(first)),
    })
}

// ---------------------------------------------------------------------------------------------------
// Objects only
// ---------------------------------------------------------------------------------------------------

// serde's derived structs also accept a JSON array, read positionally (`"Pod": []` would be an empty
// pod). Go's decoder refuses an array for a struct, and so do we: every type above derives with
// `remote = "Self"` (which makes the derived code inherent functions) and the trait impls below admit
// only objects before handing over to the derived code.

/// The derived (inherent) deserializer of a wire struct, with the Go type's name for messages.
trait Derived: Sized {
    const NAME: &'static str;
    fn derived<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
}

struct ObjectVisitor<T>(PhantomData<T>);

impl<'de, T: Derived> de::Visitor<'de> for ObjectVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON object ({})", T::NAME)
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::derived(de::value::MapAccessDeserializer::new(map))
    }
}

macro_rules! objects_only {
    ($($t:ident: $go:literal),* $(,)?) => {$(
        impl Derived for $t {
            const NAME: &'static str = $go;
            fn derived<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $t::deserialize(d)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_map(ObjectVisitor::<$t>(PhantomData))
            }
        }
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                $t::serialize(self, s)
            }
        }
    )*};
}

objects_only! {
    ExtenderArgs: "ExtenderArgs",
    ExtenderFilterResult: "ExtenderFilterResult",
    HostPriority: "HostPriority",
    ExtenderBindingArgs: "ExtenderBindingArgs",
    ExtenderBindingResult: "ExtenderBindingResult",
    ExtenderPreemptionArgs: "ExtenderPreemptionArgs",
    Victims: "Victims",
    MetaPod: "MetaPod",
    MetaVictims: "MetaVictims",
    ExtenderPreemptionResult: "ExtenderPreemptionResult",
    ObjectMeta: "ObjectMeta",
    OwnerReference: "OwnerReference",
    Pod: "Pod",
    PodSpec: "PodSpec",
    Container: "Container",
    ResourceRequirements: "ResourceRequirements",
    PodStatus: "PodStatus",
    Node: "Node",
    NodeStatus: "NodeStatus",
    NodeList: "NodeList",
}

// ---------------------------------------------------------------------------------------------------
// The node limit: no list or map of nodes in a request grows past what a cluster has
// ---------------------------------------------------------------------------------------------------

/// Default for `serve --max-request-nodes`: three times the 5,000 nodes Kubernetes supports per
/// cluster. A body within the size limit can still name millions of (unknown) nodes; each would cost
/// memory to decode and a line in the answer, so such a request is refused while it is decoded.
pub const DEFAULT_MAX_REQUEST_NODES: usize = 15_000;

thread_local! {
    static NODE_LIMIT: Cell<usize> = const { Cell::new(DEFAULT_MAX_REQUEST_NODES) };
    pub(crate) static NODE_LIMIT_HIT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (decoding and deciding on this thread) with at most `max` nodes accepted in any one
/// node list or node map of a request; more fail decoding with [`WireError::TooManyNodes`]. The
/// limit is per thread, so concurrent requests with different limits (tests) do not meet.
pub fn with_node_limit<R>(max: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            NODE_LIMIT.set(self.0);
        }
    }
    let _restore = Restore(NODE_LIMIT.replace(max.max(1)));
    f()
}

/// The node limit in force on this thread.
pub(crate) fn node_limit() -> usize {
    NODE_LIMIT.get()
}

fn over_node_limit<E: de::Error>() -> E {
    NODE_LIMIT_HIT.set(true);
    E::custom(format_args!("more than {} nodes (serve --max-request-nodes)", node_limit()))
}

/// A list that stops decoding at the node limit.
struct BoundedVec<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for BoundedVec<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for Visitor<T> {
            type Value = BoundedVec<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let max = node_limit();
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(max).min(1 << 12));
                while let Some(x) = seq.next_element()? {
                    if out.len() >= max {
                        return Err(over_node_limit());
                    }
                    out.push(x);
                }
                Ok(BoundedVec(out))
            }
        }
        d.deserialize_seq(Visitor(PhantomData))
    }
}

/// A map keyed by node that stops decoding at the node limit.
struct BoundedMap<V>(BTreeMap<String, V>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for BoundedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> de::Visitor<'de> for Visitor<V> {
            type Value = BoundedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let max = node_limit();
                let mut out = BTreeMap::new();
                while let Some((k, v)) = map.next_entry::<String, V>()? {
                    if out.len() >= max {
                        return Err(over_node_limit());
                    }
                    out.insert(k, v);
                }
                Ok(BoundedMap(out))
            }
        }
        d.deserialize_map(Visitor(PhantomData))
    }
}

fn bounded_opt_vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Vec<T>>, D::Error> {
    Ok(Option::<BoundedVec<T>>::deserialize(d)?.map(|v| v.0))
}

fn bounded_null_vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(bounded_opt_vec(d)?.unwrap_or_default())
}

fn bounded_opt_map<'de, D: Deserializer<'de>, V: Deserialize<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, V>>, D::Error> {
    Ok(Option::<BoundedMap<V>>::deserialize(d)?.map(|m| m.0))
}

// ---------------------------------------------------------------------------------------------------
// Field helpers
// ---------------------------------------------------------------------------------------------------

/// `null` reads as the empty value, as Go's decoder leaves a field it gets `null` for at its zero value.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A resource map whose values are quantity strings or, as Go's `resource.Quantity` also accepts,
/// JSON numbers (kept as their decimal text) and `null` (Go's zero quantity, so "0", which the contract
/// refuses for gpuplace resources). Anything else is a type error naming the resource.
fn resource_list<'de, D: Deserializer<'de>>(d: D) -> Result<ResourceList, D::Error> {
    use serde_json::Value;
    let raw: Option<BTreeMap<String, Value>> = Option::deserialize(d)?;
    let mut out = ResourceList::new();
    for (name, v) in raw.unwrap_or_default() {
        let text = match v {
            Value::String(s) => s,
            Value::Number(n) => n.to_string(),
            Value::Null => "0".to_string(),
            other => {
                let kind = match other {
                    Value::Bool(_) => "a boolean",
                    Value::Array(_) => "a list",
                    _ => "an object",
                };
                return Err(de::Error::custom(format!(
                    "resource {name:?}: expected a quantity such as \"2\" or \"64Gi\", got {kind}"
                )));
            }
        };
        out.insert(name, text);
    }
    Ok(out)
}
