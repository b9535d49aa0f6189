//! The hot path of filter and prioritize (docs/performance-journal.md, "filter+prioritize load"):
//!
//! - `ShapeCache`: each node's verdict (fits with a score, or the rejection and its reason) per
//!   request *shape*, reused by later pods of the same shape while the node is unchanged.
//!   kube-scheduler schedules the replicas of a Deployment or Job one after another, all of one
//!   shape, and between two of them usually only the node of the last bind changed.
//! - `NameOrder`: candidate names to node indices, guessing each from the order of the last
//!   request (kube-scheduler sends its node list in a stable order) before hashing.
//! - [`Answer`]: each candidate's verdict, the filter's decision; each [`Reason`] carries its text
//!   encoded once as a JSON string, for the front ends that write JSON (`extender::answers`).
//!
//! # When a cached verdict is used
//!
//! A verdict is a pure function of the pod's request, the node, the clock (utilization samples
//! count only while fresh), which of the mix's reserve classes are scarce in the whole cluster
//! ([`Engine::shared_key`](crate::placement::engine::Engine::shared_key): a table's verdicts are
//! dropped when it changes, see `Table::keep_only`) and, for pods of a `gpuplace.io/group`, where
//! the group's other pods are.
//! The profile is fixed for the process; the learned mix changes now and then, and the whole cache
//! is emptied when it does (`ShapeCache::clear`). So an entry is keyed by the whole
//! [`PodRequest`] except the pod's name (policies, NUMA, GPU models and containers are all in it),
//! and is used only when
//! - the node's stamp ([`Node::generation`](gpuplace_core::cluster::Node::generation)) is the one it
//!   was made at: every change to the node (allocate, release, new inventory, utilization, any edit
//!   through [`Cluster::node_mut`]) takes a new stamp, never reused, and
//! - now lies in the span in which the node's utilization samples keep their freshness
//!   ([`stable_window`](crate::placement::scorers::utilization::stable_window)).
//!
//! Pods of a group are never cached: their network score depends on other nodes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::placement::feasibility::Cause;
use crate::scheduler::reasons;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::PodRequest;

/// The top of the score scale (0..=10) each fitting node gets: kube-scheduler's
/// `MaxExtenderPriority`.
pub const MAX_SCORE: i64 = 10;

/// Request shapes kept by default: each holds a verdict slot per node (48 bytes; 240 KB for 5,000
/// nodes), least recently used dropped first.
pub const DEFAULT_SHAPE_CACHE: usize = 64;

/// Distinct reasons kept per shape for sharing; beyond it the table starts over (reasons in use stay
/// alive in their slots). Reasons depend on the kind of shortfall only, so a shape has a handful.
const MAX_REASONS: usize = 4096;

/// Why filter turned a node down, coarsely (the exact reasons go to the placement log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectClass {
    /// The pod's request breaks the resource contract: it fits nowhere.
    Contract,
    /// gpuplace knows nothing about the node's GPUs.
    UnknownNode,
    /// Never fits on this node, whatever is evicted.
    Unresolvable,
    /// Might fit after preemption.
    Preemptable,
}

impl RejectClass {
    pub const ALL: [RejectClass; 4] =
        [RejectClass::Contract, RejectClass::UnknownNode, RejectClass::Unresolvable, RejectClass::Preemptable];

    pub fn name(self) -> &'static str {
        match self {
            RejectClass::Contract => "contract",
            RejectClass::UnknownNode => "unknown_node",
            RejectClass::Unresolvable => "unresolvable",
            RejectClass::Preemptable => "preemptable",
        }
    }

    /// Its position in [`RejectClass::ALL`] (per-class counters are arrays in that order).
    pub fn index(self) -> usize {
        RejectClass::ALL.iter().position(|&c| c == self).unwrap_or(0)
    }

    /// What a pod every candidate turned down waits on, from how many nodes each class turned it
    /// down (in [`RejectClass::ALL`] order): a refused request first (it fits nowhere until it is
    /// changed), then capacity (somewhere it would fit after evictions), then nodes gpuplace knows
    /// nothing about (it might fit there once their inventory is published), else nowhere.
    /// `None` when no node turned it down.
    pub fn of_pending(counts: &[u64; 4]) -> Option<RejectClass> {
        [RejectClass::Contract, RejectClass::Preemptable, RejectClass::UnknownNode, RejectClass::Unresolvable]
            .into_iter()
            .find(|c| counts[c.index()] > 0)
    }
}

