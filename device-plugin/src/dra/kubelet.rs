//! The node side of DRA: the plugin registered with kubelet as the DRA driver, preparing claims.
//!
//! Two unix sockets, as kubelet's DRA plugin manager expects:
//! - `<plugins_registry>/<driver>-reg.sock` serves plugin registration v1: kubelet's plugin watcher
//!   finds it (inotify on the folder, and a scan when kubelet starts, so a restarted kubelet finds
//!   the plugin again by itself), asks `GetInfo` (type `DRAPlugin`, the driver name, the service
//!   socket, `v1.DRAPlugin`) and reports its verdict with `NotifyRegistrationStatus`;
//! - `<plugins>/<driver>/dra.sock` serves `v1.DRAPlugin`: `NodePrepareResources` reads each claim
//!   from the API server ([`ClaimSource`]), turns its allocation into a CDI spec
//!   ([`super::prepare`]) written to the CDI folder ([`super::cdi`]) and answers with the CDI device
//!   of each request; `NodeUnprepareResources` removes the spec. The same socket serves
//!   `v1alpha1.DRAResourceHealth`: every GPU's health, streamed ([`HealthService`]). kubelet hands the CDI devices to the
//!   runtime, which applies the spec's environment (and MPS mount) to the claim's containers.
//!
//! One claim's failure is its entry's error (kubelet retries it and shows it on the pod), never the
//! call's. A kubelet that registered a driver removes that driver's ResourceSlices some time after
//! the plugin goes away, and one that starts removes the slices of drivers not registered with it:
//! the slices ([`crate::k8s::slices`]) live as long as this registration. The sockets are checked
//! every poll interval and made again if removed or replaced. Both serve through
//! [`crate::grpc_authority`], since kubelet's plugin watcher sends the socket's path as the
//! request's authority, which tonic's HTTP/2 refuses.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::net::UnixListener;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::cdi::{prepared_uids, remove_spec, write_spec};
use super::devices::device_name;
use super::prepare::{prepare, NodeGpus};
use crate::container_env::MpsConnect;
use crate::grpc_authority::incoming;
use crate::kubelet_api::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use crate::kubelet_api::dra::{
    Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use crate::kubelet_api::dra_health::dra_resource_health_server::{DraResourceHealth, DraResourceHealthServer};
use crate::kubelet_api::dra_health::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest, NodeWatchResourcesResponse,
};
use crate::kubelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use crate::kubelet_api::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};
use crate::kubelet_api::{DRA_HEALTH_SERVICE_V1ALPHA1, DRA_PLUGIN_TYPE, DRA_SERVICE_V1};
use crate::nvml::Inventory;
use crate::plugin::Plugin;
use crate::sampler::Telemetry;
use crate::server::{file_id, ServeError, StopSignal};

/// Where claims are read (the API server; a map in fast tests).
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync {
    /// The claim `namespace/name`, `None` when there is none.
    async fn claim(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String>;
}

/// Where the node side lives.
#[derive(Debug, Clone)]
pub struct DraConfig {
    pub driver: String,
    /// This node's name (its pool's).
    pub node: String,
    /// kubelet's plugin registration folder.
    pub registry_dir: PathBuf,
    /// kubelet's DRA plugins folder; the service socket goes in `<it>/<driver>/`.
    pub plugins_dir: PathBuf,
    /// The runtime's CDI folder.
    pub cdi_dir: PathBuf,
    pub mps_pipe_dir: Option<PathBuf>,
    /// The MPS daemon's `/dev/shm` on the host, a share container's `/dev/shm` (with `mps_pipe_dir`).
    pub mps_shm_dir: Option<PathBuf>,
    pub poll_interval: Duration,
}

impl DraConfig {
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{}-reg.sock", self.driver))
    }

    pub fn service_socket(&self) -> PathBuf {
        self.plugins_dir.join(&self.driver).join("dra.sock")
    }
}

/// The node side's state, shared by both services.
pub struct DraNode {
    cfg: DraConfig,
    inventory: Inventory,
    /// GPU health (the plugin's health monitor keeps it).
    plugin: Arc<Plugin>,
    claims: Arc<dyn ClaimSource>,
    telemetry: Arc<Telemetry>,
}

impl DraNode {
    pub fn new(
        cfg: DraConfig,
        inventory: Inventory,
        plugin: Arc<Plugin>,
        claims: Arc<dyn ClaimSource>,
        telemetry: Arc<Telemetry>,
    ) -> Arc<Self> {
        telemetry.enable_dra();
        Arc::new(Self { cfg, inventory, plugin, claims, telemetry })
    }

    pub fn config(&self) -> &DraConfig {
        &self.cfg
    }

    /// How many times kubelet said the registration succeeded.
    pub fn registrations(&self) -> u64 {
        self.telemetry.snapshot().dra_registrations
    }

