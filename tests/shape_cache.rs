//! The shape cache (`scheduler::verdict_cache`) never changes an answer: a service with it and one without,
//! fed the same filters, prioritizes, binds, releases, node replacements, utilization samples and
//! clock jumps, answer every request alike and end in the same state. Plus the cases it exists
//! for (a later pod of the same shape is answered from the cache, a bind re-judges one node) and
//! the ones it must stay out of (a group's pods, ageing utilization samples).
//! The placement logs written alongside agree too, down to each scorer's part of the best nodes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use gpuplace::extender::wire::{decode, ExtenderFilterResult, HostPriorityList, Pod};
use gpuplace::extender::Extender;
use gpuplace::placement::mix::ReserveClass;
use gpuplace::placement::mix::WorkloadMix;
use gpuplace::placement::{profile::ProfileConfig, registry::Weights};
use gpuplace::placement_log::compactor::CompactOptions;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::{Decision, TopScore};
use gpuplace::scheduler::service::{RestoredPod, ServiceOptions};
use gpuplace_core::cluster::{Cluster, Node, UtilSample};
use gpuplace_core::inventory::Board;
use gpuplace_core::resources::PodRequest;
use harness::{block_on, Harness, NOW};
use proptest::prelude::*;
use serde_json::{json, Value};

#[path = "support/harness.rs"]
mod harness;

/// The default profile's `max_sample_age_s`, in ms.
const MAX_AGE_MS: i64 = 60_000;
const NODES: [&str; 5] = ["h100-0", "h100-1", "l40s-0", "l40s-1", "t4-0"];

fn node(name: &str) -> Node {
    let board = match &name[..2] {
        "h1" => Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 },
        "l4" => Board::Pcie {
            model: "L40S".into(),
            memory_mib: 46068,
            sockets: 2,
            switches_per_socket: 2,
            gpus_per_switch: 2,
        },
        _ => Board::Flat { gpus: 2, model: "T4".into(), memory_mib: 15109 },
    };
    let tor = if name.ends_with('0') { "tor-a" } else { "tor-b" };
    let labels = BTreeMap::from([
        ("network.gpuplace.io/spine".to_string(), "s1".to_string()),
        ("network.gpuplace.io/tor".to_string(), tor.to_string()),
    ]);
    board.resolve(Path::new(".")).unwrap().node(name, labels, 0, 0)
}

/// A mix whose reserve keeps back the last 2 nodes with 8 free GPUs (4 of the 5 nodes have 8): a
/// few binds make it scarce, a release makes it plenty again, and every verdict on such a node
/// changes with it although the node itself did not.
fn reserve_mix() -> WorkloadMix {
    let class = ReserveClass { gpus: 8, milli: 1000, cpu_milli: 0, memory_mib: 0, models: Vec::new(), keep: 2 };
    WorkloadMix::new(Vec::new(), vec![class])
}

fn service_with(shape_cache: usize, mix: WorkloadMix, log: Option<PlacementLog>) -> Extender {
    let cluster = Cluster::new(NODES.iter().map(|n| node(n)).collect());
    let opts =
        ServiceOptions { shape_cache, eval_cache: if shape_cache == 0 { 0 } else { 64 }, ..ServiceOptions::default() };
    // utilization weighs as much as everything else together, so a stale sample shows in the 0..10
    // scores (with the default weights it often rounds away)
    let weights = Weights::default().with("utilization", 12.0);
    Harness::new(cluster)
        .profile(ProfileConfig { weights, ..ProfileConfig::default() })
        .mix(mix)
        .options(opts)
        .clock(NOW)
        .placement_log(log)
        .build()
}

/// A placement log that writes every call, in a folder of its own under the test's temporary folder.
fn every_call_log(name: &str) -> (PathBuf, PlacementLog) {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "shape-cache-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let opts = CompactOptions { every_call: true, ..CompactOptions::default() };
    let log = PlacementLog::open(path.to_str().unwrap(), 1 << 30).unwrap().with_options(opts);
    (path, log)
}

type Details = std::collections::BTreeMap<String, String>;

