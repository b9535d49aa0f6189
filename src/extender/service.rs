//! The extender's decisions, without HTTP: each verb takes the request body and returns the answer
//! kube-scheduler reads (or the decoding error, which the HTTP layer sends as a 400).
//!
//! State is the cluster model (nodes, GPUs, who holds what) plus the records bind needs: pods by UID
//! that gpuplace bound, the per-node bind sequence, and the pods seen in filter requests (bind only
//! names the pod, so its GPU request comes from the filter that preceded it; the API-server watchers
//! will feed the same cache). Filter, prioritize and preempt take a read lock and change no
//! allocation; bind takes the write lock to re-check and count the allocation at once, releases it
//! while the [`Binder`] runs, and takes it again to confirm or roll back.
//!
//! Seams for API-server mode (`src/apiserver/`): the watchers call [`Extender::observe_node`],
//! [`Extender::remove_node`], [`Extender::observe_pod`], [`Extender::release_pod`],
//! [`Extender::retain_pods`], [`Extender::restore`] and [`Extender::set_ready`] (the decisions on
//! what to trust are in the `observe` submodule); the kube-rs binder implements [`Binder`].

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::core::annotations::{
    AnnotationError, AssignmentAnnotation, NodeInventory, UtilizationAnnotation, ANNOTATION_ASSIGNMENT,
    ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use crate::core::cluster::{Cluster, Node, PodAssignment};
use crate::core::resources::{PodRequest, RESOURCE_GPU};
use crate::extender::adapt::{NodeListMode, Verdict};
use crate::extender::binder::{BindRequest, Binder};
use crate::extender::metrics::{BindOutcome, ClusterSummary, ConflictKind, Metrics, RejectClass};
use crate::extender::placement_log::{
    Chosen, ChosenGpu, Decision, PlacementLog, Requests, TopScore, PLACEMENT_LOG_VERSION,
};
use crate::extender::wire::{
    decode, ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, HostPriorityList, MetaPod, MetaVictims, Pod, WireError, WireNode, MAX_EXTENDER_PRIORITY,
};
use crate::placement::engine::{Engine, Evaluation};
use crate::placement::feasibility::Infeasible;
use crate::placement::scorers::network::GroupView;

/// Every reason we give kube-scheduler starts with this, so a person reading the pod's events knows
/// which component turned the node down.
const REASON_PREFIX: &str = "gpuplace: ";

/// What filter and bind answer (in `Error`) while the state is not complete or this replica is not
/// the leader; prioritize and preempt, which have no error field, get HTTP 503.
pub const NOT_READY: &str = "gpuplace: not ready (state not rebuilt yet, or not the leader); retry";

/// How many pods from filter requests are remembered for bind. kube-scheduler binds a pod right
/// after filtering it, so this only needs to cover the pods in flight at once.
pub const DEFAULT_POD_CACHE: usize = 10_000;

/// Placement log lines name at most this many top nodes.
const TOP_NODES: usize = 5;

/// How many pods' filter evaluations are kept for the prioritize call that follows. kube-scheduler
/// prioritizes a pod right after filtering it, one pod at a time per profile; this covers many in
/// flight at once.
pub const DEFAULT_EVAL_CACHE: usize = 64;

/// Scores can depend on the clock (utilization samples age out), so a cached evaluation is reused
/// only this long after it was made: prioritize follows filter within milliseconds.
const EVAL_CACHE_MAX_AGE: Duration = Duration::from_secs(1);

/// In [`CachedEval::scores`]: a node the evaluation did not cover, and one it rejected.
const NOT_JUDGED: i8 = -1;
const REJECTED: i8 = -2;

pub fn now_unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// A pod as filter saw it: enough for bind to place it.
#[derive(Debug, Clone, PartialEq)]
pub struct SeenPod {
    /// `namespace/name`.
    pub key: String,
    pub uid: String,
    /// The request, or the contract's refusal.
    pub request: Result<PodRequest, String>,
}

/// A pod gpuplace bound (or restored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundPod {
    pub key: String,
    pub uid: String,
    pub node: String,
    pub bind_seq: u64,
    /// The assignment annotation written (none for a pod without GPU containers).
    pub annotation: Option<String>,
    /// False while the Binding is in flight.
    pub confirmed: bool,
}

/// A bounded map UID → pod, oldest forgotten first.
#[derive(Debug, Default)]
struct PodCache {
    by_uid: HashMap<String, SeenPod>,
    order: VecDeque<String>,
    cap: usize,
}

impl PodCache {
    fn insert(&mut self, pod: SeenPod) {
        if self.cap == 0 {
            return;
        }
        // a known UID keeps its place in the eviction order
        if self.by_uid.insert(pod.uid.clone(), pod.clone()).is_none() {
            self.order.push_back(pod.uid);
            while self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.by_uid.remove(&old);
                }
            }
        }
    }
}

struct State {
    cluster: Cluster,
    /// Bumped whenever the write lock is taken, i.e. whenever the cluster may change: a cached
    /// evaluation is valid only for the generation it was made at.
    generation: u64,
    /// UID → record, for pods gpuplace bound or restored.
    bound: HashMap<String, BoundPod>,
    /// `namespace/name` → UID of its record.
    uid_of: HashMap<String, String>,
    /// Last bind sequence used per node.
    last_seq: HashMap<String, u64>,
    /// Node → the inventory annotation and labels last seen on its Node object (full-Nodes mode),
    /// so an unchanged node is not parsed again.
    node_sources: HashMap<String, (String, BTreeMap<String, String>)>,
    util_sources: HashMap<String, String>,
    /// Allocations on nodes whose Node object was deleted, by node name: counted again if the node
    /// comes back, dropped when their pods go (see `observe::remove_node`).
    parked: HashMap<String, Vec<PodAssignment>>,
    /// UID → the assignment text last refused on that pod and the node it was bound to, so that a
    /// watch echo of an unchanged pod is not reported (logged, counted, raised as an Event) again.
    refused: HashMap<String, (String, Option<String>)>,
    /// UID → the assignment text of a bind that was rolled back: the watch may still show it on the
    /// unbound pod for a moment, which is not a forgery.
    withdrawn: HashMap<String, String>,
    /// UID → when this process's own bind of it was confirmed: a re-list that started before then
    /// may not show the pod yet, and must not release it (`observe::retain_pods`).
    bound_at: HashMap<String, Instant>,
}

