//! Allocate finding pods by the extender's assignments, against the in-process fake API server with
//! the fake kubelet over real gRPC: bind order and out of order, corrupt, forged and mismatched
//! annotations, an API server that is down, pods gpuplace did not place, twins admitted out of
//! order, devices held without an assignment.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::common::kubelet::FakePodResources;
use crate::common::{allocate, assignment_keys, Harness, SlotIds, WAIT};
use gpuplace_core::annotations::{
    AllocatedAnnotation, AllocationCounts, AssignmentAnnotation, ANNOTATION_ALLOCATED, ANNOTATION_ALLOCATION_COUNTS,
    ANNOTATION_ASSIGNMENT,
};
use gpuplace_device_plugin::assign::AssignmentSource;
use gpuplace_device_plugin::k8s::events::{PluginEvents, REASON_CORRECTED, REASON_MISMATCH, REASON_SKIPPED};
use gpuplace_device_plugin::k8s::node::NodeSync;
use gpuplace_device_plugin::kubelet_api::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuplace_device_plugin::metrics::render;
use gpuplace_device_plugin::podresources::PodResourcesClient;
use gpuplace_device_plugin::publish::{MemorySink, PublishPolicy, Publisher};
use gpuplace_device_plugin::sampler::{Sampler, Telemetry};
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, PodStatus};
use kube::ResourceExt;
use tonic::Code;

use crate::common::api::*;

