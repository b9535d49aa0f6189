//! The extender over real HTTP (a server bound to a loopback port, requests over TCP): every
//! kube-scheduler v1.36 fixture replayed in the order it was captured against static mode with
//! `examples/clusters/fixture-cluster.yaml`, binds (idempotence, rollback), preemption, full-Nodes
//! inventory, restore from annotations, metrics and the placement log. HTTP errors, limits on
//! bodies and arbitrary request bodies: `limits.rs`.
//!
//! The capture order (see the fixtures' README and tests/extender_fixtures.rs): `nocache/` ran
//! first (nc-whole4 bound on gpu-node-3, nc-gang-0 on gpu-node-2), then `cache/` on the same cluster
//! (c-whole4 on gpu-node-3, c-gang-0 on gpu-node-1, filler-0..3 on gpu-node-0, then preemptions);
//! `nocache-preempt/` ran on a fresh cluster (16 fillers, four per node, then `urgent`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuplace::extender::http::HttpOptions;
use gpuplace::extender::http_client::Connection;
use gpuplace::extender::wire::{decode, ExtenderArgs, Pod};
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::Decision;
use gpuplace::scheduler::binder::{BindError, BindFuture, BindRequest, Binder, RecordingBinder};
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::service::{RestoredPod, ServiceOptions};
use gpuplace_core::annotations::{
    AssignmentAnnotation, GpuUtilization, NodeInventory, UtilizationAnnotation, ANNOTATION_ASSIGNMENT,
};
use gpuplace_core::inventory::Board;
use harness::fixture;
use serde_json::{json, Value};

#[path = "../support/fuzz.rs"]
mod fuzz;
#[path = "../support/harness.rs"]
mod harness;
#[path = "../support/http_server.rs"]
mod http_server;
mod limits;

use http_server::*;

/// Replays `nocache/` then `cache/` on one server, checking every answer.
fn replay_nocache_then_cache(s: &Server) {
    // nocache: full Node objects
    let a = s.fixture("nocache/filter-001");
    assert_refused_everywhere(&a, "nocache/filter-001");
    assert_eq!(a["Nodes"], json!({"metadata": {}, "items": []}));
    assert_scores(&s.fixture("nocache/prioritize-001"), "nocache/prioritize-001", true);
    bind_refused(&s.fixture("nocache/bind-001"), "nocache/bind-001");

    let a = s.fixture("nocache/filter-002");
    assert_all_fit(&a, "nocache/filter-002");
    // the Node objects come back byte for byte
    let sent = fixture_json("nocache/filter-002");
    assert_eq!(a["Nodes"], sent["Nodes"]);
    assert_scores(&s.fixture("nocache/prioritize-002"), "nocache/prioritize-002", false);
    bind_ok(&s.fixture("nocache/bind-002"), "nocache/bind-002");
    assert_eq!(s.idle()["gpu-node-3"], 4, "nc-whole4 holds 4 GPUs at once");

    assert_planned(&s.fixture("nocache/filter-003"), "nocache/filter-003");
    assert_planned_scores(&s.fixture("nocache/prioritize-003"), "nocache/prioritize-003");
    bind_ok(&s.fixture("nocache/bind-003"), "nocache/bind-003");
    assert_refused_everywhere(&s.fixture("nocache/filter-004"), "nocache/filter-004");
    assert_scores(&s.fixture("nocache/prioritize-004"), "nocache/prioritize-004", true);
    bind_refused(&s.fixture("nocache/bind-004"), "nocache/bind-004");

    // cache: names only
    let a = s.fixture("cache/filter-001");
    assert_refused_everywhere(&a, "cache/filter-001");
    assert_eq!(a["NodeNames"], json!([]));
    assert_eq!(a["Nodes"], Value::Null);
    assert_scores(&s.fixture("cache/prioritize-001"), "cache/prioritize-001", true);
    bind_refused(&s.fixture("cache/bind-001"), "cache/bind-001");
    // c-whole4 on gpu-node-3 next to nc-whole4: its 4 idle GPUs are enough
    assert_all_fit(&s.fixture("cache/filter-002"), "cache/filter-002");
    assert_scores(&s.fixture("cache/prioritize-002"), "cache/prioritize-002", false);
    bind_ok(&s.fixture("cache/bind-002"), "cache/bind-002");
    assert_planned(&s.fixture("cache/filter-003"), "cache/filter-003");
    assert_planned_scores(&s.fixture("cache/prioritize-003"), "cache/prioritize-003");
    bind_ok(&s.fixture("cache/bind-003"), "cache/bind-003");
    assert_refused_everywhere(&s.fixture("cache/filter-004"), "cache/filter-004");
    assert_scores(&s.fixture("cache/prioritize-004"), "cache/prioritize-004", true);
    bind_refused(&s.fixture("cache/bind-004"), "cache/bind-004");
    for seq in 5..=8 {
        let rel = format!("cache/filter-{seq:03}");
        assert_all_fit(&s.fixture(&rel), &rel);
        bind_ok(&s.fixture(&format!("cache/bind-{seq:03}")), "cache filler bind");
    }
    assert_eq!(s.idle(), ALL_NODES.iter().map(|n| (n.to_string(), 0)).collect(), "every GPU is held");
}