/// What a rejected node's reason is made from: its class and the engine's cause (`None`: the engine
/// gave none). Nodes with equal keys get one shared reason.
pub(crate) type ReasonKey = (RejectClass, Option<Cause>);

/// Why a node was turned down, as the answer carries it.
#[derive(Debug, PartialEq, Eq)]
pub struct Reason {
    pub class: RejectClass,
    /// With the `gpuplace: ` prefix, as kube-scheduler shows it in the pod's events; never a `%`.
    pub text: String,
    /// `text` as a JSON string, quotes included: escaped once, written for every node it explains.
    json: Vec<u8>,
}

impl Reason {
    pub fn new(class: RejectClass, text: String) -> Self {
        let text = reasons::scrub(text);
        let mut json = Vec::with_capacity(text.len() + 2);
        push_str(&mut json, &text);
        Self { class, text, json }
    }

    /// [`Self::text`] as a JSON string, quotes included.
    pub fn json(&self) -> &[u8] {
        &self.json
    }

    /// `FailedAndUnresolvableNodes` (no preemption helps) rather than `FailedNodes`.
    pub fn unresolvable(&self) -> bool {
        self.class != RejectClass::Preemptable
    }
}

/// One candidate's verdict.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Fits, with its score (0..=10) and the engine's total behind it (0..=1), which ranks nodes of
    /// equal score when the answer offers only the best (`Scheduler::with_nodes_to_score`).
    Fits(u8, f32),
    No(Arc<Reason>),
    /// Fits, but not among the nodes offered: named in neither list of the answer, so that
    /// kube-scheduler drops it from the nodes it scores, as it drops nodes it does not sample.
    NotOffered,
}

/// Filter's decision: an error for the whole request (the scheduler cannot judge now), or a
/// verdict per candidate, in the order given.
#[derive(Debug)]
pub enum FilterDecision<'a> {
    Error(String),
    Judged(Candidates<'a>, Vec<Answer>),
}

// ---------------------------------------------------------------------------------------------------
// Candidates
// ---------------------------------------------------------------------------------------------------

/// One request's candidates, by position in the request.
#[derive(Debug)]
pub struct Candidates<'a> {
    pub names: Vec<&'a str>,
    /// Node index (`None`: not in the node cache).
    pub at: Vec<Option<usize>>,
    /// The first position of its name: failure maps name each node once.
    pub first: Vec<bool>,
}

impl<'a> Candidates<'a> {
    /// Candidates without looking them up (answers that do not depend on the node).
    pub fn unresolved(names: Vec<&'a str>) -> Self {
        let mut seen = HashSet::with_capacity(names.len());
        let first = names.iter().map(|n| seen.insert(*n)).collect();
        Self { at: vec![None; names.len()], first, names }
    }

    /// Positions of first occurrences.
    pub fn unique(&self) -> impl Iterator<Item = usize> + '_ {
        self.first.iter().enumerate().filter(|(_, &f)| f).map(|(p, _)| p)
    }
}

/// Name to node index, guessing from the order of the last request: for each node, the index of
/// the node that followed it. kube-scheduler sends its node list in one order, rotated from call to
/// call, so most guesses are right and cost one comparison with a copy of the node's name (all
/// names in one array: the nodes' own names lie scattered over the heap, a cache miss each)
/// instead of a hash and a probe. A wrong guess falls back to a hash table over that same array:
/// kube-scheduler's filters run on 16 goroutines and list the feasible nodes in the order they
/// finished, so with `nodeCacheCapable` a filter's 1,000 names break the chain every few dozen
/// names, and the cluster's map of `String`s was 7 % of the extender's CPU at 1,000 nodes
/// (docs/performance-journal.md, "The last third"). Shared by all workers: the guesses are
/// relaxed atomics, and a stale guess is only a miss.
#[derive(Debug, Default)]
pub(crate) struct NameOrder {
    table: RwLock<OrderTable>,
}

#[derive(Debug, Default)]
struct OrderTable {
    next: Vec<AtomicU32>,
    /// Each node's name as (start, end) in `arena`, by node index, for the cluster layout `layout`
    /// ([`Cluster::layout`]): removing a node shifts the indices after it, and the table starts over.
    spans: Vec<(u32, u32)>,
    arena: Vec<u8>,
    /// Node indices by their name's hash (the names in `arena`).
    index: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
    layout: u64,
}

