//! The plugin's Kubernetes side against the in-process fake API server (`gpuplace_testkit::apiserver`),
//! with the fake kubelet over real gRPC: node status and annotations, the utilization sink, and
//! Allocate finding pods by the extender's assignments.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use common::kubelet::FakePodResources;
use common::{allocate, assignment_keys, public_keys_configmap, topology, Harness, SlotIds, WAIT};
use gpuplace_core::annotations::{
    AllocatedAnnotation, AllocationCounts, AssignmentAnnotation, GpuUtilization, NodeInventory, UtilizationAnnotation,
    ANNOTATION_ALLOCATED, ANNOTATION_ALLOCATION_COUNTS, ANNOTATION_ASSIGNMENT, ANNOTATION_INVENTORY,
    ANNOTATION_UTILIZATION,
};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Node as ModelNode;
use gpuplace_core::utilization_configmap::{configmap_name, read, LABEL_UTILIZATION};
use gpuplace_device_plugin::assign::{AssignmentSource, PendingPod, StaticAssignments};
use gpuplace_device_plugin::k8s::assignments::KubeAssignments;
use gpuplace_device_plugin::k8s::events::{
    PluginEvents, CONTROLLER, REASON_CORRECTED, REASON_MISMATCH, REASON_SKIPPED,
};
use gpuplace_device_plugin::k8s::inventory::cluster_node;
use gpuplace_device_plugin::k8s::keys::AssignmentKeys;
use gpuplace_device_plugin::k8s::node::{NodeSync, Reconciled};
use gpuplace_device_plugin::k8s::utilization::KubeUtilizationSink;
use gpuplace_device_plugin::kubelet_api::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::{ContainerPreferredAllocationRequest, PreferredAllocationRequest};
use gpuplace_device_plugin::metrics::render;
use gpuplace_device_plugin::nvml::fake::{FakeBackend, Fault};
use gpuplace_device_plugin::nvml::{GpuBackend, Inventory};
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig};
use gpuplace_device_plugin::podresources::PodResourcesClient;
use gpuplace_device_plugin::publish::{MemorySink, PublishPolicy, Publisher, UtilizationSink};
use gpuplace_device_plugin::sampler::{Sampler, Telemetry};
use gpuplace_device_plugin::slots::DEFAULT_SLOTS_PER_GPU;
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{
    Binding, ConfigMap, Container, Node, ObjectReference, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use serde_json::Value;
use tonic::transport::Channel;
use tonic::Code;

/// The Kubernetes node; also the fake backend's UUID seed in the harness.
const NODE: &str = "test-node";
const H100_MIB: u64 = 81559;

fn inventory(topo: &str) -> Inventory {
    FakeBackend::load(&topology(topo), NODE).unwrap().inventory().unwrap()
}

fn model() -> ModelNode {
    cluster_node(&inventory("hgx-h100-8"), NODE, DEFAULT_SLOTS_PER_GPU).unwrap()
}

fn k8s_node(name: &str) -> Node {
    Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() }
}

/// Resource limits, name and quantity.
type Limits<'a> = &'a [(&'a str, &'a str)];

/// A pod whose containers (name, init, limits) ask for gpuplace resources.
fn gpu_pod(ns: &str, name: &str, containers: &[(&str, bool, Limits)]) -> Pod {
    let container = |(cname, res): (&str, Limits)| Container {
        name: cname.into(),
        resources: Some(ResourceRequirements {
            limits: Some(res.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let apps: Vec<Container> = containers.iter().filter(|c| !c.1).map(|c| container((c.0, c.2))).collect();
    let inits: Vec<Container> = containers.iter().filter(|c| c.1).map(|c| container((c.0, c.2))).collect();
    Pod {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(ns.into()), ..Default::default() },
        spec: Some(PodSpec {
            containers: apps,
            init_containers: if inits.is_empty() { None } else { Some(inits) },
            ..Default::default()
        }),
        ..Default::default()
    }
}

const SHARE_20G_25: &[(&str, &str)] =
    &[("gpuplace.io/gpu", "1"), ("gpuplace.io/gpu-mem", "20480"), ("gpuplace.io/gpu-core", "25")];
const SHARE_10G_10: &[(&str, &str)] =
    &[("gpuplace.io/gpu", "1"), ("gpuplace.io/gpu-mem", "10240"), ("gpuplace.io/gpu-core", "10")];
const WHOLE_2: &[(&str, &str)] = &[("gpuplace.io/gpu", "2")];

fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct, exclusive: false }
}

fn whole(gpu: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib: H100_MIB, core_pct: 100, exclusive: true }
}

