//! The extender over real HTTP (a server bound to a loopback port, requests over TCP): every
//! kube-scheduler v1.36 fixture replayed in the order it was captured against static mode with
//! `examples/clusters/fixture-cluster.yaml`, binds (idempotence, rollback), preemption, full-Nodes
//! inventory, restore from annotations, HTTP errors, metrics and the placement log, and a property
//! test of arbitrary request bodies.
//!
//! The capture order (see the fixtures' README and tests/extender_fixtures.rs): `nocache/` ran
//! first (nc-whole4 bound on gpu-node-3, nc-gang-0 on gpu-node-2), then `cache/` on the same cluster
//! (c-whole4 on gpu-node-3, c-gang-0 on gpu-node-1, filler-0..3 on gpu-node-0, then preemptions);
//! `nocache-preempt/` ran on a fresh cluster (16 fillers, four per node, then `urgent`).

#[path = "support/fuzz.rs"]
mod fuzz;
#[path = "support/harness.rs"]
mod harness;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplace::extender::http::{spawn, HttpOptions, Running};
use gpuplace::extender::http_client::{Connection, Response};
use gpuplace::extender::wire::{decode, ExtenderArgs, ExtenderPreemptionArgs, Pod};
use gpuplace::extender::Extender;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::Decision;
use gpuplace::scheduler::binder::{BindError, BindFuture, BindRequest, Binder, RecordingBinder};
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::service::{RestoredPod, ServiceOptions};
use gpuplace_core::annotations::{
    AssignmentAnnotation, GpuUtilization, NodeInventory, UtilizationAnnotation, ANNOTATION_ASSIGNMENT,
};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::{load_cluster, Board};
use harness::{fixture, Harness};
use proptest::prelude::*;
use serde_json::{json, Value};

const ALL_NODES: [&str; 4] = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"];
const TIMEOUT: Duration = Duration::from_secs(30);

fn fixture_json(rel: &str) -> Value {
    serde_json::from_slice(&fixture(rel)).unwrap()
}

fn fixture_cluster() -> Cluster {
    load_cluster(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/clusters/fixture-cluster.yaml")).unwrap()
}

/// A static-mode server on a free loopback port.
struct Server {
    ext: Arc<Extender>,
    running: Running,
    conn: Mutex<Option<Connection>>,
}

impl Server {
    fn start() -> Self {
        Self::with(Arc::new(RecordingBinder::new()), HttpOptions::default(), None)
    }

    fn with(binder: Arc<dyn Binder>, opts: HttpOptions, log: Option<PlacementLog>) -> Self {
        Self::on(fixture_cluster(), binder, opts, log)
    }

    fn on(cluster: Cluster, binder: Arc<dyn Binder>, opts: HttpOptions, log: Option<PlacementLog>) -> Self {
        Self::build(cluster, binder, opts, log, ServiceOptions::default())
    }

    fn on_opts(cluster: Cluster, service: ServiceOptions) -> Self {
        Self::build(cluster, Arc::new(RecordingBinder::new()), HttpOptions::default(), None, service)
    }

    fn build(
        cluster: Cluster,
        binder: Arc<dyn Binder>,
        opts: HttpOptions,
        log: Option<PlacementLog>,
        service: ServiceOptions,
    ) -> Self {
        let ext = Arc::new(Harness::new(cluster).binder(binder).options(service).placement_log(log).build());
        let running = spawn(ext.clone(), opts, "127.0.0.1:0", 1).expect("server starts");
        Self { ext, running, conn: Mutex::new(None) }
    }

    /// One request on a kept-alive connection (reopened if the server closed it).
    fn call(&self, method: &str, path: &str, body: &[u8]) -> Response {
        let mut conn = self.conn.lock().unwrap();
        for _ in 0..2 {
            if conn.is_none() {
                *conn = Some(Connection::open(&self.running.addr.to_string(), TIMEOUT).expect("connect"));
            }
            match conn.as_mut().unwrap().request(method, path, body) {
                Ok(r) => return r,
                Err(_) => *conn = None,
            }
        }
        panic!("{method} {path}: no response");
    }

    fn post(&self, verb: &str, body: &[u8]) -> Response {
        self.call("POST", &format!("/gpuplace/{verb}"), body)
    }

    /// POSTs a body that must be answered with 200, and returns the JSON answer.
    fn ok(&self, verb: &str, body: &[u8]) -> Value {
        let r = self.post(verb, body);
        assert_eq!(r.status, 200, "{verb}: {}", r.text());
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        serde_json::from_slice(&r.body).unwrap()
    }

    fn fixture(&self, rel: &str) -> Value {
        let verb = rel.rsplit('/').next().unwrap().split('-').next().unwrap();
        self.ok(verb, &fixture(rel))
    }

    fn inspect(&self) -> InspectReport {
        let r = self.call("GET", "/inspect", b"");
        assert_eq!(r.status, 200);
        serde_json::from_slice(&r.body).unwrap()
    }

    /// Idle GPUs per node, from /inspect.
    fn idle(&self) -> BTreeMap<String, usize> {
        self.inspect()
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.gpus.iter().filter(|g| g.holders.is_empty()).count()))
            .collect()
    }
}

