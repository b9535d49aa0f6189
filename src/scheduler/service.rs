//! The online scheduler's state and decisions, without any protocol: each verb takes its typed
//! input (`scheduler::input`) and returns a typed decision, which a front end (`crate::extender`)
//! encodes.
//!
//! State is the cluster model (nodes, GPUs, who holds what) plus the records bind needs: pods by UID
//! that gpuplace bound, the per-node bind sequence, and the pods seen in filter requests (bind only
//! names the pod, so its GPU request comes from the filter that preceded it; the API-server watchers
//! feed the same cache). Filter, prioritize and preempt take a read lock and change no
//! allocation; bind takes the write lock to re-check and count the allocation at once, releases it
//! while the [`Binder`] runs, and takes it again to confirm or roll back.
//!
//! The engine lives in the state too: a learned request mix (`scheduler::mix`, the `learning`
//! submodule) is replaced under the write lock, so each request scores with one mix throughout and
//! every cached answer made with the old one is dropped at once.
//!
//! Seams for API-server mode (`src/k8s/`): the watchers call [`Scheduler::observe_node`],
//! [`Scheduler::remove_node`], [`Scheduler::observe_pod`], [`Scheduler::release_pod`],
//! [`Scheduler::retain_pods`], [`Scheduler::restore`] and [`Scheduler::set_ready`] (the decisions on
//! what to trust are in the `observe` submodule, the assignment MAC and its keys in `trust`), and
//! the utilization ConfigMap watcher calls [`Scheduler::observe_utilization`] and
//! [`Scheduler::forget_utilization`] (the `utilization` submodule); the kube-rs binder implements
//! [`Binder`]. The DRA front end's seams (nodes from ResourceSlices, claims' allocations, placements
//! held while their claims are written) are in the `claims` submodule.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::placement::engine::{Engine, Evaluation, Rejection};
use crate::placement::mix_learner::MixLearner;
use crate::placement_log::writer::PlacementLog;
use crate::placement_log::{Chosen, ChosenGpu, Decision, Requests, TopScore, PLACEMENT_LOG_VERSION};
use crate::scheduler::binder::{BindRequest, Binder};
use crate::scheduler::groups::{Groups, DEFAULT_GROUP_TIMEOUT};
use crate::scheduler::input::{BindOrder, NodeObject, NodeQuery, NodeVictims, PodView, PreemptQuery, Victim};
use crate::scheduler::metrics::{BindOutcome, ConflictKind, Metrics};
use crate::scheduler::mix::Learning;
use crate::scheduler::reasons::{self, prefixed, UnknownNode, MAX_DETAILED_NODES};
use crate::scheduler::requeue::{RecentRejections, Requeuer};
use crate::scheduler::verdict_cache::{
    Answer, Candidates, FilterDecision, NameOrder, Reason, ReasonKey, RejectClass, Shape, ShapeCache, TopParts,
    DEFAULT_SHAPE_CACHE, MAX_SCORE,
};
use gpuplace_core::annotations::{
    AssignmentAnnotation, NodeInventory, ANNOTATION_ASSIGNMENT, ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::clock::now_unix_ms;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::node_constraints::{NodeConstraints, Taint};
use gpuplace_core::resources::PodRequest;
use gpuplace_core::signing::{KeyId, KeyRing};
use gpuplace_core::summary::ClusterSummary;

/// What filter and bind answer (in `Error`) while the state is not complete or this replica is not
/// the leader; prioritize and preempt, which have no error field, get HTTP 503.
pub const NOT_READY: &str = "gpuplace: not ready (state not rebuilt yet, or not the leader); retry";

/// How many pods from filter requests are remembered for bind. kube-scheduler binds a pod right
/// after filtering it, so this only needs to cover the pods in flight at once.
pub const DEFAULT_POD_CACHE: usize = 10_000;

/// How many pods' filter evaluations are kept for the prioritize call that follows. kube-scheduler
/// prioritizes a pod right after filtering it, one pod at a time per profile; this covers many in
/// flight at once.
pub const DEFAULT_EVAL_CACHE: usize = 64;

/// `Scheduler::clock` when no fixed time is set.
const SYSTEM_CLOCK: i64 = i64::MIN;

/// [`State::gpu_memory_mib`] before it is computed.
const UNKNOWN_GPU_MEMORY: u64 = u64::MAX;

/// A pod as filter, or the pod watcher, saw it: enough for bind to place it.
#[derive(Debug, Clone, PartialEq)]
pub struct SeenPod {
    /// `namespace/name`.
    pub key: String,
    pub uid: String,
    /// The request, or the contract's refusal.
    pub request: Result<PodRequest, String>,
    /// What it requires of its node (`nodeSelector`, required node affinity), or why that cannot
    /// be read. Checked by bind in API-server mode, where node labels are the Node objects'.
    pub constraints: Result<NodeConstraints, String>,
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
    /// The id of the key whose MAC the annotation carries (`None`: unsigned, taken for the migration
    /// from a version that did not sign); the leader re-signs records not signed by the primary key.
    #[serde(default)]
    pub signed_by: Option<KeyId>,
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
    /// The profile and the mix every verdict is made with. Here, under the state's lock, because a
    /// learned mix is replaced while serving: a new one goes in under the write lock, which also
    /// starts a new generation and empties the shape cache (see [`Scheduler::take_mix`]), so every
    /// request sees one mix throughout and no cached answer outlives the mix it was made with.
    engine: Engine,
    /// Observations the learner had counted when `engine.mix` was taken (0 for a fixed mix): a mix
    /// taken earlier never replaces a later one.
    mix_taken_at: u64,
    /// The cluster's typical GPU memory, by which the learner reads shares given in memory
    /// ([`typical_gpu_memory_mib`](crate::placement::mix_learner::typical_gpu_memory_mib)), or [`UNKNOWN_GPU_MEMORY`]: computed under the read lock at the
    /// first need, forgotten whenever a node is added, replaced or removed.
    gpu_memory_mib: AtomicU64,
    /// The largest GPU memory of each model (`placement::feasibility::largest_gpus`), for the reason
    /// of a slice no GPU holds: computed under the read lock at the first need, forgotten whenever
    /// a node is added, replaced or removed.
    largest_gpus: Mutex<Option<Arc<HashMap<String, u64>>>>,
    /// Bumped whenever the write lock is taken, i.e. whenever the cluster (or the mix) may change: a
    /// cached evaluation is valid only for the generation it was made at.
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
    /// Node → the utilization text last applied to it (from either source), so an unchanged one is
    /// not parsed again; cleared when the node's GPUs are redefined (their samples start empty).
    util_sources: HashMap<String, String>,
    /// Node → the utilization text of its ConfigMap (the device plugin's; see `utilization`), kept
    /// whether or not the node is known yet, so it applies when the node appears or is redefined.
    /// While a node has one, its deprecated Node annotation is ignored.
    util_published: HashMap<String, String>,
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
    /// Groups placed whole: their members, plans and reservations (`scheduler::groups`). Here, under
    /// the state's lock, because reservations are allocations in `cluster`.
    groups: Groups,
    /// Node → UIDs of the pods counted there whose GPU containers the node's device plugin has not
    /// confirmed yet (`gpuplace.io/allocated`): what bind waits for on nodes whose plugin confirms
    /// allocations (the `admission` submodule).
    awaiting: HashMap<String, HashSet<String>>,
    /// DRA (the `claims` submodule): node → its GPUs from its ResourceSlices; the labels of Node
    /// objects without an inventory annotation (a DRA node is built from both); claim key → when a
    /// placement held it, until the claim watcher shows its allocation written.
    dra_gpus: HashMap<String, gpuplace_core::dra::slices::SliceGpus>,
    dra_labels: HashMap<String, BTreeMap<String, String>>,
    /// Node → its allocatable CPU (millicores) and memory (MiB), and pod UID → its node and host
    /// requests (DRA front end on only): a DRA node's host is checked by gpuplace.
    dra_host: HashMap<String, (u64, u64)>,
    host_uses: HashMap<String, (String, u64, u64)>,
    held: HashMap<String, Instant>,
    /// Pod UID → the GPUs a filter answer promised it, held until its bind (`offers`).
    offers: crate::scheduler::offers::Offers,
    /// Nodes whose books are due a write, records to put back on pods (`scheduler::books`).
    books: crate::scheduler::books::BooksState,
}

/// Options of the service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    pub pod_cache: usize,
    /// Pods whose filter evaluation prioritize may reuse (0: none, prioritize evaluates again). Used
    /// for the pods the shape cache does not take (groups), or all pods when it is off.
    pub eval_cache: usize,
    /// Request shapes whose per-node verdicts later pods of the same shape reuse (0: off; see
    /// `scheduler::verdict_cache`).
    pub shape_cache: usize,
    /// Answer as ready from the start (static mode: the cluster file is the whole truth).
    pub ready: bool,
    /// Count assignments that carry no `sig` at all (never ones whose `sig` does not verify): for
    /// one upgrade from a version that did not sign (`--accept-unsigned-assignments`).
    pub accept_unsigned: bool,
    /// How long a group's plan holds GPUs for members not bound yet (`scheduler::groups`).
    pub group_timeout: Duration,
    /// How many of the nodes that fit filter offers to kube-scheduler's scoring.
    pub nodes_to_score: NodesToScore,
}

