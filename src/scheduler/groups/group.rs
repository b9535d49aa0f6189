//! What the groups are made of: the PodGroup's facts, a member's verdict, members, slots, plans and
//! the group itself, with the keys and fingerprints both the bookkeeping and the planning read.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use serde::Serialize;

use crate::placement_log::GroupEvent;
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::{GroupSpec, PodRequest};

/// What the PodGroup object says (watched from scheduling.k8s.io/v1alpha2).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct PodGroupInfo {
    /// `spec.schedulingPolicy.gang.minCount` (none for a `basic` policy).
    pub min_count: Option<u32>,
    /// `spec.schedulingConstraints.topology[].key`.
    pub topology_keys: Vec<String>,
}

/// A member as filter sees it.
#[derive(Debug, Clone)]
pub struct Arrival<'a> {
    pub uid: &'a str,
    pub request: &'a PodRequest,
    /// Nodes the member may not go to, which its group's plans leave out from now on (`Some`: the
    /// whole set, for a claim pod the nodes without ResourceSlices and those its selector, affinity
    /// or tolerations refuse). `None` for a filter's member, which has kube-scheduler's candidates
    /// instead (a planned node missing from them is left out then).
    pub excluded: Option<&'a [String]>,
}

/// What filter answers a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberVerdict {
    /// Fits on this node only (its slot of the group's plan).
    Planned { node: String },
    /// No plan: every node is turned away with this reason.
    NoPlan { reason: String },
    /// A member beyond the ones a plan is starting (an elastic group's): every node is turned away
    /// with this reason, as plain rejections even for a gang, whose cycle must go on for the members
    /// that have slots.
    Waits { reason: String },
    /// Not placed by a plan (a member beyond the planned size, or a group of one): judged as a single.
    Single,
}

impl GroupEvent {
    pub(super) fn new(group: &str, event: &'static str) -> Self {
        Self {
            group: group.to_string(),
            event: event.to_string(),
            domain: None,
            nodes: Vec::new(),
            reason: None,
            totals: None,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Member {
    pub(super) key: String,
    pub(super) request: PodRequest,
    pub(super) slot: Option<usize>,
    /// The node it is bound to (by gpuplace's bind or counted from the API server).
    pub(super) bound: Option<String>,
}

#[derive(Debug, Clone)]
pub(super) struct Slot {
    /// The reservation (pod = the reservation key) while unbound.
    pub(super) reservation: PodAssignment,
    /// The request the slot was planned for.
    pub(super) request: PodRequest,
    /// The member it is kept for.
    pub(super) holder: Option<String>,
    /// The holder's bind took it (the reservation is no longer in the cluster).
    pub(super) taken: bool,
}

#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) domain: String,
    pub(super) slots: Vec<Slot>,
    pub(super) made: Instant,
}

#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) fingerprint: (u64, u64, usize),
    pub(super) reason: String,
}

#[derive(Debug, Clone)]
pub(super) struct Group {
    /// `namespace/name`.
    pub(super) key: String,
    /// A kube-scheduler PodGroup (gang): turned away with the filter's `Error` (see [`MemberVerdict`]).
    pub(super) gang: bool,
    /// How many pods to plan for.
    pub(super) size: usize,
    /// How many it needs to start (0: all of them): a PodGroup's `minCount`, `gpuplace.io/group-min`.
    pub(super) min: usize,
    pub(super) required: Vec<String>,
    /// UID → member.
    pub(super) members: BTreeMap<String, Member>,
    pub(super) plan: Option<Plan>,
    pub(super) failure: Option<Failure>,
    /// Its last plan timed out: planned again only once every member exists.
    pub(super) expired: bool,
    /// Nodes kube-scheduler would not place a member on.
    pub(super) excluded: BTreeSet<String>,
}

impl Group {
    /// A group first seen through one of its pods (its size and keys are settled at its members'
    /// filters, with the PodGroup's).
    pub(super) fn new(spec: &GroupSpec) -> Self {
        Self {
            key: spec.key.clone(),
            gang: spec.pod_group,
            size: spec.size as usize,
            min: spec.min as usize,
            required: spec.required.clone(),
            members: BTreeMap::new(),
            plan: None,
            failure: None,
            expired: false,
            excluded: BTreeSet::new(),
        }
    }

