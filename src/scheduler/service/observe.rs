//! What the API-server watchers tell the extender, and what of it is trusted.
//!
//! The watchers (`src/k8s/nodes.rs`, `pods.rs`) only translate objects; every decision is
//! here, next to the state it changes:
//!
//! - Nodes: the inventory annotation (re)defines a node, unchanged objects cost a read lock only; a
//!   refused inventory leaves the node as it was. A deleted node (or one whose inventory annotation
//!   went away) leaves the model, and its pods' allocations are *parked*, not dropped: Kubernetes
//!   deletes pods of a deleted node (pod GC), which releases them, but a node deleted and registered
//!   again keeps its running pods, whose GPUs must count again. Its deprecated utilization
//!   annotation goes through the `utilization` submodule, as the utilization ConfigMaps do.
//! - Pods: a bound pod whose assignment annotation carries gpuplace's MAC (the `trust` submodule),
//!   validates against its own request, its node and that node's GPUs, and fits next to what is
//!   already counted, is counted once. First counted wins: a later pod claiming GPUs that are taken
//!   is refused, never the pod already counted. The watch echo of a bind this process made matches
//!   its record (same UID) and changes nothing; so does the same record signed again (a rotation).
//!   Finished (`Succeeded`/`Failed`) and deleted pods are released.
//! - An assignment on a pod that is not bound is never counted. While watching it is not reported
//!   either: every bind shows it for a moment (the annotation is written before the Binding, by this
//!   replica or by the leader). At a rebuild, where no bind is in flight, it is reported
//!   ([`Scheduler::refuse_unbound`]).
//! - Refusals are logged and counted once per pod, annotation text and node, and returned so that
//!   the caller raises a Kubernetes Event on the pod.

use gpuplace_core::node_constraints::NodeConstraints;
use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use super::{BoundPod, Scheduler, SeenPod, State};
use crate::scheduler::input::PodView;
use crate::scheduler::metrics::ConflictKind;
use crate::scheduler::requeue::RequeuePod;
use gpuplace_core::annotations::{
    NodeInventory, ANNOTATION_ALLOCATED, ANNOTATION_ASSIGNMENT, ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use gpuplace_core::resources::PodRequest;

/// A pod as the pod watcher saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedPod {
    /// `namespace/name`.
    pub key: String,
    pub uid: String,
    /// `spec.nodeName`, when bound.
    pub node: Option<String>,
    /// `Succeeded` or `Failed`.
    pub finished: bool,
    /// The request, or the contract's refusal.
    pub request: Result<PodRequest, String>,
    /// The `gpuplace.io/assignment` value.
    pub annotation: Option<String>,
    /// The device plugin's `gpuplace.io/allocated` value: which GPU containers it has admitted.
    pub allocated: Option<String>,
    /// Its `nodeSelector`, required node affinity and tolerations, which bind checks: read for a GPU
    /// pod not bound yet only (none for any other).
    pub constraints: Result<NodeConstraints, String>,
}

impl ObservedPod {
    pub fn of(pod: &dyn PodView) -> Self {
        let node = Some(pod.node_name()).filter(|n| !n.is_empty()).map(str::to_string);
        let request = pod.request();
        // only a GPU pod not bound yet is remembered for bind (`remember`), which alone reads the
        // constraints: the events of bound and GPU-free pods, most of a busy cluster's, skip the parse
        let for_bind = node.is_none() && !request.as_ref().is_ok_and(PodRequest::is_gpu_free);
        Self {
            key: pod.key(),
            uid: pod.uid().to_string(),
            node,
            finished: pod.is_finished(),
            request,
            annotation: pod.annotation(ANNOTATION_ASSIGNMENT).map(str::to_string),
            allocated: pod.annotation(ANNOTATION_ALLOCATED).map(str::to_string),
            constraints: if for_bind { pod.node_constraints() } else { Ok(NodeConstraints::default()) },
        }
    }

    /// Neither asks for gpuplace resources nor carries an assignment: nothing to do unless it holds
    /// a record (a GPU-free pod gpuplace bound).
    pub fn is_foreign(&self) -> bool {
        self.annotation.is_none() && self.request.as_ref().is_ok_and(PodRequest::is_gpu_free)
    }
}

