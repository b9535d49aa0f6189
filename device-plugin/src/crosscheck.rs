//! After admission, kubelet's word against the plugin's: pod-resources names the container that holds
//! each device ID, and Allocate recorded whose assignment it applied to the devices it was sent. When
//! the two name different pods, the plugin's record named the wrong pod:
//!
//! - **identical limits** (the holder's container on those GPUs was assigned the same slices): the
//!   expected outcome of a match among interchangeable pods (`core::admission`); the container runs
//!   with its own limits. Only the record is corrected: informational.
//! - **different limits**, or a holder without a valid assignment: the container runs with another
//!   pod's memory and compute limits. Matching refuses every Allocate where that could happen, so
//!   this means something else allocates the node's devices; it cannot be undone from here, so it is
//!   made loud: a log error, `gpuplace_allocation_mismatches_total`, and a Warning Event on both pods.
//!
//! In both cases the plugin then corrects `gpuplace.io/allocated` (the holder's container marked, the
//! other pod's unmarked when it holds nothing) and its grant records (`crate::plugin`).
//!
//! Only pods are compared, not containers: kubelet hands an init container's devices on to the app
//! containers of the same pod, so pod-resources may name another container of the pod that was granted.

use std::collections::{BTreeMap, BTreeSet};

use gpuplace_core::admission::{admission_order, gpu_set, sorted_slices};
use gpuplace_core::assignment::GpuSlice;

use crate::assign::PendingPod;
use crate::podresources::ContainerRef;

/// A container's grants, keyed by `namespace/pod` and container name: what pod-resources reports.
pub type GrantKey = (String, String);

/// How the limits Allocate applied compare with what the device's holder was assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limits {
    /// Other limits, or a holder whose assignment is not known: it runs with another pod's limits.
    Different,
    /// The holder's container on those GPUs was assigned the same slices: it runs with its own.
    Identical,
}

/// A device that Allocate granted as one pod's assignment and kubelet gave to another pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub device: String,
    /// Whose assignment Allocate applied (`namespace/pod`, container).
    pub granted_to: GrantKey,
    /// Who holds the device, as pod-resources says (none of them in the granted pod).
    pub held_by: Vec<ContainerRef>,
    pub limits: Limits,
}

impl Mismatch {
    /// The `namespace/pod/container` names of the holders.
    fn holders(&self) -> String {
        let held: Vec<String> =
            self.held_by.iter().map(|c| format!("{}/{}/{}", c.namespace, c.pod, c.container)).collect();
        held.join(", ")
    }
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pod, container) = (&self.granted_to.0, &self.granted_to.1);
        match self.limits {
            Limits::Different => write!(
                f,
                "device {} was allocated with the gpuplace assignment of {pod}/{container}, but kubelet gave it to {}: that \
                 container runs with the other pod's GPU memory and compute limits; delete it to be admitted again",
                self.device,
                self.holders()
            ),
            Limits::Identical => write!(
                f,
                "device {} was matched to {pod}/{container} among pods waiting with the same limits, and kubelet gave it \
                 to {}: the container runs with its own pod's limits; gpuplace.io/allocated corrected, nothing to do",
                self.device,
                self.holders()
            ),
        }
    }
}

/// The one pod holding every mismatched device of a grant, by the container pod-resources names
/// first; `None` when several pods hold them (then nothing is corrected, only reported).
pub fn sole_holder(mismatches: &[Mismatch]) -> Option<&ContainerRef> {
    let first = mismatches.first()?.held_by.first()?;
    let same_pod = |c: &ContainerRef| c.namespace == first.namespace && c.pod == first.pod;
    mismatches.iter().all(|m| m.held_by.iter().all(same_pod)).then_some(first)
}

/// The container of the holder's assignment that got the grant's devices (`limits`: the slices
/// Allocate applied, sorted by GPU), and how its own limits compare. The one pod-resources names
/// when it has those GPUs (it may name an app container that inherited an init container's
/// devices); else one on those GPUs with the same slices; else any on those GPUs.
pub fn holder_container(
    limits: &[GpuSlice],
    holder: &ContainerRef,
    assigned: Option<&PendingPod>,
) -> (Option<String>, Limits) {
    let Some(p) = assigned else { return (None, Limits::Different) };
    let mut gpus: Vec<u32> = limits.iter().map(|s| s.gpu).collect();
    gpus.dedup();
    let on_gpus: Vec<_> = admission_order(&p.assignment).filter(|c| gpu_set(c) == gpus).collect();
    let named = on_gpus.iter().find(|c| c.name == holder.container && sorted_slices(c) == limits);
    let chosen = named
        .or_else(|| on_gpus.iter().find(|c| sorted_slices(c) == limits))
        .or_else(|| on_gpus.iter().find(|c| c.name == holder.container))
        .or_else(|| on_gpus.first());
    match chosen {
        Some(c) if sorted_slices(c) == limits => (Some(c.name.clone()), Limits::Identical),
        Some(c) => (Some(c.name.clone()), Limits::Different),
        None => (None, Limits::Different),
    }
}