/// How many of the nodes that fit a filter answer names, the best first by the engine's ranking (0:
/// every one). kube-scheduler scores only the nodes an extender's filter passes, and skips scoring
/// and prioritize altogether when one is left: at 1,000 nodes its scoring and the prioritize call
/// were most of a pod's scheduling cycle (docs/performance-journal.md, "Scale"). Pods whose
/// preferences kube-scheduler weighs (preferred affinity, `ScheduleAnyway` spread) get `soft` nodes
/// to choose from. The library's default is every node; `gpuplace serve` offers 1 and 16.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodesToScore {
    pub plain: usize,
    pub soft: usize,
}

impl Default for ServiceOptions {
    fn default() -> Self {
        Self {
            pod_cache: DEFAULT_POD_CACHE,
            eval_cache: DEFAULT_EVAL_CACHE,
            shape_cache: DEFAULT_SHAPE_CACHE,
            ready: true,
            accept_unsigned: false,
            group_timeout: DEFAULT_GROUP_TIMEOUT,
            nodes_to_score: NodesToScore::default(),
        }
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

/// The online scheduler: the state every front end shares, and the verbs' decisions.
pub struct Scheduler {
    state: RwLock<State>,
    /// The mix learner and the pods it counted (`None`: the mix is fixed). Its own lock, never held
    /// while the state's is taken.
    learning: Option<Mutex<Learning>>,
    /// Pods seen in filter requests, for bind. Its own lock: filter of a new pod would otherwise take
    /// the state's write lock, which also invalidates every cached evaluation.
    seen: Mutex<PodCache>,
    evals: Mutex<EvalCache>,
    /// Per request shape, each node's verdict (filter and prioritize; not cluster state).
    shapes: ShapeCache,
    names: NameOrder,
    /// Fixed Unix ms for tests, or [`SYSTEM_CLOCK`].
    clock: AtomicI64,
    binder: Arc<dyn Binder>,
    metrics: Metrics,
    log: Option<PlacementLog>,
    ready: AtomicBool,
    /// API-server mode: the pod watcher remembers pods for bind, and filter bodies do not.
    pods_watched: AtomicBool,
    /// Each Node's taints as its watcher last saw them, for bind's check of the pod's tolerations.
    /// Its own lock: a Node's status heartbeats must not take the state's.
    node_taints: Mutex<HashMap<String, Vec<Taint>>>,
    /// Signs the assignments bind writes and verifies those read back (the `trust` submodule). A
    /// per-process random ring until [`Scheduler::set_key_ring`] installs the shared one; `None` only
    /// if the OS random generator failed, and then bind refuses rather than write unsigned records.
    keys: RwLock<Option<Arc<KeyRing>>>,
    accept_unsigned: bool,
    /// Pods turned away for want of free GPUs, for a few seconds (`scheduler::requeue`), and who
    /// sends them back to kube-scheduler's queue when GPUs they were turned away from are freed
    /// (unset: nobody, as in static mode, where no watch lags).
    rejections: Mutex<RecentRejections>,
    requeuer: OnceLock<Arc<dyn Requeuer>>,
    nodes_to_score: NodesToScore,
    /// Bumped whenever a pod stops awaiting its admission: binds waiting for it look again.
    admissions: tokio::sync::watch::Sender<u64>,
    /// The DRA front end is on: pods' host requests are kept for DRA nodes (`claims`).
    dra_enabled: AtomicBool,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

fn requests_of(req: &PodRequest) -> Requests {
    Requests {
        containers: req.containers.clone(),
        init_containers: req.init_containers.clone(),
        group: req.group.as_ref().map(|g| g.key.clone()),
    }
}

impl Scheduler {
    pub fn new(cluster: Cluster, engine: Engine, binder: Arc<dyn Binder>, opts: ServiceOptions) -> Self {
        let state = State {
            cluster,
            engine,
            mix_taken_at: 0,
            gpu_memory_mib: AtomicU64::new(UNKNOWN_GPU_MEMORY),
            largest_gpus: Mutex::new(None),
            generation: 0,
            bound: HashMap::new(),
            uid_of: HashMap::new(),
            last_seq: HashMap::new(),
            node_sources: HashMap::new(),
            util_sources: HashMap::new(),
            util_published: HashMap::new(),
            parked: HashMap::new(),
            refused: HashMap::new(),
            withdrawn: HashMap::new(),
            bound_at: HashMap::new(),
            groups: Groups::new(opts.group_timeout),
            awaiting: HashMap::new(),
            dra_gpus: HashMap::new(),
            dra_labels: HashMap::new(),
            dra_host: HashMap::new(),
            host_uses: HashMap::new(),
            held: HashMap::new(),
            offers: Default::default(),
            books: Default::default(),
        };
        Self {
            state: RwLock::new(state),
            learning: None,
            seen: Mutex::new(PodCache { cap: opts.pod_cache, ..PodCache::default() }),
            evals: Mutex::new(EvalCache::new(opts.eval_cache)),
            shapes: ShapeCache::new(opts.shape_cache),
            names: NameOrder::default(),
            clock: AtomicI64::new(SYSTEM_CLOCK),
            binder,
            metrics: {
                let m = Metrics::new();
                m.set_accept_unsigned(opts.accept_unsigned);
                m
            },
            log: None,
            ready: AtomicBool::new(opts.ready),
            pods_watched: AtomicBool::new(false),
            node_taints: Mutex::new(HashMap::new()),
            keys: RwLock::new(ephemeral_keys()),
            accept_unsigned: opts.accept_unsigned,
            rejections: Mutex::new(RecentRejections::default()),
            requeuer: OnceLock::new(),
            nodes_to_score: opts.nodes_to_score,
            admissions: tokio::sync::watch::Sender::new(0),
            dra_enabled: AtomicBool::new(false),
        }
    }

    /// Who sends pods back to kube-scheduler's queue when GPUs they were just turned away from are
    /// freed (`scheduler::requeue`); the first one set stays.
    pub fn set_requeuer(&self, requeuer: Arc<dyn Requeuer>) {
        let _ = self.requeuer.set(requeuer);
    }

    fn rejections(&self) -> std::sync::MutexGuard<'_, RecentRejections> {
        self.rejections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After filter, what both kinds of verdict share: a pod that was offered a node is forgotten;
    /// for one turned away (and with a requeuer to hand it to), the requeuer and the pod's UID.
    fn turned_away<'p>(&self, pod: &'p dyn PodView, fits: bool) -> Option<(&Arc<dyn Requeuer>, &'p str)> {
        let requeuer = self.requeuer.get()?;
        let uid = pod.uid();
        if uid.is_empty() {
            return None;
        }
        if fits {
            self.rejections().forget(uid);
            return None;
        }
        Some((requeuer, uid))
    }

    /// After filter: a pod that fits nowhere among the candidates is remembered with the nodes where
    /// only capacity stood in the way (preemptable rejections); one that fits is forgotten.
    fn note_verdict(
        &self,
        pod: &dyn PodView,
        c: &Candidates<'_>,
        answers: &[Answer],
        feasible: usize,
        read_at: Instant,
    ) {
        let Some((requeuer, uid)) = self.turned_away(pod, feasible > 0) else { return };
        let capacity = c
            .unique()
            .filter(|&p| matches!(&answers[p], Answer::No(r) if r.class == RejectClass::Preemptable))
            .map(|p| c.names[p]);
        let due = self.rejections().record(uid, pod.namespace(), pod.name(), capacity, read_at, Instant::now());
        if let Some(p) = due {
            requeuer.requeue(vec![p]);
        }
    }

    /// After filter: a group member turned away on every candidate while its group waits for room
    /// (its verdict read from the state at `read_at`) goes back to kube-scheduler's queue when GPUs
    /// are freed anywhere in the next few seconds; one that was offered a node is forgotten.
    pub(super) fn note_group_verdict(&self, pod: &dyn PodView, fits: bool, read_at: Instant) {
        let Some((requeuer, uid)) = self.turned_away(pod, fits) else { return };
        let due = self.rejections().record_anywhere(uid, pod.namespace(), pod.name(), read_at, Instant::now());
        if let Some(p) = due {
            requeuer.requeue(vec![p]);
        }
    }

    /// GPUs on `node` were freed (the state already shows it): pods just turned away there go back
    /// to kube-scheduler's queue.
    fn note_freed(&self, node: &str) {
        let Some(requeuer) = self.requeuer.get() else { return };
        let mut due = self.rejections().freed(node, Instant::now());
        if !due.is_empty() {
            // bound since (by this replica, or another before a hand-over): nothing to retry
            let st = self.read();
            due.retain(|p| !st.bound.contains_key(&p.uid));
        }
        if !due.is_empty() {
            requeuer.requeue(due);
        }
    }

    pub fn with_placement_log(mut self, log: PlacementLog) -> Self {
        self.log = Some(log);
        self
    }

    /// Scores with the mix `learner` learns from the pods this extender sees, from its current mix
    /// on, instead of the engine's fixed one (see `scheduler::mix`).
    pub fn with_mix_learner(mut self, learner: MixLearner) -> Self {
        let learning = Learning::new(learner);
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.engine.mix = learning.current().clone();
        st.mix_taken_at = learning.learner().observed();
        self.learning = Some(Mutex::new(learning));
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
        self.log_with(|log| log.write(d));
    }

    fn log_with(&self, f: impl FnOnce(&PlacementLog) -> std::io::Result<()>) {
        if let Some(log) = &self.log {
            if let Err(e) = f(log) {
                self.metrics.placement_log_error();
                tracing::warn!(error = %e, "placement log line not written");
            }
        }
    }

    /// Writes the filter repeats the placement log still holds (at shutdown).
    pub fn finish_placement_log(&self) {
        self.log_with(PlacementLog::finish);
    }

    fn decision(&self, verb: &str, pod: &dyn PodView, started: Instant) -> Decision {
        Decision {
            v: PLACEMENT_LOG_VERSION,
            ts_unix_ms: now_unix_ms(),
            verb: verb.into(),
            pod: pod.key(),
            uid: pod.uid().to_string(),
            latency_us: started.elapsed().as_micros() as u64,
            ..Decision::default()
        }
    }

    /// How filter and prioritize start: the decision line for `verb` with how the candidates came
    /// and how many.
    fn candidates_decision(&self, verb: &str, q: &NodeQuery<'_>, started: Instant) -> Decision {
        let mut d = self.decision(verb, q.pod, started);
        d.mode = Some(q.mode().into());
        d.candidates = q.names.len();
        d
    }

    /// The pod's request, remembered for bind from this filter body, unless the pods are watched:
    /// then only the pod watcher's view of the pod (the API server's) is remembered, so that a body
    /// sent by anyone who reaches the port can never change what bind places.
    pub fn remember_pod(&self, pod: &dyn PodView) -> Result<PodRequest, String> {
        let request = pod.request();
        if !pod.uid().is_empty() && !self.pods_watched() {
            let key = pod.key();
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let known = seen.by_uid.get(pod.uid()).is_some_and(|s| s.key == key && s.request == request);
            if !known {
                let constraints = pod.node_constraints();
                seen.insert(SeenPod { key, uid: pod.uid().to_string(), request: request.clone(), constraints });
            }
        }
        request
    }

    /// From now on, the pod watcher alone tells bind what a pod requests and requires (API-server
    /// mode): see [`remember_pod`](Self::remember_pod).
    pub fn set_pods_watched(&self) {
        self.pods_watched.store(true, Ordering::Relaxed);
        self.write().groups.reserve_only_for_existing();
    }

    pub fn pods_watched(&self) -> bool {
        self.pods_watched.load(Ordering::Relaxed)
    }

    /// The node watcher's word on a Node's taints (`None`: the Node is gone).
    pub fn observe_node_taints(&self, name: &str, taints: Option<Vec<Taint>>) {
        let mut all = self.node_taints.lock().unwrap_or_else(|e| e.into_inner());
        match taints.filter(|t| !t.is_empty()) {
            Some(t) if all.get(name) != Some(&t) => {
                all.insert(name.to_string(), t);
            }
            Some(_) => {}
            None => {
                all.remove(name);
            }
        }
    }

    pub fn taints_of(&self, name: &str) -> Vec<Taint> {
        self.node_taints.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned().unwrap_or_default()
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
        // its GPUs may be new: the typical and largest GPU memory are computed again at the next need
        st.gpu_memory_mib.store(UNKNOWN_GPU_MEMORY, Ordering::Relaxed);
        *st.largest_gpus.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        for c in st.cluster.upsert_node(node) {
            if c.kept {
                // the pod still holds the GPUs: counted over capacity, never dropped
                tracing::warn!(pod = %c.pod, node = %name, reason = %c.reason, "allocation exceeds the node's new inventory; still counted until the pod goes");
            } else {
                self.metrics.conflict(ConflictKind::BadAssignment);
                tracing::warn!(pod = %c.pod, node = %name, reason = %c.reason, "allocation names GPUs the node's new inventory lacks; dropped");
            }
        }
        // a node deleted and created again: its pods' allocations count again where they still fit
        for a in st.parked.remove(&name).unwrap_or_default() {
            let pod = a.pod.clone();
            // a claim's allocation holds the devices whatever else is counted (the `claims` submodule)
            let counted = if gpuplace_core::dra::claims::is_observed_key(&pod) {
                st.cluster.count_observed(a).map(|_| ())
            } else {
                st.cluster.allocate(a)
            };
            if let Err(e) = counted {
                self.metrics.conflict(ConflictKind::BadAssignment);
                tracing::warn!(pod = %pod, node = %name, error = %e, "allocation kept from the deleted node no longer fits; dropped");
                if let Some(uid) = st.uid_of.remove(&pod) {
                    st.bound.remove(&uid);
                    st.books.mark(&name);
                }
            }
        }
        // a planned node that changed may no longer hold its group's reservations
        let events = Self::groups_after_node_change(st);
        self.group_events(events);
    }

    /// Rebuilds every allocation from pod assignment annotations (after a restart). Each annotation
    /// must carry gpuplace's MAC (see the `trust` submodule) and is validated against its pod's
    /// request, node and the node's GPUs; a refused one, or one that
    /// collides with a record applied before it (records apply in pod-name order), is not counted and
    /// is returned. Bind sequences continue after the highest one seen per node.
    pub fn restore(&self, pods: Vec<RestoredPod>) -> Vec<RestoreConflict> {
        let mut st = self.write();
        let mut conflicts = Vec::new();
        let mut records = Vec::new();
        let mut meta: HashMap<String, BoundPod> = HashMap::new();
        let mut last_seq: HashMap<String, u64> = HashMap::new();
        let mut refused: HashMap<String, (String, Option<String>)> = HashMap::new();
        // (UID, request) of the records trusted, for the learned mix
        let mut arrived = Vec::new();
        let keys = self.key_ring();
        for p in pods {
            // a record this process did not write counts only with gpuplace's MAC: a forged one
            // never reaches the pod-name-order collision rule below, nor moves a bind sequence
            let checked =
                self.checked_assignment(&st.cluster, keys.as_deref(), &p.annotation, &p.uid, &p.node, &p.request);
            match checked {
                Ok((record, seq, signed_by)) => {
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
                            signed_by,
                        },
                    );
                    records.push(record);
                    arrived.push((p.uid, p.request));
                }
                Err(e) => {
                    self.metrics.conflict(ConflictKind::BadAssignment);
                    tracing::warn!(pod = %p.request.key, error = %e, "assignment annotation not trusted");
                    refused.insert(p.uid.clone(), (p.annotation.clone(), Some(p.node.clone())));
                    conflicts.push(RestoreConflict { pod: p.request.key.clone(), reason: e.to_string() });
                }
            }
        }
        // claims' allocations and DRA nodes' host use come from their watchers, not from annotations: kept
        let claims = Self::observed_records(&st.cluster);
        for c in st.cluster.rebuild(records) {
            self.metrics.conflict(ConflictKind::BadAssignment);
            tracing::warn!(pod = %c.pod, reason = %c.reason, "assignment collides with another pod's; not counted");
            if let Some(b) = meta.remove(&c.pod) {
                refused.insert(b.uid, (b.annotation.unwrap_or_default(), Some(b.node)));
            }
            conflicts.push(RestoreConflict { pod: c.pod, reason: c.reason.to_string() });
        }
        for c in claims {
            if let Err(e) = st.cluster.count_observed(c) {
                tracing::warn!(error = %e, "claim allocation collides with a restored pod's; not counted");
            }
        }
        st.bound.clear();
        st.books.reset();
        st.uid_of.clear();
        st.parked.clear();
        st.withdrawn.clear();
        st.bound_at.clear();
        st.refused = refused;
        // awaiting their admission until the pod watcher shows their markers (it does, right after)
        st.awaiting.clear();
        for (key, b) in meta {
            if b.annotation.is_some() {
                st.awaiting.entry(b.node.clone()).or_default().insert(b.uid.clone());
            }
            st.uid_of.insert(key, b.uid.clone());
            st.bound.insert(b.uid.clone(), b);
        }
        st.last_seq = last_seq;
        // the rebuild dropped every reservation: plans are made again at their members' next filter
        st.groups.forget_plans();
        for (uid, req) in &arrived {
            if let Some(b) = st.bound.get(uid) {
                let (key, node) = (b.key.clone(), b.node.clone());
                st.groups.member_bound(uid, &key, req, &node);
            }
        }
        arrived.retain(|(uid, _)| st.bound.contains_key(uid));
        drop(st);
        self.observe_rebuilt(&arrived);
        conflicts
    }

