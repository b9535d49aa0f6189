//! The watchers' k8s-openapi Pod as the scheduler reads it ([`PodView`]), straight from the typed
//! object: no JSON round trip into the extender's wire pod. The two views agree field for field
//! (tests/pod_views.rs reads the fixtures' pods and every field through both).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::extender::adapt::PodRefused;
use crate::scheduler::input::PodView;
use gpuplace_core::node_constraints::{NodeConstraints, Toleration};
use gpuplace_core::resources::{pod_request, ContainerResources, PodRequest, PodSpecView};

/// An empty spec, for a pod object without one (never sent by the API server).
static NO_SPEC: std::sync::LazyLock<PodSpec> = std::sync::LazyLock::new(PodSpec::default);

fn spec(pod: &Pod) -> &PodSpec {
    pod.spec.as_ref().unwrap_or(&NO_SPEC)
}

fn quantities(list: Option<&BTreeMap<String, Quantity>>) -> BTreeMap<String, String> {
    list.map(|l| l.iter().map(|(k, q)| (k.clone(), q.0.clone())).collect()).unwrap_or_default()
}

/// A container's resources as the contract reads them (requests and limits both passed on, as
/// the wire pod's are).
fn resources(c: &Container) -> ContainerResources {
    let r = c.resources.as_ref();
    ContainerResources {
        name: c.name.clone(),
        requests: quantities(r.and_then(|r| r.requests.as_ref())),
        limits: quantities(r.and_then(|r| r.limits.as_ref())),
    }
}

fn spec_view(pod: &Pod) -> PodSpecView {
    let s = spec(pod);
    PodSpecView {
        namespace: pod.namespace().to_string(),
        name: pod.name().to_string(),
        labels: pod.metadata.labels.clone().unwrap_or_default(),
        annotations: pod.metadata.annotations.clone().unwrap_or_default(),
        containers: s.containers.iter().map(resources).collect(),
        init_containers: s.init_containers.iter().flatten().map(resources).collect(),
        pod_group: s.scheduling_group.as_ref().and_then(|g| g.pod_group_name.clone()).filter(|n| !n.is_empty()),
    }
}

impl PodView for Pod {
    fn namespace(&self) -> &str {
        self.metadata.namespace.as_deref().unwrap_or_default()
    }

    fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    fn uid(&self) -> &str {
        self.metadata.uid.as_deref().unwrap_or_default()
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata.annotations.as_ref()?.get(key).map(String::as_str)
    }

    fn node_name(&self) -> &str {
        spec(self).node_name.as_deref().unwrap_or_default()
    }

    fn is_finished(&self) -> bool {
        let phase = self.status.as_ref().and_then(|s| s.phase.as_deref());
        matches!(phase, Some("Succeeded" | "Failed"))
    }

    fn request(&self) -> Result<PodRequest, String> {
        // the same refusal, in the same words, as the extender's wire pod gives
        pod_request(&spec_view(self)).map_err(|e| PodRefused { pod: self.key(), source: Box::new(e) }.to_string())
    }

    fn node_constraints(&self) -> Result<NodeConstraints, String> {
        let s = spec(self);
        // the affinity terms are read as the API server writes them (camelCase JSON); only pods
        // with an affinity pay for the conversion
        let affinity = match &s.affinity {
            Some(a) => Some(serde_json::to_value(a).map_err(|e| format!("affinity not readable: {e}"))?),
            None => None,
        };
        let tolerations = s
            .tolerations
            .iter()
            .flatten()
            .map(|t| Toleration {
                key: t.key.clone().unwrap_or_default(),
                operator: t.operator.clone().unwrap_or_default(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone().unwrap_or_default(),
            })
            .collect();
        Ok(NodeConstraints::new(s.node_selector.clone().unwrap_or_default(), affinity.as_ref())?
            .with_tolerations(tolerations))
    }

    fn has_soft_preferences(&self) -> bool {
        fn any<T>(terms: Option<&Vec<T>>) -> bool {
            terms.is_some_and(|t| !t.is_empty())
        }
        let s = spec(self);
        let preferred = s.affinity.as_ref().is_some_and(|a| {
            any(a.node_affinity.as_ref().and_then(|n| n.preferred_during_scheduling_ignored_during_execution.as_ref()))
                || any(a
                    .pod_affinity
                    .as_ref()
                    .and_then(|p| p.preferred_during_scheduling_ignored_during_execution.as_ref()))
                || any(a
                    .pod_anti_affinity
                    .as_ref()
                    .and_then(|p| p.preferred_during_scheduling_ignored_during_execution.as_ref()))
        });
        preferred || s.topology_spread_constraints.iter().flatten().any(|t| t.when_unsatisfiable == "ScheduleAnyway")
    }
}