impl OrderTable {
    fn is(&self, i: usize, name: &str) -> bool {
        self.spans
            .get(i)
            .and_then(|&(a, b)| self.arena.get(a as usize..b as usize))
            .is_some_and(|n| same(n, name.as_bytes()))
    }

    fn push(&mut self, name: &str) {
        let start = self.arena.len() as u32;
        self.arena.extend_from_slice(name.as_bytes());
        let end = self.arena.len() as u32;
        let i = self.spans.len() as u32;
        self.spans.push((start, end));
        self.next.push(AtomicU32::new(NO_GUESS));
        let hash = self.hasher.hash_one(name.as_bytes());
        let (arena, spans) = (&self.arena, &self.spans);
        let rehash = |&j: &u32| {
            let (a, b) = spans[j as usize];
            self.hasher.hash_one(&arena[a as usize..b as usize])
        };
        self.index.insert_unique(hash, i, rehash);
    }

    /// The index of the node of this name, when the table has it.
    fn find(&self, name: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(name.as_bytes());
        self.index.find(hash, |&i| self.is(i as usize, name)).map(|&i| i as usize)
    }
}

/// `a == b`, inline for the 8-16 byte names this compares thousands of times per request (a
/// `memcmp` call each cost more than the comparison).
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word =
        |s: &[u8], at: usize| s.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()).map(u64::from_ne_bytes);
    if (8..=16).contains(&n) {
        // two (possibly overlapping) words cover it
        word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8)
    } else {
        a == b
    }
}

const NO_GUESS: u32 = u32::MAX;
/// How far along the chain a name is looked for before hashing.
const CHAIN_HOPS: usize = 4;

impl NameOrder {
    pub fn resolve<'a>(&self, cluster: &Cluster, names: Vec<&'a str>) -> Candidates<'a> {
        let nodes = cluster.nodes();
        let stale = |t: &OrderTable| t.layout != cluster.layout() || t.next.len() < nodes.len();
        if stale(&self.table.read().unwrap_or_else(|e| e.into_inner())) {
            let mut w = self.table.write().unwrap_or_else(|e| e.into_inner());
            if w.layout != cluster.layout() {
                *w = OrderTable { layout: cluster.layout(), ..OrderTable::default() };
            }
            while w.next.len() < nodes.len() {
                let i = w.next.len();
                w.push(&nodes[i].name);
            }
        }
        let t = self.table.read().unwrap_or_else(|e| e.into_inner());
        let mut at = Vec::with_capacity(names.len());
        let mut first = Vec::with_capacity(names.len());
        let mut seen = vec![false; nodes.len()];
        let mut unknown: HashSet<&str> = HashSet::new();
        let mut prev: Option<usize> = None;
        for &name in &names {
            // prioritize sends the nodes filter passed, in filter's order: a few hops along the
            // chain skip the ones it turned down (and leave filter's chain as it was)
            let mut guess = prev;
            let mut found = None;
            for _ in 0..CHAIN_HOPS {
                guess = guess.and_then(|g| t.next.get(g)).map(|g| g.load(Ordering::Relaxed) as usize);
                match guess {
                    Some(g) if t.is(g, name) => {
                        found = Some(g);
                        break;
                    }
                    Some(_) => {}
                    None => break,
                }
            }
            let i = match found {
                Some(g) => Some(g),
                None => {
                    // the table was made from this cluster (callers hold the state's read lock), so
                    // a name it lacks is not a node; the cluster's map stays the last word
                    let i = t.find(name).filter(|&i| i < nodes.len()).or_else(|| cluster.node_index(name));
                    if let (Some(p), Some(i)) = (prev, i) {
                        if let Some(slot) = t.next.get(p) {
                            slot.store(i as u32, Ordering::Relaxed);
                        }
                    }
                    i
                }
            };
            match i {
                Some(i) => first.push(!std::mem::replace(&mut seen[i], true)),
                None => first.push(unknown.insert(name)),
            }
            at.push(i);
            prev = i;
        }
        drop(t);
        Candidates { names, at, first }
    }
}

// ---------------------------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------------------------

