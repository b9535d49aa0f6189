//! Filter and bind for members of a group (`scheduler::groups` holds the plans and reservations):
//! each member goes to its planned node only; a group with no plan has every member turned away.
//!
//! How a group with no plan is turned away depends on who schedules it. A plain group's members are
//! single pods to kube-scheduler, so every node gets the group's reason (`FailedAndUnresolvableNodes`:
//! evicting pods from one node cannot place a whole group) and kube-scheduler backs each pod off as
//! usual. A gang (PodGroup) is answered with the filter's `Error` instead: kube-scheduler v1.36 sends
//! a gang member that a filter rejected back after back-off, but pops its back-off queue early
//! whenever its active queue is empty (`SchedulerPopFromBackoffQ`, on by default) and pulls every
//! sibling into the same cycle, so a rejected gang is retried at once, without end (docs/resources.md,
//! "Gangs and kube-scheduler's back-off"). An error puts the members in the error back-off queue,
//! which is never popped early (1, 2, 4, 8, then every 10 s). The error is answered only when no node
//! anywhere could take the group; inside a plan, a topology domain kube-scheduler tries that is not
//! the plan's gets plain node rejections, since an error would abort the whole group cycle.

use std::sync::Arc;
use std::time::Instant;

use super::{Scheduler, State};
use crate::placement::group_plan::group_name;
use crate::placement_log::GroupEvent;
use crate::placement_log::{Decision, PLACEMENT_LOG_VERSION};
use crate::scheduler::groups::{Arrival, MemberVerdict, PodGroupInfo};
use crate::scheduler::input::PodView;
use crate::scheduler::reasons::prefixed;
use crate::scheduler::verdict_cache::RejectClass;
use crate::scheduler::verdict_cache::{Answer, Candidates, FilterDecision, Reason};
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::resources::PodRequest;

impl Scheduler {
    /// A kube-scheduler PodGroup seen or changed (`namespace/name`): its `minCount` and topology keys
    /// apply to the group of that name.
    pub fn observe_pod_group(&self, key: &str, info: PodGroupInfo) {
        let known = self.read().groups.pod_group(key) == Some(&info);
        if !known {
            self.write().groups.observe_pod_group(key, info);
        }
    }

    /// The `spec.schedulingConstraints.topology` keys of the PodGroup `key` (`namespace/name`), as
    /// last seen (none when it is not known).
    pub fn pod_group_topology(&self, key: &str) -> Vec<String> {
        self.read().groups.pod_group(key).map(|p| p.topology_keys.clone()).unwrap_or_default()
    }

    /// A PodGroup deleted: its group's reservations end.
    pub fn forget_pod_group(&self, key: &str) {
        self.change_groups(|st| ((), st.groups.forget_pod_group(&mut st.cluster, key)));
    }

    /// Changes the groups under the state's write lock, then logs what happened, each event with
    /// every group's totals right after the change.
    pub(super) fn change_groups<T>(&self, change: impl FnOnce(&mut State) -> (T, Vec<GroupEvent>)) -> T {
        let (out, events) = {
            let mut guard = self.write();
            let st = &mut *guard;
            let (out, events) = change(st);
            (out, st.groups.stamped(&st.cluster, events))
        };
        self.group_events(events);
        out
    }

