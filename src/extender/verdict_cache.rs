//! The hot path of filter and prioritize (docs/performance-journal.md, "filter+prioritize load"):
//!
//! - `ShapeCache`: each node's verdict (fits with a score, or the rejection and its reason) per
//!   request *shape*, reused by later pods of the same shape while the node is unchanged.
//!   kube-scheduler schedules the replicas of a Deployment or Job one after another, all of one
//!   shape, and between two of them usually only the node of the last bind changed.
//! - `NameOrder`: candidate names to node indices, guessing each from the order of the last
//!   request (kube-scheduler sends its node list in a stable order) before hashing.
//! - Answer encoding straight into one byte buffer: names as sent, reasons encoded once per text.
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
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::extender::metrics::RejectClass;
use crate::extender::reasons;
use crate::extender::wire::{ExtenderArgsRef, ExtenderFilterResult, FailedNodesMap, HostPriority, HostPriorityList};
use crate::placement::feasibility::Cause;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::PodRequest;

/// Request shapes kept by default: each holds a verdict slot per node (40 bytes; 200 KB for 5,000
/// nodes), least recently used dropped first.
pub const DEFAULT_SHAPE_CACHE: usize = 64;

/// Distinct reasons kept per shape for sharing; beyond it the table starts over (reasons in use stay
/// alive in their slots). Reasons depend on the kind of shortfall only, so a shape has a handful.
const MAX_REASONS: usize = 4096;

/// What a rejected node's reason is made from: its class and the engine's cause (`None`: the engine
/// gave none). Nodes with equal keys get one shared reason.
pub(crate) type ReasonKey = (RejectClass, Option<Cause>);

/// Why a node was turned down, as the answer carries it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Reason {
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

    /// `FailedAndUnresolvableNodes` (no preemption helps) rather than `FailedNodes`.
    pub fn unresolvable(&self) -> bool {
        self.class != RejectClass::Preemptable
    }
}

/// One candidate's verdict.
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    /// Fits, with its score (0..=10) and the engine's total behind it (0..=1), which ranks nodes of
    /// equal score when the answer offers only the best (`Extender::with_nodes_to_score`).
    Fits(u8, f32),
    No(Arc<Reason>),
    /// Fits, but not among the nodes offered: named in neither list of the answer, so that
    /// kube-scheduler drops it from the nodes it scores, as it drops nodes it does not sample.
    NotOffered,
}

// ---------------------------------------------------------------------------------------------------
// Candidates
// ---------------------------------------------------------------------------------------------------

/// One request's candidates, by position in the request.
#[derive(Debug)]
pub(crate) struct Candidates<'a> {
    pub names: Vec<&'a str>,
    /// Node index (`None`: not in the node cache).
    pub at: Vec<Option<usize>>,
    /// The first position of its name: failure maps name each node once.
    pub first: Vec<bool>,
    /// Every name can be written into JSON as it is (it was a JSON string without escapes in the
    /// request): see [`ExtenderArgsRef::names_verbatim`].
    pub verbatim: bool,
}

impl<'a> Candidates<'a> {
    /// Candidates without looking them up (answers that do not depend on the node).
    pub fn unresolved(names: Vec<&'a str>, verbatim: bool) -> Self {
        let mut seen = HashSet::with_capacity(names.len());
        let first = names.iter().map(|n| seen.insert(*n)).collect();
        Self { at: vec![None; names.len()], first, names, verbatim }
    }

    /// Positions of first occurrences.
    pub fn unique(&self) -> impl Iterator<Item = usize> + '_ {
        self.first.iter().enumerate().filter(|(_, &f)| f).map(|(p, _)| p)
    }
}

/// Name to node index, guessing from the order of the last request: for each node, the index of
/// the node that followed it. kube-scheduler sends its node list in one order, rotated from call to
/// call, so nearly every guess is right and costs one comparison with a copy of the node's name
/// (all names in one array: the nodes' own names lie scattered over the heap, a cache miss each)
/// instead of a hash and a probe; a wrong guess falls back to the cluster's map. Shared by all
/// workers: the guesses are relaxed atomics, and a stale guess is only a miss.
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
    layout: u64,
}

