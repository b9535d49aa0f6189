//! A real `kube::Client` and `kube::runtime::watcher` against the fake API server
//! (`gpuplace_testkit::apiserver`): what the extender and the device plugin will rely on.

use std::time::Duration;

use futures::StreamExt;
use gpuplace_core::api_client::connect::{connect, Source};
use gpuplace_testkit::apiserver::{FakeApiServer, Resource};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource as _, ResourceExt};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(3);

fn pod(ns: &str, name: &str, labels: &[(&str, &str)], node: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        },
        spec: Some(PodSpec { node_name: node.map(str::to_owned), ..Default::default() }),
        ..Default::default()
    }
}

fn node(name: &str) -> Node {
    Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() }
}

fn api_code(err: &kube::Error) -> Option<(u16, String)> {
    match err {
        kube::Error::Api(s) => Some((s.code, s.reason.clone())),
        _ => None,
    }
}

#[tokio::test]
async fn pods_list_get_and_patch_annotations() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&pod("gpu", "a", &[("app", "train")], Some("n1")));
    fake.put(&pod("gpu", "b", &[("app", "infer")], None));
    fake.put(&pod("other", "c", &[("app", "train")], Some("n1")));
    let client = fake.client().unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "gpu");
    let all: Api<Pod> = Api::all(client);

    let names = |l: kube::core::ObjectList<Pod>| l.items.iter().map(|p| p.name_any()).collect::<Vec<_>>();
    assert_eq!(names(pods.list(&ListParams::default()).await.unwrap()), ["a", "b"]);
    assert_eq!(names(all.list(&ListParams::default().labels("app=train")).await.unwrap()), ["a", "c"]);
    assert_eq!(names(all.list(&ListParams::default().fields("spec.nodeName=n1")).await.unwrap()), ["a", "c"]);
    assert_eq!(names(pods.list(&ListParams::default().fields("spec.nodeName=")).await.unwrap()), ["b"]);
    assert_eq!(names(all.list(&ListParams::default().fields("metadata.name=c")).await.unwrap()), ["c"]);
    // Pagination: limit and continue.
    let page = all.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(names(page.clone()), ["a", "b"]);
    let token = page.metadata.continue_.clone().unwrap();
    let rest = all.list(&ListParams::default().limit(2).continue_token(&token)).await.unwrap();
    assert_eq!(names(rest.clone()), ["c"]);
    assert!(rest.metadata.continue_.is_none());

    let a = pods.get("a").await.unwrap();
    assert_eq!(a.spec.unwrap().node_name.as_deref(), Some("n1"));
    let rv = a.metadata.resource_version.unwrap();

    // Merge patch, JSON patch (with a '/' escaped in the key), strategic merge: all on annotations.
    let pp = PatchParams::default();
    let merge = json!({"metadata": {"annotations": {"gpuplace.io/assignment": "0:500"}}});
    let patched = pods.patch("a", &pp, &Patch::Merge(&merge)).await.unwrap();
    assert_eq!(patched.annotations()["gpuplace.io/assignment"], "0:500");
    assert_ne!(patched.metadata.resource_version.unwrap(), rv);
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/annotations/gpuplace.io~1assignment", "value": "0:500"},
        {"op": "add", "path": "/metadata/annotations/gpuplace.io~1gpus", "value": "0,1"},
    ]))
    .unwrap();
    let patched = pods.patch("a", &pp, &Patch::Json::<()>(ops)).await.unwrap();
    assert_eq!(patched.annotations()["gpuplace.io/gpus"], "0,1");
    let strategic = json!({"metadata": {"annotations": {"gpuplace.io/assignment": null}}});
    let patched = pods.patch("a", &pp, &Patch::Strategic(&strategic)).await.unwrap();
    assert!(!patched.annotations().contains_key("gpuplace.io/assignment"));
    // A failed JSON patch `test` is 422 and changes nothing.
    let bad: json_patch::Patch = serde_json::from_value(
        json!([{"op": "test", "path": "/metadata/annotations/gpuplace.io~1gpus", "value": "9"}]),
    )
    .unwrap();
    let err = pods.patch("a", &pp, &Patch::Json::<()>(bad)).await.unwrap_err();
    assert_eq!(api_code(&err), Some((422, "Invalid".into())));
    // A merge patch that names a stale resourceVersion is a conflict.
    let stale = json!({"metadata": {"resourceVersion": rv, "labels": {"x": "y"}}});
    let err = pods.patch("a", &pp, &Patch::Merge(&stale)).await.unwrap_err();
    assert_eq!(api_code(&err), Some((409, "Conflict".into())));

    let stored: Pod = fake.get("gpu", "a").unwrap();
    assert_eq!(stored.annotations().get("gpuplace.io/gpus").map(String::as_str), Some("0,1"));
    let content_types: Vec<_> =
        fake.requests().into_iter().filter(|r| r.method == "PATCH").filter_map(|r| r.content_type).collect();
    assert_eq!(
        content_types,
        [
            "application/merge-patch+json",
            "application/json-patch+json",
            "application/strategic-merge-patch+json",
            "application/json-patch+json",
            "application/merge-patch+json"
        ]
    );

    // A patch that names another UID is a conflict too (the pod was re-created); its own UID is accepted.
    let other = json!({"metadata": {"uid": "not-this-pod", "labels": {"x": "y"}}});
    let err = pods.patch("a", &pp, &Patch::Merge(&other)).await.unwrap_err();
    assert_eq!(api_code(&err), Some((409, "Conflict".into())));
    let uid = pods.get("a").await.unwrap().metadata.uid.unwrap();
    let same = json!({"metadata": {"uid": uid, "labels": {"x": "z"}}});
    assert_eq!(pods.patch("a", &pp, &Patch::Merge(&same)).await.unwrap().labels()["x"], "z");

    // Errors are Status objects kube parses.
    let err = pods.get("missing").await.unwrap_err();
    assert_eq!(api_code(&err), Some((404, "NotFound".into())));
    assert_eq!(pods.get_opt("missing").await.unwrap(), None);

    // Create, AlreadyExists, delete.
    let created = pods.create(&PostParams::default(), &pod("gpu", "d", &[], None)).await.unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    let err = pods.create(&PostParams::default(), &pod("gpu", "d", &[], None)).await.unwrap_err();
    assert_eq!(api_code(&err), Some((409, "AlreadyExists".into())));
    pods.delete("d", &DeleteParams::default()).await.unwrap();
    assert!(fake.get::<Pod>("gpu", "d").is_none());
    let err = pods.delete("d", &DeleteParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), Some((404, "NotFound".into())));
}

