//! How a member's filter is decided: its slot, a plan made for the group (all of it, or for an
//! elastic group the most members that fit), a plan grown for a member that joins later, and the room
//! members beyond a quorum leave to whole groups that wait.

use std::collections::HashMap;
use std::time::Instant;

use super::group::{fingerprint, reservation_key, Failure, Group, MemberVerdict, Plan, Slot};
use crate::placement::engine::Engine;
use crate::placement::group_plan::{group_name, level_name, plan_group, GroupAsk, GroupPlan, NoPlan};
use crate::placement_log::GroupEvent;
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::resources::PodRequest;

/// Two requests that a slot planned for one can serve for the other (same containers and rules).
fn same_shape(a: &PodRequest, b: &PodRequest) -> bool {
    a.containers == b.containers
        && a.init_containers == b.init_containers
        && a.allowed_models == b.allowed_models
        && a.isolation == b.isolation
        && a.numa == b.numa
        && a.gpu_policy == b.gpu_policy
}

/// The member's slot (held already, or a free one of its shape).
fn take_slot(g: &mut Group, uid: &str) -> Option<MemberVerdict> {
    let plan = g.plan.as_mut()?;
    let m = g.members.get_mut(uid)?;
    if let Some(i) = m.slot {
        let s = plan.slots.get(i)?;
        if s.holder.as_deref() == Some(uid) && !s.taken && same_shape(&s.request, &m.request) {
            return Some(MemberVerdict::Planned { node: s.reservation.node.clone() });
        }
    }
    let i = plan.slots.iter().position(|s| s.holder.is_none() && !s.taken && same_shape(&s.request, &m.request))?;
    plan.slots[i].holder = Some(uid.to_string());
    m.slot = Some(i);
    Some(MemberVerdict::Planned { node: plan.slots[i].reservation.node.clone() })
}

/// What planning reads besides the group.
pub(super) struct Planning<'a> {
    pub cluster: &'a mut Cluster,
    pub engine: &'a Engine,
    /// The other groups (a waiting one's room is not taken by members beyond a quorum).
    pub others: &'a HashMap<String, Group>,
    pub now: Instant,
    pub now_unix_ms: i64,
    /// Reserve only for the members that exist (`Groups::reserve_only_for_existing`).
    pub only_existing: bool,
}

/// Where a registered member may go: its slot, a slot made for it, or why it waits.
pub(super) fn decide(g: &mut Group, mut ctx: Planning<'_>, uid: &str, events: &mut Vec<GroupEvent>) -> MemberVerdict {
    if g.members.get(uid).is_some_and(|m| m.bound.is_some()) {
        return MemberVerdict::Single;
    }
    // a slot already held for it, or a free one of its shape
    if let Some(v) = take_slot(g, uid) {
        return v;
    }
    let fp = fingerprint(ctx.cluster);
    if g.plan.is_some() {
        if g.placed() >= g.size {
            // more members than the group's size: judged as a single
            return MemberVerdict::Single;
        }
        // a member beyond the plan (an elastic group's, or one seen after the plan): it joins near
        // the others when room allows
        if let Some(f) = g.failure.as_ref().filter(|f| f.fingerprint == fp) {
            return MemberVerdict::Waits { reason: f.reason.clone() };
        }
        return match grow_plan(g, &mut ctx, uid) {
            Ok(ev) => {
                g.failure = None;
                events.push(ev);
                take_slot(g, uid).unwrap_or(MemberVerdict::Single)
            }
            Err(reason) => {
                g.failure = Some(Failure { fingerprint: fingerprint(ctx.cluster), reason: reason.clone() });
                MemberVerdict::Waits { reason }
            }
        };
    }
    if (g.expired || ctx.only_existing) && g.members.len() < g.quorum() {
        let all = if g.quorum() == g.size { "all " } else { "" };
        let why = if g.expired { "after its reservation timed out" } else { "before it reserves room for them" };
        let reason = format!(
            "group {} waits for {all}{} pods ({} exist) {why}",
            group_name(&g.key),
            g.quorum(),
            g.members.len()
        );
        return MemberVerdict::NoPlan { reason };
    }
    if let Some(f) = g.failure.as_ref().filter(|f| f.fingerprint == fp) {
        return MemberVerdict::NoPlan { reason: f.reason.clone() };
    }
    match make_plan(g, &mut ctx) {
        Ok(ev) => {
            g.failure = None;
            events.push(ev);
            take_slot(g, uid).unwrap_or(MemberVerdict::Single)
        }
        Err(reason) => {
            let mut ev = GroupEvent::new(&g.key, "no_plan");
            ev.reason = Some(reason.clone());
            if g.failure.as_ref().is_none_or(|f| f.reason != reason) {
                events.push(ev);
            }
            g.failure = Some(Failure { fingerprint: fingerprint(ctx.cluster), reason: reason.clone() });
            MemberVerdict::NoPlan { reason }
        }
    }
}