/// What one grant says and what pod-resources shows for its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not every device is listed yet (the container is still being admitted, or gone).
    Unseen,
    /// Every device is held by the granted pod.
    Confirmed,
    /// These devices are held by other pods.
    Mismatched(Vec<Mismatch>),
}

/// Compares one grant (`key` over `devices`) with pod-resources' holders of each device ID.
pub fn check_grant(
    key: &GrantKey,
    devices: &BTreeSet<String>,
    holders: &BTreeMap<String, BTreeSet<ContainerRef>>,
) -> Verdict {
    let mut mismatches = Vec::new();
    for device in devices {
        let Some(held) = holders.get(device).filter(|h| !h.is_empty()) else { return Verdict::Unseen };
        if !held.iter().any(|c| c.grant_key().0 == key.0) {
            mismatches.push(Mismatch {
                device: device.clone(),
                granted_to: key.clone(),
                held_by: held.iter().cloned().collect(),
                limits: Limits::Different,
            });
        }
    }
    if mismatches.is_empty() {
        Verdict::Confirmed
    } else {
        Verdict::Mismatched(mismatches)
    }
}

/// Where mismatches go besides the log and the metric (Events, in the binary).
pub trait MismatchReporter: Send + Sync {
    fn report(&self, m: &Mismatch);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(pod: &str, container: &str) -> ContainerRef {
        ContainerRef { namespace: "ml".into(), pod: pod.into(), container: container.into() }
    }

    fn key(pod: &str, container: &str) -> GrantKey {
        (format!("ml/{pod}"), container.into())
    }

    #[test]
    fn a_device_held_by_another_pod_is_a_mismatch_and_the_same_pod_is_not() {
        let devices: BTreeSet<String> = ["GPU-a::0".to_string(), "GPU-b::0".to_string()].into();
        let mut holders: BTreeMap<String, BTreeSet<ContainerRef>> = BTreeMap::new();
        // only one device listed so far: nothing to say yet
        holders.insert("GPU-a::0".into(), [who("a", "main")].into());
        assert_eq!(check_grant(&key("a", "main"), &devices, &holders), Verdict::Unseen);
        // an init container's devices show under the app container of the same pod
        holders.insert("GPU-b::0".into(), [who("a", "main")].into());
        assert_eq!(check_grant(&key("a", "init"), &devices, &holders), Verdict::Confirmed);
        // pod b holds what was granted as a's
        holders.insert("GPU-b::0".into(), [who("b", "main")].into());
        let Verdict::Mismatched(m) = check_grant(&key("a", "main"), &devices, &holders) else { panic!() };
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].device.as_str(), &m[0].held_by[..]), ("GPU-b::0", &[who("b", "main")][..]));
        let text = m[0].to_string();
        assert!(text.contains("assignment of ml/a/main, but kubelet gave it to ml/b/main"), "{text}");
        assert_eq!(sole_holder(&m), Some(&who("b", "main")));
    }

    #[test]
    fn the_holders_own_assignment_decides_whether_the_limits_were_right() {
        use crate::assign::{pending_pod, share};
        let granted = vec![share(1, 4096, 40)];
        let twin = pending_pod("ml/b", 2, &[("worker", false, vec![share(1, 4096, 40)])]);
        let other = pending_pod("ml/b", 2, &[("worker", false, vec![share(1, 2048, 20)])]);
        let holder = who("b", "worker");
        assert_eq!(holder_container(&granted, &holder, Some(&twin)), (Some("worker".into()), Limits::Identical));
        assert_eq!(holder_container(&granted, &holder, Some(&other)), (Some("worker".into()), Limits::Different));
        // a holder gpuplace assigned nothing (or whose assignment is skipped): its limits are unknown
        assert_eq!(holder_container(&granted, &holder, None), (None, Limits::Different));
        // pod-resources names the app container that inherited the init container's devices
        let init = pending_pod(
            "ml/b",
            2,
            &[("app", false, vec![share(1, 8192, 40)]), ("warm", true, vec![share(1, 4096, 40)])],
        );
        assert_eq!(holder_container(&granted, &who("b", "app"), Some(&init)), (Some("warm".into()), Limits::Identical));
        // the informational text says so, and gives no "delete it" advice
        let m = Mismatch {
            device: "GPU-a::0".into(),
            granted_to: key("a", "main"),
            held_by: vec![holder],
            limits: Limits::Identical,
        };
        let text = m.to_string();
        assert!(text.contains("runs with its own pod's limits") && !text.contains("delete"), "{text}");
        // several pods hold the grant's devices: nothing to correct from
        let mut two = m.clone();
        two.held_by.push(who("c", "main"));
        assert_eq!(sole_holder(&[two]), None);
    }
}
