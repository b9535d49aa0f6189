//! The plugin's running edges: the gRPC face kubelet calls ([`DevicePluginService`], one per server
//! instance) and the thread that feeds GPU health events into the [`Plugin`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::Plugin;
use crate::kubelet_api::v1beta1::device_plugin_server::DevicePlugin;
use crate::kubelet_api::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions, Empty,
    ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::nvml::GpuBackend;

/// Watches backend health events on a thread of its own (NVML's wait blocks) until `stop` is set.
pub fn spawn_health_monitor(
    plugin: Arc<Plugin>,
    backend: Arc<dyn GpuBackend>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("gpu-health".into()).spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match backend.wait_events(Duration::from_millis(250)) {
                Ok(events) => {
                    for e in &events {
                        plugin.apply_event(e);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for GPU events failed");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    })
}

/// The gRPC face of a [`Plugin`], tied to one server instance: `shutdown` ends its streams.
#[derive(Clone)]
pub struct DevicePluginService {
    plugin: Arc<Plugin>,
    shutdown: watch::Receiver<bool>,
}

impl DevicePluginService {
    pub fn new(plugin: Arc<Plugin>, shutdown: watch::Receiver<bool>) -> Self {
        Self { plugin, shutdown }
    }
}

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.plugin.options()))
    }

    type ListAndWatchStream = ReceiverStream<Result<ListAndWatchResponse, Status>>;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut devices = self.plugin.subscribe();
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            loop {
                let list = devices.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: list.to_vec() })).await.is_err() {
                    break;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { break },
                    // the server is going away (re-registration): end the stream so it can stop
                    _ = shutdown.wait_for(|s| *s) => break,
                    _ = tx.closed() => break,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in &request.get_ref().container_requests {
            container_responses
                .push(ContainerPreferredAllocationResponse { device_i_ds: self.plugin.preferred(c).await? });
        }
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in &request.get_ref().container_requests {
            match self.plugin.allocate(c).await {
                Ok(r) => container_responses.push(r),
                Err(e) => {
                    tracing::error!(devices = ?c.devices_ids, error = %e.message(), "Allocate refused");
                    return Err(e);
                }
            }
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
