//! [`KubeAssignments`]: the [`AssignmentSource`] over this node's pods.
//!
//! - A watcher (`spec.nodeName=<node>`) feeds a reflector cache, so `Allocate` does not LIST on every
//!   call; [`refresh`](AssignmentSource::refresh) LISTs afresh (the plugin calls it when the cache has
//!   no match: kubelet admits a pod moments after it is bound), and so does `pending` until the cache
//!   has synced once.
//! - Each pod's `gpuplace.io/assignment` must carry the extender's signature, verified with the
//!   public keys ([`super::keys`]; a key not loaded yet makes one reload first), and is then
//!   validated with the core schema against the pod's own request, the node it is bound to and this
//!   node's GPUs. A pod whose annotation is unsigned, forged or edited, unparseable, written for
//!   another pod or node, or does not match its request, or that names a GPU another pod holds
//!   exclusively ([`crate::exclusive`]), is skipped with one warning and one `AssignmentSkipped`
//!   Event per problem ([`super::events`]): never matched, never a crash.
//! - `gpuplace.io/allocated` lists the containers already given their GPUs; a fully allocated pod is
//!   not pending. [`mark_allocated`](AssignmentSource::mark_allocated) merge-patches it with the pod's
//!   UID as precondition (a re-created pod of the same name is not marked), and
//!   [`correct_allocated`](AssignmentSource::correct_allocated) rewrites it after pod-resources showed
//!   who holds the devices. Because the cache lags its own writes, the source remembers each marker
//!   it wrote and takes that over any view; for pods it has not written to, it counts every
//!   container a view showed marked. A marker that cannot be parsed makes the pod skipped (it may be
//!   allocated already); a marker written for another UID is ignored.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuplace_core::admission::admission_order;
use gpuplace_core::annotations::SignatureProblem;
use gpuplace_core::annotations::{
    AllocatedAnnotation, AnnotationError, AssignmentAnnotation, ANNOTATION_ALLOCATED, ANNOTATION_ASSIGNMENT,
};
use gpuplace_core::cluster::Node;
use gpuplace_core::resources::{pod_request, ContainerResources, PodSpecView, RequestError};
use gpuplace_core::signing::PublicKeys;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;

use super::events::PluginEvents;
use super::keys::AssignmentKeys;
use super::{call, CALL_TIMEOUT};
use crate::assign::{AssignmentSource, PendingPod, PodKey, SourceError};
use crate::exclusive::{conflicts, Conflict};
use crate::sampler::Telemetry;

/// How long a remembered marker outlives its pod's disappearance from the cache (the cache may not
/// have seen a pod that a fresh LIST found).
const FORGET_AFTER: Duration = Duration::from_secs(600);
/// Distinct problems logged before the record is cleared (bounds memory under a flood of bad pods).
const MAX_WARNED: usize = 4096;

/// Why a pod on this node is not a candidate for `Allocate`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodProblem {
    #[error("no UID")]
    NoUid,
    #[error("bound to {bound:?}, not this node {node:?}")]
    OtherNode { bound: String, node: String },
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    #[error("its GPU request: {0}")]
    Request(#[from] RequestError),
    #[error(transparent)]
    Conflict(#[from] Conflict),
}

impl PodProblem {
    /// A signature by a key this plugin has not loaded (yet): worth one reload of the keys.
    pub(crate) fn unknown_key(&self) -> bool {
        matches!(self, PodProblem::Annotation(AnnotationError::NotSigned(SignatureProblem::UnknownKey(_))))
    }
}

fn resources(c: &Container) -> ContainerResources {
    let text = |m: Option<
        &std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { m.map(|m| m.iter().map(|(k, q)| (k.clone(), q.0.clone())).collect()).unwrap_or_default() };
    let r = c.resources.as_ref();
    ContainerResources {
        name: c.name.clone(),
        requests: text(r.and_then(|r| r.requests.as_ref())),
        limits: text(r.and_then(|r| r.limits.as_ref())),
    }
}

/// The parts of a pod the resource contract reads.
pub fn spec_view(pod: &Pod) -> PodSpecView {
    let spec = pod.spec.as_ref();
    PodSpecView {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        labels: pod.labels().clone(),
        annotations: pod.annotations().clone(),
        containers: spec.map(|s| s.containers.iter().map(resources).collect()).unwrap_or_default(),
        init_containers: spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|v| v.iter().map(resources).collect())
            .unwrap_or_default(),
        pod_group: spec.and_then(|s| s.scheduling_group.as_ref()).and_then(|g| g.pod_group_name.clone()),
    }
}

