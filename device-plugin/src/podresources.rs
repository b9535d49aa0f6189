//! Which pod and container hold each of our devices: kubelet's pod-resources API (gRPC v1 `List` on
//! `/var/lib/kubelet/pod-resources/kubelet.sock`).
//!
//! [`PodResourcesClient::list`] makes one call (a fresh connection each time: a kubelet restart
//! replaces the socket, and one connect every few seconds costs nothing); [`attribute`] turns the
//! answer into containers per GPU, pure, so it is tested without a socket.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::kubelet_api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::kubelet_api::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use crate::slots::SlotTable;
use crate::unix_socket::connect_unix;

/// Where kubelet serves the pod-resources API.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// One container, as pod-resources names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerRef {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl ContainerRef {
    /// The key the plugin's grant records use: (`namespace/pod`, container).
    pub fn grant_key(&self) -> (String, String) {
        (format!("{}/{}", self.namespace, self.pod), self.container.clone())
    }
}

/// Containers per GPU index, from one `List`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    pub by_gpu: BTreeMap<u32, BTreeSet<ContainerRef>>,
    /// Every container holding one of our devices.
    pub containers: BTreeSet<ContainerRef>,
    /// Who holds each of our device IDs (more than one container when kubelet hands an init
    /// container's device on to an app container, and both are listed).
    pub by_device: BTreeMap<String, BTreeSet<ContainerRef>>,
    /// Device IDs of our resource that do not name a slot of this node (a stale kubelet checkpoint
    /// after the GPUs changed, or a slot count lowered across a restart).
    pub unknown_ids: usize,
}

/// Maps the devices of `resource` in a `List` answer to our GPUs.
pub fn attribute(resp: &ListPodResourcesResponse, resource: &str, slots: &SlotTable) -> Attribution {
    let mut out = Attribution::default();
    for pod in &resp.pod_resources {
        for c in &pod.containers {
            let who =
                ContainerRef { namespace: pod.namespace.clone(), pod: pod.name.clone(), container: c.name.clone() };
            for id in c.devices.iter().filter(|d| d.resource_name == resource).flat_map(|d| &d.device_ids) {
                match slots.parse(id) {
                    Ok(slot) => {
                        out.by_gpu.entry(slot.gpu).or_default().insert(who.clone());
                        out.containers.insert(who.clone());
                        out.by_device.entry(id.clone()).or_default().insert(who.clone());
                    }
                    Err(_) => out.unknown_ids += 1,
                }
            }
        }
    }
    out
}

/// Why a `List` call failed; [`reason`](Self::reason) is the metric label.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error("pod-resources socket {0} does not exist (is kubelet running, and is the directory mounted?)")]
    SocketMissing(PathBuf),
    #[error("connecting to pod-resources socket {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("pod-resources List on {path} failed: {status}")]
    Call { path: PathBuf, status: tonic::Status },
    #[error("pod-resources List on {path} took longer than {timeout:?}")]
    Timeout { path: PathBuf, timeout: Duration },
}

impl PodResourcesError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::SocketMissing(_) => "socket_missing",
            Self::Connect { .. } => "connect",
            Self::Call { .. } => "call",
            Self::Timeout { .. } => "timeout",
        }
    }
}

/// A client of kubelet's pod-resources `List`.
#[derive(Debug, Clone)]
pub struct PodResourcesClient {
    socket: PathBuf,
    timeout: Duration,
}

impl PodResourcesClient {
    /// `timeout` bounds connect and call together, so a wedged kubelet cannot stall the sampler.
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self { socket: socket.into(), timeout }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// One `List` call.
    pub async fn list(&self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        if !self.socket.exists() {
            return Err(PodResourcesError::SocketMissing(self.socket.clone()));
        }
        let path = self.socket.clone();
        let call = async {
            let channel = connect_unix(&self.socket)
                .await
                .map_err(|source| PodResourcesError::Connect { path: path.clone(), source })?;
            let mut client = PodResourcesListerClient::new(channel);
            client
                .list(ListPodResourcesRequest {})
                .await
                .map(tonic::Response::into_inner)
                .map_err(|status| PodResourcesError::Call { path: path.clone(), status })
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or_else(|_| Err(PodResourcesError::Timeout { path: path.clone(), timeout: self.timeout }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_api::podresources::{ContainerDevices, ContainerResources, PodResources};

    fn container(name: &str, resource: &str, ids: &[&str]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|s| s.to_string()).collect(),
                topology: None,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn devices_map_to_gpus_and_foreign_resources_are_ignored() {
        let slots = SlotTable::new(vec!["GPU-a".into(), "GPU-b".into()], 4).unwrap();
        let resp = ListPodResourcesResponse {
            pod_resources: vec![
                PodResources {
                    name: "train".into(),
                    namespace: "ml".into(),
                    containers: vec![
                        container("main", "gpuplace.io/gpu", &["GPU-a::0", "GPU-b::0"]),
                        // another vendor's resource with look-alike IDs is not ours
                        container("side", "nvidia.com/gpu", &["GPU-a::1"]),
                    ],
                },
                PodResources {
                    name: "infer".into(),
                    namespace: "web".into(),
                    containers: vec![container("srv", "gpuplace.io/gpu", &["GPU-a::2", "GPU-gone::0", "junk"])],
                },
            ],
        };
        let a = attribute(&resp, "gpuplace.io/gpu", &slots);
        let names = |g: u32| a.by_gpu[&g].iter().map(|c| c.container.as_str()).collect::<Vec<_>>();
        assert_eq!(names(0), ["main", "srv"]);
        assert_eq!(names(1), ["main"]);
        assert_eq!(a.containers.len(), 2);
        assert_eq!(a.unknown_ids, 2);
        assert_eq!(a.by_device.len(), 3);
        assert_eq!(a.by_device["GPU-a::2"].iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(), ["infer"]);
        let srv = a.by_gpu[&0].iter().find(|c| c.container == "srv").unwrap();
        assert_eq!(srv.grant_key(), ("web/infer".to_string(), "srv".to_string()));
    }

    #[tokio::test]
    async fn a_missing_socket_is_named() {
        let c = PodResourcesClient::new("/nonexistent/pod-resources/kubelet.sock", Duration::from_secs(1));
        let e = c.list().await.unwrap_err();
        assert_eq!(e.reason(), "socket_missing");
        assert!(e.to_string().contains("/nonexistent/pod-resources/kubelet.sock"), "{e}");
    }
}
