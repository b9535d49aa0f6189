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
//! The engine lives in the state too: a learned request mix (`extender::mix`, the `learning`
//! submodule) is replaced under the write lock, so each request scores with one mix throughout and
//! every cached answer made with the old one is dropped at once.
//!
//! Seams for API-server mode (`src/apiserver/`): the watchers call [`Extender::observe_node`],
//! [`Extender::remove_node`], [`Extender::observe_pod`], [`Extender::release_pod`],
//! [`Extender::retain_pods`], [`Extender::restore`] and [`Extender::set_ready`] (the decisions on
//! what to trust are in the `observe` submodule, the assignment MAC and its keys in `trust`), and
//! the utilization ConfigMap watcher calls [`Extender::observe_utilization`] and
//! [`Extender::forget_utilization`] (the `utilization` submodule); the kube-rs binder implements
//! [`Binder`].

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::core::annotations::{
    AssignmentAnnotation, NodeInventory, ANNOTATION_ASSIGNMENT, ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use crate::core::cluster::{Cluster, Node, PodAssignment};
use crate::core::resources::PodRequest;
use crate::core::signing::{KeyId, KeyRing};
use crate::extender::adapt::NodeListMode;
use crate::extender::binder::{BindRequest, Binder};
use crate::extender::groups::{Groups, DEFAULT_GROUP_TIMEOUT};
use crate::extender::metrics::{BindOutcome, ClusterSummary, ConflictKind, Metrics, RejectClass};
use crate::extender::mix::Learning;
use crate::extender::placement_log::{
    CapacitySummary, Chosen, ChosenGpu, Decision, PlacementLog, Requests, TopScore, PLACEMENT_LOG_VERSION,
};
use crate::extender::reasons::{self, prefixed, UnknownNode, MAX_DETAILED_NODES};
use crate::extender::requeue::{RecentRejections, Requeuer};
use crate::extender::shapes::{
    self, Answer, Candidates, NameOrder, Reason, ReasonKey, Shape, ShapeCache, DEFAULT_SHAPE_CACHE,
};
use crate::extender::wire::{
    decode, decode_args, ExtenderArgsRef, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, HostPriorityList, MetaPod, MetaVictims, Pod, WireError, WireNode,
    MAX_EXTENDER_PRIORITY,
};
use crate::placement::engine::{Engine, Evaluation, Rejection};
use crate::placement::mix_learner::MixLearner;
use crate::placement::scorers::network::GroupView;

/// What filter and bind answer (in `Error`) while the state is not complete or this replica is not
/// the leader; prioritize and preempt, which have no error field, get HTTP 503.
pub const NOT_READY: &str = "gpuplace: not ready (state not rebuilt yet, or not the leader); retry";

/// How many pods from filter requests are remembered for bind. kube-scheduler binds a pod right
/// after filtering it, so this only needs to cover the pods in flight at once.
pub const DEFAULT_POD_CACHE: usize = 10_000;

/// Placement log lines name at most this many top nodes.
const TOP_NODES: usize = 5;

/// A node that fits, as the answer ranks it: (its position or index, score, the engine's total).
type Ranked = (usize, u8, f32);

/// Keeps the `n` best of `fits` (any order among them): by score, then total, then the first.
fn keep_best(fits: &mut Vec<Ranked>, n: usize) {
    if n == 0 || fits.len() <= n {
        return;
    }
    let best = |a: &Ranked, b: &Ranked| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.0.cmp(&b.0));
    fits.select_nth_unstable_by(n - 1, best);
    fits.truncate(n);
}

/// How many pods' filter evaluations are kept for the prioritize call that follows. kube-scheduler
/// prioritizes a pod right after filtering it, one pod at a time per profile; this covers many in
/// flight at once.
pub const DEFAULT_EVAL_CACHE: usize = 64;

/// A cached evaluation is reused at most this long after it was made: prioritize follows filter
/// within milliseconds, and the cache is not meant to serve later pods. (Scores that depend on the
/// clock are covered by the evaluation's validity window, not by this.)
const EVAL_CACHE_MAX_AGE: Duration = Duration::from_secs(1);

/// `Extender::clock` when no fixed time is set.
const SYSTEM_CLOCK: i64 = i64::MIN;

/// [`State::gpu_memory_mib`] before it is computed.
const UNKNOWN_GPU_MEMORY: u64 = u64::MAX;

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
    /// starts a new generation and empties the shape cache (see [`Extender::take_mix`]), so every
    /// request sees one mix throughout and no cached answer outlives the mix it was made with.
    engine: Engine,
    /// Observations the learner had counted when `engine.mix` was taken (0 for a fixed mix): a mix
    /// taken earlier never replaces a later one.
    mix_taken_at: u64,
    /// The cluster's typical GPU memory, by which the learner reads shares given in memory
    /// ([`typical_gpu_memory_mib`](crate::placement::mix_learner::typical_gpu_memory_mib)), or [`UNKNOWN_GPU_MEMORY`]: computed under the read lock at the
    /// first need, forgotten whenever a node is added, replaced or removed.
    gpu_memory_mib: AtomicU64,
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
    /// Groups placed whole: their members, plans and reservations (`extender::groups`). Here, under
    /// the state's lock, because reservations are allocations in `cluster`.
    groups: Groups,
}