    /// The UIDs of the claims prepared on this node and not unprepared: those with a CDI spec.
    pub fn prepared_claims(&self) -> std::io::Result<Vec<String>> {
        prepared_uids(&self.cfg.cdi_dir, &self.cfg.driver)
    }

    /// Every GPU of this node with its health now (the resource health stream's message).
    pub fn health_report(&self) -> NodeWatchResourcesResponse {
        let health = self.plugin.health();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default();
        let devices = self
            .inventory
            .gpus
            .iter()
            .map(|g| DeviceHealth {
                device: Some(DeviceIdentifier { pool_name: self.cfg.node.clone(), device_name: device_name(g.index) }),
                health: if health.get(g.index as usize).is_none_or(|h| h.healthy) {
                    HealthStatus::Healthy
                } else {
                    HealthStatus::Unhealthy
                } as i32,
                last_updated_time: now,
            })
            .collect();
        NodeWatchResourcesResponse { devices }
    }

    async fn prepare_one(&self, namespace: &str, name: &str, uid: &str) -> Result<Vec<Device>, String> {
        let claim = self
            .claims
            .claim(namespace, name)
            .await
            .map_err(|e| format!("reading claim {namespace}/{name}: {e}"))?
            .ok_or_else(|| format!("claim {namespace}/{name} does not exist"))?;
        let health = self.plugin.health();
        let mps = self
            .cfg
            .mps_pipe_dir
            .clone()
            .map(|pipe_dir| MpsConnect { pipe_dir, shm_dir: self.cfg.mps_shm_dir.clone() });
        let node = NodeGpus {
            driver: &self.cfg.driver,
            node: &self.cfg.node,
            inventory: &self.inventory,
            health: &health,
            mps: mps.as_ref(),
        };
        let prepared = prepare(&claim, uid, &node).map_err(|e| e.to_string())?;
        let path = write_spec(&self.cfg.cdi_dir, &self.cfg.driver, uid, &prepared.spec).map_err(|e| {
            format!("writing the CDI spec of claim {namespace}/{name} in {}: {e}", self.cfg.cdi_dir.display())
        })?;
        let devices: Vec<Device> = prepared
            .devices
            .into_iter()
            .map(|d| Device {
                request_names: vec![d.request],
                pool_name: d.pool,
                device_name: d.device,
                cdi_device_ids: d.cdi_ids,
            })
            .collect();
        // managed MPS reads the shares from the specs: its limits follow this one now
        self.plugin.note_shares_changed();
        let gpus: Vec<&str> = devices.iter().map(|d| d.device_name.as_str()).collect();
        tracing::info!(claim = %format!("{namespace}/{name}"), uid, gpus = ?gpus, spec = %path.display(), "claim prepared");
        Ok(devices)
    }
}

/// The `v1.DRAPlugin` service.
pub struct DraService(pub Arc<DraNode>);

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut claims = HashMap::new();
        for c in request.into_inner().claims {
            let entry = match self.0.prepare_one(&c.namespace, &c.name, &c.uid).await {
                Ok(devices) => {
                    self.0.telemetry.dra_claim("prepared");
                    NodePrepareResourceResponse { devices, error: String::new() }
                }
                Err(error) => {
                    self.0.telemetry.dra_claim("refused");
                    tracing::warn!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, %error, "claim not prepared");
                    NodePrepareResourceResponse { devices: Vec::new(), error }
                }
            };
            claims.insert(c.uid, entry);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let node = &self.0;
        let mut claims = HashMap::new();
        for c in request.into_inner().claims {
            let error = match remove_spec(&node.cfg.cdi_dir, &node.cfg.driver, &c.uid) {
                Ok(removed) => {
                    tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, removed, "claim unprepared");
                    String::new()
                }
                Err(e) => format!("removing the CDI spec of claim {}/{}: {e}", c.namespace, c.name),
            };
            if error.is_empty() {
                node.telemetry.dra_claim("unprepared");
            }
            claims.insert(c.uid, NodeUnprepareResourceResponse { error });
        }
        node.plugin.note_shares_changed();
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// How often the health stream repeats itself unchanged: kubelet takes a device it has not heard
/// about for a while as Unknown.
pub const HEALTH_REPEAT: Duration = Duration::from_secs(10);

