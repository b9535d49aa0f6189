//! From kube-scheduler's objects to the scheduler's inputs (the wire pod as a [`PodView`], each
//! verb's request as its input, the candidates in either `nodeCacheCapable` mode) and to the
//! placement core's terms; the preempt answer from the victims kept. No decisions are made here,
//! and filter and prioritize answers are written by `extender::answers`.

use std::collections::{BTreeMap, HashMap};

use crate::extender::wire::{
    Container, ExtenderArgs, ExtenderArgsRef, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, MetaPod, MetaVictims, Pod, WireError, WireNode,
};
use crate::scheduler::input::{BindOrder, NodeObject, NodeQuery, NodeVictims, PodView, PreemptQuery, Victim};
use gpuplace_core::node_constraints::NodeConstraints;
use gpuplace_core::resources::{pod_request, ContainerResources, PodRequest, PodSpecView, RequestError, RESOURCE_GPU};

/// A pod whose request breaks the resource contract: it fits nowhere until its owner changes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod {pod}: {source}")]
pub struct PodRefused {
    /// `namespace/name`.
    pub pod: String,
    /// Boxed to keep `Result<PodRequest, PodRefused>` small on the success path.
    pub source: Box<RequestError>,
}

impl Container {
    /// The container's resources as the contract reads them. Requests and limits are both passed on:
    /// for extended resources a limit alone stands for the request, and the two must agree when both
    /// are set (kube-apiserver copies limits into absent requests, as every fixture shows, but
    /// objects built by other clients may carry only limits).
    pub fn resources_view(&self) -> ContainerResources {
        ContainerResources {
            name: self.name.clone(),
            requests: self.resources.requests.clone(),
            limits: self.resources.limits.clone(),
        }
    }
}

impl Pod {
    /// `namespace/name`, the key the cluster model and placement logs use.
    pub fn key(&self) -> String {
        format!("{}/{}", self.metadata.namespace, self.metadata.name)
    }

    /// The parts of the pod the resource contract reads. Infallible: quantities are still text.
    pub fn spec_view(&self) -> PodSpecView {
        PodSpecView {
            namespace: self.metadata.namespace.clone(),
            name: self.metadata.name.clone(),
            labels: self.metadata.labels.clone(),
            annotations: self.metadata.annotations.clone(),
            containers: self.spec.containers.iter().map(Container::resources_view).collect(),
            init_containers: self.spec.init_containers.iter().map(Container::resources_view).collect(),
            pod_group: self
                .spec
                .scheduling_group
                .as_ref()
                .and_then(|g| g.pod_group_name.clone())
                .filter(|n| !n.is_empty()),
        }
    }

    /// The pod's GPU request under the contract (docs/resources.md). Host CPU and memory are left at
    /// zero on purpose: kube-scheduler checks them against everything on the node, which the extender
    /// does not see. A pod without gpuplace resources gives a request with no containers.
    pub fn request(&self) -> Result<PodRequest, PodRefused> {
        pod_request(&self.spec_view()).map_err(|e| PodRefused { pod: self.key(), source: Box::new(e) })
    }

    /// `Succeeded` or `Failed`: the pod's containers are gone and hold no GPUs.
    pub fn is_finished(&self) -> bool {
        matches!(self.status.phase.as_str(), "Succeeded" | "Failed")
    }
}

/// How kube-scheduler passed the candidates, which is also how it reads the filter answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeListMode {
    /// `nodeCacheCapable: true`: `NodeNames` only; the extender knows the nodes from its own cache.
    NamesOnly,
    /// `nodeCacheCapable: false`: `Nodes` carries full Node objects; GPU inventory comes from them.
    FullNodes,
}

impl ExtenderArgs {
    /// Which mode the request is in. `Nodes` wins when a client sends both, because an answer carrying
    /// `Nodes` is read by kube-scheduler in either mode; neither is an error.
    pub fn mode(&self) -> Result<NodeListMode, WireError> {
        match (&self.nodes, &self.node_names) {
            (Some(_), _) => Ok(NodeListMode::FullNodes),
            (None, Some(_)) => Ok(NodeListMode::NamesOnly),
            (None, None) => Err(WireError::NoCandidates),
        }
    }

    /// Candidate node names in the order sent (possibly empty).
    pub fn candidate_names(&self) -> Result<Vec<&str>, WireError> {
        Ok(match self.mode()? {
            NodeListMode::FullNodes => self.nodes.iter().flat_map(|l| l.items.iter().map(|n| n.name())).collect(),
            NodeListMode::NamesOnly => self.node_names.iter().flatten().map(String::as_str).collect(),
        })
    }
}