fn binding(pod: &str, node: &str) -> Binding {
    Binding {
        metadata: ObjectMeta {
            name: Some(pod.into()),
            annotations: Some([("gpuplace.io/assignment".to_string(), "gpus=0,1".to_string())].into()),
            ..Default::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some(node.into()), ..Default::default() },
    }
}

#[tokio::test]
async fn binding_sets_the_node_once() {
    let fake = FakeApiServer::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), "ns");
    pods.create(&PostParams::default(), &pod("ns", "p", &[], None)).await.unwrap();
    let pp = PostParams::default();

    // A 500 injected on the binding subresource surfaces as an API error, once.
    fake.fail_next("POST", "/api/v1/namespaces/*/pods/*/binding", 1, 500);
    let err = pods.create_subresource::<_, Value>("binding", "p", &pp, &binding("p", "n1")).await.unwrap_err();
    assert_eq!(api_code(&err), Some((500, "InternalError".into())));

    let status: Value = pods.create_subresource("binding", "p", &pp, &binding("p", "n1")).await.unwrap();
    assert_eq!(status["status"], "Success");
    let bound = pods.get("p").await.unwrap();
    assert_eq!(bound.spec.as_ref().unwrap().node_name.as_deref(), Some("n1"));
    assert_eq!(bound.annotations()["gpuplace.io/assignment"], "gpus=0,1");
    let conditions = bound.status.unwrap().conditions.unwrap();
    assert!(conditions.iter().any(|c| c.type_ == "PodScheduled" && c.status == "True"));
    let running = json!({"status": {"phase": "Running"}});
    let st = pods.patch_status("p", &PatchParams::default(), &Patch::Merge(&running)).await.unwrap().status.unwrap();
    assert_eq!((st.phase.as_deref(), st.conditions.map(|c| c.len())), (Some("Running"), Some(1)));

    // Already bound: 409, to another node or the same one (as the real registry does).
    for node in ["n2", "n1"] {
        let err = pods.create_subresource::<_, Value>("binding", "p", &pp, &binding("p", node)).await.unwrap_err();
        assert_eq!(api_code(&err), Some((409, "Conflict".into())), "{node}");
    }
    let err = pods.create_subresource::<_, Value>("binding", "nope", &pp, &binding("nope", "n1")).await.unwrap_err();
    assert_eq!(api_code(&err), Some((404, "NotFound".into())));
}

