//! Replicas of the extender in API-server mode against the fake API server, and the waits and
//! objects the API-server tests share (tests/apiserver_*.rs).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::extender::Extender;
use gpuplace::k8s::binder::KubeBinder;
use gpuplace::k8s::keys::KeyOptions;
use gpuplace::k8s::leader::{LeaderConfig, Leadership};
use gpuplace::k8s::serve::{self, ApiOptions, Controller};
use gpuplace::placement::mix_learner::MixLearner;
use gpuplace::placement::profile::ProfileConfig;
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::annotations::ANNOTATION_ASSIGNMENT;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::signing::KeyRing;
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::ResourceExt;
use serde_json::{json, Value};

use super::harness::Harness;

pub const WAIT: Duration = Duration::from_secs(3);
pub const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/*/leases/*";
/// Where the replicas watch utilization ConfigMaps.
pub const UTIL_NS: &str = "gpuplace-system";

pub struct Replica {
    pub ext: Arc<Extender>,
    pub binder: Arc<KubeBinder>,
    pub ctl: Controller,
}

pub fn replica(fake: &FakeApiServer, leader: Option<LeaderConfig>) -> Replica {
    replica_with(fake, leader, ProfileConfig::default())
}

pub fn replica_with(fake: &FakeApiServer, leader: Option<LeaderConfig>, profile: ProfileConfig) -> Replica {
    start_replica(fake, leader, profile, None, None)
}

/// A replica that learns its mix with `learner`.
pub fn learning_replica(fake: &FakeApiServer, learner: MixLearner) -> Replica {
    start_replica(fake, None, ProfileConfig::default(), Some(learner), None)
}

/// A replica that watches only the Nodes `selector` (a label selector) matches (`serve --node-selector`).
pub fn selecting_replica(fake: &FakeApiServer, selector: &str) -> Replica {
    start_replica(fake, None, ProfileConfig::default(), None, Some(selector.to_string()))
}

pub fn start_replica(
    fake: &FakeApiServer,
    leader: Option<LeaderConfig>,
    profile: ProfileConfig,
    learner: Option<MixLearner>,
    node_selector: Option<String>,
) -> Replica {
    let client = fake.client().unwrap();
    let leadership = if leader.is_some() { Leadership::elected() } else { Leadership::always() };
    let binder = Arc::new(KubeBinder::new(client.clone(), leadership.clone()));
    let opts = ServiceOptions { ready: false, ..ServiceOptions::default() };
    let ext = Arc::new(
        Harness::new(Cluster::default()).profile(profile).binder(binder.clone()).options(opts).learner(learner).build(),
    );
    let instance = leader.as_ref().map_or("solo".to_string(), |l| l.identity.clone());
    let keys = KeyOptions { resign_every: Duration::from_millis(100), ..KeyOptions::default() };
    let opts = ApiOptions {
        node_selector,
        leader,
        instance,
        utilization_namespace: Some(UTIL_NS.into()),
        keys,
        scheduler_tls: None,
        dra: None,
        books_namespace: Some("gpuplace-system".into()),
    };
    let ctl = serve::start(client, ext.scheduler().clone(), leadership, opts);
    Replica { ext, binder, ctl }
}

pub fn election(identity: &str) -> LeaderConfig {
    let mut cfg = LeaderConfig::new("gpuplace-system", "gpuplace-extender", identity);
    cfg.lease_duration = Duration::from_millis(600);
    cfg.renew_deadline = Duration::from_millis(400);
    cfg.retry_period = Duration::from_millis(100);
    cfg
}

pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lets watch events already sent arrive (for checks that something did *not* happen).
pub async fn settle() {
    tokio::time::sleep(Duration::from_millis(150)).await;
}

pub fn inventory(name: &str, gpus: u32) -> String {
    let gpus: Vec<Value> = (0..gpus)
        .map(|i| json!({"uuid": format!("GPU-{name}-{i}"), "index": i, "model": "A100", "memoryMiB": 40960}))
        .collect();
    json!({"version": 1, "gpus": gpus}).to_string()
}

pub fn gpu_node(name: &str, gpus: u32) -> Node {
    serde_json::from_value(
        json!({"metadata": {"name": name, "annotations": {"gpuplace.io/inventory": inventory(name, gpus)}}}),
    )
    .unwrap()
}

/// A pod asking for `limits` (gpuplace resources) in one container `c`.
pub fn gpu_pod(name: &str, limits: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
    }))
    .unwrap()
}

pub fn whole(n: u32) -> Value {
    json!({"gpuplace.io/gpu": n.to_string()})
}

pub fn share(mem_mib: u32) -> Value {
    json!({"gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": mem_mib.to_string(), "gpuplace.io/gpu-core": "25"})
}

pub fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap()
}

pub async fn bind(ext: &Extender, pod: &Pod, node: &str) -> String {
    let body = json!({"PodName": pod.name_any(), "PodNamespace": "ns", "PodUID": uid(pod), "Node": node});
    ext.bind(body.to_string().as_bytes()).await.unwrap().error
}

pub fn annotation(fake: &FakeApiServer, name: &str) -> Option<String> {
    fake.get::<Pod>("ns", name).and_then(|p| p.annotations().get(ANNOTATION_ASSIGNMENT).cloned())
}

pub fn node_of(fake: &FakeApiServer, name: &str) -> Option<String> {
    fake.get::<Pod>("ns", name).and_then(|p| p.spec.and_then(|s| s.node_name))
}

/// Pods holding GPUs on `node`, by key.
pub fn holders(ext: &Extender, node: &str) -> Vec<String> {
    let mut v: Vec<String> =
        ext.cluster().node(node).map(|n| n.pods().map(|a| a.pod.clone()).collect()).unwrap_or_default();
    v.sort();
    v
}

pub fn total_held(ext: &Extender) -> usize {
    ext.cluster().nodes().iter().map(|n| n.pods().count()).sum()
}

pub async fn ready(ext: &Extender) {
    eventually("ready", || ext.is_ready()).await;
}

/// The key Secret every replica shares (created by the first replica when absent).
pub const KEY_SECRET: &str = "gpuplace-assignment-keys";

pub fn key_ring(fake: &FakeApiServer) -> Option<KeyRing> {
    let secret: Secret = fake.get("gpuplace-system", KEY_SECRET)?;
    let data: BTreeMap<String, Vec<u8>> = secret.data?.into_iter().map(|(k, v)| (k, v.0)).collect();
    KeyRing::from_secret_data(&data).ok()
}
