//! The plugin's Kubernetes side against the in-process fake API server (`gpuplace_testkit::apiserver`),
//! with the fake kubelet over real gRPC: node status and annotations, the utilization sink, and the
//! public keys. Allocate finding pods by the extender's assignments: `assignments.rs`.

mod assignments;
#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{public_keys_configmap, Harness, WAIT};
use gpuplace_core::annotations::{
    GpuUtilization, NodeInventory, UtilizationAnnotation, ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use gpuplace_core::utilization_configmap::{configmap_name, read, LABEL_UTILIZATION};
use gpuplace_device_plugin::assign::{AssignmentSource, StaticAssignments};
use gpuplace_device_plugin::k8s::keys::AssignmentKeys;
use gpuplace_device_plugin::k8s::node::{NodeSync, Reconciled};
use gpuplace_device_plugin::k8s::utilization::KubeUtilizationSink;
use gpuplace_device_plugin::nvml::fake::Fault;
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig};
use gpuplace_device_plugin::publish::UtilizationSink;
use gpuplace_device_plugin::sampler::Telemetry;
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use common::api::*;

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