#[tokio::test]
async fn node_status_patch_and_apply() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&node("n1"));
    let nodes: Api<Node> = Api::all(fake.client().unwrap());

    let status = json!({"status": {"capacity": {"gpuplace.io/gpu": "8"}, "allocatable": {"gpuplace.io/gpu": "7"}}});
    let patched = nodes.patch_status("n1", &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    let st = patched.status.unwrap();
    assert_eq!(st.capacity.unwrap()["gpuplace.io/gpu"].0, "8");
    assert_eq!(st.allocatable.unwrap()["gpuplace.io/gpu"].0, "7");
    let stored: Node = fake.get("", "n1").unwrap();
    nodes.create(&PostParams::default(), &node("n0")).await.unwrap();
    assert!(fake.get::<Node>("", "n0").unwrap().metadata.namespace.is_none());
    assert_eq!(stored.status.unwrap().capacity.unwrap()["gpuplace.io/gpu"].0, "8");

    // The object ignores status changes (they go through /status), as the real API does.
    let on_object = json!({"metadata": {"labels": {"gpu": "yes"}}, "status": {"capacity": {"gpuplace.io/gpu": "1"}}});
    let patched = nodes.patch("n1", &PatchParams::default(), &Patch::Merge(&on_object)).await.unwrap();
    assert_eq!(patched.labels()["gpu"], "yes");
    assert_eq!(patched.status.unwrap().capacity.unwrap()["gpuplace.io/gpu"].0, "8");

    // Server-side apply (a merge here) updates, and creates a missing object.
    let pp = PatchParams::apply("gpuplace").force();
    let apply = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2", "annotations": {"a": "b"}}});
    let created = nodes.patch("n2", &pp, &Patch::Apply(&apply)).await.unwrap();
    assert_eq!(created.annotations()["a"], "b");
    assert_eq!(fake.list::<Node>().len(), 3);
    let apply_status = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"},
                              "status": {"capacity": {"gpuplace.io/gpu": "4"}}});
    let applied = nodes.patch_status("n2", &pp, &Patch::Apply(&apply_status)).await.unwrap();
    assert_eq!(applied.status.unwrap().capacity.unwrap()["gpuplace.io/gpu"].0, "4");
    let last = fake.requests().pop().unwrap();
    assert_eq!(
        (last.method.as_str(), last.path.as_str(), last.content_type.as_deref()),
        ("PATCH", "/api/v1/nodes/n2/status", Some("application/apply-patch+yaml"))
    );
    assert_eq!(last.query_param("fieldManager").as_deref(), Some("gpuplace"));
}

