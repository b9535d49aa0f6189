//! The HTTP face of the extender (actix-web): routes, status codes and body limits, nothing else.
//! Every decision is the online scheduler's, reached through [`Extender`], which decodes and encodes.
//!
//! - `POST {prefix}/filter|prioritize|bind|preempt`: kube-scheduler's verbs. 200 with the answer;
//!   400 with the decoding error for a body that cannot be used; 413 over `max_body_bytes`, or for
//!   a body naming more than `max_request_nodes` nodes (refused while it is decoded); 404 for an unknown verb; 405 for a known verb with another method. While not ready, filter and
//!   bind answer with `Error` set, prioritize and preempt with 503.
//! - With `metrics_listen`, a second listener, plain HTTP, serves `/metrics`, `/healthz` and
//!   `/readyz` and nothing else, so that scrapers and probes need no access to the verbs' port; with
//!   `probe_listen`, a third serves `/healthz` and `/readyz` alone, for kubelet's probes. Each
//!   listener holds a capped number of connections and closes idle and slow ones ([`ports`]).
//! - `GET /healthz` (the process answers), `/readyz` (503 until the state is complete),
//!   `/metrics` (Prometheus text), `/inspect` and `/inspect/{node}` (JSON; 404 for an unknown node),
//!   `/mix` (the learned mix's state as JSON, what `--mix-state` holds; 404 when the mix is fixed).
//!   These sit at the root, not under the prefix, where probes and scrapers look by default.
//! - With a [`Frontend`] (API-server mode): HTTPS ([`tls`]; with a client CA
//!   the verbs, `/inspect` and `/mix` answer 403 to a connection without a verified client
//!   certificate), and the forward of every verb to the leader while this replica does not lead
//!   ([`forward`](crate::extender::forward); `/readyz` then reports the role).
//!
//! Bodies are read by [`body`](crate::extender::body): 413 over `max_body_bytes`, 408 for a body that
//! stalls or trickles (below 1 MiB/s after a 2 s grace). A body over [`LARGE_BODY_BYTES`] is
//! decided on actix's blocking pool, one at a time (the gate is taken once that many bytes have
//! arrived, chunked bodies included), so that the workers keep answering probes and ordinary
//! requests meanwhile; the heap it used is then handed back to the system.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Serialize;

use crate::extender::body::{read_body, Body, BodyLimits};
use crate::extender::forward::{Forwarder, Route, FORWARDED_HEADER};
use crate::extender::ports::{self, Limits, ListenerLimits, Ports};
use crate::extender::tls::{self, ClientVerified, ServerTls};
use crate::extender::wire::WireError;
use crate::extender::Extender;
use crate::scheduler::metrics::Verb;

/// Default address: every interface, port 8888 (the Service in front of the extender targets it).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8888";
pub const DEFAULT_PREFIX: &str = "/gpuplace";
/// 4 MiB: what kube-scheduler sends with `nodeCacheCapable: true` (the project's configuration) at
/// 5,000 nodes: the names (at most 1.3 MB, 253-character names) and the pod (etcd keeps objects
/// under 1.5 MiB). Without `nodeCacheCapable` it sends whole Node objects (~5 KiB each, ~25 MiB at
/// 5,000 nodes): raise `--max-body-bytes` to about 6 KiB per node then.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
pub use crate::extender::wire::DEFAULT_MAX_REQUEST_NODES;
/// Bodies above this are decided off the HTTP workers (about 60,000 node names, or 200 Node
/// objects); kube-scheduler's names-only requests for a 5,000-node cluster stay below it.
pub const LARGE_BODY_BYTES: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Path before the verbs, `""` or starting with `/` (a trailing `/` is dropped).
    pub prefix: String,
    pub max_body_bytes: usize,
    /// Most nodes one request may name (candidates, or victims' nodes in preempt).
    pub max_request_nodes: usize,
    /// Time before a body's pace is checked, and the slowest average rate accepted after it.
    pub body_grace: Duration,
    pub body_min_bytes_per_sec: u64,
    /// The metrics and probe listeners, the connections each listener holds, and whether `/metrics`
    /// names pods (`serve --metrics-listen`, `--probe-listen`, `--max-connections`, ...).
    pub ports: Ports,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.into(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_request_nodes: DEFAULT_MAX_REQUEST_NODES,
            body_grace: crate::extender::body::DEFAULT_GRACE,
            body_min_bytes_per_sec: crate::extender::body::DEFAULT_MIN_BYTES_PER_SEC,
            ports: Ports::default(),
        }
    }
}