/// Options of the service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    pub pod_cache: usize,
    /// Pods whose filter evaluation prioritize may reuse (0: none, prioritize evaluates again).
    pub eval_cache: usize,
    /// Answer as ready from the start (static mode: the cluster file is the whole truth).
    pub ready: bool,
}

impl Default for ServiceOptions {
    fn default() -> Self {
        Self { pod_cache: DEFAULT_POD_CACHE, eval_cache: DEFAULT_EVAL_CACHE, ready: true }
    }
}

/// A restored record that was refused.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreConflict {
    pub pod: String,
    pub reason: String,
}

/// A pod with an assignment annotation, as the watchers will hand it over after a restart.
#[derive(Debug, Clone)]
pub struct RestoredPod {
    pub uid: String,
    pub request: PodRequest,
    /// The node the pod is bound to (`spec.nodeName`).
    pub node: String,
    /// The `gpuplace.io/assignment` value.
    pub annotation: String,
}

/// The extender.
pub struct Extender {
    engine: Engine,
    state: RwLock<State>,
    /// Pods seen in filter requests, for bind. Its own lock: filter of a new pod would otherwise take
    /// the state's write lock, which also invalidates every cached evaluation.
    seen: Mutex<PodCache>,
    evals: Mutex<EvalCache>,
    binder: Arc<dyn Binder>,
    metrics: Metrics,
    log: Option<PlacementLog>,
    ready: AtomicBool,
}

impl std::fmt::Debug for Extender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extender").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

/// Filter's and prioritize's view of the candidates, by their position in the request.
struct Judged {
    /// Each candidate's node index (`None`: not a known GPU node).
    at: Vec<Option<usize>>,
    /// Per node index: the score (0..=10) where the pod fits, [`REJECTED`] or [`NOT_JUDGED`].
    scores: Vec<i8>,
    /// Why each rejected node (by index) was turned down (filter only).
    rejects: HashMap<usize, Verdict>,
    /// Why each unknown candidate (by name) was turned down (filter only).
    unknown: HashMap<String, Verdict>,
    /// Nodes turned down per class (each node once), in [`RejectClass::ALL`] order.
    class_counts: [u64; 4],
    evaluation: Evaluation,
}

impl Judged {
    /// The verdict on the candidate at `pos` (named `name`).
    fn verdict(&self, pos: usize, name: &str) -> Verdict {
        match self.at.get(pos).copied().flatten() {
            Some(i) if self.scores.get(i).is_some_and(|&s| s >= 0) => Verdict::Fits,
            // every evaluated node either fits or has a reason
            Some(i) => self.rejects.get(&i).cloned().unwrap_or(Verdict::Fits),
            None => self.unknown.get(name).cloned().unwrap_or(Verdict::Fits),
        }
    }
}

/// A pod's filter evaluation, reused by the prioritize call that follows it.
struct CachedEval {
    uid: String,
    request: PodRequest,
    generation: u64,
    made: Instant,
    /// Per node index: score, [`REJECTED`] or [`NOT_JUDGED`].
    scores: Vec<i8>,
    /// For the placement log (empty without one).
    top: Vec<TopScore>,
}

/// The last few pods' evaluations, oldest dropped first.
#[derive(Default)]
struct EvalCache {
    entries: VecDeque<CachedEval>,
    cap: usize,
    hits: u64,
    misses: u64,
}

impl EvalCache {
    fn insert(&mut self, e: CachedEval) {
        if self.cap == 0 {
            return;
        }
        self.entries.retain(|x| x.uid != e.uid);
        while self.entries.len() >= self.cap {
            self.entries.pop_front();
        }
        self.entries.push_back(e);
    }

    /// Per candidate position, the cached score, when an evaluation of exactly this pod (UID and
    /// request) at this generation, recent enough, covered every known candidate.
    fn scores(
        &mut self,
        uid: &str,
        req: &PodRequest,
        generation: u64,
        at: &[Option<usize>],
    ) -> Option<(Vec<i8>, Vec<TopScore>)> {
        let found = self.entries.iter().find(|e| {
            e.uid == uid && e.generation == generation && e.made.elapsed() <= EVAL_CACHE_MAX_AGE && e.request == *req
        });
        let out = found.and_then(|e| {
            let scores = at
                .iter()
                .map(|i| match i {
                    None => Some(REJECTED),
                    Some(i) => e.scores.get(*i).copied().filter(|&s| s != NOT_JUDGED),
                })
                .collect::<Option<Vec<i8>>>()?;
            Some((scores, e.top.clone()))
        });
        if out.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        out
    }
}

fn prefixed(reason: &str) -> String {
    format!("{REASON_PREFIX}{reason}")
}

fn requests_of(req: &PodRequest) -> Requests {
    Requests {
        containers: req.containers.clone(),
        init_containers: req.init_containers.clone(),
        group: req.group.as_ref().map(|g| g.key.clone()),
    }
}

