//! The Pod watcher: every pod (resources cannot be selected server-side; pods that neither ask for
//! gpuplace resources nor carry an assignment are dropped cheaply) goes to
//! [`Scheduler::observe_pod`], deletions to [`Scheduler::release_pod`].
//!
//! Start-up: the first complete list is held back until the node watcher has listed too, then the
//! whole set rebuilds every allocation at once ([`Scheduler::restore`]) and readiness may turn on. A
//! later re-list (after a watch broke and its history expired) releases the pods it no longer shows
//! ([`Scheduler::retain_pods`]). Assignments that are not trusted are raised as Events on their pod.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::k8s::keys::KeyStatus;
use crate::k8s::watch::next_event;
use crate::scheduler::metrics::Watched;
use crate::scheduler::service::observe::{ObservedPod, PodOutcome};
use crate::scheduler::service::RestoredPod;
use crate::scheduler::Scheduler;
use gpuplace_core::api_client::events::{EventSink, REASON_ASSIGNMENT};
use gpuplace_core::clock::now_unix_ms;

/// A DRA node's host is gpuplace's to check: the pod's requests, read only with the DRA front end
/// on; a bound pod with claims is its group's member on its node. `observed`: the pod as already
/// read, whose request is not parsed again.
fn observe_host_use(ext: &Scheduler, pod: &Pod, observed: Option<&ObservedPod>) {
    use crate::scheduler::input::PodView;
    if !ext.dra_enabled() {
        return;
    }
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let use_ = crate::k8s::dra::host_use(pod);
    if let Some((node, _, _)) = use_ {
        let claims = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref()).is_some_and(|c| !c.is_empty());
        if claims {
            let request = match observed {
                Some(p) => p.request.clone(),
                None => PodView::request(pod),
            };
            if let Ok(req) = request {
                ext.observe_claim_member(uid, &PodView::key(pod), &req, node);
            }
        }
    }
    ext.observe_host_use(uid, use_);
}

/// Applies one added or changed pod, raising an Event when its assignment is refused.
pub fn apply(ext: &Scheduler, pod: &Pod, events: Option<&EventSink>) -> PodOutcome {
    let p = ObservedPod::of(pod);
    observe_host_use(ext, pod, Some(&p));
    let outcome = ext.observe_pod(&p);
    if let (PodOutcome::Refused(why), Some(ev)) = (&outcome, events) {
        ev.warn(pod.object_ref(&()), REASON_ASSIGNMENT, "CountAssignment", why);
    }
    outcome
}

/// Rebuilds every allocation from one complete list of pods: bound, unfinished pods with an
/// assignment and a readable request go to [`Scheduler::restore`] together; the rest (unbound,
/// unreadable request) are judged one by one afterwards ([`Scheduler::refuse_unbound`]). Returns the number of pods refused.
pub fn rebuild(ext: &Scheduler, pods: &[Pod], events: Option<&EventSink>) -> usize {
    let mut restored = Vec::new();
    let mut observed_restored = Vec::new();
    let mut refs: HashMap<String, ObjectReference> = HashMap::new();
    let mut later = Vec::new();
    for pod in pods {
        let p = ObservedPod::of(pod);
        if p.finished || p.is_foreign() {
            continue;
        }
        match (&p.node, &p.annotation, &p.request) {
            (Some(node), Some(annotation), Ok(request)) => {
                refs.insert(p.key.clone(), pod.object_ref(&()));
                restored.push(RestoredPod {
                    uid: p.uid.clone(),
                    request: request.clone(),
                    node: node.clone(),
                    annotation: annotation.clone(),
                });
                observed_restored.push(p);
            }
            _ => later.push(pod),
        }
    }
    let counted = restored.len();
    let conflicts = ext.restore(restored);
    // the records restored await their admission until their device-plugin markers say otherwise
    for p in &observed_restored {
        ext.observe_pod(p);
    }
    let mut refused = conflicts.len();
    for c in &conflicts {
        if let (Some(ev), Some(r)) = (events, refs.get(&c.pod)) {
            ev.warn(r.clone(), REASON_ASSIGNMENT, "RebuildAssignments", &c.reason);
        }
    }
    for pod in later {
        let p = ObservedPod::of(pod);
        if let PodOutcome::Refused(why) = ext.refuse_unbound(&p) {
            refused += 1;
            if let Some(ev) = events {
                ev.warn(pod.object_ref(&()), REASON_ASSIGNMENT, "RebuildAssignments", &why);
            }
        }
    }
    tracing::info!(
        pods = pods.len(),
        counted = counted - conflicts.len(),
        refused,
        "allocations rebuilt from pod assignments"
    );
    refused
}

/// Watches every pod until the stream ends, which it does not: errors are retried with backoff.
/// The first complete list waits for `nodes_synced` and for the key ring (`keys`: every assignment
/// is verified with it), is rebuilt from, and then `rebuilt` is called.
pub async fn watch_pods(
    api: Api<Pod>,
    ext: Arc<Scheduler>,
    events: Option<EventSink>,
    mut nodes_synced: watch::Receiver<bool>,
    mut keys: watch::Receiver<KeyStatus>,
    rebuilt: impl Fn(),
) {
    let mut stream = watcher::watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
    let mut initial = true;
    let mut buffer: Vec<Pod> = Vec::new();
    let mut listed: HashSet<String> = HashSet::new();
    let mut since = Instant::now();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::Pods).await {
        match ev {
            Event::Init => {
                // the list starts after this: a bind confirmed from now on may be missing from it
                since = Instant::now();
                buffer.clear();
                listed.clear();
            }
            Event::InitApply(p) if initial => buffer.push(p),
            Event::InitApply(p) => {
                if let Some(uid) = &p.metadata.uid {
                    listed.insert(uid.clone());
                }
                apply(&ext, &p, events.as_ref());
            }
            Event::InitDone if initial => {
                // the node cache must be complete first, or bound pods would name unknown nodes
                if nodes_synced.wait_for(|&s| s).await.is_err() {
                    tracing::error!("node watcher ended before listing; pods not rebuilt");
                    return;
                }
                // before the shared ring is in, genuine assignments would not verify
                if keys.wait_for(KeyStatus::is_loaded).await.is_err() {
                    tracing::error!("key watcher ended before loading the key ring; pods not rebuilt");
                    return;
                }
                rebuild(&ext, &buffer, events.as_ref());
                for p in &buffer {
                    observe_host_use(&ext, p, None);
                }
                buffer = Vec::new();
                initial = false;
                ext.metrics().watch_fresh(Watched::Pods, now_unix_ms());
                rebuilt();
            }
            Event::InitDone => {
                ext.retain_pods(&listed, since.into_std());
                ext.retain_host_uses(&listed);
            }
            Event::Apply(p) => {
                apply(&ext, &p, events.as_ref());
            }
            Event::Delete(p) => {
                if let Some(uid) = &p.metadata.uid {
                    ext.release_pod(uid);
                    // a pod deleted before it was bound: the host requests its placement held go too
                    ext.release_held(&[gpuplace_core::dra::claims::host_key(uid)]);
                    ext.observe_host_use(uid, None);
                }
            }
        }
    }
}