#[tokio::test]
async fn allocate_applies_the_extenders_assignments_in_bind_order_and_out_of_order() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    let k = 4;
    // bound before the plugin starts: found by the watcher's initial list
    bind(
        &fake,
        gpu_pod("ns", "share-a", &[("main", false, SHARE_20G_25)]),
        vec![("main", false, vec![share(1, 20480, 25)])],
        1,
    )
    .await;
    let pair_uid = bind(
        &fake,
        gpu_pod("ns", "pair", &[("train", false, WHOLE_2)]),
        vec![("train", false, vec![whole(2), whole(3)])],
        3,
    )
    .await;
    bind(
        &fake,
        gpu_pod("ns", "late", &[("main", false, SHARE_20G_25)]),
        vec![("main", false, vec![share(6, 20480, 25)])],
        4,
    )
    .await;
    // the same limits as share-a, on the same GPU, bound later: its twin
    bind(
        &fake,
        gpu_pod("ns", "share-c", &[("main", false, SHARE_20G_25)]),
        vec![("main", false, vec![share(1, 20480, 25)])],
        5,
    )
    .await;
    // an init container and an app container of one pod, on GPU 4
    bind(
        &fake,
        gpu_pod("ns", "init", &[("main", false, SHARE_10G_10), ("warm", true, SHARE_10G_10)]),
        vec![("main", false, vec![share(4, 10240, 10)]), ("warm", true, vec![share(4, 10240, 10)])],
        6,
    )
    .await;
    // a pod without gpuplace resources and one on another node: neither is a candidate
    fake.put(&Pod {
        spec: Some(PodSpec { node_name: Some(NODE.into()), ..Default::default() }),
        ..gpu_pod("ns", "plain", &[])
    });

    let (mut h, source, _telemetry) = harness(&fake, k).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    assert_eq!(
        pods_named(&source.pending().await.unwrap()),
        ["ns/init", "ns/late", "ns/pair", "ns/share-a", "ns/share-c"]
    );

    // the two-GPU pod: preference and Allocate follow its assignment
    let got = preferred(&mut c, slots.all(k), 2).await;
    assert_eq!(got.iter().map(|id| slots.gpu_of(id)).collect::<BTreeSet<u32>>(), BTreeSet::from([2, 3]));
    let r = allocate(&mut c, got).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/pair");
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], format!("{},{}", slots.uuids[2], slots.uuids[3]));
    let marker = allocated(&fake, "ns", "pair").expect("marked on the pod");
    assert_eq!((marker.pod_uid.as_str(), marker.containers), (pair_uid.as_str(), containers(&["train"])));

    // out of bind order: ns/late (GPU 6) before the shares of GPU 1
    let r = allocate(&mut c, vec![slots.slot(6, 0)]).await.unwrap();
    assert_eq!((r.envs["GPUPLACE_POD"].as_str(), r.envs["GPUPLACE_GPU_MEM_MIB"].as_str()), ("ns/late", "20480"));
    // GPU 1, concurrently twice: the twins share-a and share-c, each once, each with their limits;
    // the first match was made with both waiting (either is right), so it is marked unconfirmed
    let (mut c1, mut c2) = (c.clone(), c.clone());
    let (a, b) = tokio::join!(allocate(&mut c1, vec![slots.slot(1, 0)]), allocate(&mut c2, vec![slots.slot(1, 1)]));
    let (a, b) = (a.unwrap(), b.unwrap());
    let mut got = [a.envs["GPUPLACE_POD"].clone(), b.envs["GPUPLACE_POD"].clone()];
    got.sort();
    assert_eq!(got, ["ns/share-a".to_string(), "ns/share-c".to_string()]);
    for r in [&a, &b] {
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], slots.uuids[1]);
        assert_eq!(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=20480M");
    }
    assert!(fake.wait_until(WAIT, |f| allocated(f, "ns", "share-c").is_some()).await);
    let (first, second) = (allocated(&fake, "ns", "share-a").unwrap(), allocated(&fake, "ns", "share-c").unwrap());
    assert_eq!((first.containers, first.unconfirmed), (containers(&["main"]), containers(&["main"])));
    assert_eq!((second.containers, second.unconfirmed), (containers(&["main"]), containers(&[])));
    // the init container first, then the app container of the same pod
    let r = allocate(&mut c, vec![slots.slot(4, 0)]).await.unwrap();
    assert_eq!((r.envs["GPUPLACE_POD"].as_str(), r.envs["GPUPLACE_CONTAINER"].as_str()), ("ns/init", "warm"));
    let r = allocate(&mut c, vec![slots.slot(4, 0)]).await.unwrap();
    assert_eq!((r.envs["GPUPLACE_POD"].as_str(), r.envs["GPUPLACE_CONTAINER"].as_str()), ("ns/init", "main"));
    assert_eq!(allocated(&fake, "ns", "init").unwrap().containers, containers(&["main", "warm"]));

    // bound now and admitted at once: the cache may not have it; the fresh list does
    bind(
        &fake,
        gpu_pod("ns", "fresh", &[("main", false, SHARE_10G_10)]),
        vec![("main", false, vec![share(7, 10240, 10)])],
        7,
    )
    .await;
    let r = allocate(&mut c, vec![slots.slot(7, 0)]).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/fresh");
    // other limits on GPU 1, bound once the twins were allocated (as the extender binds them)
    bind(
        &fake,
        gpu_pod("ns", "share-b", &[("main", false, SHARE_10G_10)]),
        vec![("main", false, vec![share(1, 10240, 10)])],
        8,
    )
    .await;
    let r = allocate(&mut c, vec![slots.slot(1, 2)]).await.unwrap();
    assert_eq!((r.envs["GPUPLACE_POD"].as_str(), r.envs["GPUPLACE_GPU_MEM_MIB"].as_str()), ("ns/share-b", "10240"));

    // GPU 5: nobody's assignment. A clear refusal that lists what waits, never some other pod's GPU
    bind(
        &fake,
        gpu_pod("ns", "waiting", &[("main", false, SHARE_10G_10)]),
        vec![("main", false, vec![share(0, 10240, 10)])],
        9,
    )
    .await;
    let e = allocate(&mut c, vec![slots.slot(5, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("GPU(s) [5]") && e.message().contains("ns/waiting/main on [0]"), "{}", e.message());
    assert_eq!(allocate(&mut c, vec![slots.slot(0, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/waiting");
    assert!(fake.wait_until(WAIT, |f| allocated(f, "ns", "waiting").is_some()).await);
    h.shutdown().await;
    drop(source);

    // a restarted plugin reads the markers: nothing is pending, nothing is matched twice
    let (mut h, source, _) = harness(&fake, k).await;
    let (_, mut c) = h.register_and_connect().await;
    assert!(source.pending().await.unwrap().is_empty());
    let e = allocate(&mut c, vec![SlotIds::of(&h).slot(1, 3)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    h.shutdown().await;
}

#[tokio::test]
async fn corrupt_forged_and_mismatched_annotations_are_skipped_never_matched() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    let one = |name: &str| gpu_pod("bad", name, &[("main", false, SHARE_20G_25)]);
    let slice = |gpu| vec![("main", false, vec![share(gpu, 20480, 25)])];
    // unparseable, an unknown version, empty
    for (name, text) in [("garbage", "{not json"), ("v9", r#"{"version":9}"#), ("empty", "")] {
        fake.put(&one(name));
        bind_raw(&fake, "bad", name, text).await;
    }
    // copied from another pod (wrong UID)
    let donor_uid = bind(&fake, one("donor"), slice(0), 1).await;
    let donor: Pod = fake.get("bad", "donor").unwrap();
    fake.put(&one("copy"));
    bind_raw(&fake, "bad", "copy", &donor.annotations()[ANNOTATION_ASSIGNMENT]).await;
    // the request says 20480 MiB, the annotation 40960 MiB
    let uid = fake.put(&one("greedy")).uid().unwrap();
    let mut rec = AssignmentAnnotation::parse(&donor.annotations()[ANNOTATION_ASSIGNMENT]).unwrap();
    rec.pod_uid = uid;
    rec.containers[0].gpus[0].memory_mib = 40960;
    // signed, as if the extender itself had written it: validation still refuses it
    bind_raw(&fake, "bad", "greedy", &rec.signed(&assignment_keys()).to_json()).await;
    // names another node
    let uid = fake.put(&one("elsewhere")).uid().unwrap();
    let mut rec = AssignmentAnnotation::parse(&donor.annotations()[ANNOTATION_ASSIGNMENT]).unwrap();
    (rec.pod_uid, rec.node) = (uid, "other-node".into());
    bind_raw(&fake, "bad", "elsewhere", &rec.signed(&assignment_keys()).to_json()).await;
    // a GPU this node does not have
    let uid = fake.put(&one("forged-gpu")).uid().unwrap();
    let mut rec = AssignmentAnnotation::parse(&donor.annotations()[ANNOTATION_ASSIGNMENT]).unwrap();
    rec.pod_uid = uid;
    rec.containers[0].gpus[0].uuid = "GPU-00000000-forged".into();
    bind_raw(&fake, "bad", "forged-gpu", &rec.signed(&assignment_keys()).to_json()).await;
    // the donor's record re-targeted at this pod but not signed again, and one signed by a key
    // the extender never published
    let uid = fake.put(&one("edited")).uid().unwrap();
    let mut rec = AssignmentAnnotation::parse(&donor.annotations()[ANNOTATION_ASSIGNMENT]).unwrap();
    rec.pod_uid = uid;
    bind_raw(&fake, "bad", "edited", &rec.to_json()).await;
    let uid = fake.put(&one("self-signed")).uid().unwrap();
    rec.pod_uid = uid;
    let own = gpuplace_core::signing::KeyRing::generate().unwrap();
    bind_raw(&fake, "bad", "self-signed", &rec.signed(&own).to_json()).await;
    // a corrupt allocated marker: it may be allocated already, so it is skipped too
    bind(&fake, one("bad-marker"), slice(2), 2).await;
    let mut p: Pod = fake.get("bad", "bad-marker").unwrap();
    p.annotations_mut().insert(ANNOTATION_ALLOCATED.into(), "main".into());
    fake.put(&p);
    // another pod's marker means nothing here
    bind(&fake, one("foreign-marker"), slice(3), 3).await;
    let mut p: Pod = fake.get("bad", "foreign-marker").unwrap();
    p.annotations_mut()
        .insert(ANNOTATION_ALLOCATED.into(), AllocatedAnnotation::new(&donor_uid, ["main".to_string()]).to_json());
    fake.put(&p);
    // finished pods are never candidates
    bind(&fake, one("done"), slice(4), 4).await;
    let mut p: Pod = fake.get("bad", "done").unwrap();
    p.status = Some(PodStatus { phase: Some("Succeeded".into()), ..Default::default() });
    fake.put(&p);

    let (mut h, source, _) = harness(&fake, 2).await;
    let (_, mut c) = h.register_and_connect().await;
    assert_eq!(pods_named(&source.pending().await.unwrap()), ["bad/donor", "bad/foreign-marker"]);
    // each skipped pod gets an Event saying why (once: asking again writes no more)
    let skipped =
        ["garbage", "v9", "empty", "copy", "greedy", "elsewhere", "forged-gpu", "edited", "self-signed", "bad-marker"];
    let events = events_of(&fake, REASON_SKIPPED, skipped.len()).await;
    assert_eq!(regarding(&events), skipped.iter().map(|n| format!("bad/{n}")).collect());
    let note = |name: &str| events.iter().find(|e| e["regarding"]["name"] == name).unwrap()["note"].to_string();
    assert!(note("greedy").contains("assigned 40960 MiB, 25%"), "{}", note("greedy"));
    assert!(note("garbage").contains("Allocate refuses its GPU containers"), "{}", note("garbage"));
    assert!(note("elsewhere").contains("other-node"), "{}", note("elsewhere"));
    assert!(note("edited").contains("the signature does not verify"), "{}", note("edited"));
    assert!(note("self-signed").contains("which is not in the key Secret"), "{}", note("self-signed"));
    source.pending().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fake.events().iter().filter(|e| e["reason"] == REASON_SKIPPED).count(), skipped.len());
    let slots = SlotIds::of(&h);
    // GPU 0: donor's own assignment, once; the copy on another pod never matches
    assert_eq!(allocate(&mut c, vec![slots.slot(0, 0)]).await.unwrap().envs["GPUPLACE_POD"], "bad/donor");
    let e = allocate(&mut c, vec![slots.slot(0, 1)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    for gpu in [2, 4] {
        assert_eq!(allocate(&mut c, vec![slots.slot(gpu, 0)]).await.unwrap_err().code(), Code::FailedPrecondition);
    }
    assert_eq!(allocate(&mut c, vec![slots.slot(3, 0)]).await.unwrap().envs["GPUPLACE_POD"], "bad/foreign-marker");
    // the foreign marker is replaced by this pod's own
    assert_eq!(
        allocated(&fake, "bad", "foreign-marker").unwrap().pod_uid,
        fake.get::<Pod>("bad", "foreign-marker").unwrap().uid().unwrap()
    );
    // and the plugin is still serving
    assert!(c.get_device_plugin_options(gpuplace_device_plugin::kubelet_api::v1beta1::Empty {}).await.is_ok());
    h.shutdown().await;
}

/// Issue 29's acceptance: a tenant who edits its own pod's assignment to name a GPU another pod
/// holds exclusively gets nothing at Allocate, whether the edit is unsigned (any tenant) or carries
/// a valid signature (a double assignment by the extender itself).
#[tokio::test]
async fn a_pod_that_edits_its_assignment_to_another_pods_exclusive_gpu_is_refused_at_allocate() {
    const WHOLE_1: &[(&str, &str)] = &[("gpuplace.io/gpu", "1")];
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    bind(&fake, gpu_pod("team-a", "holder", &[("main", false, WHOLE_1)]), vec![("main", false, vec![whole(5)])], 1)
        .await;
    bind(&fake, gpu_pod("team-b", "thief", &[("main", false, WHOLE_1)]), vec![("main", false, vec![whole(1)])], 2)
        .await;
    let (mut h, source, _) = harness(&fake, 2).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    assert_eq!(allocate(&mut c, vec![slots.slot(5, 0)]).await.unwrap().envs["GPUPLACE_POD"], "team-a/holder");

    // the tenant rewrites GPU 1 to GPU 5 in its own annotation (a pod patch it is allowed)
    let gpu5 = model().gpus[5].uuid.clone();
    let thief: Pod = fake.get("team-b", "thief").unwrap();
    let genuine = AssignmentAnnotation::parse(&thief.annotations()[ANNOTATION_ASSIGNMENT]).unwrap();
    let mut edited = genuine.clone();
    (edited.containers[0].gpus[0].uuid, edited.containers[0].gpus[0].index) = (gpu5.clone(), 5);
    let put = |text: String| {
        let mut p: Pod = fake.get("team-b", "thief").unwrap();
        p.annotations_mut().insert(ANNOTATION_ASSIGNMENT.into(), text);
        fake.put(&p);
    };
    put(edited.to_json());
    let e = allocate(&mut c, vec![slots.slot(5, 1)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("team-b/thief: gpuplace.io/assignment: not signed"), "{}", e.message());
    println!("edited, unsigned: Allocate answered {:?}: {}", e.code(), e.message());
    let events = events_of(&fake, REASON_SKIPPED, 1).await;
    let note = events[0]["note"].to_string();
    assert!(note.contains("the signature does not verify"), "{note}");
    println!("edited, unsigned: Event {}: {note}", REASON_SKIPPED);

    // the same edit with a valid signature (the extender assigned GPU 5 twice): the holder keeps it
    put(edited.signed(&assignment_keys()).to_json());
    let e = allocate(&mut c, vec![slots.slot(5, 1)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    // the refusal says why (the pod's Event series only counts a second problem)
    assert!(e.message().contains("team-b/thief: GPU 5 is held exclusively by pod team-a/holder"), "{}", e.message());
    println!("edited, signed: Allocate answered {:?}: {}", e.code(), e.message());
    assert!(source.refresh().await.unwrap().is_empty(), "the thief is no candidate");

    // back to its genuine record, the thief gets its own GPU 1
    put(genuine.to_json());
    assert_eq!(allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap().envs["GPUPLACE_POD"], "team-b/thief");
    h.shutdown().await;
}

#[tokio::test]
async fn api_server_down_fails_allocate_clearly_and_recovers() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    bind(
        &fake,
        gpu_pod("ns", "a", &[("main", false, SHARE_20G_25)]),
        vec![("main", false, vec![share(1, 20480, 25)])],
        1,
    )
    .await;
    let (mut h, source, telemetry) = harness(&fake, 2).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    assert_eq!(pods_named(&source.pending().await.unwrap()), ["ns/a"]);

    // the pod matches, but it cannot be marked: refused, not started unmarked
    fake.fail_next("PATCH", "/api/v1/namespaces/ns/pods/a", 1, 500);
    let e = allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("ns/a") && e.message().contains("marking"), "{}", e.message());
    // Allocate decides on a fresh list: with the API server down, Unavailable, never a guess from
    // the cache
    fake.set_down(true);
    for gpu in [1, 5] {
        let e = allocate(&mut c, vec![slots.slot(gpu, 0)]).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().contains("listing the pods of node test-node"), "{}", e.message());
    }
    let errors = telemetry.snapshot().api_errors;
    assert!(
        errors.get("pod_patch").is_some_and(|&n| n >= 1) && errors.get("pods_list").is_some_and(|&n| n >= 1),
        "{errors:?}"
    );

    fake.set_down(false);
    let r = allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/a");
    assert_eq!(allocated(&fake, "ns", "a").unwrap().containers, containers(&["main"]));
    // a pod bound after the outage is found (watch resumed or fresh list)
    bind(
        &fake,
        gpu_pod("ns", "b", &[("main", false, SHARE_10G_10)]),
        vec![("main", false, vec![share(5, 10240, 10)])],
        2,
    )
    .await;
    assert_eq!(allocate(&mut c, vec![slots.slot(5, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/b");
    h.shutdown().await;
}

/// A sampler over the harness's plugin, listing pod-resources from a fake kubelet on `socket`, with
/// Events written to the fake API server.
fn sampler(fake: &FakeApiServer, h: &Harness, telemetry: &Arc<Telemetry>, socket: &std::path::Path) -> Sampler {
    let policy =
        PublishPolicy { threshold_pct: 10, min_interval: Duration::ZERO, max_interval: Duration::from_secs(60) };
    let mut sampler = Sampler::new(
        h.backend.clone(),
        h.plugin.clone(),
        telemetry.clone(),
        Some(PodResourcesClient::new(socket, Duration::from_secs(5))),
        Publisher::new(policy, Arc::new(MemorySink::default())),
    );
    sampler.set_reporter(Arc::new(PluginEvents::new(fake.client().unwrap(), NODE)));
    sampler
}

/// pod-resources' answer: `pod`'s container `main` holds `device`.
fn holding(pod: &str, device: String) -> ListPodResourcesResponse {
    let holder = PodResources {
        name: pod.into(),
        namespace: "ns".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: "gpuplace.io/gpu".into(),
                device_ids: vec![device],
                topology: None,
            }],
            ..Default::default()
        }],
    };
    ListPodResourcesResponse { pod_resources: vec![holder] }
}

/// pod-resources' answer: `pod`'s container `main` listed without devices (being admitted).
fn waiting(pod: &str) -> PodResources {
    PodResources {
        name: pod.into(),
        namespace: "ns".into(),
        containers: vec![ContainerResources { name: "main".into(), ..Default::default() }],
    }
}

/// A pod bound by nodeName (no gpuplace assignment) admitted while a gpuplace pod waits for the
/// same kind of GPU: once the kubelet has shown that it lists the pod it admits, a listing with none
/// of gpuplace's pods waiting means the pod is not gpuplace's, and Allocate refuses it rather than
/// hand it the waiting pod's assignment (which that pod would then lose). The waiting pod's own
/// admission then matches it. tests/e2e/real_node.rs does the same on a real kubelet.
#[tokio::test]
async fn a_pod_gpuplace_did_not_place_is_refused_and_the_waiting_pod_keeps_its_assignment() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    for (seq, name) in [(1, "first"), (2, "second")] {
        let slices = vec![("main", false, vec![share(seq, 20480, 25)])];
        bind(&fake, gpu_pod("ns", name, &[("main", false, SHARE_20G_25)]), slices, u64::from(seq)).await;
    }
    let (mut h, _source, _telemetry) = harness(&fake, 4).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    let socket = h.dir.path().join("pod-resources.sock");
    let listing = |pods: Vec<PodResources>| ListPodResourcesResponse { pod_resources: pods };
    let mut kubelet = FakePodResources::start(&socket, listing(vec![waiting("first")])).unwrap();
    h.plugin.set_pod_resources(PodResourcesClient::new(&socket, Duration::from_secs(5)));
    assert_eq!(allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/first");

    // the kubelet admits `intruder` (listed, no devices) while `second` waits on GPU 2, not listed yet
    let mut held = holding("first", slots.slot(1, 0)).pod_resources;
    held.push(waiting("intruder"));
    kubelet.set(Ok(listing(held.clone())));
    let e = allocate(&mut c, vec![slots.slot(2, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("a pod that gpuplace did not place"), "{}", e.message());
    assert_eq!(allocated(&fake, "ns", "second").map(|a| a.containers).unwrap_or_default(), containers(&[]));

    // `second` admitted: its Allocate matches it, with its own limits
    held.push(waiting("second"));
    kubelet.set(Ok(listing(held)));
    let r = allocate(&mut c, vec![slots.slot(2, 0)]).await.unwrap();
    assert_eq!((r.envs["GPUPLACE_POD"].as_str(), r.envs["GPUPLACE_GPU_MEM_MIB"].as_str()), ("ns/second", "20480"));
    kubelet.stop().await;
    h.shutdown().await;
}

/// Issue 28's case, now harmless: twins (the same limits on GPU 1) admitted out of bind order. The
/// match was a guess, right for the limits either way; pod-resources shows the other twin holding the
/// device, and the record follows: the holder is marked, the guessed pod unmarked (its own admission
/// then matches it), an informational Event on both, counted as a correction, not a mismatch.
#[tokio::test]
async fn a_twin_admitted_out_of_order_is_corrected_quietly_from_pod_resources() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    for (seq, name) in [(1, "first"), (2, "second")] {
        let slices = vec![("main", false, vec![share(1, 20480, 25)])];
        bind(&fake, gpu_pod("ns", name, &[("main", false, SHARE_20G_25)]), slices, seq).await;
    }
    let (mut h, _source, telemetry) = harness(&fake, 4).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    // kubelet is admitting `second`; both wait with the same limits, bind order picks `first`
    let granted = allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap();
    assert_eq!(
        (granted.envs["GPUPLACE_POD"].as_str(), granted.envs["GPUPLACE_GPU_MEM_MIB"].as_str()),
        ("ns/first", "20480")
    );
    assert_eq!(allocated(&fake, "ns", "first").unwrap().unconfirmed, containers(&["main"]));

    let socket = h.dir.path().join("pod-resources.sock");
    let mut kubelet = FakePodResources::start(&socket, holding("second", slots.slot(1, 0))).unwrap();
    sampler(&fake, &h, &telemetry, &socket).tick().await;
    let t = telemetry.snapshot();
    assert_eq!((t.allocation_mismatches, t.allocation_corrections), (0, 1));
    let events = events_of(&fake, REASON_CORRECTED, 2).await;
    assert_eq!(regarding(&events), ["ns/first".to_string(), "ns/second".to_string()].into());
    assert!(fake.events().iter().all(|e| e["reason"] != REASON_MISMATCH), "no Warning for a harmless swap");
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains("matched to ns/first/main") && note.contains("gave it to ns/second/main"), "{note}");
    // the holder is marked, confirmed; the guessed pod holds nothing and is unmarked
    let second = allocated(&fake, "ns", "second").unwrap();
    assert_eq!((second.containers, second.unconfirmed), (containers(&["main"]), containers(&[])));
    assert_eq!(allocated(&fake, "ns", "first").unwrap().containers, containers(&[]));
    assert_eq!(h.plugin.grants().keys().cloned().collect::<Vec<_>>(), [("ns/second".to_string(), "main".to_string())]);
    // `first` is admitted now: its Allocate matches it, no guess left
    let r = allocate(&mut c, vec![slots.slot(1, 1)]).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/first");
    let first = allocated(&fake, "ns", "first").unwrap();
    assert_eq!((first.containers, first.unconfirmed), (containers(&["main"]), containers(&[])));
    kubelet.stop().await;
    h.shutdown().await;
}

/// Twins admitted each in the other's place: both records swap names, neither is lost (the
/// allocated-vs-used gauges look grants up under the names pod-resources reports).
#[tokio::test]
async fn twins_admitted_in_each_others_place_swap_their_records() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    for (seq, name) in [(1, "first"), (2, "second")] {
        let slices = vec![("main", false, vec![share(1, 20480, 25)])];
        bind(&fake, gpu_pod("ns", name, &[("main", false, SHARE_20G_25)]), slices, seq).await;
    }
    let (mut h, _source, telemetry) = harness(&fake, 4).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    assert_eq!(allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/first");
    assert_eq!(allocate(&mut c, vec![slots.slot(1, 1)]).await.unwrap().envs["GPUPLACE_POD"], "ns/second");
    let socket = h.dir.path().join("pod-resources.sock");
    let mut listing = holding("second", slots.slot(1, 0));
    listing.pod_resources.extend(holding("first", slots.slot(1, 1)).pod_resources);
    let mut kubelet = FakePodResources::start(&socket, listing).unwrap();
    sampler(&fake, &h, &telemetry, &socket).tick().await;
    let t = telemetry.snapshot();
    assert_eq!((t.allocation_mismatches, t.allocation_corrections), (0, 2));
    for name in ["first", "second"] {
        let m = allocated(&fake, "ns", name).unwrap();
        assert_eq!((m.containers, m.unconfirmed), (containers(&["main"]), containers(&[])), "{name}");
    }
    let keys: Vec<String> = h.plugin.grants().keys().map(|k| k.0.clone()).collect();
    assert_eq!(keys, ["ns/first", "ns/second"]);
    kubelet.stop().await;
    h.shutdown().await;
}

/// A device kubelet gave to a pod gpuplace assigned nothing (allocated by something else): that pod
/// runs with the granted pod's limits. Made loud on both pods; the count survives a plugin restart
/// through the node's `gpuplace.io/allocation-counts`.
#[tokio::test]
async fn a_device_held_by_a_pod_without_an_assignment_is_a_mismatch_counted_across_restarts() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    bind(
        &fake,
        gpu_pod("ns", "first", &[("main", false, SHARE_20G_25)]),
        vec![("main", false, vec![share(1, 20480, 25)])],
        1,
    )
    .await;
    let (mut h, _source, telemetry) = harness(&fake, 4).await;
    let (_, mut c) = h.register_and_connect().await;
    let slots = SlotIds::of(&h);
    assert_eq!(allocate(&mut c, vec![slots.slot(1, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/first");

    let socket = h.dir.path().join("pod-resources.sock");
    let mut kubelet = FakePodResources::start(&socket, holding("intruder", slots.slot(1, 0))).unwrap();
    let mut sampler = sampler(&fake, &h, &telemetry, &socket);
    sampler.tick().await;
    assert_eq!(telemetry.snapshot().allocation_mismatches, 1);
    let events = events_of(&fake, REASON_MISMATCH, 2).await;
    assert_eq!(regarding(&events), ["ns/first".to_string(), "ns/intruder".to_string()].into());
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains("assignment of ns/first/main, but kubelet gave it to ns/intruder/main"), "{note}");
    assert!(note.contains("delete it"), "{note}");
    // `first` holds nothing: unmarked, so its own admission matches it
    assert_eq!(allocated(&fake, "ns", "first").unwrap().containers, containers(&[]));
    // reported once
    sampler.tick().await;
    assert_eq!(telemetry.snapshot().allocation_mismatches, 1);

    // the node pass persists the counts on the Node
    let inv = inventory("hgx-h100-8");
    let sync = |t: &Arc<Telemetry>| {
        NodeSync::new(fake.client().unwrap(), NODE, inv.clone(), h.plugin.clone(), t.clone(), Duration::from_secs(3600))
    };
    assert!(sync(&telemetry).reconcile().await.unwrap().counts_patched);
    let on_node = |f: &FakeApiServer| {
        let n: Node = f.get("", NODE).unwrap();
        n.annotations().get(ANNOTATION_ALLOCATION_COUNTS).map(|t| AllocationCounts::parse(t).unwrap())
    };
    assert_eq!(on_node(&fake), Some(AllocationCounts::new(1, 0)));
    // a restarted plugin: no series until the earlier count is read, then it goes on from there
    let restarted = Telemetry::new(8, true);
    restarted.enable_api();
    let page =
        |t: &Arc<Telemetry>| render(NODE, h.plugin.gpus(), &h.plugin.health(), &BTreeMap::new(), &t.snapshot(), true);
    assert!(!page(&restarted).contains("gpuplace_allocation_mismatches_total"), "no 0 before the persisted count");
    let done = sync(&restarted).reconcile().await.unwrap();
    assert!(!done.counts_patched, "nothing new to write");
    let text = page(&restarted);
    assert!(text.contains("\ngpuplace_allocation_mismatches_total{Hostname=\"test-node\"} 1\n"), "{text}");
    assert!(text.contains("\ngpuplace_allocation_corrections_total{Hostname=\"test-node\"} 0\n"), "{text}");
    restarted.count_allocations(0, 2);
    assert!(sync(&restarted).reconcile().await.unwrap().counts_patched);
    assert_eq!(on_node(&fake), Some(AllocationCounts::new(1, 2)));
    kubelet.stop().await;
    h.shutdown().await;
}