impl Extender {
    pub fn new(cluster: Cluster, engine: Engine, binder: Arc<dyn Binder>, opts: ServiceOptions) -> Self {
        let state = State {
            cluster,
            generation: 0,
            bound: HashMap::new(),
            uid_of: HashMap::new(),
            last_seq: HashMap::new(),
            node_sources: HashMap::new(),
            util_sources: HashMap::new(),
            parked: HashMap::new(),
            refused: HashMap::new(),
            withdrawn: HashMap::new(),
            bound_at: HashMap::new(),
        };
        Self {
            engine,
            state: RwLock::new(state),
            seen: Mutex::new(PodCache { cap: opts.pod_cache, ..PodCache::default() }),
            evals: Mutex::new(EvalCache { cap: opts.eval_cache, ..EvalCache::default() }),
            binder,
            metrics: Metrics::new(),
            log: None,
            ready: AtomicBool::new(opts.ready),
        }
    }

    pub fn with_placement_log(mut self, log: PlacementLog) -> Self {
        self.log = Some(log);
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The watchers turn this on once allocations are rebuilt (and, with leader election, only on the
    /// leader).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    // A poisoned lock means a panic while it was held; every change to the model is check-then-apply,
    // so the state is still consistent and serving on beats failing every later request.
    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
        // whoever writes may change the cluster: evaluations cached before this are stale
        st.generation += 1;
        st
    }

    fn evals(&self) -> std::sync::MutexGuard<'_, EvalCache> {
        self.evals.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Prioritize calls answered from filter's evaluation, and those that evaluated again.
    pub fn eval_cache_stats(&self) -> (u64, u64) {
        let c = self.evals();
        (c.hits, c.misses)
    }

    /// A copy of the cluster model (for tests and tools; the service itself never copies it).
    pub fn cluster(&self) -> Cluster {
        self.read().cluster.clone()
    }

    /// Pods gpuplace holds a record for, by UID.
    pub fn bound_pods(&self) -> BTreeMap<String, BoundPod> {
        self.read().bound.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    fn log(&self, d: Decision) {
        if let Some(log) = &self.log {
            if let Err(e) = log.write(&d) {
                self.metrics.placement_log_error();
                tracing::warn!(error = %e, "placement log line not written");
            }
        }
    }

    fn decision(&self, verb: &str, pod: &Pod, started: Instant) -> Decision {
        Decision {
            v: PLACEMENT_LOG_VERSION,
            ts_unix_ms: now_unix_ms(),
            verb: verb.into(),
            pod: pod.key(),
            uid: pod.metadata.uid.clone(),
            latency_us: started.elapsed().as_micros() as u64,
            ..Decision::default()
        }
    }

    /// Remembers a pod for bind (filter does this; so will the pod watcher).
    pub fn remember_pod(&self, pod: &Pod) -> Result<PodRequest, String> {
        let request = pod.request().map_err(|e| e.to_string());
        if !pod.metadata.uid.is_empty() {
            let key = pod.key();
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let known = seen.by_uid.get(&pod.metadata.uid).is_some_and(|s| s.key == key && s.request == request);
            if !known {
                seen.insert(SeenPod { key, uid: pod.metadata.uid.clone(), request: request.clone() });
            }
        }
        request
    }

    fn seen_pod(&self, uid: &str) -> Option<SeenPod> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).by_uid.get(uid).cloned()
    }

    /// Adds or replaces a node (the node watcher's entry point). Allocations that no longer fit the
    /// new inventory are dropped, logged and counted as conflicts.
    pub fn upsert_node(&self, node: Node) {
        let mut st = self.write();
        self.upsert_locked(&mut st, node);
    }

    fn upsert_locked(&self, st: &mut State, node: Node) {
        let name = node.name.clone();
        for c in st.cluster.upsert_node(node) {
            self.metrics.conflict(ConflictKind::BadAssignment);
            tracing::warn!(pod = %c.pod, node = %name, reason = %c.reason, "allocation no longer fits the node's new inventory; dropped");
        }
        // a node deleted and created again: its pods' allocations count again where they still fit
        for a in st.parked.remove(&name).unwrap_or_default() {
            let pod = a.pod.clone();
            if let Err(e) = st.cluster.allocate(a) {
                self.metrics.conflict(ConflictKind::BadAssignment);
                tracing::warn!(pod = %pod, node = %name, error = %e, "allocation kept from the deleted node no longer fits; dropped");
                if let Some(uid) = st.uid_of.remove(&pod) {
                    st.bound.remove(&uid);
                }
            }
        }
    }