/// A pod as a candidate: `Ok(None)` when it is not a gpuplace pod awaiting devices (no assignment,
/// finished, being deleted); `Err` when it carries an assignment that must not be trusted (not
/// signed by one of `keys`, or not valid for this pod and node). The allocated set is the pod's own
/// marker only (the caller adds what it remembers).
pub fn pending_pod(
    pod: &Pod,
    node_name: &str,
    node: &Node,
    keys: &PublicKeys,
) -> Result<Option<PendingPod>, PodProblem> {
    let Some(text) = pod.annotations().get(ANNOTATION_ASSIGNMENT) else { return Ok(None) };
    let finished =
        pod.status.as_ref().and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed");
    if finished || pod.metadata.deletion_timestamp.is_some() {
        return Ok(None);
    }
    let uid = pod.uid().ok_or(PodProblem::NoUid)?;
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    if bound != node_name {
        return Err(PodProblem::OtherNode { bound, node: node_name.to_string() });
    }
    let annotation = AssignmentAnnotation::parse(text)?;
    annotation.verify(keys)?;
    let request = pod_request(&spec_view(pod))?;
    let assignment = annotation.validate(&uid, &bound, &request, node)?;
    let (allocated, unconfirmed) = match pod.annotations().get(ANNOTATION_ALLOCATED) {
        None => Default::default(),
        Some(t) => {
            let marker = AllocatedAnnotation::parse(t)?;
            if marker.pod_uid == uid {
                (marker.containers, marker.unconfirmed)
            } else {
                // copied from another pod (a re-applied manifest): says nothing about this one
                tracing::debug!(pod = %assignment.pod, marker_uid = %marker.pod_uid, "ignoring another pod's allocated marker");
                Default::default()
            }
        }
    };
    Ok(Some(PendingPod {
        key: PodKey { pod: assignment.pod.clone(), uid },
        bind_seq: annotation.bind_seq,
        assignment,
        allocated,
        unconfirmed,
    }))
}

/// Containers known to be allocated, per pod UID.
#[derive(Debug)]
struct Known {
    containers: BTreeSet<String>,
    /// Those of `containers` not confirmed by pod-resources yet.
    unconfirmed: BTreeSet<String>,
    /// This source wrote the pod's marker: it is the newest, whatever a (lagging) view shows.
    written: bool,
    /// Last seen in a view or marked.
    touched: Instant,
}

impl Known {
    fn new() -> Self {
        Self { containers: BTreeSet::new(), unconfirmed: BTreeSet::new(), written: false, touched: Instant::now() }
    }

    /// What a view shows of a pod whose marker this source has not written: only ever more.
    fn merge(&mut self, p: &PendingPod) {
        if !self.written {
            self.containers.extend(p.allocated.iter().cloned());
            self.unconfirmed.extend(p.unconfirmed.iter().cloned());
        }
        self.touched = Instant::now();
    }
}

/// See the module docs.
pub struct KubeAssignments {
    client: Client,
    node_name: String,
    node: Node,
    store: Store<Pod>,
    keys: Arc<AssignmentKeys>,
    telemetry: Arc<Telemetry>,
    known: Mutex<HashMap<String, Known>>,
    warned: Mutex<HashSet<String>>,
    /// `namespace/name: why` of each pod the last full view left out.
    skipped: Mutex<Vec<String>>,
    events: PluginEvents,
    /// Per API call: Allocate waits on it.
    timeout: Duration,
    watch: JoinHandle<()>,
    /// When the guard last asked for the keys to be read again ([`Self::reload_keys_soon`]).
    key_reload_asked: Mutex<Option<Instant>>,
}

