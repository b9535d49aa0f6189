//! The plugin's side of the Kubernetes API. Named `k8s` so that the `kube` crate stays visible.
//!
//! - [`assignments::KubeAssignments`]: the [`crate::assign::AssignmentSource`] over this node's pods
//!   (a watch-backed cache, with a fresh LIST when the cache has no match) and the
//!   `gpuplace.io/allocated` marker.
//! - [`node::NodeSync`]: `gpuplace.io/gpu-mem` and `gpuplace.io/gpu-core` capacity and allocatable
//!   in the node's status, and the `gpuplace.io/inventory` annotation, kept correct across kubelet
//!   restarts and health changes.
//! - [`utilization::KubeUtilizationSink`]: the [`crate::publish::UtilizationSink`] writing this
//!   node's utilization ConfigMap (not the Node: kube-scheduler requeues pods on every Node update).
//! - [`events::PluginEvents`]: Events on pods whose assignment is skipped, and on both pods of an
//!   allocation mismatch found by the pod-resources cross-check.
//! - [`keys::AssignmentKeys`]: the extender's public keys, which every assignment must verify with.
//! - [`claims::KubeClaims`]: in DRA mode, the claims kubelet asks to prepare.
//! - [`slices::SliceSync`]: in DRA mode, this node's ResourceSlice (its healthy GPUs as devices).
//! - [`pods`]: this node's pods, watched into a cache (the assignments mode's and the DRA guard's).
//! - [`dra_guard`]: in DRA mode, the guard's directory: a container's grants from its claims.
//! - [`guard`]: the guard's pods (which container a process is in, and its grant), its Events and
//!   evictions.
//! - [`inventory`]: what the node publishes, computed from the discovered GPUs and their health (pure).
//!
//! The calls, and so the RBAC (scheduler-config/device-plugin/rbac.yaml): pods list and watch (field
//! selector `spec.nodeName`) and patch; its node get and patch; `nodes/status` patch; events.k8s.io
//! events create and patch (kube's `Recorder` patches a repeated Event); `pods/eviction` create (the
//! guard, with `--guard-action evict`); configmaps patch and create
//! in the utilization namespace (a Role there); in DRA mode, resourceslices list (field selector
//! `spec.nodeName`, `spec.driver`), create, update and delete, and resourceclaims get
//! (scheduler-config/device-plugin/dra.yaml),
//! and no node status, inventory or pod calls. A failed call
//! never stops the plugin: it is logged, counted in `gpuplace_apiserver_errors_total{op}`, and
//! retried (the loops) or reported to kubelet as `Unavailable` (Allocate).

pub mod assignments;
pub mod claims;
pub mod dra_guard;
pub mod events;
pub mod guard;
pub mod inventory;
pub mod keys;
pub mod node;
pub mod pods;
pub mod slices;
pub mod utilization;

use std::future::Future;
use std::time::Duration;

/// Labels of `gpuplace_apiserver_errors_total`, all exported from the start.
pub const API_OPS: [&str; 15] = [
    "pods_list",
    "pods_watch",
    "pod_patch",
    "node_get",
    "node_patch",
    "node_status_patch",
    "configmap_patch",
    "configmap_create",
    "configmap_get",
    "resourceslices_list",
    "resourceslice_create",
    "resourceslice_replace",
    "resourceslice_delete",
    "resourceclaim_get",
    "pod_evict",
];

/// How long one API call may take. kubelet waits on Allocate, so a hung API server must turn into a
/// clear error quickly rather than a stuck admission; kube's own retries of 503/429 fit inside.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an API call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{op}: {source}")]
    Api {
        op: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("{op}: no answer from the API server within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
}

impl CallError {
    /// The operation, the `op` label of `gpuplace_apiserver_errors_total`.
    pub fn op(&self) -> &'static str {
        match self {
            CallError::Api { op, .. } | CallError::Timeout { op, .. } => op,
        }
    }

    /// The API's HTTP status, when the server answered with one.
    pub fn status(&self) -> Option<u16> {
        match self {
            CallError::Api { source: kube::Error::Api(s), .. } => Some(s.code),
            _ => None,
        }
    }
}

/// Runs one API call under `timeout`, labelling a failure with `op`. kube's client retries 503, 429
/// and 504 itself for more than a minute, so an outage ends here, at the timeout.
pub async fn call<T>(
    op: &'static str,
    timeout: Duration,
    f: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(CallError::Api { op, source }),
        Err(_) => Err(CallError::Timeout { op, timeout }),
    }
}

/// The wait before a reconcile loop's next pass: `resync` after a pass that worked; after a failed
/// one 1 s (at most `resync`), doubling with each failure in a row up to `resync`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    resync: Duration,
    first: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(resync: Duration) -> Self {
        let first = Duration::from_secs(1).min(resync);
        Self { resync, first, next: first }
    }

    /// The wait after a pass that worked (`ok`) or failed.
    pub fn after(&mut self, ok: bool) -> Duration {
        if ok {
            self.next = self.first;
            return self.resync;
        }
        let wait = self.next;
        self.next = (self.next * 2).min(self.resync);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_back_off_from_a_second_to_the_resync_and_a_success_resets() {
        let mut b = Backoff::new(Duration::from_secs(5));
        let waits: Vec<u64> = [false, false, false, false].iter().map(|&ok| b.after(ok).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5]);
        assert_eq!(b.after(true), Duration::from_secs(5));
        assert_eq!(b.after(false), Duration::from_secs(1));
        // a resync under a second bounds the first retry too
        assert_eq!(Backoff::new(Duration::from_millis(300)).after(false), Duration::from_millis(300));
    }
}