    /// Rebuilds every allocation from pod assignment annotations (after a restart). Each annotation
    /// is validated against its pod's request, node and the node's GPUs; a refused one, or one that
    /// collides with a record applied before it (records apply in pod-name order), is not counted and
    /// is returned. Bind sequences continue after the highest one seen per node.
    pub fn restore(&self, pods: Vec<RestoredPod>) -> Vec<RestoreConflict> {
        let mut st = self.write();
        let mut conflicts = Vec::new();
        let mut records = Vec::new();
        let mut meta: HashMap<String, BoundPod> = HashMap::new();
        let mut last_seq: HashMap<String, u64> = HashMap::new();
        let mut refused: HashMap<String, (String, Option<String>)> = HashMap::new();
        for p in pods {
            let checked = AssignmentAnnotation::parse(&p.annotation).and_then(|a| {
                let node = st.cluster.node(&p.node).ok_or_else(|| AnnotationError::WrongNode {
                    annotated: a.node.clone(),
                    bound: format!("{} (not a known GPU node)", p.node),
                })?;
                Ok((a.validate(&p.uid, &p.node, &p.request, node)?, a.bind_seq))
            });
            match checked {
                Ok((record, seq)) => {
                    let seq_slot = last_seq.entry(p.node.clone()).or_default();
                    *seq_slot = (*seq_slot).max(seq);
                    meta.insert(
                        record.pod.clone(),
                        BoundPod {
                            key: record.pod.clone(),
                            uid: p.uid.clone(),
                            node: p.node.clone(),
                            bind_seq: seq,
                            annotation: Some(p.annotation.clone()),
                            confirmed: true,
                        },
                    );
                    records.push(record);
                }
                Err(e) => {
                    self.metrics.conflict(ConflictKind::BadAssignment);
                    tracing::warn!(pod = %p.request.key, error = %e, "assignment annotation not trusted");
                    refused.insert(p.uid.clone(), (p.annotation.clone(), Some(p.node.clone())));
                    conflicts.push(RestoreConflict { pod: p.request.key.clone(), reason: e.to_string() });
                }
            }
        }
        for c in st.cluster.rebuild(records) {
            self.metrics.conflict(ConflictKind::BadAssignment);
            tracing::warn!(pod = %c.pod, reason = %c.reason, "assignment collides with another pod's; not counted");
            if let Some(b) = meta.remove(&c.pod) {
                refused.insert(b.uid, (b.annotation.unwrap_or_default(), Some(b.node)));
            }
            conflicts.push(RestoreConflict { pod: c.pod, reason: c.reason.to_string() });
        }
        st.bound.clear();
        st.uid_of.clear();
        st.parked.clear();
        st.withdrawn.clear();
        st.bound_at.clear();
        st.refused = refused;
        for (key, b) in meta {
            st.uid_of.insert(key, b.uid.clone());
            st.bound.insert(b.uid.clone(), b);
        }
        st.last_seq = last_seq;
        conflicts
    }

    // -----------------------------------------------------------------------------------------------
    // filter and prioritize
    // -----------------------------------------------------------------------------------------------

    /// In full-Nodes mode, takes each Node object's inventory (and utilization) annotation into the
    /// node cache when it changed. Refused annotations are treated as absent, logged and counted.
    fn learn_nodes(&self, items: &[WireNode]) {
        let mut inventories = Vec::new();
        let mut utilizations = Vec::new();
        {
            let st = self.read();
            for item in items {
                let view = item.view();
                let name = item.name();
                if let Some(text) = view.metadata.annotations.get(ANNOTATION_INVENTORY) {
                    let same = st.node_sources.get(name).is_some_and(|(t, l)| t == text && *l == view.metadata.labels);
                    if !same {
                        inventories.push((name.to_string(), text.clone(), view.metadata.labels.clone()));
                    }
                }
                if let Some(text) = view.metadata.annotations.get(ANNOTATION_UTILIZATION) {
                    if st.util_sources.get(name) != Some(text) {
                        utilizations.push((name.to_string(), text.clone()));
                    }
                }
            }
        }
        if inventories.is_empty() && utilizations.is_empty() {
            return;
        }
        let mut st = self.write();
        for (name, text, labels) in inventories {
            match NodeInventory::parse(&text).and_then(|inv| inv.to_node(&name, labels.clone())) {
                Ok(node) => {
                    tracing::info!(node = %name, gpus = node.gpus.len(), "node inventory taken from the Node object");
                    self.upsert_locked(&mut st, node);
                    st.node_sources.insert(name, (text, labels));
                }
                Err(e) => {
                    self.metrics.conflict(ConflictKind::BadInventory);
                    tracing::warn!(node = %name, error = %e, "inventory annotation refused; ignored");
                    // remembered too, so an unchanged bad annotation is refused (and counted) once
                    st.node_sources.insert(name, (text, labels));
                }
            }
        }
        for (name, text) in utilizations {
            let parsed = UtilizationAnnotation::parse(&text);
            match (parsed, st.cluster.node_mut(&name)) {
                (Ok(u), Some(mut node)) => {
                    u.apply_to(&mut node);
                }
                (Ok(_), None) => {}
                (Err(e), _) => tracing::warn!(node = %name, error = %e, "utilization annotation refused; ignored"),
            }
            st.util_sources.insert(name, text);
        }
    }

    /// Why an unknown candidate is turned down (the Node object, when sent, says more).
    fn unknown_reason(args: &ExtenderArgs, name: &str) -> String {
        let object = args.nodes.iter().flat_map(|l| l.items.iter()).find(|n| n.name() == name);
        match object {
            None => format!("node {name} is not in gpuplace's node cache, so its GPUs are unknown"),
            Some(n) if !n.view().status.allocatable.contains_key(RESOURCE_GPU) => format!(
                "node {name} has no {ANNOTATION_INVENTORY} annotation and advertises no {RESOURCE_GPU}: not a gpuplace GPU node"
            ),
            Some(_) => format!(
                "node {name} has no valid {ANNOTATION_INVENTORY} annotation (the device plugin publishes it) and is not in gpuplace's node cache, so its GPUs are unknown"
            ),
        }
    }