fn names(v: &Value) -> BTreeSet<String> {
    match v {
        Value::Array(a) => a.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
        Value::Object(o) => o.keys().cloned().collect(),
        _ => panic!("not a list or map: {v}"),
    }
}

fn set(n: &[&str]) -> BTreeSet<String> {
    n.iter().map(|s| s.to_string()).collect()
}

/// The passing nodes of a filter answer, in either mode.
fn passing(answer: &Value) -> BTreeSet<String> {
    if answer["Nodes"].is_null() {
        names(&answer["NodeNames"])
    } else {
        answer["Nodes"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }
}

fn candidates(rel: &str) -> BTreeSet<String> {
    let a: ExtenderArgs = decode(&fixture(rel)).unwrap();
    a.candidate_names().unwrap().into_iter().map(String::from).collect()
}

/// A refused pod: every candidate unresolvable, with the fix named; nothing passes.
fn assert_refused_everywhere(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    assert!(passing(answer).is_empty(), "{rel}: {answer}");
    assert_eq!(answer["FailedNodes"], json!({}), "{rel}");
    let un = answer["FailedAndUnresolvableNodes"].as_object().unwrap();
    assert_eq!(un.keys().cloned().collect::<BTreeSet<_>>(), candidates(rel), "{rel}");
    for reason in un.values() {
        let r = reason.as_str().unwrap();
        assert!(r.starts_with("gpuplace: pod default/"), "{r}");
        assert!(r.contains("add `gpuplace.io/gpu: 1`"), "{rel}: the fix is named: {r}");
    }
}

/// Every candidate passes, nothing fails.
fn assert_all_fit(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    assert_eq!(passing(answer), candidates(rel), "{rel}: {answer}");
    assert_eq!(answer["FailedNodes"], json!({}), "{rel}");
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}), "{rel}");
}

/// Every candidate fits, and the answer names one of them, the best, and no failed node
/// (docs/extender-protocol.md, "The best nodes only").
fn assert_best_named(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    let named = passing(answer);
    assert_eq!(named.len(), 1, "{rel}: {answer}");
    assert!(named.is_subset(&candidates(rel)), "{rel}: {answer}");
    assert_eq!(answer["FailedNodes"], json!({}), "{rel}");
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}), "{rel}");
}

/// A member of a group (docs/resources.md, "Groups"): its plan passes one node, every other candidate
/// is turned away with the group's reason.
fn assert_planned(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    let pass = passing(answer);
    assert_eq!(pass.len(), 1, "{rel}: {answer}");
    let un = answer["FailedAndUnresolvableNodes"].as_object().unwrap();
    let mut all: BTreeSet<String> = un.keys().cloned().collect();
    all.extend(pass);
    assert_eq!(all, candidates(rel), "{rel}");
    for reason in un.values() {
        assert!(reason.as_str().unwrap().contains("holds a place for this pod on another node"), "{rel}: {reason}");
    }
}

