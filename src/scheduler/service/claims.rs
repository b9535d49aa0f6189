//! GPUs that come from DRA: nodes whose GPUs are ResourceSlice devices, and the allocations
//! ResourceClaims hold on them. The DRA front end's seams, protocol-free (`crate::dra` reads and
//! writes the objects):
//!
//! - [`Scheduler::observe_slices`]: a node's GPUs from its slices (`gpuplace_core::dra::slices`);
//!   with its Node object's labels (kept for nodes without an inventory annotation) it is a node of
//!   the model like any other.
//! - [`Scheduler::observe_claim`]: a claim's allocation as its watcher reads it, counted under the
//!   claim's own key (`claim:<namespace>/<name>`) even past capacity: whoever wrote it, the claim
//!   holds the devices.
//! - [`Scheduler::hold`]: a placement chosen and counted under one write lock, so no bind or other
//!   placement sees the GPUs free between the choice and the count; the records stay *held* until
//!   the watcher shows the written allocations (an event from before the write, showing none, does
//!   not release them) or [`Scheduler::release_held`] gives them back (the write failed).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::{AllocError, Cluster, Node};
use gpuplace_core::dra::claims::{host_key, host_record, is_claim_key, is_observed_key};
use gpuplace_core::dra::slices::SliceGpus;
use gpuplace_core::resources::PodRequest;

use super::{Scheduler, State};
use crate::placement::engine::Engine;
use crate::scheduler::groups::{Arrival, MemberVerdict};
use crate::scheduler::metrics::ConflictKind;

/// Why [`Scheduler::hold`] counted nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldError<E: std::error::Error> {
    #[error("{0}")]
    NotReady(&'static str),
    /// The pod's group has no room for it now (the group planning's reason).
    #[error("{0}")]
    Group(String),
    #[error(transparent)]
    Plan(E),
    /// The plan returned a record the model refuses (a bug in the plan, or a key already held).
    #[error("the placement does not fit the model: {0}")]
    Refused(AllocError),
}

/// Times a group is planned again without a planned node the pod may not run on, per placement.
const MAX_REPLANS: usize = 4;

/// What a placement under [`Scheduler::hold`] sees, under the write lock.
pub struct HoldView<'a> {
    pub cluster: &'a Cluster,
    pub engine: &'a Engine,
    pub now_ms: i64,
    /// The node where the pod's group holds its slot (the slot's room already given back for it):
    /// the only node it may go to. `None`: the pod is placed alone.
    pub slot: Option<&'a str>,
    dra_gpus: &'a HashMap<String, SliceGpus>,
}

impl<'a> HoldView<'a> {
    fn of(st: &'a State, now_ms: i64, slot: Option<&'a str>) -> Self {
        Self { cluster: &st.cluster, engine: &st.engine, now_ms, slot, dra_gpus: &st.dra_gpus }
    }

    /// Whether the node's GPUs come from ResourceSlices: only their devices can be allocated to a
    /// claim (a node of the extender's own resources cannot).
    pub fn is_dra_node(&self, name: &str) -> bool {
        self.dra_gpus.contains_key(name)
    }

    /// Whether the pod may go to `name` as far as the hold is concerned: a DRA node, and its
    /// group's slot if it has one.
    pub fn may_use(&self, name: &str) -> bool {
        self.is_dra_node(name) && self.slot.is_none_or(|s| s == name)
    }
}

/// What [`Scheduler::observe_claim`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Nothing changed (the record counted is the one read, or neither has one).
    Unchanged,
    /// Counted (new or changed); `Some` with why when it is over the node's capacity.
    Counted(Option<String>),
    /// Released: the claim holds nothing now.
    Released,
    /// Held by a placement whose write is not seen yet: kept.
    Held,
    /// On a node the model does not have yet: counted when the node's slices are seen.
    Parked,
    /// Refused: it names a node or GPU the model does not have, or clashes with an exclusive holder.
    Refused(String),
}

impl Scheduler {
    /// A node's GPUs from its ResourceSlices (`None`: it has none any more). Built into a node of the
    /// model with the labels its Node object last showed, now or when the Node object is seen.
    pub fn observe_slices(&self, name: &str, gpus: Option<SliceGpus>) {
        let mut st = self.write();
        let st = &mut *st;
        match gpus {
            Some(g) => {
                st.dra_gpus.insert(name.to_string(), g);
                Self::dra_node_locked(self, st, name);
            }
            None => {
                if st.dra_gpus.remove(name).is_none() || st.node_sources.contains_key(name) {
                    return;
                }
                let holds_claims = st.cluster.node(name).is_some_and(|n| n.pods().any(|a| is_claim_key(&a.pod)));
                if !holds_claims {
                    self.drop_node_locked(st, name);
                } else if let Some(mut n) = st.cluster.node_mut(name) {
                    // its claims still hold the GPUs: the node stays, every GPU unhealthy, until the
                    // slice is back or the Node is deleted
                    for g in 0..n.gpus.len() {
                        n.set_gpu_health(g, false);
                    }
                }
            }
        }
    }