/// What [`Scheduler::observe_pod`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodOutcome {
    /// Nothing gpuplace tracks (or a refusal already reported).
    Ignored,
    /// Not bound yet: remembered for bind.
    Pending,
    /// A trusted assignment, now counted.
    Counted,
    /// Already counted (the echo of this process's bind, or a pod seen before).
    Known,
    /// Finished: its GPUs were given back.
    Released,
    /// An assignment that is not trusted (not counted), with why; reported once per annotation text.
    Refused(String),
    /// A counted pod's assignment annotation was removed: its GPUs stay counted (and the leader
    /// writes the record back), with what to tell; reported once until the record is back.
    Tampered(String),
}

/// What [`Scheduler::observe_node`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeOutcome {
    /// No inventory annotation, and not a known node.
    NotGpu,
    /// Nothing gpuplace reads changed (utilization may have been applied).
    Unchanged,
    /// Added or replaced, with this many GPUs.
    Upserted { gpus: usize },
    /// The inventory annotation was refused (the node stays as it was), with why.
    Refused(String),
    /// Its inventory annotation went away: removed, with this many allocations parked.
    Removed { parked: usize },
}

impl Scheduler {
    /// The node watcher's entry point for an added or changed Node object.
    pub fn observe_node(
        &self,
        name: &str,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) -> NodeOutcome {
        let Some(text) = annotations.get(ANNOTATION_INVENTORY) else {
            return self.observe_plain_node(name, labels);
        };
        let utilization = annotations.get(ANNOTATION_UTILIZATION);
        {
            // most Node updates are status heartbeats: answered under the read lock
            let st = self.read();
            let known = st.cluster.node(name).is_some();
            let same_inventory = st.node_sources.get(name).is_some_and(|(t, l)| t == text && l == labels);
            let same_util = utilization.is_none_or(|u| !known || !Self::annotation_utilization_pending(&st, name, u));
            if same_inventory && same_util {
                return NodeOutcome::Unchanged;
            }
        }
        let mut st = self.write();
        let st = &mut *st;
        let mut outcome = NodeOutcome::Unchanged;
        let changed = st.node_sources.get(name).is_none_or(|(t, l)| t != text || l != labels);
        if changed {
            st.node_sources.insert(name.to_string(), (text.clone(), labels.clone()));
            match NodeInventory::parse(text).and_then(|inv| inv.to_node(name, labels.clone())) {
                Ok(node) => {
                    let gpus = node.gpus.len();
                    tracing::info!(node = %name, gpus, "node inventory taken from the Node object");
                    self.upsert_locked(st, node);
                    // a new Node value starts without samples: the current ones apply again (the
                    // ConfigMap's here, the annotation's below)
                    self.utilization_redefined_locked(st, name);
                    outcome = NodeOutcome::Upserted { gpus };
                }
                Err(e) => {
                    self.metrics.conflict(ConflictKind::BadInventory);
                    tracing::warn!(node = %name, error = %e, "inventory annotation refused; the node stays as it was");
                    outcome = NodeOutcome::Refused(e.to_string());
                }
            }
        }
        if let Some(text) = utilization {
            self.observe_annotation_utilization_locked(st, name, text);
        }
        outcome
    }

    /// A Node object without an inventory annotation: its labels are kept, for a node whose GPUs
    /// come from ResourceSlices (the `claims` submodule); a node that had an inventory leaves the
    /// model.
    fn observe_plain_node(&self, name: &str, labels: &BTreeMap<String, String>) -> NodeOutcome {
        {
            let st = self.read();
            if st.dra_labels.get(name) == Some(labels) && !st.node_sources.contains_key(name) {
                return if st.cluster.node(name).is_some() { NodeOutcome::Unchanged } else { NodeOutcome::NotGpu };
            }
        }
        let mut st = self.write();
        let st = &mut *st;
        st.dra_labels.insert(name.to_string(), labels.clone());
        if st.node_sources.remove(name).is_some() {
            // it had an inventory annotation: gone now
            let parked = self.drop_node_locked(st, name).unwrap_or(0);
            tracing::info!(node = %name, parked, "inventory annotation gone; node removed");
            return NodeOutcome::Removed { parked };
        }
        if !st.dra_gpus.contains_key(name) {
            return NodeOutcome::NotGpu;
        }
        match self.dra_node_locked(st, name) {
            Some(gpus) => NodeOutcome::Upserted { gpus },
            None => NodeOutcome::Unchanged,
        }
    }

