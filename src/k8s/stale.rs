//! Stale assignments on pods that are not bound: the leader removes them.
//!
//! gpuplace's binds write the assignment with the Binding, atomically, so they never leave one on
//! a pending pod. Such assignments still appear: forged, copied from another pod, or left by a bind
//! of an earlier build (which patched the pod first and was cut before its Binding). They are never
//! counted (an unbound pod's assignment is not trusted), but they are reported as not trusted again
//! at every rebuild, and such pods pile up.
//! This task watches unbound pods (metadata only, field selector `spec.nodeName=`, as
//! kube-scheduler selects them) and, while this replica leads, removes an assignment that has sat
//! on an unbound pod for longer than `grace`.
//!
//! Why it cannot remove a live one: `grace` is at least the Lease duration, so a bind of a former
//! leader is over by then; a bind of this replica is in its bound records and skipped; and the
//! removal is a JSON patch that tests the pod's UID and the resourceVersion it saw, so a pod bound
//! (or re-annotated) since is left alone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::time::Instant;

use crate::k8s::leader::Leadership;
use crate::k8s::watched_pod::WatchedMeta;
use crate::scheduler::Scheduler;
use gpuplace_core::annotations::ANNOTATION_ASSIGNMENT;

/// How often candidates are looked at.
const TICK: Duration = Duration::from_secs(5);

struct Candidate {
    namespace: String,
    name: String,
    text: String,
    resource_version: String,
    /// When this annotation text was first seen on the unbound pod.
    since: Instant,
}

/// Runs until aborted. `grace`: how long an assignment may sit on an unbound pod.
pub async fn run(client: Client, ext: Arc<Scheduler>, leadership: Arc<Leadership>, grace: Duration) {
    // metadata only: the annotation and the resourceVersion are all this needs (decoded without
    // managedFields: this sees every pod twice, created and bound)
    let api: Api<WatchedMeta> = Api::all(client.clone());
    let config = watcher::Config::default().fields("spec.nodeName=");
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut candidates: HashMap<String, Candidate> = HashMap::new();
    let mut tick = tokio::time::interval(TICK);
    loop {
        tokio::select! {
            ev = stream.next() => match ev {
                None => return,
                Some(Err(e)) => tracing::debug!(error = %e, "unbound-pod watch failed; retrying"),
                Some(Ok(Event::Apply(m) | Event::InitApply(m))) => {
                    let Some(uid) = m.uid() else { continue };
                    match m.annotations().get(ANNOTATION_ASSIGNMENT) {
                        None => {
                            candidates.remove(&uid);
                        }
                        Some(text) => {
                            let rv = m.resource_version().unwrap_or_default();
                            let since = candidates.get(&uid).filter(|c| c.text == *text).map_or_else(Instant::now, |c| c.since);
                            candidates.insert(uid, Candidate {
                                namespace: m.namespace().unwrap_or_default(),
                                name: m.name_any(),
                                text: text.clone(),
                                resource_version: rv,
                                since,
                            });
                        }
                    }
                }
                Some(Ok(Event::Delete(m))) => {
                    if let Some(uid) = m.uid() {
                        candidates.remove(&uid);
                    }
                }
                Some(Ok(Event::Init | Event::InitDone)) => {}
            },
            _ = tick.tick() => {
                if leadership.is_leader() {
                    sweep(&client, &ext, &mut candidates, grace).await;
                }
            }
        }
    }
}

async fn sweep(client: &Client, ext: &Scheduler, candidates: &mut HashMap<String, Candidate>, grace: Duration) {
    let due: Vec<String> =
        candidates.iter().filter(|(_, c)| c.since.elapsed() >= grace).map(|(u, _)| u.clone()).collect();
    if due.is_empty() {
        return;
    }
    let ours = ext.bound_pods();
    let key = ANNOTATION_ASSIGNMENT.replace('~', "~0").replace('/', "~1");
    for uid in due {
        // a bind of ours in flight: its own annotation, not stale
        if ours.contains_key(&uid) {
            continue;
        }
        let Some(c) = candidates.remove(&uid) else { continue };
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "test", "path": "/metadata/resourceVersion", "value": c.resource_version},
            {"op": "remove", "path": format!("/metadata/annotations/{key}")},
        ]);
        let Ok(patch) = serde_json::from_value::<json_patch::Patch>(ops) else { continue };
        let api: Api<Pod> = Api::namespaced(client.clone(), &c.namespace);
        match api.patch(&c.name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => tracing::info!(
                pod = %format!("{}/{}", c.namespace, c.name),
                unbound_for_s = c.since.elapsed().as_secs(),
                "stale assignment removed from a pod that is not bound (a bind cut short)"
            ),
            // changed since (bound, re-annotated, gone): the watch brings its new state
            Err(e) => tracing::debug!(pod = %c.name, error = %e, "stale assignment left: the pod changed"),
        }
    }
}