impl Drop for KubeAssignments {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // plain bookkeeping: a panic elsewhere leaves it usable
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KubeAssignments {
    /// Starts watching this node's pods. `node` is this node as the cluster model sees it (its GPUs
    /// by UUID and index), what assignments are validated against; `keys`, what their signatures are
    /// verified with. Needs a tokio runtime.
    pub fn start(
        client: Client,
        node_name: &str,
        node: Node,
        keys: Arc<AssignmentKeys>,
        telemetry: Arc<Telemetry>,
    ) -> Arc<Self> {
        Self::start_with_timeout(client, node_name, node, keys, telemetry, CALL_TIMEOUT)
    }

    /// [`start`](Self::start) with another limit per API call (tests of outages).
    pub fn start_with_timeout(
        client: Client,
        node_name: &str,
        node: Node,
        keys: Arc<AssignmentKeys>,
        telemetry: Arc<Telemetry>,
        timeout: Duration,
    ) -> Arc<Self> {
        let (store, watch) = super::pods::watch_node_pods(client.clone(), node_name, telemetry.clone());
        Arc::new(Self {
            node_name: node_name.to_string(),
            node,
            store,
            keys,
            telemetry,
            known: Mutex::new(HashMap::new()),
            warned: Mutex::new(HashSet::new()),
            skipped: Mutex::new(Vec::new()),
            events: PluginEvents::new(client.clone(), node_name),
            client,
            timeout,
            watch,
            key_reload_asked: Mutex::new(None),
        })
    }

    /// This node's pods from the watch's cache: the one with that UID, or all.
    pub(crate) fn cached_pods(&self, uid: Option<&str>) -> Vec<Arc<Pod>> {
        let mut pods = self.store.state();
        if let Some(uid) = uid {
            pods.retain(|p| p.metadata.uid.as_deref() == Some(uid));
        }
        pods
    }

    /// The pod's assignment if it can be trusted (signed, valid for this pod and node); `Ok(None)`
    /// when it has none or is finished.
    pub(crate) fn trusted(&self, pod: &Pod) -> Result<Option<PendingPod>, PodProblem> {
        pending_pod(pod, &self.node_name, &self.node, &self.keys.current())
    }

    /// Reads the keys again in the background, at most every 5 s: the guard found an assignment
    /// signed by a key not loaded (it cannot wait on the API server the way Allocate does). Needs a
    /// tokio runtime.
    pub(crate) fn reload_keys_soon(&self) {
        let mut asked = lock(&self.key_reload_asked);
        if asked.is_some_and(|t| t.elapsed() < Duration::from_secs(5)) {
            return;
        }
        *asked = Some(Instant::now());
        let keys = self.keys.clone();
        tokio::spawn(async move {
            keys.reload().await;
        });
    }

    fn synced(&self) -> bool {
        use futures::FutureExt;
        matches!(self.store.wait_until_ready().now_or_never(), Some(Ok(())))
    }

    async fn list(&self) -> Result<Vec<Pod>, SourceError> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node_name));
        match call("pods_list", self.timeout, api.list(&params)).await {
            Ok(list) => Ok(list.items),
            Err(e) => {
                self.telemetry.api_error("pods_list");
                Err(SourceError::Unavailable(format!("listing the pods of node {}: {e}", self.node_name)))
            }
        }
    }

    /// Candidates from a view of the node's pods, with what this source remembers added: only those
    /// still waiting for a container's devices when `waiting_only`. Pods that cannot be trusted are
    /// warned about once each. A signature by a key not loaded makes the keys reload once first.
    async fn candidates(&self, pods: &[&Pod], waiting_only: bool) -> Vec<PendingPod> {
        let (mut out, mut problems) = self.evaluate(pods, waiting_only, &self.keys.current());
        if problems.iter().any(|(_, p)| p.unknown_key()) && self.keys.reload().await {
            (out, problems) = self.evaluate(pods, waiting_only, &self.keys.current());
        }
        if waiting_only {
            *lock(&self.skipped) = problems
                .iter()
                .map(|(pod, problem)| format!("{}/{}: {problem}", pod.namespace().unwrap_or_default(), pod.name_any()))
                .collect();
        }
        for (pod, problem) in problems {
            self.warn_once(pod, &problem);
        }
        out
    }

    /// [`candidates`](Self::candidates) with `keys`, returning the problems.
    fn evaluate<'a>(
        &self,
        pods: &[&'a Pod],
        waiting_only: bool,
        keys: &PublicKeys,
    ) -> (Vec<PendingPod>, Vec<(&'a Pod, PodProblem)>) {
        // the live pods and, in the same order, their objects
        let (mut live, mut objects) = (Vec::new(), Vec::new());
        let mut problems = Vec::new();
        let mut known = lock(&self.known);
        for &pod in pods {
            match pending_pod(pod, &self.node_name, &self.node, keys) {
                Ok(None) => {}
                Ok(Some(mut p)) => {
                    let k = known.entry(p.key.uid.clone()).or_insert_with(Known::new);
                    k.merge(&p);
                    (p.allocated, p.unconfirmed) = (k.containers.clone(), k.unconfirmed.clone());
                    live.push(p);
                    objects.push(pod);
                }
                Err(problem) => problems.push((pod, problem)),
            }
        }
        drop(known);
        // every live pod counts as a holder, waiting or not
        let refused = conflicts(&live);
        let mut out = Vec::new();
        for (pod, p) in objects.into_iter().zip(live) {
            if let Some(c) = refused.get(&p.key.uid) {
                problems.push((pod, PodProblem::Conflict(c.clone())));
                continue;
            }
            if waiting_only && admission_order(&p.assignment).all(|c| p.allocated.contains(&c.name)) {
                continue;
            }
            out.push(p);
        }
        (out, problems)
    }

    fn warn_once(&self, pod: &Pod, problem: &PodProblem) {
        let who = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let key = format!("{}|{problem}", pod.uid().unwrap_or_default());
        let mut warned = lock(&self.warned);
        if warned.len() >= MAX_WARNED {
            warned.clear();
        }
        if warned.insert(key) {
            tracing::warn!(pod = %who, problem = %problem, "skipping the pod's gpuplace assignment; it will not be matched");
            self.events.assignment_skipped(pod, &problem.to_string());
        }
    }

    /// Forgets markers of pods the cache no longer has, once they are old enough that a lagging
    /// cache cannot bring the pod back unmarked.
    fn forget_gone(&self) {
        let live: HashSet<String> = self.store.state().iter().filter_map(|p| p.uid()).collect();
        let now = Instant::now();
        lock(&self.known).retain(|uid, k| live.contains(uid) || now.duration_since(k.touched) < FORGET_AFTER);
    }
}

