//! The PodGroup watcher: kube-scheduler's gangs (scheduling.k8s.io/v1alpha2 `PodGroup`, alpha in
//! Kubernetes 1.36) go to [`Scheduler::observe_pod_group`] (their `minCount` and topology keys) and,
//! when deleted, to [`Scheduler::forget_pod_group`] (the group's reservations end).
//!
//! Optional: the API is served only where the API server runs with
//! `--runtime-config=scheduling.k8s.io/v1alpha2=true` and the `GenericWorkload` gate. Without it
//! there are no gangs, and groups come from gpuplace's labels alone; the watcher asks again every
//! few minutes (an API server upgraded or reconfigured starts serving it). Readiness does not wait
//! on it: a gang member whose PodGroup is not seen yet is answered "retry" (docs/resources.md).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::scheduling::v1alpha2::PodGroup;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};

use crate::k8s::watch::next_event;
use crate::scheduler::groups::PodGroupInfo;
use crate::scheduler::metrics::Watched;
use crate::scheduler::Scheduler;

/// The API version PodGroups are watched at.
pub const POD_GROUP_API: &str = "scheduling.k8s.io/v1alpha2";

/// How often a server that does not serve PodGroups is asked again.
const RECHECK: Duration = Duration::from_secs(300);

/// What gpuplace reads of a PodGroup.
pub fn info(pg: &PodGroup) -> PodGroupInfo {
    let min_count = pg.spec.scheduling_policy.gang.as_ref().map(|g| g.min_count.max(0) as u32);
    let topology_keys = pg
        .spec
        .scheduling_constraints
        .as_ref()
        .and_then(|c| c.topology.as_ref())
        .map(|t| t.iter().map(|k| k.key.clone()).filter(|k| !k.is_empty()).collect())
        .unwrap_or_default();
    PodGroupInfo { min_count, topology_keys }
}

fn key(pg: &PodGroup) -> String {
    format!("{}/{}", pg.namespace().unwrap_or_default(), pg.name_any())
}

/// Whether the server serves PodGroups.
async fn served(client: &Client) -> bool {
    match client.list_api_group_resources(POD_GROUP_API).await {
        Ok(list) => list.resources.iter().any(|r| r.name == "podgroups"),
        Err(e) => {
            tracing::debug!(error = %e, "PodGroup API not served");
            false
        }
    }
}

/// Watches PodGroups in every namespace, once the server serves them; never ends.
pub async fn watch_pod_groups(client: Client, ext: Arc<Scheduler>) {
    let mut said = false;
    while !served(&client).await {
        if !said {
            tracing::info!(
                api = POD_GROUP_API,
                "PodGroups not served: groups come from gpuplace.io/group labels only; asking again every {} s",
                RECHECK.as_secs()
            );
            said = true;
        }
        tokio::time::sleep(RECHECK).await;
    }
    tracing::info!(api = POD_GROUP_API, "watching PodGroups");
    let api: Api<PodGroup> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
    let mut known: HashSet<String> = HashSet::new();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::PodGroups).await {
        match ev {
            Event::Init => listed.clear(),
            Event::InitApply(pg) | Event::Apply(pg) => {
                let k = key(&pg);
                listed.insert(k.clone());
                known.insert(k.clone());
                ext.observe_pod_group(&k, info(&pg));
            }
            Event::InitDone => {
                // deleted while the watch was broken
                let gone: Vec<String> = known.iter().filter(|k| !listed.contains(*k)).cloned().collect();
                for k in gone {
                    known.remove(&k);
                    ext.forget_pod_group(&k);
                }
            }
            Event::Delete(pg) => {
                let k = key(&pg);
                known.remove(&k);
                ext.forget_pod_group(&k);
            }
        }
    }
}