    /// (Re)builds the DRA node `name` from its slices and labels, if both are known.
    pub(super) fn dra_node_locked(&self, st: &mut State, name: &str) -> Option<usize> {
        let g = st.dra_gpus.get(name)?;
        let labels = st.dra_labels.get(name)?.clone();
        let previous = st.cluster.node(name);
        let same = previous.is_some_and(|n| {
            n.labels == labels && n.gpus == g.gpus && n.slots_per_gpu == g.slots_per_gpu && n.isolation == g.isolation
        });
        if same {
            return None;
        }
        let (cpu, mem) = st.dra_host.get(name).copied().unwrap_or((0, 0));
        let node = Node::new(name, labels, g.gpus.clone(), Arc::new(g.topology.clone()), cpu, mem)
            .with_slots_per_gpu(g.slots_per_gpu)
            .with_isolation(g.isolation);
        let gpus = node.gpus.len();
        let first = previous.is_none();
        tracing::info!(node = %name, gpus, generation = g.generation, "node GPUs taken from its ResourceSlices");
        self.upsert_locked(st, node);
        // a new Node value starts without samples: its ConfigMap's apply again
        self.utilization_redefined_locked(st, name);
        if first {
            // pods bound there before its slices were seen: their host requests count now
            let on_it: Vec<PodAssignment> = st
                .host_uses
                .iter()
                .filter(|(_, (n, _, _))| n == name)
                .map(|(uid, (n, c, m))| host_record(uid, n, *c, *m))
                .collect();
            for r in on_it {
                if st.cluster.assignment(&r.pod).is_none() {
                    let _ = st.cluster.count_observed(r);
                }
            }
        }
        Some(gpus)
    }

    /// A claim's allocation on gpuplace's devices as its watcher reads it (`None`: none, or the claim
    /// is gone), under `key` ([`gpuplace_core::dra::claims::claim_key`]).
    pub fn observe_claim(&self, key: &str, record: Option<PodAssignment>) -> ClaimOutcome {
        {
            let st = self.read();
            let counted = st.cluster.assignment(key);
            if counted == record.as_ref() && !st.held.contains_key(key) {
                return ClaimOutcome::Unchanged;
            }
            if record.is_none() && st.held.contains_key(key) {
                return ClaimOutcome::Held;
            }
        }
        let mut st = self.write();
        let st = &mut *st;
        if record.is_none() && st.held.contains_key(key) {
            return ClaimOutcome::Held;
        }
        // a held record is settled once its allocation is seen
        st.held.remove(key);
        if st.cluster.assignment(key) == record.as_ref() {
            return ClaimOutcome::Unchanged;
        }
        let mut had = st.cluster.release(key).is_ok();
        for records in st.parked.values_mut() {
            let before = records.len();
            records.retain(|a| a.pod != key);
            had |= records.len() != before;
        }
        let Some(record) = record else {
            return if had { ClaimOutcome::Released } else { ClaimOutcome::Unchanged };
        };
        if st.cluster.node(&record.node).is_none() {
            st.parked.entry(record.node.clone()).or_default().push(record);
            return ClaimOutcome::Parked;
        }
        match st.cluster.count_observed(record) {
            Ok(over) => {
                if let Some(why) = &over {
                    tracing::warn!(claim = %key, reason = %why, "claim allocation over the device's capacity; counted until it goes");
                }
                ClaimOutcome::Counted(over.map(|e| e.to_string()))
            }
            Err(e) => {
                self.metrics.conflict(ConflictKind::BadAssignment);
                tracing::warn!(claim = %key, error = %e, "claim allocation not counted");
                ClaimOutcome::Refused(e.to_string())
            }
        }
    }

    /// A re-list of the claims: every claim record not among `listed` (keys) is released, except
    /// those held since `listed_at` (their write may be newer than the list).
    pub fn retain_claims(&self, listed: &HashSet<String>, listed_at: Instant) {
        let mut st = self.write();
        let st = &mut *st;
        let gone: Vec<String> = st
            .cluster
            .nodes()
            .iter()
            .flat_map(|n| n.pods())
            .map(|a| a.pod.clone())
            .filter(|k| is_claim_key(k) && !listed.contains(k))
            .filter(|k| st.held.get(k).is_none_or(|&at| at < listed_at))
            .collect();
        for k in gone {
            st.held.remove(&k);
            if st.cluster.release(&k).is_ok() {
                tracing::info!(claim = %k, "claim no longer listed; its allocation released");
            }
        }
    }

