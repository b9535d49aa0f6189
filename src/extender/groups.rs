//! Groups placed whole: the plans and reservations behind each group of pods (docs/resources.md,
//! "Groups").
//!
//! A group is kube-scheduler's `PodGroup` (a pod's `spec.schedulingGroup.podGroupName`) or
//! gpuplace's `gpuplace.io/group` label with `gpuplace.io/group-size`. When both are set, the
//! PodGroup names the group (kube-scheduler gangs by it), its `minCount` and topology keys apply, and
//! the label's size, when larger, says how many pods to plan for.
//!
//! When the first member is filtered (for a gang: once kube-scheduler releases it, i.e. once
//! `minCount` members exist), [`plan_group`] picks nodes and GPUs for every member still to place,
//! and each slot is held as a *reservation*: an allocation in the cluster model under a key no pod
//! can have (`namespace/group#slot`), so that no other pod's filter or bind can take it. Each member
//! is then filtered to its slot's node only, and its bind swaps the reservation for the member's own
//! allocation with the same GPUs. No plan: every member is turned away with one reason, and none is
//! bound.
//!
//! A plan's unbound reservations end when the group is bound, when every member is deleted, after
//! the time-out (kube-scheduler's own gang wait at Permit is 5 minutes, `permitTimeoutDuration` in
//! its GangScheduling plugin; the default here is the same), or when a planned node leaves or loses
//! a planned GPU (the unbound members are planned again). After a time-out the group is planned again
//! only once all its members exist, so a group short of pods does not hold GPUs over and over.
//! Reservations live in memory only: a restart (or a new leader) starts without them, counts the
//! bound members from their assignment annotations, and plans the rest again at their next filter.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::core::assignment::PodAssignment;
use crate::core::cluster::Cluster;
use crate::core::resources::{GroupSpec, PodRequest};
use crate::placement::engine::Engine;
use crate::placement::group_plan::{group_name, plan_group, GroupAsk, GroupPlan};
use crate::placement_log::{GroupEvent, GroupTotals};

/// kube-scheduler v1.36's gang time-out (GangScheduling's Permit wait).
pub const DEFAULT_GROUP_TIMEOUT: Duration = Duration::from_secs(300);

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
}

/// What filter answers a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Fits on this node only (its slot of the group's plan).
    Planned { node: String },
    /// No plan: every node is turned away with this reason.
    NoPlan { reason: String },
    /// Not placed by a plan (a member beyond the planned size, or a group of one): judged as a single.
    Single,
}