/// Options of the service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    pub pod_cache: usize,
    /// Pods whose filter evaluation prioritize may reuse (0: none, prioritize evaluates again). Used
    /// for the pods the shape cache does not take (groups), or all pods when it is off.
    pub eval_cache: usize,
    /// Request shapes whose per-node verdicts later pods of the same shape reuse (0: off; see
    /// `extender::shapes`).
    pub shape_cache: usize,
    /// Answer as ready from the start (static mode: the cluster file is the whole truth).
    pub ready: bool,
    /// Count assignments that carry no `sig` at all (never ones whose `sig` does not verify): for
    /// one upgrade from a version that did not sign (`--accept-unsigned-assignments`).
    pub accept_unsigned: bool,
    /// How long a group's plan holds GPUs for members not bound yet (`extender::groups`).
    pub group_timeout: Duration,
    /// How many of the nodes that fit filter offers to kube-scheduler's scoring.
    pub nodes_to_score: NodesToScore,
}

/// How many of the nodes that fit a filter answer names, the best first by the engine's ranking (0:
/// every one). kube-scheduler scores only the nodes an extender's filter passes, and skips scoring
/// and prioritize altogether when one is left: at 1,000 nodes its scoring and the prioritize call
/// were most of a pod's scheduling cycle (docs/performance.md, "Scale"). Pods whose preferences
/// kube-scheduler weighs (preferred affinity, `ScheduleAnyway` spread) get `soft` nodes to choose
/// from. The library's default is every node; `gpuplace serve` offers 1 and 16.
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

/// The extender.
pub struct Extender {
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
    /// Signs the assignments bind writes and verifies those read back (the `trust` submodule). A
    /// per-process random ring until [`Extender::set_key_ring`] installs the shared one; `None` only
    /// if the OS random generator failed, and then bind refuses rather than write unsigned records.
    keys: RwLock<Option<Arc<KeyRing>>>,
    accept_unsigned: bool,
    /// Pods turned away for want of free GPUs, for a few seconds (`extender::requeue`), and who
    /// sends them back to kube-scheduler's queue when GPUs they were turned away from are freed
    /// (unset: nobody, as in static mode, where no watch lags).
    rejections: Mutex<RecentRejections>,
    requeuer: OnceLock<Arc<dyn Requeuer>>,
    nodes_to_score: NodesToScore,
}

impl std::fmt::Debug for Extender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extender").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

/// Filter's and prioritize's evaluation of the known candidates without the shape cache.
struct Judged {
    /// Per node index: the score (0..=10) where the pod fits, [`REJECTED`] or [`NOT_JUDGED`].
    scores: Vec<i8>,
    /// Why each rejected node (by index) was turned down (filter only).
    rejects: HashMap<usize, Arc<Reason>>,
    /// The engine's total behind each score, by node index.
    totals: HashMap<usize, f32>,
    evaluation: Evaluation,
}

impl Judged {
    /// The verdict on node `i` (`None` when not judged, or rejected without a reason).
    fn answer(&self, i: usize) -> Option<Answer> {
        match self.scores.get(i).copied() {
            Some(s) if s >= 0 => Some(Answer::Fits(s as u8, self.totals.get(&i).copied().unwrap_or(0.0))),
            Some(REJECTED) => self.rejects.get(&i).map(|r| Answer::No(r.clone())),
            _ => None,
        }
    }
}

/// Reasons for candidates not in the node cache, one per kind (they name no node).
struct Unknown<'a> {
    objects: Option<&'a [WireNode]>,
    reasons: [Option<Arc<Reason>>; UnknownNode::ALL.len()],
}

impl<'a> Unknown<'a> {
    fn new(args: &'a ExtenderArgsRef<'_>) -> Self {
        Self { objects: args.nodes.as_ref().map(|l| l.items.as_slice()), reasons: Default::default() }
    }

    /// The verdict on the unknown candidate at position `p`.
    fn answer(&mut self, p: usize) -> Answer {
        let kind = UnknownNode::of(self.objects.and_then(|o| o.get(p)));
        // a fieldless enum in `ALL` order: its discriminant is its index
        let slot = &mut self.reasons[kind as usize];
        let r = slot.get_or_insert_with(|| Arc::new(Reason::new(RejectClass::UnknownNode, kind.reason())));
        Answer::No(r.clone())
    }
}

/// What filter answers with: an extender error, or a verdict per candidate.
enum Filtered<'a> {
    Error(String),
    Judged(Candidates<'a>, Vec<Answer>),
}