#[tokio::test]
async fn lease_replace_is_optimistic() {
    let fake = FakeApiServer::start().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(fake.client().unwrap(), "kube-system");
    let lease = Lease {
        metadata: ObjectMeta { name: Some("gpuplace".into()), ..Default::default() },
        spec: Some(LeaseSpec { holder_identity: Some("a".into()), ..Default::default() }),
    };
    let created = leases.create(&PostParams::default(), &lease).await.unwrap();
    let err = leases.create(&PostParams::default(), &lease).await.unwrap_err();
    assert_eq!(api_code(&err), Some((409, "AlreadyExists".into())));

    let mut mine = created.clone();
    mine.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let renewed = leases.replace("gpuplace", &PostParams::default(), &mine).await.unwrap();
    assert_eq!(renewed.spec.unwrap().holder_identity.as_deref(), Some("b"));

    // `created` carries the old resourceVersion: 409 Conflict, parsed as kube::Error::Api.
    let err = leases.replace("gpuplace", &PostParams::default(), &created).await.unwrap_err();
    match &err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
            assert!(s.message.contains("the object has been modified"), "{}", s.message);
        }
        other => panic!("expected an API error, got {other:?}"),
    }
    assert_eq!(
        fake.get::<Lease>("kube-system", "gpuplace").unwrap().spec.unwrap().holder_identity.as_deref(),
        Some("b")
    );

    // An injected conflict on the next PUT.
    let current = leases.get("gpuplace").await.unwrap();
    fake.fail_next("PUT", "/apis/coordination.k8s.io/v1/namespaces/*/leases/*", 1, 409);
    let err = leases.replace("gpuplace", &PostParams::default(), &current).await.unwrap_err();
    assert_eq!(api_code(&err), Some((409, "Conflict".into())));
    leases.replace("gpuplace", &PostParams::default(), &current).await.unwrap();
}

/// The next watcher event within WAIT, `Init*` events and errors included.
async fn next<S: futures::Stream<Item = Result<Event<Pod>, watcher::Error>> + Unpin>(
    stream: &mut S,
) -> Result<Event<Pod>, watcher::Error> {
    tokio::time::timeout(WAIT, stream.next()).await.expect("watcher event in time").expect("stream open")
}

fn describe(ev: &Result<Event<Pod>, watcher::Error>) -> String {
    match ev {
        Ok(Event::Init) => "init".into(),
        Ok(Event::InitApply(p)) => format!("init-apply {}", p.name_any()),
        Ok(Event::InitDone) => "init-done".into(),
        Ok(Event::Apply(p)) => format!("apply {}", p.name_any()),
        Ok(Event::Delete(p)) => format!("delete {}", p.name_any()),
        Err(e) => format!("error {e}"),
    }
}

async fn expect<S: futures::Stream<Item = Result<Event<Pod>, watcher::Error>> + Unpin>(stream: &mut S, want: &[&str]) {
    for w in want {
        let got = match tokio::time::timeout(WAIT, stream.next()).await {
            Ok(Some(ev)) => describe(&ev),
            other => panic!("waiting for {w:?}: {:?}", other.map(|e| e.map(|e| describe(&e)))),
        };
        assert_eq!(&got, w);
    }
}

