//! The Pod watcher: every pod (resources cannot be selected server-side; pods that neither ask for
//! gpuplace resources nor carry an assignment are dropped cheaply) goes to
//! [`Scheduler::observe_pod`], deletions to [`Scheduler::release_pod`].
//!
//! Pods are decoded without the fields gpuplace never reads ([`WatchedPod`]).
//!
//! Start-up: the first complete list is held back until the node watcher has listed too, then the
//! whole set rebuilds every allocation at once ([`Scheduler::restore`]) and readiness may turn on. A
//! later re-list (after a watch broke and its history expired) releases the pods it no longer shows
//! ([`Scheduler::retain_pods`]). Assignments that are not trusted are raised as Events on their pod.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::k8s::keys::KeyStatus;
use crate::k8s::stale::UnboundAssignments;
use crate::k8s::watch::next_event;
use crate::k8s::watched_pod::WatchedPod;
use crate::scheduler::books::KeptRecords;
use crate::scheduler::metrics::Watched;
use crate::scheduler::service::books::tampered_note;
use crate::scheduler::service::observe::{ObservedPod, PodOutcome};
use crate::scheduler::service::RestoredPod;
use crate::scheduler::Scheduler;
use gpuplace_core::api_client::events::{EventSink, REASON_ASSIGNMENT, REASON_TAMPERED};
use gpuplace_core::clock::now_unix_ms;
use gpuplace_core::resources::PodRequest;

/// What the DRA front end reads of a pod (its host use, and whether it holds claims), taken as the
/// pod arrives; `None` without the DRA front end.
#[derive(Debug)]
struct HostUse {
    /// Its node and host requests (CPU millicores, MiB), when bound and unfinished.
    use_: Option<(String, u64, u64)>,
    claims: bool,
}

impl HostUse {
    fn of(ext: &Scheduler, pod: &Pod) -> Option<HostUse> {
        if !ext.dra_enabled() {
            return None;
        }
        let use_ = crate::k8s::dra::host_use(pod).map(|(n, c, m)| (n.to_string(), c, m));
        let claims = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref()).is_some_and(|c| !c.is_empty());
        Some(HostUse { use_, claims })
    }

    /// A DRA node's host is gpuplace's to check: the pod's host use counted; a bound pod with
    /// claims is its group's member on its node.
    fn observe(&self, ext: &Scheduler, pod: &ObservedPod) {
        if let (Some((node, _, _)), true, Ok(req)) = (&self.use_, self.claims, &pod.request) {
            ext.observe_claim_member(&pod.uid, &pod.key, req, node);
        }
        ext.observe_host_use(&pod.uid, self.use_.as_ref().map(|(n, c, m)| (n.as_str(), *c, *m)));
    }
}

/// A pod of the first list as gpuplace reads it: a decoded Pod is tens of KiB, and a large
/// cluster's first list held whole made a restart's peak memory (issue 33); pods with nothing for
/// gpuplace are not kept at all.
#[derive(Debug)]
pub struct Listed {
    pod: ObservedPod,
    /// For the Event that refuses its assignment: only for a pod that may hold one.
    reference: Option<ObjectReference>,
    host: Option<HostUse>,
}

impl Listed {
    /// `None` when the pod is nothing to gpuplace: finished or foreign, and no DRA host use to count.
    fn of(ext: &Scheduler, pod: &Pod) -> Option<Listed> {
        let observed = ObservedPod::of(pod);
        let host = HostUse::of(ext, pod);
        let counted = !(observed.finished || observed.is_foreign());
        (counted || host.is_some()).then(|| Listed {
            reference: counted.then(|| pod.object_ref(&())),
            pod: observed,
            host,
        })
    }
}

/// Applies one added or changed pod, raising an Event when its assignment is refused.
pub fn apply(ext: &Scheduler, pod: &Pod, events: Option<&EventSink>) -> PodOutcome {
    let p = ObservedPod::of(pod);
    if let Some(host) = HostUse::of(ext, pod) {
        host.observe(ext, &p);
    }
    let outcome = ext.observe_pod(&p);
    match (&outcome, events) {
        (PodOutcome::Refused(why), Some(ev)) => ev.warn(pod.object_ref(&()), REASON_ASSIGNMENT, "CountAssignment", why),
        (PodOutcome::Tampered(why), Some(ev)) => ev.warn(pod.object_ref(&()), REASON_TAMPERED, "CountAssignment", why),
        _ => {}
    }
    outcome
}

/// The record a rebuild counts for a bound pod: its annotation while gpuplace trusts it, else the
/// books' record of it on that node (then `true`: the annotation was erased or rewritten).
fn record_of(
    ext: &Scheduler,
    p: &ObservedPod,
    node: &str,
    request: &PodRequest,
    kept: &KeptRecords,
) -> Option<(String, bool)> {
    let book = kept.get(&p.uid, node).map(|e| e.assignment.as_str());
    match (p.annotation.as_deref(), book) {
        (Some(text), Some(b)) if text != b && !ext.assignment_trusted(text, &p.uid, node, request) => {
            Some((b.to_string(), true))
        }
        (Some(text), _) => Some((text.to_string(), false)),
        (None, Some(b)) => Some((b.to_string(), true)),
        (None, None) => None,
    }
}

