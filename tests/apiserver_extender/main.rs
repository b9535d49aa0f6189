//! API-server mode against the in-process fake API server: the binder (annotation, Binding,
//! rollback, retry), the watchers (node selector, release, rebuild after restart, outages,
//! utilization ConfigMaps, the learned mix, requeue). Signing keys: `keys.rs`; leader election and
//! the standby's forward: `leader.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuplace::extender::Extender;
use gpuplace::k8s::binder::KubeBinder;
use gpuplace::k8s::leader::Leadership;
use gpuplace::placement::mix_learner::{bundled_prior, MixLearner};
use gpuplace::placement::{profile::ProfileConfig, registry::Weights};
use gpuplace::scheduler::binder::{BindError, BindRequest, Binder};
use gpuplace::scheduler::metrics::{BindOutcome, ConflictKind, Watched};
use gpuplace_core::annotations::{
    AllocatedAnnotation, AssignmentAnnotation, GpuUtilization, UtilizationAnnotation, ANNOTATION_ALLOCATED,
    ANNOTATION_ASSIGNMENT, ANNOTATION_REQUEUED, ANNOTATION_UTILIZATION,
};
use gpuplace_core::clock::now_unix_ms;
use gpuplace_core::utilization_configmap::{configmap_name, data, labels};
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use serde_json::{json, Value};

#[path = "../support/tls.rs"]
mod certs;
#[path = "../support/harness.rs"]
mod harness;
mod keys;
mod leader;
#[path = "../support/replicas.rs"]
mod replicas;

use replicas::*;

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
