//! API-server mode against the in-process fake API server: the binder (annotation, Binding,
//! rollback, retry), the watchers (release, rebuild after restart, forged annotations, outages),
//! leader election with two replicas, and the standby's forward of every verb to the leader over
//! HTTP and HTTPS.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::extender::forward::{ForwardOptions, Forwarder, Role, Route, FORWARDED_HEADER};
use gpuplace::extender::http::{self, Frontend, HttpOptions};
use gpuplace::extender::pki;
use gpuplace::extender::tls::{self, ClientAuth, ServerFiles};
use gpuplace::extender::Extender;
use gpuplace::k8s::binder::KubeBinder;
use gpuplace::k8s::keys::KeyOptions;
use gpuplace::k8s::leader::ANNOTATION_LEADER_URL;
use gpuplace::k8s::leader::{LeaderConfig, Leadership};
use gpuplace::k8s::serve::{self, ApiOptions, Controller};
use gpuplace::placement::mix_learner::{bundled_prior, MixLearner};
use gpuplace::placement::{profile::ProfileConfig, registry::Weights};
use gpuplace::scheduler::binder::{BindError, BindRequest, Binder};
use gpuplace::scheduler::metrics::{BindOutcome, ConflictKind, Watched};
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::annotations::{
    AllocatedAnnotation, AssignmentAnnotation, GpuUtilization, UtilizationAnnotation, ANNOTATION_ALLOCATED,
    ANNOTATION_ASSIGNMENT, ANNOTATION_REQUEUED, ANNOTATION_UTILIZATION,
};
use gpuplace_core::clock::now_unix_ms;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::signing::{KeyRing, PublicKeys};
use gpuplace_core::utilization_configmap::{configmap_name, data, labels};
use gpuplace_testkit::apiserver::FakeApiServer;
use harness::Harness;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::ResourceExt;
use serde_json::{json, Value};

#[path = "support/tls.rs"]
mod certs;
#[path = "support/harness.rs"]
mod harness;

use certs::{https, write as write_pem, Ca, Identity};

