//! A fake kubelet: kubelet's `Registration` service on `<dir>/kubelet.sock`, for tests and demos.
//!
//! It lives in the library rather than in `tests/` so its gRPC server is compiled once, not once per
//! test crate.

use std::path::Path;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use crate::api::v1beta1::registration_server::{Registration, RegistrationServer};
use crate::api::v1beta1::{Empty, RegisterRequest};
use crate::api::KUBELET_SOCKET;

struct Kubelet {
    registrations: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.registrations.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// A running fake kubelet; every Register call it receives is queued.
pub struct FakeKubelet {
    registrations: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeKubelet {
    /// Serves on `<dir>/kubelet.sock` (replacing a stale one). Needs a tokio runtime.
    pub fn start(dir: &Path) -> std::io::Result<Self> {
        let sock = dir.join(KUBELET_SOCKET);
        match std::fs::remove_file(&sock) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = UnixListener::bind(&sock)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stop_rx.await;
            };
            let service = RegistrationServer::new(Kubelet { registrations: tx });
            if let Err(e) = Server::builder()
                .serve_with_incoming_shutdown(service, UnixListenerStream::new(listener), stopped)
                .await
            {
                tracing::warn!(error = %e, "fake kubelet stopped");
            }
        });
        Ok(Self { registrations: rx, stop: Some(stop_tx), task })
    }

    /// The next Register call, or `None` if none arrives within `timeout`.
    pub async fn next_registration(&mut self, timeout: Duration) -> Option<RegisterRequest> {
        tokio::time::timeout(timeout, self.registrations.recv()).await.ok().flatten()
    }

    /// Stops serving, as a dying kubelet does (the socket file stays, as after a crash).
    pub async fn stop(&mut self) {
        // only once: a finished JoinHandle must not be polled again
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
        }
    }
}
