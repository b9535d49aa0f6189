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
//! An elastic group (a quorum below its size: a PodGroup's `minCount` below the pods that name it,
//! `gpuplace.io/group-min`) starts with the most members that fit, at least its quorum, and the rest
//! join one by one beside the members placed as room appears ([`MemberVerdict::Waits`] while they cannot),
//! never taking room that a whole waiting group could use now.
//!
//! A plan's unbound reservations end when the group is bound, when every member is deleted, after
//! the time-out (kube-scheduler's own gang wait at Permit is 5 minutes, `permitTimeoutDuration` in
//! its GangScheduling plugin; the default here is the same), or when a planned node leaves or loses
//! a planned GPU (the unbound members are planned again). After a time-out the group is planned again
//! only once all its members exist, so a group short of pods does not hold GPUs over and over.
//! Reservations live in memory only: a restart (or a new leader) starts without them, counts the
//! bound members from their assignment annotations, and plans the rest again at their next filter.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::placement::engine::Engine;
use crate::placement_log::{GroupEvent, GroupTotals};
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::PodRequest;

mod group;
mod planning;

pub use group::{fingerprint, is_reservation, reservation_key, Arrival, MemberVerdict, PodGroupInfo};
use group::{free_holder, Group, Member};
use planning::{decide, Planning};

/// kube-scheduler v1.36's gang time-out (GangScheduling's Permit wait).
pub const DEFAULT_GROUP_TIMEOUT: Duration = Duration::from_secs(300);

/// One group as `/inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct GroupReport {
    pub group: String,
    pub gang: bool,
    pub size: usize,
    /// Members it needs to start (the size unless it is elastic).
    #[serde(default)]
    pub min: usize,
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

/// Every group's members and plan.
#[derive(Debug)]
pub struct Groups {
    groups: HashMap<String, Group>,
    member_of: HashMap<String, String>,
    pod_groups: HashMap<String, PodGroupInfo>,
    timeout: Duration,
    /// Reservations only for members that exist (API-server mode, where the pod watcher sees every
    /// pod): a `gpuplace.io/group-size` larger than the pods created reserves nothing for the rest.
    only_existing: bool,
}

impl Default for Groups {
    fn default() -> Self {
        Self::new(DEFAULT_GROUP_TIMEOUT)
    }
}

impl Groups {
    pub fn new(timeout: Duration) -> Self {
        Self {
            groups: HashMap::new(),
            member_of: HashMap::new(),
            pod_groups: HashMap::new(),
            timeout,
            only_existing: false,
        }
    }

    /// Plans and reservations for the members that exist only: every pod is watched, so a group's
    /// members are known before their filters (`observe_pending`). Without it (static mode, where
    /// members are known only from their filters) a plan reserves for the group's whole size.
    pub fn reserve_only_for_existing(&mut self) {
        self.only_existing = true;
    }