/// What every verb handler needs besides the extender: the node limit, the body's limits, and the
/// gate that lets one large body at a time be read and decided.
#[derive(Debug, Clone)]
struct VerbLimits {
    max_request_nodes: usize,
    body: BodyLimits,
    large: Arc<tokio::sync::Semaphore>,
}

impl HttpOptions {
    /// The prefix as routes use it.
    pub fn normalized_prefix(&self) -> Result<String, String> {
        let p = self.prefix.trim_end_matches('/');
        if !p.is_empty() && !p.starts_with('/') {
            return Err(format!("--prefix must start with '/', got {:?}", self.prefix));
        }
        if p.contains(['{', '}']) {
            return Err(format!("--prefix must be a plain path, got {:?}", self.prefix));
        }
        Ok(p.to_string())
    }
}

/// Registers every route on an actix `App`.
pub fn configure(cfg: &mut web::ServiceConfig, ext: web::Data<Extender>, prefix: &str, opts: &HttpOptions) {
    configure_with(cfg, ext, prefix, opts, Arc::new(tokio::sync::Semaphore::new(1)))
}

/// [`configure`] with the large-body gate shared by every worker of one server.
fn configure_with(
    cfg: &mut web::ServiceConfig,
    ext: web::Data<Extender>,
    prefix: &str,
    opts: &HttpOptions,
    large: Arc<tokio::sync::Semaphore>,
) {
    let body = BodyLimits {
        max_bytes: opts.max_body_bytes,
        large_bytes: LARGE_BODY_BYTES,
        grace: opts.body_grace,
        min_bytes_per_sec: opts.body_min_bytes_per_sec,
        large_wait: crate::extender::body::DEFAULT_LARGE_WAIT,
    };
    cfg.app_data(ext)
        .app_data(web::Data::new(VerbLimits { max_request_nodes: opts.max_request_nodes, body, large }))
        .route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics))
        .route("/inspect", web::get().to(inspect_all))
        .route("/inspect/{node}", web::get().to(inspect_node))
        .route("/mix", web::get().to(mix))
        .service(
            web::scope(prefix)
                .route("/filter", web::post().to(filter))
                .route("/prioritize", web::post().to(prioritize))
                .route("/bind", web::post().to(bind))
                .route("/preempt", web::post().to(preempt))
                .route("/{verb}", web::to(unknown_verb)),
        )
        .default_service(web::to(not_found));
}

/// A side listener's routes: `/healthz`, `/readyz`, and `/metrics` on the metrics port; 404 for
/// anything else.
fn configure_side(cfg: &mut web::ServiceConfig, ext: web::Data<Extender>, front: &Frontend, side: Side) {
    // the forward's readiness and metrics; the client-certificate marker is read by no route here
    configure_frontend(cfg, front);
    cfg.app_data(ext).route("/healthz", web::get().to(healthz)).route("/readyz", web::get().to(readyz));
    if side == Side::Metrics {
        cfg.route("/metrics", web::get().to(metrics));
    }
    cfg.default_service(web::to(not_found));
}

/// The listeners beside the verbs' port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Metrics,
    Probes,
}

/// Applies a listener's [`Limits`] to an actix `HttpServer` with `$workers` workers (before
/// `bind`: the backlog is the listening socket's).
macro_rules! limited {
    ($server:expr, $limits:expr, $workers:expr) => {{
        let l: Limits = $limits;
        $server
            .workers($workers)
            .max_connections(l.per_worker($workers))
            .backlog(l.backlog)
            .client_request_timeout(l.request_timeout)
            .keep_alive(l.keep_alive)
            .client_disconnect_timeout(l.disconnect_timeout)
    }};
}

