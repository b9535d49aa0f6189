//! After admission, kubelet's word against the plugin's: pod-resources names the container that holds
//! each device ID, and Allocate recorded whose assignment it applied to the devices it was sent. When
//! the two name different pods, a container runs with another pod's memory and compute limits (two
//! pods waiting for the same GPUs with different slices, admitted out of bind order: the one case
//! matching cannot tell apart, docs/device-plugin.md). It cannot be undone from here, so it is made
//! loud: a log error, `gpuplace_allocation_mismatches_total`, and an Event on both pods.
//!
//! Only pods are compared, not containers: kubelet hands an init container's devices on to the app
//! containers of the same pod, so pod-resources may name another container of the pod that was granted.

use std::collections::{BTreeMap, BTreeSet};

use crate::podresources::ContainerRef;

/// A container's grants, keyed by `namespace/pod` and container name: what pod-resources reports.
pub type GrantKey = (String, String);

/// A device that Allocate granted as one pod's assignment and kubelet gave to another pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub device: String,
    /// Whose assignment Allocate applied (`namespace/pod`, container).
    pub granted_to: GrantKey,
    /// Who holds the device, as pod-resources says (none of them in the granted pod).
    pub held_by: Vec<ContainerRef>,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held: Vec<String> =
            self.held_by.iter().map(|c| format!("{}/{}/{}", c.namespace, c.pod, c.container)).collect();
        write!(
            f,
            "device {} was allocated with the gpuplace assignment of {}/{}, but kubelet gave it to {}: that container \
             runs with the other pod's GPU memory and compute limits; delete it to be admitted again",
            self.device,
            self.granted_to.0,
            self.granted_to.1,
            held.join(", ")
        )
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
    }
}