#[test]
fn nocache_and_cache_fixtures_in_capture_order() {
    let s = Server::start();
    replay_nocache_then_cache(&s);

    // the next filler, offered every node: all full now, so each is preemptable (FailedNodes), with
    // a reason that says what is missing, the same on every node so that kube-scheduler groups them
    let mut body = fixture_json("cache/filter-005");
    body["NodeNames"] = json!(ALL_NODES);
    let a = s.ok("filter", body.to_string().as_bytes());
    assert_eq!(a["NodeNames"], json!([]));
    assert_eq!(names(&a["FailedNodes"]), set(&ALL_NODES));
    assert_eq!(a["FailedAndUnresolvableNodes"], json!({}));
    for r in a["FailedNodes"].as_object().unwrap().values() {
        assert_eq!(r, "gpuplace: fewer than 2 idle GPUs");
    }

    // preemption: every victim kube-scheduler named is needed (each holds GPUs the pod needs)
    for seq in 1..=5 {
        let rel = format!("cache/preempt-{seq:03}");
        let a = s.fixture(&rel);
        assert_eq!(a["NodeNameToMetaVictims"], meta_victims(&rel), "{rel}: {a}");
    }
    // and nothing was evicted for real: preempt has no side effects
    assert_eq!(s.idle().values().sum::<usize>(), 0);
    assert_eq!(s.ext.metrics().binds(gpuplace::scheduler::metrics::BindOutcome::Bound), 8);
}

#[test]
fn nocache_preempt_storm_shrinks_as_binds_accumulate() {
    let s = Server::start();
    let all_nodes = fixture_json("nocache-preempt/filter-001")["Nodes"].clone();
    assert_eq!(all_nodes["items"].as_array().unwrap().len(), 4);
    for seq in 1..=16u32 {
        let rel = format!("nocache-preempt/filter-{seq:03}");
        // the same pod offered every node: gpuplace's own view of which nodes still have room must be
        // exactly the candidates kube-scheduler offered, which it computed from the binds so far
        let mut everywhere = fixture_json(&rel);
        everywhere["Nodes"] = all_nodes.clone();
        let a = s.ok("filter", everywhere.to_string().as_bytes());
        assert_eq!(passing(&a), candidates(&rel), "{rel}: {a}");
        let full: BTreeSet<String> = set(&ALL_NODES).difference(&candidates(&rel)).cloned().collect();
        assert_eq!(names(&a["FailedNodes"]), full, "{rel}: full nodes might fit after preemption");
        assert_eq!(a["FailedAndUnresolvableNodes"], json!({}));

        assert_all_fit(&s.fixture(&rel), &rel);
        if seq <= 12 {
            let rel = format!("nocache-preempt/prioritize-{seq:03}");
            assert_scores(&s.fixture(&rel), &rel, false);
        }
        let rel = format!("nocache-preempt/bind-{seq:03}");
        bind_ok(&s.fixture(&rel), &rel);
    }
    assert_eq!(s.idle().values().sum::<usize>(), 0);
    // urgent (8 GPUs) against four fillers of 2 GPUs per node, sent as full pods: all four are needed
    let a = s.fixture("nocache-preempt/preempt-001");
    assert_eq!(a["NodeNameToMetaVictims"], meta_victims("nocache-preempt/preempt-001"));
    for v in a["NodeNameToMetaVictims"].as_object().unwrap().values() {
        assert_eq!(v["Pods"].as_array().unwrap().len(), 4);
    }

    // a 2-GPU pod needs one filler gone, not four: both forms answer with a single victim per node
    let mut p = fixture_json("nocache-preempt/preempt-001");
    p["Pod"] = fixture_json("nocache-preempt/filter-001")["Pod"].clone();
    p["Pod"]["metadata"]["name"] = json!("small");
    p["Pod"]["metadata"]["uid"] = json!("small-uid");
    let full_answer = s.ok("preempt", p.to_string().as_bytes());
    let mut meta = p.clone();
    meta["NodeNameToMetaVictims"] = meta_victims("nocache-preempt/preempt-001");
    meta["NodeNameToVictims"] = Value::Null;
    let meta_answer = s.ok("preempt", meta.to_string().as_bytes());
    for answer in [&full_answer, &meta_answer] {
        let m = answer["NodeNameToMetaVictims"].as_object().unwrap();
        assert_eq!(m.keys().cloned().collect::<BTreeSet<_>>(), set(&ALL_NODES));
        for (node, v) in m {
            let pods = v["Pods"].as_array().unwrap();
            assert_eq!(pods.len(), 1, "{node}: one filler frees 2 GPUs: {v}");
            assert!(meta["NodeNameToMetaVictims"][node]["Pods"].as_array().unwrap().contains(&pods[0]));
            assert_eq!(v["NumPDBViolations"], 0);
        }
    }
    assert_eq!(s.idle().values().sum::<usize>(), 0, "preempt changes nothing");
}

