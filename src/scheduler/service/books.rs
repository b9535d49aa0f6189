//! The books (`scheduler::books`) on the scheduler's side: which nodes' books are due a write and
//! what they hold, the records a rebuild takes from them, and the records to put back on pods whose
//! annotation was erased or rewritten after gpuplace bound them.

use std::collections::HashMap;

use super::observe::{ObservedPod, PodOutcome};
use super::{BoundPod, Scheduler};
use crate::scheduler::books::{BookEntry, NodeBook};
use crate::scheduler::metrics::ConflictKind;
use gpuplace_core::resources::PodRequest;

/// A record to write back on its pod (a merge patch naming the pod's UID, as re-signing does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutBack {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub assignment: String,
}

/// What a tampered pod's Event says.
pub fn tampered_note(how: &str, node: &str) -> String {
    format!(
        "the pod's gpuplace.io/assignment annotation was {how} after gpuplace bound it to {node}; its GPUs stay \
         counted from gpuplace's books, and the record is written back"
    )
}

impl Scheduler {
    /// The books of the nodes whose records changed since the last call (every node with a record
    /// after a rebuild or [`books_mark_all`](Self::books_mark_all)): each confirmed bind's signed
    /// record, by node; a node left with none gets an empty book. Nothing is due afterwards.
    pub fn books_due(&self) -> Vec<(String, NodeBook)> {
        let st = self.read();
        let Some(due) = st.books.due.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Vec::new();
        };
        let wanted = |node: &str| due.as_ref().is_none_or(|d| d.contains(node));
        let mut books: HashMap<String, NodeBook> = due.iter().flatten().map(|n| (n.clone(), NodeBook::new())).collect();
        for b in st.bound.values().filter(|b| b.confirmed && wanted(&b.node)) {
            if let Some(text) = &b.annotation {
                let entry = BookEntry { pod: b.key.clone(), assignment: text.clone() };
                books.entry(b.node.clone()).or_default().insert(b.uid.clone(), entry);
            }
        }
        let mut books: Vec<_> = books.into_iter().collect();
        books.sort_by(|a, b| a.0.cmp(&b.0));
        books
    }

    /// `node`'s book was not written: due again at the next call.
    pub fn books_retry(&self, node: &str) {
        self.read().books.due.lock().unwrap_or_else(|e| e.into_inner()).mark(node);
    }

    /// Every node's book due (a new leader compares them all with what is written).
    pub fn books_mark_all(&self) {
        self.read().books.due.lock().unwrap_or_else(|e| e.into_inner()).mark_all();
    }

    /// Whether `text` is a record gpuplace would count for the pod (its MAC, its node, its request),
    /// leaving collisions aside: at a rebuild, an annotation that is not is replaced by the books'.
    pub fn assignment_trusted(&self, text: &str, uid: &str, node: &str, request: &PodRequest) -> bool {
        let st = self.read();
        let keys = self.key_ring();
        self.checked_assignment(&st.cluster, keys.as_deref(), text, uid, node, request).is_ok()
    }

    /// At a rebuild: pod `uid` was counted from the books because its annotation was missing or not
    /// trusted (`now`: what it carries instead). Counted as a conflict, and its record goes back on
    /// the pod. False if it was not counted after all (it collided with another record).
    pub fn note_tampered(&self, uid: &str, now: Option<&str>) -> bool {
        let mut st = self.write();
        let Some(node) = st.bound.get(uid).map(|b| b.node.clone()) else {
            return false;
        };
        st.books.tampered.insert(uid.to_string());
        // reported here: the watch's view of the same annotation is not news
        if let Some(text) = now {
            st.refused.insert(uid.to_string(), (text.to_string(), Some(node)));
        }
        drop(st);
        self.metrics.conflict(ConflictKind::TamperedAssignment);
        true
    }

    /// A counted pod whose annotation is gone: what it holds stays counted.
    pub(super) fn erased(b: &BoundPod, pod: &ObservedPod) -> bool {
        b.confirmed && b.annotation.is_some() && pod.annotation.is_none() && pod.node.as_deref() == Some(&b.node)
    }

    /// The watch shows a counted pod without its annotation: reported once, the record put back.
    pub(super) fn erased_after_bind(&self, pod: &ObservedPod) -> PodOutcome {
        let mut st = self.write();
        let Some(node) = st.bound.get(&pod.uid).filter(|b| Self::erased(b, pod)).map(|b| b.node.clone()) else {
            return PodOutcome::Known;
        };
        if !st.books.tampered.insert(pod.uid.clone()) {
            return PodOutcome::Known;
        }
        drop(st);
        self.metrics.conflict(ConflictKind::TamperedAssignment);
        tracing::warn!(pod = %pod.key, uid = %pod.uid, node = %node, "assignment annotation removed from a counted pod; its GPUs stay counted");
        PodOutcome::Tampered(tampered_note("removed", &node))
    }

    /// Up to `limit` records to write back on their pods, in pod order.
    pub fn records_to_put_back(&self, limit: usize) -> Vec<PutBack> {
        let st = self.read();
        let mut out: Vec<PutBack> = st
            .books
            .tampered
            .iter()
            .filter_map(|uid| {
                let b = st.bound.get(uid).filter(|b| b.confirmed)?;
                let (namespace, name) = b.key.split_once('/')?;
                Some(PutBack {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    uid: uid.clone(),
                    assignment: b.annotation.clone()?,
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        out.truncate(limit);
        out
    }

    /// `p`'s record is on its pod again (or the pod is gone): no longer to put back.
    pub fn put_back(&self, p: &PutBack) {
        let mut st = self.write();
        st.books.tampered.remove(&p.uid);
        // the echo of the write is the record itself: not a change to refuse
        st.refused.remove(&p.uid);
    }
}
