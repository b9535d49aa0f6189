//! Stale assignments on pods that are not bound: the leader removes them.
//!
//! gpuplace's binds write the assignment with the Binding, atomically, so they never leave one on
//! a pending pod. Such assignments still appear: forged, copied from another pod, or left by a bind
//! of an earlier build (which patched the pod first and was cut before its Binding). They are never
//! counted (an unbound pod's assignment is not trusted), but they are reported as not trusted again
//! at every rebuild, and such pods pile up.
//!
//! The pod watcher (`pods`), which sees every pod, hands each one to [`UnboundAssignments`]: a pod
//! without `spec.nodeName` that carries an assignment is a candidate, anything else is not. (This
//! used to be a second watch of unbound pods, metadata only; it made the API server send every pod
//! twice more, created and bound, and cost the extender a tenth of its watch thread: issue 33.)
//! [`run`] looks at the candidates every [`TICK`] and, while this replica leads, removes an
//! assignment that has sat on an unbound pod for longer than `grace`.
//!
//! Why it cannot remove a live one: `grace` is at least the Lease duration, so a bind of a former
//! leader is over by then; a bind of this replica is in its bound records and skipped; and the
//! removal is a JSON patch that tests the pod's UID and the resourceVersion it saw, so a pod bound
//! (or re-annotated) since is left alone.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::time::Instant;

use crate::k8s::leader::Leadership;
use crate::scheduler::Scheduler;
use gpuplace_core::annotations::ANNOTATION_ASSIGNMENT;

/// How often candidates are looked at.
const TICK: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq)]
struct Candidate {
    namespace: String,
    name: String,
    text: String,
    resource_version: String,
    /// When this annotation text was first seen on the unbound pod.
    since: Instant,
}

/// The unbound pods that carry an assignment, by UID, as the pod watcher last saw them.
#[derive(Debug, Default)]
pub struct UnboundAssignments {
    candidates: Mutex<HashMap<String, Candidate>>,
}

impl UnboundAssignments {
    fn candidates(&self) -> std::sync::MutexGuard<'_, HashMap<String, Candidate>> {
        // a panic elsewhere while holding it leaves a map that is still right to read
        self.candidates.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pod added or changed: a candidate while it is unbound and carries an assignment (since
    /// when its text was first seen so), else not.
    pub fn observe(&self, pod: &Pod) {
        self.observe_at(pod, Instant::now());
    }

    fn observe_at(&self, pod: &Pod, now: Instant) {
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        let unbound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_none_or(str::is_empty);
        let text = pod.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ASSIGNMENT));
        let mut candidates = self.candidates();
        let Some(text) = text.filter(|_| unbound) else {
            if !candidates.is_empty() {
                candidates.remove(uid);
            }
            return;
        };
        let since = candidates.get(uid).filter(|c| c.text == *text).map_or(now, |c| c.since);
        let candidate = Candidate {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            text: text.clone(),
            resource_version: pod.metadata.resource_version.clone().unwrap_or_default(),
            since,
        };
        candidates.insert(uid.to_string(), candidate);
    }

    /// The pod `uid` is gone.
    pub fn forget(&self, uid: &str) {
        self.candidates().remove(uid);
    }

    /// After a re-list: pods it did not show (by UID) are gone.
    pub fn retain(&self, listed: &HashSet<String>) {
        self.candidates().retain(|uid, _| listed.contains(uid));
    }

    /// The candidates unbound with the same text for `grace` or longer at `now`, taken out.
    fn take_due(&self, grace: Duration, now: Instant) -> Vec<(String, Candidate)> {
        let mut candidates = self.candidates();
        let due: Vec<String> =
            candidates.iter().filter(|(_, c)| now.duration_since(c.since) >= grace).map(|(u, _)| u.clone()).collect();
        due.into_iter().filter_map(|u| candidates.remove(&u).map(|c| (u, c))).collect()
    }

    #[cfg(test)]
    fn uids(&self) -> Vec<String> {
        let mut uids: Vec<String> = self.candidates().keys().cloned().collect();
        uids.sort();
        uids
    }
}

/// Runs until aborted. `grace`: how long an assignment may sit on an unbound pod.
pub async fn run(
    client: Client,
    ext: Arc<Scheduler>,
    leadership: Arc<Leadership>,
    unbound: Arc<UnboundAssignments>,
    grace: Duration,
) {
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        if leadership.is_leader() {
            sweep(&client, &ext, &unbound, grace).await;
        }
    }
}

async fn sweep(client: &Client, ext: &Scheduler, unbound: &UnboundAssignments, grace: Duration) {
    let due = unbound.take_due(grace, Instant::now());
    if due.is_empty() {
        return;
    }
    let ours = ext.bound_pods();
    let key = ANNOTATION_ASSIGNMENT.replace('~', "~0").replace('/', "~1");
    for (uid, c) in due {
        // a bind of ours in flight: its own annotation, not stale
        if ours.contains_key(&uid) {
            continue;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(uid: &str, node: Option<&str>, assignment: Option<&str>, rv: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("p-{uid}")),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                resource_version: Some(rv.into()),
                annotations: assignment.map(|a| [(ANNOTATION_ASSIGNMENT.to_string(), a.to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec { node_name: node.map(str::to_string), ..PodSpec::default() }),
            status: None,
        }
    }

    #[test]
    fn only_unbound_pods_with_an_assignment_are_candidates_and_their_age_follows_the_text() {
        let u = UnboundAssignments::default();
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        u.observe_at(&pod("a", None, Some("x"), "1"), t0);
        u.observe_at(&pod("b", Some("n1"), Some("x"), "1"), t0);
        u.observe_at(&pod("c", None, None, "1"), t0);
        u.observe_at(&pod("d", Some(""), Some("x"), "1"), t0);
        let mut no_uid = pod("e", None, Some("x"), "1");
        no_uid.metadata.uid = None;
        u.observe_at(&no_uid, t0);
        assert_eq!(u.uids(), ["a", "d"], "unbound (no nodeName, or an empty one) with an assignment");

        // same text, new resourceVersion: as old as before; new text: young again
        u.observe_at(&pod("a", None, Some("x"), "2"), later);
        u.observe_at(&pod("d", None, Some("y"), "2"), later);
        let due = u.take_due(Duration::from_secs(10), later);
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].0.as_str(), due[0].1.resource_version.as_str(), due[0].1.name.as_str()), ("a", "2", "p-a"));
        assert_eq!(u.uids(), ["d"], "what is due is taken out");
        assert!(u.take_due(Duration::from_secs(10), later).is_empty());
        assert_eq!(u.take_due(Duration::from_secs(10), later + Duration::from_secs(10)).len(), 1);

        // bound since, or its assignment removed: no longer a candidate
        u.observe_at(&pod("a", None, Some("x"), "3"), later);
        u.observe_at(&pod("a", Some("n1"), Some("x"), "4"), later);
        u.observe_at(&pod("d", None, Some("y"), "3"), later);
        u.observe_at(&pod("d", None, None, "4"), later);
        assert!(u.uids().is_empty());

        u.observe(&pod("f", None, Some("x"), "1"));
        u.observe(&pod("g", None, Some("x"), "1"));
        u.forget("f");
        assert_eq!(u.uids(), ["g"]);
        u.retain(&HashSet::from(["h".to_string()]));
        assert!(u.uids().is_empty(), "a re-list that does not show it: gone");
    }
}
