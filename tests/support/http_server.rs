//! A static-mode extender behind a real HTTP server on a loopback port, and the fixture checks the
//! HTTP tests share (tests/extender_http*.rs).
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::harness::{fixture, Harness};
use gpuplace::extender::http::{spawn, HttpOptions, Running};
use gpuplace::extender::http_client::{Connection, Response};
use gpuplace::extender::wire::{decode, ExtenderArgs, ExtenderPreemptionArgs};
use gpuplace::extender::Extender;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::scheduler::binder::{Binder, RecordingBinder};
use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::load_cluster;
use serde_json::{json, Value};

pub const ALL_NODES: [&str; 4] = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"];
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn fixture_json(rel: &str) -> Value {
    serde_json::from_slice(&fixture(rel)).unwrap()
}

pub fn fixture_cluster() -> Cluster {
    load_cluster(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/clusters/fixture-cluster.yaml")).unwrap()
}

/// A static-mode server on a free loopback port.
pub struct Server {
    pub ext: Arc<Extender>,
    pub running: Running,
    pub conn: Mutex<Option<Connection>>,
}

impl Server {
    pub fn start() -> Self {
        Self::with(Arc::new(RecordingBinder::new()), HttpOptions::default(), None)
    }

    pub fn with(binder: Arc<dyn Binder>, opts: HttpOptions, log: Option<PlacementLog>) -> Self {
        Self::on(fixture_cluster(), binder, opts, log)
    }

    pub fn on(cluster: Cluster, binder: Arc<dyn Binder>, opts: HttpOptions, log: Option<PlacementLog>) -> Self {
        Self::build(cluster, binder, opts, log, ServiceOptions::default())
    }

    pub fn on_opts(cluster: Cluster, service: ServiceOptions) -> Self {
        Self::build(cluster, Arc::new(RecordingBinder::new()), HttpOptions::default(), None, service)
    }

    pub fn build(
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
    pub fn call(&self, method: &str, path: &str, body: &[u8]) -> Response {
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

    pub fn post(&self, verb: &str, body: &[u8]) -> Response {
        self.call("POST", &format!("/gpuplace/{verb}"), body)
    }

    /// POSTs a body that must be answered with 200, and returns the JSON answer.
    pub fn ok(&self, verb: &str, body: &[u8]) -> Value {
        let r = self.post(verb, body);
        assert_eq!(r.status, 200, "{verb}: {}", r.text());
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        serde_json::from_slice(&r.body).unwrap()
    }

    pub fn fixture(&self, rel: &str) -> Value {
        let verb = rel.rsplit('/').next().unwrap().split('-').next().unwrap();
        self.ok(verb, &fixture(rel))
    }

    pub fn inspect(&self) -> InspectReport {
        let r = self.call("GET", "/inspect", b"");
        assert_eq!(r.status, 200);
        serde_json::from_slice(&r.body).unwrap()
    }

    /// Idle GPUs per node, from /inspect.
    pub fn idle(&self) -> BTreeMap<String, usize> {
        self.inspect()
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.gpus.iter().filter(|g| g.holders.is_empty()).count()))
            .collect()
    }
}

pub fn names(v: &Value) -> BTreeSet<String> {
    match v {
        Value::Array(a) => a.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
        Value::Object(o) => o.keys().cloned().collect(),
        _ => panic!("not a list or map: {v}"),
    }
}

pub fn set(n: &[&str]) -> BTreeSet<String> {
    n.iter().map(|s| s.to_string()).collect()
}

/// The passing nodes of a filter answer, in either mode.
pub fn passing(answer: &Value) -> BTreeSet<String> {
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

pub fn candidates(rel: &str) -> BTreeSet<String> {
    let a: ExtenderArgs = decode(&fixture(rel)).unwrap();
    a.candidate_names().unwrap().into_iter().map(String::from).collect()
}

/// A refused pod: every candidate unresolvable, with the fix named; nothing passes.
pub fn assert_refused_everywhere(answer: &Value, rel: &str) {
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
pub fn assert_all_fit(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    assert_eq!(passing(answer), candidates(rel), "{rel}: {answer}");
    assert_eq!(answer["FailedNodes"], json!({}), "{rel}");
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}), "{rel}");
}

/// Every candidate fits, and the answer names one of them, the best, and no failed node
/// (docs/extender-protocol.md, "The best nodes only").
pub fn assert_best_named(answer: &Value, rel: &str) {
    assert_eq!(answer["Error"], "", "{rel}");
    let named = passing(answer);
    assert_eq!(named.len(), 1, "{rel}: {answer}");
    assert!(named.is_subset(&candidates(rel)), "{rel}: {answer}");
    assert_eq!(answer["FailedNodes"], json!({}), "{rel}");
    assert_eq!(answer["FailedAndUnresolvableNodes"], json!({}), "{rel}");
}

/// A member of a group (docs/resources.md, "Groups"): its plan passes one node, every other candidate
/// is turned away with the group's reason.
pub fn assert_planned(answer: &Value, rel: &str) {
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
pub fn assert_planned_scores(answer: &Value, rel: &str) {
    let list = answer.as_array().unwrap_or_else(|| panic!("{rel}: prioritize answers a bare list"));
    let scores: Vec<i64> = list.iter().map(|h| h["Score"].as_i64().unwrap()).collect();
    assert_eq!(scores.iter().filter(|&&s| s == 10).count(), 1, "{rel}: {answer}");
    assert_eq!(scores.iter().filter(|&&s| s == 0).count(), scores.len() - 1, "{rel}: {answer}");
}

pub fn assert_scores(answer: &Value, rel: &str, refused: bool) {
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

pub fn bind_ok(answer: &Value, rel: &str) {
    assert_eq!(answer, &json!({"Error": ""}), "{rel}");
}

pub fn bind_refused(answer: &Value, rel: &str) {
    let e = answer["Error"].as_str().unwrap();
    assert!(e.contains("add `gpuplace.io/gpu: 1`"), "{rel}: {e}");
}

pub fn meta_victims(rel: &str) -> Value {
    let p: ExtenderPreemptionArgs = decode(&fixture(rel)).unwrap();
    serde_json::to_value(p.meta_victims()).unwrap()
}

/// A Node object as kube-scheduler sends it in full-Nodes mode: `gpus` allocatable, under ToR `tor-9`.
pub fn node_object(name: &str, annotations: Value, gpus: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"network.gpuplace.io/tor": "tor-9"}, "annotations": annotations},
           "status": {"allocatable": {"gpuplace.io/gpu": gpus}, "capacity": {"gpuplace.io/gpu": gpus}}})
}
