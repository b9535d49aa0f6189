//! A fake kubelet for tests: kubelet's `Registration` service on `<dir>/kubelet.sock`
//! ([`FakeKubelet`]), its pod-resources `List` ([`FakePodResources`]), and a bare HTTP GET for
//! scraping `/metrics` ([`http_get`]).
//!
//! Test-only: it lives here, beside the tests' harness, not in the plugin's library (which ships).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use gpuplace_device_plugin::kubelet_api::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpuplace_device_plugin::kubelet_api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, GetPodResourcesRequest, GetPodResourcesResponse,
    ListPodResourcesRequest, ListPodResourcesResponse,
};
use gpuplace_device_plugin::kubelet_api::v1beta1::registration_server::{Registration, RegistrationServer};
use gpuplace_device_plugin::kubelet_api::v1beta1::{Empty, RegisterRequest};
use gpuplace_device_plugin::kubelet_api::KUBELET_SOCKET;

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
        Self::start_late(dir, Duration::ZERO)
    }

    /// As [`FakeKubelet::start`], but the socket file exists `late` before it accepts connections
    /// (bound, not yet listening): a dial in between is refused, as one to a starting kubelet can be.
    pub fn start_late(dir: &Path, late: Duration) -> std::io::Result<Self> {
        use socket2::{Domain, SockAddr, Socket, Type};
        let sock = dir.join(KUBELET_SOCKET);
        match std::fs::remove_file(&sock) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
        socket.bind(&SockAddr::unix(&sock)?)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tokio::time::sleep(late).await;
            let listen = || -> std::io::Result<UnixListener> {
                socket.listen(128)?;
                socket.set_nonblocking(true)?;
                UnixListener::from_std(std::os::unix::net::UnixListener::from(socket))
            };
            let listener = listen().expect("fake kubelet: listen on its bound socket");
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

struct PodResources {
    answer: Arc<Mutex<Result<ListPodResourcesResponse, Status>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for PodResources {
    async fn list(&self, _: Request<ListPodResourcesRequest>) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.answer.lock().unwrap_or_else(|e| e.into_inner()).clone().map(Response::new)
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not faked"))
    }

    async fn get(&self, _: Request<GetPodResourcesRequest>) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not faked"))
    }
}

/// kubelet's pod-resources service on a unix socket, answering `List` with what it is given.
pub struct FakePodResources {
    answer: Arc<Mutex<Result<ListPodResourcesResponse, Status>>>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakePodResources {
    /// Serves on `socket` (replacing a stale one). Needs a tokio runtime.
    pub fn start(socket: &Path, answer: ListPodResourcesResponse) -> std::io::Result<Self> {
        match std::fs::remove_file(socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = UnixListener::bind(socket)?;
        let answer = Arc::new(Mutex::new(Ok(answer)));
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let service = PodResourcesListerServer::new(PodResources { answer: answer.clone() });
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stop_rx.await;
            };
            if let Err(e) = Server::builder()
                .serve_with_incoming_shutdown(service, UnixListenerStream::new(listener), stopped)
                .await
            {
                tracing::warn!(error = %e, "fake pod-resources stopped");
            }
        });
        Ok(Self { answer, stop: Some(stop_tx), task })
    }

    /// What later `List` calls answer: a listing, or an error status.
    pub fn set(&self, answer: Result<ListPodResourcesResponse, Status>) {
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = answer;
    }

    pub async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
        }
    }
}

/// A plain HTTP/1.1 GET: (status code, content type, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String, String)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8(raw).map_err(|_| bad("response is not UTF-8"))?;
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| bad("no status code"))?;
    let content_type = head
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-type")))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    Ok((status, content_type, body.to_string()))
}