/// A group member's prioritize: 10 on the node its plan holds (the one filter passed), 0 elsewhere.
fn assert_planned_scores(answer: &Value, rel: &str) {
    let list = answer.as_array().unwrap_or_else(|| panic!("{rel}: prioritize answers a bare list"));
    let scores: Vec<i64> = list.iter().map(|h| h["Score"].as_i64().unwrap()).collect();
    assert_eq!(scores.iter().filter(|&&s| s == 10).count(), 1, "{rel}: {answer}");
    assert_eq!(scores.iter().filter(|&&s| s == 0).count(), scores.len() - 1, "{rel}: {answer}");
}

fn assert_scores(answer: &Value, rel: &str, refused: bool) {
    let list = answer.as_array().unwrap_or_else(|| panic!("{rel}: prioritize answers a bare list"));
    let hosts: Vec<&str> = list.iter().map(|h| h["Host"].as_str().unwrap()).collect();
    let a: ExtenderArgs = decode(&fixture(rel)).unwrap();
    assert_eq!(hosts, a.candidate_names().unwrap(), "{rel}: one entry per candidate, in order");
    for h in list {
        let s = h["Score"].as_i64().unwrap();
        assert!((0..=10).contains(&s), "{rel}: {h}");
        if refused {
            assert_eq!(s, 0, "{rel}");
        } else {
            assert!(s > 0, "{rel}: a fitting node scores above 0: {h}");
        }
    }
}

fn bind_ok(answer: &Value, rel: &str) {
    assert_eq!(answer, &json!({"Error": ""}), "{rel}");
}

fn bind_refused(answer: &Value, rel: &str) {
    let e = answer["Error"].as_str().unwrap();
    assert!(e.contains("add `gpuplace.io/gpu: 1`"), "{rel}: {e}");
}

fn meta_victims(rel: &str) -> Value {
    let p: ExtenderPreemptionArgs = decode(&fixture(rel)).unwrap();
    serde_json::to_value(p.meta_victims()).unwrap()
}

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

