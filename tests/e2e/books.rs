//! Issue 48: a record erased from a pod is not forgotten. gpuplace keeps its own books (one
//! ConfigMap per node in its namespace, `src/k8s/books.rs`) where tenants cannot write; a rebuild
//! counts a running pod from them when its `gpuplace.io/assignment` is gone, and reports it.
//!
//! Run as the chart runs the extender (its ServiceAccount, RBAC and admission policy, leader
//! election), without the records policy: a cluster admin strips the annotation, which admission
//! would let through anyway.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

use crate::audit::node_name;
use crate::cluster::figure;
use crate::fleet::{self, Extender};
use crate::{
    counter, inspect_holders, placed_pod, scheduler_config, stage_of, stays_pending, wait_bound, Placed, NS, SERIAL,
};
use gpuplace::scheduler::books::books_name;
use gpuplace_core::annotations::ANNOTATION_ASSIGNMENT;
use gpuplace_core::api_client::events::REASON_TAMPERED;

fn assignment(p: &Pod) -> Option<String> {
    p.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ASSIGNMENT)).cloned()
}

/// Removes the pod's assignment annotation with a plain JSON patch, as any client that may patch
/// the pod can.
async fn strip(pods: &Api<Pod>, name: &str) {
    let path = format!("/metadata/annotations/{}", ANNOTATION_ASSIGNMENT.replace('/', "~1"));
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "remove", "path": path}])).expect("a JSON patch");
    pods.patch(name, &PatchParams::default(), &Patch::<()>::Json(patch)).await.expect("strip the annotation");
    assert_eq!(assignment(&pods.get(name).await.expect("the pod")), None, "{name} still has its annotation");
}

/// The pods with an `AssignmentTampered` Event.
async fn tampered_events(events: &Api<Event>) -> BTreeSet<String> {
    let list = events.list(&ListParams::default()).await.expect("events").items;
    list.into_iter()
        .filter(|e| e.reason.as_deref() == Some(REASON_TAMPERED))
        .filter_map(|e| e.involved_object.name)
        .collect()
}

