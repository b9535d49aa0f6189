//! `/metrics` over HTTP: the sampler over the fake backend, a fake pod-resources server on a unix
//! socket in a temp dir, and the plugin's Allocate records.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::kubelet::{http_get, FakePodResources};
use common::topology;
use gpuplace_device_plugin::assign::{pending_pod, share, StaticAssignments};
use gpuplace_device_plugin::crosscheck::{Mismatch, MismatchReporter};
use gpuplace_device_plugin::kubelet_api::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuplace_device_plugin::kubelet_api::v1beta1::ContainerAllocateRequest;
use gpuplace_device_plugin::metrics::{self, MetricsSource, CONTENT_TYPE_TEXT};
use gpuplace_device_plugin::nvml::fake::{FakeBackend, FakeReading, Fault};
use gpuplace_device_plugin::nvml::GpuBackend;
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig};
use gpuplace_device_plugin::podresources::PodResourcesClient;
use gpuplace_device_plugin::publish::{MemorySink, PublishPolicy, Publisher};
use gpuplace_device_plugin::sampler::{Sampler, Telemetry};
use gpuplace_device_plugin::slots::slot_id;
use tokio::sync::oneshot;

const H100_MIB: u64 = 81559;

struct Node {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    backend: Arc<FakeBackend>,
    plugin: Arc<Plugin>,
    sampler: Sampler,
    sink: Arc<MemorySink>,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Node {
    /// GPU n at n*10 % and n GiB, GPU 0 with every field fixed; GPU 5 granted to ml/train main.
    async fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("gdpm").tempdir().unwrap();
        let socket = dir.path().join("pod-resources.sock");
        let backend = Arc::new(FakeBackend::load(&topology("hgx-h100-8"), "test-node").unwrap());
        for g in 1..8 {
            backend.set_utilization(g, g * 10, u64::from(g) * 1024).unwrap();
        }
        let fixed = FakeReading {
            util_pct: Some(90),
            mem_used_mib: Some(40_000),
            temperature_c: Some(65),
            power_w: Some(500),
            sm_clock_mhz: Some(1755),
        };
        backend.set_reading(0, fixed).unwrap();
        let source = Arc::new(StaticAssignments::new(vec![pending_pod(
            "ml/train",
            1,
            &[("main", false, vec![share(5, 20480, 25)])],
        )]));
        let inventory = backend.inventory().unwrap();
        let plugin = Plugin::new(PluginConfig::default(), &inventory, Some(source)).unwrap();
        let granted = plugin.allocate(&ContainerAllocateRequest { devices_ids: vec![slot(&plugin, 5, 0)] }).await;
        assert_eq!(granted.unwrap().envs["GPUPLACE_GPU_MEM_MIB"], "20480");

        let telemetry = Telemetry::new(8, true);
        let sink = Arc::new(MemorySink::default());
        let policy =
            PublishPolicy { threshold_pct: 10, min_interval: Duration::ZERO, max_interval: Duration::from_secs(60) };
        let client = PodResourcesClient::new(&socket, Duration::from_secs(5));
        let sampler = Sampler::new(
            backend.clone(),
            plugin.clone(),
            telemetry.clone(),
            Some(client),
            Publisher::new(policy, sink.clone()),
        );
        let listener = metrics::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let source = Arc::new(MetricsSource {
            hostname: "test-node".into(),
            plugin: plugin.clone(),
            telemetry,
            pod_labels: true,
        });
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        tokio::spawn(metrics::serve(
            listener,
            source,
            Box::pin(async move {
                let _ = stop_rx.await;
            }),
        ));
        Self { _dir: dir, socket, backend, plugin, sampler, sink, addr, stop: Some(stop_tx) }
    }

    async fn scrape(&self) -> String {
        let (status, content_type, body) = http_get(self.addr, "/metrics").await.unwrap();
        assert_eq!((status, content_type.as_str()), (200, CONTENT_TYPE_TEXT));
        body
    }

    /// Drains the backend's health events into the plugin (the health monitor's job).
    fn apply_events(&self) {
        for e in self.backend.wait_events(Duration::from_millis(1)).unwrap() {
            self.plugin.apply_event(&e);
        }
    }

    fn uuid(&self, gpu: u32) -> String {
        self.plugin.gpus()[gpu as usize].uuid.clone()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn slot(plugin: &Plugin, gpu: u32, s: u32) -> String {
    slot_id(&plugin.gpus()[gpu as usize].uuid, s)
}

fn pod(ns: &str, name: &str, container: &str, ids: Vec<String>) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: "gpuplace.io/gpu".into(),
                device_ids: ids,
                topology: None,
            }],
            ..Default::default()
        }],
    }
}

/// The series of `name` whose labels contain every `want` pair, as (labels, value).
fn series<'a>(page: &'a str, name: &str, want: &[(&str, &str)]) -> Vec<(&'a str, f64)> {
    page.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|l| l.rsplit_once("} "))
        .filter(|(labels, _)| want.iter().all(|(k, v)| labels.split(',').any(|p| p == format!("{k}=\"{v}\""))))
        .map(|(labels, v)| (labels, v.parse().unwrap()))
        .collect()
}