/// Victims gpuplace knows nothing about are kept; nodes where no victim set helps are dropped.
#[test]
fn preempt_drops_nodes_no_victim_set_helps() {
    let s = Server::start();
    replay_nocache_then_cache(&s);
    let p = fixture_json("cache/preempt-005");
    let victims = meta_victims("cache/preempt-005");
    let uid = |node: &str, i: usize| victims[node]["Pods"][i]["UID"].as_str().unwrap().to_string();
    let mut body = p.clone();
    body["NodeNameToMetaVictims"] = json!({
        // only one of two pods on gpu-node-3: 4 GPUs free, urgent needs 8: dropped
        "gpu-node-3": {"Pods": [{"UID": uid("gpu-node-3", 0)}], "NumPDBViolations": 1},
        // a pod gpuplace has no record of (not a GPU pod): frees nothing; dropped
        "gpu-node-1": {"Pods": [{"UID": "not-a-gpu-pod"}], "NumPDBViolations": 0},
        // enough, plus an unknown pod that is kept as sent (chosen for resources gpuplace does not see)
        "gpu-node-2": {"Pods": [{"UID": uid("gpu-node-2", 0)}, {"UID": "cpu-hog"}], "NumPDBViolations": 5},
        // not a node gpuplace knows
        "cpu-node-9": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0},
    });
    let a = s.ok("preempt", body.to_string().as_bytes());
    assert_eq!(
        a,
        json!({"NodeNameToMetaVictims": {"gpu-node-2": {"Pods": [{"UID": uid("gpu-node-2", 0)}, {"UID": "cpu-hog"}], "NumPDBViolations": 2}}})
    );
    // a refused pod fits nowhere: no node is a preemption candidate
    let mut refused = body.clone();
    refused["Pod"] = fixture_json("cache/filter-004")["Pod"].clone();
    assert_eq!(s.ok("preempt", refused.to_string().as_bytes()), json!({"NodeNameToMetaVictims": {}}));
    // empty and null victim maps are valid, empty answers
    for v in [json!({}), Value::Null] {
        let mut b = p.clone();
        b["NodeNameToMetaVictims"] = v;
        assert_eq!(s.ok("preempt", b.to_string().as_bytes()), json!({"NodeNameToMetaVictims": {}}));
    }
}