/// Each line's verb, pod, best nodes with every scorer's part, and rejected nodes' details: what a
/// line says about scores and rejections.
fn tops(path: &Path) -> Vec<(String, String, Vec<TopScore>, Details)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines = text.lines().map(|l| serde_json::from_str::<Decision>(l).unwrap());
    lines.map(|d| (d.verb, d.pod, d.top, d.rejection_details)).collect()
}

/// Pod shapes: GPU resources, then annotations (the policies that are part of a shape), and a group.
const SHAPES: usize = 9;

fn pod(shape: usize, name: &str) -> Value {
    let whole = |n: u32| json!({ "gpuplace.io/gpu": n.to_string() });
    let share = json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": "8000", "gpuplace.io/gpu-core": "30" });
    let (limits, annotations, labels) = match shape {
        0 => (whole(1), json!({}), json!({})),
        1 => (whole(2), json!({}), json!({})),
        2 => (whole(4), json!({}), json!({})),
        3 => (share.clone(), json!({}), json!({})),
        4 => (whole(2), json!({ "gpuplace.io/node-policy": "spread" }), json!({})),
        5 => (whole(1), json!({ "gpuplace.io/gpu-model": "L40S" }), json!({})),
        6 => (whole(2), json!({ "gpuplace.io/numa": "required" }), json!({})),
        7 => (share, json!({ "gpuplace.io/gpu-policy": "spread" }), json!({})),
        _ => (whole(1), json!({ "gpuplace.io/group-size": "3" }), json!({ "gpuplace.io/group": "job" })),
    };
    json!({
        "metadata": { "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "labels": labels, "annotations": annotations },
        "spec": { "containers": [ { "name": "main", "resources": { "limits": limits } } ] }
    })
}

/// A filter/prioritize body for `candidates` (indices into NODES; 5 and up are unknown names), as
/// names or as Node objects without inventory (the node cache answers for them).
fn args(pod: &Value, candidates: &[usize], as_nodes: bool) -> Vec<u8> {
    let names: Vec<String> =
        candidates.iter().map(|&i| NODES.get(i).map_or_else(|| format!("unknown-{i}"), |n| n.to_string())).collect();
    let body = if as_nodes {
        let items: Vec<Value> = names.iter().map(|n| json!({ "metadata": { "name": n } })).collect();
        json!({ "Pod": pod, "Nodes": { "metadata": {}, "items": items }, "NodeNames": null })
    } else {
        json!({ "Pod": pod, "Nodes": null, "NodeNames": names })
    };
    body.to_string().into_bytes()
}

#[derive(Debug, Clone)]
enum Op {
    Filter {
        shape: usize,
        candidates: Vec<usize>,
        as_nodes: bool,
    },
    Prioritize {
        shape: usize,
        candidates: Vec<usize>,
    },
    /// Filter, prioritize and bind a new pod of the shape to the best node.
    Bind {
        shape: usize,
    },
    /// Forget one bound pod (a restore without it).
    Release {
        pick: usize,
    },
    /// Replace a node: its board again with one GPU marked unhealthy, or as it was.
    Upsert {
        node: usize,
        unhealthy: Option<usize>,
    },
    /// A utilization sample on one GPU, taken `age_ms` before now (negative: in the future).
    Sample {
        node: usize,
        gpu: usize,
        sm_pct: u32,
        age_ms: i64,
    },
    Tick {
        ms: i64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let candidates = proptest::collection::vec(0usize..7, 0..8);
    prop_oneof![
        4 => (0..SHAPES, candidates.clone(), any::<bool>()).prop_map(|(shape, candidates, as_nodes)| Op::Filter { shape, candidates, as_nodes }),
        2 => (0..SHAPES, candidates).prop_map(|(shape, candidates)| Op::Prioritize { shape, candidates }),
        3 => (0..SHAPES).prop_map(|shape| Op::Bind { shape }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => (0..NODES.len(), proptest::option::of(0usize..8)).prop_map(|(node, unhealthy)| Op::Upsert { node, unhealthy }),
        2 => (0..NODES.len(), 0usize..8, 0u32..=100, -90_000i64..90_000).prop_map(|(node, gpu, sm_pct, age_ms)| Op::Sample { node, gpu, sm_pct, age_ms }),
        2 => prop_oneof![0i64..2, 0i64..40_000, Just(MAX_AGE_MS), Just(MAX_AGE_MS + 1)].prop_map(|ms| Op::Tick { ms }),
    ]
}

/// Two services, one with a small shape cache (2 shapes, so shapes are evicted and come back) and
/// one without any cache, driven alike.
struct Twins {
    cached: Extender,
    plain: Extender,
    now: i64,
    seq: usize,
    /// Bound pods: UID → (request, node).
    bound: BTreeMap<String, PodRequest>,
    /// The placement logs of `cached` and of `plain`.
    logs: [PathBuf; 2],
}

impl Drop for Twins {
    fn drop(&mut self) {
        for log in &self.logs {
            if let Some(dir) = log.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

impl Twins {
    fn new() -> Self {
        Self::with_mix(WorkloadMix::default())
    }

    fn with_mix(mix: WorkloadMix) -> Self {
        let (cached_log, log) = every_call_log("cached.jsonl");
        let cached = service_with(2, mix.clone(), Some(log));
        // one key ring: `restore` hands both services the assignments the cached one signed
        let (plain_log, log) = every_call_log("plain.jsonl");
        let plain = service_with(0, mix, Some(log));
        plain.set_key_ring(cached.key_ring().as_deref().cloned().unwrap());
        Self { cached, plain, now: NOW, seq: 0, bound: BTreeMap::new(), logs: [cached_log, plain_log] }
    }

    /// The placement logs' lines agree on the best nodes and each scorer's part of their scores
    /// (the cached service keeps the parts with its verdicts: `TopParts`), and on the rejected
    /// nodes' details (kept with their verdicts too).
    fn same_tops(&self) {
        let [cached, plain] = [&self.logs[0], &self.logs[1]].map(|p| tops(p));
        assert_eq!(cached.len(), plain.len(), "placement log lines");
        for (c, p) in cached.iter().zip(&plain) {
            assert_eq!(c.0, p.0);
            assert_eq!(c.1, p.1);
            assert_eq!(c.3, p.3, "{} {}: rejection details", c.0, c.1);
            assert_eq!(c.2.len(), p.2.len(), "{} {}: top", c.0, c.1);
            for (a, b) in c.2.iter().zip(&p.2) {
                assert_eq!((&a.node, a.score), (&b.node, b.score), "{} {}: top", c.0, c.1);
                // the same arithmetic on the same placement: equal to the bit, or nearly where the
                // parts were summed in another order
                assert!((a.total - b.total).abs() < 1e-12, "{} {}: {a:?} / {b:?}", c.0, c.1);
                assert_eq!(a.parts.keys().collect::<Vec<_>>(), b.parts.keys().collect::<Vec<_>>());
                for (x, y) in a.parts.values().zip(b.parts.values()) {
                    assert!((x - y).abs() < 1e-12, "{} {}: {a:?} / {b:?}", c.0, c.1);
                }
            }
        }
    }

    fn both<T: PartialEq + std::fmt::Debug>(&self, what: &str, f: impl Fn(&Extender) -> T) -> T {
        let a = f(&self.cached);
        assert_eq!(a, f(&self.plain), "{what}: the shape cache changed the answer");
        a
    }

    /// One call each: the cached service's encoded answer, the plain one's wire type (so the
    /// encoder is held to what the wire type would serialize as well).
    fn filter(&self, body: &[u8]) -> ExtenderFilterResult {
        let cached = decode::<ExtenderFilterResult>(&self.cached.filter_json(body).unwrap()).unwrap();
        assert_eq!(cached, self.plain.filter(body).unwrap(), "filter: the shape cache changed the answer");
        cached
    }

    fn prioritize(&self, body: &[u8]) -> HostPriorityList {
        let cached = decode::<HostPriorityList>(&self.cached.prioritize_json(body).unwrap()).unwrap();
        assert_eq!(cached, self.plain.prioritize(body).unwrap(), "prioritize: the shape cache changed the answer");
        cached
    }

    fn upsert(&self, n: Node) {
        self.cached.upsert_node(n.clone());
        self.plain.upsert_node(n);
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Filter { shape, candidates, as_nodes } => {
                self.filter(&args(&pod(*shape, "p"), candidates, *as_nodes));
            }
            Op::Prioritize { shape, candidates } => {
                self.prioritize(&args(&pod(*shape, "p"), candidates, false));
            }
            Op::Bind { shape } => {
                self.seq += 1;
                let name = format!("b{}", self.seq);
                let p = pod(*shape, &name);
                let all: Vec<usize> = (0..NODES.len()).collect();
                let f = self.filter(&args(&p, &all, false));
                let pass: Vec<usize> =
                    f.node_names.unwrap_or_default().iter().filter_map(|n| NODES.iter().position(|x| x == n)).collect();
                if pass.is_empty() {
                    return;
                }
                let scores = self.prioritize(&args(&p, &pass, false));
                let best = scores.iter().max_by_key(|h| h.score).map(|h| h.host.clone()).unwrap();
                let body =
                    json!({ "PodName": name, "PodNamespace": "ns", "PodUID": format!("uid-{name}"), "Node": best });
                let body = body.to_string().into_bytes();
                let r = self.both("bind", |e| block_on(e.bind(&body)).unwrap());
                if r.error.is_empty() {
                    let wire: Pod = serde_json::from_value(p).unwrap();
                    self.bound.insert(format!("uid-{name}"), wire.request().unwrap());
                }
            }
            Op::Release { pick } => {
                if self.bound.is_empty() {
                    return;
                }
                let gone = self.bound.keys().nth(pick % self.bound.len()).cloned().unwrap();
                self.bound.remove(&gone);
                let records = self.cached.bound_pods();
                let keep: Vec<RestoredPod> = self
                    .bound
                    .iter()
                    .filter_map(|(uid, req)| {
                        let b = records.get(uid)?;
                        Some(RestoredPod {
                            uid: uid.clone(),
                            request: req.clone(),
                            node: b.node.clone(),
                            annotation: b.annotation.clone()?,
                        })
                    })
                    .collect();
                self.both("restore", |e| e.restore(keep.clone()));
            }
            Op::Upsert { node: i, unhealthy } => {
                let mut n = node(NODES[*i]);
                if let Some(g) = unhealthy.filter(|&g| g < n.gpus.len()) {
                    n.set_gpu_health(g, false);
                }
                self.upsert(n);
            }
            Op::Sample { node: i, gpu, sm_pct, age_ms } => {
                let mut n = self.cached.cluster().nodes()[*i].clone();
                let g = gpu % n.gpus.len();
                n.set_utilization(
                    g,
                    Some(UtilSample { sm_pct: *sm_pct, mem_used_mib: 1000, at_unix_ms: self.now - age_ms }),
                );
                self.upsert(n);
            }
            Op::Tick { ms } => {
                self.now += ms;
                self.cached.set_clock(Some(self.now));
                self.plain.set_clock(Some(self.now));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn cached_answers_equal_uncached_answers(ops in proptest::collection::vec(op(), 1..60)) {
        let mut t = Twins::new();
        for op in &ops {
            t.apply(op);
        }
        prop_assert_eq!(t.cached.cluster(), t.plain.cluster());
        prop_assert_eq!(t.cached.bound_pods(), t.plain.bound_pods());
        t.same_tops();
    }

    /// The same with a reserve, whose scarcity depends on every node (`Engine::shared_key`).
    #[test]
    fn cached_answers_equal_uncached_answers_with_a_reserve(ops in proptest::collection::vec(op(), 1..60)) {
        let mut t = Twins::with_mix(reserve_mix());
        for op in &ops {
            t.apply(op);
        }
        prop_assert_eq!(t.cached.cluster(), t.plain.cluster());
        t.same_tops();
    }
}

#[test]
fn a_reserve_turning_scarce_voids_the_cached_verdicts_of_unchanged_nodes() {
    let t = Twins::with_mix(reserve_mix());
    let h100_1 = |t: &Twins, pod_name: &str| t.prioritize(&args(&pod(0, pod_name), &[1], false))[0].score;
    let plenty = h100_1(&t, "a");
    // two binds elsewhere leave 2 nodes with 8 free GPUs: h100-1 is one of the last two now
    for (name, node) in [("x", "h100-0"), ("y", "l40s-0")] {
        t.filter(&args(&pod(0, name), &all_nodes(), false));
        let bind = json!({ "PodName": name, "PodNamespace": "ns", "PodUID": format!("uid-{name}"), "Node": node });
        assert!(t.both("bind", |e| block_on(e.bind(bind.to_string().as_bytes())).unwrap()).error.is_empty());
    }
    // h100-1 did not change, yet its cached verdict for this shape must not be served
    let scarce = h100_1(&t, "b");
    assert!(scarce < plenty, "{plenty} -> {scarce}");
}

fn all_nodes() -> Vec<usize> {
    (0..NODES.len()).collect()
}

#[test]
fn later_pods_of_a_shape_are_answered_from_the_cache_and_a_bind_rejudges_one_node() {
    let t = Twins::new();
    let first = t.filter(&args(&pod(1, "a"), &all_nodes(), false));
    assert_eq!(t.cached.shape_cache_stats(), (0, 5), "the first pod of a shape judges every node");
    t.prioritize(&args(&pod(1, "a"), &[0, 1, 2, 3], false));
    assert_eq!(t.cached.shape_cache_stats(), (4, 5), "prioritize follows from filter's verdicts");
    // another pod, other name, same shape; names-only or full Nodes alike
    assert_eq!(t.filter(&args(&pod(1, "b"), &all_nodes(), false)), first);
    t.filter(&args(&pod(1, "b"), &all_nodes(), true));
    assert_eq!(t.cached.shape_cache_stats(), (14, 5));
    // a policy annotation is another shape
    t.filter(&args(&pod(4, "c"), &all_nodes(), false));
    assert_eq!(t.cached.shape_cache_stats(), (14, 10));
    let bind = |name: &str| {
        let bind = json!({ "PodName": name, "PodNamespace": "ns", "PodUID": format!("uid-{name}"), "Node": "h100-0" });
        assert!(t.both("bind", |e| block_on(e.bind(bind.to_string().as_bytes())).unwrap()).error.is_empty());
    };
    // the first bind leaves the H100s a smaller share of the free GPUs than of all GPUs: the
    // inventory's H100 list turns short (`placement::scorers::model_supply`), a cluster-wide change
    // that voids every verdict
    bind("a");
    t.filter(&args(&pod(1, "d"), &all_nodes(), false));
    assert_eq!(t.cached.shape_cache_stats(), (14, 15), "a list turning short: every node judged again");
    // with nothing cluster-wide changing, only the node of the bind is judged again
    t.filter(&args(&pod(1, "e"), &all_nodes(), false));
    bind("e");
    t.filter(&args(&pod(1, "f"), &all_nodes(), false));
    assert_eq!(t.cached.shape_cache_stats(), (23, 16), "only the node of the bind is judged again");
}

#[test]
fn utilization_samples_age_out_of_cached_verdicts() {
    let mut t = Twins::new();
    let scores = |t: &Twins| {
        let h = t.prioritize(&args(&pod(0, "p"), &[0, 1], false));
        (h[0].score, h[1].score)
    };
    let idle = scores(&t);
    // every GPU of h100-0 measured fully busy, just now: it scores lower while the samples count
    let mut n = t.cached.cluster().nodes()[0].clone();
    for g in 0..8 {
        n.set_utilization(g, Some(UtilSample { sm_pct: 100, mem_used_mib: 80000, at_unix_ms: NOW }));
    }
    t.upsert(n);
    let busy = scores(&t);
    assert!(busy.0 < idle.0 && busy.1 == idle.1, "{idle:?} {busy:?}");
    t.apply(&Op::Tick { ms: MAX_AGE_MS });
    assert_eq!(scores(&t), busy, "still fresh at exactly the maximum age");
    let (hits, misses) = t.cached.shape_cache_stats();
    t.apply(&Op::Tick { ms: 1 });
    assert_eq!(scores(&t), idle, "stale a millisecond later: the cached verdict expired with it");
    assert_eq!(t.cached.shape_cache_stats(), (hits + 1, misses + 1), "h100-0 judged again, h100-1 not");
}

#[test]
fn group_pods_are_never_cached() {
    let t = Twins::new();
    for name in ["g1", "g2"] {
        t.filter(&args(&pod(8, name), &all_nodes(), false));
    }
    assert_eq!(t.cached.shape_cache_stats(), (0, 0));
}