/// A side listener, bound and running (plain HTTP, one worker), and its address.
fn side_server(
    ext: web::Data<Extender>,
    front: &Frontend,
    listen: &str,
    side: Side,
    limits: Limits,
) -> std::io::Result<(actix_web::dev::Server, Option<SocketAddr>)> {
    let front = front.clone();
    let server = actix_web::HttpServer::new(move || {
        let (ext, front) = (ext.clone(), front.clone());
        actix_web::App::new().configure(move |cfg| configure_side(cfg, ext, &front, side))
    });
    let server = limited!(server, limits, 1).disable_signals().shutdown_timeout(1).bind(listen)?;
    let addr = server.addrs().first().copied();
    for a in server.addrs() {
        match side {
            Side::Metrics => {
                tracing::info!(addr = %a, max_connections = limits.max_connections, "gpuplace metrics listening")
            }
            Side::Probes => {
                tracing::info!(addr = %a, max_connections = limits.max_connections, "gpuplace probes listening")
            }
        }
    }
    Ok((server.run(), addr))
}

/// The side listeners `ports` asks for, bound and running: (metrics, probes), each with its address.
type Sides = [Option<(actix_web::dev::Server, Option<SocketAddr>)>; 2];

fn side_servers(
    ext: &web::Data<Extender>,
    front: &Frontend,
    ports: &Ports,
    limits: &ListenerLimits,
) -> std::io::Result<Sides> {
    let metrics = ports
        .metrics_listen
        .as_deref()
        .map(|l| side_server(ext.clone(), front, l, Side::Metrics, limits.metrics))
        .transpose()?;
    let probes = ports
        .probe_listen
        .as_deref()
        .map(|l| side_server(ext.clone(), front, l, Side::Probes, limits.probes))
        .transpose()?;
    Ok([metrics, probes])
}

/// The listeners' limits for `workers` verbs workers under the current open-file limit, logged; and
/// whether `/metrics` names pods, set on the extender's metrics.
fn prepare(ext: &Extender, ports: &Ports, workers: usize) -> ListenerLimits {
    ext.metrics().set_pod_series(ports.metrics_pod_series);
    let open_files = gpuplace_core::fd_limit::current().ok().map(|l| l.soft);
    let limits = ports.limits(workers, open_files);
    let log = |l: &Limits| l.max_connections;
    if limits.cut {
        tracing::warn!(
            open_files,
            verbs = log(&limits.verbs),
            metrics = log(&limits.metrics),
            probes = log(&limits.probes),
            "connection caps cut to fit the open-file limit (raise the container's RLIMIT_NOFILE hard limit)"
        );
    } else {
        tracing::info!(
            open_files,
            verbs = log(&limits.verbs),
            metrics = log(&limits.metrics),
            probes = log(&limits.probes),
            "connection caps per listener"
        );
    }
    limits
}

/// Runs the verbs' server until it stops, then stops the side listeners with it.
async fn run_all(server: actix_web::dev::Server, sides: Vec<actix_web::dev::Server>) -> std::io::Result<()> {
    let mut running = Vec::new();
    for side in sides {
        running.push((side.handle(), actix_web::rt::spawn(side)));
    }
    let result = server.await;
    for (handle, task) in running {
        handle.stop(true).await;
        let _ = task.await;
    }
    result
}

/// What API-server mode adds around the routes: TLS on the port, and the forward to the leader.
#[derive(Debug, Clone, Default)]
pub struct Frontend {
    pub tls: Option<ServerTls>,
    pub forward: Option<Arc<Forwarder>>,
}

/// App data: the verbs, `/inspect` and `/mix` need a verified client certificate.
#[derive(Debug, Clone, Copy)]
struct RequireClientCert;

