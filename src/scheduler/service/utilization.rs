//! Live utilization samples, from either source, through one code path.
//!
//! - The device plugin's per-node ConfigMap (`gpuplace_core::utilization_configmap`), watched in
//!   API-server mode: [`Scheduler::observe_utilization`] and [`Scheduler::forget_utilization`]. Its
//!   text is kept per node even while the node is unknown, and applied again whenever the node's
//!   GPUs are (re)defined, so the order in which the two watches deliver does not matter.
//! - The deprecated `gpuplace.io/utilization` Node annotation (older device plugins; full-Nodes
//!   requests; the node watcher): applied only while the node has no ConfigMap, so a stale annotation
//!   an older plugin left behind never overwrites fresher samples.
//!
//! Either way a value is parsed once per distinct text, and samples land on the node's GPUs by UUID
//! ([`UtilizationAnnotation::apply_to`]); their age is judged by the scorer, not here.

use super::{Scheduler, State};
use gpuplace_core::annotations::UtilizationAnnotation;

/// What [`Scheduler::observe_utilization`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UtilizationOutcome {
    /// The samples are on the node's GPUs now.
    Applied,
    /// The same text was applied already.
    Unchanged,
    /// The node is not known yet: kept, and applied when it appears.
    Pending,
    /// Not a valid utilization value (logged; the node's samples stay as they were), with why.
    Refused(String),
}

impl Scheduler {
    /// The utilization ConfigMap watcher's entry point: `text` is the current value for `node`.
    pub fn observe_utilization(&self, node: &str, text: &str) -> UtilizationOutcome {
        {
            // an unchanged ConfigMap (a re-list, a label edit) costs a read lock only
            let st = self.read();
            if st.util_published.get(node).is_some_and(|t| t == text) {
                if st.util_sources.get(node).is_some_and(|t| t == text) {
                    return UtilizationOutcome::Unchanged;
                }
                if st.cluster.node(node).is_none() {
                    return UtilizationOutcome::Pending;
                }
            }
        }
        let mut st = self.write();
        st.util_published.insert(node.to_string(), text.to_string());
        self.apply_utilization_locked(&mut st, node, text)
    }

    /// The utilization ConfigMap of `node` is gone: its samples are dropped (a later Node annotation,
    /// if an older plugin writes one, applies again). Returns whether the node had a ConfigMap.
    pub fn forget_utilization(&self, node: &str) -> bool {
        if !self.read().util_published.contains_key(node) {
            return false;
        }
        let mut st = self.write();
        let st = &mut *st;
        if st.util_published.remove(node).is_none() {
            return false;
        }
        st.util_sources.remove(node);
        if let Some(mut n) = st.cluster.node_mut(node) {
            for gpu in 0..n.gpus.len() {
                n.set_utilization(gpu, None);
            }
        }
        tracing::info!(node, "utilization ConfigMap gone; the node's samples dropped");
        true
    }

    /// The deprecated Node annotation's value for `name`: applied unless the node has a ConfigMap.
    pub(super) fn observe_annotation_utilization_locked(&self, st: &mut State, name: &str, text: &str) {
        if !st.util_published.contains_key(name) {
            self.apply_utilization_locked(st, name, text);
        }
    }

    /// Whether the node annotation's value would be applied (for the read-locked fast paths).
    pub(super) fn annotation_utilization_pending(st: &State, name: &str, text: &str) -> bool {
        !st.util_published.contains_key(name) && st.util_sources.get(name).is_none_or(|t| t != text)
    }

    /// The node's GPUs were just (re)defined, without samples: its ConfigMap's value applies again.
    pub(super) fn utilization_redefined_locked(&self, st: &mut State, name: &str) {
        st.util_sources.remove(name);
        if let Some(text) = st.util_published.get(name).cloned() {
            self.apply_utilization_locked(st, name, &text);
        }
    }

    /// The one code path: parse `text` (once per distinct text) and put its samples on the node.
    fn apply_utilization_locked(&self, st: &mut State, name: &str, text: &str) -> UtilizationOutcome {
        if st.util_sources.get(name).is_some_and(|t| t == text) {
            return UtilizationOutcome::Unchanged;
        }
        match (UtilizationAnnotation::parse(text), st.cluster.node_mut(name)) {
            (Ok(u), Some(mut node)) => {
                for problem in u.apply_to(&mut node) {
                    tracing::debug!(node = %name, %problem, "utilization sample skipped");
                }
                st.util_sources.insert(name.to_string(), text.to_string());
                UtilizationOutcome::Applied
            }
            // not remembered as applied: it applies when the node appears
            (Ok(_), None) => UtilizationOutcome::Pending,
            (Err(e), _) => {
                tracing::warn!(node = %name, error = %e, "utilization value refused; ignored");
                // remembered, so an unchanged bad value is reported once
                st.util_sources.insert(name.to_string(), text.to_string());
                UtilizationOutcome::Refused(e.to_string())
            }
        }
    }
}
