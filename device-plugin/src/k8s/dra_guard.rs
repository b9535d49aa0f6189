//! The guard's directory in DRA mode: a process's container is found in this node's pods (the
//! watch of [`super::pods`]), and its grant in the CDI specs of the claims this plugin prepared
//! ([`crate::dra::grants`]): what the allocation gave each request of each claim, per GPU. Events
//! and evictions go through the same [`super::guard::KubeGuardOutlet`] as in assignments mode. The
//! driver's memory caps read the same grants ([`GrantedPods`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;

use super::guard::container_name;
use crate::dra::cdi::prepared_specs;
use crate::dra::grants::{container_grants, pod_grants, spec_grants, ClaimGrant};
use crate::driver_limits::{GrantedPods, PodGrants};
use crate::guard::{ContainerDirectory, Holder, Lookup};
use crate::sampler::Telemetry;

/// How long the prepared claims' grants are reused: one guard sample looks up every process.
const SPECS_FRESH: Duration = Duration::from_millis(500);

/// See the module docs.
pub struct DraDirectory {
    store: Store<Pod>,
    watch: JoinHandle<()>,
    cdi_dir: PathBuf,
    driver: String,
    prepared: Mutex<Option<(Instant, Arc<Vec<ClaimGrant>>)>>,
}

impl Drop for DraDirectory {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl DraDirectory {
    /// Starts watching this node's pods; `cdi_dir` and `driver` are where prepared claims' specs are
    /// (`--cdi-dir`, `--dra-driver`). Needs a tokio runtime.
    pub fn start(client: Client, node: &str, cdi_dir: PathBuf, driver: &str, telemetry: Arc<Telemetry>) -> Arc<Self> {
        let (store, watch) = super::pods::watch_node_pods(client, node, telemetry);
        Arc::new(Self { store, watch, cdi_dir, driver: driver.to_string(), prepared: Mutex::new(None) })
    }

    /// The grants of every claim prepared here, read from their specs at most every 500 ms.
    fn prepared(&self) -> Arc<Vec<ClaimGrant>> {
        let mut cached = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, grants)) = cached.as_ref() {
            if at.elapsed() < SPECS_FRESH {
                return grants.clone();
            }
        }
        let grants: Vec<ClaimGrant> =
            prepared_specs(&self.cdi_dir, &self.driver).iter().flat_map(spec_grants).collect();
        let grants = Arc::new(grants);
        *cached = Some((Instant::now(), grants.clone()));
        grants
    }
}

impl ContainerDirectory for DraDirectory {
    fn lookup(&self, pod_uid: Option<&str>, container_id: &str) -> Lookup {
        let mut pods = self.store.state();
        if let Some(uid) = pod_uid {
            pods.retain(|p| p.metadata.uid.as_deref() == Some(uid));
        }
        let found = pods.into_iter().find_map(|p| container_name(&p, container_id).map(|c| (p, c)));
        let Some((pod, container)) = found else { return Lookup::Unknown };
        let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        match container_grants(&pod, &container, &self.prepared()) {
            None => Lookup::NotGranted(format!(
                "container {container} of pod {name} uses no claim prepared by driver {}",
                self.driver
            )),
            Some(grants) => Lookup::Granted {
                holder: Holder {
                    namespace: pod.namespace().unwrap_or_default(),
                    pod: pod.name_any(),
                    pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
                    container,
                    container_id: container_id.to_string(),
                },
                grants,
            },
        }
    }
}

impl GrantedPods for DraDirectory {
    fn granted_pods(&self) -> Vec<PodGrants> {
        let prepared = self.prepared();
        self.store.state().iter().filter_map(|pod| pod_grants(pod, &prepared)).collect()
    }
}