    /// A PodGroup seen (or changed) on the API server, by `namespace/name`.
    pub fn observe_pod_group(&mut self, key: &str, info: PodGroupInfo) {
        if let Some(g) = self.groups.get_mut(key) {
            if let Some(m) = info.min_count {
                g.size = g.size.max(m as usize);
                g.min = m as usize;
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
    pub fn settled(&self, cluster: &Cluster, arrival: &Arrival<'_>, now: Instant) -> Option<MemberVerdict> {
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
            let Some(i) = m.slot else {
                // a member beyond the plan whose last try to join failed on this same state
                let f = g.failure.as_ref()?;
                return (f.fingerprint == fingerprint(cluster))
                    .then(|| MemberVerdict::Waits { reason: f.reason.clone() });
            };
            let slot = plan.slots.get(i)?;
            return (!slot.taken).then(|| MemberVerdict::Planned { node: slot.reservation.node.clone() });
        }
        let f = g.failure.as_ref()?;
        (f.fingerprint == fingerprint(cluster)).then(|| MemberVerdict::NoPlan { reason: f.reason.clone() })
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
    ) -> (MemberVerdict, Vec<GroupEvent>) {
        let mut events = Vec::new();
        let Some(spec) = arrival.request.group.clone() else { return (MemberVerdict::Single, events) };
        self.expire(cluster, now, &mut events);
        let info = self.pod_groups.get(&spec.key).cloned();
        // out of the map while it is decided, so that the other groups can be read (room kept for them)
        let mut g = self.groups.remove(&spec.key).unwrap_or_else(|| Group::new(&spec));
        g.settle_spec(&spec, info.as_ref());
        if let Some(off) = arrival.excluded {
            g.excluded = off.iter().cloned().collect();
        }
        let ctx =
            Planning { cluster, engine, others: &self.groups, now, now_unix_ms, only_existing: self.only_existing };
        let verdict = if g.gang && info.is_none() && spec.size == 0 {
            MemberVerdict::NoPlan { reason: format!("PodGroup {} is not known to gpuplace yet; retry", spec.key) }
        } else if g.size <= 1 {
            MemberVerdict::Single
        } else {
            g.register(&mut self.member_of, arrival.uid, arrival.request);
            decide(&mut g, ctx, arrival.uid, &mut events)
        };
        self.groups.insert(spec.key, g);
        (verdict, events)
    }

    /// A member seen pending on the API server before any filter: a gang's size is every pod that
    /// names its PodGroup, so a plan is made for all of them, not only `minCount`.
    ///
    /// Returns the group's other pending members (`namespace/name`, UID) when this one completes the
    /// members it needs to start and it has no plan: those turned away while it waited for its pods
    /// get no retry from kube-scheduler until a cluster event, so the caller requeues them.
    pub fn observe_pending(&mut self, uid: &str, request: &PodRequest) -> Vec<(String, String)> {
        let Some(spec) = &request.group else { return Vec::new() };
        if self.groups.get(&spec.key).and_then(|g| g.members.get(uid)).is_some_and(|m| m.request == *request) {
            return Vec::new();
        }
        let info = self.pod_groups.get(&spec.key).cloned();
        let g = self.groups.entry(spec.key.clone()).or_insert_with(|| Group::new(spec));
        g.settle_spec(spec, info.as_ref());
        let before = g.members.len();
        g.register(&mut self.member_of, uid, request);
        let completed = before < g.quorum() && g.members.len() >= g.quorum();
        if !(self.only_existing && completed && g.plan.is_none() && g.size > 1) {
            return Vec::new();
        }
        g.failure = None;
        g.members
            .iter()
            .filter(|(u, m)| u.as_str() != uid && m.bound.is_none())
            .map(|(u, m)| (m.key.clone(), u.clone()))
            .collect()
    }

    /// Whether the pending pod is a member already registered with this request.
    pub fn knows_pending(&self, uid: &str, request: &PodRequest) -> bool {
        request.group.as_ref().is_none_or(|spec| {
            self.groups.get(&spec.key).and_then(|g| g.members.get(uid)).is_some_and(|m| m.request == *request)
        })
    }

    /// After a re-list: members that never bound and that the list no longer shows are forgotten.
    pub fn retain_listed(
        &mut self,
        cluster: &mut Cluster,
        listed: &std::collections::HashSet<String>,
    ) -> Vec<GroupEvent> {
        let gone: Vec<String> = self
            .groups
            .values()
            .flat_map(|g| {
                g.members.iter().filter(|(u, m)| m.bound.is_none() && !listed.contains(*u)).map(|(u, _)| u.clone())
            })
            .collect();
        gone.iter().flat_map(|u| self.forget_member(cluster, u)).collect()
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

    /// The node a member is counted as bound to.
    pub fn bound_node(&self, uid: &str) -> Option<&str> {
        self.groups.get(self.member_of.get(uid)?)?.members.get(uid)?.bound.as_deref()
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
                min: g.quorum(),
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

/// GPUs' worth a reservation holds.
fn reserved_share(cluster: &Cluster, a: &PodAssignment) -> f64 {
    let Some(node) = cluster.node(&a.node) else { return 0.0 };
    a.holdings()
        .map(|(g, mem, core, whole)| {
            if whole {
                return 1.0;
            }
            let cap = node.gpus.get(g as usize).map_or(0, |x| x.memory_mib);
            gpuplace_core::assignment::share_fraction(mem, core, cap)
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