    // ---- filter and prioritize ----

    /// In full-Nodes mode, takes each Node object's inventory (and utilization) annotation into the
    /// node cache when it changed. Refused annotations are treated as absent, logged and counted.
    fn learn_nodes(&self, items: &[NodeObject<'_>]) {
        let mut inventories = Vec::new();
        let mut utilizations = Vec::new();
        {
            let st = self.read();
            for item in items {
                let name = item.name;
                let mut redefined = false;
                if let Some(text) = item.annotations.get(ANNOTATION_INVENTORY) {
                    let same = st.node_sources.get(name).is_some_and(|(t, l)| t == text && l == item.labels);
                    if !same {
                        redefined = true;
                        inventories.push((name.to_string(), text.clone(), item.labels.clone()));
                    }
                }
                if let Some(text) = item.annotations.get(ANNOTATION_UTILIZATION) {
                    // a redefined node starts without samples: an unchanged value applies again
                    if redefined || Self::annotation_utilization_pending(&st, name, text) {
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
                    self.utilization_redefined_locked(&mut st, &name);
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
            self.observe_annotation_utilization_locked(&mut st, &name, &text);
        }
    }

    /// The clock scores are computed against (utilization samples age).
    fn now_ms(&self) -> i64 {
        match self.clock.load(Ordering::Relaxed) {
            SYSTEM_CLOCK => now_unix_ms(),
            fixed => fixed,
        }
    }

    /// Fixes the clock filter and prioritize judge utilization samples' age by (tests and replays
    /// that need time to stand still or jump); `None` goes back to the system clock.
    pub fn set_clock(&self, now_unix_ms: Option<i64>) {
        self.clock.store(now_unix_ms.unwrap_or(SYSTEM_CLOCK), Ordering::Relaxed);
    }

    /// (node verdicts answered from the shape cache, node verdicts judged afresh for it).
    pub fn shape_cache_stats(&self) -> (u64, u64) {
        self.shapes.stats()
    }

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        let observed = self.mix_observed();
        let st = self.read();
        let bound = st
            .cluster
            .nodes()
            .iter()
            .map(|n| n.pods().filter(|a| !crate::scheduler::groups::is_reservation(&a.pod)).count())
            .sum();
        self.metrics.set_groups(&st.groups.stats(&st.cluster, Instant::now()));
        self.metrics.set_signed_with_old_key(self.signed_with_old_key(&st));
        self.metrics.set_mix(observed, st.engine.mix.entries.len() as u64);
        let reserve = st.engine.reserve_classes(&st.cluster);
        let scarce = reserve.iter().filter(|(_, _, scarce)| *scarce).count() as u64;
        self.metrics.set_reserve(scarce, (reserve.len() as u64).saturating_sub(scarce));
        self.metrics.render(&st.cluster, bound, self.is_ready())
    }

    /// Every node (or one), per GPU.
    pub fn inspect(&self, node: Option<&str>) -> Option<crate::scheduler::inspect::InspectReport> {
        let mix = self.mix_report();
        let st = self.read();
        let mut report =
            crate::scheduler::inspect::InspectReport::build(&st.cluster, node, self.is_ready(), now_unix_ms())?;
        report.mix = Some(mix);
        report.groups = st.groups.report(&st.cluster, Instant::now());
        Some(report)
    }

    /// Totals over the cluster.
    pub fn summary(&self) -> ClusterSummary {
        ClusterSummary::of(&self.read().cluster)
    }
}

mod admission;
mod bind;
pub mod books;
pub mod claims;
mod eval_cache;
mod filter;
mod groups;
mod learning;
pub mod observe;
mod offers;
mod preempt;
mod prioritize;
pub mod trust;
pub mod utilization;
use eval_cache::{EvalCache, NOT_JUDGED, REJECTED};

/// A per-process random ring: static mode signs with it (nothing is read back from annotations
/// there), API-server mode until the Secret's ring is installed. `None` only if the OS random
/// generator fails.
fn ephemeral_keys() -> Option<Arc<KeyRing>> {
    match KeyRing::generate() {
        Ok(keys) => Some(Arc::new(keys)),
        Err(e) => {
            tracing::error!(error = %e, "no per-process assignment key; binds are refused until a key ring is installed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(uid: &str) -> SeenPod {
        SeenPod { key: format!("ns/{uid}"), uid: uid.into(), request: Err("x".into()), constraints: Err("x".into()) }
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