/// The `v1alpha1.DRAResourceHealth` service: every GPU's health when kubelet opens the stream,
/// again at every health change, and every [`HEALTH_REPEAT`]. kubelet shows it in the status of
/// the pods holding the device (an unhealthy GPU also leaves the slice, so nothing new lands on it).
/// The round's end (`true`) closes the open streams, so that the server's graceful shutdown does not
/// wait on kubelet's never-ending stream.
pub struct HealthService(pub Arc<DraNode>, pub tokio::sync::watch::Receiver<bool>);

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ReceiverStream<Result<NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let node = self.0.clone();
        let mut done = self.1.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut changes = node.plugin.subscribe();
            loop {
                if tx.send(Ok(node.health_report())).await.is_err() {
                    return;
                }
                tokio::select! {
                    r = changes.changed() => if r.is_err() { return },
                    _ = tokio::time::sleep(HEALTH_REPEAT) => {}
                    _ = tx.closed() => return,
                    _ = done.wait_for(|d| *d) => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Both services of the DRA socket, told apart by the gRPC path's service name (tonic serves one
/// service per server without its axum-based router).
#[derive(Clone)]
struct DraSocket<A, B> {
    dra: A,
    health: B,
}

impl<A, B> tower::Service<http::Request<tonic::body::Body>> for DraSocket<A, B>
where
    A: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    A::Future: Send + 'static,
    B: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    B::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        // tonic's generated services are always ready; asked anyway, as the contract says
        match (self.dra.poll_ready(cx), self.health.poll_ready(cx)) {
            (std::task::Poll::Ready(a), std::task::Poll::Ready(b)) => std::task::Poll::Ready(a.and(b)),
            _ => std::task::Poll::Pending,
        }
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let health = format!("/{}/", <DraResourceHealthServer<HealthService> as tonic::server::NamedService>::NAME);
        if req.uri().path().starts_with(&health) {
            Box::pin(self.health.call(req))
        } else {
            Box::pin(self.dra.call(req))
        }
    }
}

/// The registration service kubelet's plugin watcher calls.
pub struct RegistrationService(pub Arc<DraNode>);

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        let cfg = &self.0.cfg;
        Ok(Response::new(PluginInfo {
            r#type: DRA_PLUGIN_TYPE.into(),
            name: cfg.driver.clone(),
            endpoint: cfg.service_socket().display().to_string(),
            supported_versions: vec![DRA_SERVICE_V1.into(), DRA_HEALTH_SERVICE_V1ALPHA1.into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let s = request.into_inner();
        if s.plugin_registered {
            self.0.telemetry.dra_registered();
            let n = self.0.registrations();
            tracing::info!(driver = %self.0.cfg.driver, registrations = n, "registered with kubelet as a DRA driver");
        } else {
            tracing::error!(driver = %self.0.cfg.driver, error = %s.error, "kubelet refused the DRA driver's registration");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    let io = |action, source| ServeError::Io { action, path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the folder of", e))?;
    }
    // a socket left by an earlier run: nobody serves it any more
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing the old socket", e)),
    }
    UnixListener::bind(path).map_err(|e| io("binding", e))
}

/// Serves both sockets until `stop` resolves, making them again when they are removed or replaced;
/// removes them on the way out (kubelet then deregisters the driver).
pub async fn serve(node: Arc<DraNode>, mut stop: StopSignal) -> Result<(), ServeError> {
    let (reg_path, svc_path) = (node.cfg.registration_socket(), node.cfg.service_socket());
    loop {
        // the service first: kubelet dials it as soon as registration succeeds
        let svc = bind(&svc_path)?;
        let reg = bind(&reg_path)?;
        let ids = (file_id(&svc_path), file_id(&reg_path));
        tracing::info!(registration = %reg_path.display(), service = %svc_path.display(), "DRA driver sockets served");
        let (done_tx, done_rx) = tokio::sync::watch::channel(false);
        let until_done = |mut done: tokio::sync::watch::Receiver<bool>| async move {
            let _ = done.wait_for(|d| *d).await;
        };
        let service = DraSocket {
            dra: DraPluginServer::new(DraService(node.clone())),
            health: DraResourceHealthServer::new(HealthService(node.clone(), done_rx.clone())),
        };
        let (svc_done, reg_done) = (until_done(done_rx.clone()), until_done(done_rx));
        let svc_task = tokio::spawn(async move {
            Server::builder().serve_with_incoming_shutdown(service, incoming(svc), svc_done).await
        });
        let registration = RegistrationServer::new(RegistrationService(node.clone()));
        let reg_task = tokio::spawn(async move {
            Server::builder().serve_with_incoming_shutdown(registration, incoming(reg), reg_done).await
        });
        let stopped = loop {
            tokio::select! {
                _ = &mut stop => break true,
                _ = tokio::time::sleep(node.cfg.poll_interval) => {
                    if (file_id(&svc_path), file_id(&reg_path)) != ids {
                        tracing::warn!("a DRA driver socket was removed or replaced; serving it again");
                        break false;
                    }
                }
            }
        };
        let _ = done_tx.send(true);
        let _ = svc_task.await;
        let _ = reg_task.await;
        if stopped {
            for p in [&reg_path, &svc_path] {
                let _ = std::fs::remove_file(p);
            }
            return Ok(());
        }
    }
}