/// Registers the frontend's app data next to [`configure`]'s routes.
fn configure_frontend(cfg: &mut web::ServiceConfig, front: &Frontend) {
    if let Some(f) = &front.forward {
        cfg.app_data(web::Data::from(f.clone()));
    }
    if front.tls.as_ref().is_some_and(|t| t.require_client_cert) {
        cfg.app_data(RequireClientCert);
    }
}

/// Binds `listen`, over TLS when the frontend has it.
macro_rules! bind_frontend {
    ($server:expr, $listen:expr, $front:expr) => {
        match &$front.tls {
            Some(t) => $server.on_connect(tls::on_connect).bind_rustls_0_23($listen, (*t.config).clone()),
            None => $server.bind($listen),
        }
    };
}

/// A running server.
#[derive(Debug)]
pub struct Running {
    pub addr: SocketAddr,
    /// The metrics listener's address, with `metrics_listen`.
    pub metrics_addr: Option<SocketAddr>,
    /// The probe listener's address, with `probe_listen`.
    pub probe_addr: Option<SocketAddr>,
    pub handle: ServerHandle,
    pub thread: std::thread::JoinHandle<std::io::Result<()>>,
}

/// Starts a server on its own thread and actix system (tests, benchmarks, tools): returns once it
/// listens. `listen` may use port 0 for a free port.
pub fn spawn(ext: Arc<Extender>, opts: HttpOptions, listen: &str, workers: usize) -> std::io::Result<Running> {
    spawn_with(ext, opts, listen, workers, Frontend::default())
}

/// [`spawn`] with TLS and the forward to the leader.
pub fn spawn_with(
    ext: Arc<Extender>,
    opts: HttpOptions,
    listen: &str,
    workers: usize,
    front: Frontend,
) -> std::io::Result<Running> {
    let prefix = opts.normalized_prefix().map_err(std::io::Error::other)?;
    let listen = listen.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new().name("gpuplace-http".into()).spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let data = web::Data::from(ext);
            let workers = workers.max(1);
            let limits = prepare(&data, &opts.ports, workers);
            let ports = opts.ports.clone();
            let large = Arc::new(tokio::sync::Semaphore::new(1));
            let app_front = front.clone();
            let app_data = data.clone();
            let server = actix_web::HttpServer::new(move || {
                let (data, prefix, opts, large) = (app_data.clone(), prefix.clone(), opts.clone(), large.clone());
                let front = app_front.clone();
                actix_web::App::new().configure(move |cfg| {
                    configure_with(cfg, data, &prefix, &opts, large);
                    configure_frontend(cfg, &front);
                })
            });
            let server = limited!(server, limits.verbs, workers).disable_signals().shutdown_timeout(1);
            let bound = bind_frontend!(server, &listen, front)
                .and_then(|server| Ok((server, side_servers(&data, &front, &ports, &limits)?)));
            let (server, [metrics, probes]) = match bound {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                    return Err(e);
                }
            };
            let addr = server.addrs().first().copied();
            let server = server.run();
            let (metrics, metrics_addr) = metrics.map_or((None, None), |(s, a)| (Some(s), a));
            let (probes, probe_addr) = probes.map_or((None, None), |(s, a)| (Some(s), a));
            let _ = tx.send(
                addr.map(|a| (a, metrics_addr, probe_addr, server.handle()))
                    .ok_or_else(|| std::io::Error::other("no address bound")),
            );
            run_all(server, metrics.into_iter().chain(probes).collect()).await
        })
    })?;
    let (addr, metrics_addr, probe_addr, handle) =
        rx.recv().map_err(|_| std::io::Error::other("server thread ended before listening"))??;
    Ok(Running { addr, metrics_addr, probe_addr, handle, thread })
}

/// Serves until SIGINT or SIGTERM (the `gpuplace serve` command).
pub fn serve_forever(ext: Arc<Extender>, opts: HttpOptions, listen: &str, workers: usize) -> std::io::Result<()> {
    serve_forever_with(ext, opts, listen, workers, Frontend::default())
}

