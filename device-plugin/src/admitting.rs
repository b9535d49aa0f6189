//! Which pod the kubelet is admitting, read from its pod-resources `List`.
//!
//! `GetPreferredAllocation` and `Allocate` carry device IDs, never the pod. Bind order is no answer:
//! the kubelet sorts each batch of pods it learns of by creation time (one-second resolution, ties in
//! any order), and after a restart admits every waiting pod in one batch. On a real v1.36 node a
//! burst of nine pods created together started eight containers on another pod's assignment when
//! the plugin took the earliest bind first (tests/e2e/real_node.rs).
//!
//! What the kubelet does show: it admits pods one at a time, and adds a pod to its pod manager just
//! before admitting it; pod-resources `List` reports the pod manager's active pods, each container
//! with the devices already allocated to it. So while the kubelet waits on our `GetPreferredAllocation`
//! or `Allocate` for a container, that container is listed without any of our devices, every pod
//! admitted before it has its devices, and pods it has not reached are not listed at all. Among the
//! pods that by our records still wait for an `Allocate`, the ones listed with a waiting container
//! and no devices for it are the pod being admitted: one pod, by construction.
//!
//! [`admitting`] is that rule, pure. An empty answer means the kubelet admits a pod that is not ours
//! (bound by nodeName or by another scheduler): once the kubelet has shown that it lists the pod it
//! admits, Allocate refuses it (`crate::plugin`), since a match would hand it a waiting pod's
//! assignment; before that, [`crate::assign`]'s rules decide alone. More than one pod (say a pod the
//! kubelet refused and still lists) narrows them to those.

use std::collections::BTreeSet;

use crate::assign::{PendingPod, PodKey};
use crate::kubelet_api::podresources::ListPodResourcesResponse;

/// The pods of `pending` that `list` shows waiting for a device of `resource`: listed, with a
/// container the assignment names that is not yet allocated and holds none of `resource`'s devices.
pub fn admitting(list: &ListPodResourcesResponse, resource: &str, pending: &[PendingPod]) -> BTreeSet<PodKey> {
    let mut out = BTreeSet::new();
    for p in pending {
        let Some((ns, name)) = p.key.pod.split_once('/') else { continue };
        let Some(listed) = list.pod_resources.iter().find(|l| l.namespace == ns && l.name == name) else { continue };
        let waits =
            p.assignment.containers.iter().filter(|c| !p.allocated.contains(&c.name)).any(|c| {
                // a container the kubelet lists without our devices; one it does not list at all is
                // not being admitted yet (the kubelet lists every container of a pod it has added)
                listed.containers.iter().find(|lc| lc.name == c.name).is_some_and(|lc| {
                    !lc.devices.iter().any(|d| d.resource_name == resource && !d.device_ids.is_empty())
                })
            });
        if waits {
            out.insert(p.key.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_api::podresources::{ContainerDevices, ContainerResources, PodResources};
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};

    const R: &str = "gpuplace.io/gpu";

    fn pending(pod: &str, containers: &[&str], allocated: &[&str]) -> PendingPod {
        PendingPod {
            key: PodKey { pod: pod.to_string(), uid: format!("uid-{pod}") },
            bind_seq: 1,
            assignment: PodAssignment {
                pod: pod.to_string(),
                node: "n".into(),
                containers: containers
                    .iter()
                    .map(|c| ContainerAssignment {
                        name: c.to_string(),
                        init: false,
                        slices: vec![GpuSlice { gpu: 0, mem_mib: 1000, core_pct: 10, exclusive: false }],
                    })
                    .collect(),
                cpu_milli: 0,
                memory_mib: 0,
                group: None,
            },
            allocated: allocated.iter().map(|s| s.to_string()).collect(),
            unconfirmed: BTreeSet::new(),
        }
    }

    fn listed(pod: &str, containers: &[(&str, &[&str])]) -> PodResources {
        let (ns, name) = pod.split_once('/').unwrap();
        PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers: containers
                .iter()
                .map(|(c, ids)| ContainerResources {
                    name: c.to_string(),
                    devices: if ids.is_empty() {
                        Vec::new()
                    } else {
                        vec![ContainerDevices {
                            resource_name: R.into(),
                            device_ids: ids.iter().map(|s| s.to_string()).collect(),
                            ..Default::default()
                        }]
                    },
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn keys(s: &BTreeSet<PodKey>) -> Vec<&str> {
        s.iter().map(|k| k.pod.as_str()).collect()
    }

    #[test]
    fn the_listed_pod_without_devices_is_the_one_being_admitted() {
        // a admitted before (its devices listed), b being admitted, c bound but not reached yet
        let list = ListPodResourcesResponse {
            pod_resources: vec![listed("ns/a", &[("main", &["GPU-0::0"])]), listed("ns/b", &[("main", &[])])],
        };
        let p = [pending("ns/a", &["main"], &[]), pending("ns/b", &["main"], &[]), pending("ns/c", &["main"], &[])];
        assert_eq!(keys(&admitting(&list, R, &p)), ["ns/b"]);
    }

    #[test]
    fn another_resource_s_devices_do_not_count_and_allocated_containers_do_not_wait() {
        let mut other = listed("ns/b", &[("main", &["x"])]);
        other.containers[0].devices[0].resource_name = "nvidia.com/gpu".into();
        let list = ListPodResourcesResponse { pod_resources: vec![other, listed("ns/d", &[("main", &[])])] };
        // d's only container is already marked allocated by us: it waits for nothing
        let p = [pending("ns/b", &["main"], &[]), pending("ns/d", &["main"], &["main"])];
        assert_eq!(keys(&admitting(&list, R, &p)), ["ns/b"]);
    }

    #[test]
    fn a_pod_between_its_containers_still_waits_and_unlisted_pods_never_do() {
        // two GPU containers: the first got its devices, the kubelet now allocates the second
        let list =
            ListPodResourcesResponse { pod_resources: vec![listed("ns/a", &[("one", &["GPU-0::1"]), ("two", &[])])] };
        let p = [pending("ns/a", &["one", "two"], &["one"]), pending("ns/z", &["main"], &[])];
        assert_eq!(keys(&admitting(&list, R, &p)), ["ns/a"]);
        let empty = ListPodResourcesResponse::default();
        assert!(admitting(&empty, R, &p).is_empty());
    }
}
