//! The HTTP face of the extender (actix-web): routes, status codes and body limits, nothing else.
//! Every decision is [`Extender`]'s.
//!
//! - `POST {prefix}/filter|prioritize|bind|preempt`: kube-scheduler's verbs. 200 with the answer;
//!   400 with the decoding error for a body that cannot be used; 413 over `max_body_bytes`;
//!   404 for an unknown verb; 405 for a known verb with another method. While not ready, filter and
//!   bind answer with `Error` set, prioritize and preempt with 503.
//! - `GET /healthz` (the process answers), `/readyz` (503 until the state is complete),
//!   `/metrics` (Prometheus text), `/inspect` and `/inspect/{node}` (JSON; 404 for an unknown node),
//!   `/mix` (the learned mix's state as JSON, what `--mix-state` holds; 404 when the mix is fixed).
//!   These sit at the root, not under the prefix, where probes and scrapers look by default.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use actix_web::dev::ServerHandle;
use actix_web::http::StatusCode;
use actix_web::{web, FromRequest, HttpRequest, HttpResponse};
use serde::Serialize;

use crate::extender::metrics::Verb;
use crate::extender::service::Extender;
use crate::extender::wire::WireError;

/// Default address: every interface, port 8888 (the Service in front of the extender targets it).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8888";
pub const DEFAULT_PREFIX: &str = "/gpuplace";
/// 64 MiB: a full-Nodes request for 5,000 nodes is about 25 MiB (a Node object is ~5 KiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;

#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Path before the verbs, `""` or starting with `/` (a trailing `/` is dropped).
    pub prefix: String,
    pub max_body_bytes: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self { prefix: DEFAULT_PREFIX.into(), max_body_bytes: DEFAULT_MAX_BODY_BYTES }
    }
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
pub fn configure(cfg: &mut web::ServiceConfig, ext: web::Data<Extender>, prefix: &str, max_body_bytes: usize) {
    cfg.app_data(ext)
        .app_data(web::PayloadConfig::new(max_body_bytes))
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

/// A running server.
#[derive(Debug)]
pub struct Running {
    pub addr: SocketAddr,
    pub handle: ServerHandle,
    pub thread: std::thread::JoinHandle<std::io::Result<()>>,
}

/// Starts a server on its own thread and actix system (tests, benchmarks, tools): returns once it
/// listens. `listen` may use port 0 for a free port.
pub fn spawn(ext: Arc<Extender>, opts: HttpOptions, listen: &str, workers: usize) -> std::io::Result<Running> {
    let prefix = opts.normalized_prefix().map_err(std::io::Error::other)?;
    let listen = listen.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new().name("gpuplace-http".into()).spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let data = web::Data::from(ext);
            let max = opts.max_body_bytes;
            let bound = actix_web::HttpServer::new(move || {
                let (data, prefix) = (data.clone(), prefix.clone());
                actix_web::App::new().configure(move |cfg| configure(cfg, data, &prefix, max))
            })
            .workers(workers.max(1))
            .disable_signals()
            .shutdown_timeout(1)
            .bind(&listen);
            let server = match bound {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                    return Err(e);
                }
            };
            let addr = server.addrs().first().copied();
            let server = server.run();
            let _ =
                tx.send(addr.map(|a| (a, server.handle())).ok_or_else(|| std::io::Error::other("no address bound")));
            server.await
        })
    })?;
    let (addr, handle) = rx.recv().map_err(|_| std::io::Error::other("server thread ended before listening"))??;
    Ok(Running { addr, handle, thread })
}

/// Serves until SIGINT or SIGTERM (the `gpuplace serve` command).
pub fn serve_forever(ext: Arc<Extender>, opts: HttpOptions, listen: &str, workers: usize) -> std::io::Result<()> {
    let prefix = opts.normalized_prefix().map_err(std::io::Error::other)?;
    actix_web::rt::System::new().block_on(async move {
        let data = web::Data::from(ext);
        let max = opts.max_body_bytes;
        let mut server = actix_web::HttpServer::new(move || {
            let (data, prefix) = (data.clone(), prefix.clone());
            actix_web::App::new().configure(move |cfg| configure(cfg, data, &prefix, max))
        })
        .shutdown_timeout(5);
        if workers > 0 {
            server = server.workers(workers);
        }
        let server = server.bind(listen)?;
        for a in server.addrs() {
            tracing::info!(addr = %a, "gpuplace extender listening");
        }
        server.run().await
    })
}

