//! [`KubeBinder`]: a bind decision made real through the API server.
//!
//! 1. Merge-patch the annotations (the assignment) onto the pod. The patch names the pod's UID, which
//!    the registry checks as a precondition (409 Conflict when it differs), so a pod deleted and
//!    created again under the same name is never annotated with another pod's GPUs.
//! 2. POST `pods/{name}/binding` (with the UID too, which the registry checks as a precondition).
//! 3. If the Binding fails, read the pod back: bound to this node with this assignment (a retry of
//!    a bind that went through, or an answer lost on the way) is success; otherwise the annotation
//!    is removed again (best effort, logged) and the error returned, so the extender rolls its
//!    allocation back (removed only while it is ours and the pod unbound, or bound elsewhere where
//!    it does not apply). When the pod cannot be read, the annotation is left: removing it from a pod
//!    whose Binding did go through would leave it running without its assignment; on an unbound
//!    pod it is harmless (not trusted, overwritten by the next bind).
//!
//! Only the leader binds: every bind first checks [`Leadership`].

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::apiserver::leader::Leadership;
use crate::core::annotations::{AssignmentAnnotation, ANNOTATION_ASSIGNMENT};
use crate::extender::binder::{BindError, BindFuture, BindRequest, Binder};

/// How many binds talk to the API server at once (the rest wait in turn). Each one in flight holds
/// an HTTP/1.1 connection, and each connection beyond the pooled ones costs a TLS handshake. Measured
/// on the real control plane (tests/e2e, docs/performance.md): a cap of 8 halved the throughput of a
/// 100-pod burst, so the cap only guards against an unbounded number of connections.
pub const DEFAULT_BIND_CONCURRENCY: usize = 64;

pub struct KubeBinder {
    client: Client,
    leadership: Arc<Leadership>,
    slots: tokio::sync::Semaphore,
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
        Self { client, leadership, slots: tokio::sync::Semaphore::new(concurrency.max(1)) }
    }

    async fn run(&self, r: &BindRequest) -> Result<(), BindError> {
        if !self.leadership.is_leader() {
            return Err(BindError::Unavailable {
                pod: format!("{}/{}", r.namespace, r.name),
                message: "this replica is not the leader".into(),
            });
        }
        let queued = std::time::Instant::now();
        // never closed: a failed acquire cannot happen, but is no reason to panic on a request path
        let _slot = self.slots.acquire().await.ok();
        let waited = queued.elapsed();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &r.namespace);
        let pp = PatchParams::default();
        let started = std::time::Instant::now();
        if !r.annotations.is_empty() {
            let patch = json!({"metadata": {"uid": r.uid, "annotations": r.annotations}});
            pods.patch(&r.name, &pp, &Patch::Merge(&patch)).await.map_err(|e| api_error("annotating", r, &e))?;
        }
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(r.name.clone()),
                namespace: Some(r.namespace.clone()),
                uid: Some(r.uid.clone()),
                ..ObjectMeta::default()
            },
            target: ObjectReference { kind: Some("Node".into()), name: Some(r.node.clone()), ..Default::default() },
        };
        let annotated = started.elapsed();
        let failed =
            match pods.create_subresource::<_, Value>("binding", &r.name, &PostParams::default(), &binding).await {
                Ok(_) => {
                    // where a slow bind's time went (API server, or this process's client)
                    tracing::debug!(
                        pod = %r.name,
                        namespace = %r.namespace,
                        queued_ms = waited.as_secs_f64() * 1e3,
                        annotate_ms = annotated.as_secs_f64() * 1e3,
                        binding_ms = (started.elapsed() - annotated).as_secs_f64() * 1e3,
                        "bound through the API"
                    );
                    return Ok(());
                }
                Err(e) => e,
            };
        match pods.get_opt(&r.name).await {
            Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(r.uid.as_str()) => {
                let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
                let ours = r.annotations.iter().all(|(k, v)| pod.annotations().get(k) == Some(v));
                if node == Some(r.node.as_str()) && ours {
                    tracing::debug!(pod = %pod.name_any(), node = %r.node, "already bound as asked; the bind stands");
                    return Ok(());
                }
                // bound elsewhere with an assignment for that node (an earlier bind of ours): it stands
                let valid_where_bound = r
                    .annotations
                    .get(ANNOTATION_ASSIGNMENT)
                    .and_then(|t| AssignmentAnnotation::parse(t).ok())
                    .is_some_and(|a| Some(a.node.as_str()) == node);
                if ours && (node.is_none() || !valid_where_bound) {
                    self.unannotate(&pods, r).await;
                }
            }
            // gone, or another pod under that name now: nothing of ours is on it
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(pod = %r.name, namespace = %r.namespace, error = %e, "cannot read the pod after a failed Binding; its annotation is left in place");
            }
        }
        Err(api_error("Binding", r, &failed))
    }

    /// Removes the annotations written for a bind that did not happen (best effort).
    async fn unannotate(&self, pods: &Api<Pod>, r: &BindRequest) {
        if r.annotations.is_empty() {
            return;
        }
        let removed: serde_json::Map<String, Value> = r.annotations.keys().map(|k| (k.clone(), Value::Null)).collect();
        let patch = json!({"metadata": {"uid": r.uid, "annotations": removed}});
        match pods.patch(&r.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                tracing::debug!(pod = %r.name, namespace = %r.namespace, "assignment annotation removed after a failed Binding")
            }
            Err(e) => {
                tracing::warn!(pod = %r.name, namespace = %r.namespace, error = %e, "assignment annotation not removed after a failed Binding")
            }
        }
    }
}

impl Binder for KubeBinder {
    fn bind<'a>(&'a self, request: &'a BindRequest) -> BindFuture<'a> {
        Box::pin(self.run(request))
    }
}
