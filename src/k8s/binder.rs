//! [`KubeBinder`]: a bind decision made real through the API server, in one call.
//!
//! The assignment travels as an annotation on the `Binding` itself: POST `pods/{name}/binding` with
//! `metadata.annotations` and `metadata.uid`. The registry sets `spec.nodeName` and merges the
//! Binding's annotations into the pod in the same storage update (`setPodHostAndAnnotations`), and
//! checks the UID as a precondition (409 Conflict when a pod was re-created under the name). So a
//! pod is bound with its assignment or not at all: there is no window in which an unbound pod carries
//! an assignment, and no second call to undo. One call instead of a patch and a Binding also halves
//! the bind's time on a busy API server (measured in tests/e2e, docs/performance-journal.md).
//!
//! When the Binding fails, the pod is read back: bound to this node with this assignment (a retry of
//! a bind that went through, or an answer lost on the way) is success; anything else is the error,
//! and the extender rolls its allocation back.
//!
//! Only the leader binds: every bind first checks [`Leadership`].
//!
//! In `gpuplace serve` the calls run on the thread that drives the bind client's connection
//! ([`KubeBinder::run_calls_on`]): the request is encoded, sent, answered and decoded there, and the
//! HTTP worker that took kube-scheduler's bind only awaits the outcome. Measured on the real control
//! plane (tests/e2e, docs/performance-journal.md): with the response handed across to the HTTP
//! worker, which was busy deciding filters, the storm's bind p99 was 48-103 ms; with the whole call
//! on the bind thread, 28-77 ms in paired runs.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use serde_json::Value;

use crate::k8s::leader::Leadership;
use crate::scheduler::binder::{BindError, BindFuture, BindRequest, Binder};

/// How many binds talk to the API server at once (the rest wait in turn). Each one in flight holds
/// an HTTP/1.1 connection, and each connection beyond the pooled ones costs a TLS handshake. Measured
/// on the real control plane (tests/e2e, docs/performance-journal.md): a cap of 8 halved the
/// throughput of a 100-pod burst, so the cap only guards against an unbounded number of connections.
pub const DEFAULT_BIND_CONCURRENCY: usize = 64;

/// How long one API call of a bind may take. kube-scheduler gives up on the extender's bind after its
/// `httpTimeout` (5 s in the shipped config) anyway; past this, the call is abandoned and the pod read
/// back (a Binding that went through late is then seen by the watch and counted from its signed
/// assignment).
pub const BIND_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub struct KubeBinder {
    client: Client,
    leadership: Arc<Leadership>,
    slots: Arc<tokio::sync::Semaphore>,
    /// Where the API calls run: the runtime that drives `client`'s connection, when it has one of its
    /// own; else the caller's.
    runtime: Option<tokio::runtime::Handle>,
}

impl std::fmt::Debug for KubeBinder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBinder").field("leader", &self.leadership.is_leader()).finish_non_exhaustive()
    }
}

fn api_error(call: &'static str, r: &BindRequest, e: &kube::Error) -> BindError {
    let status = match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    };
    BindError::Api { call, pod: format!("{}/{}", r.namespace, r.name), status, message: e.to_string() }
}

impl KubeBinder {
    pub fn new(client: Client, leadership: Arc<Leadership>) -> Self {
        Self::with_concurrency(client, leadership, DEFAULT_BIND_CONCURRENCY)
    }

    /// At most `concurrency` (at least 1) binds call the API server at once; the rest wait in turn.
    pub fn with_concurrency(client: Client, leadership: Arc<Leadership>, concurrency: usize) -> Self {
        Self { client, leadership, slots: Arc::new(tokio::sync::Semaphore::new(concurrency.max(1))), runtime: None }
    }

    /// Runs each bind's API calls as a task on `runtime`, the one that drives the client's
    /// connection (see the module doc). A bind whose caller goes away still runs to its end there,
    /// so a Binding is never cut off half sent.
    pub fn run_calls_on(mut self, runtime: tokio::runtime::Handle) -> Self {
        self.runtime = Some(runtime);
        self
    }

    async fn run(&self, r: &BindRequest) -> Result<(), BindError> {
        if !self.leadership.is_leader() {
            return Err(BindError::Unavailable {
                pod: format!("{}/{}", r.namespace, r.name),
                message: "this replica is not the leader".into(),
            });
        }
        let queued = std::time::Instant::now();
        // never closed: a failed acquire cannot happen, but is no reason to panic on a request path;
        // held by the call itself, so a call whose caller went away still counts
        let slot = self.slots.clone().acquire_owned().await.ok();
        let waited = queued.elapsed();
        let Some(runtime) = &self.runtime else {
            let _slot = slot;
            return bind_call(self.client.clone(), r, waited).await;
        };
        let (client, request) = (self.client.clone(), r.clone());
        let call = async move {
            let _slot = slot;
            bind_call(client, &request, waited).await
        };
        runtime.spawn(call).await.unwrap_or_else(|e| {
            Err(BindError::Unavailable {
                pod: format!("{}/{}", r.namespace, r.name),
                message: format!("the bind thread ended before the Binding did: {e}"),
            })
        })
    }
}

/// The Binding, and the read-back after a failed one (see the module doc).
async fn bind_call(client: Client, r: &BindRequest, waited: std::time::Duration) -> Result<(), BindError> {
    let pods: Api<Pod> = Api::namespaced(client, &r.namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(r.name.clone()),
            namespace: Some(r.namespace.clone()),
            uid: Some(r.uid.clone()),
            annotations: (!r.annotations.is_empty()).then(|| r.annotations.clone()),
            ..ObjectMeta::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some(r.node.clone()), ..Default::default() },
    };
    let started = std::time::Instant::now();
    let pp = PostParams::default();
    let failed = match within_timeout(pods.create_subresource::<_, Value>("binding", &r.name, &pp, &binding)).await {
        Ok(_) => {
            // where a slow bind's time went: waiting for a slot, or the API server
            tracing::debug!(
                pod = %r.name,
                namespace = %r.namespace,
                queued_ms = waited.as_secs_f64() * 1e3,
                binding_ms = started.elapsed().as_secs_f64() * 1e3,
                "bound through the API"
            );
            return Ok(());
        }
        Err(e) => e,
    };
    match within_timeout(pods.get_opt(&r.name)).await {
        Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(r.uid.as_str()) => {
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            let ours = r.annotations.iter().all(|(k, v)| pod.annotations().get(k) == Some(v));
            if node == Some(r.node.as_str()) && ours {
                tracing::debug!(pod = %pod.name_any(), node = %r.node, "already bound as asked; the bind stands");
                return Ok(());
            }
        }
        // gone, or another pod under that name now
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(pod = %r.name, namespace = %r.namespace, error = %e, "cannot read the pod after a failed Binding");
        }
    }
    Err(api_error("Binding", r, &failed))
}

/// One API call, abandoned after [`BIND_CALL_TIMEOUT`].
async fn within_timeout<T>(call: impl std::future::Future<Output = kube::Result<T>>) -> kube::Result<T> {
    tokio::time::timeout(BIND_CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(kube::Error::Service(format!("no answer in {BIND_CALL_TIMEOUT:?}").into())))
}

impl Binder for KubeBinder {
    fn bind<'a>(&'a self, request: &'a BindRequest) -> BindFuture<'a> {
        Box::pin(self.run(request))
    }
}
