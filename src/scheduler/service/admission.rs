//! Admission: bind never leaves two pods that the node's device plugin could confuse waiting for
//! their Allocate on the node at once (the rule is `core::admission`; issue 28).
//!
//! kubelet's Allocate does not name the pod, and it may admit the pods bound to a node in any order.
//! So on a node whose device plugin confirms its allocations (the inventory's
//! `confirmsAllocations`: a kubelet calls it, and it marks each Allocate on the pod), a bind whose
//! assignment is confusable with a pod there still awaiting admission waits until that pod is
//! admitted (`gpuplace.io/allocated` confirms each of its GPU containers), at most
//! [`ADMISSION_WAIT`], then sends its Binding. Pods with identical slices are interchangeable and do
//! not wait for each other, and pods on other GPU sets never do: only a pod that would share a GPU set
//! with another pod's different limits waits, for about the time kubelet takes to admit the first
//! (its watch, then Allocate: well under a second on a live node).
//!
//! Why wait in bind rather than keep such GPUs out of filter: filter would send the pod to other
//! GPUs, or other nodes, for a condition that lasts a moment, and the placement (fragmentation,
//! packing) would stay worse for the pod's whole life; bind keeps the placement filter and prioritize
//! chose, and kube-scheduler binds asynchronously, so a waiting bind holds up no other pod's
//! scheduling. Only when the first pod is not admitted within [`ADMISSION_WAIT`] (kubelet down, the
//! plugin restarting) is the bind refused, with a retryable error: the allocation is rolled back and
//! kube-scheduler schedules the pod again after its back-off.
//!
//! Nodes whose plugin does not confirm allocations (no kubelet, as the e2e suite's nodes; an older
//! plugin; `--no-assignments`) never wait: nothing there would ever confirm one.

use super::observe::ObservedPod;
use super::*;
use gpuplace_core::admission::{admitted, confusable};
use gpuplace_core::annotations::AllocatedAnnotation;

/// How long a bind waits for the pods it could be confused with to be admitted. kube-scheduler gives
/// the extender's bind its `httpTimeout` (5 s in the shipped configurations), and the Binding call
/// itself must still fit in it.
pub const ADMISSION_WAIT: Duration = Duration::from_secs(3);

/// How often a waiting bind looks again even without a change announced (a release, say).
const ADMISSION_POLL: Duration = Duration::from_millis(100);

impl Scheduler {
    /// At bind, under the write lock, once `assignment` is counted for pod `uid` on `node`: the pods
    /// awaiting admission there that the plugin could confuse with it (empty where the node's plugin
    /// does not confirm allocations); the pod itself now awaits its own admission.
    pub(super) fn awaiting_confusable(
        st: &mut State,
        node: &str,
        uid: &str,
        assignment: &PodAssignment,
    ) -> Vec<String> {
        let gated = st.cluster.node(node).is_some_and(|n| n.confirms_allocations);
        let waiting = st.awaiting.entry(node.to_string()).or_default();
        let blockers = if gated {
            let bound = &st.bound;
            let cluster = &st.cluster;
            waiting
                .iter()
                .filter(|other| *other != uid)
                .filter(|other| {
                    let held = bound.get(*other).and_then(|b| cluster.assignment(&b.key));
                    held.is_some_and(|a| confusable(assignment, a))
                })
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        waiting.insert(uid.to_string());
        blockers
    }

    /// Pod `uid` no longer awaits admission on `node` (admitted, released, or its bind rolled back).
    pub(super) fn forget_awaiting(st: &mut State, node: &str, uid: &str) -> bool {
        let Some(waiting) = st.awaiting.get_mut(node) else { return false };
        let removed = waiting.remove(uid);
        if waiting.is_empty() {
            st.awaiting.remove(node);
        }
        removed
    }

    /// Tells waiting binds to look again.
    pub(super) fn admissions_changed(&self) {
        self.admissions.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The pod watcher's word on a counted pod's admission: its `gpuplace.io/allocated` marker.
    pub(super) fn observe_admission(&self, pod: &ObservedPod) {
        let Some(node) = pod.node.as_deref() else { return };
        let marker = pod.allocated.as_deref().and_then(|t| AllocatedAnnotation::parse(t).ok());
        let is_admitted = |st: &State| {
            let b = st.bound.get(&pod.uid).filter(|b| b.node == node && b.annotation.is_some())?;
            let a = st.cluster.assignment(&b.key).filter(|a| a.node == node)?;
            Some(admitted(a, &pod.uid, marker.as_ref()))
        };
        {
            // most pod events change nothing here: answered under the read lock
            let st = self.read();
            let waiting = st.awaiting.get(node).is_some_and(|w| w.contains(&pod.uid));
            match is_admitted(&st) {
                None => return,
                Some(done) if done != waiting => return,
                Some(_) => {}
            }
        }
        let mut st = self.write();
        match is_admitted(&st) {
            Some(true) if Self::forget_awaiting(&mut st, node, &pod.uid) => {
                drop(st);
                tracing::debug!(pod = %pod.key, node, "admitted: the device plugin confirmed its GPU containers");
                self.admissions_changed();
            }
            // counted without a marker yet (or one taken back by the plugin's correction)
            Some(false) => {
                st.awaiting.entry(node.to_string()).or_default().insert(pod.uid.clone());
            }
            _ => {}
        }
    }

    /// Waits until none of `blockers` awaits admission on `node` any more (admitted, released, or the
    /// node's plugin no longer confirms allocations), at most [`ADMISSION_WAIT`]. `Err`: the pods
    /// still waiting, for the retryable refusal.
    pub(super) async fn wait_for_admissions(&self, node: &str, mut blockers: Vec<String>) -> Result<(), String> {
        let deadline = Instant::now() + ADMISSION_WAIT;
        let mut changes = self.admissions.subscribe();
        loop {
            {
                let st = self.read();
                let gated = st.cluster.node(node).is_some_and(|n| n.confirms_allocations);
                let waiting = st.awaiting.get(node);
                blockers.retain(|uid| gated && waiting.is_some_and(|w| w.contains(uid)));
                if blockers.is_empty() {
                    return Ok(());
                }
                let now = Instant::now();
                if now >= deadline {
                    let names: Vec<&str> =
                        blockers.iter().filter_map(|u| st.bound.get(u)).map(|b| b.key.as_str()).collect();
                    return Err(names.join(", "));
                }
            }
            let step = deadline.saturating_duration_since(Instant::now()).min(ADMISSION_POLL);
            // a change or the poll: either way the state is read again
            let _ = tokio::time::timeout(step, changes.changed()).await;
        }
    }
}