/// The one value of `name` on `gpu` with pod labels `want` (panics unless exactly one series).
fn value(page: &str, name: &str, gpu: &str, want: &[(&str, &str)]) -> f64 {
    let mut w = vec![("gpu", gpu)];
    w.extend_from_slice(want);
    let s = series(page, name, &w);
    assert_eq!(s.len(), 1, "{name} on GPU {gpu} with {want:?}: {s:?}");
    s[0].1
}

#[tokio::test]
async fn dcgm_series_carry_pod_labels_and_allocated_vs_used() {
    let mut node = Node::start().await;
    let listing = ListPodResourcesResponse {
        pod_resources: vec![
            pod("ml", "train", "main", vec![slot(&node.plugin, 5, 0)]),
            pod("web", "infer", "srv", vec![slot(&node.plugin, 0, 0)]),
            // no extender assignment for this one: it runs unlimited, so it counts as the whole GPU
            pod("ml", "batch", "worker", vec![slot(&node.plugin, 0, 1)]),
        ],
    };
    let mut kubelet = FakePodResources::start(&node.socket, listing).unwrap();
    node.sampler.tick().await;
    let page = node.scrape().await;

    // GPU 0: every field as the fake fixed it, one series per container holding it
    let srv = [("UUID", node.uuid(0)), ("modelName", "NVIDIA H100 80GB HBM3".into())];
    let srv: Vec<(&str, &str)> = srv.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut want = srv.clone();
    want.extend([("Hostname", "test-node"), ("container", "srv"), ("namespace", "web"), ("pod", "infer")]);
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_UTIL", "0", &want), 90.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_FB_USED", "0", &want), 40_000.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_FB_FREE", "0", &want), (H100_MIB - 40_000) as f64);
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_TEMP", "0", &want), 65.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_POWER_USAGE", "0", &want), 500.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_SM_CLOCK", "0", &want), 1755.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_XID_ERRORS", "0", &want), 0.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_UTIL", "0", &[("pod", "batch"), ("container", "worker")]), 90.0);
    assert_eq!(series(&page, "DCGM_FI_DEV_GPU_UTIL", &[("gpu", "0")]).len(), 2);
    // GPU 5 held by ml/train; GPU 1 by nobody: one series without pod labels
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_UTIL", "5", &[("pod", "train"), ("namespace", "ml")]), 50.0);
    let idle = series(&page, "DCGM_FI_DEV_GPU_UTIL", &[("gpu", "1")]);
    assert_eq!(idle.len(), 1);
    assert!(!idle[0].0.contains("pod="), "{idle:?}");
    assert!(page
        .contains("# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n# TYPE DCGM_FI_DEV_FB_USED gauge\n"));

    // allocated vs used: the grant on GPU 5; two containers on GPU 0, one unlimited: the whole GPU
    assert_eq!(value(&page, "gpuplace_gpu_memory_allocated_mib", "5", &[]), 20480.0);
    assert_eq!(value(&page, "gpuplace_gpu_core_allocated_percent", "5", &[]), 25.0);
    assert_eq!(value(&page, "gpuplace_gpu_memory_used_mib", "5", &[]), 5.0 * 1024.0);
    assert_eq!(value(&page, "gpuplace_gpu_core_used_percent", "5", &[]), 50.0);
    assert_eq!(value(&page, "gpuplace_gpu_memory_allocated_mib", "0", &[]), H100_MIB as f64);
    assert_eq!(value(&page, "gpuplace_gpu_core_allocated_percent", "0", &[]), 100.0);
    assert_eq!(value(&page, "gpuplace_gpu_memory_allocated_mib", "1", &[]), 0.0);
    assert_eq!(value(&page, "gpuplace_gpu_containers", "0", &[]), 2.0);
    assert_eq!(series(&page, "gpuplace_podresources_up", &[])[0].1, 1.0);
    // kubelet agrees with the grant: ml/train holds the device its assignment was applied to
    assert_eq!(series(&page, "gpuplace_allocation_mismatches_total", &[("Hostname", "test-node")])[0].1, 0.0);
    assert_eq!(node.sink.published().len(), 1, "the first sweep is published");
    assert_eq!(node.sink.published()[0].gpus.len(), 8);

    // GPU 3 falls off the bus: its readings go, its XID and health stay; the sweep without it is published
    node.backend.inject(3, Fault::FallOffBus).unwrap();
    node.apply_events();
    // ml/train ends: its grant is forgotten
    kubelet.set(Ok(ListPodResourcesResponse {
        pod_resources: vec![pod("web", "infer", "srv", vec![slot(&node.plugin, 0, 0)])],
    }));
    node.sampler.tick().await;
    let page = node.scrape().await;
    assert!(series(&page, "DCGM_FI_DEV_GPU_UTIL", &[("gpu", "3")]).is_empty());
    assert!(series(&page, "gpuplace_gpu_memory_used_mib", &[("gpu", "3")]).is_empty());
    assert_eq!(value(&page, "DCGM_FI_DEV_XID_ERRORS", "3", &[]), 79.0);
    assert_eq!(value(&page, "gpuplace_gpu_healthy", "3", &[]), 0.0);
    assert_eq!(value(&page, "gpuplace_gpu_healthy", "2", &[]), 1.0);
    assert_eq!(value(&page, "gpuplace_gpu_xid_errors_total", "3", &[]), 1.0);
    assert_eq!(value(&page, "gpuplace_sampler_errors_total", "3", &[("reason", "gpu_lost")]), 1.0);
    assert_eq!(value(&page, "gpuplace_gpu_memory_allocated_mib", "5", &[]), 0.0);
    assert!(node.plugin.grants().is_empty());
    let published = node.sink.published();
    assert_eq!(published.len(), 2);
    assert_eq!(published[1].gpus.len(), 7);
    assert!(published[1].gpus.iter().all(|g| g.uuid != node.uuid(3)));
    assert_eq!(series(&page, "gpuplace_utilization_publishes_total", &[("reason", "gpus_changed")])[0].1, 1.0);
    assert_eq!(series(&page, "gpuplace_sampler_sweeps_total", &[])[0].1, 2.0);

    // nothing moved: no third publish
    node.sampler.tick().await;
    assert_eq!(node.sink.published().len(), 2);

    // only /metrics is served
    let (status, _, _) = http_get(node.addr, "/").await.unwrap();
    assert_eq!(status, 404);
    kubelet.stop().await;
}