/// [`serve_forever`] with TLS and the forward to the leader.
pub fn serve_forever_with(
    ext: Arc<Extender>,
    opts: HttpOptions,
    listen: &str,
    workers: usize,
    front: Frontend,
) -> std::io::Result<()> {
    let prefix = opts.normalized_prefix().map_err(std::io::Error::other)?;
    actix_web::rt::System::new().block_on(async move {
        let data = web::Data::from(ext);
        let workers = ports::worker_count(workers);
        let limits = prepare(&data, &opts.ports, workers);
        let ports = opts.ports.clone();
        let app_data = data.clone();
        let large = Arc::new(tokio::sync::Semaphore::new(1));
        let app_front = front.clone();
        let server = actix_web::HttpServer::new(move || {
            let (data, prefix, opts, large) = (app_data.clone(), prefix.clone(), opts.clone(), large.clone());
            let front = app_front.clone();
            actix_web::App::new().configure(move |cfg| {
                configure_with(cfg, data, &prefix, &opts, large);
                configure_frontend(cfg, &front);
            })
        });
        let server = limited!(server, limits.verbs, workers).shutdown_timeout(5);
        let server = bind_frontend!(server, listen, front)?;
        for a in server.addrs() {
            tracing::info!(addr = %a, workers, max_connections = limits.verbs.max_connections, "gpuplace extender listening");
        }
        let sides = side_servers(&data, &front, &ports, &limits)?;
        run_all(server.run(), sides.into_iter().flatten().map(|(s, _)| s).collect()).await
    })
}

// ---------------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------------

fn text(status: StatusCode, message: impl Into<String>) -> HttpResponse {
    HttpResponse::build(status).content_type("text/plain; charset=utf-8").body(message.into())
}

fn json<T: Serialize>(value: &T) -> HttpResponse {
    Reply::json(value).into_response()
}

/// An answer already encoded (filter and prioritize write theirs straight into a sized buffer).
fn json_body(body: Vec<u8>) -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body(body)
}