impl ExtenderArgsRef<'_> {
    /// As [`ExtenderArgs::mode`].
    pub fn mode(&self) -> Result<NodeListMode, WireError> {
        match (&self.nodes, &self.node_names) {
            (Some(_), _) => Ok(NodeListMode::FullNodes),
            (None, Some(_)) => Ok(NodeListMode::NamesOnly),
            (None, None) => Err(WireError::NoCandidates),
        }
    }

    /// Whether every candidate name can be written back into JSON as it is: names-only mode, and
    /// every name was borrowed from the body, so it was a JSON string without escapes there
    /// (serde_json refuses raw control characters, and other bytes need no escaping).
    pub fn names_verbatim(&self) -> bool {
        use std::borrow::Cow;
        self.nodes.is_none() && self.node_names.iter().flatten().all(|n| matches!(n.0, Cow::Borrowed(_)))
    }

    /// As [`ExtenderArgs::candidate_names`].
    pub fn candidate_names(&self) -> Result<Vec<&str>, WireError> {
        Ok(match self.mode()? {
            NodeListMode::FullNodes => self.nodes.iter().flat_map(|l| l.items.iter().map(|n| n.name())).collect(),
            NodeListMode::NamesOnly => self.node_names.iter().flatten().map(|n| n.as_str()).collect(),
        })
    }
}

impl ExtenderFilterResult {
    /// Fails the whole scheduling attempt (for faults on our side, not for pods that do not fit).
    pub fn error(message: impl Into<String>) -> Self {
        Self { error: message.into(), ..Self::default() }
    }
}

impl ExtenderBindingArgs {
    /// `namespace/name`.
    pub fn pod_key(&self) -> String {
        format!("{}/{}", self.pod_namespace, self.pod_name)
    }
}

impl ExtenderBindingResult {
    pub fn ok() -> Self {
        Self::default()
    }

    pub fn error(message: impl Into<String>) -> Self {
        Self { error: message.into() }
    }
}

impl ExtenderPreemptionArgs {
    /// Victims per node by UID in either mode: `NodeNameToMetaVictims` as sent, or the UIDs of the full
    /// pods of `NodeNameToVictims` (what kube-scheduler's own `convertToMetaVictims` does). This is also the
    /// shape of the answer, which only ever carries UIDs.
    pub fn meta_victims(&self) -> BTreeMap<String, MetaVictims> {
        if let Some(meta) = &self.node_name_to_meta_victims {
            return meta.clone();
        }
        let full = self.node_name_to_victims.iter().flatten();
        full.map(|(node, v)| {
            let pods = v.pods.iter().map(|p| MetaPod { uid: p.metadata.uid.clone() }).collect();
            (node.clone(), MetaVictims { pods, num_pdb_violations: v.num_pdb_violations })
        })
        .collect()
    }
}

/// The wire pod is how the extender's requests show the scheduler a pod.
impl PodView for Pod {
    fn namespace(&self) -> &str {
        &self.metadata.namespace
    }

    fn name(&self) -> &str {
        &self.metadata.name
    }

    fn uid(&self) -> &str {
        &self.metadata.uid
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata.annotations.get(key).map(String::as_str)
    }

    fn node_name(&self) -> &str {
        &self.spec.node_name
    }

    fn is_finished(&self) -> bool {
        Pod::is_finished(self)
    }

    fn request(&self) -> Result<PodRequest, String> {
        Pod::request(self).map_err(|e| e.to_string())
    }

    fn node_constraints(&self) -> Result<NodeConstraints, String> {
        self.spec.node_constraints()
    }

    fn has_soft_preferences(&self) -> bool {
        self.spec.has_soft_preferences()
    }
}

impl WireNode {
    /// The Node object as the scheduler reads it.
    pub fn object(&self) -> NodeObject<'_> {
        let view = self.view();
        NodeObject {
            name: self.name(),
            labels: &view.metadata.labels,
            annotations: &view.metadata.annotations,
            advertises_gpus: view.status.allocatable.contains_key(RESOURCE_GPU),
        }
    }
}