#[test]
fn http_errors_are_clear_and_leave_state_alone() {
    let s = Server::with(
        Arc::new(RecordingBinder::new()),
        HttpOptions { prefix: "/gpuplace".into(), max_body_bytes: 8 * 1024, ..HttpOptions::default() },
        None,
    );
    s.fixture("cache/filter-002");
    bind_ok(&s.fixture("cache/bind-002"), "setup");
    let before = s.ext.cluster();

    // over the body limit: 413 (the full-Nodes fixture is ~10 KiB)
    let big = fixture("nocache/filter-002");
    assert!(big.len() > 8 * 1024);
    let r = s.post("filter", &big);
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("--max-body-bytes"));
    // unknown verbs and paths: 404; a verb with GET: 405
    let r = s.post("filters", b"{}");
    assert_eq!(r.status, 404);
    assert!(r.text().contains("unknown extender verb \"filters\""), "{}", r.text());
    assert_eq!(s.call("POST", "/other/filter", b"{}").status, 404);
    assert_eq!(s.call("GET", "/gpuplace/filter", b"").status, 405);
    // malformed, truncated, wrong types, missing pod, no candidates: 400 with the decoder's message
    for (verb, body, needle) in [
        ("filter", &b"not json"[..], "not valid JSON"),
        ("filter", &b""[..], "ends early"),
        ("filter", &fixture("cache/filter-002")[..100], "ends early"),
        ("prioritize", br#"{"Pod":{},"NodeNames":"gpu-node-0"}"#, "at NodeNames"),
        ("filter", br#"{"NodeNames":["gpu-node-0"]}"#, "missing field `Pod`"),
        ("filter", br#"{"Pod":{}}"#, "neither Nodes nor NodeNames"),
        ("bind", br#"{"PodName":"p","PodNamespace":"ns","Node":"n"}"#, "PodUID"),
        ("bind", br#"[]"#, "expected a JSON object (ExtenderBindingArgs)"),
        ("preempt", br#"{"Pod":{},"NodeNameToMetaVictims":{"n":{"Pods":[{"UID":5}]}}}"#, "ExtenderPreemptionArgs"),
        (
            "prioritize",
            br#"{"Pod":{"spec":{"containers":[{"resources":{"limits":{"gpuplace.io/gpu":[]}}}]}},"NodeNames":[]}"#,
            "expected a quantity",
        ),
    ] {
        let r = s.post(verb, body);
        assert_eq!(r.status, 400, "{verb} {}: {}", String::from_utf8_lossy(body), r.text());
        assert!(r.text().contains(needle), "{verb}: {} should mention {needle}", r.text());
    }
    // empty candidate lists: valid, empty answers
    let pod = fixture_json("cache/filter-002")["Pod"].clone();
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": []}).to_string().as_bytes());
    assert_eq!(
        a,
        json!({"Nodes": null, "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""})
    );
    let a = s.ok("filter", json!({"Pod": pod, "Nodes": {"metadata": {}, "items": null}}).to_string().as_bytes());
    assert_eq!(a["Nodes"], json!({"metadata": {}, "items": []}));
    assert_eq!(s.ok("prioritize", json!({"Pod": pod, "NodeNames": []}).to_string().as_bytes()), json!([]));
    // unknown node names: unresolvable with a reason, never an error
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": ["cpu-node-1", "gpu-node-0"]}).to_string().as_bytes());
    assert_eq!(a["NodeNames"], json!(["gpu-node-0"]));
    assert!(a["FailedAndUnresolvableNodes"]["cpu-node-1"].as_str().unwrap().contains("not in gpuplace's node cache"));
    let a = s.ok("prioritize", json!({"Pod": pod, "NodeNames": ["cpu-node-1"]}).to_string().as_bytes());
    assert_eq!(a, json!([{"Host": "cpu-node-1", "Score": 0}]));
    // a pod without gpuplace resources is not gpuplace's to refuse
    let plain = json!({"metadata": {"name": "web", "namespace": "default", "uid": "w"}, "spec": {"containers": [{"name": "c"}]}});
    let a = s.ok("filter", json!({"Pod": plain, "NodeNames": ["gpu-node-3", "anything"]}).to_string().as_bytes());
    assert_eq!(a["NodeNames"], json!(["gpu-node-3", "anything"]));
    assert_eq!(s.ext.cluster(), before, "no request above changed any allocation");

    // probes, metrics, inspect
    assert_eq!(s.call("GET", "/healthz", b"").status, 200);
    assert_eq!(s.call("GET", "/readyz", b"").status, 200);
    s.ext.set_ready(false);
    assert_eq!(s.call("GET", "/readyz", b"").status, 503);
    // not ready: no decision from an incomplete state
    let a = s.fixture("cache/filter-003");
    assert!(a["Error"].as_str().unwrap().contains("not ready"), "{a}");
    assert!(s.fixture("cache/bind-002")["Error"].as_str().unwrap().contains("not ready"));
    assert_eq!(s.post("prioritize", &fixture("cache/prioritize-003")).status, 503);
    assert_eq!(s.post("preempt", &fixture("cache/preempt-005")).status, 503);
    assert_eq!(s.ext.cluster(), before);
    s.ext.set_ready(true);
    let one = s.call("GET", "/inspect/gpu-node-3", b"");
    assert_eq!(one.status, 200);
    let r: InspectReport = serde_json::from_slice(&one.body).unwrap();
    assert_eq!(r.nodes.len(), 1);
    let held: Vec<&str> = r.nodes[0].gpus.iter().flat_map(|g| g.holders.iter().map(|h| h.pod.as_str())).collect();
    assert_eq!(held, ["default/c-whole4"; 4]);
    assert_eq!(s.call("GET", "/inspect/nope", b"").status, 404);
    let metrics = s.call("GET", "/metrics", b"").text();
    for line in [
        "gpuplace_requests_total{verb=\"filter\",code=\"4xx\"} 6",
        "gpuplace_requests_total{verb=\"bind\",code=\"2xx\"} 2",
        "gpuplace_binds_total{result=\"not_ready\"} 1",
        "gpuplace_binds_total{result=\"bound\"} 1",
        "gpuplace_filter_rejections_total{reason=\"unknown_node\"} 1",
        "gpuplace_gpus{state=\"exclusive\"} 4",
        "gpuplace_gpus{state=\"idle\"} 28",
        "gpuplace_gpu_memory_mib{state=\"allocated\"} 326236",
        "gpuplace_gpu_core_percent{state=\"free\"} 2800",
        "gpuplace_pods_bound 1",
        "gpuplace_ready 1",
        "gpuplace_fragmentation_ratio 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.contains("gpuplace_request_duration_seconds_bucket{verb=\"filter\",le=\"+Inf\"}"));
}

#[test]
fn requests_naming_more_nodes_than_a_cluster_has_are_refused_while_decoded() {
    let s = Server::with(
        Arc::new(RecordingBinder::new()),
        HttpOptions { max_request_nodes: 100, ..HttpOptions::default() },
        None,
    );
    let pod = fixture_json("cache/filter-002")["Pod"].clone();
    let names = |n: usize, prefix: &str| (0..n).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>();
    let mut at_limit = names(96, "x");
    at_limit.extend(ALL_NODES.iter().map(|n| n.to_string()));
    // exactly the limit: answered, the known nodes judged and the unknown ones refused
    let a = s.ok("filter", json!({"Pod": pod, "NodeNames": at_limit}).to_string().as_bytes());
    let unknown = a["FailedAndUnresolvableNodes"].as_object().unwrap().keys().filter(|k| k.starts_with('x')).count();
    assert_eq!(unknown, 96);
    let over = |verb: &str, body: Value| {
        let r = s.post(verb, body.to_string().as_bytes());
        assert_eq!(r.status, 413, "{verb}: {}", r.text());
        assert!(r.text().contains("more than 100 nodes (serve --max-request-nodes)"), "{verb}: {}", r.text());
    };
    // one over: the scanner's path, serde_json's path (a name with an escape), and full Nodes
    over("filter", json!({"Pod": pod, "NodeNames": names(101, "x")}));
    over("prioritize", json!({"Pod": pod, "NodeNames": names(101, "x")}));
    let mut escaped = names(101, "x");
    escaped[0] = "a\"b".into();
    over("filter", json!({"Pod": pod, "NodeNames": escaped}));
    let items: Vec<Value> = names(101, "n").iter().map(|n| json!({"metadata": {"name": n}})).collect();
    over("filter", json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}}));
    // preempt: victims keyed by node
    let victims: serde_json::Map<String, Value> =
        names(101, "n").into_iter().map(|n| (n, json!({"Pods": [], "NumPDBViolations": 0}))).collect();
    over("preempt", json!({"Pod": pod, "NodeNameToMetaVictims": victims}));

    // a body over LARGE_BODY_BYTES is decided off the HTTP workers, with the same answer
    let small = fixture("cache/filter-003");
    let expected = s.ok("filter", &small);
    let mut padded = small.clone();
    padded.extend(std::iter::repeat_n(b' ', gpuplace::extender::http::LARGE_BODY_BYTES + 1));
    assert_eq!(s.ok("filter", &padded), expected);
    let metrics = s.call("GET", "/metrics", b"").text();
    assert!(metrics.lines().any(|l| l == "gpuplace_requests_total{verb=\"filter\",code=\"4xx\"} 3"), "{metrics}");
}

/// A 55 MB filter body naming five million unknown nodes, as issue 12 sent: refused within a second
/// while probes keep answering, and the server's memory stays bounded.
#[test]
fn a_body_of_millions_of_unknown_nodes_is_refused_quickly_and_probes_answer_meanwhile() {
    // a full-Nodes deployment's body limit (the default, 4 MiB, is sized for names only)
    let opts = HttpOptions { max_body_bytes: 64 << 20, ..HttpOptions::default() };
    let s = Server::with(Arc::new(RecordingBinder::new()), opts, None);
    let pod = fixture_json("cache/filter-002")["Pod"].to_string();
    let mut body = format!("{{\"Pod\":{pod},\"Nodes\":null,\"NodeNames\":[").into_bytes();
    for i in 0..5_000_000u32 {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(format!("\"x{i:07}\"").as_bytes());
    }
    body.extend_from_slice(b"]}");
    assert!(body.len() > 50 << 20 && body.len() < 64 << 20);
    let addr = s.running.addr.to_string();
    let started = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut conn = Connection::open(&addr, TIMEOUT).expect("connect");
        conn.request("POST", "/gpuplace/filter", &body).expect("answer")
    });
    // probes on their own connection while the body is sent and decided
    let mut probes = 0;
    while !sender.is_finished() {
        let t = Instant::now();
        let mut conn = Connection::open(&s.running.addr.to_string(), TIMEOUT).expect("connect");
        assert_eq!(conn.request("GET", "/healthz", b"").expect("healthz").status, 200);
        assert!(t.elapsed() < Duration::from_secs(1), "healthz took {:?}", t.elapsed());
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = sender.join().unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("more than 15000 nodes"), "{}", r.text());
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert!(probes > 0);
    // the server still decides ordinary requests
    s.fixture("cache/filter-002");
}

/// Sends request headers (and `body`) on a raw connection, leaving it open: a slow or idle client.
fn raw_request(addr: &str, headers: &str, body: &[u8]) -> std::net::TcpStream {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(TIMEOUT)).unwrap();
    c.write_all(
        format!("POST /gpuplace/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n")
            .as_bytes(),
    )
    .unwrap();
    c.write_all(body).unwrap();
    c
}

/// The status line's code of what the server answered on `c` (0 when it closed without one).
fn status_of(c: &mut std::net::TcpStream) -> u16 {
    use std::io::Read;
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Issue 29's H3: a connection that declares a 2 MB body and sends nothing holds neither the
/// large-body gate nor a worker: a real 2 MiB filter is answered meanwhile as fast as without it,
/// and the idle connection is answered 408 once the grace is over. Trickling clients are cut the
/// same way, and a chunked body is read under the same limits (the gate, the size cap).
#[test]
fn slow_idle_and_chunked_bodies_hold_nothing_and_are_cut() {
    let grace = Duration::from_millis(500);
    let opts = HttpOptions { body_grace: grace, ..HttpOptions::default() };
    let s = Server::with(Arc::new(RecordingBinder::new()), opts, None);
    let addr = s.running.addr.to_string();
    let small = fixture("cache/filter-003");
    let expected = s.ok("filter", &small);
    let mut padded = small.clone();
    padded.extend(std::iter::repeat_n(b' ', 2 << 20));
    let timed = |s: &Server| {
        let t = Instant::now();
        assert_eq!(s.ok("filter", &padded), expected);
        t.elapsed()
    };
    let alone = timed(&s);
    let mut idle = raw_request(&addr, "Content-Length: 2000000\r\n", b"");
    std::thread::sleep(Duration::from_millis(50));
    let beside = timed(&s);
    println!(
        "figure: a 2 MiB filter alone {alone:?}, beside a connection declaring 2 MB and sending nothing {beside:?}"
    );
    assert!(beside < alone + Duration::from_secs(1), "alone {alone:?}, beside an idle declared body {beside:?}");
    let t = Instant::now();
    assert_eq!(status_of(&mut idle), 408);
    assert!(t.elapsed() < grace + Duration::from_secs(2), "cut after {:?}", t.elapsed());

    // 500 clients trickling a byte every 100 ms (issue 29's count): every one cut soon after the
    // grace, and a real filter answered meanwhile
    let t = Instant::now();
    let trickling: Vec<_> = (0..500)
        .map(|_| {
            let addr = addr.clone();
            std::thread::Builder::new().stack_size(128 << 10).spawn(move || {
                use std::io::Write;
                let mut c = raw_request(&addr, "Content-Length: 100000\r\n", b"{");
                for _ in 0..100 {
                    std::thread::sleep(Duration::from_millis(100));
                    if c.write_all(b" ").is_err() {
                        break;
                    }
                }
                status_of(&mut c)
            })
        })
        .collect::<Result<_, _>>()
        .expect("a client thread");
    std::thread::sleep(Duration::from_millis(200));
    let meanwhile = timed(&s);
    let statuses: Vec<u16> = trickling.into_iter().map(|h| h.join().unwrap()).collect();
    println!("figure: 500 trickling clients cut after {:?}; a 2 MiB filter meanwhile {meanwhile:?}", t.elapsed());
    assert!(meanwhile < alone + Duration::from_secs(1), "alone {alone:?}, beside 500 trickling clients {meanwhile:?}");
    assert!(statuses.iter().all(|&c| c == 408), "{statuses:?}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());

    // chunked: a large body is decided as the same body sent with a length; over the cap is 413
    let chunked = |body: &[u8]| {
        let mut framed = Vec::new();
        for part in body.chunks(64 << 10) {
            framed.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
            framed.extend_from_slice(part);
            framed.extend_from_slice(b"\r\n");
        }
        framed.extend_from_slice(b"0\r\n\r\n");
        let mut c = raw_request(&addr, "Transfer-Encoding: chunked\r\nConnection: close\r\n", &framed);
        use std::io::Read;
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let answer = chunked(&padded);
    assert!(answer.starts_with("HTTP/1.1 200"), "{}", &answer[..answer.len().min(300)]);
    let mut over = small.clone();
    over.extend(std::iter::repeat_n(b' ', gpuplace::extender::http::DEFAULT_MAX_BODY_BYTES));
    let answer = chunked(&over);
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("--max-body-bytes"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    // and the server still answers
    assert_eq!(s.ok("filter", &small), expected);
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

fn node_object(name: &str, annotations: Value, gpus: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"network.gpuplace.io/tor": "tor-9"}, "annotations": annotations},
           "status": {"allocatable": {"gpuplace.io/gpu": gpus}, "capacity": {"gpuplace.io/gpu": gpus}}})
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

// ---------------------------------------------------------------------------------------------------
// Arbitrary bodies over HTTP
// ---------------------------------------------------------------------------------------------------

const SEEDS: [&str; 6] = [
    "cache/filter-003",
    "nocache/filter-002",
    "cache/prioritize-002",
    "cache/bind-005",
    "cache/preempt-005",
    "nocache-preempt/preempt-001",
];

fn fuzz_server() -> &'static Server {
    static S: std::sync::OnceLock<Server> = std::sync::OnceLock::new();
    S.get_or_init(Server::start)
}

proptest! {
    // 1,000 cases each over a kept-alive connection: about 0.1 s per property in the test profile on
    // the 2-core machine (docs/performance.md).
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Real requests with bytes flipped, dropped or inserted, to every verb (and to the wrong verb):
    /// the answer is 200 or 400, never a 5xx or a dropped connection, and a 400 leaves the state alone.
    #[test]
    fn mutated_bodies_get_200_or_400(
        which in 0usize..SEEDS.len(),
        verb in prop::sample::select(vec!["filter", "prioritize", "bind", "preempt"]),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<u8>()), 0..6),
    ) {
        let s = fuzz_server();
        let mut body = fixture(SEEDS[which]);
        fuzz::mutate(&mut body, edits);
        let before = s.ext.cluster();
        let r = s.post(verb, &body);
        prop_assert!(r.status == 200 || r.status == 400, "{} {}: {}", verb, r.status, r.text());
        if r.status == 400 {
            prop_assert!(!r.body.is_empty());
            prop_assert!(s.ext.cluster() == before, "a refused body changed the state");
        } else if verb != "bind" {
            // a group member's filter may reserve its group's plan, never change a pod's allocation
            prop_assert!(pods_only(s.ext.cluster()) == pods_only(before), "{} changed the state", verb);
        }
    }
}