/// Reads the whole body under the server's limits ([`crate::extender::body`]); the error response
/// says which limit.
async fn body(req: &HttpRequest, payload: web::Payload) -> Result<Body, HttpResponse> {
    let Some(limits) = req.app_data::<web::Data<VerbLimits>>() else {
        return Err(text(StatusCode::INTERNAL_SERVER_ERROR, "the server's body limits are not configured"));
    };
    let declared =
        req.headers().get(actix_web::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    read_body(payload.into_inner(), declared, &limits.body, &limits.large).await.map_err(|e| {
        let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
        let mut resp = text(status, e.to_string());
        if status == StatusCode::REQUEST_TIMEOUT || status == StatusCode::PAYLOAD_TOO_LARGE {
            // the rest of the body is not read: the connection cannot carry another request
            resp.head_mut().set_connection_type(actix_web::http::ConnectionType::Close);
        }
        resp
    })
}

/// With a client CA: 403 for a connection that presented no verified client certificate.
fn unauthenticated(req: &HttpRequest) -> Option<HttpResponse> {
    req.app_data::<RequireClientCert>()?;
    if req.conn_data::<ClientVerified>().is_some() {
        return None;
    }
    Some(text(
        StatusCode::FORBIDDEN,
        "a client certificate signed by the extender's --tls-client-ca is required for this route",
    ))
}

/// The leader's URL when this verb is to be forwarded: this replica does not lead, a leader is
/// known, and the request was not forwarded already (it is then answered here).
fn forward_to(req: &HttpRequest) -> Option<(web::Data<Forwarder>, String)> {
    let fwd = req.app_data::<web::Data<Forwarder>>()?;
    if req.headers().contains_key(FORWARDED_HEADER) {
        return None;
    }
    match fwd.role().route() {
        Route::Leader(url) => Some((fwd.clone(), url)),
        Route::Local | Route::Unknown => None,
    }
}

/// The leader's answer, as it came.
fn relay(answer: crate::extender::forward::Forwarded) -> HttpResponse {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut resp = HttpResponse::build(status);
    if let Some(ct) = answer.content_type {
        resp.insert_header((actix_web::http::header::CONTENT_TYPE, ct));
    }
    resp.body(answer.body)
}

/// Runs one verb: body, decision (here, or the leader's through the forward), status, metrics.
async fn run_verb<F, Fut>(
    verb: Verb,
    ext: web::Data<Extender>,
    req: HttpRequest,
    payload: web::Payload,
    f: F,
) -> HttpResponse
where
    F: FnOnce(web::Data<Extender>, web::Bytes) -> Fut,
    Fut: std::future::Future<Output = HttpResponse>,
{
    let started = Instant::now();
    if let Some(cert) = req.conn_data::<tls::ClientCertificate>().filter(|c| c.first_use()) {
        ext.metrics().client_certificate(&cert.subject, cert.not_after);
    }
    let resp = match unauthenticated(&req) {
        Some(refused) => refused,
        None => match body(&req, payload).await {
            // a large body's permit is held until it is decided
            Ok(Body { bytes, permit: _permit }) => match forward_to(&req) {
                // a failed forward is answered here: not leading, that is the not-ready answer
                Some((fwd, url)) => match fwd.forward(verb, &url, bytes.clone()).await {
                    Ok(answer) => relay(answer),
                    Err(_) => f(ext.clone(), bytes).await,
                },
                None => f(ext.clone(), bytes).await,
            },
            Err(resp) => resp,
        },
    };
    if resp.status().is_client_error() {
        tracing::debug!(verb = verb.name(), status = resp.status().as_u16(), "request refused");
    }
    ext.metrics().request(verb, resp.status().as_u16(), started.elapsed());
    resp
}

/// Runs a verb whose decision is synchronous (filter, prioritize, preempt) under the node limit: on
/// the worker for an ordinary body, on the blocking pool (one at a time) for a large one.
async fn run_sync_verb(
    verb: Verb,
    ext: web::Data<Extender>,
    limits: web::Data<VerbLimits>,
    req: HttpRequest,
    payload: web::Payload,
    decide: fn(&Extender, &[u8]) -> Reply,
) -> HttpResponse {
    let max_nodes = limits.max_request_nodes;
    run_verb(verb, ext, req, payload, move |ext, b| async move {
        if b.len() <= LARGE_BODY_BYTES {
            return crate::extender::wire::with_node_limit(max_nodes, || decide(&ext, &b)).into_response();
        }
        let answer = web::block(move || {
            let answer = crate::extender::wire::with_node_limit(max_nodes, || decide(&ext, &b));
            drop(b);
            release_heap();
            answer
        })
        .await;
        match answer {
            Ok(a) => a.into_response(),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("deciding a large request: {e}")),
        }
    })
    .await
}

/// A synchronous verb's answer, before it becomes a response (which may not cross threads).
/// Serves the other handlers too, so encoding and refusals are written once.
enum Reply {
    Json(Vec<u8>),
    Text(StatusCode, String),
}

impl Reply {
    fn json<T: Serialize>(value: &T) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => Reply::Json(body),
            Err(e) => Reply::Text(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the answer: {e}")),
        }
    }

    fn refused(e: &WireError) -> Self {
        Reply::Text(StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST), e.to_string())
    }

    fn not_ready() -> Self {
        Reply::Text(StatusCode::SERVICE_UNAVAILABLE, crate::scheduler::service::NOT_READY.into())
    }

    fn into_response(self) -> HttpResponse {
        match self {
            Reply::Json(body) => json_body(body),
            Reply::Text(status, message) => text(status, message),
        }
    }
}

/// Hands the heap a large request used back to the system: glibc keeps freed memory in its arenas,
/// and one 60 MB body would otherwise leave the process hundreds of MB larger for good.
fn release_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of glibc's own heap to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