    /// The members it needs to start: all of them unless it is elastic.
    pub(super) fn quorum(&self) -> usize {
        if self.min == 0 {
            self.size
        } else {
            self.min.min(self.size)
        }
    }

    pub(super) fn bound(&self) -> usize {
        self.members.values().filter(|m| m.bound.is_some()).count()
    }

    /// Members bound, plus slots reserved for members not bound yet.
    pub(super) fn placed(&self) -> usize {
        self.bound() + self.plan.as_ref().map_or(0, |p| p.slots.iter().filter(|s| !s.taken).count())
    }

    /// Its size, quorum and required keys from the member's spec and the PodGroup (the larger size
    /// wins: a gang is every pod that names it, so one seen beyond the PodGroup's `minCount` counts).
    pub(super) fn settle_spec(&mut self, spec: &GroupSpec, info: Option<&PodGroupInfo>) {
        self.gang |= spec.pod_group;
        self.size = group_size(spec, info).max(self.size);
        if let Some(m) = info.and_then(|i| i.min_count) {
            self.min = m as usize;
        } else if spec.min > 0 {
            self.min = spec.min as usize;
        }
        self.required = required_keys(spec, info);
    }

    /// Registers a member (a pod of the same name under a new UID replaces the old one).
    pub(super) fn register(&mut self, member_of: &mut HashMap<String, String>, uid: &str, request: &PodRequest) {
        if let Some(m) = self.members.get_mut(uid) {
            m.request = request.clone();
            return;
        }
        let key = request.key.clone();
        let stale: Vec<String> =
            self.members.iter().filter(|(_, m)| m.key == key && m.bound.is_none()).map(|(u, _)| u.clone()).collect();
        for u in stale {
            free_holder(self, &u);
            self.members.remove(&u);
            member_of.remove(&u);
        }
        self.members.insert(uid.to_string(), Member { key, request: request.clone(), slot: None, bound: None });
        member_of.insert(uid.to_string(), self.key.clone());
        if self.gang {
            self.size = self.size.max(self.members.len());
        }
    }
}

/// The reservation key of a slot: a pod key no real pod can have (`#` is not allowed in names).
pub fn reservation_key(group: &str, slot: usize) -> String {
    format!("{group}#{slot}")
}

/// Whether a pod key in the cluster model is a reservation.
pub fn is_reservation(pod: &str) -> bool {
    pod.contains('#')
}

/// A cheap fingerprint of the cluster's state: equal fingerprints mean no node changed since.
pub fn fingerprint(cluster: &Cluster) -> (u64, u64, usize) {
    (cluster.layout(), cluster.stamps().iter().fold(0u64, |a, s| a.wrapping_add(*s)), cluster.nodes().len())
}

fn group_size(spec: &GroupSpec, info: Option<&PodGroupInfo>) -> usize {
    let min = info.and_then(|i| i.min_count).unwrap_or(0) as usize;
    (spec.size as usize).max(min)
}

fn required_keys(spec: &GroupSpec, info: Option<&PodGroupInfo>) -> Vec<String> {
    let mut keys: Vec<String> = info.map(|i| i.topology_keys.clone()).unwrap_or_default();
    for k in &spec.required {
        if !keys.contains(k) {
            keys.push(k.clone());
        }
    }
    keys
}

/// Frees the slot a member held (its reservation stays, for a replacement).
pub(super) fn free_holder(g: &mut Group, uid: &str) {
    let Some(m) = g.members.get(uid) else { return };
    if let (Some(i), Some(plan)) = (m.slot, g.plan.as_mut()) {
        if let Some(s) = plan.slots.get_mut(i) {
            if s.holder.as_deref() == Some(uid) && !s.taken {
                s.holder = None;
            }
        }
    }
}