/// The cluster without group reservations (`namespace/group#slot`).
fn pods_only(mut c: Cluster) -> Cluster {
    let reserved: Vec<String> =
        c.nodes().iter().flat_map(|n| n.pods().map(|a| a.pod.clone())).filter(|k| k.contains('#')).collect();
    for k in reserved {
        c.release(&k).unwrap();
    }
    c
}

fn arb_quantity() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        (0i64..12).prop_map(|n| Some(n.to_string())),
        (1u64..200_000).prop_map(|n| Some(n.to_string())),
        "[-0-9a-zA-Z.]{0,6}".prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Well-formed filter and prioritize requests with arbitrary GPU resources and candidates (known,
    /// unknown, repeated; names or full Nodes): always 200, every candidate answered exactly once
    /// (passing, FailedNodes or FailedAndUnresolvableNodes), scores 0..=10, no state change.
    #[test]
    fn any_wellformed_request_is_answered_for_every_candidate(
        gpu in arb_quantity(), mem in arb_quantity(), core in arb_quantity(),
        picks in proptest::collection::vec(0usize..6, 0..8),
        full in any::<bool>(),
    ) {
        let s = fuzz_server();
        let pool = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3", "ghost-0", "ghost-1"];
        let mut limits = serde_json::Map::new();
        for (k, v) in [("gpuplace.io/gpu", gpu), ("gpuplace.io/gpu-mem", mem), ("gpuplace.io/gpu-core", core)] {
            if let Some(v) = v {
                limits.insert(k.into(), json!(v));
            }
        }
        let gpu_free = limits.is_empty();
        let pod = json!({"metadata": {"name": "p", "namespace": "fuzz", "uid": "fuzz-uid"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}});
        let names: Vec<&str> = picks.iter().map(|&i| pool[i]).collect();
        let body = if full {
            let items: Vec<Value> = names.iter().map(|n| node_object(n, json!({}), "8")).collect();
            json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": null})
        } else {
            json!({"Pod": pod, "Nodes": null, "NodeNames": names})
        };
        let body = body.to_string();
        let before = s.ext.cluster();
        let r = s.post("filter", body.as_bytes());
        prop_assert_eq!(r.status, 200, "{}", r.text());
        let a: Value = serde_json::from_slice(&r.body).unwrap();
        let pass = passing(&a);
        let failed = names_of(&a["FailedNodes"]);
        let unres = names_of(&a["FailedAndUnresolvableNodes"]);
        prop_assert!(pass.is_disjoint(&failed) && pass.is_disjoint(&unres) && failed.is_disjoint(&unres), "{}", a);
        let all: BTreeSet<String> = pass.iter().chain(&failed).chain(&unres).cloned().collect();
        prop_assert_eq!(all, names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>());
        // a node gpuplace knows nothing about passes only a pod that asks for no gpuplace resource
        prop_assert!(!pass.contains("ghost-0") || gpu_free, "{}", a);
        let r = s.post("prioritize", body.as_bytes());
        prop_assert_eq!(r.status, 200);
        let p: Value = serde_json::from_slice(&r.body).unwrap();
        let p = p.as_array().unwrap();
        prop_assert_eq!(p.len(), names.len());
        for h in p {
            let score = h["Score"].as_i64().unwrap();
            prop_assert!((0..=10).contains(&score));
            if !pass.contains(h["Host"].as_str().unwrap()) {
                prop_assert_eq!(score, 0);
            }
        }
        prop_assert!(s.ext.cluster() == before);
    }
}

fn names_of(v: &Value) -> BTreeSet<String> {
    v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
}

/// Keeps the fuzz server honest: after arbitrary traffic, it still answers a real request right.
#[test]
fn fuzz_server_still_answers() {
    let s = fuzz_server();
    let r = s.post("filter", &fixture("cache/filter-004"));
    assert_eq!(r.status, 200);
}