#[tokio::test]
async fn watcher_sees_changes_and_recovers() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&pod("ns", "a", &[], None));
    fake.put(&pod("ns", "b", &[], None));
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), "ns");
    // Page size 1 makes the initial LIST paginate.
    let mut w = watcher::watcher(pods, watcher::Config::default().page_size(1)).boxed();

    expect(&mut w, &["init", "init-apply a", "init-apply b", "init-done"]).await;
    fake.put(&pod("ns", "c", &[], None));
    fake.put(&pod("other", "x", &[], None)); // another namespace: not seen
    let mut a: Pod = fake.get("ns", "a").unwrap();
    a.metadata.annotations = Some([("k".to_string(), "v".to_string())].into());
    fake.put(&a);
    fake.remove::<Pod>("ns", "b");
    expect(&mut w, &["apply c", "apply a", "delete b"]).await;

    let reqs = fake.requests();
    let lists: Vec<_> = reqs.iter().filter(|r| r.method == "GET" && !r.is_watch()).collect();
    assert_eq!(lists.len(), 2, "two pages");
    assert_eq!(lists[0].query_param("limit").as_deref(), Some("1"));
    assert!(lists[1].query_param("continue").is_some());
    let watch = reqs.iter().find(|r| r.is_watch()).unwrap();
    assert_eq!(watch.path, "/api/v1/namespaces/ns/pods");
    assert_eq!(watch.query_param("allowWatchBookmarks").as_deref(), Some("true"));
    assert_eq!(watch.query_param("timeoutSeconds").as_deref(), Some("290"));
    let listed_rv: u64 = watch.query_param("resourceVersion").unwrap().parse().unwrap();
    assert!(listed_rv > 0);

    // The stream closes (a restart, a load balancer): the watcher re-watches from its version
    // and sees what happened meanwhile, without re-listing.
    fake.close_watches();
    fake.put(&pod("ns", "d", &[], None));
    expect(&mut w, &["apply d"]).await;
    assert_eq!(fake.requests().iter().filter(|r| r.is_watch()).count(), 2);

    // An outage: the stream closes and requests get 503 (kube's client retries them) until it ends.
    fake.set_down(true);
    fake.put(&pod("ns", "e", &[], None));
    let during = tokio::time::timeout(Duration::from_millis(40), w.next()).await;
    assert!(during.is_err(), "nothing while down: {:?}", during.map(|e| e.as_ref().map(describe)));
    fake.set_down(false);
    expect(&mut w, &["apply e"]).await;
    assert!(fake.requests().iter().any(|r| r.status == 503));

    // The stream closes, a change follows, and the history that holds it is compacted away: the
    // resumed watch gets 410 Expired and the watcher re-lists.
    fake.close_watches();
    fake.put(&pod("ns", "f", &[], None));
    fake.compact();
    let err = describe(&next(&mut w).await);
    assert!(err.starts_with("error") && err.contains("too old resource version"), "{err}");
    let all = ["init", "init-apply a", "init-apply c", "init-apply d", "init-apply e", "init-apply f", "init-done"];
    expect(&mut w, &all).await;
    fake.remove::<Pod>("ns", "a");
    expect(&mut w, &["delete a"]).await;
}

#[tokio::test]
async fn streaming_list_watcher() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&pod("ns", "a", &[("app", "x")], None));
    fake.put(&pod("ns", "b", &[("app", "y")], None));
    let pods: Api<Pod> = Api::all(fake.client().unwrap());
    let config = watcher::Config::default().streaming_lists().labels("app=x");
    let mut w = watcher::watcher(pods, config).boxed();
    expect(&mut w, &["init", "init-apply a", "init-done"]).await;
    let watch = fake.requests().into_iter().find(|r| r.is_watch()).unwrap();
    assert_eq!(watch.query_param("sendInitialEvents").as_deref(), Some("true"));
    // b starts matching the selector: ADDED for this watch; a stops matching: DELETED.
    let mut b: Pod = fake.get("ns", "b").unwrap();
    b.metadata.labels = Some([("app".to_string(), "x".to_string())].into());
    fake.put(&b);
    let mut a: Pod = fake.get("ns", "a").unwrap();
    a.metadata.labels = Some([("app".to_string(), "z".to_string())].into());
    fake.put(&a);
    expect(&mut w, &["apply b", "delete a"]).await;
}

#[tokio::test]
async fn raw_watch_bookmarks_and_timeout() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&pod("ns", "a", &[], None));
    let rv = fake.resource_version().to_string();
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), "ns");
    let started = tokio::time::Instant::now();
    let mut s = pods.watch(&WatchParams::default().timeout(1), &rv).await.unwrap().boxed();
    assert!(fake.wait_until(WAIT, |f| f.open_watches() == 1).await);
    fake.put(&pod("ns", "b", &[], None));
    let ev = tokio::time::timeout(WAIT, s.next()).await.unwrap().unwrap().unwrap();
    assert!(matches!(&ev, WatchEvent::Added(p) if p.name_any() == "b"), "{ev:?}");
    let after_b = fake.resource_version().to_string();
    fake.send_bookmarks();
    let ev = tokio::time::timeout(WAIT, s.next()).await.unwrap().unwrap().unwrap();
    assert!(matches!(&ev, WatchEvent::Bookmark(bm) if bm.metadata.resource_version == after_b), "{ev:?}");
    // timeoutSeconds=1: a last bookmark, then the stream ends.
    let ev = tokio::time::timeout(WAIT, s.next()).await.unwrap().unwrap().unwrap();
    assert!(matches!(ev, WatchEvent::Bookmark(_)), "{ev:?}");
    assert!(tokio::time::timeout(WAIT, s.next()).await.unwrap().is_none());
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900), "ended by timeoutSeconds=1, not before: {took:?}");
    assert!(fake.wait_until(WAIT, |f| f.open_watches() == 0).await);
}