#[tonic::async_trait]
impl AssignmentSource for KubeAssignments {
    async fn pending(&self) -> Result<Vec<PendingPod>, SourceError> {
        if !self.synced() {
            return self.refresh().await;
        }
        self.forget_gone();
        let pods = self.store.state();
        let pods: Vec<&Pod> = pods.iter().map(|p| p.as_ref()).collect();
        Ok(self.candidates(&pods, true).await)
    }

    async fn refresh(&self) -> Result<Vec<PendingPod>, SourceError> {
        let pods = self.list().await?;
        let pods: Vec<&Pod> = pods.iter().collect();
        Ok(self.candidates(&pods, true).await)
    }

    async fn mark_allocated(&self, pod: &PodKey, container: &str, unconfirmed: bool) -> Result<(), SourceError> {
        let c = [container.to_string()];
        let none: [String; 0] = [];
        self.write_marker(pod, &c, if unconfirmed { &c[..] } else { &none[..] }, &none).await
    }

    async fn assigned(&self, pod: &str) -> Result<Option<PendingPod>, SourceError> {
        let (ns, name) = pod.split_once('/').unwrap_or(("", pod));
        let cached =
            self.store.state().into_iter().find(|p| p.namespace().as_deref() == Some(ns) && p.name_any() == name);
        let found = match cached {
            Some(p) => self.candidates(&[p.as_ref()], false).await,
            // the cache may lag: the pod kubelet admitted was bound a moment ago
            None => {
                let pods = self.list().await?;
                let p: Vec<&Pod> =
                    pods.iter().filter(|p| p.namespace().as_deref() == Some(ns) && p.name_any() == name).collect();
                self.candidates(&p, false).await
            }
        };
        Ok(found.into_iter().next())
    }

    async fn correct_allocated(&self, pod: &PodKey, confirm: &[String], unmark: &[String]) -> Result<(), SourceError> {
        self.write_marker(pod, confirm, &[], unmark).await.map(|_| ())
    }

    fn skipped(&self) -> Vec<String> {
        lock(&self.skipped).clone()
    }
}

impl KubeAssignments {
    /// Rewrites the pod's marker from what this source knows: `add` marked, `unconfirmed` of them
    /// unconfirmed (the others confirmed), `remove` unmarked.
    async fn write_marker(
        &self,
        pod: &PodKey,
        add: &[String],
        unconfirmed: &[String],
        remove: &[String],
    ) -> Result<(), SourceError> {
        let named: Vec<&str> = add.iter().chain(remove).map(String::as_str).collect();
        let fail = |message: String| SourceError::Mark { pod: pod.pod.clone(), container: named.join(","), message };
        let (ns, name) = pod.pod.split_once('/').ok_or_else(|| fail("not a namespace/name key".into()))?;
        let (mut containers, mut pending) =
            lock(&self.known).get(&pod.uid).map(|k| (k.containers.clone(), k.unconfirmed.clone())).unwrap_or_default();
        for c in add {
            containers.insert(c.clone());
            pending.remove(c);
        }
        pending.extend(unconfirmed.iter().cloned());
        for c in remove {
            containers.remove(c);
            pending.remove(c);
        }
        let marker = AllocatedAnnotation::new(&pod.uid, containers.iter().cloned()).with_unconfirmed(pending);
        // the UID makes it a precondition: a re-created pod of the same name gets a 409, not a marker
        let patch = json!({"metadata": {"uid": pod.uid, "annotations": {ANNOTATION_ALLOCATED: marker.to_json()}}});
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        if let Err(e) =
            call("pod_patch", self.timeout, api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))).await
        {
            self.telemetry.api_error("pod_patch");
            return Err(fail(e.to_string()));
        }
        let mut known = lock(&self.known);
        let k = known.entry(pod.uid.clone()).or_insert_with(Known::new);
        (k.containers, k.unconfirmed, k.written) = (marker.containers, marker.unconfirmed, true);
        k.touched = Instant::now();
        Ok(())
    }
}