    /// Whether a GPU node of this name is in the model.
    pub fn has_node(&self, name: &str) -> bool {
        self.read().cluster.node(name).is_some()
    }

    /// The node watcher's entry point for a deleted Node object: the node leaves the model and its
    /// allocations are parked until their pods go or the node comes back. `None`: not a known node.
    pub fn remove_node(&self, name: &str) -> Option<usize> {
        let mut st = self.write();
        let st = &mut *st;
        st.dra_labels.remove(name);
        st.node_sources.remove(name);
        self.drop_node_locked(st, name)
    }

    /// The node leaves the model (what gpuplace knows of its Node object stays); its allocations are
    /// parked. `None`: not a known node.
    pub(super) fn drop_node_locked(&self, st: &mut State, name: &str) -> Option<usize> {
        st.util_sources.remove(name);
        let node = st.cluster.remove_node(name)?;
        st.gpu_memory_mib.store(super::UNKNOWN_GPU_MEMORY, std::sync::atomic::Ordering::Relaxed);
        *st.largest_gpus.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        let pods: Vec<_> = node.pods().filter(|a| !crate::scheduler::groups::is_reservation(&a.pod)).cloned().collect();
        let n = pods.len();
        if n > 0 {
            st.parked.entry(name.to_string()).or_default().extend(pods);
        }
        let events = Self::groups_after_node_change(st);
        self.group_events(events);
        tracing::info!(node = %name, parked = n, "node removed");
        Some(n)
    }

    /// The pod watcher's entry point for an added or changed pod (a deleted one goes to
    /// [`release_pod`](Self::release_pod)).
    pub fn observe_pod(&self, pod: &ObservedPod) -> PodOutcome {
        let outcome = self.count_pod(pod);
        if matches!(outcome, PodOutcome::Counted | PodOutcome::Known) {
            self.observe_admission(pod);
        }
        if outcome == PodOutcome::Counted {
            // bound (by another replica, or before a restart): no longer pending
            self.metrics.pod_settled(&pod.uid);
        }
        if let (PodOutcome::Counted, Ok(req)) = (&outcome, &pod.request) {
            // a bound pod this replica never filtered (the leader did) is one arrival too
            self.observe_arrival(&pod.uid, req);
        }
        outcome
    }

    fn count_pod(&self, pod: &ObservedPod) -> PodOutcome {
        if pod.uid.is_empty() {
            return PodOutcome::Ignored;
        }
        if pod.finished {
            return if self.release_pod(&pod.uid) { PodOutcome::Released } else { PodOutcome::Ignored };
        }
        {
            let st = self.read();
            let reported = Self::already_refused(&st, pod);
            if let Some(b) = st.bound.get(&pod.uid) {
                if Self::erased(b, pod) && !st.books.tampered.contains(&pod.uid) {
                    drop(st);
                    return self.erased_after_bind(pod);
                }
                let differs = pod.annotation.is_some() && pod.annotation != b.annotation;
                if !differs || reported {
                    return PodOutcome::Known;
                }
            } else if pod.is_foreign() || reported {
                return PodOutcome::Ignored;
            }
        }
        let Some(text) = pod.annotation.as_deref() else {
            if pod.node.is_none() {
                self.remember(pod);
                return PodOutcome::Pending;
            }
            return PodOutcome::Ignored;
        };
        let mut st = self.write();
        let st = &mut *st;
        if st.bound.contains_key(&pod.uid) {
            // the leader signed the same record again with the primary key (a rotation)
            if let Some(outcome) = self.resigned_copy(st, &pod.uid, text) {
                return outcome;
            }
            // someone rewrote the annotation after gpuplace bound the pod: the GPUs it counted stay,
            // and the leader writes the record back
            self.metrics.conflict(ConflictKind::TamperedAssignment);
            st.books.tampered.insert(pod.uid.clone());
            let why =
                "the assignment was changed after gpuplace bound the pod; the GPUs counted at bind stay as they were"
                    .to_string();
            return self.refuse(st, pod, text, why);
        }
        let Some(node) = pod.node.as_deref() else {
            // a bind in flight (or a rolled-back one) shows this for a moment: not counted, and
            // reported only at a rebuild (see the module documentation)
            self.remember(pod);
            tracing::debug!(pod = %pod.key, "assignment on a pod not bound yet; not counted");
            return PodOutcome::Pending;
        };
        let request = match &pod.request {
            Ok(r) => r,
            Err(e) => return self.refuse(st, pod, text, e.clone()),
        };
        let keys = self.key_ring();
        // not written by this process: only gpuplace's MAC makes it a record (a forgery that
        // validates would otherwise count, and move the node's bind sequence)
        let checked = self.checked_assignment(&st.cluster, keys.as_deref(), text, &pod.uid, node, request);
        let (record, seq, signed_by) = match checked {
            Ok(x) => x,
            Err(e) => return self.refuse(st, pod, text, e.to_string()),
        };
        if let Some(old) = st.uid_of.get(&pod.key).cloned() {
            // two live pods cannot share a name: the old UID's pod is gone and its release was missed
            self.metrics.conflict(ConflictKind::StaleUid);
            tracing::warn!(pod = %pod.key, old_uid = %old, new_uid = %pod.uid, "pod name counted again under a new UID; releasing the old record");
            Self::release_locked(st, &old);
        }
        // bound (by another replica, or in a bind this one lost track of): its hold is over
        Self::release_offer(st, &pod.uid);
        if let Err(e) = st.cluster.allocate(record) {
            return self.refuse(st, pod, text, format!("collides with GPUs already counted: {e}"));
        }
        let last = st.last_seq.entry(node.to_string()).or_default();
        *last = (*last).max(seq);
        st.uid_of.insert(pod.key.clone(), pod.uid.clone());
        st.bound.insert(
            pod.uid.clone(),
            BoundPod {
                key: pod.key.clone(),
                uid: pod.uid.clone(),
                node: node.to_string(),
                bind_seq: seq,
                annotation: Some(text.to_string()),
                confirmed: true,
                signed_by,
            },
        );
        st.refused.remove(&pod.uid);
        st.books.mark(node);
        st.groups.member_bound(&pod.uid, &pod.key, request, node);
        tracing::info!(pod = %pod.key, node, "assignment counted from the pod");
        PodOutcome::Counted
    }