    /// Filters and scores the candidates (`names`, in request order; each known node is evaluated
    /// once however often it is named); unknown nodes are unresolvable with a reason. Rejection
    /// reasons are written only when `reasons` is set (prioritize does not send them).
    fn judge(&self, st: &State, req: &PodRequest, args: &ExtenderArgs, names: &[&str], reasons: bool) -> Judged {
        let cluster = &st.cluster;
        let mut scores = vec![NOT_JUDGED; cluster.nodes().len()];
        let mut at = Vec::with_capacity(names.len());
        let mut indices = Vec::with_capacity(names.len());
        let mut unknown = HashMap::new();
        let mut class_counts = [0u64; 4];
        for &name in names {
            let i = cluster.node_index(name);
            at.push(i);
            match i {
                // marks the node as listed (once); the evaluation below overwrites the ones that fit
                Some(i) if scores.get(i) == Some(&NOT_JUDGED) => {
                    scores[i] = REJECTED;
                    indices.push(i);
                }
                Some(_) => {}
                None if reasons && !unknown.contains_key(name) => {
                    let why = Self::unknown_reason(args, name);
                    unknown.insert(name.to_string(), Verdict::Unresolvable(prefixed(&why)));
                    class_counts[class_index(RejectClass::UnknownNode)] += 1;
                }
                None => {}
            }
        }
        let evaluation = self.engine.evaluate_in_order(cluster, req, &indices, now_unix_ms(), self.log.is_some());
        for c in &evaluation.ranked {
            scores[c.node] = c.score.clamp(0, MAX_EXTENDER_PRIORITY) as i8;
        }
        let mut rejects = HashMap::with_capacity(if reasons { evaluation.rejected.len() } else { 0 });
        for r in evaluation.rejected.iter().filter(|_| reasons) {
            // the engine filters without writing reasons; only rejected nodes pay for the text
            let (verdict, class) = match self.engine.explain_rejection(cluster, req, r) {
                Some(Infeasible::Unresolvable(why)) => {
                    (Verdict::Unresolvable(prefixed(&why)), RejectClass::Unresolvable)
                }
                Some(Infeasible::Preemptable(why)) => (Verdict::Preemptable(prefixed(&why)), RejectClass::Preemptable),
                None => {
                    let kind = if r.unresolvable { "never fits" } else { "might fit after preemption" };
                    let why = format!("does not fit ({kind})");
                    if r.unresolvable {
                        (Verdict::Unresolvable(prefixed(&why)), RejectClass::Unresolvable)
                    } else {
                        (Verdict::Preemptable(prefixed(&why)), RejectClass::Preemptable)
                    }
                }
            };
            class_counts[class_index(class)] += 1;
            rejects.insert(r.node, verdict);
        }
        Judged { at, scores, rejects, unknown, class_counts, evaluation }
    }

    /// The best nodes with each scorer's share, re-scored in full (the ranking pass keeps only totals).
    fn top_scores(&self, cluster: &Cluster, req: &PodRequest, ev: &Evaluation) -> Vec<TopScore> {
        let group = req.group.as_ref().map(|g| GroupView::new(cluster, g));
        ev.ranked
            .iter()
            .take(TOP_NODES)
            .map(|c| {
                let parts = c
                    .placement(cluster, req)
                    .map(|p| self.engine.score(cluster, req, c.node, &p, now_unix_ms(), group.as_ref()).parts)
                    .unwrap_or_default();
                TopScore {
                    node: cluster.nodes()[c.node].name.clone(),
                    score: c.score,
                    total: c.total,
                    parts: parts.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
                }
            })
            .collect()
    }