#[test]
fn bind_is_idempotent_and_refuses_a_second_node() {
    let s = Server::start();
    assert_all_fit(&s.fixture("cache/filter-002"), "cache/filter-002");
    bind_ok(&s.fixture("cache/bind-002"), "first");
    let after_first = s.ext.cluster();
    let annotation = s.ext.bound_pods().values().next().unwrap().annotation.clone();
    for _ in 0..3 {
        bind_ok(&s.fixture("cache/bind-002"), "retry");
    }
    assert_eq!(s.ext.cluster(), after_first, "retries count nothing twice");
    assert_eq!(s.ext.bound_pods().values().next().unwrap().annotation, annotation);
    let mut other: Value = fixture_json("cache/bind-002");
    other["Node"] = json!("gpu-node-0");
    let a = s.ok("bind", other.to_string().as_bytes());
    assert!(a["Error"].as_str().unwrap().contains("already bound to gpu-node-3"), "{a}");
    assert_eq!(s.ext.cluster(), after_first);
    use gpuplace::scheduler::metrics::BindOutcome as B;
    let m = s.ext.metrics();
    assert_eq!((m.binds(B::Bound), m.binds(B::Repeated), m.binds(B::Conflict)), (1, 3, 1));

    // a bind for a pod never filtered, or onto a node gpuplace does not know, is refused cleanly
    let a = s.fixture("cache/bind-003");
    assert!(a["Error"].as_str().unwrap().contains("was not seen in a filter request"), "{a}");
    s.fixture("cache/filter-003");
    let mut b = fixture_json("cache/bind-003");
    b["Node"] = json!("gpu-node-9");
    let a = s.ok("bind", b.to_string().as_bytes());
    assert!(a["Error"].as_str().unwrap().contains("gpu-node-9 is not in gpuplace's node cache"), "{a}");
    // a node without room: the re-check refuses
    b["Node"] = json!("gpu-node-3");
    let a = s.ok("bind", b.to_string().as_bytes());
    assert!(a["Error"].as_str().unwrap().contains("no longer fits on gpu-node-3"), "{a}");
    assert_eq!(s.ext.cluster(), after_first);

    // the assignment annotation written for c-whole4: 4 exclusive H100s on gpu-node-3, sequence 1
    let ann: Value = serde_json::from_str(annotation.as_deref().unwrap()).unwrap();
    assert_eq!(ann["version"], 1);
    assert_eq!(ann["podUID"], "9bee6ff2-eb8c-4fe6-8ebf-6c44ad33feeb");
    assert_eq!(ann["node"], "gpu-node-3");
    assert_eq!(ann["bindSeq"], 1);
    let gpus = ann["containers"][0]["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 4);
    for g in gpus {
        assert_eq!(
            (g["memoryMiB"].as_u64(), g["corePercent"].as_u64(), g["exclusive"].as_bool()),
            (Some(81559), Some(100), Some(true))
        );
        assert!(g["uuid"].as_str().unwrap().starts_with("GPU-"));
    }
}

/// Fails the first `fail` binds, then succeeds.
struct FlakyBinder {
    fail: usize,
    calls: AtomicUsize,
}

impl Binder for FlakyBinder {
    fn bind<'a>(&'a self, r: &'a BindRequest) -> BindFuture<'a> {
        Box::pin(async move {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            assert!(r.annotations.contains_key(ANNOTATION_ASSIGNMENT), "the annotation goes with the Binding");
            if n < self.fail {
                Err(BindError::Api {
                    call: "create Binding",
                    pod: format!("{}/{}", r.namespace, r.name),
                    status: Some(409),
                    message: "conflict".into(),
                })
            } else {
                Ok(())
            }
        })
    }
}

#[test]
fn a_failed_binding_rolls_the_allocation_back() {
    let binder = Arc::new(FlakyBinder { fail: 1, calls: AtomicUsize::new(0) });
    let s = Server::with(binder.clone(), HttpOptions::default(), None);
    let before = s.ext.cluster();
    s.fixture("cache/filter-003");
    let a = s.fixture("cache/bind-003");
    let e = a["Error"].as_str().unwrap();
    assert!(e.contains("binding failed, GPUs released") && e.contains("conflict"), "{e}");
    assert_eq!(s.ext.cluster(), before, "allocation rolled back");
    assert!(s.ext.bound_pods().is_empty());
    assert_eq!(s.idle()["gpu-node-1"], 8);
    // kube-scheduler retries: this time the Binding succeeds and the GPUs are counted
    bind_ok(&s.fixture("cache/bind-003"), "retry");
    assert_eq!(s.idle()["gpu-node-1"], 0);
    assert_eq!(binder.calls.load(Ordering::SeqCst), 2);
    let b = s.ext.bound_pods();
    assert_eq!(b.values().next().unwrap().bind_seq, 2, "sequence numbers are not reused");
}

/// A filter/prioritize body for the c-whole4 fixture pod renamed to `name`/`uid`, asking for `gpus`
/// whole GPUs, with every fixture node as candidate.
fn pod_args(name: &str, uid: &str, gpus: &str) -> Vec<u8> {
    let mut v = fixture_json("cache/filter-002");
    v["Pod"]["metadata"]["name"] = json!(name);
    v["Pod"]["metadata"]["uid"] = json!(uid);
    let res = json!({ "gpuplace.io/gpu": gpus });
    v["Pod"]["spec"]["containers"][0]["resources"] = json!({ "limits": res, "requests": res });
    v["NodeNames"] = json!(ALL_NODES);
    v.to_string().into_bytes()
}

fn scores(answer: &Value) -> BTreeMap<String, i64> {
    answer
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (h["Host"].as_str().unwrap().into(), h["Score"].as_i64().unwrap()))
        .collect()
}

/// The same requests to a server with the (per-pod) evaluation cache and to one without give the
/// same answers; the cached one only saves work. Both run without the shape cache, which would
/// otherwise answer these pods (tests/shape_cache.rs covers it).
struct CachePair {
    cached: Server,
    plain: Server,
}

impl CachePair {
    fn new() -> Self {
        let cached = ServiceOptions { shape_cache: 0, ..ServiceOptions::default() };
        let plain = ServiceOptions { eval_cache: 0, shape_cache: 0, ..ServiceOptions::default() };
        Self { cached: Server::on_opts(fixture_cluster(), cached), plain: Server::on_opts(fixture_cluster(), plain) }
    }

