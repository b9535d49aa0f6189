//! Key rotation without losing records: the leader writes every counted assignment whose MAC is
//! not the primary key's (or that is unsigned, taken under `--accept-unsigned-assignments`) again,
//! signed with the primary key, so that an old key can leave the Secret once
//! `gpuplace_assignments_signed_with_old_key` is 0.
//!
//! Only the ready leader writes (ready implies the key ring is loaded and the state rebuilt). Each
//! write is a merge patch of the annotation naming the pod's UID, which the registry checks as a
//! precondition (as the binder's), so a pod deleted and created again under the same name is never
//! given another pod's record. The record itself never changes, only `sig`: the replicas' watches
//! take the new value as the same record (`Scheduler::observe_pod`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;

use crate::k8s::keys::KeyStatus;
use crate::k8s::leader::Leadership;
use crate::scheduler::service::trust::Resign;
use crate::scheduler::Scheduler;
use gpuplace_core::annotations::ANNOTATION_ASSIGNMENT;

/// Records written per pass; the rest wait for the next pass, so a rotation over many pods does not
/// flood the API server.
pub const RESIGN_BATCH: usize = 200;

/// What writing an assignment on its pod came to.
pub enum AssignmentWrite {
    Written,
    /// The pod is gone, or another pod has its name now (the UID precondition failed): its record is
    /// released by the watch. The API status code.
    Gone(u16),
    Failed(kube::Error),
}

/// Writes `text` as the assignment of pod `namespace/name`: a merge patch of the annotation naming
/// the pod's UID, which the registry checks as a precondition. Shared with the books' write-back.
pub async fn write_assignment(client: &Client, namespace: &str, name: &str, uid: &str, text: &str) -> AssignmentWrite {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let patch = json!({"metadata": {"uid": uid, "annotations": {ANNOTATION_ASSIGNMENT: text}}});
    match pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => AssignmentWrite::Written,
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => AssignmentWrite::Gone(s.code),
        Err(e) => AssignmentWrite::Failed(e),
    }
}

/// Signs one record again on its pod; whether it was written.
async fn resign_one(client: &Client, ext: &Scheduler, r: &Resign) -> bool {
    match write_assignment(client, &r.namespace, &r.name, &r.uid, &r.new).await {
        AssignmentWrite::Written => {
            ext.resigned(r);
            true
        }
        AssignmentWrite::Gone(code) => {
            tracing::debug!(pod = %r.name, namespace = %r.namespace, code, "pod changed before its assignment was re-signed");
            false
        }
        AssignmentWrite::Failed(e) => {
            tracing::warn!(pod = %r.name, namespace = %r.namespace, error = %e, "re-signing the assignment failed; retried next pass");
            false
        }
    }
}

/// One pass: up to [`RESIGN_BATCH`] records, while this replica is the ready leader. Returns how
/// many were written.
pub async fn resign_pass(client: &Client, ext: &Scheduler, leadership: &Leadership) -> usize {
    let mut written = 0;
    for r in ext.assignments_to_resign(RESIGN_BATCH) {
        if !(ext.is_ready() && leadership.is_leader()) {
            break;
        }
        if resign_one(client, ext, &r).await {
            written += 1;
        }
    }
    if written > 0 {
        let primary = ext.key_ring().map(|k| k.primary().to_string()).unwrap_or_default();
        tracing::info!(written, primary = %primary, "assignments re-signed with the primary key");
    }
    written
}

/// Runs forever: a pass every `every`, and right after the key ring changes.
pub async fn run(
    client: Client,
    ext: Arc<Scheduler>,
    leadership: Arc<Leadership>,
    mut keys: watch::Receiver<KeyStatus>,
    every: Duration,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            changed = keys.changed() => {
                if changed.is_err() {
                    // the key watcher is gone: nothing will change the ring again, passes still help
                    tokio::time::sleep(every).await;
                }
            }
        }
        if ext.is_ready() && leadership.is_leader() {
            resign_pass(&client, &ext, &leadership).await;
        }
    }
}
