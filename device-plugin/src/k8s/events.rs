//! The Events the device plugin writes (events.k8s.io/v1, `reportingController`
//! `gpuplace.io/device-plugin`, `reportingInstance` the node), so `kubectl describe pod` shows what
//! the plugin did with a pod that the log alone would hide:
//!
//! - `AssignmentSkipped` on a bound pod whose `gpuplace.io/assignment` the plugin will not apply
//!   (corrupt, written for another pod or node, not matching its request): its containers' Allocate
//!   will fail rather than start on GPUs nobody assigned. Once per pod and problem.
//! - `AllocationMismatch` (Warning) on both pods when pod-resources shows that kubelet gave a device
//!   to another pod than the one whose assignment Allocate applied, with other limits
//!   ([`crate::crosscheck`]): that container runs with the other pod's limits.
//! - `AllocationCorrected` (Normal) on both pods when it was one of several pods with the same
//!   limits: the container runs with its own limits, and only the record was corrected.
//!
//! - `MpsServerFault` (Warning) on each pod with an MPS share when a client's fatal fault ended
//!   every client of the MPS server ([`crate::mps`]): their GPU work failed with it.
//!
//! Best effort, as the extender's Events: a failed write is logged, never retried, never fails a call.

use gpuplace_core::api_client::events::EventSink;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{Client, Resource};

use crate::crosscheck::{Limits, Mismatch, MismatchReporter};
use crate::mps::daemon::FaultReporter;

/// `reportingController` of the plugin's Events.
pub const CONTROLLER: &str = "gpuplace.io/device-plugin";
/// Reason of the Event on a pod whose assignment is skipped.
pub const REASON_SKIPPED: &str = "AssignmentSkipped";
/// Reason of the Event on the pods of an allocation mismatch.
pub const REASON_MISMATCH: &str = "AllocationMismatch";
/// Reason of the (informational) Event on the pods whose record a cross-check corrected.
pub const REASON_CORRECTED: &str = "AllocationCorrected";
/// Reason of the Event on the pods with an MPS share when their server was torn down by a fault.
pub const REASON_MPS_FAULT: &str = "MpsServerFault";

/// Writes the plugin's Events. Its methods must be called inside a tokio runtime.
#[derive(Debug, Clone)]
pub struct PluginEvents {
    sink: EventSink,
}

fn pod_ref(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..ObjectReference::default()
    }
}

impl PluginEvents {
    /// `node`: this node's name, the Events' `reportingInstance`.
    pub fn new(client: Client, node: &str) -> Self {
        Self { sink: EventSink::for_controller(client, CONTROLLER, node) }
    }

    /// A Warning Event from the guard ([`crate::guard`]) on a pod named by namespace, name and UID.
    pub fn guard_warn(&self, namespace: &str, name: &str, uid: &str, reason: &'static str, note: &str) {
        let mut object = pod_ref(namespace, name);
        object.uid = Some(uid.into());
        self.sink.warn(object, reason, "Guard", note);
    }

    /// `pod`'s assignment will not be applied, because of `problem`.
    pub fn assignment_skipped(&self, pod: &Pod, problem: &str) {
        let note = format!(
            "{problem}. The pod's gpuplace assignment is not applied: Allocate refuses its GPU containers rather than \
             start them on GPUs the extender did not assign"
        );
        self.sink.warn(pod.object_ref(&()), REASON_SKIPPED, "Allocate", &note);
    }
}

impl FaultReporter for PluginEvents {
    /// `pods`: `namespace/name` of each pod with a share, or `claim:namespace/name` of each DRA
    /// claim (the Event goes on the claim then).
    fn server_fault(&self, pods: &[String], detail: &str) {
        let note = format!(
            "a fatal GPU fault of one MPS client ended every client of the node's MPS server, this pod's included: \
             its GPU work failed with it, not through a fault of its own ({detail})"
        );
        for p in pods {
            let (claim, p) = match p.strip_prefix("claim:") {
                Some(rest) => (true, rest),
                None => (false, p.as_str()),
            };
            let Some((ns, name)) = p.split_once('/') else { continue };
            let mut object = pod_ref(ns, name);
            if claim {
                (object.api_version, object.kind) = (Some("resource.k8s.io/v1".into()), Some("ResourceClaim".into()));
            }
            self.sink.warn(object, REASON_MPS_FAULT, "MpsServer", &note);
        }
    }
}

impl MismatchReporter for PluginEvents {
    fn report(&self, m: &Mismatch) {
        let note = m.to_string();
        let mut pods: Vec<(String, String)> = Vec::new();
        if let Some((ns, name)) = m.granted_to.0.split_once('/') {
            pods.push((ns.into(), name.into()));
        }
        pods.extend(m.held_by.iter().map(|c| (c.namespace.clone(), c.pod.clone())));
        pods.sort();
        pods.dedup();
        for (ns, name) in pods {
            match m.limits {
                Limits::Different => self.sink.warn(pod_ref(&ns, &name), REASON_MISMATCH, "Allocate", &note),
                Limits::Identical => self.sink.normal(pod_ref(&ns, &name), REASON_CORRECTED, "Allocate", &note),
            }
        }
    }
}