impl<'a> ExtenderArgsRef<'a> {
    /// Filter's and prioritize's input. `Err` for a request without candidates (neither `Nodes`
    /// nor `NodeNames`).
    pub fn query(&'a self) -> Result<NodeQuery<'a>, WireError> {
        let names = self.candidate_names()?;
        let objects = self.nodes.as_ref().map(|l| l.items.iter().map(WireNode::object).collect());
        Ok(NodeQuery { pod: &self.pod, names, objects })
    }
}

impl ExtenderBindingArgs {
    /// Bind's input.
    pub fn order(&self) -> BindOrder {
        BindOrder {
            namespace: self.pod_namespace.clone(),
            name: self.pod_name.clone(),
            uid: self.pod_uid.clone(),
            node: self.node.clone(),
        }
    }
}

impl ExtenderPreemptionArgs {
    /// Preempt's input: the victims by UID per node ([`Self::meta_victims`]), each with its name
    /// and priority where kube-scheduler sent the full pod.
    pub fn query(&self) -> PreemptQuery<'_> {
        let mut full: HashMap<&str, (String, Option<i32>)> = HashMap::new();
        for v in self.node_name_to_victims.iter().flat_map(|m| m.values()) {
            for p in &v.pods {
                full.insert(p.metadata.uid.as_str(), (p.key(), p.spec.priority));
            }
        }
        let nodes = self
            .meta_victims()
            .into_iter()
            .map(|(node, v)| {
                let pods =
                    v.pods.into_iter().map(|p| Victim { pod: full.get(p.uid.as_str()).cloned(), uid: p.uid }).collect();
                (node, NodeVictims { pods, pdb_violations: v.num_pdb_violations })
            })
            .collect();
        PreemptQuery { pod: &self.pod, nodes }
    }
}

impl ExtenderPreemptionResult {
    /// The answer: the victims kept per node, by UID.
    pub fn of(kept: BTreeMap<String, NodeVictims>) -> Self {
        let node_name_to_meta_victims = kept
            .into_iter()
            .map(|(node, v)| {
                let pods = v.pods.into_iter().map(|p| MetaPod { uid: p.uid }).collect();
                (node, MetaVictims { pods, num_pdb_violations: v.pdb_violations })
            })
            .collect();
        Self { node_name_to_meta_victims }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::wire::{decode, Node, ResourceRequirements, WireNode};
    use gpuplace_core::resources::{GpuDemand, MemoryDemand, NumaPolicy, PackingPolicy};

    fn container(name: &str, limits: &[(&str, &str)]) -> Container {
        let limits = limits.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Container { name: name.into(), resources: ResourceRequirements { limits, requests: BTreeMap::new() } }
    }

    #[test]
    fn spec_view_carries_everything_the_contract_reads() {
        let mut pod = Pod::default();
        pod.metadata.name = "p".into();
        pod.metadata.namespace = "ml".into();
        pod.metadata.labels.insert("gpuplace.io/group".into(), "job".into());
        pod.metadata.annotations.insert("gpuplace.io/group-size".into(), "3".into());
        pod.metadata.annotations.insert("gpuplace.io/gpu-policy".into(), "spread".into());
        pod.metadata.annotations.insert("gpuplace.io/numa".into(), "required".into());
        pod.spec.containers = vec![
            container(
                "main",
                &[("gpuplace.io/gpu", "2"), ("gpuplace.io/gpu-mem", "8Ki"), ("gpuplace.io/gpu-core", "100")],
            ),
            container("sidecar", &[("cpu", "100m")]),
        ];
        pod.spec.init_containers = vec![container("warmup", &[("gpuplace.io/gpu", "1")])];
        let r = pod.request().unwrap();
        assert_eq!(r.key, "ml/p");
        assert_eq!(r.containers.len(), 1);
        assert_eq!(
            r.containers[0].demand,
            GpuDemand::Shared { gpus: 2, memory: MemoryDemand::Mib(4096), core_pct: 50 }
        );
        assert_eq!(r.init_containers[0].name, "warmup");
        assert_eq!(r.gpu_policy, Some(PackingPolicy::Spread));
        assert_eq!(r.numa, NumaPolicy::Required);
        assert_eq!(r.group.unwrap().key, "ml/job");
        assert_eq!((r.cpu_milli, r.memory_mib), (0, 0), "host resources are kube-scheduler's to check");
    }

    #[test]
    fn finished_pods_are_recognised() {
        let mut pod = Pod::default();
        for (phase, done) in
            [("Pending", false), ("Running", false), ("Succeeded", true), ("Failed", true), ("", false)]
        {
            pod.status.phase = phase.into();
            assert_eq!(pod.is_finished(), done, "{phase}");
        }
    }

    #[test]
    fn nodes_built_in_code_round_trip() {
        let mut view = Node::default();
        view.metadata.name = "n1".into();
        view.status.allocatable.insert("gpuplace.io/gpu".into(), "8".into());
        let node = WireNode::from_view(view.clone()).unwrap();
        assert_eq!(node.name(), "n1");
        assert_eq!(node.raw_json(), r#"{"metadata":{"name":"n1"},"status":{"allocatable":{"gpuplace.io/gpu":"8"}}}"#);
        let body = format!(r#"{{"Pod":{{}},"Nodes":{{"metadata":{{}},"items":[{}]}}}}"#, node.raw_json());
        let args: ExtenderArgs = decode(body.as_bytes()).unwrap();
        assert_eq!(args.nodes.unwrap().items[0].view(), &view);
    }
}
