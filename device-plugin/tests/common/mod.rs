//! A fake kubelet for the tests: a `Registration` server on `kubelet.sock` in a temp dir, plus a
//! harness that runs the plugin (fake backend, real gRPC stack) against it.

#![allow(dead_code)]

pub mod api;
pub mod kubelet;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use gpuplace_device_plugin::assign::AssignmentSource;
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse, Device, ListAndWatchResponse, RegisterRequest,
};
use gpuplace_device_plugin::nvml::fake::FakeBackend;
use gpuplace_device_plugin::nvml::GpuBackend;
use gpuplace_device_plugin::plugin::service::spawn_health_monitor;
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig};
use gpuplace_device_plugin::server::{run, ServeConfig};
use gpuplace_device_plugin::slots::slot_id;
use gpuplace_device_plugin::unix_socket::connect_unix;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::Streaming;

/// The extender's assignment key in these tests: what `bind` helpers sign with.
pub fn assignment_keys() -> gpuplace_core::signing::KeyRing {
    gpuplace_core::signing::KeyRing::new("test-key", [("test-key".to_string(), vec![7u8; 32])]).expect("a valid seed")
}

/// The public-key ConfigMap the extender's leader publishes for [`assignment_keys`], at the plugin's
/// default place.
pub fn public_keys_configmap() -> k8s_openapi::api::core::v1::ConfigMap {
    k8s_openapi::api::core::v1::ConfigMap {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("gpuplace-assignment-public-keys".into()),
            namespace: Some("gpuplace-system".into()),
            ..Default::default()
        },
        data: Some(assignment_keys().public_keys().to_configmap_data()),
        ..Default::default()
    }
}

/// Generous for a loaded 2-core CI machine; the happy paths take milliseconds.
pub const WAIT: Duration = Duration::from_secs(10);

pub fn topology(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies").join(format!("{name}.json"))
}

/// The fake kubelet ([`kubelet::FakeKubelet`]), with the tests' patience.
pub struct FakeKubelet(kubelet::FakeKubelet);

impl FakeKubelet {
    pub fn start(dir: &Path) -> Self {
        Self(kubelet::FakeKubelet::start(dir).expect("start fake kubelet"))
    }

    /// A kubelet whose socket refuses dials for its first `late` ([`kubelet::FakeKubelet::start_late`]).
    pub fn start_late(dir: &Path, late: Duration) -> Self {
        Self(kubelet::FakeKubelet::start_late(dir, late).expect("start fake kubelet"))
    }

    /// The next Register call.
    pub async fn next_registration(&mut self) -> RegisterRequest {
        self.0.next_registration(WAIT).await.expect("no registration in time")
    }

    pub async fn stop(&mut self) {
        self.0.stop().await;
    }
}

/// The plugin under test, serving a fake kubelet.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub kubelet: FakeKubelet,
    pub backend: Arc<FakeBackend>,
    pub plugin: Arc<Plugin>,
    stop: Option<oneshot::Sender<()>>,
    serve: Option<tokio::task::JoinHandle<()>>,
    monitor_stop: Arc<AtomicBool>,
}

impl Harness {
    pub async fn start(topo: &str, config: PluginConfig, source: Option<Arc<dyn AssignmentSource>>) -> Self {
        let dir = tempfile::Builder::new().prefix("gdp").tempdir().expect("temp dir");
        let kubelet = FakeKubelet::start(dir.path());
        let backend = Arc::new(FakeBackend::load(&topology(topo), "test-node").expect("topology"));
        let inventory = backend.inventory().expect("inventory");
        let plugin = Plugin::new(config, &inventory, source).expect("plugin");
        let monitor_stop = Arc::new(AtomicBool::new(false));
        spawn_health_monitor(plugin.clone(), backend.clone(), monitor_stop.clone()).expect("monitor");
        let cfg = ServeConfig {
            dir: dir.path().to_path_buf(),
            socket_name: "gpuplace.sock".into(),
            poll_interval: Duration::from_millis(20),
            retry_interval: Duration::from_millis(20),
        };
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let serve = tokio::spawn({
            let plugin = plugin.clone();
            async move {
                run(
                    plugin,
                    cfg,
                    Box::pin(async {
                        let _ = stop_rx.await;
                    }),
                )
                .await
                .expect("serve");
            }
        });
        Self { dir, kubelet, backend, plugin, stop: Some(stop_tx), serve: Some(serve), monitor_stop }
    }

    /// Waits for the plugin to register and connects to it as kubelet does.
    pub async fn register_and_connect(&mut self) -> (RegisterRequest, DevicePluginClient<Channel>) {
        let reg = self.kubelet.next_registration().await;
        let client = self.connect(&reg.endpoint).await;
        (reg, client)
    }

    pub async fn connect(&self, endpoint: &str) -> DevicePluginClient<Channel> {
        let channel = connect_unix(&self.dir.path().join(endpoint)).await.expect("connect to plugin");
        DevicePluginClient::new(channel)
    }

    /// Simulates a kubelet restart: it stops, wipes the plugin sockets, and comes back.
    pub async fn restart_kubelet(&mut self) {
        self.kubelet.stop().await;
        for e in std::fs::read_dir(self.dir.path()).expect("read dir").flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        self.kubelet = FakeKubelet::start(self.dir.path());
    }

    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.serve.take() {
            tokio::time::timeout(WAIT, t).await.expect("plugin stops").expect("serve task");
        }
        assert!(!self.dir.path().join("gpuplace.sock").exists(), "socket removed on exit");
        self.monitor_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The plugin's device IDs (`<uuid>::<slot>`) by GPU index and slot, and back.
pub struct SlotIds {
    pub uuids: Vec<String>,
}

impl SlotIds {
    pub fn of(h: &Harness) -> Self {
        Self { uuids: h.plugin.gpus().iter().map(|g| g.uuid.clone()).collect() }
    }

    pub fn slot(&self, gpu: u32, slot: u32) -> String {
        slot_id(&self.uuids[gpu as usize], slot)
    }

    /// Every slot of the given GPUs.
    pub fn slots_of(&self, gpus: impl IntoIterator<Item = u32>, k: u32) -> Vec<String> {
        gpus.into_iter().flat_map(|g| (0..k).map(move |s| (g, s))).map(|(g, s)| self.slot(g, s)).collect()
    }

    /// Every slot of every GPU.
    pub fn all(&self, k: u32) -> Vec<String> {
        self.slots_of(0..self.uuids.len() as u32, k)
    }

    pub fn gpu_of(&self, id: &str) -> u32 {
        let uuid = id.rsplit_once("::").unwrap().0;
        self.uuids.iter().position(|u| u == uuid).unwrap() as u32
    }
}

/// One container's Allocate for the given device IDs.
pub async fn allocate(
    c: &mut DevicePluginClient<Channel>,
    ids: Vec<String>,
) -> Result<ContainerAllocateResponse, tonic::Status> {
    let req = AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] };
    Ok(c.allocate(req).await?.into_inner().container_responses.remove(0))
}

/// The next ListAndWatch message.
pub async fn next_list(stream: &mut Streaming<ListAndWatchResponse>) -> Vec<Device> {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("ListAndWatch update in time")
        .expect("stream ok")
        .expect("stream open")
        .devices
}

/// Asserts that no ListAndWatch message arrives within `d`.
pub async fn no_update_within(stream: &mut Streaming<ListAndWatchResponse>, d: Duration) {
    if let Ok(m) = tokio::time::timeout(d, stream.message()).await {
        panic!("unexpected ListAndWatch message: {:?}", m.map(|m| m.map(|m| m.devices.len())));
    }
}