impl OrderTable {
    fn is(&self, i: usize, name: &str) -> bool {
        self.spans
            .get(i)
            .and_then(|&(a, b)| self.arena.get(a as usize..b as usize))
            .is_some_and(|n| same(n, name.as_bytes()))
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
    pub fn resolve<'a>(&self, cluster: &Cluster, names: Vec<&'a str>, verbatim: bool) -> Candidates<'a> {
        let nodes = cluster.nodes();
        let stale = |t: &OrderTable| t.layout != cluster.layout() || t.next.len() < nodes.len();
        if stale(&self.table.read().unwrap_or_else(|e| e.into_inner())) {
            let mut w = self.table.write().unwrap_or_else(|e| e.into_inner());
            if w.layout != cluster.layout() {
                *w = OrderTable { layout: cluster.layout(), ..OrderTable::default() };
            }
            while w.next.len() < nodes.len() {
                let name = nodes[w.next.len()].name.as_bytes();
                let start = w.arena.len() as u32;
                w.arena.extend_from_slice(name);
                let end = w.arena.len() as u32;
                w.spans.push((start, end));
                w.next.push(AtomicU32::new(NO_GUESS));
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
                    let i = cluster.node_index(name);
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
        Candidates { names, at, first, verbatim }
    }
}

// ---------------------------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------------------------

/// A node's cached verdict for one shape.
#[derive(Debug, Clone, Default)]
struct Slot {
    /// The node's stamp when judged (0: empty; stamps start at 1).
    stamp: u64,
    /// Valid for `from <= now < until` (Unix ms).
    from: i64,
    until: i64,
    answer: Option<Answer>,
}

/// The verdicts of one shape, by node index.
#[derive(Debug, Default)]
pub(crate) struct Table {
    slots: Vec<Slot>,
    /// The engine's shared key the verdicts were made with.
    shared: u64,
    reasons: HashMap<ReasonKey, Arc<Reason>>,
}

impl Table {
    /// Drops every verdict unless it was made with the engine's shared key `key`: a score depends
    /// on which reserve classes are scarce cluster-wide, not only on the node judged.
    pub fn keep_only(&mut self, key: u64) {
        if self.shared != key {
            self.slots.clear();
            self.shared = key;
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
        self.slots[i] = Slot { stamp, from, until, answer: Some(answer) };
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

// ---------------------------------------------------------------------------------------------------
// Answers
// ---------------------------------------------------------------------------------------------------

/// `s` as a JSON string. Node names and reasons need no escapes (the check is one pass over the
/// bytes); others go through serde_json.
pub(crate) fn push_str(out: &mut Vec<u8>, s: &str) {
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

/// A candidate's name as a JSON string.
#[inline]
fn push_name(out: &mut Vec<u8>, name: &str, verbatim: bool) {
    if verbatim {
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.push(b'"');
    } else {
        push_str(out, name);
    }
}

fn push_score(out: &mut Vec<u8>, score: u8) {
    let s = score.min(10);
    if s == 10 {
        out.extend_from_slice(b"10");
    } else {
        out.push(b'0' + s);
    }
}

/// The filter answer's JSON (as [`filter_result`] would serialize, except that the failure maps
/// list nodes in request order rather than by name, which decoders do not see).
pub(crate) fn filter_json(args: &ExtenderArgsRef<'_>, c: &Candidates<'_>, answers: &[Answer]) -> Vec<u8> {
    // one pass writes the passing nodes and sets the failures aside (each name once)
    let mut failed: [Vec<(&str, &Reason)>; 2] = [Vec::new(), Vec::new()];
    let mut failed_bytes = 0;
    let items = args.nodes.as_ref().map(|l| (l, l.items.as_slice()));
    // names run under 24 bytes; Node objects are echoed whole
    let echoed = items.map_or(0, |(_, items)| items.iter().map(|n| n.raw_json().len() + 1).sum::<usize>());
    let mut out = Vec::with_capacity(c.names.len() * 24 + echoed + 256);
    out.extend_from_slice(b"{\"Nodes\":");
    match items {
        Some((list, _)) => {
            out.extend_from_slice(b"{\"metadata\":");
            let _ = serde_json::to_writer(&mut out, &list.metadata);
            out.extend_from_slice(b",\"items\":[");
        }
        None => out.extend_from_slice(b"null,\"NodeNames\":["),
    }
    let mut sep = false;
    for (p, (name, a)) in c.names.iter().zip(answers).enumerate() {
        match a {
            Answer::Fits(..) => {
                if std::mem::replace(&mut sep, true) {
                    out.push(b',');
                }
                match items {
                    Some((_, items)) => out.extend_from_slice(items.get(p).map_or("null", |n| n.raw_json()).as_bytes()),
                    None => push_name(&mut out, name, c.verbatim),
                }
            }
            Answer::No(r) if c.first.get(p) == Some(&true) => {
                failed_bytes += name.len() + r.json.len() + 4;
                failed[usize::from(r.unresolvable())].push((name, r));
            }
            Answer::No(_) | Answer::NotOffered => {}
        }
    }
    out.extend_from_slice(if items.is_some() { b"]},\"NodeNames\":null" } else { b"]" });
    out.reserve(failed_bytes + 64);
    for (key, list) in [&b",\"FailedNodes\":{"[..], b"},\"FailedAndUnresolvableNodes\":{"].iter().zip(&failed) {
        out.extend_from_slice(key);
        for (k, (name, r)) in list.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            push_name(&mut out, name, c.verbatim);
            out.push(b':');
            out.extend_from_slice(&r.json);
        }
    }
    out.extend_from_slice(b"},\"Error\":\"\"}");
    out
}

/// The filter answer as the wire type.
pub(crate) fn filter_result(
    args: &ExtenderArgsRef<'_>,
    c: &Candidates<'_>,
    answers: &[Answer],
) -> ExtenderFilterResult {
    let fits = |p: usize| matches!(answers.get(p), Some(Answer::Fits(..)));
    let mut out = ExtenderFilterResult::default();
    match &args.nodes {
        Some(list) => {
            let items = list.items.iter().enumerate().filter(|(p, _)| fits(*p)).map(|(_, n)| n.clone()).collect();
            out.nodes = Some(crate::extender::wire::NodeList { metadata: list.metadata.clone(), items });
        }
        None => {
            out.node_names =
                Some(c.names.iter().enumerate().filter(|(p, _)| fits(*p)).map(|(_, n)| n.to_string()).collect())
        }
    }
    let (mut failed, mut unresolvable) = (FailedNodesMap::new(), FailedNodesMap::new());
    for p in c.unique() {
        if let (Some(Answer::No(r)), Some(n)) = (answers.get(p), c.names.get(p)) {
            let map = if r.unresolvable() { &mut unresolvable } else { &mut failed };
            map.insert(n.to_string(), r.text.clone());
        }
    }
    out.failed_nodes = failed;
    out.failed_and_unresolvable_nodes = unresolvable;
    out
}

/// The prioritize answer's JSON: `[{"Host":…,"Score":…},…]`, one entry per candidate in order.
pub(crate) fn priorities_json(names: &[&str], verbatim: bool, scores: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(names.iter().map(|n| n.len() + 24).sum::<usize>() + 2);
    out.push(b'[');
    for (i, (n, &s)) in names.iter().zip(scores).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"Host\":");
        push_name(&mut out, n, verbatim);
        out.extend_from_slice(b",\"Score\":");
        push_score(&mut out, s);
        out.push(b'}');
    }
    out.push(b']');
    out
}

/// The prioritize answer as the wire type.
pub(crate) fn priorities(names: &[&str], scores: &[u8]) -> HostPriorityList {
    names.iter().zip(scores).map(|(n, &s)| HostPriority::new(*n, i64::from(s))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::args_decoder::decode_args;
    use gpuplace_core::resources::{GpuDemand, GroupSpec, PackingPolicy};

    #[test]
    fn name_guesses_never_outlive_a_node_removal() {
        use crate::placement::test_fixtures::node;
        let mut c = Cluster::new(vec![node("a", 1), node("b", 1), node("c", 1)]);
        let order = NameOrder::default();
        let names = vec!["a", "b", "c"];
        assert_eq!(order.resolve(&c, names.clone(), true).at, [Some(0), Some(1), Some(2)]);
        // the same order again follows the learnt chain; after removing a, b and c move down one
        assert_eq!(order.resolve(&c, names.clone(), true).at, [Some(0), Some(1), Some(2)]);
        c.remove_node("a");
        assert_eq!(order.resolve(&c, names.clone(), true).at, [None, Some(0), Some(1)]);
        assert_eq!(order.resolve(&c, vec!["b", "c"], true).at, [Some(0), Some(1)]);
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
        for s in 0..=10u8 {
            let mut out = Vec::new();
            push_score(&mut out, s);
            assert_eq!(out, s.to_string().into_bytes());
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

    #[test]
    fn encoded_filter_answers_decode_to_the_wire_type() {
        let body = br#"{"Pod":{},"NodeNames":["a","b","a","c","we\"ird","b"]}"#;
        let args = decode_args(body).unwrap();
        let c = Candidates::unresolved(args.candidate_names().unwrap(), args.names_verbatim());
        let no = Arc::new(Reason::new(RejectClass::Preemptable, "busy \"now\"".into()));
        let never = Arc::new(Reason::new(RejectClass::Unresolvable, "too small".into()));
        let answers = vec![
            Answer::Fits(3, 0.3),
            Answer::No(no.clone()),
            Answer::Fits(3, 0.3),
            Answer::No(never),
            Answer::Fits(0, 0.0),
            Answer::No(no),
        ];
        let json = filter_json(&args, &c, &answers);
        let decoded: ExtenderFilterResult = serde_json::from_slice(&json).unwrap();
        assert_eq!(decoded, filter_result(&args, &c, &answers));
        assert_eq!(decoded.node_names.unwrap(), ["a", "a", "we\"ird"]);
        assert_eq!(decoded.failed_nodes.len(), 1, "b once");
        let names = ["a", "b"];
        for verbatim in [false, true] {
            let list: HostPriorityList = serde_json::from_slice(&priorities_json(&names, verbatim, &[10, 0])).unwrap();
            assert_eq!(list, priorities(&names, &[10, 0]));
        }
        // names taken from the body as they were written
        let plain = decode_args(br#"{"Pod":{},"NodeNames":["a","b"]}"#).unwrap();
        assert!(plain.names_verbatim());
        let c = Candidates::unresolved(plain.candidate_names().unwrap(), true);
        let answers = [Answer::Fits(1, 0.1), Answer::No(Arc::new(Reason::new(RejectClass::Preemptable, "x".into())))];
        let json = filter_json(&plain, &c, &answers);
        assert_eq!(
            String::from_utf8(json).unwrap(),
            r#"{"Nodes":null,"NodeNames":["a"],"FailedNodes":{"b":"x"},"FailedAndUnresolvableNodes":{},"Error":""}"#
        );
        assert!(!args.names_verbatim(), "an escaped name was copied");
    }
}