#[tokio::test]
async fn without_pod_resources_metrics_still_serve_and_say_why() {
    let mut node = Node::start().await;
    // no socket at all
    node.sampler.tick().await;
    let page = node.scrape().await;
    let util = series(&page, "DCGM_FI_DEV_GPU_UTIL", &[]);
    assert_eq!(util.len(), 8);
    assert!(util.iter().all(|(labels, _)| !labels.contains("pod=")), "{util:?}");
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_UTIL", "0", &[("Hostname", "test-node")]), 90.0);
    assert_eq!(series(&page, "gpuplace_podresources_up", &[])[0].1, 0.0);
    assert_eq!(series(&page, "gpuplace_podresources_errors_total", &[("reason", "socket_missing")])[0].1, 1.0);
    // without a listing, allocation is what the plugin granted
    assert_eq!(value(&page, "gpuplace_gpu_memory_allocated_mib", "5", &[]), 20480.0);
    assert!(!page.contains("gpuplace_gpu_containers"), "no container counts without a listing");

    // kubelet answers with an error: counted as such
    let kubelet = FakePodResources::start(&node.socket, ListPodResourcesResponse::default()).unwrap();
    kubelet.set(Err(tonic::Status::unavailable("kubelet busy")));
    node.sampler.tick().await;
    let page = node.scrape().await;
    assert_eq!(series(&page, "gpuplace_podresources_errors_total", &[("reason", "call")])[0].1, 1.0);

    // and recovers: labels come back
    kubelet.set(Ok(ListPodResourcesResponse {
        pod_resources: vec![pod("web", "infer", "srv", vec![slot(&node.plugin, 0, 0)])],
    }));
    node.sampler.tick().await;
    let page = node.scrape().await;
    assert_eq!(series(&page, "gpuplace_podresources_up", &[])[0].1, 1.0);
    assert_eq!(value(&page, "DCGM_FI_DEV_GPU_UTIL", "0", &[("pod", "infer")]), 90.0);
    assert!(Path::new(&node.socket).exists());
}

/// Mismatches reported to the test.
#[derive(Default)]
struct Reported(std::sync::Mutex<Vec<Mismatch>>);

impl MismatchReporter for Reported {
    fn report(&self, m: &Mismatch) {
        self.0.lock().unwrap().push(m.clone());
    }
}

#[tokio::test]
async fn a_container_kubelet_started_on_another_pods_grant_is_reported_once() {
    let mut node = Node::start().await;
    let reported = Arc::new(Reported::default());
    node.sampler.set_reporter(reported.clone());
    // Allocate applied ml/train's assignment to the device on GPU 5, but kubelet gave it to ml/other
    let device = slot(&node.plugin, 5, 0);
    let listing = ListPodResourcesResponse { pod_resources: vec![pod("ml", "other", "main", vec![device.clone()])] };
    let mut kubelet = FakePodResources::start(&node.socket, listing).unwrap();
    node.sampler.tick().await;
    let page = node.scrape().await;
    assert_eq!(series(&page, "gpuplace_allocation_mismatches_total", &[])[0].1, 1.0);
    let seen = reported.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].device, device);
    assert_eq!(seen[0].granted_to, ("ml/train".to_string(), "main".to_string()));
    assert_eq!(seen[0].held_by.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(), ["other"]);
    // the next listing says the same: reported once, not every tick
    node.sampler.tick().await;
    assert_eq!(series(&node.scrape().await, "gpuplace_allocation_mismatches_total", &[])[0].1, 1.0);
    assert_eq!(reported.0.lock().unwrap().len(), 1);
    kubelet.stop().await;
}
