//! Kubernetes Events (events.k8s.io/v1, through kube's `Recorder`) on objects gpuplace has something
//! to say about: annotations the extender or the device plugin refused, a container kubelet started
//! on another pod's grant. `kubectl describe pod` then shows why. Best effort: publishing runs on its
//! own task, and a failure is logged, never retried.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Client;

/// `reportingController` of every Event.
pub const CONTROLLER: &str = "gpuplace.io/extender";
/// Reason of the Event on a pod whose assignment annotation is not trusted.
pub const REASON_ASSIGNMENT: &str = "AssignmentNotTrusted";
/// Reason of the Event on a pod whose assignment annotation was removed or rewritten after gpuplace
/// bound it (its GPUs stay counted from gpuplace's books).
pub const REASON_TAMPERED: &str = "AssignmentTampered";
/// Reason of the Event on a node whose inventory annotation is refused.
pub const REASON_INVENTORY: &str = "InventoryRefused";

/// events.k8s.io/v1 limits `note` to 1 kB.
const MAX_NOTE: usize = 1000;

#[derive(Clone)]
pub struct EventSink {
    recorder: Recorder,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink").finish_non_exhaustive()
    }
}

impl EventSink {
    /// The extender's sink. `instance`: this replica's name (`reportingInstance`).
    pub fn new(client: Client, instance: &str) -> Self {
        Self::for_controller(client, CONTROLLER, instance)
    }

    /// A sink reporting as another component (`reportingController`), e.g. the device plugin.
    pub fn for_controller(client: Client, controller: &str, instance: &str) -> Self {
        let reporter = Reporter { controller: controller.into(), instance: Some(instance.into()) };
        Self { recorder: Recorder::new(client, reporter) }
    }

    /// A Warning on `object`. Must be called inside a tokio runtime.
    pub fn warn(&self, object: ObjectReference, reason: &'static str, action: &'static str, note: &str) {
        self.publish(EventType::Warning, object, reason, action, note);
    }

    /// A Normal (informational) Event on `object`. Must be called inside a tokio runtime.
    pub fn normal(&self, object: ObjectReference, reason: &'static str, action: &'static str, note: &str) {
        self.publish(EventType::Normal, object, reason, action, note);
    }

    fn publish(
        &self,
        type_: EventType,
        object: ObjectReference,
        reason: &'static str,
        action: &'static str,
        note: &str,
    ) {
        let mut note = note.to_string();
        if note.len() > MAX_NOTE {
            let mut cut = MAX_NOTE;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
        }
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            let ev = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
            if let Err(e) = recorder.publish(&ev, &object).await {
                tracing::warn!(error = %e, object = ?object.name, reason, "Event not written");
            }
        });
    }
}