/// Creates the pod and binds it to [`NODE`] with the assignment annotation, as the extender's bind
/// does (annotation and Binding in one call); returns the pod's UID.
async fn bind(fake: &FakeApiServer, pod: Pod, containers: Vec<(&str, bool, Vec<GpuSlice>)>, seq: u64) -> String {
    let (ns, name) = (pod.namespace().unwrap(), pod.name_any());
    let uid = fake.put(&pod).uid().unwrap();
    let record = PodAssignment {
        pod: format!("{ns}/{name}"),
        node: NODE.into(),
        containers: containers
            .into_iter()
            .map(|(c, init, slices)| ContainerAssignment { name: c.into(), init, slices })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    };
    let ann = AssignmentAnnotation::from_assignment(&record, &uid, &model(), seq).unwrap();
    bind_raw(fake, &ns, &name, &ann.signed(&assignment_keys()).to_json()).await;
    uid
}

/// A Binding carrying `annotation` (any text) as the assignment.
async fn bind_raw(fake: &FakeApiServer, ns: &str, name: &str, annotation: &str) {
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some([(ANNOTATION_ASSIGNMENT.to_string(), annotation.to_string())].into()),
            ..Default::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some(NODE.into()), ..Default::default() },
    };
    let pods: Api<Pod> = Api::namespaced(fake.client().unwrap(), ns);
    let _: Value = pods.create_subresource("binding", name, &PostParams::default(), &binding).await.unwrap();
}

