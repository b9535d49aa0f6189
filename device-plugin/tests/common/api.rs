//! What the API-server tests share: the node, its pods and their assignments as the extender
//! writes them, Events, and a plugin harness wired to the fake API server (the `apiserver` test binary:
//! `main.rs` and `assignments.rs`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::{assignment_keys, public_keys_configmap, topology, Harness, WAIT};
use gpuplace_core::annotations::{
    AllocatedAnnotation, AssignmentAnnotation, ANNOTATION_ALLOCATED, ANNOTATION_ASSIGNMENT,
};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Node as ModelNode;
use gpuplace_device_plugin::assign::{AssignmentSource, PendingPod};
use gpuplace_device_plugin::k8s::assignments::KubeAssignments;
use gpuplace_device_plugin::k8s::events::{CONTROLLER, REASON_CORRECTED};
use gpuplace_device_plugin::k8s::inventory::cluster_node;
use gpuplace_device_plugin::k8s::keys::AssignmentKeys;
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::{ContainerPreferredAllocationRequest, PreferredAllocationRequest};
use gpuplace_device_plugin::nvml::fake::FakeBackend;
use gpuplace_device_plugin::nvml::{GpuBackend, Inventory};
use gpuplace_device_plugin::plugin::PluginConfig;
use gpuplace_device_plugin::sampler::Telemetry;
use gpuplace_device_plugin::slots::DEFAULT_SLOTS_PER_GPU;
use gpuplace_testkit::apiserver::FakeApiServer;
use k8s_openapi::api::core::v1::{
    Binding, ConfigMap, Container, Node, ObjectReference, Pod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use serde_json::Value;
use tonic::transport::Channel;

/// The Kubernetes node; also the fake backend's UUID seed in the harness.
pub const NODE: &str = "test-node";
pub const H100_MIB: u64 = 81559;

pub fn inventory(topo: &str) -> Inventory {
    FakeBackend::load(&topology(topo), NODE).unwrap().inventory().unwrap()
}

pub fn model() -> ModelNode {
    cluster_node(&inventory("hgx-h100-8"), NODE, DEFAULT_SLOTS_PER_GPU).unwrap()
}

pub fn k8s_node(name: &str) -> Node {
    Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() }
}

/// Resource limits, name and quantity.
type Limits<'a> = &'a [(&'a str, &'a str)];

/// A pod whose containers (name, init, limits) ask for gpuplace resources.
pub fn gpu_pod(ns: &str, name: &str, containers: &[(&str, bool, Limits)]) -> Pod {
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

pub const SHARE_20G_25: &[(&str, &str)] =
    &[("gpuplace.io/gpu", "1"), ("gpuplace.io/gpu-mem", "20480"), ("gpuplace.io/gpu-core", "25")];
pub const SHARE_10G_10: &[(&str, &str)] =
    &[("gpuplace.io/gpu", "1"), ("gpuplace.io/gpu-mem", "10240"), ("gpuplace.io/gpu-core", "10")];
pub const WHOLE_2: &[(&str, &str)] = &[("gpuplace.io/gpu", "2")];

pub fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct, exclusive: false }
}

pub fn whole(gpu: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib: H100_MIB, core_pct: 100, exclusive: true }
}

/// Creates the pod and binds it to [`NODE`] with the assignment annotation, as the extender's bind
/// does (annotation and Binding in one call); returns the pod's UID.
pub async fn bind(fake: &FakeApiServer, pod: Pod, containers: Vec<(&str, bool, Vec<GpuSlice>)>, seq: u64) -> String {
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
pub async fn bind_raw(fake: &FakeApiServer, ns: &str, name: &str, annotation: &str) {
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
pub async fn events_of(fake: &FakeApiServer, reason: &str, n: usize) -> Vec<Value> {
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
pub fn regarding(events: &[Value]) -> BTreeSet<String> {
    events
        .iter()
        .map(|e| {
            format!("{}/{}", e["regarding"]["namespace"].as_str().unwrap(), e["regarding"]["name"].as_str().unwrap())
        })
        .collect()
}

pub fn allocated(fake: &FakeApiServer, ns: &str, name: &str) -> Option<AllocatedAnnotation> {
    let pod: Pod = fake.get(ns, name)?;
    pod.annotations().get(ANNOTATION_ALLOCATED).map(|t| AllocatedAnnotation::parse(t).unwrap())
}

pub fn containers(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

pub async fn preferred(c: &mut DevicePluginClient<Channel>, available: Vec<String>, size: i32) -> Vec<String> {
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
pub async fn harness(fake: &FakeApiServer, k: u32) -> (Harness, Arc<KubeAssignments>, Arc<Telemetry>) {
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

pub fn pods_named(pending: &[PendingPod]) -> Vec<String> {
    let mut v: Vec<String> = pending.iter().map(|p| p.key.pod.clone()).collect();
    v.sort();
    v
}