    /// Gives back what a pod holds (deleted or finished). Returns whether it held a record.
    pub fn release_pod(&self, uid: &str) -> bool {
        self.rejections().forget(uid);
        // its filter repeats the placement log holds go out now: no later line of it will carry them
        self.log_with(|log| log.forget(uid));
        self.metrics.pod_settled(uid);
        self.drop_offer(uid);
        let released = self.release_record(uid);
        // after its GPUs are back: a bound member's slot is reserved again for its replacement
        self.forget_group_member(uid);
        released
    }

    fn release_record(&self, uid: &str) -> bool {
        {
            let st = self.read();
            if !st.bound.contains_key(uid) && !st.refused.contains_key(uid) && !st.withdrawn.contains_key(uid) {
                return false;
            }
        }
        let mut st = self.write();
        let released = Self::release_locked(&mut st, uid);
        drop(st);
        if let Some(node) = &released {
            tracing::debug!(uid, node = %node, "pod released");
            self.note_freed(node);
            // a bind may be waiting for this pod's admission
            self.admissions_changed();
        }
        released.is_some()
    }

    /// After a re-list: releases the records of pods the list no longer shows (their deletion
    /// happened while the watch was broken). A bind this process confirmed after `listed_since`
    /// (when the re-list began) is kept: the list may predate it. Returns the pods released.
    pub fn retain_pods(&self, listed: &HashSet<String>, listed_since: Instant) -> Vec<String> {
        let mut guard = self.write();
        let st = &mut *guard;
        let gone: Vec<String> = st
            .bound
            .values()
            .filter(|b| {
                !listed.contains(&b.uid) && b.confirmed && st.bound_at.get(&b.uid).is_none_or(|&t| t < listed_since)
            })
            .map(|b| b.uid.clone())
            .collect();
        let mut keys = Vec::with_capacity(gone.len());
        let mut freed = HashSet::new();
        for uid in &gone {
            if let Some(b) = st.bound.get(uid) {
                keys.push(b.key.clone());
            }
            freed.extend(Self::release_locked(st, uid));
        }
        st.refused.retain(|uid, _| listed.contains(uid));
        st.withdrawn.retain(|uid, _| listed.contains(uid));
        drop(guard);
        // pending pods deleted while the watch was broken too (a pod listed late only gets a line early)
        self.log_with(|log| log.forget_unlisted(listed));
        self.change_groups(|st| ((), st.groups.retain_listed(&mut st.cluster, listed)));
        for uid in &gone {
            self.forget_group_member(uid);
        }
        for node in &freed {
            self.note_freed(node);
        }
        if !keys.is_empty() {
            tracing::info!(released = keys.len(), "pods gone while the watch was broken released");
        }
        keys
    }