// ---------------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------------

fn text(status: StatusCode, message: impl Into<String>) -> HttpResponse {
    HttpResponse::build(status).content_type("text/plain; charset=utf-8").body(message.into())
}

fn json<T: Serialize>(value: &T) -> HttpResponse {
    match serde_json::to_vec(value) {
        Ok(body) => json_body(body),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the answer: {e}")),
    }
}

/// An answer already encoded (filter and prioritize write theirs straight into a sized buffer).
fn json_body(body: Vec<u8>) -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body(body)
}

fn bad_request(e: &WireError) -> HttpResponse {
    text(StatusCode::BAD_REQUEST, e.to_string())
}

/// Reads the whole body within the configured limit; the error response names the limit.
async fn body(req: &HttpRequest, payload: web::Payload) -> Result<web::Bytes, HttpResponse> {
    let mut payload = payload.into_inner();
    web::Bytes::from_request(req, &mut payload).await.map_err(|e| {
        let status = e.as_response_error().status_code();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "request body is larger than the extender accepts (--max-body-bytes)".to_string()
        } else {
            format!("reading the request body: {e}")
        };
        text(status, message)
    })
}

/// Runs one verb: body, decision, status, metrics.
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
    let resp = match body(&req, payload).await {
        Ok(bytes) => f(ext.clone(), bytes).await,
        Err(resp) => resp,
    };
    if resp.status().is_client_error() {
        tracing::debug!(verb = verb.name(), status = resp.status().as_u16(), "request refused");
    }
    ext.metrics().request(verb, resp.status().as_u16(), started.elapsed());
    resp
}

async fn filter(ext: web::Data<Extender>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    run_verb(Verb::Filter, ext, req, payload, |ext, b| async move {
        match ext.filter_json(&b) {
            Ok(body) => json_body(body),
            Err(e) => bad_request(&e),
        }
    })
    .await
}

fn not_ready() -> HttpResponse {
    text(StatusCode::SERVICE_UNAVAILABLE, crate::extender::service::NOT_READY)
}

async fn prioritize(ext: web::Data<Extender>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    run_verb(Verb::Prioritize, ext, req, payload, |ext, b| async move {
        if !ext.is_ready() {
            return not_ready();
        }
        match ext.prioritize_json(&b) {
            Ok(body) => json_body(body),
            Err(e) => bad_request(&e),
        }
    })
    .await
}

async fn bind(ext: web::Data<Extender>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    run_verb(Verb::Bind, ext, req, payload, |ext, b| async move {
        match ext.bind(&b).await {
            Ok(r) => json(&r),
            Err(e) => bad_request(&e),
        }
    })
    .await
}

async fn preempt(ext: web::Data<Extender>, req: HttpRequest, payload: web::Payload) -> HttpResponse {
    run_verb(Verb::Preempt, ext, req, payload, |ext, b| async move {
        if !ext.is_ready() {
            return not_ready();
        }
        match ext.preempt(&b) {
            Ok(r) => json(&r),
            Err(e) => bad_request(&e),
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

async fn readyz(ext: web::Data<Extender>) -> HttpResponse {
    if ext.is_ready() {
        text(StatusCode::OK, "ready")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "not ready: state not complete (or not the leader)")
    }
}

async fn metrics(ext: web::Data<Extender>) -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(ext.render_metrics())
}

async fn inspect_all(ext: web::Data<Extender>) -> HttpResponse {
    match ext.inspect(None) {
        Some(r) => json(&r),
        None => text(StatusCode::INTERNAL_SERVER_ERROR, "no report"),
    }
}

async fn mix(ext: web::Data<Extender>) -> HttpResponse {
    match ext.mix_state() {
        Some(s) => json(&s),
        None => text(
            StatusCode::NOT_FOUND,
            "the mix is fixed (serve --mix FILE): nothing is learned; /inspect shows the mix in use",
        ),
    }
}

async fn inspect_node(ext: web::Data<Extender>, path: web::Path<String>) -> HttpResponse {
    let node = path.into_inner();
    match ext.inspect(Some(&node)) {
        Some(r) => json(&r),
        None => text(StatusCode::NOT_FOUND, format!("no GPU node named {node:?}")),
    }
}