/// The Events of `reason`, once there are at least `n` of them (panics after [`WAIT`]). Each was
/// written by the device plugin, from this node, as a Warning (a Normal Event for a correction).
async fn events_of(fake: &FakeApiServer, reason: &str, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let events: Vec<Value> = fake.events().into_iter().filter(|e| e["reason"] == reason).collect();
        if events.len() >= n {
            for e in &events {
                assert_eq!(e["reportingController"], CONTROLLER, "{e}");
                let kind = if reason == REASON_CORRECTED { "Normal" } else { "Warning" };
                assert_eq!((e["reportingInstance"].as_str(), e["type"].as_str()), (Some(NODE), Some(kind)), "{e}");
            }
            return events;
        }
        assert!(tokio::time::Instant::now() < deadline, "{n} {reason} Events expected: {:?}", fake.events());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The pods (`namespace/name`) the Events are about.
fn regarding(events: &[Value]) -> BTreeSet<String> {
    events
        .iter()
        .map(|e| {
            format!("{}/{}", e["regarding"]["namespace"].as_str().unwrap(), e["regarding"]["name"].as_str().unwrap())
        })
        .collect()
}

fn allocated(fake: &FakeApiServer, ns: &str, name: &str) -> Option<AllocatedAnnotation> {
    let pod: Pod = fake.get(ns, name)?;
    pod.annotations().get(ANNOTATION_ALLOCATED).map(|t| AllocatedAnnotation::parse(t).unwrap())
}

fn containers(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

async fn preferred(c: &mut DevicePluginClient<Channel>, available: Vec<String>, size: i32) -> Vec<String> {
    let req = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    c.get_preferred_allocation(req).await.unwrap().into_inner().container_responses.remove(0).device_i_ds
}

/// The plugin with a Kubernetes assignment source, serving the fake kubelet; the extender's public
/// keys published at the default place and watched there.
async fn harness(fake: &FakeApiServer, k: u32) -> (Harness, Arc<KubeAssignments>, Arc<Telemetry>) {
    let telemetry = Telemetry::new(8, false);
    telemetry.enable_api();
    if fake.get::<ConfigMap>("gpuplace-system", "gpuplace-assignment-public-keys").is_none() {
        fake.put(&public_keys_configmap());
    }
    // a short limit per call keeps the outage test short (the plugin's default is 5 s)
    let timeout = Duration::from_secs(1);
    let client = fake.client().unwrap();
    let keys = AssignmentKeys::watch(
        client.clone(),
        "gpuplace-system",
        "gpuplace-assignment-public-keys",
        telemetry.clone(),
        timeout,
    );
    let source = KubeAssignments::start_with_timeout(client, NODE, model(), keys, telemetry.clone(), timeout);
    let config = PluginConfig { slots_per_gpu: k, ..PluginConfig::default() };
    let h = Harness::start("hgx-h100-8", config, Some(source.clone() as Arc<dyn AssignmentSource>)).await;
    (h, source, telemetry)
}

fn pods_named(pending: &[PendingPod]) -> Vec<String> {
    let mut v: Vec<String> = pending.iter().map(|p| p.key.pod.clone()).collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------------------

fn quantity(n: &Node, list: &str, key: &str) -> Option<String> {
    let st = n.status.as_ref()?;
    let m = if list == "capacity" { st.capacity.as_ref() } else { st.allocatable.as_ref() }?;
    m.get(key).map(|q| q.0.clone())
}

fn node_inventory(fake: &FakeApiServer) -> Option<NodeInventory> {
    let n: Node = fake.get("", NODE)?;
    n.annotations().get(ANNOTATION_INVENTORY).map(|t| NodeInventory::parse(t).unwrap())
}

fn has_capacity(fake: &FakeApiServer, mem: u64, core: u64) -> bool {
    let Some(n) = fake.get::<Node>("", NODE) else { return false };
    ["capacity", "allocatable"].iter().all(|l| {
        quantity(&n, l, "gpuplace.io/gpu-mem") == Some(mem.to_string())
            && quantity(&n, l, "gpuplace.io/gpu-core") == Some(core.to_string())
    })
}

#[tokio::test]
async fn node_capacity_and_inventory_survive_kubelet_restarts_and_follow_health() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    let mut h = Harness::start("hgx-h100-8", PluginConfig::default(), None).await;
    let telemetry = Telemetry::new(8, false);
    let inv = inventory("hgx-h100-8");
    // a long resync: every write below is caused by a registration or a health change
    let plugin = h.plugin.clone();
    let node_sync = || {
        let client = fake.client().unwrap();
        NodeSync::new(client, NODE, inv.clone(), plugin.clone(), telemetry.clone(), Duration::from_secs(3600))
    };
    let task = tokio::spawn(node_sync().run());
    let _ = h.register_and_connect().await;

    // one pass writes the status, then the annotation
    let written = |f: &FakeApiServer| has_capacity(f, 8 * H100_MIB, 800) && node_inventory(f).is_some();
    assert!(fake.wait_until(WAIT, written).await, "capacity 8 GPUs and the inventory");
    let ann = node_inventory(&fake).expect("inventory annotation");
    assert_eq!(ann.slots_per_gpu, Some(10));
    assert!(!ann.confirms_allocations, "no assignments: kubelet's slots decide, nothing is confirmed");
    assert_eq!(ann.gpus.len(), 8);
    assert!(ann.gpus.iter().all(|g| g.healthy));
    assert_eq!(
        ann.gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>(),
        inv.gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>()
    );
    assert!(ann.to_node(NODE, BTreeMap::new()).is_ok(), "the extender can read it");

    // kubelet restarts: it zeroes extended resources it does not manage, then the plugin re-registers
    let mut zeroed: Node = fake.get("", NODE).unwrap();
    let st = zeroed.status.get_or_insert_with(Default::default);
    for list in [st.capacity.get_or_insert_with(Default::default), st.allocatable.get_or_insert_with(Default::default)]
    {
        list.insert("gpuplace.io/gpu-mem".into(), Quantity("0".into()));
        list.insert("gpuplace.io/gpu-core".into(), Quantity("0".into()));
    }
    fake.put(&zeroed);
    h.restart_kubelet().await;
    let _ = h.register_and_connect().await;
    assert!(fake.wait_until(WAIT, |f| has_capacity(f, 8 * H100_MIB, 800)).await, "re-applied after the restart");

    // GPU 3 falls off the bus: the inventory marks it, capacity drops by one GPU
    h.backend.inject(3, Fault::FallOffBus).unwrap();
    assert!(fake.wait_until(WAIT, |f| has_capacity(f, 7 * H100_MIB, 700)).await, "capacity without GPU 3");
    assert!(fake.wait_until(WAIT, |f| node_inventory(f).is_some_and(|i| !i.gpus[3].healthy)).await);
    assert_eq!(node_inventory(&fake).unwrap().gpus.iter().filter(|g| g.healthy).count(), 7);
    task.abort();

    // a pass that finds everything in place writes nothing
    let sync = node_sync();
    fake.clear_requests();
    assert_eq!(sync.reconcile().await.unwrap(), Reconciled::default());
    assert!(fake.requests().iter().all(|r| r.method == "GET"), "{:?}", fake.requests());

    // failures are errors, counted, and the next pass repairs
    fake.fail_next("PATCH", "/api/v1/nodes/test-node/status", 1, 500);
    h.backend.inject(3, Fault::Recover).unwrap();
    for _ in 0..500 {
        if h.plugin.is_healthy(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(h.plugin.is_healthy(3), "GPU 3 recovered");
    let e = sync.reconcile().await.unwrap_err();
    assert!(e.to_string().contains("node_status_patch"), "{e}");
    assert_eq!(telemetry.snapshot().api_errors.get("node_status_patch"), Some(&1));
    let done = sync.reconcile().await.unwrap();
    assert!(done.status_patched && done.inventory_patched);
    assert!(has_capacity(&fake, 8 * H100_MIB, 800));
    // a node that does not exist is a clear error, not a crash
    let other = NodeSync::new(
        fake.client().unwrap(),
        "no-such-node",
        inv,
        h.plugin.clone(),
        telemetry.clone(),
        Duration::from_secs(1),
    );
    assert!(other.reconcile().await.unwrap_err().to_string().contains("no-such-node does not exist"));
    h.shutdown().await;
}

/// Where the plugin writes its utilization ConfigMap in these tests.
const UTIL_NS: &str = "gpuplace-system";

fn util_value(at_unix_ms: i64, sm: u32) -> UtilizationAnnotation {
    UtilizationAnnotation {
        version: 1,
        at_unix_ms,
        gpus: vec![GpuUtilization { uuid: "GPU-a".into(), sm_percent: sm, memory_used_mib: 1234 }],
    }
}

fn util_configmap(fake: &FakeApiServer) -> Option<ConfigMap> {
    fake.get(UTIL_NS, &configmap_name(NODE))
}

#[tokio::test]
async fn utilization_goes_to_a_configmap_owned_by_the_node_never_to_the_node() {
    let fake = FakeApiServer::start().await.unwrap();
    let mut node = k8s_node(NODE);
    node.metadata.annotations = Some([("keep".to_string(), "me".to_string())].into());
    let node = fake.put(&node);
    let telemetry = Telemetry::new(8, false);
    let sink = KubeUtilizationSink::new(fake.client().unwrap(), NODE, UTIL_NS, telemetry.clone());
    assert_eq!(sink.name(), "gpuplace-utilization-test-node");

    // the first publish creates it: labelled for the extender's watch, owned by the Node
    let value = util_value(1_700_000_000_000, 55);
    sink.publish(&value).await.unwrap();
    let cm = util_configmap(&fake).expect("the ConfigMap");
    let labels = cm.metadata.labels.clone().unwrap();
    assert_eq!(labels[LABEL_UTILIZATION], "true");
    assert_eq!(labels["app.kubernetes.io/managed-by"], "gpuplace-device-plugin");
    let owners = cm.metadata.owner_references.clone().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!((owners[0].kind.as_str(), owners[0].name.as_str()), ("Node", NODE));
    assert_eq!(Some(&owners[0].uid), node.metadata.uid.as_ref());
    assert_eq!(owners[0].block_owner_deletion, None, "no finalizer rights needed on the Node");
    let data = cm.data.clone().unwrap();
    assert_eq!(data["node"], NODE);
    assert_eq!(UtilizationAnnotation::parse(&data["utilization"]).unwrap(), value);
    // what the extender reads back
    assert_eq!(read(&configmap_name(NODE), cm.data.as_ref()).unwrap().0, NODE);

    // later publishes are one merge patch each: nothing read, nothing created, the Node untouched
    let before = fake.get::<Node>("", NODE).unwrap();
    fake.clear_requests();
    for i in 1..=3 {
        sink.publish(&util_value(1_700_000_000_000 + i * 10_000, 50 + i as u32)).await.unwrap();
    }
    let requests = fake.requests();
    assert_eq!(requests.len(), 3, "{requests:?}");
    for r in &requests {
        assert_eq!(
            (r.method.as_str(), r.path.as_str()),
            ("PATCH", "/api/v1/namespaces/gpuplace-system/configmaps/gpuplace-utilization-test-node")
        );
        assert_eq!(r.content_type.as_deref(), Some("application/merge-patch+json"));
    }
    let after = fake.get::<Node>("", NODE).unwrap();
    assert_eq!(after.metadata.resource_version, before.metadata.resource_version, "the Node did not change");
    assert!(!after.annotations().contains_key(ANNOTATION_UTILIZATION));
    assert_eq!(after.annotations()["keep"], "me");
    let latest = UtilizationAnnotation::parse(&util_configmap(&fake).unwrap().data.unwrap()["utilization"]).unwrap();
    assert_eq!(latest.gpus[0].sm_percent, 53);

    // a failed write is an error naming the ConfigMap, counted; the next one succeeds
    fake.fail_next("PATCH", "/api/v1/namespaces/*/configmaps/*", 1, 500);
    let e = sink.publish(&value).await.unwrap_err();
    assert!(e.to_string().contains("gpuplace-utilization-test-node") && e.to_string().contains(NODE), "{e}");
    assert_eq!(telemetry.snapshot().api_errors.get("configmap_patch"), Some(&1));
    sink.publish(&value).await.unwrap();

    // deleted (on a real cluster, garbage-collected with a deleted Node): created again, owned by the
    // Node that exists now
    assert!(fake.remove::<ConfigMap>(UTIL_NS, &configmap_name(NODE)));
    assert!(fake.remove::<Node>("", NODE));
    let e = sink.publish(&value).await.unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    assert!(util_configmap(&fake).is_none(), "never created without its owner");
    let again = fake.put(&k8s_node(NODE));
    assert_ne!(again.metadata.uid, node.metadata.uid);
    sink.publish(&value).await.unwrap();
    let owners = util_configmap(&fake).unwrap().metadata.owner_references.unwrap();
    assert_eq!(Some(&owners[0].uid), again.metadata.uid.as_ref());
}

#[tokio::test]
async fn the_plugin_removes_a_utilization_annotation_an_older_version_left_on_its_node() {
    let fake = FakeApiServer::start().await.unwrap();
    let mut node = k8s_node(NODE);
    node.metadata.annotations = Some(
        [
            (ANNOTATION_UTILIZATION.to_string(), util_value(1_600_000_000_000, 90).to_json()),
            ("keep".to_string(), "me".to_string()),
        ]
        .into(),
    );
    fake.put(&node);
    let h = Harness::start("hgx-h100-8", PluginConfig::default(), None).await;
    let telemetry = Telemetry::new(8, false);
    let sync = NodeSync::new(
        fake.client().unwrap(),
        NODE,
        inventory("hgx-h100-8"),
        h.plugin.clone(),
        telemetry,
        Duration::from_secs(3600),
    );
    // the start pass: inventory written and the stale annotation removed, in one patch
    fake.clear_requests();
    let done = sync.reconcile().await.unwrap();
    assert!(done.inventory_patched && done.stale_utilization_removed, "{done:?}");
    let patches: Vec<_> =
        fake.requests().into_iter().filter(|r| r.method == "PATCH" && r.path == "/api/v1/nodes/test-node").collect();
    assert_eq!(patches.len(), 1, "{patches:?}");
    let stored: Node = fake.get("", NODE).unwrap();
    assert!(!stored.annotations().contains_key(ANNOTATION_UTILIZATION));
    assert!(stored.annotations().contains_key(ANNOTATION_INVENTORY));
    assert_eq!(stored.annotations()["keep"], "me");

    // only when present: an older plugin's value alone costs one patch, then nothing
    let mut again = stored.clone();
    again.annotations_mut().insert(ANNOTATION_UTILIZATION.into(), util_value(1_600_000_000_000, 90).to_json());
    fake.put(&again);
    let done = sync.reconcile().await.unwrap();
    assert_eq!(done, Reconciled { stale_utilization_removed: true, ..Reconciled::default() });
    fake.clear_requests();
    assert_eq!(sync.reconcile().await.unwrap(), Reconciled::default());
    assert!(fake.requests().iter().all(|r| r.method == "GET"), "{:?}", fake.requests());
    h.shutdown().await;
}

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
    let page = |t: &Arc<Telemetry>| render(NODE, h.plugin.gpus(), &h.plugin.health(), &BTreeMap::new(), &t.snapshot());
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

/// The inventory says the plugin confirms allocations only in assignments mode once a kubelet has
/// registered it (the extender then binds confusable pods one at a time); a restarted plugin keeps
/// the word until its own registration; without assignments it never says so.
#[tokio::test]
async fn the_inventory_says_allocations_are_confirmed_only_where_a_kubelet_calls_allocate() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&k8s_node(NODE));
    let inv = inventory("hgx-h100-8");
    let telemetry = Telemetry::new(8, false);
    let source = || -> Arc<dyn AssignmentSource> { Arc::new(StaticAssignments::new(Vec::new())) };
    let sync = |plugin: &Arc<Plugin>| {
        NodeSync::new(
            fake.client().unwrap(),
            NODE,
            inv.clone(),
            plugin.clone(),
            telemetry.clone(),
            Duration::from_secs(3600),
        )
    };
    let says = |f: &FakeApiServer| node_inventory(f).unwrap().confirms_allocations;
    // assignments, no kubelet (the e2e suite's nodes): not confirmed, so the extender never waits
    let plugin = Plugin::new(PluginConfig::default(), &inv, Some(source())).unwrap();
    sync(&plugin).reconcile().await.unwrap();
    assert!(!says(&fake));
    plugin.note_registered();
    assert!(sync(&plugin).reconcile().await.unwrap().inventory_patched);
    assert!(says(&fake));
    // restarted, not registered again yet: keeps its predecessor's word
    let restarted = Plugin::new(PluginConfig::default(), &inv, Some(source())).unwrap();
    assert!(!sync(&restarted).reconcile().await.unwrap().inventory_patched);
    assert!(says(&fake));
    // restarted with --no-assignments: kubelet's slots decide, nothing is confirmed
    let plain = Plugin::new(PluginConfig::default(), &inv, None).unwrap();
    plain.note_registered();
    sync(&plain).reconcile().await.unwrap();
    assert!(!says(&fake));
}

/// The extender rotates its key: the plugin's watch picks the new public keys up without a restart,
/// and a malformed ConfigMap afterwards keeps the last good keys (never an empty set, which would
/// refuse every assignment, nor garbage).
#[tokio::test]
async fn a_rotated_public_key_is_picked_up_and_a_malformed_configmap_keeps_the_last_good_keys() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.put(&public_keys_configmap());
    let telemetry = Telemetry::new(8, false);
    let (ns, name) = ("gpuplace-system", "gpuplace-assignment-public-keys");
    let keys = AssignmentKeys::watch(fake.client().unwrap(), ns, name, telemetry, Duration::from_secs(1));
    let until = tokio::time::Instant::now() + WAIT;
    let ids = |k: &AssignmentKeys| k.current().ids().into_iter().map(String::from).collect::<Vec<_>>();
    while ids(&keys) != ["test-key"] {
        assert!(tokio::time::Instant::now() < until, "the first keys: {:?}", ids(&keys));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // rotation: the leader publishes the new primary beside the old one
    let rotated = gpuplace_core::signing::KeyRing::new(
        "key-2",
        [("test-key".to_string(), vec![7u8; 32]), ("key-2".to_string(), vec![9u8; 32])],
    )
    .unwrap();
    let mut cm = public_keys_configmap();
    cm.data = Some(rotated.public_keys().to_configmap_data());
    fake.put(&cm);
    while ids(&keys) != ["key-2", "test-key"] && ids(&keys) != ["test-key", "key-2"] {
        assert!(tokio::time::Instant::now() < until, "the rotated keys: {:?}", ids(&keys));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let good = keys.current();
    assert_eq!(good, rotated.public_keys());

    // a malformed ConfigMap: the watch sees it, and the keys stay as they were
    let mut bad = public_keys_configmap();
    bad.data = Some([("key-2".to_string(), "not a key".to_string())].into());
    fake.put(&bad);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(keys.current(), good);
    // a reload (a signature naming an unknown key) reads the same malformed object: still kept
    assert!(!keys.reload().await);
    assert_eq!(keys.current(), good);
}
