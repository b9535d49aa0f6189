//! Sends pending pods back to kube-scheduler's queue (`scheduler::requeue` says when and why).
//!
//! kube-scheduler retries a pod that an extender turned away on any cluster event, an update of the
//! pending pod itself included: a merge patch of one annotation ([`ANNOTATION_REQUEUED`]) is such an
//! event, and touches nothing else of the pod. The patch names the pod's UID, which the API server
//! refuses to change, so a pod re-created under the same name is left alone.
//!
//! The patches are made on a task of their own, fed by a channel, so neither the watch that freed
//! the GPUs nor a filter request waits on the API server. Best effort: a failure (the pod bound or
//! deleted since, the API server down) is counted and logged, never retried: kube-scheduler's own
//! periodic flush still retries the pod.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::mpsc;

use crate::scheduler::requeue::{RequeuePod, Requeuer};
use crate::scheduler::Scheduler;
use gpuplace_core::annotations::ANNOTATION_REQUEUED;
use gpuplace_core::clock::now_unix_ms;

/// The [`Requeuer`] of API-server mode: hands the pods to [`run`].
#[derive(Debug, Clone)]
pub struct PatchRequeuer {
    tx: mpsc::UnboundedSender<Vec<RequeuePod>>,
}

impl Requeuer for PatchRequeuer {
    fn requeue(&self, pods: Vec<RequeuePod>) {
        // the task is gone only when the kube side is shutting down
        let _ = self.tx.send(pods);
    }
}

/// A requeuer and the receiving end [`run`] drains.
pub fn channel() -> (PatchRequeuer, mpsc::UnboundedReceiver<Vec<RequeuePod>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (PatchRequeuer { tx }, rx)
}

/// The patch that requeues `pod`.
pub fn patch_for(pod: &RequeuePod, now_ms: i64) -> serde_json::Value {
    json!({"metadata": {
        "uid": pod.uid,
        "annotations": {ANNOTATION_REQUEUED: format!("{} {now_ms}", pod.node)},
    }})
}

/// Patches each pod received until the channel closes.
pub async fn run(client: Client, ext: Arc<Scheduler>, mut rx: mpsc::UnboundedReceiver<Vec<RequeuePod>>) {
    while let Some(pods) = rx.recv().await {
        for pod in pods {
            let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
            let patch = patch_for(&pod, now_unix_ms());
            match api.patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    ext.metrics().requeued(true);
                    tracing::debug!(
                        pod = %format!("{}/{}", pod.namespace, pod.name),
                        node = %pod.node,
                        "pod sent back to kube-scheduler's queue: GPUs it was just turned away from were freed"
                    );
                }
                Err(e) => {
                    ext.metrics().requeued(false);
                    tracing::debug!(pod = %pod.name, error = %e, "requeue annotation not written (the pod changed or is gone)");
                }
            }
        }
    }
}
