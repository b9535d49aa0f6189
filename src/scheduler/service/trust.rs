//! Which assignments the extender trusts, and the keys behind that: the MAC check that every
//! assignment it did not write in this process passes before it is validated and counted, the key
//! ring bind signs with, and the re-signing of records made with a key that is no longer primary.
//! The MAC itself (message, format, key ring) is `gpuplace_core::signing`; the Secret the ring comes
//! from is `src/k8s/keys.rs`.

use std::sync::Arc;

use super::observe::PodOutcome;
use super::{Scheduler, State};
use gpuplace_core::annotations::SignatureProblem;
use gpuplace_core::annotations::{AnnotationError, AssignmentAnnotation};
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::PodRequest;
use gpuplace_core::signing::{KeyId, KeyRing};

/// A counted record to write again, signed with the primary key (the leader's part of a rotation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resign {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The annotation as counted now.
    pub old: String,
    /// The same record, signed with the primary key.
    pub new: String,
    /// That primary key's id.
    pub signed_by: KeyId,
}

impl Scheduler {
    /// [`set_key_ring`](Self::set_key_ring), as a builder.
    pub fn with_key_ring(self, keys: KeyRing) -> Self {
        self.set_key_ring(keys);
        self
    }

    /// Installs the ring that signs from now on and verifies what is read from now on (the shared
    /// one from the Secret, or a rotation of it). Records already counted stay counted: each was
    /// verified, or written by this process, when it was counted.
    pub fn set_key_ring(&self, keys: KeyRing) {
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(keys));
    }

    /// The ring in use.
    pub fn key_ring(&self) -> Option<Arc<KeyRing>> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether an assignment read from `pod` may go on to validation: it carries a MAC of one of
    /// the ring's keys (whose id is returned), or it is unsigned and unsigned ones are accepted for
    /// the migration (`None`, logged loudly every time).
    pub(super) fn trusted(
        &self,
        keys: Option<&KeyRing>,
        a: &AssignmentAnnotation,
        pod: &str,
    ) -> Result<Option<KeyId>, AnnotationError> {
        let keys = keys.ok_or(AnnotationError::NotSigned(SignatureProblem::NoKeys))?;
        let signer = a.trust(keys, self.accept_unsigned)?;
        if signer.is_none() {
            tracing::warn!(
                pod,
                "UNSIGNED assignment trusted because --accept-unsigned-assignments is set; the leader re-signs it, then drop the flag"
            );
        }
        Ok(signer)
    }

    /// An assignment read from a pod (not written by this process) as the record to count: it must
    /// be [`trusted`](Self::trusted) and validate against the pod's UID, the node it is bound to and
    /// that node's GPUs. Returns the record, its bind sequence and the id of the key that signed it.
    pub(super) fn checked_assignment(
        &self,
        cluster: &Cluster,
        keys: Option<&KeyRing>,
        text: &str,
        uid: &str,
        bound_node: &str,
        request: &PodRequest,
    ) -> Result<(PodAssignment, u64, Option<KeyId>), AnnotationError> {
        let a = AssignmentAnnotation::parse(text)?;
        let signed_by = self.trusted(keys, &a, &request.key)?;
        let node = cluster.node(bound_node).ok_or_else(|| AnnotationError::WrongNode {
            annotated: a.node.clone(),
            bound: format!("{bound_node} (not a known GPU node)"),
        })?;
        Ok((a.validate(uid, bound_node, request, node)?, a.bind_seq, signed_by))
    }

    /// Counted records whose MAC is not the primary key's, or that are unsigned.
    pub(super) fn signed_with_old_key(&self, st: &State) -> u64 {
        let primary = self.key_ring().map(|k| k.primary().to_string());
        st.bound.values().filter(|b| b.annotation.is_some() && b.signed_by != primary).count() as u64
    }

    /// Up to `limit` counted records (bind confirmed) not signed with the primary key, each signed
    /// again with it, in pod order. The record itself is unchanged: only `sig` differs.
    pub fn assignments_to_resign(&self, limit: usize) -> Vec<Resign> {
        let Some(keys) = self.key_ring() else { return Vec::new() };
        let st = self.read();
        let mut stale: Vec<_> = st
            .bound
            .values()
            .filter(|b| b.confirmed && b.annotation.is_some() && b.signed_by.as_deref() != Some(keys.primary()))
            .collect();
        stale.sort_by(|a, b| a.key.cmp(&b.key));
        stale
            .into_iter()
            .filter_map(|b| {
                let old = b.annotation.clone()?;
                let a = AssignmentAnnotation::parse(&old).ok()?;
                let (namespace, name) = b.key.split_once('/')?;
                Some(Resign {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    uid: b.uid.clone(),
                    new: a.signed(&keys).to_json(),
                    signed_by: keys.primary().to_string(),
                    old,
                })
            })
            .take(limit)
            .collect()
    }

    /// `r.new` is on the pod now: the record carries it (so the watch echo matches). False when the
    /// record changed or went meanwhile.
    pub fn resigned(&self, r: &Resign) -> bool {
        let mut st = self.write();
        match st.bound.get_mut(&r.uid) {
            Some(b) if b.annotation.as_deref() == Some(r.old.as_str()) => {
                b.signed_by = Some(r.signed_by.clone());
                b.annotation = Some(r.new.clone());
                let node = b.node.clone();
                st.books.mark(&node);
                true
            }
            _ => false,
        }
    }

    /// A counted pod's annotation changed to `text`. When that is the same record with a MAC of
    /// the ring (the leader signed it again after a rotation) the record takes it; when the MAC
    /// names a key this replica has not loaded yet (the Secret's change is on its way) the record
    /// stays as it is, unreported, and the next update of the pod tries again. Either way `Known`:
    /// what is counted does not change. `None`: a change after bind, for the caller to refuse.
    pub(super) fn resigned_copy(&self, st: &mut State, uid: &str, text: &str) -> Option<PodOutcome> {
        let keys = self.key_ring()?;
        let b = st.bound.get_mut(uid)?;
        let old = AssignmentAnnotation::parse(b.annotation.as_deref()?).ok()?;
        let new = AssignmentAnnotation::parse(text).ok().filter(|new| new.same_record(&old))?;
        // verified, not `trust`ed: a counted record never goes back to unsigned
        match new.verify(keys.as_ref()) {
            Ok(id) => {
                b.annotation = Some(text.to_string());
                b.signed_by = Some(id);
                let node = b.node.clone();
                st.books.mark(&node);
                Some(PodOutcome::Known)
            }
            Err(AnnotationError::NotSigned(SignatureProblem::UnknownKey(id))) => {
                tracing::debug!(uid, key = %id, "assignment signed again with a key not loaded yet; kept as counted");
                Some(PodOutcome::Known)
            }
            Err(_) => None,
        }
    }
}