/// A fitting node's score in full, as the placement log's `top` shows it: the engine's total and
/// each scorer's weighted part. Made only for the nodes a written line names, and kept beside the
/// node's verdict (so for its stamp, window and shared key): the next pod of the shape names mostly
/// the same best nodes, which were placed and scored again twice a line before
/// (docs/performance-journal.md, "The placement log's own cost").
#[derive(Debug, PartialEq)]
pub(crate) struct TopParts {
    pub total: f64,
    /// (scorer, weighted part of `total`).
    pub parts: Vec<(&'static str, f64)>,
}

/// A node's cached verdict for one shape.
#[derive(Debug, Clone, Default)]
struct Slot {
    /// The node's stamp when judged (0: empty; stamps start at 1).
    stamp: u64,
    /// Valid for `from <= now < until` (Unix ms).
    from: i64,
    until: i64,
    answer: Option<Answer>,
    /// The verdict's score in full, once a placement log line named the node.
    top: Option<Arc<TopParts>>,
}

/// The verdicts of one shape, by node index.
#[derive(Debug, Default)]
pub(crate) struct Table {
    slots: Vec<Slot>,
    /// The engine's shared key the verdicts were made with.
    shared: u64,
    reasons: HashMap<ReasonKey, Arc<Reason>>,
    /// A rejected node's detail (the node's own figures behind its reason), once a placement log
    /// line named it, by node index, with the stamp and window start of the verdict it explains:
    /// the next pods of the shape list the same full nodes first.
    details: HashMap<u32, (u64, i64, Arc<str>)>,
}

impl Table {
    /// Drops every verdict unless it was made with the engine's shared key `key`: a score depends
    /// on which reserve classes are scarce cluster-wide, not only on the node judged.
    pub fn keep_only(&mut self, key: u64) {
        if self.shared != key {
            self.slots.clear();
            self.details.clear();
            self.shared = key;
        }
    }

    /// The detail kept with node `i`'s rejection, when that verdict holds (as [`Self::get`]) and
    /// the detail was made for it.
    pub fn detail(&self, i: usize, stamp: u64, now: i64) -> Option<Arc<str>> {
        let from = self.get(i, stamp, now).map(|_| self.slots[i].from)?;
        let (s, f, text) = self.details.get(&u32::try_from(i).ok()?)?;
        (*s == stamp && *f == from).then(|| text.clone())
    }

    /// Keeps `detail` with node `i`'s verdict made at `stamp`; nothing when the slot holds another
    /// (or no) verdict.
    pub fn set_detail(&mut self, i: usize, stamp: u64, detail: Arc<str>) {
        let Ok(key) = u32::try_from(i) else { return };
        if let Some(s) = self.slots.get(i).filter(|s| s.stamp == stamp && s.answer.is_some()) {
            self.details.insert(key, (stamp, s.from, detail));
        }
    }

    /// The cached verdict on node `i`, when made for this stamp and still valid at `now`.
    pub fn get(&self, i: usize, stamp: u64, now: i64) -> Option<&Answer> {
        let s = self.slots.get(i)?;
        if s.stamp == stamp && s.from <= now && now < s.until {
            s.answer.as_ref()
        } else {
            None
        }
    }

    pub fn set(&mut self, i: usize, stamp: u64, (from, until): (i64, i64), answer: Answer) {
        if self.slots.len() <= i {
            self.slots.resize(i + 1, Slot::default());
        }
        self.slots[i] = Slot { stamp, from, until, answer: Some(answer), top: None };
    }

    /// The full score kept with node `i`'s verdict, when the verdict holds (as [`Self::get`]).
    pub fn top(&self, i: usize, stamp: u64, now: i64) -> Option<Arc<TopParts>> {
        self.get(i, stamp, now)?;
        self.slots.get(i)?.top.clone()
    }

    /// Keeps `top` with node `i`'s verdict made at `stamp`; nothing when the slot holds another
    /// (or no) verdict, which `top` was not made for.
    pub fn set_top(&mut self, i: usize, stamp: u64, top: Arc<TopParts>) {
        if let Some(s) = self.slots.get_mut(i).filter(|s| s.stamp == stamp && s.answer.is_some()) {
            s.top = Some(top);
        }
    }