/// Rebuilds every allocation from one complete list of pods (`listed` of them in all, the ones kept
/// in `pods`): bound, unfinished pods with an assignment and a readable request go to
/// [`Scheduler::restore`] together; the rest (unbound, unreadable request) are judged one by one
/// afterwards ([`Scheduler::refuse_unbound`]); then the DRA host uses. Returns the number of pods
/// refused.
pub fn rebuild(
    ext: &Scheduler,
    pods: &[Listed],
    listed: usize,
    kept: &KeptRecords,
    events: Option<&EventSink>,
) -> usize {
    let mut restored = Vec::new();
    let mut observed_restored = Vec::new();
    let mut from_books = Vec::new();
    let mut later = Vec::new();
    for l in pods.iter().filter(|l| l.reference.is_some()) {
        let p = &l.pod;
        let record = match (&p.node, &p.request) {
            (Some(node), Ok(request)) => record_of(ext, p, node, request, kept).map(|r| (node, request, r)),
            _ => None,
        };
        let Some((node, request, (annotation, tampered))) = record else {
            later.push(l);
            continue;
        };
        if tampered {
            from_books.push((l, if p.annotation.is_some() { "rewritten" } else { "removed" }, node));
        }
        restored.push(RestoredPod { uid: p.uid.clone(), request: request.clone(), node: node.clone(), annotation });
        observed_restored.push(l);
    }
    let counted = restored.len();
    let conflicts = ext.restore(restored);
    // counted from the books: reported, and the leader writes the record back on the pod
    for (l, how, node) in &from_books {
        if ext.note_tampered(&l.pod.uid, l.pod.annotation.as_deref()) {
            tracing::warn!(pod = %l.pod.key, node = %node, how, "assignment annotation {how} after bind; counted from gpuplace's books");
            if let (Some(ev), Some(r)) = (events, &l.reference) {
                ev.warn(r.clone(), REASON_TAMPERED, "RebuildAssignments", &tampered_note(how, node));
            }
        }
    }
    // the records restored await their admission until their device-plugin markers say otherwise
    for l in &observed_restored {
        ext.observe_pod(&l.pod);
    }
    let mut refused = conflicts.len();
    if let Some(ev) = events {
        let refs: HashMap<&str, &ObjectReference> =
            observed_restored.iter().filter_map(|l| Some((l.pod.key.as_str(), l.reference.as_ref()?))).collect();
        for c in &conflicts {
            if let Some(r) = refs.get(c.pod.as_str()) {
                ev.warn((*r).clone(), REASON_ASSIGNMENT, "RebuildAssignments", &c.reason);
            }
        }
    }
    for l in later {
        if let PodOutcome::Refused(why) = ext.refuse_unbound(&l.pod) {
            refused += 1;
            if let (Some(ev), Some(r)) = (events, &l.reference) {
                ev.warn(r.clone(), REASON_ASSIGNMENT, "RebuildAssignments", &why);
            }
        }
    }
    for l in pods {
        if let Some(host) = &l.host {
            host.observe(ext, &l.pod);
        }
    }
    tracing::info!(
        pods = listed,
        counted = counted - conflicts.len(),
        from_books = from_books.len(),
        refused,
        "allocations rebuilt from pod assignments"
    );
    refused
}

/// What the first rebuild waits for: the node cache complete (`nodes_synced`), the key ring loaded
/// (`keys`: every assignment is verified with it), and gpuplace's books listed (`books`, when kept:
/// `k8s::books`).
#[derive(Debug)]
pub struct RebuildWaits {
    pub nodes_synced: watch::Receiver<bool>,
    pub keys: watch::Receiver<KeyStatus>,
    pub books: Option<Api<ConfigMap>>,
}

/// Watches every pod until the stream ends, which it does not: errors are retried with backoff.
/// The first complete list waits for what `waits` names, is rebuilt from, and then `rebuilt` is
/// called. Every pod also goes to `unbound`, which tracks the assignments left on unbound pods
/// (`stale`).
pub async fn watch_pods(
    api: Api<WatchedPod>,
    ext: Arc<Scheduler>,
    unbound: Arc<UnboundAssignments>,
    events: Option<EventSink>,
    waits: RebuildWaits,
    rebuilt: impl Fn(),
) {
    let RebuildWaits { mut nodes_synced, mut keys, books } = waits;
    let mut stream = watcher::watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
    let mut initial = true;
    // the first list, as gpuplace reads it (not whole Pods), and how many pods it had
    let mut buffer: Vec<Listed> = Vec::new();
    let mut listed_total = 0;
    let mut listed: HashSet<String> = HashSet::new();
    let mut since = Instant::now();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::Pods).await {
        match ev {
            Event::Init => {
                // the list starts after this: a bind confirmed from now on may be missing from it
                since = Instant::now();
                buffer.clear();
                listed.clear();
                listed_total = 0;
            }
            Event::InitApply(WatchedPod(p)) if initial => {
                listed_total += 1;
                unbound.observe(&p);
                buffer.extend(Listed::of(&ext, &p));
            }
            Event::InitApply(WatchedPod(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    listed.insert(uid.clone());
                }
                unbound.observe(&p);
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
                let kept = match &books {
                    Some(api) => crate::k8s::books::load(api).await,
                    None => KeptRecords::default(),
                };
                rebuild(&ext, &buffer, listed_total, &kept, events.as_ref());
                buffer = Vec::new();
                initial = false;
                ext.metrics().watch_fresh(Watched::Pods, now_unix_ms());
                rebuilt();
            }
            Event::InitDone => {
                unbound.retain(&listed);
                ext.retain_pods(&listed, since.into_std());
                ext.retain_host_uses(&listed);
            }
            Event::Apply(WatchedPod(p)) => {
                unbound.observe(&p);
                apply(&ext, &p, events.as_ref());
            }
            Event::Delete(WatchedPod(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    unbound.forget(uid);
                    ext.release_pod(uid);
                    // a pod deleted before it was bound: the host requests its placement held go too
                    ext.release_held(&[gpuplace_core::dra::claims::host_key(uid)]);
                    ext.observe_host_use(uid, None);
                }
            }
        }
    }
}