#[tokio::test]
async fn events_are_stored() {
    use kube::runtime::events::{Event as RecorderEvent, EventType, Recorder, Reporter};
    let fake = FakeApiServer::start().await.unwrap();
    let client = fake.client().unwrap();
    let p = fake.put(&pod("ns", "p", &[], None));
    let recorder = Recorder::new(client.clone(), Reporter { controller: "gpuplace".into(), instance: None });
    let ev = RecorderEvent {
        type_: EventType::Normal,
        reason: "Placed".into(),
        note: Some("GPUs 0,1 on n1".into()),
        action: "Bind".into(),
        secondary: None,
    };
    recorder.publish(&ev, &p.object_ref(&())).await.unwrap();
    // A core/v1 Event, as kubectl and older clients write them.
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client, "ns");
    let old_style = json!({"metadata": {"name": "p.1"}, "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns"},
                           "reason": "Filtered", "message": "no GPU", "type": "Warning"});
    core.create(&PostParams::default(), &serde_json::from_value(old_style).unwrap()).await.unwrap();

    let events = fake.events();
    assert_eq!(events.len(), 2);
    assert_eq!(
        (events[0]["apiVersion"].as_str(), events[0]["reason"].as_str()),
        (Some("events.k8s.io/v1"), Some("Placed"))
    );
    assert_eq!(events[0]["regarding"]["name"], "p");
    assert_eq!(events[1]["reason"], "Filtered");
    assert_eq!(fake.list_values(Resource::EventsV1).len(), 1);
}

#[tokio::test]
async fn outages_and_kubeconfig() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&node("n1"));
    let path = std::env::temp_dir().join(format!("gpuplace-fake-kubeconfig-{}", std::process::id()));
    std::fs::write(&path, fake.kubeconfig_yaml()).unwrap();
    let client = connect(&Source::Kubeconfig(path.clone())).await.unwrap();
    let _ = std::fs::remove_file(&path);
    let nodes: Api<Node> = Api::all(client);
    assert_eq!(nodes.list(&ListParams::default()).await.unwrap().items.len(), 1);

    // A single 503 is retried by kube's client: the caller never sees it.
    fake.clear_requests();
    fake.fail_next("GET", "/api/v1/nodes/*", 1, 503);
    nodes.get("n1").await.unwrap();
    let statuses: Vec<u16> = fake.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [503, 200]);

    // A short outage: calls wait it out (client retries), then succeed.
    fake.set_down(true);
    let call = tokio::spawn({
        let nodes = nodes.clone();
        async move { nodes.get("n1").await }
    });
    assert!(fake.wait_until(WAIT, |f| f.requests().iter().filter(|r| r.status == 503).count() >= 3).await);
    fake.set_down(false);
    assert_eq!(call.await.unwrap().unwrap().name_any(), "n1");

    // Non-retryable faults surface.
    fake.fail_next("*", "*", 1, 403);
    let err = nodes.get("n1").await.unwrap_err();
    assert_eq!(api_code(&err), Some((403, "Forbidden".into())));
    assert!(client_version_ok(&fake).await);
}

async fn client_version_ok(fake: &FakeApiServer) -> bool {
    let info = fake.client().unwrap().apiserver_version().await.unwrap();
    (info.major.as_str(), info.minor.as_str()) == ("1", "36")
}