    /// The reason, shared with every other node of this shape turned down for the same key; `text`
    /// writes it the first time.
    pub fn intern(&mut self, key: ReasonKey, text: impl FnOnce() -> String) -> Arc<Reason> {
        if let Some(r) = self.reasons.get(&key) {
            return r.clone();
        }
        if self.reasons.len() >= MAX_REASONS {
            self.reasons.clear();
        }
        let r = Arc::new(Reason::new(key.0, text()));
        self.reasons.insert(key, r.clone());
        r
    }
}

/// One request shape and its verdicts.
#[derive(Debug)]
pub(crate) struct Shape {
    request: PodRequest,
    table: Mutex<Table>,
}

impl Shape {
    pub fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The last `cap` shapes seen, most recent last. Also counts node verdicts served from the cache
/// and judged afresh.
#[derive(Debug, Default)]
pub(crate) struct ShapeCache {
    cap: usize,
    shapes: Mutex<VecDeque<Arc<Shape>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// Whether two requests have the same shape: equal in everything but the pod's name. Spelled out
/// field by field, so that a field added to [`PodRequest`] does not compile until it is decided here.
fn same_shape(a: &PodRequest, b: &PodRequest) -> bool {
    let PodRequest {
        key: _,
        containers,
        init_containers,
        cpu_milli,
        memory_mib,
        node_policy,
        gpu_policy,
        numa,
        allowed_models,
        group,
        isolation,
    } = a;
    *containers == b.containers
        && *init_containers == b.init_containers
        && *cpu_milli == b.cpu_milli
        && *memory_mib == b.memory_mib
        && *node_policy == b.node_policy
        && *gpu_policy == b.gpu_policy
        && *numa == b.numa
        && *allowed_models == b.allowed_models
        && *group == b.group
        && *isolation == b.isolation
}

impl ShapeCache {
    pub fn new(cap: usize) -> Self {
        Self { cap, ..Self::default() }
    }

    /// The shape of `req`, created if new; `None` when it is not cached (a group's pod, or no cache).
    pub fn shape(&self, req: &PodRequest) -> Option<Arc<Shape>> {
        if self.cap == 0 || req.group.is_some() {
            return None;
        }
        let mut shapes = self.shapes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pos) = shapes.iter().rposition(|s| same_shape(&s.request, req)) {
            let s = shapes.remove(pos)?;
            shapes.push_back(s.clone());
            return Some(s);
        }
        let mut request = req.clone();
        request.key.clear();
        let s = Arc::new(Shape { request, table: Mutex::new(Table::default()) });
        shapes.push_back(s.clone());
        while shapes.len() > self.cap {
            shapes.pop_front();
        }
        Some(s)
    }

    /// Forgets every shape and its verdicts (the mix they were scored with was replaced). The
    /// caller holds the state's write lock: verdicts are made and read under its read lock.
    pub fn clear(&self) {
        self.shapes.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub fn count(&self, hits: usize, misses: usize) {
        self.hits.fetch_add(hits as u64, Ordering::Relaxed);
        self.misses.fetch_add(misses as u64, Ordering::Relaxed);
    }

    /// (node verdicts served from the cache, node verdicts judged for it).
    pub fn stats(&self) -> (u64, u64) {
        (self.hits.load(Ordering::Relaxed), self.misses.load(Ordering::Relaxed))
    }
}

/// `s` as a JSON string (how [`Reason::json`] is made once per reason, and front ends that speak
/// JSON write names). Node names and reasons need no escapes (the check is one pass over the
/// bytes); others go through serde_json.
pub fn push_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // writing into a Vec cannot fail
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplace_core::resources::{GpuDemand, GroupSpec, PackingPolicy};