const WAIT: Duration = Duration::from_secs(3);
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/*/leases/*";
/// Where the replicas watch utilization ConfigMaps.
const UTIL_NS: &str = "gpuplace-system";

struct Replica {
    ext: Arc<Extender>,
    binder: Arc<KubeBinder>,
    ctl: Controller,
}

fn replica(fake: &FakeApiServer, leader: Option<LeaderConfig>) -> Replica {
    replica_with(fake, leader, ProfileConfig::default())
}

fn replica_with(fake: &FakeApiServer, leader: Option<LeaderConfig>, profile: ProfileConfig) -> Replica {
    start_replica(fake, leader, profile, None, None)
}

/// A replica that learns its mix with `learner`.
fn learning_replica(fake: &FakeApiServer, learner: MixLearner) -> Replica {
    start_replica(fake, None, ProfileConfig::default(), Some(learner), None)
}

/// A replica that watches only the Nodes `selector` (a label selector) matches (`serve --node-selector`).
fn selecting_replica(fake: &FakeApiServer, selector: &str) -> Replica {
    start_replica(fake, None, ProfileConfig::default(), None, Some(selector.to_string()))
}

fn start_replica(
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
    };
    let ctl = serve::start(client, ext.scheduler().clone(), leadership, opts);
    Replica { ext, binder, ctl }
}

fn election(identity: &str) -> LeaderConfig {
    let mut cfg = LeaderConfig::new("gpuplace-system", "gpuplace-extender", identity);
    cfg.lease_duration = Duration::from_millis(600);
    cfg.renew_deadline = Duration::from_millis(400);
    cfg.retry_period = Duration::from_millis(100);
    cfg
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lets watch events already sent arrive (for checks that something did *not* happen).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(150)).await;
}

fn inventory(name: &str, gpus: u32) -> String {
    let gpus: Vec<Value> = (0..gpus)
        .map(|i| json!({"uuid": format!("GPU-{name}-{i}"), "index": i, "model": "A100", "memoryMiB": 40960}))
        .collect();
    json!({"version": 1, "gpus": gpus}).to_string()
}

fn gpu_node(name: &str, gpus: u32) -> Node {
    serde_json::from_value(
        json!({"metadata": {"name": name, "annotations": {"gpuplace.io/inventory": inventory(name, gpus)}}}),
    )
    .unwrap()
}

/// A pod asking for `limits` (gpuplace resources) in one container `c`.
fn gpu_pod(name: &str, limits: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
    }))
    .unwrap()
}

fn whole(n: u32) -> Value {
    json!({"gpuplace.io/gpu": n.to_string()})
}

fn share(mem_mib: u32) -> Value {
    json!({"gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": mem_mib.to_string(), "gpuplace.io/gpu-core": "25"})
}

fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap()
}

async fn bind(ext: &Extender, pod: &Pod, node: &str) -> String {
    let body = json!({"PodName": pod.name_any(), "PodNamespace": "ns", "PodUID": uid(pod), "Node": node});
    ext.bind(body.to_string().as_bytes()).await.unwrap().error
}

fn annotation(fake: &FakeApiServer, name: &str) -> Option<String> {
    fake.get::<Pod>("ns", name).and_then(|p| p.annotations().get(ANNOTATION_ASSIGNMENT).cloned())
}

fn node_of(fake: &FakeApiServer, name: &str) -> Option<String> {
    fake.get::<Pod>("ns", name).and_then(|p| p.spec.and_then(|s| s.node_name))
}

/// Pods holding GPUs on `node`, by key.
fn holders(ext: &Extender, node: &str) -> Vec<String> {
    let mut v: Vec<String> =
        ext.cluster().node(node).map(|n| n.pods().map(|a| a.pod.clone()).collect()).unwrap_or_default();
    v.sort();
    v
}

fn total_held(ext: &Extender) -> usize {
    ext.cluster().nodes().iter().map(|n| n.pods().count()).sum()
}

async fn ready(ext: &Extender) {
    eventually("ready", || ext.is_ready()).await;
}

#[tokio::test]
async fn a_node_selector_limits_the_nodes_watched_and_placed_on() {
    let fake = FakeApiServer::start().await.unwrap();
    let mut train = gpu_node("train-1", 2);
    train.metadata.labels = Some([("gpuplace.io/pool".to_string(), "train".to_string())].into());
    fake.put(&train);
    fake.put(&gpu_node("other-1", 2));
    let r = selecting_replica(&fake, "gpuplace.io/pool=train");
    ready(&r.ext).await;
    eventually("the selected node", || r.ext.has_node("train-1")).await;
    settle().await;
    assert!(!r.ext.has_node("other-1"), "a node the selector leaves out is not gpuplace's");
    // the watch asked the API server for the selected nodes only
    assert!(
        fake.requests().iter().any(|q| q.path.starts_with("/api/v1/nodes") && q.query.contains("labelSelector")),
        "{:?}",
        fake.requests().iter().filter(|q| q.path.starts_with("/api/v1/nodes")).collect::<Vec<_>>()
    );
    // a filter over both: the unselected node is unknown to gpuplace, so nothing is placed there
    let pod = serde_json::to_value(gpu_pod("p", whole(1))).unwrap();
    let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["train-1", "other-1"]});
    let a = r.ext.filter(body.to_string().as_bytes()).unwrap();
    assert_eq!(a.node_names, Some(vec!["train-1".to_string()]), "{a:?}");
}

#[tokio::test]
async fn a_refused_inventory_is_an_event_on_its_node_and_the_node_is_not_placed_on() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("good", 2));
    let corrupt: Node = serde_json::from_value(
        json!({"metadata": {"name": "corrupt", "annotations": {"gpuplace.io/inventory": "{\"version\": 1, \"gpus\": 7}"}}}),
    )
    .unwrap();
    fake.put(&corrupt);
    let r = replica(&fake, None);
    ready(&r.ext).await;
    eventually("an Event", || !fake.events().is_empty()).await;
    settle().await;
    let events: Vec<(String, String, String)> = fake
        .events()
        .iter()
        .map(|e| {
            let s = |v: &Value| v.as_str().unwrap_or("").to_string();
            (s(&e["regarding"]["kind"]), s(&e["regarding"]["name"]), s(&e["reason"]))
        })
        .collect();
    assert_eq!(events, [("Node".to_string(), "corrupt".to_string(), "InventoryRefused".to_string())]);
    assert!(r.ext.has_node("good") && !r.ext.has_node("corrupt"));
    let pod = serde_json::to_value(gpu_pod("p", whole(1))).unwrap();
    let body = json!({"Pod": pod, "Nodes": null, "NodeNames": ["good", "corrupt"]});
    let a = r.ext.filter(body.to_string().as_bytes()).unwrap();
    assert_eq!(a.node_names, Some(vec!["good".to_string()]), "{a:?}");
}

#[tokio::test]
async fn bind_writes_the_annotation_and_the_binding_once_and_retries_are_idempotent() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;

    assert_eq!(bind(&r.ext, &p, "n1").await, "");
    assert_eq!(node_of(&fake, "p").as_deref(), Some("n1"));
    let a = AssignmentAnnotation::parse(&annotation(&fake, "p").unwrap()).unwrap();
    assert_eq!((a.pod_uid.as_str(), a.node.as_str(), a.bind_seq), (uid(&p).as_str(), "n1", 1));
    let calls: Vec<(String, String)> = fake
        .requests()
        .into_iter()
        .filter(|q| q.method != "GET" && q.path.contains("/pods/"))
        .map(|q| (q.method, q.path))
        .collect();
    assert_eq!(
        calls,
        [("POST".into(), "/api/v1/namespaces/ns/pods/p/binding".into())],
        "one call: the Binding carries the assignment"
    );
    // the watch echoes the bound, annotated pod: still counted once
    settle().await;
    assert_eq!(holders(&r.ext, "n1"), ["ns/p"]);
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);

    // kube-scheduler retries the bind: success, nothing counted twice
    assert_eq!(bind(&r.ext, &p, "n1").await, "");
    assert_eq!(r.ext.metrics().binds(BindOutcome::Repeated), 1);
    // the binder itself, asked again for the same bind (an answer lost on the way): success
    let again = BindRequest {
        namespace: "ns".into(),
        name: "p".into(),
        uid: uid(&p),
        node: "n1".into(),
        annotations: BTreeMap::from([(ANNOTATION_ASSIGNMENT.to_string(), annotation(&fake, "p").unwrap())]),
    };
    r.binder.bind(&again).await.unwrap();
    // ...but not to another node, and never onto a pod re-created under the same name
    let elsewhere = BindRequest { node: "n2".into(), ..again.clone() };
    assert!(matches!(r.binder.bind(&elsewhere).await, Err(BindError::Api { call: "Binding", .. })));
    assert_eq!(
        annotation(&fake, "p").map(|t| t.contains("n1")),
        Some(true),
        "the bind that stands keeps its annotation"
    );
    let q = fake.put(&gpu_pod("q", whole(1)));
    let stale = BindRequest { name: "q".into(), uid: "not-q".into(), ..again };
    // the registry treats a UID in the body as a precondition: 409 Conflict, nothing written
    assert!(matches!(r.binder.bind(&stale).await, Err(BindError::Api { call: "Binding", status: Some(409), .. })));
    assert_eq!(annotation(&fake, "q"), None);
    assert_eq!(node_of(&fake, "q"), None);
    drop(q);
}

/// A node whose device plugin confirms allocations (a kubelet calls its Allocate): its inventory
/// says so.
fn confirming_node(name: &str, gpus: u32) -> Node {
    let mut inv: Value = serde_json::from_str(&inventory(name, gpus)).unwrap();
    inv["confirmsAllocations"] = json!(true);
    serde_json::from_value(
        json!({"metadata": {"name": name, "annotations": {"gpuplace.io/inventory": inv.to_string()}}}),
    )
    .unwrap()
}

/// A share of one GPU with `mem_mib` MiB and `core` percent.
fn share_of(mem_mib: u32, core: u32) -> Value {
    json!({"gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": mem_mib.to_string(), "gpuplace.io/gpu-core": core.to_string()})
}

/// The device plugin's marker on pod `name`: container `c` allocated, `unconfirmed` or not.
fn mark_allocated(fake: &FakeApiServer, name: &str, unconfirmed: bool) {
    let mut p: Pod = fake.get("ns", name).unwrap();
    let marker = AllocatedAnnotation::new(&uid(&p), ["c".to_string()]);
    let marker = if unconfirmed { marker.with_unconfirmed(["c".to_string()]) } else { marker };
    p.annotations_mut().insert(ANNOTATION_ALLOCATED.into(), marker.to_json());
    fake.put(&p);
}

/// Issue 28: kubelet's Allocate does not name the pod, so on a node whose device plugin confirms its
/// allocations, a pod whose slice differs from one still awaiting its Allocate on the same GPU is
/// bound only once that pod is admitted; pods with the same slices, and nodes without the word, never
/// wait; a wait that does not end in time rolls back and is retried.
#[tokio::test]
async fn binds_the_device_plugin_could_confuse_wait_for_the_first_pods_admission() {
    let fake = FakeApiServer::start().await.unwrap();
    // one GPU each (40960 MiB): every share lands on it
    fake.put(&confirming_node("n1", 1));
    fake.put(&gpu_node("n2", 1));
    let a = fake.put(&gpu_pod("a", share_of(8192, 25)));
    let twin = fake.put(&gpu_pod("twin", share_of(8192, 25)));
    let b = fake.put(&gpu_pod("b", share_of(16384, 25)));
    let d = fake.put(&gpu_pod("d", share_of(4096, 25)));
    let x = fake.put(&gpu_pod("x", share_of(8192, 25)));
    let y = fake.put(&gpu_pod("y", share_of(16384, 25)));
    let r = replica(&fake, None);
    ready(&r.ext).await;

    assert_eq!(bind(&r.ext, &a, "n1").await, "");
    // the same slices: either match is right for the limits, no wait
    let started = std::time::Instant::now();
    assert_eq!(bind(&r.ext, &twin, "n1").await, "");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    // other limits on the same GPU while a and twin await their Allocate: the Binding waits
    let pending = tokio::spawn({
        let (ext, b) = (r.ext.clone(), b.clone());
        async move { bind(&ext, &b, "n1").await }
    });
    settle().await;
    assert!(!pending.is_finished());
    assert_eq!(node_of(&fake, "b"), None, "no Binding yet");
    assert_eq!(holders(&r.ext, "n1"), ["ns/a", "ns/b", "ns/twin"], "its GPUs are counted meanwhile");
    // the plugin marks a allocated, and twin only as a match among twins, not confirmed yet
    mark_allocated(&fake, "a", false);
    mark_allocated(&fake, "twin", true);
    settle().await;
    assert!(!pending.is_finished(), "twin's match is not confirmed");
    // pod-resources confirmed it: b is bound
    mark_allocated(&fake, "twin", false);
    assert_eq!(tokio::time::timeout(WAIT, pending).await.unwrap().unwrap(), "");
    assert_eq!(node_of(&fake, "b").as_deref(), Some("n1"));

    // d's slice differs from b's, and b is never admitted: refused after the wait, retryable, rolled back
    let started = std::time::Instant::now();
    let e = bind(&r.ext, &d, "n1").await;
    assert!(started.elapsed() >= Duration::from_secs(2), "{:?}", started.elapsed());
    assert!(e.contains("ns/b still awaits its device-plugin Allocate") && e.contains("retry"), "{e}");
    assert!(!e.contains('%'), "{e}");
    assert_eq!(node_of(&fake, "d"), None);
    assert_eq!(holders(&r.ext, "n1"), ["ns/a", "ns/b", "ns/twin"]);
    assert_eq!(r.ext.metrics().binds(BindOutcome::AdmissionWait), 1);
    // once b is gone, d binds at once
    fake.remove::<Pod>("ns", "b");
    eventually("b released", || holders(&r.ext, "n1") == ["ns/a", "ns/twin"]).await;
    assert_eq!(bind(&r.ext, &d, "n1").await, "");

    // a node whose plugin confirms nothing (no kubelet calls Allocate there): never a wait
    let started = std::time::Instant::now();
    assert_eq!(bind(&r.ext, &x, "n2").await, "");
    assert_eq!(bind(&r.ext, &y, "n2").await, "");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
}

#[tokio::test]
async fn a_failed_binding_writes_nothing_and_rolls_back_the_allocation() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;

    fake.fail_next("POST", "/api/v1/namespaces/*/pods/*/binding", 1, 500);
    let err = bind(&r.ext, &p, "n1").await;
    assert!(err.contains("binding failed") && err.contains("500"), "{err}");
    assert_eq!(annotation(&fake, "p"), None, "nothing written");
    assert_eq!(node_of(&fake, "p"), None);
    assert!(holders(&r.ext, "n1").is_empty(), "allocation rolled back");
    assert_eq!(r.ext.metrics().binds(BindOutcome::BinderFailed), 1);
    // nothing reached the pod: no forgery seen, no Event
    settle().await;
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    assert!(fake.events().is_empty(), "{:?}", fake.events());

    // kube-scheduler tries again: bound, counted once
    assert_eq!(bind(&r.ext, &p, "n1").await, "");
    settle().await;
    assert_eq!(holders(&r.ext, "n1"), ["ns/p"]);
}

/// `gpuplace serve` runs each bind's calls on the bind client's own thread
/// (`KubeBinder::run_calls_on`): they bind there, and once that thread's runtime is gone a bind is
/// refused, not left hanging and not run elsewhere.
#[tokio::test]
async fn binds_run_on_the_bind_thread_and_are_refused_once_it_is_gone() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let q = fake.put(&gpu_pod("q", whole(1)));
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        handle_tx.send(rt.handle().clone()).unwrap();
        rt.block_on(async {
            let _ = stop_rx.await;
        });
    });
    let handle = handle_rx.recv().unwrap();
    let binder = KubeBinder::new(fake.client().unwrap(), Leadership::always()).run_calls_on(handle);
    let request = |pod: &Pod| BindRequest {
        namespace: "ns".into(),
        name: pod.name_any(),
        uid: uid(pod),
        node: "n1".into(),
        annotations: BTreeMap::new(),
    };

    binder.bind(&request(&p)).await.unwrap();
    assert_eq!(node_of(&fake, "p").as_deref(), Some("n1"));

    stop_tx.send(()).unwrap();
    thread.join().unwrap();
    match binder.bind(&request(&q)).await {
        Err(BindError::Unavailable { pod, message }) => {
            assert_eq!(pod, "ns/q");
            assert!(message.contains("bind thread ended"), "{message}");
        }
        other => panic!("a bind with its thread gone: {other:?}"),
    }
    assert_eq!(node_of(&fake, "q"), None, "nothing bound once the thread is gone");
}

#[tokio::test]
async fn pods_that_are_deleted_or_finish_give_their_gpus_back() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let a = fake.put(&gpu_pod("a", whole(1)));
    let b = fake.put(&gpu_pod("b", share(10240)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &a, "n1").await, "");
    assert_eq!(bind(&r.ext, &b, "n1").await, "");
    assert_eq!(holders(&r.ext, "n1"), ["ns/a", "ns/b"]);

    fake.remove::<Pod>("ns", "a");
    eventually("a released", || holders(&r.ext, "n1") == ["ns/b"]).await;
    let mut done: Pod = fake.get("ns", "b").unwrap();
    done.status.get_or_insert_with(Default::default).phase = Some("Succeeded".into());
    fake.put(&done);
    eventually("b released", || holders(&r.ext, "n1").is_empty()).await;
    assert!(r.ext.bound_pods().is_empty());
    let free = r.ext.summary();
    assert_eq!((free.idle, free.mem_alloc), (2, 0));
}

#[tokio::test]
async fn a_restarted_extender_rebuilds_exactly_before_it_is_ready() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    fake.put(&gpu_node("n2", 1));
    let pods: Vec<Pod> = [("a", whole(2)), ("b", share(8192)), ("c", share(4096)), ("d", whole(1))]
        .into_iter()
        .map(|(n, l)| fake.put(&gpu_pod(n, l)))
        .collect();
    let first = replica(&fake, None);
    ready(&first.ext).await;
    for (p, node) in pods.iter().zip(["n1", "n2", "n2"]) {
        assert_eq!(bind(&first.ext, p, node).await, "", "{}", p.name_any());
    }
    // d does not fit (n1's two GPUs are a's): refused before any API call, nothing left behind
    assert!(bind(&first.ext, &pods[3], "n1").await.contains("no longer fits"));
    assert_eq!((node_of(&fake, "d"), annotation(&fake, "d")), (None, None));
    let before = first.ext.cluster();
    first.ctl.stop();
    drop(first);

    // node list fails once: the pods are listed, but rebuilding waits for the nodes
    fake.fail_next("GET", "/api/v1/nodes", 1, 500);
    let second = replica(&fake, None);
    eventually("pods listed", || fake.requests().iter().any(|q| q.path == "/api/v1/pods" && q.status == 200)).await;
    assert!(!second.ext.is_ready(), "not ready before the nodes are listed and allocations rebuilt");
    ready(&second.ext).await;
    let after = second.ext.cluster();
    for n in ["n1", "n2"] {
        let (x, y) = (before.node(n).unwrap(), after.node(n).unwrap());
        assert_eq!(x.usages(), y.usages(), "{n}");
        let mut px: Vec<_> = x.pods().cloned().collect();
        let mut py: Vec<_> = y.pods().cloned().collect();
        px.sort_by(|a, b| a.pod.cmp(&b.pod));
        py.sort_by(|a, b| a.pod.cmp(&b.pod));
        assert_eq!(px, py, "{n}");
    }
    assert_eq!(total_held(&second.ext), 3);
    settle().await;
    assert_eq!(total_held(&second.ext), 3, "none counted twice");
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    // bind sequences continue where they were
    fake.remove::<Pod>("ns", "b");
    eventually("b released", || total_held(&second.ext) == 2).await;
    let e = fake.put(&gpu_pod("e", share(1024)));
    eventually("e seen", || second.ext.bound_pods().len() == 2 && fake.get::<Pod>("ns", "e").is_some()).await;
    settle().await;
    assert_eq!(bind(&second.ext, &e, "n2").await, "");
    let seq = AssignmentAnnotation::parse(&annotation(&fake, "e").unwrap()).unwrap().bind_seq;
    assert_eq!(seq, 3, "n2 had sequences 1 and 2");
}

/// Assignments that carry gpuplace's MAC (as if made by someone holding the key) are still checked
/// against the pod, its node and what is counted: the MAC says who wrote a record, not that it fits.
#[tokio::test]
async fn signed_but_invalid_assignments_are_never_counted_and_are_reported() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let real = fake.put(&gpu_pod("real", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &real, "n1").await, "");
    let genuine = AssignmentAnnotation::parse(&annotation(&fake, "real").unwrap()).unwrap();
    let keys = key_ring(&fake).unwrap();

    // the same GPUs, rewritten for another pod's UID (node, request and all else valid) and signed
    let forge = |name: &str, limits: Value, node: Option<&str>| {
        let mut p = fake.put(&gpu_pod(name, limits));
        let mut a = genuine.clone();
        a.pod_uid = uid(&p);
        let text = a.signed(&keys).to_json();
        p.metadata.annotations = Some(BTreeMap::from([(ANNOTATION_ASSIGNMENT.to_string(), text)]));
        p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
        fake.put(&p)
    };
    forge("unbound", whole(1), None);
    forge("mismatch", whole(2), Some("n1"));
    forge("collide", whole(1), Some("n1"));
    eventually("two Events", || fake.events().len() >= 2).await;
    settle().await;
    let mut regarding: Vec<(String, String)> = fake
        .events()
        .iter()
        .map(|e| (e["regarding"]["name"].as_str().unwrap().to_string(), e["reason"].as_str().unwrap().to_string()))
        .collect();
    regarding.sort();
    let want = |n: &str| (n.to_string(), "AssignmentNotTrusted".to_string());
    // the unbound one is not counted, and not reported while watching (the stale task removes it;
    // binds of earlier releases showed one for a moment)
    assert_eq!(regarding, [want("collide"), want("mismatch")]);
    let notes: Vec<String> = fake.events().iter().map(|e| e["note"].as_str().unwrap_or("").to_string()).collect();
    assert!(notes.iter().any(|n| n.contains("2 requested")), "{notes:?}");
    assert!(notes.iter().any(|n| n.contains("collides")), "{notes:?}");
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 2);
    assert_eq!(holders(&r.ext, "n1"), ["ns/real"]);
    assert!(r.ext.render_metrics().contains("gpuplace_conflicts_total{kind=\"bad_assignment\"} 2"));

    // an unchanged forgery seen again (any update of the pod) is not reported again
    let mut again: Pod = fake.get("ns", "collide").unwrap();
    again.metadata.labels = Some(BTreeMap::from([("touched".to_string(), "yes".to_string())]));
    fake.put(&again);
    settle().await;
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 2);
    // once the real pod is gone, the collider is still not trusted
    fake.remove::<Pod>("ns", "real");
    eventually("real released", || holders(&r.ext, "n1").is_empty()).await;
    settle().await;
    assert!(holders(&r.ext, "n1").is_empty());

    // a restart (no bind in flight): the unbound one and the mismatch are refused, with Events
    r.ctl.stop();
    let before = fake.events().len();
    let second = replica(&fake, None);
    ready(&second.ext).await;
    eventually("Events again", || fake.events().len() >= before + 2).await;
    let late: Vec<String> =
        fake.events()[before..].iter().map(|e| e["regarding"]["name"].as_str().unwrap().to_string()).collect();
    assert!(late.contains(&"unbound".to_string()) && late.contains(&"mismatch".to_string()), "{late:?}");
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 2);
    assert_eq!(
        total_held(&second.ext),
        1,
        "only the collider's claim, now that nobody else holds the GPU: a key holder can forge"
    );
}

/// The key Secret every replica shares (created by the first replica when absent).
const KEY_SECRET: &str = "gpuplace-assignment-keys";

fn key_ring(fake: &FakeApiServer) -> Option<KeyRing> {
    let secret: Secret = fake.get("gpuplace-system", KEY_SECRET)?;
    let data: BTreeMap<String, Vec<u8>> = secret.data?.into_iter().map(|(k, v)| (k, v.0)).collect();
    KeyRing::from_secret_data(&data).ok()
}

/// Writes the key Secret's data as an operator would (`kubectl apply`).
fn put_keys(fake: &FakeApiServer, data: BTreeMap<String, Vec<u8>>) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(KEY_SECRET.into()),
            namespace: Some("gpuplace-system".into()),
            ..ObjectMeta::default()
        },
        data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
        ..Secret::default()
    };
    fake.put(&secret);
}

/// The public-key ConfigMap the leader publishes.
fn public_keys(fake: &FakeApiServer) -> Option<PublicKeys> {
    let cm: ConfigMap = fake.get("gpuplace-system", "gpuplace-assignment-public-keys")?;
    PublicKeys::from_configmap_data(&cm.data.unwrap_or_default()).ok()
}

/// The id of the key whose signature the pod's assignment carries.
fn signer(fake: &FakeApiServer, pod: &str) -> Option<String> {
    let sig = AssignmentAnnotation::parse(&annotation(fake, pod)?).ok()?.sig?;
    sig.split_once(':').map(|(id, _)| id.to_string())
}

/// Puts pod `name` with the assignment `a` (as JSON) and, when given, bound to `node` directly
/// through `spec.nodeName` (no Binding, no extender).
fn put_assigned(fake: &FakeApiServer, name: &str, limits: Value, node: Option<&str>, a: impl Fn(&str) -> String) {
    let mut p = fake.put(&gpu_pod(name, limits));
    let text = a(&uid(&p));
    p.metadata.annotations = Some(BTreeMap::from([(ANNOTATION_ASSIGNMENT.to_string(), text)]));
    p.spec.as_mut().unwrap().node_name = node.map(str::to_owned);
    fake.put(&p);
}

fn notes_on(fake: &FakeApiServer, pod: &str) -> Vec<String> {
    fake.events()
        .iter()
        .filter(|e| e["regarding"]["name"].as_str() == Some(pod))
        .map(|e| {
            assert_eq!(e["reason"].as_str(), Some("AssignmentNotTrusted"), "{e}");
            e["note"].as_str().unwrap_or("").to_string()
        })
        .collect()
}

fn old_key_gauge(ext: &Extender) -> String {
    let text = ext.render_metrics();
    let line = text.lines().find(|l| l.starts_with("gpuplace_assignments_signed_with_old_key "));
    line.map(|l| l.rsplit(' ').next().unwrap().to_string()).unwrap_or_default()
}

/// What anyone who can edit pods can write, without gpuplace's key, aimed at the GPU a genuine pod
/// holds: never counted (while running, nor after a restart, where the pod-name order that settles
/// collisions would have put `a-forge` first), the genuine owner stays counted, no second pod gets
/// the exclusive GPU once the forgers are gone, and no forged `bindSeq` moves the bind sequence.
#[tokio::test]
async fn forged_assignments_never_take_the_place_of_genuine_ones() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    let real = fake.put(&gpu_pod("real", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &real, "n1").await, "");
    let text = annotation(&fake, "real").unwrap();
    let genuine = AssignmentAnnotation::parse(&text).unwrap();
    let keys = key_ring(&fake).unwrap();
    assert_eq!(genuine.verify(&keys).unwrap(), keys.primary(), "bind signs with the Secret's primary key");
    assert_eq!(r.ext.key_ring().as_deref(), Some(&keys));

    // the genuine record, rewritten for the forger's own UID with a bind sequence far ahead
    let rewritten = |uid: &str| AssignmentAnnotation { pod_uid: uid.into(), bind_seq: 100, ..genuine.clone() };
    // its MAC kept (now wrong), none at all, or made with a key of the forger's
    put_assigned(&fake, "a-forge", whole(1), Some("n1"), |u| rewritten(u).to_json());
    put_assigned(&fake, "a-unsigned", whole(1), Some("n1"), |u| {
        AssignmentAnnotation { sig: None, ..rewritten(u) }.to_json()
    });
    let own = KeyRing::generate().unwrap();
    put_assigned(&fake, "a-badsig", whole(1), Some("n1"), |u| rewritten(u).signed(&own).to_json());
    // the genuine annotation replayed verbatim on a pod bound directly: the MAC holds, the UID not
    put_assigned(&fake, "a-replay", whole(1), Some("n1"), |_| text.clone());
    // on a pod that is not bound
    put_assigned(&fake, "a-unbound", whole(1), None, |u| rewritten(u).to_json());
    eventually("four Events", || fake.events().len() >= 4).await;
    settle().await;
    let not_signed = "not signed by gpuplace's assignment key";
    for (pod, why) in [
        ("a-forge", "the signature does not verify"),
        ("a-unsigned", "it has no `sig`"),
        ("a-badsig", "which is not in the key Secret"),
    ] {
        let notes = notes_on(&fake, pod);
        assert!(notes.len() == 1 && notes[0].contains(not_signed) && notes[0].contains(why), "{pod}: {notes:?}");
    }
    let notes = notes_on(&fake, "a-replay");
    assert!(notes.len() == 1 && notes[0].contains("written for pod UID"), "{notes:?}");
    assert!(notes_on(&fake, "a-unbound").is_empty(), "unbound: not counted, reported only at a rebuild");
    assert_eq!(holders(&r.ext, "n1"), ["ns/real"]);
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 4);

    // a forger gone: the GPU is still the genuine pod's
    let late = fake.put(&gpu_pod("late", whole(1)));
    fake.remove::<Pod>("ns", "a-unsigned");
    eventually("late seen", || fake.get::<Pod>("ns", "late").is_some()).await;
    settle().await;
    assert!(bind(&r.ext, &late, "n1").await.contains("no longer fits"));

    // a restart: every forgery is refused again (the unbound one too, now), `a-forge` sorting
    // before `real` changes nothing, and the genuine record is counted
    r.ctl.stop();
    drop(r);
    let before = fake.events().len();
    let second = replica(&fake, None);
    ready(&second.ext).await;
    eventually("Events again", || fake.events().len() >= before + 4).await;
    settle().await;
    assert_eq!(holders(&second.ext, "n1"), ["ns/real"]);
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 4);
    assert_eq!(second.ext.bound_pods().values().map(|b| b.bind_seq).max(), Some(1), "forged bindSeq ignored");
    let late_events: Vec<String> =
        fake.events()[before..].iter().map(|e| e["regarding"]["name"].as_str().unwrap().to_string()).collect();
    for pod in ["a-forge", "a-badsig", "a-replay", "a-unbound"] {
        assert!(late_events.iter().any(|e| e == pod), "{pod}: {late_events:?}");
    }

    // the forgers gone: still no second pod on the exclusive GPU
    for pod in ["a-forge", "a-badsig", "a-replay", "a-unbound"] {
        fake.remove::<Pod>("ns", pod);
    }
    settle().await;
    assert!(bind(&second.ext, &late, "n1").await.contains("no longer fits"));
    assert_eq!(holders(&second.ext, "n1"), ["ns/real"]);
    // the genuine pod gone: the next bind on n1 continues the genuine sequence, not the forged one
    fake.remove::<Pod>("ns", "real");
    eventually("real released", || holders(&second.ext, "n1").is_empty()).await;
    assert_eq!(bind(&second.ext, &late, "n1").await, "");
    let seq = AssignmentAnnotation::parse(&annotation(&fake, "late").unwrap()).unwrap().bind_seq;
    assert_eq!(seq, 2, "after the genuine 1, whatever the forgeries said");
}

/// The first replica creates the key Secret (one random key); the second, racing it, reads the
/// winner's: both sign and verify with one ring, so the standby counts the leader's binds. The
/// Secret is only ever read by name (field selector), as RBAC's resourceNames require.
#[tokio::test]
async fn the_key_secret_is_created_when_absent_and_shared_by_two_replicas() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    assert!(key_ring(&fake).is_none());
    let a = replica(&fake, Some(election("a")));
    let b = replica(&fake, Some(election("b")));
    eventually("both rebuilt", || a.ctl.readiness.is_rebuilt() && b.ctl.readiness.is_rebuilt()).await;
    let keys = key_ring(&fake).expect("the Secret was created");
    assert_eq!(keys.ids(), [keys.primary()], "one key");
    let secret: Secret = fake.get("gpuplace-system", KEY_SECRET).unwrap();
    assert_eq!(secret.data.unwrap()[&format!("ed25519.{}", keys.primary())].0.len(), 32);
    assert_eq!(a.ext.key_ring().as_deref(), Some(&keys));
    assert_eq!(b.ext.key_ring().as_deref(), Some(&keys));
    let creates: Vec<u16> = fake
        .requests()
        .iter()
        .filter(|q| q.method == "POST" && q.path == "/api/v1/namespaces/gpuplace-system/secrets")
        .map(|q| q.status)
        .collect();
    assert_eq!(creates.iter().filter(|&&s| s == 201).count(), 1, "{creates:?}");
    assert!(creates.iter().all(|&s| s == 201 || s == 409), "{creates:?}");
    for q in fake.requests().iter().filter(|q| q.method == "GET" && q.path.contains("/secrets")) {
        let by_name = q.path == format!("/api/v1/namespaces/gpuplace-system/secrets/{KEY_SECRET}")
            || q.query_param("fieldSelector").as_deref() == Some(&*format!("metadata.name={KEY_SECRET}"));
        assert!(by_name, "{q:?}");
    }

    eventually("one ready", || a.ext.is_ready() || b.ext.is_ready()).await;
    // the leader publishes the public halves, which the device plugins verify with
    eventually("public keys published", || public_keys(&fake) == Some(keys.public_keys())).await;
    let (leader, standby) = if a.ext.is_ready() { (&a, &b) } else { (&b, &a) };
    assert_eq!(bind(&leader.ext, &p, "n1").await, "");
    eventually("the standby verifies and counts the leader's bind", || holders(&standby.ext, "n1") == ["ns/p"]).await;
    assert_eq!(standby.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
}

/// A Secret without a usable ring is an error, not a guess: the replica does not rebuild or turn
/// ready until it is fixed.
#[tokio::test]
async fn a_malformed_key_secret_keeps_the_replica_unready() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k1".to_vec()), ("ed25519.k1".into(), vec![7; 16])]));
    let r = replica(&fake, None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!r.ext.is_ready() && !r.ctl.readiness.is_rebuilt() && !r.ctl.readiness.keys_loaded());
    put_keys(&fake, BTreeMap::from([("ed25519.k1".into(), vec![7; 32])]));
    settle().await;
    assert!(!r.ext.is_ready(), "no primary");
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k1".to_vec()), ("ed25519.k1".into(), vec![7; 32])]));
    ready(&r.ext).await;
    assert_eq!(r.ext.key_ring().unwrap().primary(), "k1");
    assert_eq!(key_ring(&fake).unwrap().primary(), "k1", "an existing Secret is never replaced");
    // broken again while running: unready, nothing counted is lost
    put_keys(&fake, BTreeMap::from([("primary".into(), b"k2".to_vec()), ("ed25519.k1".into(), vec![7; 32])]));
    eventually("unready", || !r.ext.is_ready()).await;
}

/// Rotation without losing records: a new primary key signs new binds, the leader re-signs the old
/// records with it (the gauge shows what is left), and once it reaches 0 the old key can go: a
/// restarted replica still counts every record.
#[tokio::test]
async fn a_rotation_re_signs_old_records_which_survive_the_old_keys_removal() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let pods: Vec<Pod> = ["p", "q"].iter().map(|n| fake.put(&gpu_pod(n, share(8192)))).collect();
    let r = replica(&fake, None);
    ready(&r.ext).await;
    for p in &pods {
        assert_eq!(bind(&r.ext, p, "n1").await, "");
    }
    let old = key_ring(&fake).unwrap();
    assert_eq!((signer(&fake, "p"), old_key_gauge(&r.ext)), (Some(old.primary().to_string()), "0".into()));

    // while pod writes fail, the records wait, and the gauge says so
    fake.fail_next("PATCH", "/api/v1/namespaces/ns/pods/*", 100_000, 500);
    let new = old.rotate().unwrap();
    put_keys(&fake, new.to_secret_data());
    eventually("new ring installed", || r.ext.key_ring().is_some_and(|k| k.primary() == new.primary())).await;
    assert_eq!(old_key_gauge(&r.ext), "2");
    assert_eq!(signer(&fake, "p").as_deref(), Some(old.primary()));
    fake.clear_faults();
    eventually("re-signed", || {
        ["p", "q"].iter().all(|n| signer(&fake, n).as_deref() == Some(new.primary())) && old_key_gauge(&r.ext) == "0"
    })
    .await;
    settle().await;
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"]);
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0, "the re-signed echo is the same record");
    assert!(fake.events().is_empty(), "{:?}", fake.events());
    // new binds use the new key
    let s = fake.put(&gpu_pod("s", share(4096)));
    eventually("s seen", || fake.get::<Pod>("ns", "s").is_some()).await;
    settle().await;
    assert_eq!(bind(&r.ext, &s, "n1").await, "");
    assert_eq!(signer(&fake, "s").as_deref(), Some(new.primary()));

    // the old key leaves the Secret; a restarted replica counts every record
    let mut data = new.to_secret_data();
    data.remove(&format!("ed25519.{}", old.primary()));
    put_keys(&fake, data);
    eventually("old key gone", || r.ext.key_ring().is_some_and(|k| k.ids() == [new.primary()])).await;
    r.ctl.stop();
    drop(r);
    let second = replica(&fake, None);
    ready(&second.ext).await;
    assert_eq!(holders(&second.ext, "n1"), ["ns/p", "ns/q", "ns/s"]);
    assert_eq!(second.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    assert_eq!(old_key_gauge(&second.ext), "0");
}

/// The upgrade from a version that did not sign: without `--accept-unsigned-assignments` unsigned
/// records are refused like forgeries; with it they are counted (never one whose `sig` is bad), and
/// the leader signs them, so that the flag can go.
#[tokio::test]
async fn unsigned_assignments_count_only_with_the_migration_flag_and_are_then_signed() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    fake.put(&gpu_node("n2", 1));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let q = fake.put(&gpu_pod("q", whole(1)));
    let first = replica(&fake, None);
    ready(&first.ext).await;
    assert_eq!(bind(&first.ext, &p, "n1").await, "");
    assert_eq!(bind(&first.ext, &q, "n2").await, "");
    first.ctl.stop();
    drop(first);
    // p as the old version wrote it; q with a signature nobody made
    let rewrite = |name: &str, sig: Option<String>| {
        let mut pod: Pod = fake.get("ns", name).unwrap();
        let a = AssignmentAnnotation { sig, ..AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap() };
        pod.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_ASSIGNMENT.into(), a.to_json());
        fake.put(&pod);
    };
    rewrite("p", None);
    rewrite("q", Some("k0:AAAA".into()));

    let strict = replica(&fake, None);
    ready(&strict.ext).await;
    assert_eq!(total_held(&strict.ext), 0);
    assert_eq!(strict.ext.metrics().conflicts(ConflictKind::BadAssignment), 2);
    let accepting =
        |ext: &Extender| ext.render_metrics().lines().any(|l| l == "gpuplace_accept_unsigned_assignments 1");
    assert!(!accepting(&strict.ext), "the alert's gauge is 0 without the flag");
    strict.ctl.stop();
    drop(strict);

    let client = fake.client().unwrap();
    let leadership = Leadership::always();
    let binder = Arc::new(KubeBinder::new(client.clone(), leadership.clone()));
    let opts = ServiceOptions { ready: false, accept_unsigned: true, ..ServiceOptions::default() };
    let ext = Arc::new(Harness::new(Cluster::default()).binder(binder).options(opts).build());
    let keys = KeyOptions { resign_every: Duration::from_millis(100), ..KeyOptions::default() };
    let api = ApiOptions { instance: "migrating".into(), keys, ..ApiOptions::default() };
    let _ctl = serve::start(client, ext.scheduler().clone(), leadership, api);
    ready(&ext).await;
    assert!(accepting(&ext), "GpuplaceUnsignedAssignmentsAccepted's gauge is 1 while unsigned ones are counted");
    assert_eq!(holders(&ext, "n1"), ["ns/p"]);
    assert!(holders(&ext, "n2").is_empty(), "a bad sig is never 'unsigned'");
    assert_eq!(ext.metrics().conflicts(ConflictKind::BadAssignment), 1);
    let primary = key_ring(&fake).unwrap().primary().to_string();
    eventually("p signed", || signer(&fake, "p").as_deref() == Some(primary.as_str())).await;
    eventually("nothing left to sign", || old_key_gauge(&ext) == "0").await;
    assert_eq!(holders(&ext, "n1"), ["ns/p"]);
}

/// The upgrade from a version that signed with HMAC: its Secret gets an Ed25519 primary (the HMAC
/// key kept, verifying the records it made), every record stays counted, the leader re-signs them
/// with the new key, and the plugins' ConfigMap holds only keys they can verify with.
#[tokio::test]
async fn a_legacy_hmac_ring_is_upgraded_and_its_records_re_signed() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let pods: Vec<Pod> = ["p", "q"].iter().map(|n| fake.put(&gpu_pod(n, whole(1)))).collect();
    let first = replica(&fake, None);
    ready(&first.ext).await;
    for p in &pods {
        assert_eq!(bind(&first.ext, p, "n1").await, "");
    }
    first.ctl.stop();
    drop(first);
    // what the HMAC version left: its Secret, and its MACs on the records
    let legacy = vec![9u8; 48];
    put_keys(&fake, BTreeMap::from([("primary".into(), b"old".to_vec()), ("key.old".into(), legacy.clone())]));
    for name in ["p", "q"] {
        let mut pod: Pod = fake.get("ns", name).unwrap();
        let a = AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap();
        let tag = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &legacy), &a.canonical_message());
        let sig = format!("old:{}", base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, tag));
        let a = AssignmentAnnotation { sig: Some(sig), ..a };
        pod.metadata.annotations.as_mut().unwrap().insert(ANNOTATION_ASSIGNMENT.into(), a.to_json());
        fake.put(&pod);
    }

    let r = replica(&fake, None);
    ready(&r.ext).await;
    let ring = key_ring(&fake).expect("the Secret holds an upgraded ring");
    assert_ne!(ring.primary(), "old");
    assert_eq!(ring.to_secret_data()["key.old"], legacy, "the legacy key is kept");
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"], "HMAC records stay counted");
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    eventually("re-signed", || {
        ["p", "q"].iter().all(|n| signer(&fake, n).as_deref() == Some(ring.primary())) && old_key_gauge(&r.ext) == "0"
    })
    .await;
    eventually("published", || public_keys(&fake).is_some_and(|k| k.ids() == [ring.primary()])).await;
    let public = public_keys(&fake).unwrap();
    for name in ["p", "q"] {
        let a = AssignmentAnnotation::parse(&annotation(&fake, name).unwrap()).unwrap();
        assert_eq!(a.verify(&public).unwrap(), ring.primary(), "{name}: a plugin verifies it");
    }
    assert_eq!(holders(&r.ext, "n1"), ["ns/p", "ns/q"]);
}

/// Issue 29: in API-server mode bind places a pod as the API server has it. A filter body sent by
/// anyone who reaches the port (another GPU request, no nodeSelector, a pod that does not exist)
/// changes nothing bind does, and a node the pod's own nodeSelector, required node affinity or
/// tolerations rule out is refused.
#[tokio::test]
async fn bind_places_the_pod_the_api_server_has_not_the_one_a_filter_body_claims() {
    let fake = FakeApiServer::start().await.unwrap();
    for (name, pool) in [("n1", "a"), ("n2", "b")] {
        let mut n = gpu_node(name, 2);
        n.metadata.labels = Some(BTreeMap::from([("pool".to_string(), pool.to_string())]));
        fake.put(&n);
    }
    // a tainted node: only pods that tolerate it
    let mut n3 = gpu_node("n3", 2);
    n3.spec = Some(
        serde_json::from_value(json!({"taints": [{"key": "team", "value": "ml", "effect": "NoSchedule"}]})).unwrap(),
    );
    fake.put(&n3);
    let plain = fake.put(&gpu_pod("plain", whole(1)));
    let mut tolerant = gpu_pod("tolerant", whole(1));
    tolerant.spec.as_mut().unwrap().tolerations = Some(vec![serde_json::from_value(
        json!({"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}),
    )
    .unwrap()]);
    let tolerant = fake.put(&tolerant);
    let mut spec = gpu_pod("p", whole(1));
    spec.spec.as_mut().unwrap().node_selector = Some(BTreeMap::from([("pool".to_string(), "a".to_string())]));
    let p = fake.put(&spec);
    let mut q = gpu_pod("q", share(4096));
    q.spec.as_mut().unwrap().affinity = Some(
        serde_json::from_value(json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]}]}}}))
        .unwrap(),
    );
    let q = fake.put(&q);
    let r = replica(&fake, None);
    ready(&r.ext).await;
    eventually("both pods watched", || r.ext.pods_watched()).await;
    settle().await;

    // another client's filter body for p: a small share, and no nodeSelector
    let mut forged = gpu_pod("p", share(1024));
    forged.metadata.uid = p.metadata.uid.clone();
    assert_eq!(filter(&r.ext, &forged, &["n1", "n2"]), "");
    // a node outside the pod's nodeSelector: refused, nothing counted, nothing written
    let e = bind(&r.ext, &p, "n2").await;
    assert!(e.contains("does not match the pod's nodeSelector pool=a"), "{e}");
    assert!(node_of(&fake, "p").is_none() && holders(&r.ext, "n2").is_empty());
    // the node kube-scheduler would choose: placed with the pod's own request, a whole GPU
    assert_eq!(bind(&r.ext, &p, "n1").await, "");
    let a = AssignmentAnnotation::parse(&annotation(&fake, "p").unwrap()).unwrap();
    assert!(a.containers[0].gpus.iter().all(|g| g.exclusive), "{a:?}");
    // required node affinity, the same way
    let e = bind(&r.ext, &q, "n1").await;
    assert!(e.contains("matches none of the pod's required node affinity terms"), "{e}");
    assert_eq!(bind(&r.ext, &q, "n2").await, "");

    // taints, as kube-scheduler's TaintToleration filter judges them
    let e = bind(&r.ext, &plain, "n3").await;
    assert!(e.contains("node n3 has the taint team=ml:NoSchedule, which the pod does not tolerate"), "{e}");
    assert_eq!(bind(&r.ext, &tolerant, "n3").await, "");

    // a pod the API server does not have: its filter body is not remembered, so no bind places it
    let ghost = json!({"metadata": {"name": "ghost", "namespace": "ns", "uid": "ghost-uid"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": whole(1)}}]}});
    let body = json!({ "Pod": ghost, "Nodes": null, "NodeNames": ["n1"] });
    assert_eq!(r.ext.filter(body.to_string().as_bytes()).unwrap().error, "");
    let started = std::time::Instant::now();
    let body = json!({"PodName": "ghost", "PodNamespace": "ns", "PodUID": "ghost-uid", "Node": "n1"});
    let e = r.ext.bind(body.to_string().as_bytes()).await.unwrap().error;
    assert!(e.contains("was not seen by the pod watcher"), "{e}");
    assert!(started.elapsed() >= Duration::from_secs(2), "it waited for the watch first");
    assert_eq!(holders(&r.ext, "n1"), ["ns/p"]);
}

#[tokio::test]
async fn an_api_server_outage_raises_staleness_and_recovers() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    let staleness = |ext: &Extender| ext.metrics().watch_staleness(Watched::Pods, now_unix_ms()).unwrap();
    assert!(staleness(&r.ext) < 1.0);
    let text = r.ext.render_metrics();
    assert!(text.contains("gpuplace_watch_staleness_seconds{resource=\"pods\"}"), "{text}");
    assert!(text.contains("gpuplace_watch_staleness_seconds{resource=\"nodes\"}"), "{text}");

    fake.set_down(true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(staleness(&r.ext) >= 0.25, "{}", staleness(&r.ext));
    assert!(r.ext.is_ready(), "no leader election: the state it has stays usable");
    fake.set_down(false);
    let p = fake.put(&gpu_pod("late", whole(1)));
    eventually("fresh again", || staleness(&r.ext) < 0.2).await;
    settle().await;
    assert_eq!(bind(&r.ext, &p, "n1").await, "");
}

#[tokio::test]
async fn two_replicas_elect_one_leader_and_fail_over() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let a = replica(&fake, Some(election("a")));
    let b = replica(&fake, Some(election("b")));
    eventually("one ready", || a.ext.is_ready() || b.ext.is_ready()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(a.ext.is_ready() != b.ext.is_ready(), "exactly one ready");
    let (leader, standby, standby_id) = if a.ext.is_ready() { (&a, &b, "b") } else { (&b, &a, "a") };
    assert!(standby.ctl.readiness.is_rebuilt(), "the standby is rebuilt, only not leading");
    assert!(standby.ext.render_metrics().contains("gpuplace_leader 0"));
    assert!(leader.ext.render_metrics().contains("gpuplace_leader 1"));

    // only the leader binds
    assert!(bind(&standby.ext, &p, "n1").await.contains("not ready"));
    let direct = BindRequest {
        namespace: "ns".into(),
        name: "p".into(),
        uid: uid(&p),
        node: "n1".into(),
        annotations: BTreeMap::new(),
    };
    assert!(matches!(standby.binder.bind(&direct).await, Err(BindError::Unavailable { .. })));
    assert_eq!(bind(&leader.ext, &p, "n1").await, "");
    eventually("the standby counts the leader's bind", || holders(&standby.ext, "n1") == ["ns/p"]).await;

    // the leader cannot renew: it steps down before the lease could expire; renewing again, it
    // leads again (the standby saw the Lease change within the lease duration, never expired)
    fake.fail_next("PUT", LEASES, 100_000, 500);
    eventually("leader steps down", || !leader.ext.is_ready()).await;
    assert!(!standby.ext.is_ready(), "never two leaders");
    assert!(matches!(leader.binder.bind(&direct).await, Err(BindError::Unavailable { .. })));
    fake.clear_faults();
    eventually("one leader again", || leader.ext.is_ready() || standby.ext.is_ready()).await;

    // the leader goes away (stops renewing): the standby takes over once the Lease has not changed
    // for a lease duration
    let current: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    let (leader, standby, standby_id) = if leader.ext.is_ready() {
        (leader, standby, standby_id)
    } else {
        (standby, leader, if standby_id == "a" { "b" } else { "a" })
    };
    let transitions = current.spec.unwrap().lease_transitions.unwrap_or(0);
    leader.ctl.stop();
    assert!(!leader.ext.is_ready());
    eventually("standby takes over", || standby.ext.is_ready()).await;
    let lease: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    let spec = lease.spec.unwrap();
    assert_eq!((spec.holder_identity.as_deref(), spec.lease_transitions), (Some(standby_id), Some(transitions + 1)));
    assert!(!leader.ctl.leadership.is_leader(), "the old leader's own deadline has passed");
    // the new leader's state has the old leader's bind: the GPU is not given twice
    let q = fake.put(&gpu_pod("q", whole(2)));
    eventually("q seen", || fake.get::<Pod>("ns", "q").is_some()).await;
    settle().await;
    assert!(bind(&standby.ext, &q, "n1").await.contains("no longer fits"));
}

/// A replica shutting down gracefully hands the Lease back: the standby leads at its next read, long
/// before the lease (30 s here) could expire.
#[tokio::test]
async fn a_replica_shutting_down_hands_the_lease_over_at_once() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let slow = |identity: &str| {
        let mut cfg = election(identity);
        (cfg.lease_duration, cfg.renew_deadline) = (Duration::from_secs(30), Duration::from_secs(20));
        cfg
    };
    let a = replica(&fake, Some(slow("a")));
    eventually("a leads", || a.ext.is_ready()).await;
    let b = replica(&fake, Some(slow("b")));
    eventually("b is rebuilt", || b.ctl.readiness.is_rebuilt()).await;
    settle().await;
    assert!(!b.ext.is_ready(), "b waits while a renews");

    a.ctl.shutdown().await;
    assert!(!a.ext.is_ready() && !a.ctl.leadership.is_leader(), "a stops leading before it lets go");
    eventually("b takes over well within the lease duration", || b.ext.is_ready()).await;
    let spec = fake.get::<Lease>("gpuplace-system", "gpuplace-extender").unwrap().spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));

    // shutting down a replica that does not hold the Lease leaves it alone
    let c = replica(&fake, Some(slow("c")));
    eventually("c is rebuilt", || c.ctl.readiness.is_rebuilt()).await;
    c.ctl.shutdown().await;
    settle().await;
    let spec = fake.get::<Lease>("gpuplace-system", "gpuplace-extender").unwrap().spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert!(b.ext.is_ready());
}

/// Every GPU of `node` (named as [`gpu_node`] names them) at `sm` percent, sampled now.
fn utilization(node: &str, gpus: u32, sm: u32) -> String {
    let gpus = (0..gpus)
        .map(|i| GpuUtilization {
            uuid: format!("GPU-{node}-{i}"),
            sm_percent: sm,
            memory_used_mib: 409 * u64::from(sm),
        })
        .collect();
    UtilizationAnnotation { version: 1, at_unix_ms: now_unix_ms(), gpus }.to_json()
}

/// The device plugin's utilization ConfigMap for `node`, in `ns`.
fn util_configmap(ns: &str, node: &str, value: String) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(configmap_name(node)),
            namespace: Some(ns.into()),
            labels: Some(labels()),
            ..Default::default()
        },
        data: Some(data(node, value)),
        ..Default::default()
    }
}

/// The SM percent of each GPU's sample on `node` (`None`: no sample).
fn samples(ext: &Extender, node: &str) -> Vec<Option<u32>> {
    let cluster = ext.cluster();
    let Some(n) = cluster.node(node) else { return Vec::new() };
    (0..n.gpus.len()).map(|g| n.utilization(g).map(|s| s.sm_pct)).collect()
}

/// prioritize's scores for a one-GPU pod on n1 and n2.
fn scores(ext: &Extender, pod: &Pod) -> (i64, i64) {
    let body = json!({"Pod": pod, "NodeNames": ["n1", "n2"]}).to_string();
    let list = ext.prioritize(body.as_bytes()).unwrap();
    let of = |n: &str| list.iter().find(|h| h.host == n).unwrap().score;
    (of("n1"), of("n2"))
}

#[tokio::test]
async fn utilization_comes_from_configmaps_is_scored_and_goes_with_them() {
    let fake = FakeApiServer::start().await.unwrap();
    // published before its node is known: kept, and applied once the node appears
    fake.put(&util_configmap(UTIL_NS, "n1", utilization("n1", 2, 100)));
    fake.put(&gpu_node("n2", 2));
    // neither in the watched namespace nor labelled: not utilization
    fake.put(&util_configmap("default", "n2", utilization("n2", 2, 100)));
    let mut unlabelled = util_configmap(UTIL_NS, "n2", utilization("n2", 2, 100));
    unlabelled.metadata.labels = None;
    fake.put(&unlabelled);
    // utilization weighs as much as everything else, so a busy node shows in the 0..10 scores
    let profile = ProfileConfig { weights: Weights::default().with("utilization", 12.0), ..Default::default() };
    let r = replica_with(&fake, None, profile);
    ready(&r.ext).await;
    let pod = fake.put(&gpu_pod("p", whole(1)));

    fake.put(&gpu_node("n1", 2));
    eventually("n1's samples from its ConfigMap", || samples(&r.ext, "n1") == [Some(100), Some(100)]).await;
    assert_eq!(samples(&r.ext, "n2"), [None, None]);
    let (busy, idle) = scores(&r.ext, &pod);
    assert!(busy < idle, "a busy n1 scores lower: {busy} vs {idle}");

    // an update applies; the deprecated Node annotation is ignored while the ConfigMap exists
    fake.put(&util_configmap(UTIL_NS, "n1", utilization("n1", 2, 0)));
    eventually("n1 idle again", || samples(&r.ext, "n1") == [Some(0), Some(0)]).await;
    let mut annotated = gpu_node("n1", 2);
    annotated.annotations_mut().insert(ANNOTATION_UTILIZATION.into(), utilization("n1", 2, 100));
    fake.put(&annotated);
    settle().await;
    assert_eq!(samples(&r.ext, "n1"), [Some(0), Some(0)], "the stale annotation does not overwrite");
    assert_eq!(scores(&r.ext, &pod).0, scores(&r.ext, &pod).1);

    // new GPUs on the node (a new inventory) start without samples: the ConfigMap's apply again
    fake.put(&util_configmap(UTIL_NS, "n1", utilization("n1", 2, 100)));
    eventually("busy", || samples(&r.ext, "n1") == [Some(100), Some(100)]).await;
    fake.put(&gpu_node("n1", 3));
    eventually("re-applied to the new inventory", || samples(&r.ext, "n1") == [Some(100), Some(100), None]).await;

    // the ConfigMap deleted (on a real cluster: garbage-collected with its Node): samples dropped
    assert!(fake.remove::<ConfigMap>(UTIL_NS, &configmap_name("n1")));
    eventually("samples dropped", || samples(&r.ext, "n1") == [None, None, None]).await;
    let text = r.ext.render_metrics();
    assert!(text.contains("gpuplace_watch_staleness_seconds{resource=\"configmaps\"}"), "{text}");
    assert!(text.contains("gpuplace_watch_errors_total{resource=\"configmaps\"} 0"), "{text}");
    assert_eq!(samples(&r.ext, "n2"), [None, None], "the other namespace's and the unlabelled one never applied");
}

#[tokio::test]
async fn readiness_does_not_wait_on_the_utilization_watch_whose_errors_are_counted() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    fake.put(&util_configmap(UTIL_NS, "n1", utilization("n1", 2, 100)));
    fake.fail_next("GET", &format!("/api/v1/namespaces/{UTIL_NS}/configmaps"), 1, 500);
    let r = replica(&fake, None);
    ready(&r.ext).await;
    eventually("the failed list counted", || r.ext.metrics().watch_errors(Watched::UtilizationConfigMaps) == 1).await;
    // retried with the watcher's backoff (under a second for the first retry)
    eventually("applied after the retry", || samples(&r.ext, "n1") == [Some(100), Some(100)]).await;
    assert_eq!(r.ext.metrics().watch_errors(Watched::Pods), 0);
}

/// A filter request for `pod` with `nodes` as candidates; returns the extender's `Error`.
fn filter(ext: &Extender, pod: &Pod, nodes: &[&str]) -> String {
    let body = json!({ "Pod": pod, "Nodes": null, "NodeNames": nodes });
    ext.filter(body.to_string().as_bytes()).unwrap().error
}

fn observed(ext: &Extender) -> u64 {
    ext.mix_report().observed
}

/// The learned mix counts each GPU pod once, whichever way this replica first meets it: its first
/// filter (not the later ones, nor its bind or the watch echo), its own bind of a pod it never
/// filtered, the pod watch (a pod another replica bound), or the start-up rebuild. A replica restored
/// from saved state does not count the running pods of its rebuild again.
#[tokio::test]
async fn the_learned_mix_counts_each_pod_once_from_filter_bind_watch_or_rebuild() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 4));
    let p = fake.put(&gpu_pod("p", share(10240)));
    let q = fake.put(&gpu_pod("q", whole(1)));
    fake.put(&gpu_pod("cpu-only", json!({})));
    let a = learning_replica(&fake, MixLearner::default());
    ready(&a.ext).await;
    assert_eq!(observed(&a.ext), 0, "pending pods are not counted by the watch");

    for _ in 0..3 {
        assert_eq!(filter(&a.ext, &p, &["n1"]), "");
    }
    assert_eq!(observed(&a.ext), 1, "one pod, filtered three times");
    assert_eq!(bind(&a.ext, &p, "n1").await, "");
    // q was remembered by the pod watcher, never filtered here: its bind counts it
    assert_eq!(bind(&a.ext, &q, "n1").await, "");
    settle().await;
    assert_eq!(observed(&a.ext), 2, "binds and their watch echoes count nothing more");

    // a fresh replica counts the bound pods from its rebuild
    let b = learning_replica(&fake, MixLearner::default());
    ready(&b.ext).await;
    assert_eq!(observed(&b.ext), 2);
    // a pod the other replica binds reaches it through the watch, once
    let r = fake.put(&gpu_pod("r", whole(2)));
    eventually("r remembered by a", || fake.get::<Pod>("ns", "r").is_some()).await;
    settle().await;
    assert_eq!(bind(&a.ext, &r, "n1").await, "");
    eventually("b counts r", || observed(&b.ext) == 3).await;
    settle().await;
    assert_eq!((observed(&a.ext), observed(&b.ext)), (3, 3));
    assert_eq!(a.ext.mix_report().entries, b.ext.mix_report().entries, "the same pods, the same mix");

    // a replica restored from a's state: the running pods were counted before
    let saved = a.ext.mix_state().unwrap();
    let c = learning_replica(&fake, MixLearner::restore(&saved, bundled_prior()));
    ready(&c.ext).await;
    settle().await;
    assert_eq!(observed(&c.ext), 3);
}

fn requeued(fake: &FakeApiServer, name: &str) -> Option<String> {
    fake.get::<Pod>("ns", name).and_then(|p| p.annotations().get(ANNOTATION_REQUEUED).cloned())
}

/// A pod turned away for want of GPUs that are then freed goes back to kube-scheduler's queue: one
/// annotation update on the pending pod (kube-scheduler retries an extender-rejected pod on it),
/// naming the node; a pod that was not turned away, or was turned away for another reason, is left
/// alone.
#[tokio::test]
async fn a_pod_turned_away_from_gpus_then_freed_is_sent_back_to_the_queue() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    fake.put(&gpu_node("n2", 1));
    let holder = fake.put(&gpu_pod("holder", whole(1)));
    let other = fake.put(&gpu_pod("other", whole(1)));
    let waiting = fake.put(&gpu_pod("waiting", whole(1)));
    let too_big = fake.put(&gpu_pod("too-big", whole(2)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &holder, "n1").await, "");
    assert_eq!(bind(&r.ext, &other, "n2").await, "");
    // both nodes full: turned away on both (capacity); too-big fits on neither, whatever is freed
    let failed = |pod: &Pod| {
        let body = json!({ "Pod": pod, "Nodes": null, "NodeNames": ["n1", "n2"] });
        let out = r.ext.filter(body.to_string().as_bytes()).unwrap();
        (out.failed_nodes.len(), out.failed_and_unresolvable_nodes.len())
    };
    assert_eq!(failed(&waiting), (2, 0));
    assert_eq!(failed(&too_big), (0, 2));

    fake.remove::<Pod>("ns", "holder");
    eventually("waiting requeued", || requeued(&fake, "waiting").is_some()).await;
    let text = requeued(&fake, "waiting").unwrap();
    assert!(text.starts_with("n1 "), "names the node freed: {text}");
    assert_eq!(requeued(&fake, "too-big"), None, "unresolvable everywhere: not requeued");
    let waiting_now: Pod = fake.get("ns", "waiting").unwrap();
    assert_eq!(waiting_now.spec.and_then(|s| s.node_name), None, "only annotated");
    // counted once the patch's answer is back, which can be after the fake stored it
    eventually("the requeue counted", || {
        r.ext.render_metrics().contains("gpuplace_requeued_pods_total{result=\"annotated\"} 1")
    })
    .await;

    // once per rejection: freeing n2 as well sends nothing more until the pod is turned away again
    fake.remove::<Pod>("ns", "other");
    settle().await;
    assert_eq!(requeued(&fake, "waiting").as_deref(), Some(text.as_str()));
}

// ---------------------------------------------------------------------------------------------------
// Two replicas behind their HTTP servers: the standby forwards to the leader
// ---------------------------------------------------------------------------------------------------

/// The certificates of a TLS run (one CA: the replicas' serving certificates double as the forward's
/// client certificates, and kube-scheduler's is a client certificate from the same CA).
struct TlsSetup {
    /// What the callers trust.
    ca_pem: String,
    server: ServerCerts,
    /// kube-scheduler's client certificate.
    scheduler: Identity,
}

/// Where the replicas' certificates come from.
enum ServerCerts {
    /// `--tls-cert`, `--tls-key`, `--tls-client-ca`: one serving certificate for every replica.
    Files { ca_file: std::path::PathBuf, cert: std::path::PathBuf, key: std::path::PathBuf },
    /// `--tls-ca-secret`: each replica issues its own from the extender's CA.
    SelfIssued(Arc<pki::Ca>),
}

impl TlsSetup {
    fn new(name: &str) -> TlsSetup {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("apiserver-extender-{name}-{}", std::process::id()));
        let ca = Ca::new("gpuplace test CA");
        let server = ca.server();
        TlsSetup {
            server: ServerCerts::Files {
                ca_file: write_pem(&dir, "ca.crt", &ca.cert_pem),
                cert: write_pem(&dir, "tls.crt", &server.cert_pem),
                key: write_pem(&dir, "tls.key", &server.key_pem),
            },
            scheduler: ca.client("kube-scheduler"),
            ca_pem: ca.cert_pem,
        }
    }

    /// The default install's: the extender's CA, kube-scheduler's certificate as the leader issues it.
    fn self_issued() -> TlsSetup {
        let ca = pki::Ca::generate(std::time::SystemTime::now()).unwrap();
        let issued = ca.issue(&pki::Leaf::scheduler(), std::time::SystemTime::now(), pki::LEAF_VALIDITY).unwrap();
        TlsSetup {
            ca_pem: ca.cert_pem.clone(),
            server: ServerCerts::SelfIssued(Arc::new(ca)),
            scheduler: Identity { cert_pem: issued.cert_pem, key_pem: issued.key_pem },
        }
    }
}

/// The name every replica's certificate carries (the forward checks it instead of the pod IP).
const SERVICE_NAME: &str = "gpuplace-extender.gpuplace-system.svc";

/// A replica served over HTTP(S) as `gpuplace serve` runs it: its election publishes its URL on
/// the Lease and its forward follows the Lease.
struct Served {
    r: Replica,
    port: u16,
    http: http::Running,
}

impl Drop for Served {
    fn drop(&mut self) {
        // the command is sent at once; nothing waits for the server to finish
        drop(self.http.handle.stop(false));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn served_replica(fake: &FakeApiServer, identity: &str, tls: Option<&TlsSetup>) -> Served {
    let port = free_port();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut cfg = election(identity);
    cfg.advertise_url = Some(format!("{scheme}://127.0.0.1:{port}/gpuplace"));
    let (client, server_tls, server_name) = match tls.map(|t| &t.server) {
        Some(ServerCerts::Files { ca_file, cert, key }) => {
            let files = ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: Some(ca_file.clone()),
                client_auth: ClientAuth::Optional,
            };
            (
                tls::client_config(Some(ca_file), Some((cert, key))).unwrap(),
                Some(tls::server_config(&files).unwrap()),
                Some(SERVICE_NAME.to_string()),
            )
        }
        // as `serve --tls-ca-secret` makes them: the replica's names are its Service's and the
        // advertised host, so the forward verifies the leader by the URL on the Lease
        Some(ServerCerts::SelfIssued(ca)) => {
            let names = pki::replica_names("gpuplace-extender", "gpuplace-system", cfg.advertise_url.as_deref());
            let id = tls::SelfIssued::new(ca.clone(), pki::Leaf::replica(names), std::time::SystemTime::now()).unwrap();
            (
                tls::self_issued_client_config(id.clone()).unwrap(),
                Some(tls::self_issued_server_config(id, ClientAuth::Optional).unwrap()),
                None,
            )
        }
        None => (tls::client_config(None, None).unwrap(), None, None),
    };
    let r = replica(fake, Some(cfg));
    let opts = ForwardOptions { timeout: Duration::from_secs(2), identity: identity.into(), tls: client, server_name };
    let forward = Forwarder::new(r.ctl.readiness.clone(), opts).unwrap();
    let front = Frontend { tls: server_tls, forward: Some(Arc::new(forward)) };
    let http = http::spawn_with(r.ext.clone(), HttpOptions::default(), &format!("127.0.0.1:{port}"), 2, front).unwrap();
    Served { r, port, http }
}

impl Served {
    fn url(&self, tls: bool) -> String {
        format!("{}://127.0.0.1:{}/gpuplace", if tls { "https" } else { "http" }, self.port)
    }

    /// One request as kube-scheduler sends it (over TLS with its client certificate), off the test's
    /// runtime, which the fake API server needs meanwhile. `forwarded_by`: the forward's header
    /// (plain HTTP only).
    async fn call(
        &self,
        tls: Option<&TlsSetup>,
        method: &'static str,
        path: &str,
        body: String,
        forwarded_by: Option<&str>,
    ) -> (u16, String) {
        let port = self.port;
        let path = path.to_string();
        let tls = tls.map(|t| (t.ca_pem.clone(), t.scheduler.clone()));
        let header = forwarded_by.map(|f| format!("{FORWARDED_HEADER}: {f}\r\n")).unwrap_or_default();
        tokio::task::spawn_blocking(move || {
            let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            match tls {
                Some((ca, id)) => https(addr, SERVICE_NAME, &ca, Some(&id), method, &path, body.as_bytes()),
                None => plain(addr, method, &path, &header, body.as_bytes()),
            }
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{method} {}: {e}", self.port))
    }
}

/// A plain HTTP/1.1 request with extra header lines (`Connection: close`).
fn plain(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    extra: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn forwarded(m: &str, verb: &str, result: &str) -> u64 {
    let line = format!("gpuplace_forwarded_requests_total{{verb=\"{verb}\",result=\"{result}\"}} ");
    m.lines().find_map(|l| l.strip_prefix(&line)).and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn binding_posts(fake: &FakeApiServer) -> usize {
    fake.requests().iter().filter(|q| q.method == "POST" && q.path.ends_with("/binding")).count()
}

/// Both replicas are Ready (synced), only the leader decides: every verb sent to the standby is
/// answered by the leader, unchanged; a bind through the standby is one Binding, made and counted
/// by the leader. With the leader's port gone the standby answers as a not-ready extender does;
/// once it leads it decides itself.
async fn a_standby_forwards_every_verb_to_the_leader(tls: Option<TlsSetup>) {
    let t = tls.as_ref();
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let a = served_replica(&fake, "a", t);
    let b = served_replica(&fake, "b", t);
    eventually("one leads", || a.r.ext.is_ready() || b.r.ext.is_ready()).await;
    eventually("both synced", || a.r.ctl.readiness.synced() && b.r.ctl.readiness.synced()).await;
    let (leader, standby) = if a.r.ext.is_ready() { (&a, &b) } else { (&b, &a) };
    let leader_url = leader.url(tls.is_some());
    let lease: Lease = fake.get("gpuplace-system", "gpuplace-extender").unwrap();
    assert_eq!(lease.annotations().get(ANNOTATION_LEADER_URL), Some(&leader_url), "the leader publishes its URL");
    eventually("the standby follows the Lease", || {
        standby.r.ctl.readiness.route() == Route::Leader(leader_url.clone())
    })
    .await;
    // both Ready, whichever leads: a rolling update with maxUnavailable 0 can finish
    let (status, text) = standby.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, &*format!("ready: standby, forwarding to the leader at {leader_url}")));
    let (status, text) = leader.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, "ready: leader"));

    // filter and prioritize through the standby: the leader's answers, byte for byte
    let args = json!({"Pod": p, "NodeNames": ["n1"]}).to_string();
    for verb in ["filter", "prioritize"] {
        let path = format!("/gpuplace/{verb}");
        let via = standby.call(t, "POST", &path, args.clone(), None).await;
        let direct = leader.call(t, "POST", &path, args.clone(), None).await;
        assert_eq!(via, direct, "{verb}");
        assert_eq!(via.0, 200, "{verb}: {}", via.1);
    }
    let filtered: Value =
        serde_json::from_str(&standby.call(t, "POST", "/gpuplace/filter", args.clone(), None).await.1).unwrap();
    assert_eq!(filtered["NodeNames"], json!(["n1"]), "{filtered}");
    // bind through the standby: one Binding, by the leader
    let bind_args = json!({"PodName": "p", "PodNamespace": "ns", "PodUID": uid(&p), "Node": "n1"}).to_string();
    let (status, text) = standby.call(t, "POST", "/gpuplace/bind", bind_args, None).await;
    assert_eq!((status, text.as_str()), (200, r#"{"Error":""}"#));
    assert_eq!(node_of(&fake, "p").as_deref(), Some("n1"));
    assert!(annotation(&fake, "p").is_some(), "bound with its assignment");
    assert_eq!(binding_posts(&fake), 1);
    assert_eq!(holders(&leader.r.ext, "n1"), ["ns/p"]);
    eventually("the standby counts the leader's bind from the watch", || holders(&standby.r.ext, "n1") == ["ns/p"])
        .await;
    // preempt through the standby: the leader's answer
    let q = fake.put(&gpu_pod("q", whole(2)));
    let victims = json!({"n1": {"Pods": [{"UID": uid(&p)}], "NumPDBViolations": 0}});
    let preempt = json!({"Pod": q, "NodeNameToMetaVictims": victims}).to_string();
    let via = standby.call(t, "POST", "/gpuplace/preempt", preempt.clone(), None).await;
    assert_eq!(via, leader.call(t, "POST", "/gpuplace/preempt", preempt, None).await);
    assert_eq!(via.0, 200, "{}", via.1);
    let (_, m) = standby.call(t, "GET", "/metrics", String::new(), None).await;
    for (verb, n) in [("filter", 2), ("prioritize", 1), ("bind", 1), ("preempt", 1)] {
        assert_eq!(forwarded(&m, verb, "answered"), n, "{verb}: {m}");
    }
    assert!(m.contains("gpuplace_leader 0") && m.contains("gpuplace_synced 1"), "{m}");
    let (_, m) = leader.call(t, "GET", "/metrics", String::new(), None).await;
    assert!(m.contains("gpuplace_leader 1") && m.contains("gpuplace_synced 1"), "{m}");
    assert_eq!(forwarded(&m, "filter", "answered"), 0);

    if tls.is_none() {
        // a request that was already forwarded is answered here, never passed on again
        let (status, text) = standby.call(t, "POST", "/gpuplace/filter", args.clone(), Some("x")).await;
        assert_eq!(status, 200);
        assert!(text.contains("not ready"), "{text}");
    }

    // the leader's port goes away while it still holds the Lease: not-ready answers, so
    // kube-scheduler retries. `stop` returns once the listener is closed; a worker may still
    // answer on a connection the standby's forward keeps alive until it exits, and that answer is
    // the leader's own, a right one (it was 1 run in 8 under load). So: the leader's answer or
    // not-ready, until not-ready, never anything else.
    leader.http.handle.stop(false).await;
    let until = tokio::time::Instant::now() + WAIT;
    loop {
        let (status, text) = standby.call(t, "POST", "/gpuplace/filter", args.clone(), None).await;
        assert_eq!(status, 200);
        let answer: Value = serde_json::from_str(&text).unwrap();
        if answer["Error"].as_str().unwrap_or_default().contains("not ready") {
            break;
        }
        assert_eq!(answer["Error"], "", "neither the leader's answer nor not-ready: {text}");
        assert!(tokio::time::Instant::now() < until, "the leader's stopped server still answers");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = standby.call(t, "POST", "/gpuplace/prioritize", args.clone(), None).await;
    assert_eq!(status, 503);
    let (_, m) = standby.call(t, "GET", "/metrics", String::new(), None).await;
    assert_eq!(forwarded(&m, "filter", "failed"), 1, "{m}");
    assert_eq!(forwarded(&m, "prioritize", "failed"), 1, "{m}");

    // the leader goes: the standby takes the Lease over and decides itself
    leader.r.ctl.stop();
    eventually("the standby leads", || standby.r.ext.is_ready()).await;
    let (status, text) = standby.call(t, "GET", "/readyz", String::new(), None).await;
    assert_eq!((status, text.as_str()), (200, "ready: leader"));
    let r = fake.put(&gpu_pod("r", whole(1)));
    settle().await;
    let args = json!({"Pod": r, "NodeNames": ["n1"]}).to_string();
    let (_, text) = standby.call(t, "POST", "/gpuplace/filter", args, None).await;
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["NodeNames"], json!(["n1"]), "{text}");
    assert_eq!(binding_posts(&fake), 1, "the standby never bound");
}

#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_http() {
    a_standby_forwards_every_verb_to_the_leader(None).await;
}

/// The same over HTTPS with client certificates: the standby presents its serving certificate to
/// the leader and checks the leader's against the Service's name.
#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_https() {
    a_standby_forwards_every_verb_to_the_leader(Some(TlsSetup::new("forward"))).await;
}

/// The same with the default install's certificates (`--tls-ca-secret`): each replica issues its own
/// from the extender's CA, with the pod IP it advertises among its names, and presents it when it
/// forwards; kube-scheduler presents the client certificate the leader keeps in its Secret.
#[tokio::test]
async fn a_standby_forwards_every_verb_to_the_leader_over_self_issued_https() {
    a_standby_forwards_every_verb_to_the_leader(Some(TlsSetup::self_issued())).await;
}

/// `--tls-ca-secret`: the CA Secret is made once (two replicas racing get the same CA) and never
/// overwritten when malformed; kube-scheduler's Secret is written by the leader when absent, not the
/// current CA's, malformed or a third of its life from its end, and left alone otherwise, with its
/// other entries kept.
#[tokio::test]
async fn the_extenders_ca_and_kube_schedulers_certificate_are_made_once_and_renewed_when_due() {
    use gpuplace::k8s::certificates::{
        self as certs, ensure_scheduler_secret, load_or_create_ca, SchedulerSecret, CA_CERT, SCHEDULER_CERT,
        SCHEDULER_KEY,
    };
    use gpuplace::k8s::keys::KeySecret;
    use std::time::SystemTime;
    let fake = FakeApiServer::start().await.unwrap();
    let api = kube::Api::<Secret>::namespaced(fake.client().unwrap(), "gpuplace-system");
    let ca_at = KeySecret { namespace: "gpuplace-system".into(), name: certs::DEFAULT_CA_SECRET_NAME.into() };
    let (a, b) = tokio::join!(load_or_create_ca(&api, &ca_at), load_or_create_ca(&api, &ca_at));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.cert_pem, b.cert_pem, "one CA for both replicas");
    let stored: Secret = fake.get("gpuplace-system", certs::DEFAULT_CA_SECRET_NAME).unwrap();
    assert_eq!(certs::ca_of(&stored, &ca_at).unwrap().cert_pem, a.cert_pem);
    assert_eq!(load_or_create_ca(&api, &ca_at).await.unwrap().cert_pem, a.cert_pem, "read, not remade");

    let at = KeySecret { namespace: "gpuplace-system".into(), name: certs::DEFAULT_SCHEDULER_SECRET_NAME.into() };
    let now = SystemTime::now();
    let day = Duration::from_secs(86_400);
    assert_eq!(ensure_scheduler_secret(&api, &at, &a, now).await.unwrap(), SchedulerSecret::Written("absent".into()));
    assert_eq!(ensure_scheduler_secret(&api, &at, &a, now + 200 * day).await.unwrap(), SchedulerSecret::Current);
    let first: Secret = fake.get("gpuplace-system", &at.name).unwrap();
    assert_eq!(first.type_.as_deref(), Some("kubernetes.io/tls"), "cert-manager's type, as docs/deploy.md says");
    let entry = |s: &Secret, k: &str| s.data.as_ref().unwrap()[k].0.clone();
    assert_eq!(entry(&first, CA_CERT), a.cert_pem.as_bytes());
    assert!(pki::signed_by(&a, &entry(&first, SCHEDULER_CERT)));
    // an operator's extra entry survives a renewal
    let mut edited = first.clone();
    edited.data.as_mut().unwrap().insert("note".into(), ByteString(b"kept".to_vec()));
    fake.put(&edited);
    match ensure_scheduler_secret(&api, &at, &a, now + 250 * day).await.unwrap() {
        SchedulerSecret::Written(why) => assert!(why.contains("a third"), "{why}"),
        other => panic!("not renewed: {other:?}"),
    }
    let renewed: Secret = fake.get("gpuplace-system", &at.name).unwrap();
    assert_ne!(entry(&renewed, SCHEDULER_CERT), entry(&first, SCHEDULER_CERT));
    assert_eq!(entry(&renewed, "note"), b"kept");
    // a key that is not the certificate's, then another CA: written again
    let mut broken = renewed.clone();
    broken.data.as_mut().unwrap().insert(SCHEDULER_KEY.into(), ByteString(b"not a key".to_vec()));
    fake.put(&broken);
    let written = ensure_scheduler_secret(&api, &at, &a, now).await.unwrap();
    assert_eq!(written, SchedulerSecret::Written("the key is not a PEM private key".into()));
    let other = pki::Ca::generate(now).unwrap();
    let written = ensure_scheduler_secret(&api, &at, &other, now).await.unwrap();
    assert_eq!(written, SchedulerSecret::Written("its ca.crt is not the current CA".into()));

    // a malformed CA Secret: an error that says what to do, and the Secret is left as it was
    let mut bad = stored.clone();
    bad.data.as_mut().unwrap().insert(CA_CERT.into(), ByteString(b"garbage".to_vec()));
    fake.put(&bad);
    let err = load_or_create_ca(&api, &ca_at).await.unwrap_err().to_string();
    assert!(err.contains("malformed") && err.contains("delete it"), "{err}");
    let after: Secret = fake.get("gpuplace-system", certs::DEFAULT_CA_SECRET_NAME).unwrap();
    assert_eq!(entry(&after, CA_CERT), b"garbage");
}