async fn filter(
    ext: web::Data<Extender>,
    limits: web::Data<VerbLimits>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    run_sync_verb(Verb::Filter, ext, limits, req, payload, |ext, b| match ext.filter_json(b) {
        Ok(body) => Reply::Json(body),
        Err(e) => Reply::refused(&e),
    })
    .await
}

async fn prioritize(
    ext: web::Data<Extender>,
    limits: web::Data<VerbLimits>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    run_sync_verb(Verb::Prioritize, ext, limits, req, payload, |ext, b| {
        if !ext.is_ready() {
            return Reply::not_ready();
        }
        match ext.prioritize_json(b) {
            Ok(body) => Reply::Json(body),
            Err(e) => Reply::refused(&e),
        }
    })
    .await
}

async fn bind(ext: web::Data<Extender>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    run_verb(Verb::Bind, ext, req, payload, |ext, b| async move {
        match ext.bind(&b).await {
            Ok(r) => json(&r),
            Err(e) => Reply::refused(&e).into_response(),
        }
    })
    .await
}

async fn preempt(
    ext: web::Data<Extender>,
    limits: web::Data<VerbLimits>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    run_sync_verb(Verb::Preempt, ext, limits, req, payload, |ext, b| {
        if !ext.is_ready() {
            return Reply::not_ready();
        }
        match ext.preempt(b) {
            Ok(r) => Reply::json(&r),
            Err(e) => Reply::refused(&e),
        }
    })
    .await
}

async fn unknown_verb(req: HttpRequest, path: web::Path<String>) -> HttpResponse {
    let verb = path.into_inner();
    if ["filter", "prioritize", "bind", "preempt"].contains(&verb.as_str()) {
        return text(StatusCode::METHOD_NOT_ALLOWED, format!("{verb} takes POST, not {}", req.method()));
    }
    text(
        StatusCode::NOT_FOUND,
        format!("unknown extender verb {verb:?}; the verbs are filter, prioritize, bind and preempt"),
    )
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    text(StatusCode::NOT_FOUND, format!("no route for {} {}", req.method(), req.path()))
}

async fn healthz() -> HttpResponse {
    text(StatusCode::OK, "ok")
}

async fn readyz(ext: web::Data<Extender>, req: HttpRequest) -> HttpResponse {
    if let Some(fwd) = req.app_data::<web::Data<Forwarder>>() {
        // two replicas: ready once synced, whoever leads; the text names the role
        let (ready, message) = fwd.readiness();
        let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        return text(status, message);
    }
    if ext.is_ready() {
        text(StatusCode::OK, "ready")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "not ready: state not complete (or not the leader)")
    }
}

async fn metrics(ext: web::Data<Extender>, req: HttpRequest) -> HttpResponse {
    let mut body = ext.render_metrics();
    if let Some(fwd) = req.app_data::<web::Data<Forwarder>>() {
        body.push_str(&fwd.render_metrics());
    }
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(body)
}

async fn inspect_all(ext: web::Data<Extender>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = unauthenticated(&req) {
        return refused;
    }
    match ext.inspect(None) {
        Some(r) => json(&r),
        None => text(StatusCode::INTERNAL_SERVER_ERROR, "no report"),
    }
}

async fn mix(ext: web::Data<Extender>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = unauthenticated(&req) {
        return refused;
    }
    match ext.mix_state() {
        Some(s) => json(&s),
        None => text(
            StatusCode::NOT_FOUND,
            "the mix is fixed (serve --mix FILE): nothing is learned; /inspect shows the mix in use",
        ),
    }
}

async fn inspect_node(ext: web::Data<Extender>, req: HttpRequest, path: web::Path<String>) -> HttpResponse {
    if let Some(refused) = unauthenticated(&req) {
        return refused;
    }
    let node = path.into_inner();
    match ext.inspect(Some(&node)) {
        Some(r) => json(&r),
        None => text(StatusCode::NOT_FOUND, format!("no GPU node named {node:?}")),
    }
}
