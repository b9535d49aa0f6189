//! API-server mode against the in-process fake API server: the binder (annotation, Binding,
//! rollback, retry), the watchers (release, rebuild after restart, forged annotations, outages) and
//! leader election with two replicas.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::apiserver::fake::FakeApiServer;
use gpuplace::apiserver::run::{self, ApiOptions, Controller};
use gpuplace::apiserver::{KubeBinder, LeaderConfig, Leadership};
use gpuplace::core::annotations::{AssignmentAnnotation, ANNOTATION_ASSIGNMENT};
use gpuplace::core::cluster::Cluster;
use gpuplace::extender::binder::{BindError, BindRequest, Binder};
use gpuplace::extender::metrics::{BindOutcome, ConflictKind, Watched};
use gpuplace::extender::service::{now_unix_ms, Extender, ServiceOptions};
use gpuplace::placement::engine::Engine;
use gpuplace::placement::profile::{Profile, ProfileConfig};
use gpuplace::placement::scorers::fragmentation::WorkloadMix;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(3);
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/*/leases/*";

struct Replica {
    ext: Arc<Extender>,
    binder: Arc<KubeBinder>,
    ctl: Controller,
}

fn replica(fake: &FakeApiServer, leader: Option<LeaderConfig>) -> Replica {
    let client = fake.client().unwrap();
    let leadership = if leader.is_some() { Leadership::elected() } else { Leadership::always() };
    let binder = Arc::new(KubeBinder::new(client.clone(), leadership.clone()));
    let engine = Engine::new(Profile::new(ProfileConfig::default()), WorkloadMix::default());
    let opts = ServiceOptions { ready: false, ..ServiceOptions::default() };
    let ext = Arc::new(Extender::new(Cluster::default(), engine, binder.clone(), opts));
    let instance = leader.as_ref().map_or("solo".to_string(), |l| l.identity.clone());
    let ctl = run::start(client, ext.clone(), leadership, ApiOptions { node_selector: None, leader, instance });
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
        [
            ("PATCH".into(), "/api/v1/namespaces/ns/pods/p".into()),
            ("POST".into(), "/api/v1/namespaces/ns/pods/p/binding".into())
        ]
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
    assert!(matches!(r.binder.bind(&stale).await, Err(BindError::Api { call: "annotating", status: Some(409), .. })));
    assert_eq!(annotation(&fake, "q"), None);
    assert_eq!(node_of(&fake, "q"), None);
    drop(q);
}

#[tokio::test]
async fn a_failed_binding_rolls_back_the_annotation_and_the_allocation() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 1));
    let p = fake.put(&gpu_pod("p", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;

    fake.fail_next("POST", "/api/v1/namespaces/*/pods/*/binding", 1, 500);
    let err = bind(&r.ext, &p, "n1").await;
    assert!(err.contains("binding failed") && err.contains("500"), "{err}");
    assert_eq!(annotation(&fake, "p"), None, "annotation removed");
    assert_eq!(node_of(&fake, "p"), None);
    assert!(holders(&r.ext, "n1").is_empty(), "allocation rolled back");
    assert_eq!(r.ext.metrics().binds(BindOutcome::BinderFailed), 1);
    // the watch shows the annotation that was rolled back: not a forgery, no Event
    settle().await;
    assert_eq!(r.ext.metrics().conflicts(ConflictKind::BadAssignment), 0);
    assert!(fake.events().is_empty(), "{:?}", fake.events());

    // kube-scheduler tries again: bound, counted once
    assert_eq!(bind(&r.ext, &p, "n1").await, "");
    settle().await;
    assert_eq!(holders(&r.ext, "n1"), ["ns/p"]);
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

#[tokio::test]
async fn forged_assignments_are_never_counted_and_are_reported() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&gpu_node("n1", 2));
    let real = fake.put(&gpu_pod("real", whole(1)));
    let r = replica(&fake, None);
    ready(&r.ext).await;
    assert_eq!(bind(&r.ext, &real, "n1").await, "");
    let genuine = AssignmentAnnotation::parse(&annotation(&fake, "real").unwrap()).unwrap();

    // the same GPUs, rewritten for another pod's UID (node, request and all else valid)
    let forge = |name: &str, limits: Value, node: Option<&str>| {
        let mut p = fake.put(&gpu_pod(name, limits));
        let mut a = genuine.clone();
        a.pod_uid = uid(&p);
        p.metadata.annotations = Some(BTreeMap::from([(ANNOTATION_ASSIGNMENT.to_string(), a.to_json())]));
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
    // the unbound one is not counted, and not reported while watching: every bind looks like it
    // for a moment (annotation first, then the Binding)
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
    assert_eq!(total_held(&second.ext), 1, "only the collider's claim, now that nobody else holds the GPU");
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