async fn wait_until<F: std::future::Future<Output = bool>>(what: &str, limit: Duration, mut check: impl FnMut() -> F) {
    let until = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < until, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn tampered(ext: &Extender) -> f64 {
    counter(&ext.metrics(), "gpuplace_conflicts_total", "kind=\"tampered_assignment\"")
}

/// 8 whole-GPU pods fill an 8-GPU node; one pod's annotation is stripped (while the extender runs,
/// while it is down before a restart, and as the leader is killed and the standby takes over): each
/// time a 9th whole-GPU pod pinned to the node stays pending, `/inspect` shows the stripped pod's
/// GPU as held, the tampering is an Event and a metric, and the record is written back on the pod.
#[tokio::test(flavor = "current_thread")]
async fn a_stripped_assignment_is_counted_from_the_books_across_restarts_and_failover() {
    let _serial = SERIAL.lock().await;
    let mut st = stage_of("books", 2).await;
    let node = st.nodes[0].name.clone();
    assert_eq!(st.nodes[0].gpus, 8, "gpu-00 is an 8-GPU board");
    let mut a = Extender::start(&st.cp, "replica-a", 0, &[]);
    a.wait_ready(Duration::from_secs(60)).await;
    let mut b = Extender::start(&st.cp, "replica-b", 0, &[]);
    let proxy = fleet::ReadyProxy::start(vec![a.port, b.port]);
    st.cp.start_scheduler(&scheduler_config(), Some(&proxy.url()));
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let events: Api<Event> = Api::namespaced(st.admin.clone(), NS);
    let books: Api<ConfigMap> = Api::namespaced(st.admin.clone(), "gpuplace-system");
    let one = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..Default::default() };
    let pp = PostParams::default();
    for i in 0..8 {
        pods.create(&pp, &placed_pod(&one, &format!("w-{i}"), Placed::Pinned(&node), None)).await.expect("create");
    }
    assert_eq!(wait_bound(&st.admin, NS, 8, Duration::from_secs(90)).await, 8, "the 8 pods not bound");
    let w3 = pods.get("w-3").await.expect("w-3");
    assert_eq!(node_name(&w3), Some(node.as_str()));
    let record = assignment(&w3).expect("w-3's assignment");
    // the leader's book of the node holds the 8 records within a tick or two
    let book_name = books_name(&node);
    wait_until("the node's book holds the 8 records", Duration::from_secs(15), || async {
        books.get_opt(&book_name).await.ok().flatten().and_then(|c| c.data).is_some_and(|d| d.len() == 9)
    })
    .await;
    let booked = books.get(&book_name).await.expect("book").data.unwrap_or_default();
    let entry: serde_json::Value =
        serde_json::from_str(booked.get(w3.metadata.uid.as_deref().expect("uid")).expect("w-3 in the book"))
            .expect("json");
    assert_eq!((entry["pod"].as_str(), entry["assignment"].as_str()), (Some("e2e/w-3"), Some(record.as_str())));

    // 1. stripped while the extender runs: reported, counted, written back
    strip(&pods, "w-3").await;
    wait_until("an AssignmentTampered Event on w-3", Duration::from_secs(20), || async {
        tampered_events(&events).await.contains("w-3")
    })
    .await;
    wait_until("w-3's record written back", Duration::from_secs(20), || async {
        pods.get("w-3").await.ok().and_then(|p| assignment(&p)).as_deref() == Some(record.as_str())
    })
    .await;
    let running = tampered(&a);
    assert!(running >= 1.0, "tampered_assignment not counted while running: {running}");

    // 2. stripped while the extender is down, then restarted: counted from the books
    a.proc.kill();
    b.proc.kill();
    strip(&pods, "w-3").await;
    let mut a = Extender::start(&st.cp, "replica-a", a.port, &[]);
    a.wait_ready(Duration::from_secs(60)).await;
    let holders = inspect_holders(&a, &node);
    let restarted = tampered(&a);
    pods.create(&pp, &placed_pod(&one, "w-8", Placed::Pinned(&node), None)).await.expect("create w-8");
    let pending = stays_pending(&pods, "w-8", Duration::from_secs(8)).await;
    figure(&format!(
        "books: w-3 stripped while the extender was down; after a SIGKILL and restart: {} holders of {node} \
         (w-3 among them: {}), tampered_assignment {restarted}, a 9th pod pending: {pending}",
        holders.len(),
        holders.contains(&format!("{NS}/w-3")),
    ));
    assert!(
        holders.contains(&format!("{NS}/w-3")),
        "the stripped pod's GPU is not held after the restart: {holders:?}"
    );
    assert_eq!(holders.len(), 8);
    assert!(restarted >= 1.0, "the rebuild did not count the tampering");
    assert!(pending, "a 9th whole-GPU pod was bound to the full node");
    wait_until("w-3's record written back after the restart", Duration::from_secs(20), || async {
        pods.get("w-3").await.ok().and_then(|p| assignment(&p)).as_deref() == Some(record.as_str())
    })
    .await;

    // 3. the leader killed, w-5 stripped before the standby takes over
    let b = Extender::start(&st.cp, "replica-b", b.port, &[]);
    let until = Instant::now() + Duration::from_secs(60);
    while !b.ready() {
        assert!(Instant::now() < until, "the standby never turned ready:\n{}", b.proc.tail(30));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let w5_record = assignment(&pods.get("w-5").await.expect("w-5")).expect("w-5's assignment");
    a.proc.kill();
    strip(&pods, "w-5").await;
    let killed = Instant::now();
    while !b.leads() {
        assert!(killed.elapsed() < Duration::from_secs(60), "the standby never led:\n{}", b.proc.tail(30));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let holders = inspect_holders(&b, &node);
    let pending = stays_pending(&pods, "w-8", Duration::from_secs(8)).await;
    wait_until("w-5's record written back by the new leader", Duration::from_secs(20), || async {
        pods.get("w-5").await.ok().and_then(|p| assignment(&p)).as_deref() == Some(w5_record.as_str())
    })
    .await;
    let reported = tampered_events(&events).await;
    figure(&format!(
        "books: the leader SIGKILLed, w-5 stripped; the standby led after {:.1} s: {} holders of {node}, \
         a 9th pod pending: {pending}, tampered_assignment {}, AssignmentTampered on {reported:?}",
        killed.elapsed().as_secs_f64(),
        holders.len(),
        tampered(&b),
    ));
    assert!(holders.contains(&format!("{NS}/w-5")) && holders.len() == 8, "{holders:?}");
    assert!(pending, "a 9th whole-GPU pod was bound after the failover");
    assert!(reported.contains("w-5"), "the standby did not report w-5: {reported:?}");

    // the books follow deletions: w-0 gone, its record leaves the book and w-8 binds
    pods.delete("w-0", &Default::default()).await.expect("delete w-0");
    wait_until("w-8 bound once w-0 is gone", Duration::from_secs(60), || async {
        pods.get("w-8").await.ok().as_ref().and_then(node_name).is_some()
    })
    .await;
    wait_until("the book without w-0 and with w-8", Duration::from_secs(15), || async {
        let data = books.get(&book_name).await.ok().and_then(|c| c.data).unwrap_or_default();
        let w8 = pods.get("w-8").await.ok().and_then(|p| p.metadata.uid).unwrap_or_default();
        data.len() == 9 && data.contains_key(&w8)
    })
    .await;
}