impl GroupEvent {
    fn new(group: &str, event: &'static str) -> Self {
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
struct Member {
    key: String,
    request: PodRequest,
    slot: Option<usize>,
    /// The node it is bound to (by gpuplace's bind or counted from the API server).
    bound: Option<String>,
}

#[derive(Debug, Clone)]
struct Slot {
    /// The reservation (pod = the reservation key) while unbound.
    reservation: PodAssignment,
    /// The request the slot was planned for.
    request: PodRequest,
    /// The member it is kept for.
    holder: Option<String>,
    /// The holder's bind took it (the reservation is no longer in the cluster).
    taken: bool,
}

#[derive(Debug, Clone)]
struct Plan {
    domain: String,
    slots: Vec<Slot>,
    made: Instant,
}

#[derive(Debug, Clone)]
struct Failure {
    fingerprint: (u64, u64, usize),
    reason: String,
}

#[derive(Debug, Clone)]
struct Group {
    /// `namespace/name`.
    key: String,
    /// A kube-scheduler PodGroup (gang): turned away with the filter's `Error` (see [`Verdict`]).
    gang: bool,
    /// How many pods to plan for.
    size: usize,
    required: Vec<String>,
    /// UID → member.
    members: BTreeMap<String, Member>,
    plan: Option<Plan>,
    failure: Option<Failure>,
    /// Its last plan timed out: planned again only once every member exists.
    expired: bool,
    /// Nodes kube-scheduler would not place a member on.
    excluded: BTreeSet<String>,
}

impl Group {
    /// A group first seen through one of its pods (its size and keys are settled at its members'
    /// filters, with the PodGroup's).
    fn new(spec: &GroupSpec) -> Self {
        Self {
            key: spec.key.clone(),
            gang: spec.pod_group,
            size: spec.size as usize,
            required: spec.required.clone(),
            members: BTreeMap::new(),
            plan: None,
            failure: None,
            expired: false,
            excluded: BTreeSet::new(),
        }
    }
}

/// One group as `/inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct GroupReport {
    pub group: String,
    pub gang: bool,
    pub size: usize,
    pub members_seen: usize,
    pub members_bound: usize,
    /// The plan's domain, while one holds reservations.
    pub domain: Option<String>,
    /// Node and GPUs of each reserved (unbound) slot.
    pub reserved: Vec<ReservedSlot>,
    pub plan_age_s: Option<f64>,
    /// Why the group waits, when no plan exists.
    pub waiting: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ReservedSlot {
    pub node: String,
    pub gpus: Vec<u32>,
    /// GPUs' worth reserved (a share counts its fraction).
    pub gpu_share: f64,
}

/// Counts for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GroupStats {
    /// Groups with members to place and no plan.
    pub waiting: usize,
    /// Groups holding reservations.
    pub planned: usize,
    /// GPUs' worth held by reservations.
    pub gpus_reserved: f64,
    /// Age of the oldest plan holding reservations, seconds.
    pub oldest_plan_s: f64,
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

/// Two requests that a slot planned for one can serve for the other (same containers and rules).
fn same_shape(a: &PodRequest, b: &PodRequest) -> bool {
    a.containers == b.containers
        && a.init_containers == b.init_containers
        && a.allowed_models == b.allowed_models
        && a.numa == b.numa
        && a.gpu_policy == b.gpu_policy
}

/// Every group's members and plan.
#[derive(Debug)]
pub struct Groups {
    groups: HashMap<String, Group>,
    member_of: HashMap<String, String>,
    pod_groups: HashMap<String, PodGroupInfo>,
    timeout: Duration,
}

impl Default for Groups {
    fn default() -> Self {
        Self::new(DEFAULT_GROUP_TIMEOUT)
    }
}

impl Groups {
    pub fn new(timeout: Duration) -> Self {
        Self { groups: HashMap::new(), member_of: HashMap::new(), pod_groups: HashMap::new(), timeout }
    }

    /// A PodGroup seen (or changed) on the API server, by `namespace/name`.
    pub fn observe_pod_group(&mut self, key: &str, info: PodGroupInfo) {
        if let Some(g) = self.groups.get_mut(key) {
            if let Some(m) = info.min_count {
                g.size = g.size.max(m as usize);
            }
            g.required = info.topology_keys.clone();
        }
        self.pod_groups.insert(key.to_string(), info);
    }

    /// A PodGroup deleted: its group's reservations go.
    pub fn forget_pod_group(&mut self, cluster: &mut Cluster, key: &str) -> Vec<GroupEvent> {
        self.pod_groups.remove(key);
        let mut events = Vec::new();
        if let Some(mut g) = self.groups.remove(key) {
            drop_plan(cluster, &mut g);
            for uid in g.members.keys() {
                self.member_of.remove(uid);
            }
            events.push(GroupEvent::new(key, "deleted"));
        }
        events
    }

    /// The PodGroup of that key, if seen.
    pub fn pod_group(&self, key: &str) -> Option<&PodGroupInfo> {
        self.pod_groups.get(key)
    }

    /// The answer for a member that needs no change to the state (its slot is planned and the plan
    /// still holds, or the group's last planning failed on the same cluster state): the fast path
    /// under the read lock. `None`: [`Groups::admit`] must decide.
    pub fn settled(&self, cluster: &Cluster, arrival: &Arrival<'_>, now: Instant) -> Option<Verdict> {
        let spec = arrival.request.group.as_ref()?;
        let g = self.groups.get(&spec.key)?;
        let m = g.members.get(arrival.uid)?;
        if m.request != *arrival.request {
            return None;
        }
        if let Some(plan) = &g.plan {
            if now.duration_since(plan.made) >= self.timeout {
                return None;
            }
            let slot = plan.slots.get(m.slot?)?;
            return (!slot.taken).then(|| Verdict::Planned { node: slot.reservation.node.clone() });
        }
        let f = g.failure.as_ref()?;
        (f.fingerprint == fingerprint(cluster)).then(|| Verdict::NoPlan { reason: f.reason.clone() })
    }

    /// A member is filtered: registers it, plans the group when it has no plan, and says where the
    /// member may go. Reservations are counted in `cluster`.
    pub fn admit(
        &mut self,
        cluster: &mut Cluster,
        engine: &Engine,
        arrival: &Arrival<'_>,
        now: Instant,
        now_unix_ms: i64,
    ) -> (Verdict, Vec<GroupEvent>) {
        let mut events = Vec::new();
        let Some(spec) = arrival.request.group.clone() else { return (Verdict::Single, events) };
        self.expire(cluster, now, &mut events);
        let info = self.pod_groups.get(&spec.key).cloned();
        let g = self.groups.entry(spec.key.clone()).or_insert_with(|| Group::new(&spec));
        g.gang |= spec.pod_group;
        g.size = group_size(&spec, info.as_ref()).max(g.size);
        g.required = required_keys(&spec, info.as_ref());
        if g.gang && info.is_none() && spec.size == 0 {
            return (
                Verdict::NoPlan { reason: format!("PodGroup {} is not known to gpuplace yet; retry", spec.key) },
                events,
            );
        }
        if g.size <= 1 {
            return (Verdict::Single, events);
        }
        // register (a pod of the same name under a new UID replaces the old one)
        let key = arrival.request.key.clone();
        if !g.members.contains_key(arrival.uid) {
            let stale: Vec<String> =
                g.members.iter().filter(|(_, m)| m.key == key && m.bound.is_none()).map(|(u, _)| u.clone()).collect();
            for u in stale {
                free_holder(g, &u);
                g.members.remove(&u);
                self.member_of.remove(&u);
            }
            g.members.insert(
                arrival.uid.to_string(),
                Member { key, request: arrival.request.clone(), slot: None, bound: None },
            );
            self.member_of.insert(arrival.uid.to_string(), spec.key.clone());
        } else if let Some(m) = g.members.get_mut(arrival.uid) {
            m.request = arrival.request.clone();
        }
        if g.members.get(arrival.uid).is_some_and(|m| m.bound.is_some()) {
            return (Verdict::Single, events);
        }
        // a slot already held for it, or a free one of its shape
        if let Some(v) = take_slot(g, arrival.uid) {
            return (v, events);
        }
        if g.plan.is_some() {
            // the plan is full (more members than planned): judged as a single
            return (Verdict::Single, events);
        }
        if g.expired && g.members.len() < g.size {
            let reason = format!(
                "group {} waits for all {} pods ({} exist) after its reservation timed out",
                group_name(&g.key),
                g.size,
                g.members.len()
            );
            return (Verdict::NoPlan { reason }, events);
        }
        let fp = fingerprint(cluster);
        if let Some(f) = g.failure.as_ref().filter(|f| f.fingerprint == fp) {
            return (Verdict::NoPlan { reason: f.reason.clone() }, events);
        }
        match make_plan(g, cluster, engine, now, now_unix_ms) {
            Ok(ev) => {
                g.failure = None;
                events.push(ev);
                let v = take_slot(g, arrival.uid).unwrap_or(Verdict::Single);
                (v, events)
            }
            Err(reason) => {
                let mut ev = GroupEvent::new(&g.key, "no_plan");
                ev.reason = Some(reason.clone());
                if g.failure.as_ref().is_none_or(|f| f.reason != reason) {
                    events.push(ev);
                }
                g.failure = Some(Failure { fingerprint: fingerprint(cluster), reason: reason.clone() });
                (Verdict::NoPlan { reason }, events)
            }
        }
    }

    /// Bind of a member to `node`: the reservation its slot holds there (`Some`), which the caller
    /// releases from the cluster and replaces by the member's allocation, with the member's key.
    pub fn reservation_for_bind(&self, uid: &str, node: &str) -> Option<PodAssignment> {
        let g = self.groups.get(self.member_of.get(uid)?)?;
        let m = g.members.get(uid)?;
        let slot = g.plan.as_ref()?.slots.get(m.slot?)?;
        (!slot.taken && slot.reservation.node == node).then(|| slot.reservation.clone())
    }

    /// The member's bind took its slot (the reservation was swapped for its allocation).
    pub fn slot_taken(&mut self, uid: &str, node: &str) {
        let Some(g) = self.member_of.get(uid).and_then(|k| self.groups.get_mut(k)) else { return };
        if let Some(m) = g.members.get_mut(uid) {
            m.bound = Some(node.to_string());
            if let (Some(i), Some(plan)) = (m.slot, g.plan.as_mut()) {
                if let Some(s) = plan.slots.get_mut(i) {
                    s.taken = true;
                }
            }
        }
    }

    /// A member's bind goes to a node its plan did not choose (kube-scheduler did not follow the
    /// plan): a plan it holds a slot in is dropped, so that it is placed like a single pod and its
    /// siblings are planned again around it at their next filter.
    pub fn leave_plan(&mut self, cluster: &mut Cluster, uid: &str, node: &str) -> Vec<GroupEvent> {
        let Some(g) = self.member_of.get(uid).and_then(|k| self.groups.get_mut(k)) else { return Vec::new() };
        let held = g.members.get(uid).is_some_and(|m| m.slot.is_some()) && g.plan.is_some();
        if !held {
            return Vec::new();
        }
        drop_plan(cluster, g);
        let mut ev = GroupEvent::new(&g.key, "replanned");
        ev.reason = Some(format!("a member is bound to {node}, not where the plan put it"));
        vec![ev]
    }

    /// A member bound without a slot of a plan.
    pub fn mark_bound(&mut self, uid: &str, node: &str) {
        let Some(g) = self.member_of.get(uid).and_then(|k| self.groups.get_mut(k)) else { return };
        if let Some(m) = g.members.get_mut(uid) {
            m.bound = Some(node.to_string());
        }
    }

    /// A member's Binding failed after [`Groups::slot_taken`]: its slot is reserved again, as it was
    /// (`Some(reservation)` for the caller to count), so the other members keep what they hold.
    pub fn slot_returned(&mut self, uid: &str) -> Option<PodAssignment> {
        let g = self.groups.get_mut(self.member_of.get(uid)?)?;
        let m = g.members.get_mut(uid)?;
        m.bound = None;
        let slot = g.plan.as_mut()?.slots.get_mut(m.slot?)?;
        if !slot.taken {
            return None;
        }
        slot.taken = false;
        Some(slot.reservation.clone())
    }

    /// A member counted as bound from the API server (a restart, or another replica's bind).
    pub fn member_bound(&mut self, uid: &str, key: &str, request: &PodRequest, node: &str) {
        let Some(spec) = &request.group else { return };
        let g = self.groups.entry(spec.key.clone()).or_insert_with(|| Group::new(spec));
        let m = g.members.entry(uid.to_string()).or_insert_with(|| Member {
            key: key.to_string(),
            request: request.clone(),
            slot: None,
            bound: None,
        });
        m.bound = Some(node.to_string());
        self.member_of.insert(uid.to_string(), spec.key.clone());
    }

    /// Marks the plan done once every slot is taken: returns the event.
    pub fn settle(&mut self, uid: &str) -> Option<GroupEvent> {
        let g = self.groups.get_mut(self.member_of.get(uid)?)?;
        let plan = g.plan.as_ref()?;
        if plan.slots.iter().all(|s| s.taken) {
            g.plan = None;
            for m in g.members.values_mut() {
                m.slot = None;
            }
            return Some(GroupEvent::new(&g.key, "bound"));
        }
        None
    }

    /// A member deleted (or finished), after its own GPUs were released. Its slot stays reserved for
    /// a replacement until the time-out (a bound member's slot is reserved again on the same GPUs; if
    /// they are gone, the plan is dropped and made again at the next filter); a group with no member
    /// left is dropped with its reservations.
    pub fn forget_member(&mut self, cluster: &mut Cluster, uid: &str) -> Vec<GroupEvent> {
        let Some(key) = self.member_of.remove(uid) else { return Vec::new() };
        let Some(g) = self.groups.get_mut(&key) else { return Vec::new() };
        free_holder(g, uid);
        let mut events = Vec::new();
        let taken = g.members.get(uid).and_then(|m| m.slot).filter(|_| g.plan.is_some());
        let bound_outside = g.members.get(uid).is_some_and(|m| m.bound.is_some() && m.slot.is_none());
        if bound_outside && g.plan.is_some() {
            // the plan was made around it: its replacement needs a slot the plan does not have
            drop_plan(cluster, g);
            let mut ev = GroupEvent::new(&g.key, "replanned");
            ev.reason = Some("a bound member the plan was made around is gone".into());
            events.push(ev);
        }
        if let (Some(i), Some(plan)) = (taken, g.plan.as_mut()) {
            if let Some(slot) = plan.slots.get_mut(i).filter(|s| s.taken) {
                if cluster.allocate(slot.reservation.clone()).is_ok() {
                    slot.taken = false;
                    slot.holder = None;
                } else {
                    drop_plan(cluster, g);
                }
            }
        }
        g.members.remove(uid);
        if !g.members.is_empty() {
            return events;
        }
        let Some(mut g) = self.groups.remove(&key) else { return events };
        let had_plan = g.plan.is_some();
        drop_plan(cluster, &mut g);
        if had_plan {
            events.push(GroupEvent::new(&key, "deleted"));
        }
        events
    }

    /// Whether the pod (by UID) is a known member of some group.
    pub fn is_member(&self, uid: &str) -> bool {
        self.member_of.contains_key(uid)
    }

    /// Whether some plan is past the time-out.
    pub fn any_expired(&self, now: Instant) -> bool {
        self.groups.values().any(|g| g.plan.as_ref().is_some_and(|p| now.duration_since(p.made) >= self.timeout))
    }

    /// Ends the reservations of plans past the time-out.
    pub fn expire(&mut self, cluster: &mut Cluster, now: Instant, events: &mut Vec<GroupEvent>) {
        for g in self.groups.values_mut() {
            if g.plan.as_ref().is_some_and(|p| now.duration_since(p.made) >= self.timeout) {
                drop_plan(cluster, g);
                g.expired = true;
                let mut ev = GroupEvent::new(&g.key, "expired");
                ev.reason = Some(format!("reservation older than {} s", self.timeout.as_secs()));
                events.push(ev);
            }
        }
    }

    /// After nodes changed: a plan whose reservation is no longer counted where it was planned (the
    /// node left, or the reservation no longer fits its GPUs) is dropped, and its unbound members are
    /// planned again at their next filter. Reservations parked with a removed node are not kept.
    pub fn nodes_changed(&mut self, cluster: &mut Cluster) -> Vec<GroupEvent> {
        let mut events = Vec::new();
        for g in self.groups.values_mut() {
            let broken = g.plan.as_ref().is_some_and(|p| {
                p.slots.iter().any(|s| {
                    !s.taken && {
                        let r = &s.reservation;
                        match cluster.assignment(&r.pod) {
                            Some(a) if a.node == r.node => {
                                let n = cluster.node(&r.node);
                                n.is_none_or(|n| {
                                    r.gpus().iter().any(|&gi| !n.gpus.get(gi as usize).is_some_and(|x| x.healthy))
                                })
                            }
                            _ => true,
                        }
                    }
                })
            });
            if broken {
                drop_plan(cluster, g);
                let mut ev = GroupEvent::new(&g.key, "replanned");
                ev.reason = Some("a planned node left or lost a planned GPU".into());
                events.push(ev);
            }
        }
        events
    }

    /// After the cluster's allocations were rebuilt from the API server: reservations are gone from
    /// it, so every plan is forgotten (the unbound members are planned again at their next filter).
    pub fn forget_plans(&mut self) {
        for g in self.groups.values_mut() {
            g.plan = None;
            g.failure = None;
            for m in g.members.values_mut() {
                m.slot = None;
            }
        }
    }

    /// Every group's totals now.
    pub fn totals(&self, cluster: &Cluster) -> GroupTotals {
        let s = self.stats(cluster, Instant::now());
        GroupTotals { waiting: s.waiting, reserved_gpus: (s.gpus_reserved * 1000.0).round() / 1000.0 }
    }

    /// `events` with the totals after them.
    pub fn stamped(&self, cluster: &Cluster, mut events: Vec<GroupEvent>) -> Vec<GroupEvent> {
        if !events.is_empty() {
            let t = self.totals(cluster);
            for e in &mut events {
                e.totals = Some(t);
            }
        }
        events
    }

    pub fn stats(&self, cluster: &Cluster, now: Instant) -> GroupStats {
        let mut s = GroupStats::default();
        for g in self.groups.values() {
            match &g.plan {
                Some(p) => {
                    s.planned += 1;
                    s.oldest_plan_s = s.oldest_plan_s.max(now.duration_since(p.made).as_secs_f64());
                    s.gpus_reserved += p
                        .slots
                        .iter()
                        .filter(|x| !x.taken)
                        .map(|x| reserved_share(cluster, &x.reservation))
                        .sum::<f64>();
                }
                None if g.members.values().any(|m| m.bound.is_none()) => s.waiting += 1,
                None => {}
            }
        }
        s
    }

    /// Every group, by key.
    pub fn report(&self, cluster: &Cluster, now: Instant) -> Vec<GroupReport> {
        let mut out: Vec<GroupReport> = self
            .groups
            .values()
            .map(|g| GroupReport {
                group: g.key.clone(),
                gang: g.gang,
                size: g.size,
                members_seen: g.members.len(),
                members_bound: g.members.values().filter(|m| m.bound.is_some()).count(),
                domain: g.plan.as_ref().map(|p| p.domain.clone()),
                reserved: g
                    .plan
                    .iter()
                    .flat_map(|p| p.slots.iter().filter(|s| !s.taken))
                    .map(|s| ReservedSlot {
                        node: s.reservation.node.clone(),
                        gpus: s.reservation.gpus(),
                        gpu_share: reserved_share(cluster, &s.reservation),
                    })
                    .collect(),
                plan_age_s: g.plan.as_ref().map(|p| now.duration_since(p.made).as_secs_f64()),
                waiting: if g.plan.is_none() && g.members.values().any(|m| m.bound.is_none()) {
                    g.failure.as_ref().map(|f| f.reason.clone())
                } else {
                    None
                },
            })
            .collect();
        out.sort_by(|a, b| a.group.cmp(&b.group));
        out
    }

    /// A node kube-scheduler would not place the member on (not among its candidates): excluded from
    /// the group's next plan, and the current plan dropped. Only for plain groups: a gang's cycle
    /// offers one topology domain at a time, so a planned node missing from one call says nothing.
    pub fn planned_node_refused(&mut self, cluster: &mut Cluster, uid: &str, node: &str) -> Vec<GroupEvent> {
        let Some(g) = self.member_of.get(uid).and_then(|k| self.groups.get_mut(k)) else { return Vec::new() };
        if g.gang {
            return Vec::new();
        }
        g.excluded.insert(node.to_string());
        drop_plan(cluster, g);
        let mut ev = GroupEvent::new(&g.key, "replanned");
        ev.reason = Some(format!("kube-scheduler did not offer planned node {node}"));
        vec![ev]
    }
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

/// GPUs' worth a reservation holds.
fn reserved_share(cluster: &Cluster, a: &PodAssignment) -> f64 {
    let Some(node) = cluster.node(&a.node) else { return 0.0 };
    a.holdings()
        .map(|(g, mem, core, whole)| {
            if whole {
                return 1.0;
            }
            let cap = node.gpus.get(g as usize).map_or(0, |x| x.memory_mib);
            crate::core::assignment::share_fraction(mem, core, cap)
        })
        .sum()
}

/// Releases a plan's unbound reservations from the cluster and forgets the plan.
fn drop_plan(cluster: &mut Cluster, g: &mut Group) {
    if let Some(plan) = g.plan.take() {
        for s in plan.slots.iter().filter(|s| !s.taken) {
            if cluster.assignment(&s.reservation.pod).is_some() {
                let _ = cluster.release(&s.reservation.pod);
            }
        }
    }
    for m in g.members.values_mut() {
        m.slot = None;
    }
}

/// Frees the slot a member held (its reservation stays, for a replacement).
fn free_holder(g: &mut Group, uid: &str) {
    let Some(m) = g.members.get(uid) else { return };
    if let (Some(i), Some(plan)) = (m.slot, g.plan.as_mut()) {
        if let Some(s) = plan.slots.get_mut(i) {
            if s.holder.as_deref() == Some(uid) && !s.taken {
                s.holder = None;
            }
        }
    }
}

/// The member's slot (held already, or a free one of its shape).
fn take_slot(g: &mut Group, uid: &str) -> Option<Verdict> {
    let plan = g.plan.as_mut()?;
    let m = g.members.get_mut(uid)?;
    if let Some(i) = m.slot {
        let s = plan.slots.get(i)?;
        if s.holder.as_deref() == Some(uid) && !s.taken && same_shape(&s.request, &m.request) {
            return Some(Verdict::Planned { node: s.reservation.node.clone() });
        }
    }
    let i = plan.slots.iter().position(|s| s.holder.is_none() && !s.taken && same_shape(&s.request, &m.request))?;
    plan.slots[i].holder = Some(uid.to_string());
    m.slot = Some(i);
    Some(Verdict::Planned { node: plan.slots[i].reservation.node.clone() })
}

/// Plans every member not bound yet and counts the reservations. `Err(reason)` when no plan exists.
fn make_plan(
    g: &mut Group,
    cluster: &mut Cluster,
    engine: &Engine,
    now: Instant,
    now_unix_ms: i64,
) -> Result<GroupEvent, String> {
    let bound: Vec<&Member> = g.members.values().filter(|m| m.bound.is_some()).collect();
    let placed_nodes: Vec<usize> = {
        let mut v: Vec<usize> = bound.iter().filter_map(|m| cluster.node_index(m.bound.as_deref()?)).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let to_place = g.size.saturating_sub(bound.len());
    if to_place == 0 {
        return Err(format!("group {} has every pod bound", group_name(&g.key)));
    }
    // the known unbound members' requests, then the first one's shape for members not seen yet
    let mut requests: Vec<PodRequest> =
        g.members.values().filter(|m| m.bound.is_none()).map(|m| m.request.clone()).take(to_place).collect();
    let template =
        requests.first().cloned().ok_or_else(|| format!("group {} has no pod to plan", group_name(&g.key)))?;
    while requests.len() < to_place {
        requests.push(template.clone());
    }
    for (i, r) in requests.iter_mut().enumerate() {
        r.key = reservation_key(&g.key, i);
    }
    let excluded: Vec<usize> = g.excluded.iter().filter_map(|n| cluster.node_index(n)).collect();
    let ask = GroupAsk {
        key: &g.key,
        members: &requests,
        placed_nodes: &placed_nodes,
        required_keys: &g.required,
        excluded: &excluded,
    };
    let plan: GroupPlan = plan_group(engine, cluster, &ask, now_unix_ms).map_err(|e| e.reason)?;
    let mut counted: Vec<String> = Vec::new();
    for s in &plan.slots {
        if let Err(e) = cluster.allocate(s.clone()) {
            for k in &counted {
                let _ = cluster.release(k);
            }
            return Err(format!("group {} plan could not be reserved: {e}", group_name(&g.key)));
        }
        counted.push(s.pod.clone());
    }
    let mut ev = GroupEvent::new(&g.key, "planned");
    ev.domain = Some(plan.domain.clone());
    ev.nodes = plan.slots.iter().map(|s| s.node.clone()).collect();
    g.plan = Some(Plan {
        domain: plan.domain,
        slots: plan
            .slots
            .into_iter()
            .zip(requests)
            .map(|(reservation, request)| Slot { reservation, request, holder: None, taken: false })
            .collect(),
        made: now,
    });
    g.expired = false;
    Ok(ev)
}