/// A pod's filter evaluation, reused by the prioritize call that follows it.
struct CachedEval {
    uid: String,
    request: PodRequest,
    generation: u64,
    made: Instant,
    /// When (Unix ms) the scores hold: every judged node's utilization samples keep their
    /// freshness in it.
    window: (i64, i64),
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
    /// request) at this generation, recent enough and valid at `now`, covered every known candidate.
    fn scores(
        &mut self,
        uid: &str,
        req: &PodRequest,
        generation: u64,
        now: i64,
        at: &[Option<usize>],
    ) -> Option<(Vec<i8>, Vec<TopScore>)> {
        let found = self.entries.iter().find(|e| {
            e.uid == uid
                && e.generation == generation
                && e.made.elapsed() <= EVAL_CACHE_MAX_AGE
                && e.window.0 <= now
                && now < e.window.1
                && e.request == *req
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
            engine,
            mix_taken_at: 0,
            gpu_memory_mib: AtomicU64::new(UNKNOWN_GPU_MEMORY),
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
        };
        Self {
            state: RwLock::new(state),
            learning: None,
            seen: Mutex::new(PodCache { cap: opts.pod_cache, ..PodCache::default() }),
            evals: Mutex::new(EvalCache { cap: opts.eval_cache, ..EvalCache::default() }),
            shapes: ShapeCache::new(opts.shape_cache),
            names: NameOrder::default(),
            clock: AtomicI64::new(SYSTEM_CLOCK),
            binder,
            metrics: Metrics::new(),
            log: None,
            ready: AtomicBool::new(opts.ready),
            keys: RwLock::new(trust::ephemeral_keys()),
            accept_unsigned: opts.accept_unsigned,
            rejections: Mutex::new(RecentRejections::default()),
            requeuer: OnceLock::new(),
            nodes_to_score: opts.nodes_to_score,
        }
    }

    /// Who sends pods back to kube-scheduler's queue when GPUs they were just turned away from are
    /// freed (`extender::requeue`); the first one set stays.
    pub fn set_requeuer(&self, requeuer: Arc<dyn Requeuer>) {
        let _ = self.requeuer.set(requeuer);
    }

    fn rejections(&self) -> std::sync::MutexGuard<'_, RecentRejections> {
        self.rejections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After filter: a pod that fits nowhere among the candidates is remembered with the nodes where
    /// only capacity stood in the way (preemptable rejections); one that fits is forgotten.
    fn note_verdict(&self, pod: &Pod, c: &Candidates<'_>, answers: &[Answer], feasible: usize, read_at: Instant) {
        let Some(requeuer) = self.requeuer.get() else { return };
        let uid = &pod.metadata.uid;
        if uid.is_empty() {
            return;
        }
        if feasible > 0 {
            self.rejections().forget(uid);
            return;
        }
        let capacity = c
            .unique()
            .filter(|&p| matches!(&answers[p], Answer::No(r) if r.class == RejectClass::Preemptable))
            .map(|p| c.names[p]);
        let due = self.rejections().record(
            uid,
            &pod.metadata.namespace,
            &pod.metadata.name,
            capacity,
            read_at,
            Instant::now(),
        );
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
    /// on, instead of the engine's fixed one (see `extender::mix`).
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
        // its GPUs may be new: the typical GPU memory is computed again at the next need
        st.gpu_memory_mib.store(UNKNOWN_GPU_MEMORY, Ordering::Relaxed);
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
            if let Err(e) = st.cluster.allocate(a) {
                self.metrics.conflict(ConflictKind::BadAssignment);
                tracing::warn!(pod = %pod, node = %name, error = %e, "allocation kept from the deleted node no longer fits; dropped");
                if let Some(uid) = st.uid_of.remove(&pod) {
                    st.bound.remove(&uid);
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
                let mut redefined = false;
                if let Some(text) = view.metadata.annotations.get(ANNOTATION_INVENTORY) {
                    let same = st.node_sources.get(name).is_some_and(|(t, l)| t == text && *l == view.metadata.labels);
                    if !same {
                        redefined = true;
                        inventories.push((name.to_string(), text.clone(), view.metadata.labels.clone()));
                    }
                }
                if let Some(text) = view.metadata.annotations.get(ANNOTATION_UTILIZATION) {
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

    /// The shape cache entry for this pod, unless its verdicts are not cacheable (a group's pod).
    /// With a placement log too: the log's top scores come from [`Self::top_of_cached`].
    fn cached_shape(&self, req: &PodRequest) -> Option<Arc<Shape>> {
        self.shapes.shape(req)
    }

    /// The placement log's `top` where the verdicts came from the shape cache, which keeps no
    /// scorer's part: the best [`TOP_NODES`] of `fits` (node index, score, total) by score, then
    /// total, evaluated again in full. Only for a line that is written.
    fn top_of_cached(st: &State, req: &PodRequest, mut fits: Vec<Ranked>, now: i64) -> Vec<TopScore> {
        keep_best(&mut fits, TOP_NODES);
        let nodes: Vec<usize> = fits.iter().map(|f| f.0).collect();
        let ev = st.engine.evaluate_in_order(&st.cluster, req, &nodes, now, true);
        Self::top_scores(st, req, &ev, now)
    }

    /// When the scores of the judged nodes (`scores` by index) hold: the intersection of their windows.
    fn window_of(st: &State, scores: &[i8], now: i64) -> (i64, i64) {
        let judged = st.cluster.nodes().iter().zip(scores).filter(|(_, &s)| s != NOT_JUDGED);
        judged.fold((i64::MIN, i64::MAX), |(from, until), (n, _)| {
            let (f, u) = st.engine.verdict_window(n, now);
            (from.max(f), until.min(u))
        })
    }

    /// Why the engine rejected a node, as the answer says it: the class and the cause (no text, and
    /// no detail, which only logs read).
    fn rejection(st: &State, req: &PodRequest, r: &Rejection) -> ReasonKey {
        let why = st.engine.classify_rejection(&st.cluster, req, r);
        let unresolvable = why.as_ref().map_or(r.unresolvable, |w| w.is_unresolvable());
        let class = if unresolvable { RejectClass::Unresolvable } else { RejectClass::Preemptable };
        (class, why.map(|w| w.cause()))
    }

    /// The verdict on every candidate from the shape's cache, judging (and caching) the nodes whose
    /// entry is missing, made for another state of the node, or expired. `emit` gets each position
    /// in order with its verdict (`None` for names not in the node cache).
    fn with_cached(
        &self,
        st: &State,
        shape: &Shape,
        req: &PodRequest,
        c: &Candidates<'_>,
        now: i64,
        mut emit: impl FnMut(usize, Option<&Answer>),
    ) {
        let cluster = &st.cluster;
        let stamps = cluster.stamps();
        let mut table = shape.table();
        table.keep_only(st.engine.shared_key(cluster));
        // each node once: what the cache cannot answer
        let mut stale = Vec::new();
        let mut unique = 0;
        for (&i, &first) in c.at.iter().zip(&c.first) {
            if let (Some(i), true) = (i, first) {
                unique += 1;
                if table.get(i, stamps[i], now).is_none() {
                    stale.push(i);
                }
            }
        }
        self.shapes.count(unique - stale.len(), stale.len());
        let mut fresh = HashMap::with_capacity(stale.len());
        if !stale.is_empty() {
            let nodes = cluster.nodes();
            let ev = st.engine.evaluate_in_order(cluster, req, &stale, now, false);
            for cand in &ev.ranked {
                let score = cand.score.clamp(0, MAX_EXTENDER_PRIORITY) as u8;
                fresh.insert(cand.node, Answer::Fits(score, cand.total as f32));
            }
            for r in &ev.rejected {
                let key = Self::rejection(st, req, r);
                let unresolvable = key.0 == RejectClass::Unresolvable;
                fresh.insert(r.node, Answer::No(table.intern(key, || reasons::rejection(key.1, unresolvable))));
            }
            for (&i, a) in &fresh {
                table.set(i, stamps[i], st.engine.verdict_window(&nodes[i], now), a.clone());
            }
        }
        for (p, &i) in c.at.iter().enumerate() {
            // `fresh` too: a verdict whose window does not reach past now is answered but not kept
            emit(p, i.and_then(|i| table.get(i, stamps[i], now).or_else(|| fresh.get(&i))));
        }
    }

    /// Filters and scores the known candidates without the shape cache (each evaluated once however
    /// often it is named). Rejection reasons are written only when `reasons` is set (prioritize
    /// does not send them).
    fn judge(&self, st: &State, req: &PodRequest, c: &Candidates<'_>, now: i64, reasons: bool) -> Judged {
        let cluster = &st.cluster;
        let mut scores = vec![NOT_JUDGED; cluster.nodes().len()];
        let indices: Vec<usize> = c.unique().filter_map(|p| c.at[p]).collect();
        for &i in &indices {
            // marks the node as listed; the evaluation below overwrites the ones that fit
            scores[i] = REJECTED;
        }
        let evaluation = st.engine.evaluate_in_order(cluster, req, &indices, now, self.log.is_some());
        let mut totals = HashMap::with_capacity(evaluation.ranked.len());
        for cand in &evaluation.ranked {
            scores[cand.node] = cand.score.clamp(0, MAX_EXTENDER_PRIORITY) as i8;
            totals.insert(cand.node, cand.total as f32);
        }
        let mut rejects = HashMap::with_capacity(if reasons { evaluation.rejected.len() } else { 0 });
        // the engine filters without classifying rejections; only rejected nodes pay for it, and
        // nodes rejected for the same cause share one reason
        let mut texts: HashMap<ReasonKey, Arc<Reason>> = HashMap::new();
        for r in evaluation.rejected.iter().filter(|_| reasons) {
            let key = Self::rejection(st, req, r);
            let reason = texts.entry(key).or_insert_with(|| {
                let text = reasons::rejection(key.1, key.0 == RejectClass::Unresolvable);
                Arc::new(Reason::new(key.0, text))
            });
            rejects.insert(r.node, reason.clone());
        }
        Judged { scores, rejects, totals, evaluation }
    }

    /// The first [`MAX_DETAILED_NODES`] rejected candidates, in the order sent, with the node's own
    /// figures behind the reason each was given.
    fn rejection_details(
        st: &State,
        req: &PodRequest,
        args: &ExtenderArgsRef<'_>,
        c: &Candidates<'_>,
        answers: &[Answer],
    ) -> Vec<(String, String, Arc<Reason>)> {
        let objects = args.nodes.as_ref().map(|l| l.items.as_slice());
        let rejected = c.unique().filter_map(|p| match answers.get(p) {
            Some(Answer::No(r)) => Some((p, r)),
            _ => None,
        });
        rejected
            .take(MAX_DETAILED_NODES)
            .map(|(p, r)| {
                let name = c.names[p];
                let detail = match c.at[p] {
                    // the same node state the answer was made from (the read lock is held)
                    Some(i) => st
                        .engine
                        .explain(&st.cluster, req, i)
                        .map_or_else(|| r.text.clone(), |w| w.why().detail.clone()),
                    None => UnknownNode::of(objects.and_then(|o| o.get(p))).detail(name),
                };
                (name.to_string(), detail, r.clone())
            })
            .collect()
    }

    /// The best nodes with each scorer's share, re-scored in full (the ranking pass keeps only totals).
    fn top_scores(st: &State, req: &PodRequest, ev: &Evaluation, now: i64) -> Vec<TopScore> {
        let cluster = &st.cluster;
        let group = req.group.as_ref().map(|g| GroupView::new(cluster, g));
        ev.ranked
            .iter()
            .take(TOP_NODES)
            .map(|c| {
                let parts = c
                    .placement(cluster, req)
                    .map(|p| st.engine.score(cluster, req, c.node, &p, now, group.as_ref()).parts)
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
        let args = decode_args(body)?;
        Ok(match self.filter_args(&args)? {
            Filtered::Error(e) => ExtenderFilterResult::error(e),
            Filtered::Judged(c, answers) => shapes::filter_result(&args, &c, &answers),
        })
    }

    /// [`Extender::filter`], answered as the JSON body kube-scheduler reads, encoded directly (what
    /// the HTTP service sends).
    pub fn filter_json(&self, body: &[u8]) -> Result<Vec<u8>, WireError> {
        let args = decode_args(body)?;
        Ok(match self.filter_args(&args)? {
            Filtered::Error(e) => serde_json::to_vec(&ExtenderFilterResult::error(e)).unwrap_or_default(),
            Filtered::Judged(c, answers) => shapes::filter_json(&args, &c, &answers),
        })
    }

    fn filter_args<'a>(&self, args: &'a ExtenderArgsRef<'_>) -> Result<Filtered<'a>, WireError> {
        let started = Instant::now();
        let mode = args.mode()?;
        let names = args.candidate_names()?;
        let mut d = self.decision("filter", &args.pod, started);
        d.mode = Some(mode_name(mode).into());
        d.candidates = names.len();
        if !self.is_ready() {
            // an answer from an incomplete state could place a pod on GPUs that are taken
            d.error = Some(NOT_READY.into());
            return Ok(self.finish(d, started, Filtered::Error(NOT_READY.into())));
        }
        let req = match self.remember_pod(&args.pod) {
            Ok(r) => r,
            Err(reason) => {
                let reason = Arc::new(Reason::new(RejectClass::Contract, prefixed(&reason)));
                self.metrics.rejection(RejectClass::Contract, names.len() as u64);
                self.metrics.pod_filtered(&args.pod.metadata.uid, Some(RejectClass::Contract), Instant::now());
                d.rejections.insert(reason.text.clone(), names.len());
                d.rejection_classes.insert(RejectClass::Contract.name().into(), names.len());
                d.refused = Some(reason.text.clone());
                let answers = vec![Answer::No(reason); names.len()];
                return Ok(self.finish(
                    d,
                    started,
                    Filtered::Judged(Candidates::unresolved(names, args.names_verbatim()), answers),
                ));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            // not ours to judge: kube-scheduler only asks about it when no managedResources are set
            d.feasible = names.len();
            let answers = vec![Answer::Fits(0, 0.0); names.len()];
            return Ok(self.finish(
                d,
                started,
                Filtered::Judged(Candidates::unresolved(names, args.names_verbatim()), answers),
            ));
        }
        if let Some(list) = &args.nodes {
            self.learn_nodes(&list.items);
        }
        // the pod has arrived: counted into the learned mix before it is judged, as the simulator's
        // gpuplace policy counts a pod before it places it
        self.observe_arrival(&args.pod.metadata.uid, &req);
        self.expire_groups();
        if req.group.is_some() {
            if let Some(out) = self.group_filter(&args.pod.metadata.uid, &req, &names, args.names_verbatim(), &mut d) {
                return Ok(self.finish(d, started, out));
            }
        }
        let st = self.read();
        // after the read lock: a freeing stamped later than this is not in the verdict
        let read_at = Instant::now();
        let c = self.names.resolve(&st.cluster, names, args.names_verbatim());
        let now = self.now_ms();
        let mut unknown = Unknown::new(args);
        let mut answers = Vec::with_capacity(c.names.len());
        let from_cache = self.cached_shape(&req);
        let top = match &from_cache {
            Some(shape) => {
                self.with_cached(&st, shape, &req, &c, now, |p, a| {
                    answers.push(match a {
                        Some(a) => a.clone(),
                        None => unknown.answer(p),
                    })
                });
                Vec::new()
            }
            None => {
                let judged = self.judge(&st, &req, &c, now, true);
                // the placement log's top scores re-score nodes in full: only when there is a log
                let top =
                    if self.log.is_some() { Self::top_scores(&st, &req, &judged.evaluation, now) } else { Vec::new() };
                for (p, i) in c.at.iter().enumerate() {
                    answers.push(match i.and_then(|i| judged.answer(i)) {
                        Some(a) => a,
                        None => unknown.answer(p),
                    });
                }
                if !args.pod.metadata.uid.is_empty() {
                    // for the prioritize call that follows (kube-scheduler sends it next, for the same pod)
                    self.evals().insert(CachedEval {
                        uid: args.pod.metadata.uid.clone(),
                        request: req.clone(),
                        generation: st.generation,
                        made: Instant::now(),
                        window: Self::window_of(&st, &judged.scores, now),
                        scores: judged.scores,
                        top: top.clone(),
                    });
                }
                top
            }
        };
        let mut class_counts = [0u64; 4];
        let mut feasible = 0;
        for p in c.unique() {
            match &answers[p] {
                Answer::Fits(..) => feasible += 1,
                Answer::No(r) => class_counts[class_index(r.class)] += 1,
                Answer::NotOffered => {}
            }
        }
        d.feasible = feasible;
        if self.log.is_some() {
            d.top = top;
            for (class, &n) in RejectClass::ALL.iter().zip(&class_counts) {
                if n > 0 {
                    d.rejection_classes.insert(class.name().into(), n as usize);
                }
            }
            for p in c.unique() {
                if let Answer::No(r) = &answers[p] {
                    *d.rejections.entry(r.text.clone()).or_default() += 1;
                }
            }
        }
        // the reasons name no node's figures (kube-scheduler groups nodes by them): those go to the
        // placement log and the debug log, written only for them, and not for a retry whose line
        // the log only counts (its verdict is the pod's last one)
        let logged = self.log.as_ref().is_some_and(|log| log.writes(&d));
        if logged && from_cache.is_some() {
            let fits = c
                .unique()
                .filter_map(|p| match (&answers[p], c.at[p]) {
                    (Answer::Fits(s, t), Some(i)) => Some((i, *s, *t)),
                    _ => None,
                })
                .collect();
            d.top = Self::top_of_cached(&st, &req, fits, now);
        }
        if logged || tracing::enabled!(tracing::Level::DEBUG) {
            for (node, detail, reason) in Self::rejection_details(&st, &req, args, &c, &answers) {
                tracing::debug!(pod = %d.pod, node = %node, reason = %reason.text, detail = %detail, "node rejected");
                d.rejection_details.insert(node, detail);
            }
        }
        drop(st);
        for (class, &n) in RejectClass::ALL.iter().zip(&class_counts) {
            if n > 0 {
                self.metrics.rejection(*class, n);
            }
        }
        let waits_on = if feasible > 0 { None } else { RejectClass::of_pending(&class_counts) };
        self.metrics.pod_filtered(&args.pod.metadata.uid, waits_on, read_at);
        self.note_verdict(&args.pod, &c, &answers, feasible, read_at);
        d.offered = self.offer(&args.pod, &c, &mut answers, feasible);
        Ok(self.finish(d, started, Filtered::Judged(c, answers)))
    }

    /// Narrows an answer where more nodes fit than kube-scheduler is to score ([`NodesToScore`]):
    /// the best by score, then by the engine's total, ties in the order sent (kube-scheduler
    /// rotates where its list starts); the others, and the nodes that do not fit, are left out of
    /// the answer (kube-scheduler reads the failed nodes only when the pod fits nowhere). Returns
    /// how many nodes the answer names, when it was narrowed.
    fn offer(&self, pod: &Pod, c: &Candidates<'_>, answers: &mut [Answer], feasible: usize) -> Option<usize> {
        let n = if pod.spec.has_soft_preferences() { self.nodes_to_score.soft } else { self.nodes_to_score.plain };
        if n == 0 || feasible <= n {
            return None;
        }
        let mut fits: Vec<Ranked> = c
            .unique()
            .filter_map(|p| match answers[p] {
                Answer::Fits(s, t) => Some((p, s, t)),
                _ => None,
            })
            .collect();
        keep_best(&mut fits, n);
        let keep: HashSet<&str> = fits.iter().map(|&(p, ..)| c.names[p]).collect();
        for (a, name) in answers.iter_mut().zip(&c.names) {
            if !matches!(a, Answer::Fits(..)) || !keep.contains(name) {
                *a = Answer::NotOffered;
            }
        }
        Some(n)
    }

    fn finish<T>(&self, mut d: Decision, started: Instant, out: T) -> T {
        d.latency_us = started.elapsed().as_micros() as u64;
        self.log(d);
        out
    }

    /// The prioritize verb: 0..=10 per candidate from the engine; 0 where the pod does not fit.
    /// Answers from the shape cache, or for uncached shapes from filter's evaluation of the same pod
    /// when nothing changed since (see `EvalCache`).
    pub fn prioritize(&self, body: &[u8]) -> Result<HostPriorityList, WireError> {
        let args = decode_args(body)?;
        let (names, scores) = self.prioritize_args(&args)?;
        Ok(shapes::priorities(&names, &scores))
    }

    /// [`Extender::prioritize`], answered as the JSON body kube-scheduler reads.
    pub fn prioritize_json(&self, body: &[u8]) -> Result<Vec<u8>, WireError> {
        let args = decode_args(body)?;
        let (names, scores) = self.prioritize_args(&args)?;
        Ok(shapes::priorities_json(&names, args.names_verbatim(), &scores))
    }

    fn prioritize_args<'a>(&self, args: &'a ExtenderArgsRef<'_>) -> Result<(Vec<&'a str>, Vec<u8>), WireError> {
        let started = Instant::now();
        let mode = args.mode()?;
        let names = args.candidate_names()?;
        let mut d = self.decision("prioritize", &args.pod, started);
        d.mode = Some(mode_name(mode).into());
        d.candidates = names.len();
        let req = match self.remember_pod(&args.pod) {
            Ok(r) => r,
            Err(reason) => {
                d.refused = Some(prefixed(&reason));
                let zeros = vec![0; names.len()];
                return Ok(self.finish(d, started, (names, zeros)));
            }
        };
        d.requests = Some(requests_of(&req));
        if req.is_gpu_free() {
            let zeros = vec![0; names.len()];
            return Ok(self.finish(d, started, (names, zeros)));
        }
        if let Some(list) = &args.nodes {
            self.learn_nodes(&list.items);
        }
        if let Some(scores) = self.group_priorities(&args.pod.metadata.uid, &req, &names) {
            d.feasible = scores.iter().filter(|&&s| s > 0).count();
            return Ok(self.finish(d, started, (names, scores)));
        }
        let st = self.read();
        let c = self.names.resolve(&st.cluster, names, args.names_verbatim());
        let now = self.now_ms();
        // per position: the score, or REJECTED
        let (scores, top): (Vec<i8>, Vec<TopScore>) = match self.cached_shape(&req) {
            Some(shape) => {
                let mut scores = Vec::with_capacity(c.at.len());
                // the log's top scores are made from these; without a log nothing is kept
                let mut fits = Vec::new();
                let logged = self.log.is_some();
                self.with_cached(&st, &shape, &req, &c, now, |p, a| {
                    scores.push(match a {
                        Some(Answer::Fits(s, t)) => {
                            if let (true, Some(i), true) = (logged, c.at[p], c.first[p]) {
                                fits.push((i, *s, *t));
                            }
                            *s as i8
                        }
                        _ => REJECTED,
                    })
                });
                let top = if logged { Self::top_of_cached(&st, &req, fits, now) } else { Vec::new() };
                (scores, top)
            }
            None => {
                let uid = &args.pod.metadata.uid;
                let cached =
                    if uid.is_empty() { None } else { self.evals().scores(uid, &req, st.generation, now, &c.at) };
                match cached {
                    Some(hit) => hit,
                    None => {
                        let judged = self.judge(&st, &req, &c, now, false);
                        let scores = c.at.iter().map(|i| i.map_or(REJECTED, |i| judged.scores[i])).collect();
                        let top = if self.log.is_some() {
                            Self::top_scores(&st, &req, &judged.evaluation, now)
                        } else {
                            Vec::new()
                        };
                        (scores, top)
                    }
                }
            }
        };
        drop(st);
        d.feasible = scores.iter().filter(|&&s| s >= 0).count();
        d.top = top;
        let scores = scores.iter().map(|&s| s.clamp(0, MAX_EXTENDER_PRIORITY as i8) as u8).collect();
        Ok(self.finish(d, started, (c.names, scores)))
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
                    {
                        let mut st = self.write();
                        if let Some(b) = st.bound.get_mut(&args.pod_uid) {
                            b.confirmed = true;
                            st.bound_at.insert(args.pod_uid.clone(), Instant::now());
                        }
                        let done = st.groups.settle(&args.pod_uid).into_iter().collect();
                        let done = st.groups.stamped(&st.cluster, done);
                        drop(st);
                        self.group_events(done);
                    }
                    // counted here if this replica never filtered it (the filter went to another
                    // leader, or the pod watcher remembered it)
                    if let Some(SeenPod { request: Ok(req), .. }) = self.seen_pod(&args.pod_uid) {
                        self.observe_arrival(&args.pod_uid, &req);
                    }
                    (BindOutcome::Bound, None)
                }
                Err(e) => {
                    self.rollback(&args);
                    tracing::warn!(pod = %args.pod_key(), node = %args.node, error = %e, "Binding failed; allocation rolled back");
                    (BindOutcome::BinderFailed, Some(prefixed(&format!("binding failed, GPUs released: {e}"))))
                }
            },
        };
        self.metrics.bind(outcome);
        if outcome.is_success() {
            self.metrics.pod_settled(&args.pod_uid);
        }
        d.outcome = Some(outcome.name().into());
        d.feasible = usize::from(outcome.is_success());
        d.ts_unix_ms = now_unix_ms();
        d.error = error.clone();
        if outcome.is_success() {
            tracing::debug!(pod = %args.pod_key(), node = %args.node, outcome = outcome.name(), "bound");
        } else {
            d.chosen = None;
        }
        if self.log.is_some() {
            // the cluster after this bind, for capacity reports (docs/placement-log.md)
            let st = self.read();
            d.cluster = Some(CapacitySummary::of(&st.cluster, &args.node));
            if d.group.is_some() {
                d.group_totals = Some(st.groups.totals(&st.cluster));
            }
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
        d.group = req.group.as_ref().map(|g| g.key.clone());
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
            signed_by: None,
        };
        let mut annotations = BTreeMap::new();
        if !req.is_gpu_free() {
            // a group member binding where its plan put it takes its reservation's GPUs
            let reserved = Self::take_reservation(st, &args.pod_uid, &key, &args.node);
            let elsewhere = reserved.is_none();
            if elsewhere {
                let events = st.groups.leave_plan(&mut st.cluster, &args.pod_uid, &args.node);
                self.group_events(st.groups.stamped(&st.cluster, events));
            }
            let placement = match reserved {
                Some(assignment) => crate::placement::feasibility::Placement { assignment, set_scores: Vec::new() },
                None => match st.engine.place(&st.cluster, &req, index) {
                    Ok(p) => p,
                    Err(why) => {
                        // the event gets the cause; the node's figures go to the logs
                        tracing::debug!(pod = %key, node = %args.node, detail = %why.detail(), "pod no longer fits on the chosen node");
                        d.rejection_details.insert(args.node.clone(), why.detail().to_string());
                        return fail(
                            BindOutcome::NoFit,
                            format!("pod {key} no longer fits on {}: {}", args.node, why.cause()),
                        );
                    }
                },
            };
            let seq = st.last_seq.get(&args.node).copied().unwrap_or(0) + 1;
            let node = &st.cluster.nodes()[index];
            let annotation =
                match AssignmentAnnotation::from_assignment(&placement.assignment, &args.pod_uid, node, seq) {
                    Ok(a) => a,
                    Err(e) => {
                        Self::restore_reservation(st, &args.pod_uid, &args.node);
                        return Err((BindOutcome::NoFit, prefixed(&e.to_string())));
                    }
                };
            // signed, so that a restarted replica (or the standby) can tell it from a forgery
            let Some(keys) = self.key_ring() else {
                Self::restore_reservation(st, &args.pod_uid, &args.node);
                return fail(BindOutcome::NotReady, "no assignment key to sign the assignment with; retry".into());
            };
            let annotation = annotation.signed(&keys);
            record.signed_by = Some(keys.primary().to_string());
            if let Err(e) = st.cluster.allocate(placement.assignment.clone()) {
                Self::restore_reservation(st, &args.pod_uid, &args.node);
                return Err((
                    BindOutcome::NoFit,
                    prefixed(&format!("pod {key} cannot be counted on {}: {e}", args.node)),
                ));
            }
            if elsewhere {
                st.groups.mark_bound(&args.pod_uid, &args.node);
            } else {
                st.groups.slot_taken(&args.pod_uid, &args.node);
            }
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
        // a group member's slot is held for it again: the other members keep what they hold
        if let Some(res) = st.groups.slot_returned(&args.pod_uid) {
            let _ = st.cluster.allocate(res);
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
        st.engine.place(&scratch, req, 0).ok()?;
        // Reprieve as kube-scheduler does: highest priority first (then in the order sent), keeping a
        // victim whenever the pod still fits with it back. Fit only gets harder as pods come back, so
        // no victim left in the set could be spared given the others: the set is minimal.
        let mut order: Vec<usize> = (0..gpu_victims.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(gpu_victims[i].2.unwrap_or(i32::MIN)));
        let mut evicted = vec![false; gpu_victims.len()];
        for i in order {
            let a = &gpu_victims[i].1;
            if scratch.allocate(a.clone()).is_ok() {
                if st.engine.place(&scratch, req, 0).is_ok() {
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
        let observed = self.mix_observed();
        let st = self.read();
        let bound = st
            .cluster
            .nodes()
            .iter()
            .map(|n| n.pods().filter(|a| !crate::extender::groups::is_reservation(&a.pod)).count())
            .sum();
        self.metrics.set_groups(&st.groups.stats(&st.cluster, Instant::now()));
        self.metrics.set_signed_with_old_key(self.signed_with_old_key(&st));
        self.metrics.set_mix(observed, st.engine.mix.entries.len() as u64);
        let reserve = st.engine.reserve_view(&st.cluster);
        let scarce = u64::from(reserve.scarce.count_ones());
        self.metrics.set_reserve(scarce, (reserve.classes.len() as u64).saturating_sub(scarce));
        self.metrics.render(&st.cluster, bound, self.is_ready())
    }

    /// Every node (or one), per GPU.
    pub fn inspect(&self, node: Option<&str>) -> Option<crate::extender::inspect::InspectReport> {
        let mix = self.mix_report();
        let st = self.read();
        let mut report =
            crate::extender::inspect::InspectReport::build(&st.cluster, node, self.is_ready(), now_unix_ms())?;
        report.mix = Some(mix);
        report.groups = st.groups.report(&st.cluster, Instant::now());
        Some(report)
    }

    /// Totals over the cluster.
    pub fn summary(&self) -> ClusterSummary {
        ClusterSummary::of(&self.read().cluster)
    }
}

mod groups;
mod learning;
mod observe;
mod trust;
mod utilization;
pub use observe::{NodeOutcome, ObservedPod, PodOutcome};
pub use trust::Resign;
pub use utilization::UtilizationOutcome;

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
