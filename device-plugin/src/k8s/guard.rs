//! The guard's view of this node's pods and its way out to the API server: which container of which
//! pod a process is in and what that container was granted (from the pod watch of
//! [`KubeAssignments`], trusting only verified assignments), Events on the pods, and evictions. The
//! driver's memory caps read the same grants ([`GrantedPods`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::api::EvictParams;
use kube::{Api, Client, ResourceExt};

use super::assignments::KubeAssignments;
use super::events::PluginEvents;
use super::{call, CALL_TIMEOUT};
use crate::driver_limits::{status_container_id, ContainerGrants, GrantedPods, PodGrants};
use crate::guard::cgroup::bare_container_id;
use crate::guard::run::GuardOutlet;
use crate::guard::{ContainerDirectory, Grant, Holder, Lookup};
use crate::sampler::Telemetry;

/// The container of `pod` whose runtime ID is `container_id` (app, init or ephemeral).
pub(crate) fn container_name(pod: &Pod, container_id: &str) -> Option<String> {
    let status = pod.status.as_ref()?;
    let lists = [&status.container_statuses, &status.init_container_statuses, &status.ephemeral_container_statuses];
    lists.into_iter().flatten().flatten().find_map(|c| {
        let id = c.container_id.as_deref()?;
        bare_container_id(id).eq_ignore_ascii_case(container_id).then(|| c.name.clone())
    })
}

impl ContainerDirectory for KubeAssignments {
    fn lookup(&self, pod_uid: Option<&str>, container_id: &str) -> Lookup {
        let found =
            self.cached_pods(pod_uid).into_iter().find_map(|p| container_name(&p, container_id).map(|c| (p, c)));
        let Some((pod, container)) = found else { return Lookup::Unknown };
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let assigned = match self.trusted(&pod) {
            Ok(Some(p)) => p,
            Ok(None) => return Lookup::NotGranted(format!("pod {name} has no gpuplace assignment")),
            Err(e) => {
                // a key this plugin has not loaded yet (a restarted plugin before its first
                // Allocate): read the keys again, the next sample judges the process
                if e.unknown_key() {
                    self.reload_keys_soon();
                }
                return Lookup::NotGranted(format!("pod {name}: its assignment is not trusted: {e}"));
            }
        };
        let grants: BTreeMap<u32, Grant> = assigned
            .assignment
            .containers
            .iter()
            .filter(|c| c.name == container)
            .flat_map(|c| &c.slices)
            .map(|s| (s.gpu, grant(s)))
            .collect();
        let holder = Holder {
            namespace: pod.namespace().unwrap_or_default(),
            pod: pod.name_any(),
            pod_uid,
            container,
            container_id: container_id.to_string(),
        };
        Lookup::Granted { holder, grants }
    }
}

/// A slice of an assignment as the guard's grant.
fn grant(s: &gpuplace_core::assignment::GpuSlice) -> Grant {
    Grant { mem_mib: s.mem_mib, core_pct: s.core_pct, exclusive: s.exclusive }
}

impl GrantedPods for KubeAssignments {
    fn granted_pods(&self) -> Vec<PodGrants> {
        self.cached_pods(None)
            .into_iter()
            .filter_map(|pod| {
                let assigned = match self.trusted(&pod) {
                    Ok(Some(p)) => p,
                    Ok(None) => return None,
                    Err(e) => {
                        if e.unknown_key() {
                            self.reload_keys_soon();
                        }
                        return None;
                    }
                };
                let uid = pod.metadata.uid.clone()?;
                let spec = pod.spec.as_ref();
                let init: Vec<&str> = spec
                    .into_iter()
                    .flat_map(|s| s.init_containers.iter().flatten())
                    .map(|c| c.name.as_str())
                    .collect();
                let containers = assigned
                    .assignment
                    .containers
                    .iter()
                    .map(|c| ContainerGrants {
                        name: c.name.clone(),
                        container_id: status_container_id(&pod, &c.name),
                        init: init.contains(&c.name.as_str()),
                        grants: c.slices.iter().map(|s| (s.gpu, grant(s))).collect(),
                    })
                    .collect();
                Some(PodGrants {
                    pod: format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any()),
                    uid,
                    containers,
                })
            })
            .collect()
    }
}

/// Events through [`PluginEvents`], evictions through the Eviction API.
pub struct KubeGuardOutlet {
    client: Client,
    events: PluginEvents,
    telemetry: Arc<Telemetry>,
}

impl KubeGuardOutlet {
    pub fn new(client: Client, node: &str, telemetry: Arc<Telemetry>) -> Self {
        Self { events: PluginEvents::new(client.clone(), node), client, telemetry }
    }
}

impl GuardOutlet for KubeGuardOutlet {
    fn warn(&self, holder: &Holder, reason: &'static str, note: &str) {
        self.events.guard_warn(&holder.namespace, &holder.pod, &holder.pod_uid, reason, note);
    }

    fn evict<'a>(&'a self, holder: &'a Holder) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &holder.namespace);
            // the UID as precondition: a pod re-created under the same name is not evicted
            let params = EvictParams {
                delete_options: Some(kube::api::DeleteParams {
                    preconditions: Some(kube::api::Preconditions {
                        uid: Some(holder.pod_uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                }),
                ..EvictParams::default()
            };
            match call("pod_evict", CALL_TIMEOUT, api.evict(&holder.pod, &params)).await {
                Ok(_) => Ok(()),
                Err(e) => {
                    self.telemetry.api_error("pod_evict");
                    Err(format!("evicting {}/{}: {e}", holder.namespace, holder.pod))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_found_by_runtime_id_in_every_status_list() {
        let id = "a".repeat(64);
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u"},
            "status": {
                "containerStatuses": [
                    {"name": "main", "containerID": format!("containerd://{id}"), "image": "", "imageID": "", "ready": true, "restartCount": 0},
                    {"name": "starting", "image": "", "imageID": "", "ready": false, "restartCount": 0}
                ],
                "initContainerStatuses": [
                    {"name": "setup", "containerID": format!("containerd://{}", "b".repeat(64)), "image": "", "imageID": "", "ready": false, "restartCount": 0}
                ]
            }
        }))
        .unwrap();
        assert_eq!(container_name(&pod, &id).as_deref(), Some("main"));
        assert_eq!(container_name(&pod, &"B".repeat(64)).as_deref(), Some("setup"));
        assert_eq!(container_name(&pod, &"c".repeat(64)), None);
    }
}