    /// The filter verb. `Err` only for a body that cannot be used (answered with HTTP 400).
    pub fn filter(&self, body: &[u8]) -> Result<ExtenderFilterResult, WireError> {
        let started = Instant::now();
        let args: ExtenderArgs = decode(body)?;
        let mode = args.mode()?;
        let names = args.candidate_names()?;
        let mut d = self.decision("filter", &args.pod, started);
        d.mode = Some(mode_name(mode).into());
        d.candidates = names.len();
        if !self.is_ready() {
            // an answer from an incomplete state could place a pod on GPUs that are taken
            d.error = Some(NOT_READY.into());
            return Ok(self.finish(d, started, ExtenderFilterResult::error(NOT_READY)));
        }
        let req = match self.remember_pod(&args.pod) {
            Ok(r) => r,
            Err(reason) => {
                let reason = prefixed(&reason);
                let out = args.refuse_all(&reason)?;
                self.metrics.rejection(RejectClass::Contract, names.len() as u64);
                d.rejections.insert(reason.clone(), names.len());
                d.rejection_classes.insert(RejectClass::Contract.name().into(), names.len());
                d.refused = Some(reason);
                return Ok(self.finish(d, started, out));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            // not ours to judge: kube-scheduler only asks about it when no managedResources are set
            let out = args.filter_result(|_| Verdict::Fits)?;
            d.feasible = names.len();
            return Ok(self.finish(d, started, out));
        }
        if let Some(list) = &args.nodes {
            self.learn_nodes(&list.items);
        }
        let st = self.read();
        let judged = self.judge(&st, &req, &args, &names, true);
        let made = Instant::now();
        let generation = st.generation;
        // the placement log's top scores re-score nodes in full: only when there is a log
        let top = if self.log.is_some() { self.top_scores(&st.cluster, &req, &judged.evaluation) } else { Vec::new() };
        drop(st);
        drop(names);
        let uid = args.pod.metadata.uid.clone();
        let out = args.into_filter_result(|pos, name| judged.verdict(pos, name))?;
        for (class, &n) in RejectClass::ALL.iter().zip(&judged.class_counts) {
            if n > 0 {
                self.metrics.rejection(*class, n);
            }
        }
        d.feasible = judged.evaluation.ranked.len();
        if self.log.is_some() {
            d.top = top.clone();
            for (class, &n) in RejectClass::ALL.iter().zip(&judged.class_counts) {
                if n > 0 {
                    d.rejection_classes.insert(class.name().into(), n as usize);
                }
            }
            for v in judged.rejects.values().chain(judged.unknown.values()) {
                if let Verdict::Unresolvable(r) | Verdict::Preemptable(r) = v {
                    *d.rejections.entry(r.clone()).or_default() += 1;
                }
            }
        }
        if !uid.is_empty() {
            // for the prioritize call that follows (kube-scheduler sends it next, for the same pod)
            self.evals().insert(CachedEval { uid, request: req, generation, made, scores: judged.scores, top });
        }
        Ok(self.finish(d, started, out))
    }

    fn finish<T>(&self, mut d: Decision, started: Instant, out: T) -> T {
        d.latency_us = started.elapsed().as_micros() as u64;
        self.log(d);
        out
    }

    /// The prioritize verb: 0..=10 per candidate from the engine; 0 where the pod does not fit.
    /// Reuses filter's evaluation of the same pod when nothing changed since (see [`EvalCache`]).
    pub fn prioritize(&self, body: &[u8]) -> Result<HostPriorityList, WireError> {
        let started = Instant::now();
        let args: ExtenderArgs = decode(body)?;
        let mode = args.mode()?;
        let names = args.candidate_names()?;
        let mut d = self.decision("prioritize", &args.pod, started);
        d.mode = Some(mode_name(mode).into());
        d.candidates = names.len();
        let req = match self.remember_pod(&args.pod) {
            Ok(r) => r,
            Err(reason) => {
                d.refused = Some(prefixed(&reason));
                let out = args.priorities(|_| 0)?;
                return Ok(self.finish(d, started, out));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            let out = args.priorities(|_| 0)?;
            return Ok(self.finish(d, started, out));
        }
        if let Some(list) = &args.nodes {
            self.learn_nodes(&list.items);
        }
        let st = self.read();
        let at: Vec<Option<usize>> = names.iter().map(|n| st.cluster.node_index(n)).collect();
        let uid = &args.pod.metadata.uid;
        let cached = if uid.is_empty() { None } else { self.evals().scores(uid, &req, st.generation, &at) };
        let (scores, top) = match cached {
            Some(hit) => hit,
            None => {
                let judged = self.judge(&st, &req, &args, &names, false);
                let scores = judged.at.iter().map(|i| i.map_or(REJECTED, |i| judged.scores[i])).collect();
                let top = if self.log.is_some() {
                    self.top_scores(&st.cluster, &req, &judged.evaluation)
                } else {
                    Vec::new()
                };
                (scores, top)
            }
        };
        drop(st);
        drop(names);
        d.feasible = scores.iter().filter(|&&s| s >= 0).count();
        d.top = top;
        let out = args.into_priorities(|pos, _| scores.get(pos).map_or(0, |&s| i64::from(s.max(0))))?;
        Ok(self.finish(d, started, out))
    }

    // -----------------------------------------------------------------------------------------------
    // bind
    // -----------------------------------------------------------------------------------------------

    /// The bind verb. `Err` only for a body that cannot be used; every bind failure is an answer
    /// with `Error` set, after the allocation is rolled back.
    pub async fn bind(&self, body: &[u8]) -> Result<ExtenderBindingResult, WireError> {
        let started = Instant::now();
        let args: ExtenderBindingArgs = decode(body)?;
        let mut d = Decision {
            v: PLACEMENT_LOG_VERSION,
            verb: "bind".into(),
            pod: args.pod_key(),
            uid: args.pod_uid.clone(),
            candidates: 1,
            ..Decision::default()
        };
        let prepared = if self.is_ready() {
            self.prepare_bind(&args, &mut d)
        } else {
            Err((BindOutcome::NotReady, NOT_READY.into()))
        };
        let (outcome, error) = match prepared {
            Err((outcome, message)) => (outcome, Some(message)),
            Ok(None) => (BindOutcome::Repeated, None),
            Ok(Some(request)) => match self.binder.bind(&request).await {
                Ok(()) => {
                    let mut st = self.write();
                    if let Some(b) = st.bound.get_mut(&args.pod_uid) {
                        b.confirmed = true;
                        st.bound_at.insert(args.pod_uid.clone(), Instant::now());
                    }
                    (BindOutcome::Bound, None)
                }
                Err(e) => {
                    self.rollback(&args);
                    tracing::warn!(pod = %args.pod_key(), node = %args.node, error = %e, "Binding failed; allocation rolled back");
                    (BindOutcome::BinderFailed, Some(format!("{REASON_PREFIX}binding failed, GPUs released: {e}")))
                }
            },
        };
        self.metrics.bind(outcome);
        d.outcome = Some(outcome.name().into());
        d.feasible = usize::from(outcome.is_success());
        d.ts_unix_ms = now_unix_ms();
        d.error = error.clone();
        if outcome.is_success() {
            tracing::debug!(pod = %args.pod_key(), node = %args.node, outcome = outcome.name(), "bound");
        } else {
            d.chosen = None;
        }
        let out = match error {
            None => ExtenderBindingResult::ok(),
            Some(e) => ExtenderBindingResult::error(e),
        };
        Ok(self.finish(d, started, out))
    }

    /// Re-checks and counts the allocation. `Ok(None)`: a retry of a bind already done.
    fn prepare_bind(
        &self,
        args: &ExtenderBindingArgs,
        d: &mut Decision,
    ) -> Result<Option<BindRequest>, (BindOutcome, String)> {
        let key = args.pod_key();
        let fail = |o: BindOutcome, m: String| Err((o, prefixed(&m)));
        let seen = self.seen_pod(&args.pod_uid);
        let mut st = self.write();
        let st = &mut *st;
        if let Some(b) = st.bound.get(&args.pod_uid) {
            return if b.node != args.node {
                fail(BindOutcome::Conflict, format!("pod {key} is already bound to {}", b.node))
            } else if !b.confirmed {
                fail(BindOutcome::Conflict, format!("a bind of pod {key} to {} is in flight; retry", b.node))
            } else {
                d.chosen = b.annotation.as_deref().and_then(chosen_of);
                Ok(None)
            };
        }
        let Some(seen) = seen else {
            return fail(
                BindOutcome::UnknownPod,
                format!("pod {key} (UID {}) was not seen in a filter request, so its GPU request is unknown; it will be scheduled again", args.pod_uid),
            );
        };
        if seen.key != key {
            return fail(
                BindOutcome::UnknownPod,
                format!("UID {} belongs to pod {}, not {key}", args.pod_uid, seen.key),
            );
        }
        let req = match &seen.request {
            Ok(r) => r.clone(),
            Err(reason) => return fail(BindOutcome::Refused, reason.clone()),
        };
        d.requests = Some(requests_of(&req));
        let Some(index) = st.cluster.node_index(&args.node) else {
            return fail(BindOutcome::UnknownNode, format!("node {} is not in gpuplace's node cache", args.node));
        };
        if let Some(old) = st.uid_of.get(&key).cloned() {
            // two live pods cannot share a name: the old UID's pod is gone and its release was missed
            self.metrics.conflict(ConflictKind::StaleUid);
            tracing::warn!(pod = %key, old_uid = %old, new_uid = %args.pod_uid, "pod name bound again under a new UID; releasing the old record");
            let _ = st.cluster.release(&key);
            st.bound.remove(&old);
            st.uid_of.remove(&key);
        }
        let mut record = BoundPod {
            key: key.clone(),
            uid: args.pod_uid.clone(),
            node: args.node.clone(),
            bind_seq: 0,
            annotation: None,
            confirmed: false,
        };
        let mut annotations = BTreeMap::new();
        if !req.is_gpu_free() {
            let placement = self.engine.place(&st.cluster, &req, index).map_err(|why| {
                (BindOutcome::NoFit, prefixed(&format!("pod {key} no longer fits on {}: {}", args.node, why.reason())))
            })?;
            let seq = st.last_seq.get(&args.node).copied().unwrap_or(0) + 1;
            let node = &st.cluster.nodes()[index];
            let annotation = AssignmentAnnotation::from_assignment(&placement.assignment, &args.pod_uid, node, seq)
                .map_err(|e| (BindOutcome::NoFit, prefixed(&e.to_string())))?;
            st.cluster.allocate(placement.assignment.clone()).map_err(|e| {
                (BindOutcome::NoFit, prefixed(&format!("pod {key} cannot be counted on {}: {e}", args.node)))
            })?;
            st.last_seq.insert(args.node.clone(), seq);
            let text = annotation.to_json();
            d.chosen = chosen_of(&text);
            annotations.insert(ANNOTATION_ASSIGNMENT.to_string(), text.clone());
            record.bind_seq = seq;
            record.annotation = Some(text);
        } else {
            d.chosen = Some(Chosen { node: args.node.clone(), bind_seq: 0, gpus: Vec::new() });
        }
        st.uid_of.insert(key, args.pod_uid.clone());
        st.bound.insert(args.pod_uid.clone(), record);
        Ok(Some(BindRequest {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: args.pod_uid.clone(),
            node: args.node.clone(),
            annotations,
        }))
    }

    /// Undoes `prepare_bind` after a failed Binding, if the record is still the one it made.
    fn rollback(&self, args: &ExtenderBindingArgs) {
        let mut st = self.write();
        let key = args.pod_key();
        let ours = st.bound.get(&args.pod_uid).is_some_and(|b| !b.confirmed && b.node == args.node);
        if !ours {
            return;
        }
        if let Some(text) = st.bound.remove(&args.pod_uid).and_then(|b| b.annotation) {
            // more rolled-back binds than are ever in flight at once: forget the old ones
            if st.withdrawn.len() >= DEFAULT_POD_CACHE {
                st.withdrawn.clear();
            }
            st.withdrawn.insert(args.pod_uid.clone(), text);
        }
        if st.uid_of.get(&key) == Some(&args.pod_uid) {
            st.uid_of.remove(&key);
        }
        if st.cluster.assignment(&key).is_some_and(|a| a.node == args.node) {
            let _ = st.cluster.release(&key);
        }
    }

    // -----------------------------------------------------------------------------------------------
    // preempt
    // -----------------------------------------------------------------------------------------------

    /// The preempt verb: per node, the smallest set of kube-scheduler's victims whose removal lets
    /// the pod's GPUs fit (no victim can be spared without breaking the fit); nodes where evicting
    /// every GPU victim still does not make room are dropped. Victims gpuplace holds no GPU record
    /// for are kept as sent: kube-scheduler chose them for resources gpuplace does not see.
    pub fn preempt(&self, body: &[u8]) -> Result<ExtenderPreemptionResult, WireError> {
        let started = Instant::now();
        let args: ExtenderPreemptionArgs = decode(body)?;
        let meta = args.meta_victims();
        let mut d = self.decision("preempt", &args.pod, started);
        d.candidates = meta.len();
        let req = match args.pod.request() {
            Ok(r) => r,
            Err(e) => {
                // fits nowhere, so no eviction helps
                d.refused = Some(prefixed(&e.to_string()));
                return Ok(self.finish(d, started, ExtenderPreemptionResult::default()));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            d.feasible = meta.len();
            return Ok(self.finish(d, started, ExtenderPreemptionResult { node_name_to_meta_victims: meta }));
        }
        // full victims (nodeCacheCapable false) carry their names and priorities
        let mut full: HashMap<&str, (String, Option<i32>)> = HashMap::new();
        for v in args.node_name_to_victims.iter().flat_map(|m| m.values()) {
            for p in &v.pods {
                full.insert(p.metadata.uid.as_str(), (p.key(), p.spec.priority));
            }
        }
        let st = self.read();
        let mut out = BTreeMap::new();
        for (node_name, victims) in meta {
            match self.minimal_victims(&st, &req, &node_name, &victims, &full) {
                Some(kept) => {
                    let spared = victims.pods.len().saturating_sub(kept.pods.len());
                    self.metrics.preempt_node(true, spared as u64);
                    out.insert(node_name, kept);
                }
                None => {
                    self.metrics.preempt_node(false, 0);
                    *d.rejections.entry(format!("no victim set frees room on {node_name}")).or_default() += 1;
                }
            }
        }
        drop(st);
        d.feasible = out.len();
        Ok(self.finish(d, started, ExtenderPreemptionResult { node_name_to_meta_victims: out }))
    }

    fn minimal_victims(
        &self,
        st: &State,
        req: &PodRequest,
        node_name: &str,
        victims: &MetaVictims,
        full: &HashMap<&str, (String, Option<i32>)>,
    ) -> Option<MetaVictims> {
        let node = st.cluster.node(node_name)?;
        // (position in kube-scheduler's list, record, priority)
        let mut gpu_victims: Vec<(usize, PodAssignment, Option<i32>)> = Vec::new();
        let mut foreign: Vec<usize> = Vec::new();
        let mut uids = HashSet::with_capacity(victims.pods.len());
        for (pos, p) in victims.pods.iter().enumerate() {
            // a UID listed twice is one pod: answered once
            if !uids.insert(p.uid.as_str()) {
                continue;
            }
            let (key, prio) = match full.get(p.uid.as_str()) {
                Some((k, prio)) => (Some(k.clone()), *prio),
                None => (st.bound.get(&p.uid).map(|b| b.key.clone()), None),
            };
            match key.as_deref().and_then(|k| node.pod(k)) {
                Some(a) => gpu_victims.push((pos, a.clone(), prio)),
                None => foreign.push(pos),
            }
        }
        // a one-node copy is enough: placement on a node depends on that node alone
        let mut scratch = Cluster::new(vec![node.clone()]);
        scratch.network_levels = st.cluster.network_levels.clone();
        for (_, a, _) in &gpu_victims {
            let _ = scratch.release(&a.pod);
        }
        self.engine.place(&scratch, req, 0).ok()?;
        // Reprieve as kube-scheduler does: highest priority first (then in the order sent), keeping a
        // victim whenever the pod still fits with it back. Fit only gets harder as pods come back, so
        // no victim left in the set could be spared given the others: the set is minimal.
        let mut order: Vec<usize> = (0..gpu_victims.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(gpu_victims[i].2.unwrap_or(i32::MIN)));
        let mut evicted = vec![false; gpu_victims.len()];
        for i in order {
            let a = &gpu_victims[i].1;
            if scratch.allocate(a.clone()).is_ok() {
                if self.engine.place(&scratch, req, 0).is_ok() {
                    continue;
                }
                let _ = scratch.release(&a.pod);
            }
            evicted[i] = true;
        }
        let mut keep: Vec<usize> =
            gpu_victims.iter().zip(&evicted).filter(|(_, &e)| e).map(|((pos, _, _), _)| *pos).collect();
        keep.extend(foreign);
        keep.sort_unstable();
        let pods: Vec<MetaPod> = keep.iter().map(|&i| victims.pods[i].clone()).collect();
        // spared victims can only lower the PDB violations; the exact count is kube-scheduler's
        let num_pdb_violations = victims.num_pdb_violations.min(pods.len() as i64);
        Some(MetaVictims { pods, num_pdb_violations })
    }

    // -----------------------------------------------------------------------------------------------
    // inspect and metrics
    // -----------------------------------------------------------------------------------------------

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        let st = self.read();
        let bound = st.cluster.nodes().iter().map(|n| n.pods().count()).sum();
        self.metrics.render(&st.cluster, bound, self.is_ready())
    }

    /// Every node (or one), per GPU.
    pub fn inspect(&self, node: Option<&str>) -> Option<crate::extender::inspect::InspectReport> {
        let st = self.read();
        crate::extender::inspect::InspectReport::build(&st.cluster, node, self.is_ready(), now_unix_ms())
    }

    /// Totals over the cluster.
    pub fn summary(&self) -> ClusterSummary {
        ClusterSummary::of(&self.read().cluster)
    }
}

mod observe;
pub use observe::{NodeOutcome, ObservedPod, PodOutcome};

fn class_index(c: RejectClass) -> usize {
    RejectClass::ALL.iter().position(|&x| x == c).unwrap_or(0)
}

fn mode_name(m: NodeListMode) -> &'static str {
    match m {
        NodeListMode::NamesOnly => "names",
        NodeListMode::FullNodes => "nodes",
    }
}

/// The placement log's view of an assignment annotation.
fn chosen_of(annotation: &str) -> Option<Chosen> {
    let a = AssignmentAnnotation::parse(annotation).ok()?;
    let gpus = a
        .containers
        .iter()
        .flat_map(|c| {
            c.gpus.iter().map(move |g| ChosenGpu {
                container: c.name.clone(),
                init: c.init,
                index: g.index,
                uuid: g.uuid.clone(),
                memory_mib: g.memory_mib,
                core_percent: g.core_percent,
                exclusive: g.exclusive,
            })
        })
        .collect();
    Some(Chosen { node: a.node, bind_seq: a.bind_seq, gpus })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(uid: &str) -> SeenPod {
        SeenPod { key: format!("ns/{uid}"), uid: uid.into(), request: Err("x".into()) }
    }

    #[test]
    fn pod_cache_forgets_the_oldest_and_keeps_a_known_uid_once() {
        let mut c = PodCache { cap: 2, ..PodCache::default() };
        c.insert(seen("a"));
        c.insert(seen("b"));
        c.insert(seen("a")); // replaced in place, still the oldest
        assert_eq!(c.order.len(), 2);
        c.insert(seen("c"));
        assert!(!c.by_uid.contains_key("a"));
        assert!(c.by_uid.contains_key("b") && c.by_uid.contains_key("c"));
        let mut off = PodCache::default();
        off.insert(seen("a"));
        assert!(off.by_uid.is_empty(), "a cache of size 0 keeps nothing");
    }
}