    fn both(&self, verb: &str, body: &[u8]) -> Value {
        let a = self.cached.ok(verb, body);
        assert_eq!(a, self.plain.ok(verb, body), "{verb}: the cache changed an answer");
        a
    }

    /// (hits, misses) of the cached server.
    fn stats(&self) -> (u64, u64) {
        self.cached.ext.eval_cache_stats()
    }
}

#[test]
fn prioritize_reuses_filter_only_for_the_same_pod_and_unchanged_state() {
    let p = CachePair::new();
    let a = pod_args("a", "uid-a", "4");
    let before = p.cached.ext.cluster();
    assert_eq!(passing(&p.both("filter", &a)), set(&ALL_NODES));
    let first = scores(&p.both("prioritize", &a));
    assert_eq!(p.stats(), (1, 0), "prioritize right after filter reuses its evaluation");
    assert!(first.values().all(|&s| s > 0), "{first:?}");
    assert_eq!(p.cached.ext.cluster(), before, "filter and prioritize change no allocation");

    // another pod of the same shape, never filtered, and the same UID with another request
    p.both("prioritize", &pod_args("c", "uid-c", "4"));
    assert_eq!(p.stats(), (1, 1), "a different pod is not answered from a's evaluation");
    p.both("prioritize", &pod_args("a", "uid-a", "2"));
    assert_eq!(p.stats(), (1, 2), "a changed request is evaluated again");

    // a bind in between: gpu-node-0 is taken whole, so a no longer fits there
    let b = pod_args("b", "uid-b", "8");
    p.both("filter", &b);
    let bind = json!({"PodName": "b", "PodNamespace": "default", "PodUID": "uid-b", "Node": "gpu-node-0"});
    bind_ok(&p.both("bind", bind.to_string().as_bytes()), "b");
    let after = scores(&p.both("prioritize", &a));
    assert_eq!(p.stats(), (1, 3), "an evaluation from before the bind is stale");
    assert_eq!(after["gpu-node-0"], 0, "{after:?}");
    assert_ne!(after, first);

    // filter again after the bind: reused until the next change, here a node's new inventory
    p.both("filter", &a);
    assert_eq!(scores(&p.both("prioritize", &a)), after);
    assert_eq!(p.stats(), (2, 3));
    p.cached.ext.upsert_node(l4_node("gpu-node-1"));
    p.plain.ext.upsert_node(l4_node("gpu-node-1"));
    let changed = scores(&p.both("prioritize", &a));
    assert_eq!(p.stats(), (2, 4), "a node upsert invalidates cached evaluations");
    assert_ne!(changed["gpu-node-1"], after["gpu-node-1"], "an L4 node scores differently: {changed:?}");
}

#[test]
fn prioritize_of_unfiltered_nodes_is_evaluated_again() {
    let p = CachePair::new();
    let mut some: Value = serde_json::from_slice(&pod_args("a", "uid-a", "1")).unwrap();
    some["NodeNames"] = json!(["gpu-node-0", "gpu-node-1"]);
    p.both("filter", some.to_string().as_bytes());
    // kube-scheduler prioritizes a subset of what filter passed; a node filter never saw is not
    // answered from the cache
    p.both("prioritize", &pod_args("a", "uid-a", "1"));
    assert_eq!(p.stats(), (0, 1));
    some["NodeNames"] = json!(["gpu-node-1", "gpu-node-9"]);
    p.both("prioritize", some.to_string().as_bytes());
    assert_eq!(p.stats(), (1, 1), "a subset (and an unknown node, scored 0) is answered from filter");
}

fn l4_node(name: &str) -> gpuplace_core::cluster::Node {
    let board = Board::Pcie {
        model: "NVIDIA L4".into(),
        memory_mib: 22491,
        sockets: 1,
        switches_per_socket: 2,
        gpus_per_switch: 2,
    };
    board.resolve(std::path::Path::new(".")).unwrap().node(name, BTreeMap::new(), 0, 0)
}