    /// Drops the pod's record and gives back its GPUs; returns the node it held them on.
    fn release_locked(st: &mut State, uid: &str) -> Option<String> {
        st.refused.remove(uid);
        st.withdrawn.remove(uid);
        st.bound_at.remove(uid);
        let b = st.bound.remove(uid)?;
        st.books.mark(&b.node);
        st.books.tampered.remove(uid);
        Self::forget_awaiting(st, &b.node, uid);
        if st.uid_of.get(&b.key).is_some_and(|u| u == uid) {
            st.uid_of.remove(&b.key);
        }
        if st.cluster.assignment(&b.key).is_some_and(|a| a.node == b.node) {
            let _ = st.cluster.release(&b.key);
        }
        if let Some(parked) = st.parked.get_mut(&b.node) {
            parked.retain(|a| a.pod != b.key);
            if parked.is_empty() {
                st.parked.remove(&b.node);
            }
        }
        Some(b.node)
    }

    /// At a rebuild: an assignment on a pod that is not bound (left by a bind that never finished,
    /// or written by hand) is reported as not trusted, unless it is a rolled-back bind's own.
    pub fn refuse_unbound(&self, pod: &ObservedPod) -> PodOutcome {
        let (Some(text), None) = (pod.annotation.as_deref(), &pod.node) else {
            return self.observe_pod(pod);
        };
        self.remember(pod);
        let mut st = self.write();
        if Self::already_refused(&st, pod) || st.withdrawn.get(&pod.uid).is_some_and(|w| w == text) {
            return PodOutcome::Pending;
        }
        self.refuse(&mut st, pod, text, "an assignment on a pod that is not bound".into())
    }

    fn already_refused(st: &State, pod: &ObservedPod) -> bool {
        pod.annotation
            .as_ref()
            .is_some_and(|text| st.refused.get(&pod.uid).is_some_and(|(t, n)| t == text && *n == pod.node))
    }

    fn refuse(&self, st: &mut State, pod: &ObservedPod, text: &str, why: String) -> PodOutcome {
        self.metrics.conflict(ConflictKind::BadAssignment);
        tracing::warn!(pod = %pod.key, uid = %pod.uid, node = ?pod.node, reason = %why, "assignment annotation not trusted");
        st.refused.insert(pod.uid.clone(), (text.to_string(), pod.node.clone()));
        PodOutcome::Refused(why)
    }

    /// A pod not bound yet, for bind (as filter does).
    fn remember(&self, pod: &ObservedPod) {
        if pod.request.as_ref().is_ok_and(PodRequest::is_gpu_free) {
            return;
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let known = seen
            .by_uid
            .get(&pod.uid)
            .is_some_and(|s| s.key == pod.key && s.request == pod.request && s.constraints == pod.constraints);
        if !known {
            seen.insert(SeenPod {
                key: pod.key.clone(),
                uid: pod.uid.clone(),
                request: pod.request.clone(),
                constraints: pod.constraints.clone(),
            });
        }
        drop(seen);
        if let Ok(req) = &pod.request {
            self.observe_pending_member(&pod.uid, req);
        }
    }

    /// A pending pod of a group, before any placement of it: a gang is every pod that names its
    /// PodGroup, so its plan counts the members not placed yet.
    pub fn observe_pending_member(&self, uid: &str, req: &PodRequest) {
        if req.group.is_some() && !uid.is_empty() && !self.read().groups.knows_pending(uid, req) {
            let waiting = self.write().groups.observe_pending(uid, req);
            // the group's pods all exist now: those turned away while it waited for them try again
            if let (Some(requeuer), false) = (self.requeuer.get(), waiting.is_empty()) {
                let group = req.group.as_ref().map(|g| g.key.clone()).unwrap_or_default();
                let pods = waiting
                    .into_iter()
                    .filter_map(|(key, uid)| {
                        let (namespace, name) = key.split_once('/')?;
                        Some(RequeuePod { namespace: namespace.into(), name: name.into(), uid, node: group.clone() })
                    })
                    .collect();
                requeuer.requeue(pods);
            }
        }
    }
}