    /// The size `DEFAULT_SHAPE_CACHE`'s memory figure is worked out from.
    #[test]
    fn a_slot_is_48_bytes() {
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    #[test]
    fn name_guesses_never_outlive_a_node_removal() {
        use crate::placement::test_fixtures::node;
        let mut c = Cluster::new(vec![node("a", 1), node("b", 1), node("c", 1)]);
        let order = NameOrder::default();
        let names = vec!["a", "b", "c"];
        assert_eq!(order.resolve(&c, names.clone()).at, [Some(0), Some(1), Some(2)]);
        // the same order again follows the learnt chain; after removing a, b and c move down one
        assert_eq!(order.resolve(&c, names.clone()).at, [Some(0), Some(1), Some(2)]);
        c.remove_node("a");
        assert_eq!(order.resolve(&c, names.clone()).at, [None, Some(0), Some(1)]);
        assert_eq!(order.resolve(&c, vec!["b", "c"]).at, [Some(0), Some(1)]);
    }

    proptest::proptest! {
        /// Whatever the order (kube-scheduler's parallel filters scramble it), repeats, unknown
        /// names, and nodes added or removed between calls, every name resolves as the cluster's
        /// own map has it.
        #[test]
        fn names_resolve_as_the_cluster_has_them(
            calls in proptest::collection::vec(
                (proptest::collection::vec(0usize..40, 0..60), proptest::option::of(0usize..40), proptest::bool::ANY),
                1..8,
            ),
        ) {
            use crate::placement::test_fixtures::node;
            let name = |i: usize| format!("gpu-node-{i}");
            let mut c = Cluster::new((0..20).map(|i| node(&name(i), 1)).collect());
            let order = NameOrder::default();
            for (picks, change, add) in calls {
                let names: Vec<String> = picks.iter().map(|&i| name(i)).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let got = order.resolve(&c, refs.clone());
                let want: Vec<Option<usize>> = refs.iter().map(|n| c.node_index(n)).collect();
                proptest::prop_assert_eq!(got.at, want);
                if let Some(i) = change {
                    if add {
                        c.upsert_node(node(&name(i), 1));
                    } else {
                        c.remove_node(&name(i));
                    }
                }
            }
        }
    }

    #[test]
    fn short_comparisons_agree_with_eq() {
        let words = ["", "a", "gpu-node-1", "gpu-node-12", "gpu-node-1234", "gpu-node-1235", "abcdefgh", "abcdefgi"];
        let long = ["abcdefghijklmnopq", "abcdefghijklmnopr", "abcdefghijklmnop", "bbcdefghijklmnop"];
        for a in words.iter().chain(&long) {
            for b in words.iter().chain(&long) {
                assert_eq!(same(a.as_bytes(), b.as_bytes()), a == b, "{a} {b}");
            }
        }
    }

    #[test]
    fn strings_are_escaped_only_when_needed() {
        for s in ["gpu-node-1", "", "a\"b", "a\\b", "tab\there", "ünï", "\u{7f}"] {
            let mut out = Vec::new();
            push_str(&mut out, s);
            assert_eq!(out, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn shapes_differ_by_everything_but_the_pod_name() {
        let cache = ShapeCache::new(2);
        let a = PodRequest::single("ns/a", GpuDemand::Whole { gpus: 1 });
        let b = PodRequest::single("ns/b", GpuDemand::Whole { gpus: 1 });
        let sa = cache.shape(&a).unwrap();
        assert!(Arc::ptr_eq(&sa, &cache.shape(&b).unwrap()), "the name is not part of the shape");
        let mut spread = a.clone();
        spread.node_policy = Some(PackingPolicy::Spread);
        assert!(!Arc::ptr_eq(&sa, &cache.shape(&spread).unwrap()), "a policy annotation is");
        let mut model = a.clone();
        model.allowed_models = vec!["NVIDIA L4".into()];
        let sm = cache.shape(&model).unwrap();
        assert!(!Arc::ptr_eq(&sa, &sm));
        // cap 2: `a` was least recently used and is gone
        assert!(!Arc::ptr_eq(&sa, &cache.shape(&a).unwrap()), "evicted");
        let mut grouped = a.clone();
        grouped.group = Some(GroupSpec::labelled("ns/job", 2));
        assert!(cache.shape(&grouped).is_none(), "a group's pods are never cached");
        assert!(ShapeCache::new(0).shape(&a).is_none());
    }

    #[test]
    fn slots_match_only_their_stamp_and_window() {
        let mut t = Table::default();
        let key = (RejectClass::Preemptable, Some(Cause::Slots));
        let r = t.intern(key, || "x".into());
        assert!(Arc::ptr_eq(&r, &t.intern(key, || unreachable!("written once"))), "shared");
        let other = t.intern((RejectClass::Unresolvable, Some(Cause::Slots)), || "x".into());
        assert!(!Arc::ptr_eq(&r, &other) && other.unresolvable(), "the class is part of the key");
        t.set(3, 7, (100, 200), Answer::No(r));
        assert!(t.get(3, 7, 100).is_some() && t.get(3, 7, 199).is_some());
        assert!(t.get(3, 7, 99).is_none() && t.get(3, 7, 200).is_none(), "outside the window");
        assert!(t.get(3, 8, 150).is_none(), "another stamp");
        assert!(t.get(2, 0, 150).is_none() && t.get(9, 7, 150).is_none(), "empty and missing slots");
    }
}