#[test]
fn full_nodes_mode_reads_inventory_from_node_annotations() {
    let log_path = std::env::temp_dir().join(format!("gpuplace-plog-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&log_path);
    let log = PlacementLog::open(log_path.to_str().unwrap(), 1 << 20).unwrap();
    let s = Server::with(Arc::new(RecordingBinder::new()), HttpOptions::default(), Some(log));
    let l4 = l4_node("l4-node-0");
    let inventory = NodeInventory::from_node(&l4).to_json();
    let util = UtilizationAnnotation {
        version: 1,
        at_unix_ms: 1_700_000_000_000,
        gpus: vec![GpuUtilization { uuid: l4.gpus[2].uuid.clone(), sm_percent: 55, memory_used_mib: 1234 }],
    }
    .to_json();
    let nodes = json!({"metadata": {}, "items": [
        node_object("l4-node-0", json!({"gpuplace.io/inventory": inventory, "gpuplace.io/utilization": util}), "4"),
        node_object("l4-node-1", json!({}), "4"),
        node_object("cpu-node-0", json!({}), "0").as_object().map(|o| { let mut o = o.clone(); o["status"] = json!({}); Value::Object(o) }).unwrap(),
        node_object("l4-node-2", json!({"gpuplace.io/inventory": "{\"version\":7}"}), "4"),
        // known to the cache by name, no annotation: the cache answers
        node_object("gpu-node-0", json!({}), "8"),
    ]});
    let mut pod = fixture_json("nocache/filter-002")["Pod"].clone();
    pod["metadata"]["name"] = json!("l4-pod");
    pod["metadata"]["uid"] = json!("l4-uid");
    pod["spec"]["containers"][0]["resources"] =
        json!({"limits": {"gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": "8192", "gpuplace.io/gpu-core": "40"}});
    pod["metadata"]["annotations"] = json!({"gpuplace.io/gpu-model": "NVIDIA L4"});
    let body = json!({"Pod": pod, "Nodes": nodes, "NodeNames": null}).to_string();
    let a = s.ok("filter", body.as_bytes());
    assert_eq!(passing(&a), set(&["l4-node-0"]), "{a}");
    let un = a["FailedAndUnresolvableNodes"].as_object().unwrap();
    assert!(un["l4-node-1"].as_str().unwrap().contains("no valid gpuplace.io/inventory annotation"), "{a}");
    assert!(un["cpu-node-0"].as_str().unwrap().contains("not a gpuplace GPU node"), "{a}");
    assert!(un["l4-node-2"].as_str().unwrap().contains("no valid gpuplace.io/inventory annotation"), "{a}");
    assert!(un["gpu-node-0"].as_str().unwrap().contains("gpu-model"), "H100s are not L4s: {a}");
    let p = s.ok("prioritize", body.as_bytes());
    assert!(p[0]["Score"].as_i64().unwrap() > 0 && p[1]["Score"] == 0, "{p}");
    // bind onto the node learned from its annotation
    let bind = json!({"PodName": "l4-pod", "PodNamespace": "default", "PodUID": "l4-uid", "Node": "l4-node-0"});
    bind_ok(&s.ok("bind", bind.to_string().as_bytes()), "l4 bind");
    let r: InspectReport = serde_json::from_slice(&s.call("GET", "/inspect/l4-node-0", b"").body).unwrap();
    let g = &r.nodes[0].gpus;
    assert_eq!(g.len(), 4);
    assert_eq!(g[2].utilization.as_ref().map(|u| u.sm_percent), Some(55));
    let held: Vec<(u32, u64, u32)> =
        g.iter().filter(|g| !g.holders.is_empty()).map(|g| (g.index, g.allocated_mib, g.allocated_percent)).collect();
    assert_eq!(held.len(), 1);
    assert_eq!((held[0].1, held[0].2), (8192, 40));
    assert!(s.call("GET", "/metrics", b"").text().contains("gpuplace_conflicts_total{kind=\"bad_inventory\"} 1"));
    let table = r.table();
    assert!(table.contains("NODE l4-node-0  4 x NVIDIA L4  [tor=tor-9]  1 pod(s)"), "{table}");
    assert!(table.contains("default/l4-pod[main] 8192Mi/40%"), "{table}");
    assert!(table.contains("55%/1234Mi"), "{table}");

    // the placement log: one line per decision, in the documented schema
    let text = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<Decision> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.iter().map(|d| d.verb.as_str()).collect::<Vec<_>>(), ["filter", "prioritize", "bind"]);
    let f = &lines[0];
    assert_eq!((f.pod.as_str(), f.uid.as_str(), f.mode.as_deref()), ("default/l4-pod", "l4-uid", Some("nodes")));
    assert_eq!((f.candidates, f.feasible), (5, 1));
    assert_eq!(f.rejection_classes, BTreeMap::from([("unknown_node".into(), 3), ("unresolvable".into(), 1)]));
    assert_eq!(f.rejections.values().sum::<usize>(), 4);
    // the reasons name no node; each node's own story is in the details
    assert_eq!(f.rejections.len(), 3, "two nodes without a valid inventory share one reason: {:?}", f.rejections);
    assert_eq!(
        f.rejection_details.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        BTreeSet::from(["cpu-node-0", "gpu-node-0", "l4-node-1", "l4-node-2"])
    );
    assert!(f.rejection_details["l4-node-1"].contains("node l4-node-1 has no valid"), "{:?}", f.rejection_details);
    assert!(f.rejection_details["gpu-node-0"].contains("H100"), "the node's models: {:?}", f.rejection_details);
    assert_eq!(f.top.len(), 1);
    let parts: f64 = f.top[0].parts.values().sum();
    assert!((parts - f.top[0].total).abs() < 1e-9, "scorer shares add up to the total");
    let b = &lines[2];
    assert_eq!(b.outcome.as_deref(), Some("bound"));
    let chosen = b.chosen.as_ref().unwrap();
    assert_eq!((chosen.node.as_str(), chosen.bind_seq, chosen.gpus.len()), ("l4-node-0", 1, 1));
    assert_eq!((chosen.gpus[0].memory_mib, chosen.gpus[0].core_percent), (8192, 40));
    let _ = std::fs::remove_file(&log_path);
}

/// The device plugin advertises each GPU as K kubelet devices (`slotsPerGpu` in its inventory), so a
/// K+1st container on one GPU would find no device there at admission: filter turns it away while
/// memory and compute still have room.
#[test]
fn no_more_containers_on_a_gpu_than_the_device_plugin_has_slots() {
    let s = Server::with(Arc::new(RecordingBinder::new()), HttpOptions::default(), None);
    let board = Board::Flat { gpus: 1, model: "NVIDIA L4".into(), memory_mib: 22491 };
    let node = board.resolve(std::path::Path::new(".")).unwrap().node("l4-solo", BTreeMap::new(), 0, 0);
    let mut inventory = NodeInventory::from_node(&node);
    inventory.slots_per_gpu = Some(2);
    let nodes = json!({"metadata": {}, "items": [
        node_object("l4-solo", json!({"gpuplace.io/inventory": inventory.to_json()}), "2"),
    ]});
    let body = |name: &str| {
        let mut pod = fixture_json("nocache/filter-002")["Pod"].clone();
        pod["metadata"]["name"] = json!(name);
        pod["metadata"]["uid"] = json!(format!("uid-{name}"));
        pod["spec"]["containers"][0]["resources"] =
            json!({"limits": {"gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": "1024", "gpuplace.io/gpu-core": "10"}});
        json!({"Pod": pod, "Nodes": nodes, "NodeNames": null}).to_string()
    };
    for name in ["s1", "s2"] {
        assert_eq!(passing(&s.ok("filter", body(name).as_bytes())), set(&["l4-solo"]), "{name}");
        let bind =
            json!({"PodName": name, "PodNamespace": "default", "PodUID": format!("uid-{name}"), "Node": "l4-solo"});
        bind_ok(&s.ok("bind", bind.to_string().as_bytes()), name);
    }
    let a = s.ok("filter", body("s3").as_bytes());
    assert!(passing(&a).is_empty(), "a third container on a 2-slot GPU: {a}");
    let why = a["FailedNodes"]["l4-solo"].as_str().unwrap();
    // the slots are what is short, not memory or compute (the node's figures are for the logs)
    assert_eq!(why, "gpuplace: no device-plugin slot left on the GPUs with room");
    // a bind straight onto the full GPU (no filter first) is refused too, and changes nothing
    let before = s.ext.cluster();
    let bind = json!({"PodName": "s3", "PodNamespace": "default", "PodUID": "uid-s3", "Node": "l4-solo"});
    let e = s.ok("bind", bind.to_string().as_bytes());
    assert!(
        e["Error"].as_str().is_some_and(|e| e.contains("no longer fits") && e.contains("device-plugin slot")),
        "{e}"
    );
    assert_eq!(s.ext.cluster(), before);
    let r: InspectReport = serde_json::from_slice(&s.call("GET", "/inspect/l4-solo", b"").body).unwrap();
    let g = &r.nodes[0].gpus[0];
    assert_eq!((g.slots_used, g.slots, g.holders.len()), (2, Some(2), 2));
    assert!(r.table().contains("slots-full(2)"), "{}", r.table());
}

/// What bind wrote is enough to rebuild every allocation exactly after a restart; forged and
/// colliding annotations are refused.
#[test]
fn allocations_rebuild_exactly_from_bind_annotations() {
    let binder = Arc::new(RecordingBinder::new());
    let s = Server::with(binder.clone(), HttpOptions::default(), None);
    replay_nocache_then_cache(&s);
    let requests: BTreeMap<String, (Pod, String)> =
        ["nocache/filter-002", "nocache/filter-003", "cache/filter-002", "cache/filter-003"]
            .iter()
            .chain(&["cache/filter-005", "cache/filter-006", "cache/filter-007", "cache/filter-008"])
            .map(|rel| {
                let a: ExtenderArgs = decode(&fixture(rel)).unwrap();
                (a.pod.metadata.uid.clone(), (a.pod, rel.to_string()))
            })
            .collect();
    let bindings = binder.bindings();
    assert_eq!(bindings.len(), 8);
    let restored: Vec<RestoredPod> = bindings
        .values()
        .map(|b| RestoredPod {
            uid: b.uid.clone(),
            request: requests[&b.uid].0.request().unwrap(),
            node: b.node.clone(),
            annotation: b.annotations[ANNOTATION_ASSIGNMENT].clone(),
        })
        .collect();
    // a restarted replica shares the key ring that signed them
    let keys = s.ext.key_ring().unwrap();
    let restarted = || {
        let ext = harness::extender(fixture_cluster());
        ext.set_key_ring((*keys).clone());
        ext
    };
    let fresh = restarted();
    assert!(fresh.restore(restored.clone()).is_empty());
    assert_eq!(fresh.cluster(), s.ext.cluster(), "rebuilt exactly");
    assert_eq!(fresh.bound_pods().len(), 8);

    // forged: another pod's annotation, a GPU the node does not have, the wrong node; and two pods
    // claiming the same exclusive GPUs. Signed with the key (as only gpuplace could), so that it is
    // the validation and the collision rule that refuse them.
    let signed = |text: &str| AssignmentAnnotation::parse(text).unwrap().signed(&keys).to_json();
    let mut bad = restored.clone();
    bad[0].uid = "someone-else".into();
    bad[1].annotation = signed(&bad[1].annotation.replacen("GPU-", "GPU-forged-", 1));
    bad[2].node = if bad[2].node == "gpu-node-1" { "gpu-node-0" } else { "gpu-node-1" }.into();
    let mut twin = restored[3].clone();
    twin.uid = "twin".into();
    twin.request.key = "default/a-twin".into();
    twin.annotation = signed(&twin.annotation.replace(&restored[3].uid, "twin"));
    bad.push(twin);
    // ...and what anyone who can edit pods can write: a genuine annotation rewritten for another
    // pod, without the key. Its name sorts first, so without the MAC it would win the collision.
    let mut copy = restored[4].clone();
    copy.uid = "copy".into();
    copy.request.key = "default/a-copy".into();
    copy.annotation = copy.annotation.replace(&restored[4].uid, "copy");
    bad.push(copy);
    let fresh = restarted();
    let conflicts = fresh.restore(bad);
    assert_eq!(conflicts.len(), 5, "{conflicts:?}");
    assert!(conflicts.iter().any(|c| c.reason.contains("written for pod UID")));
    assert!(conflicts.iter().any(|c| c.reason.contains("GPU-forged-")));
    assert!(conflicts.iter().any(|c| c.reason.contains("names node")));
    assert!(conflicts.iter().any(|c| c.reason.contains("held exclusively by another pod")), "{conflicts:?}");
    let forged = conflicts.iter().find(|c| c.pod == "default/a-copy").unwrap();
    assert!(forged.reason.contains("not signed by gpuplace's assignment key"), "{forged:?}");
    assert!(fresh.bound_pods().contains_key(&restored[4].uid), "the genuine owner is counted");
    assert_eq!(fresh.bound_pods().len(), 5);
    assert!(fresh.render_metrics().contains("gpuplace_conflicts_total{kind=\"bad_assignment\"} 5"));
}

/// The real binary in static mode, as the acceptance criterion runs it.
#[test]
fn gpuplace_serve_answers_fixtures() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args([
            "serve",
            "--cluster",
            "examples/clusters/fixture-cluster.yaml",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--workers",
            "1",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let host = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        match Connection::open(&host, TIMEOUT) {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("gpuplace serve did not listen: {e}"),
        }
    };
    let mut post = |rel: &str| -> Value {
        let verb = rel.rsplit('/').next().unwrap().split('-').next().unwrap();
        let r = conn.request("POST", &format!("/gpuplace/{verb}"), &fixture(rel)).unwrap();
        assert_eq!(r.status, 200, "{rel}: {}", r.text());
        serde_json::from_slice(&r.body).unwrap()
    };
    assert_refused_everywhere(&post("cache/filter-004"), "cache/filter-004");
    // where every candidate fits, the binary names the best one only (`--nodes-to-score 1`, its
    // default; the in-process service above names them all, the library's default)
    assert_best_named(&post("nocache/filter-002"), "nocache/filter-002");
    bind_ok(&post("nocache/bind-002"), "nocache/bind-002");
    assert_best_named(&post("cache/filter-002"), "cache/filter-002");
    let inspect = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["inspect", "--url", &format!("http://{host}"), "--node", "gpu-node-3"])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let out = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.status.success(), "{}", String::from_utf8_lossy(&inspect.stderr));
    assert!(out.contains("NODE gpu-node-3") && out.matches("default/nc-whole4[main]").count() == 4, "{out}");
}