    /// Chooses and counts a placement under one write lock: `plan` sees the model and the engine and
    /// returns the records to hold (claim keys), counted all together or not at all.
    pub fn hold<E: std::error::Error>(
        &self,
        plan: impl FnOnce(&HoldView<'_>) -> Result<Vec<PodAssignment>, E>,
    ) -> Result<Vec<PodAssignment>, HoldError<E>> {
        if !self.is_ready() {
            return Err(HoldError::NotReady(super::NOT_READY));
        }
        let now_ms = self.now_ms();
        let mut st = self.write();
        let st = &mut *st;
        let records = plan(&HoldView::of(st, now_ms, None)).map_err(HoldError::Plan)?;
        Self::count_held(st, records)
    }

    /// As [`Self::hold`], for the pod `uid` whose claims make `req`. A member of a group (gpuplace's
    /// labels or a PodGroup, `req.group`) is planned with its whole group, as the extender plans
    /// its members: its claims go where the plan holds its slot, into the room the slot's
    /// reservation kept (released for them under the same lock; [`HoldView::slot`] names the node),
    /// and a group without room is [`HoldError::Group`] with the reason. A planned node `admits`
    /// refuses (the pod's node selector, affinity or tolerations) has the plan made again without
    /// it. After the writes: [`Self::member_written`] or [`Self::member_not_written`].
    pub fn hold_pod<E: std::error::Error>(
        &self,
        uid: &str,
        req: &PodRequest,
        admits: &dyn Fn(&Node) -> bool,
        plan: impl FnOnce(&HoldView<'_>) -> Result<Vec<PodAssignment>, E>,
    ) -> Result<Vec<PodAssignment>, HoldError<E>> {
        if req.group.is_none() {
            return self.hold(plan);
        }
        if !self.is_ready() {
            return Err(HoldError::NotReady(super::NOT_READY));
        }
        self.expire_groups();
        let now = Instant::now();
        let now_ms = self.now_ms();
        self.change_groups(|st| {
            let excluded: Vec<String> = st
                .cluster
                .nodes()
                .iter()
                .filter(|n| !st.dra_gpus.contains_key(&n.name) || !admits(n))
                .map(|n| n.name.clone())
                .collect();
            let arrival = Arrival { uid, request: req, excluded: Some(&excluded) };
            let (mut verdict, mut events) = st.groups.admit(&mut st.cluster, &st.engine, &arrival, now, now_ms);
            for _ in 0..MAX_REPLANS {
                let MemberVerdict::Planned { node } = &verdict else { break };
                if st.cluster.node(node).is_some_and(admits) {
                    break;
                }
                let refused = st.groups.planned_node_refused(&mut st.cluster, uid, node);
                if refused.is_empty() {
                    // a gang's plan is not remade for one member: the plan below fails on the node
                    break;
                }
                events.extend(refused);
                let (v, more) = st.groups.admit(&mut st.cluster, &st.engine, &arrival, now, now_ms);
                events.extend(more);
                verdict = v;
            }
            let out = match verdict {
                MemberVerdict::Single => {
                    plan(&HoldView::of(st, now_ms, None)).map_err(HoldError::Plan).and_then(|r| Self::count_held(st, r))
                }
                MemberVerdict::NoPlan { reason } | MemberVerdict::Waits { reason } => Err(HoldError::Group(reason)),
                MemberVerdict::Planned { node } => Self::hold_slot(st, uid, &node, now_ms, plan),
            };
            (out, events)
        })
    }

    /// A member's claims in the room its slot on `node` holds: the reservation released, the claims
    /// chosen and counted, the slot taken; on any failure the reservation is counted again.
    fn hold_slot<E: std::error::Error>(
        st: &mut State,
        uid: &str,
        node: &str,
        now_ms: i64,
        plan: impl FnOnce(&HoldView<'_>) -> Result<Vec<PodAssignment>, E>,
    ) -> Result<Vec<PodAssignment>, HoldError<E>> {
        if let Some(r) = st.groups.reservation_for_bind(uid, node) {
            let _ = st.cluster.release(&r.pod);
        }
        let held = plan(&HoldView::of(st, now_ms, Some(node)))
            .map_err(HoldError::Plan)
            .and_then(|records| Self::count_held(st, records));
        match &held {
            Ok(_) => st.groups.slot_taken(uid, node),
            Err(_) => Self::restore_reservation(st, uid, node),
        }
        held
    }

    /// Counts `records` all together or not at all, held until their writes are seen.
    fn count_held<E: std::error::Error>(
        st: &mut State,
        records: Vec<PodAssignment>,
    ) -> Result<Vec<PodAssignment>, HoldError<E>> {
        let mut counted: Vec<String> = Vec::new();
        for r in &records {
            if let Err(e) = st.cluster.allocate(r.clone()) {
                for k in &counted {
                    let _ = st.cluster.release(k);
                }
                return Err(HoldError::Refused(e));
            }
            counted.push(r.pod.clone());
        }
        let at = Instant::now();
        for k in counted {
            st.held.insert(k, at);
        }
        Ok(records)
    }

    /// A member's claims held by [`Self::hold_pod`] are written: its group's plan is done once
    /// every slot is taken.
    pub fn member_written(&self, uid: &str) {
        self.change_groups(|st| ((), st.groups.settle(uid).into_iter().collect()));
    }

    /// A member's claims held by [`Self::hold_pod`] were not all written (give the held records
    /// back with [`Self::release_held`] too): its slot is held for it again, so the other members
    /// keep what they hold.
    pub fn member_not_written(&self, uid: &str) {
        Self::return_slot(&mut self.write(), uid);
    }

    /// A bound pod of a group whose GPUs come from claims on the DRA node `node` (placed before a
    /// restart, or by another replica): a member of its group there, so that members who join later
    /// are planned next to it.
    pub fn observe_claim_member(&self, uid: &str, key: &str, req: &PodRequest, node: &str) {
        if req.group.is_none() || uid.is_empty() {
            return;
        }
        {
            let st = self.read();
            if !st.dra_gpus.contains_key(node) || st.groups.bound_node(uid) == Some(node) {
                return;
            }
        }
        self.write().groups.member_bound(uid, key, req, node);
    }

    /// Gives back held records whose allocations were not written.
    pub fn release_held(&self, keys: &[String]) {
        let mut st = self.write();
        for k in keys {
            if st.held.remove(k).is_some() {
                let _ = st.cluster.release(k);
            }
        }
    }

    /// A node's allocatable CPU (millicores) and memory (MiB), from its Node object: a DRA node's
    /// host is checked by gpuplace, which chooses the node itself.
    pub fn observe_allocatable(&self, name: &str, cpu_milli: u64, memory_mib: u64) {
        if !self.dra_enabled() || self.read().dra_host.get(name) == Some(&(cpu_milli, memory_mib)) {
            return;
        }
        let mut st = self.write();
        let st = &mut *st;
        st.dra_host.insert(name.to_string(), (cpu_milli, memory_mib));
        self.dra_node_locked(st, name);
    }

    /// Whether the node's GPUs come from ResourceSlices.
    pub fn is_dra_node(&self, name: &str) -> bool {
        self.read().dra_gpus.contains_key(name)
    }

    /// Turns on the DRA front end's bookkeeping of pods' host requests.
    pub fn enable_dra(&self) {
        self.dra_enabled.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the DRA front end is on (the watchers then read pods' and nodes' host resources).
    pub fn dra_enabled(&self) -> bool {
        self.dra_enabled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A pod's host requests (`Some((node, millicores, MiB))` while it is bound and not finished):
    /// on a DRA node they count under [`host_key`], as the claims do. Kept only with the DRA front
    /// end on; cheap to call for every pod event otherwise.
    pub fn observe_host_use(&self, uid: &str, use_: Option<(&str, u64, u64)>) {
        if !self.dra_enabled() || uid.is_empty() {
            return;
        }
        let want = use_.map(|(n, c, m)| (n.to_string(), c, m));
        {
            let st = self.read();
            if st.host_uses.get(uid) == want.as_ref() {
                return;
            }
        }
        let dra_node = {
            let mut st = self.write();
            match &want {
                Some(w) => st.host_uses.insert(uid.to_string(), w.clone()),
                None => st.host_uses.remove(uid),
            };
            want.as_ref().is_some_and(|(n, _, _)| st.dra_gpus.contains_key(n))
        };
        let record = want
            .filter(|_| dra_node)
            .map(|(node, cpu_milli, memory_mib)| host_record(uid, &node, cpu_milli, memory_mib));
        self.observe_claim(&host_key(uid), record);
    }

    /// A re-list of the pods: the host requests of pods it no longer shows go.
    pub fn retain_host_uses(&self, listed: &HashSet<String>) {
        let gone: Vec<String> = self.read().host_uses.keys().filter(|u| !listed.contains(*u)).cloned().collect();
        for uid in gone {
            self.observe_host_use(&uid, None);
        }
    }

    /// Records the API server's objects define (claims', pods' host use), for a restore to keep:
    /// they come from the watchers, not from pod annotations.
    pub(super) fn observed_records(cluster: &Cluster) -> Vec<PodAssignment> {
        cluster.nodes().iter().flat_map(|n| n.pods()).filter(|a| is_observed_key(&a.pod)).cloned().collect()
    }
}

#[cfg(test)]
#[path = "claims_tests.rs"]
mod tests;