    /// Filter's answer for a group member (`None`: judge it as a single pod).
    pub(super) fn group_filter<'a>(
        &self,
        pod: &dyn PodView,
        req: &PodRequest,
        names: &[&'a str],
        d: &mut Decision,
    ) -> Option<FilterDecision<'a>> {
        let group = req.group.as_ref()?;
        let uid = pod.uid();
        let arrival = Arrival { uid, request: req, excluded: None };
        // before the state is read: a freeing stamped later is not in the verdict
        let now = Instant::now();
        let settled = {
            let st = self.read();
            st.groups.settled(&st.cluster, &arrival, now)
        };
        let verdict = match settled {
            Some(v) => v,
            None => {
                let mut v = self.admit(&arrival, now);
                if let MemberVerdict::Planned { node } = &v {
                    // a plain group's member is offered every node kube-scheduler found feasible: one
                    // missing from the list will not be taken, so the group is planned without it
                    if !group.pod_group && !names.is_empty() && !names.contains(&node.as_str()) {
                        self.change_groups(|st| ((), st.groups.planned_node_refused(&mut st.cluster, uid, node)));
                        v = self.admit(&arrival, now);
                    }
                }
                v
            }
        };
        d.group = Some(group.key.clone());
        let (answers, text) = match verdict {
            MemberVerdict::Single => return None,
            MemberVerdict::NoPlan { reason } if group.pod_group => {
                let text = prefixed(&reason);
                d.error = Some(text.clone());
                d.rejection_classes.insert(RejectClass::Unresolvable.name().into(), names.len());
                self.metrics.rejection(RejectClass::Unresolvable, names.len() as u64);
                self.metrics.pod_filtered(uid, Some(RejectClass::Unresolvable), Instant::now());
                return Some(FilterDecision::Error(text));
            }
            MemberVerdict::NoPlan { reason } | MemberVerdict::Waits { reason } => {
                let r = Arc::new(Reason::new(RejectClass::Unresolvable, prefixed(&reason)));
                (names.iter().map(|_| Answer::No(r.clone())).collect::<Vec<_>>(), r.text.clone())
            }
            MemberVerdict::Planned { node } => {
                let r = Arc::new(Reason::new(
                    RejectClass::Unresolvable,
                    prefixed(&format!("group {} holds a place for this pod on another node", group_name(&group.key))),
                ));
                d.planned_node = Some(node.clone());
                let answers =
                    names.iter().map(|n| if *n == node { Answer::Fits(10, 1.0) } else { Answer::No(r.clone()) });
                (answers.collect(), r.text.clone())
            }
        };
        let c = Candidates::unresolved(names.to_vec());
        let mut feasible = 0;
        let mut rejected = 0;
        for p in c.unique() {
            match &answers[p] {
                Answer::Fits(..) => feasible += 1,
                Answer::No(_) => rejected += 1,
                Answer::NotOffered => {}
            }
        }
        d.feasible = feasible;
        if rejected > 0 {
            self.metrics.rejection(RejectClass::Unresolvable, rejected as u64);
            d.rejections.insert(text, rejected);
            d.rejection_classes.insert(RejectClass::Unresolvable.name().into(), rejected);
        }
        self.metrics.pod_filtered(uid, (feasible == 0).then_some(RejectClass::Unresolvable), Instant::now());
        // plain rejections get no retry from kube-scheduler until a cluster event: a freeing its
        // retry raced past (the extender's watch later than kube-scheduler's) must requeue it
        self.note_group_verdict(pod, feasible > 0, now);
        Some(FilterDecision::Judged(c, answers))
    }

    /// Prioritize for a group member whose plan holds a slot: 10 on its planned node, 0 elsewhere
    /// (the only node filter passed; its own reservation keeps the engine from scoring it). `None`:
    /// scored as any pod.
    pub(super) fn group_priorities(&self, uid: &str, req: &PodRequest, names: &[&str]) -> Option<Vec<u8>> {
        req.group.as_ref()?;
        let st = self.read();
        match st.groups.settled(&st.cluster, &Arrival { uid, request: req, excluded: None }, Instant::now())? {
            MemberVerdict::Planned { node } => Some(names.iter().map(|n| if *n == node { 10 } else { 0 }).collect()),
            MemberVerdict::NoPlan { .. } | MemberVerdict::Waits { .. } => Some(vec![0; names.len()]),
            MemberVerdict::Single => None,
        }
    }

    fn admit(&self, arrival: &Arrival<'_>, now: Instant) -> MemberVerdict {
        let now_ms = self.now_ms();
        self.change_groups(|st| st.groups.admit(&mut st.cluster, &st.engine, arrival, now, now_ms))
    }

    /// Ends the reservations of plans past the time-out (cheap when none is).
    pub(super) fn expire_groups(&self) {
        let now = Instant::now();
        if !self.read().groups.any_expired(now) {
            return;
        }
        self.change_groups(|st| {
            let mut events = Vec::new();
            st.groups.expire(&mut st.cluster, now, &mut events);
            ((), events)
        });
    }

    /// Writes what happened to groups to the log and the placement log.
    pub(super) fn group_events(&self, events: Vec<GroupEvent>) {
        for e in events {
            tracing::info!(group = %e.group, event = %e.event, domain = ?e.domain, nodes = ?e.nodes, reason = ?e.reason, "group");
            if self.log.is_some() {
                let d = Decision {
                    v: PLACEMENT_LOG_VERSION,
                    ts_unix_ms: gpuplace_core::clock::now_unix_ms(),
                    verb: "group".into(),
                    pod: String::new(),
                    group: Some(e.group.clone()),
                    group_event: Some(e),
                    ..Decision::default()
                };
                self.log(d);
            }
        }
    }

    /// Bind of a group member: the reservation its slot holds on `node`, released so that the member's
    /// own allocation (the same GPUs, under its key) takes its place. A member bound elsewhere gives
    /// its slot up.
    pub(super) fn take_reservation(st: &mut State, uid: &str, key: &str, node: &str) -> Option<PodAssignment> {
        let res = st.groups.reservation_for_bind(uid, node)?;
        st.cluster.release(&res.pod).ok()?;
        let mut a = res;
        a.pod = key.to_string();
        Some(a)
    }

    /// A member's allocation could not be counted after its reservation was released: the
    /// reservation goes back.
    pub(super) fn restore_reservation(st: &mut State, uid: &str, node: &str) {
        if let Some(res) = st.groups.reservation_for_bind(uid, node) {
            let _ = st.cluster.allocate(res);
        }
    }

    /// A member's placement was undone after it took its slot (a failed Binding, or claims not
    /// written): the slot is held for it again, so the other members keep what they hold.
    pub(super) fn return_slot(st: &mut State, uid: &str) {
        if let Some(res) = st.groups.slot_returned(uid) {
            let _ = st.cluster.allocate(res);
        }
    }

    /// A member deleted or finished: forgotten by its group.
    pub(super) fn forget_group_member(&self, uid: &str) {
        if !self.read().groups.is_member(uid) {
            return;
        }
        self.change_groups(|st| ((), st.groups.forget_member(&mut st.cluster, uid)));
    }

    /// After nodes changed (the caller holds the write lock): plans whose reservations no longer
    /// stand are dropped; the events, with the totals after them, for [`Scheduler::group_events`].
    pub(super) fn groups_after_node_change(st: &mut State) -> Vec<GroupEvent> {
        let events = st.groups.nodes_changed(&mut st.cluster);
        st.groups.stamped(&st.cluster, events)
    }
}