/// The nodes of the members bound and of the slots reserved and not taken.
fn placed_nodes(g: &Group, cluster: &Cluster) -> Vec<usize> {
    let bound = g.members.values().filter_map(|m| m.bound.as_deref());
    let reserved = g.plan.iter().flat_map(|p| p.slots.iter().filter(|s| !s.taken).map(|s| s.reservation.node.as_str()));
    let mut v: Vec<usize> = bound.chain(reserved).filter_map(|n| cluster.node_index(n)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Plans `count` of the members not bound yet (the known ones' requests, then the first one's shape
/// for members not seen yet), around the members placed; nothing is counted.
fn plan_members(
    g: &Group,
    ctx: &mut Planning<'_>,
    count: usize,
    first_slot: usize,
) -> Result<(GroupPlan, Vec<PodRequest>), String> {
    let mut requests: Vec<PodRequest> = g
        .members
        .values()
        .filter(|m| m.bound.is_none() && m.slot.is_none())
        .map(|m| m.request.clone())
        .take(count)
        .collect();
    let template =
        requests.first().cloned().ok_or_else(|| format!("group {} has no pod to plan", group_name(&g.key)))?;
    while requests.len() < count {
        requests.push(template.clone());
    }
    for (i, r) in requests.iter_mut().enumerate() {
        r.key = reservation_key(&g.key, first_slot + i);
    }
    let plan = plan_around(g, ctx, &requests).map_err(|e| e.reason)?;
    Ok((plan, requests))
}

/// Plans `requests` for `g` around its members placed (bound or reserved), under its required keys,
/// off the nodes kube-scheduler turned down; nothing is counted.
fn plan_around(g: &Group, ctx: &mut Planning<'_>, requests: &[PodRequest]) -> Result<GroupPlan, NoPlan> {
    let placed = placed_nodes(g, ctx.cluster);
    let excluded: Vec<usize> = g.excluded.iter().filter_map(|n| ctx.cluster.node_index(n)).collect();
    let ask = GroupAsk {
        key: &g.key,
        members: requests,
        placed_nodes: &placed,
        required_keys: &g.required,
        excluded: &excluded,
    };
    plan_group(ctx.engine, ctx.cluster, &ask, ctx.now_unix_ms)
}

/// Counts `slots` in the cluster, all or none.
fn count_slots(cluster: &mut Cluster, slots: &[PodAssignment]) -> Result<(), String> {
    for (i, s) in slots.iter().enumerate() {
        if let Err(e) = cluster.allocate(s.clone()) {
            uncount_slots(cluster, &slots[..i]);
            return Err(e.to_string());
        }
    }
    Ok(())
}

fn uncount_slots(cluster: &mut Cluster, slots: &[PodAssignment]) {
    for s in slots {
        let _ = cluster.release(&s.pod);
    }
}

/// A waiting group that could start now and could not once `slots` are counted: members beyond a
/// quorum never take the room a whole group needs. Only groups whose last try failed on another
/// cluster state can be hurt (on this one they do not fit anyway), so most waiting groups cost a
/// comparison.
fn room_kept_for(ctx: &mut Planning<'_>, slots: &[PodAssignment]) -> Option<String> {
    let fp = fingerprint(ctx.cluster);
    let others = ctx.others;
    let waiting: Vec<&Group> = others
        .values()
        .filter(|w| w.plan.is_none() && w.failure.as_ref().is_some_and(|f| f.fingerprint != fp))
        .filter(|w| !(w.expired && w.members.len() < w.quorum()))
        .collect();
    for w in waiting {
        let need = w.quorum().saturating_sub(w.bound());
        if need == 0 {
            continue;
        }
        if count_slots(ctx.cluster, slots).is_err() {
            return None;
        }
        let fits_after = plan_members(w, ctx, need, 0).is_ok();
        uncount_slots(ctx.cluster, slots);
        if !fits_after && plan_members(w, ctx, need, 0).is_ok() {
            return Some(w.key.clone());
        }
    }
    None
}

/// Why no more members of a group that has `placed` of them placed (its quorum or more) join now.
/// The count is of pods placed only: a gang's size grows as its pods are seen, so a total could read
/// low for a moment.
fn more_reason(g: &Group, placed: usize) -> String {
    let name = group_name(&g.key);
    match g.required.last() {
        Some(k) => format!("group {name} has {placed} pods placed; its {} has no room for more", level_name(k)),
        None => format!("group {name} has {placed} pods placed; no room for more now"),
    }
}

fn kept_reason(g: &Group, placed: usize, waiting: &str) -> String {
    format!(
        "group {} has {placed} pods placed; room for more is kept for group {}",
        group_name(&g.key),
        group_name(waiting)
    )
}

/// Plans the members not bound yet and counts the reservations: all of them, or (an elastic group)
/// the most that fit, at least as many as it needs to start. `Err(reason)` when no plan exists.
fn make_plan(g: &mut Group, ctx: &mut Planning<'_>) -> Result<GroupEvent, String> {
    let bound = g.bound();
    // room only for pods that exist, where every pod is watched: a size no pods back holds nothing
    let exist = if ctx.only_existing { g.members.len().min(g.size) } else { g.size };
    let to_place = exist.saturating_sub(bound);
    if to_place == 0 {
        return Err(format!("group {} has every pod bound", group_name(&g.key)));
    }
    // members it needs to start (0: it has started and the rest join as room allows)
    let need = g.quorum().saturating_sub(bound);
    let lo = need.max(1);
    let mut planned = plan_members(g, ctx, to_place, 0);
    if planned.is_err() && lo < to_place {
        // feasibility falls with the count: the largest count that plans, by bisection
        let (mut l, mut h) = (lo, to_place - 1);
        while l <= h {
            let m = l + (h - l) / 2;
            match plan_members(g, ctx, m, 0) {
                Ok(p) => {
                    planned = Ok(p);
                    l = m + 1;
                }
                Err(e) => {
                    if planned.is_err() {
                        planned = Err(e);
                    }
                    h = m - 1;
                }
            }
        }
    }
    let (mut plan, mut requests) = match planned {
        Ok(p) => p,
        Err(_) if need == 0 => return Err(more_reason(g, bound)),
        Err(e) => return Err(e),
    };
    if plan.slots.len() > need {
        if let Some(w) = room_kept_for(ctx, &plan.slots) {
            if need == 0 {
                return Err(kept_reason(g, bound, &w));
            }
            (plan, requests) = plan_members(g, ctx, need, 0)?;
        }
    }
    count_slots(ctx.cluster, &plan.slots)
        .map_err(|e| format!("group {} plan could not be reserved: {e}", group_name(&g.key)))?;
    let mut ev = GroupEvent::new(&g.key, "planned");
    ev.domain = Some(plan.domain.clone());
    ev.nodes = plan.slots.iter().map(|s| s.node.clone()).collect();
    if plan.slots.len() < to_place {
        ev.reason =
            Some(format!("{} of {} pods to place fit; the rest join as room appears", plan.slots.len(), to_place));
    }
    g.plan = Some(Plan {
        domain: plan.domain,
        slots: plan
            .slots
            .into_iter()
            .zip(requests)
            .map(|(reservation, request)| Slot { reservation, request, holder: None, taken: false })
            .collect(),
        made: ctx.now,
    });
    g.expired = false;
    Ok(ev)
}

/// Adds a slot for a member beyond the plan, near the members placed, unless a waiting group needs
/// the room.
fn grow_plan(g: &mut Group, ctx: &mut Planning<'_>, uid: &str) -> Result<GroupEvent, String> {
    let Some(plan) = g.plan.as_ref() else { return Err(format!("group {} has no plan", group_name(&g.key))) };
    let placed = g.placed();
    let next = plan.slots.len();
    let Some(m) = g.members.get(uid) else { return Err(format!("group {} does not know the pod", group_name(&g.key))) };
    let mut request = m.request.clone();
    request.key = reservation_key(&g.key, next);
    let grown = plan_around(g, ctx, std::slice::from_ref(&request)).map_err(|_| more_reason(g, placed))?;
    if let Some(w) = room_kept_for(ctx, &grown.slots) {
        return Err(kept_reason(g, placed, &w));
    }
    count_slots(ctx.cluster, &grown.slots)
        .map_err(|e| format!("group {} plan could not be reserved: {e}", group_name(&g.key)))?;
    let mut ev = GroupEvent::new(&g.key, "grown");
    ev.domain = Some(grown.domain.clone());
    ev.nodes = grown.slots.iter().map(|s| s.node.clone()).collect();
    if let (Some(plan), Some(reservation)) = (g.plan.as_mut(), grown.slots.into_iter().next()) {
        plan.slots.push(Slot { reservation, request, holder: None, taken: false });
    }
    Ok(ev)
}
