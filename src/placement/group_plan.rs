//! Whole-group plans: nodes and exact GPUs for every member of a group (a gang of training pods, a
//! set of fractional trials) at once, in the tightest topology domain that holds them all.
//!
//! kube-scheduler decides one pod at a time. A group placed that way ends partly bound when the room
//! runs out halfway, and members filtered one by one cannot know what kube-scheduler already assumed
//! for their siblings. So the extender asks this module for a plan when a group's first member
//! arrives, holds the plan's GPUs as reservations (see `scheduler::groups`), and sends each member to
//! its planned node only. No plan means no member is placed at all.
//!
//! Domains, tightest first: one node (NVLink sets inside it come from the engine's GPU choice), then
//! the cluster's network levels from the leaf switch up (`network.gpuplace.io/tor`, then `.../spine`),
//! then the whole cluster. Topology keys that the group *requires* (a PodGroup's
//! `schedulingConstraints.topology`, or `gpuplace.io/group-topology`) split the nodes first: every
//! member lands on nodes sharing the value of each required key, and nodes without the key are never
//! used. Within the tightest scope that can hold the group, the domain with the least free capacity
//! that holds it wins (best fit), so that larger free domains stay whole for larger groups.
//!
//! No I/O. Trial allocations are made on the caller's cluster and taken back before
//! [`plan_group`] returns: its allocations are as they were (the nodes' generation stamps move on).
//! A copy of a cluster of thousands of nodes and pods cost more than the whole plan.

use std::collections::BTreeMap;

use crate::placement::engine::Engine;
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::{GpuDemand, PodRequest};

/// What to plan for.
#[derive(Debug, Clone, Copy)]
pub struct GroupAsk<'a> {
    /// `namespace/name` of the group: written into each slot's assignment (`PodAssignment::group`).
    pub key: &'a str,
    /// One request per member still to place. Each slot's assignment carries that request's key.
    pub members: &'a [PodRequest],
    /// Nodes (indices) holding members already bound: the domain must contain all of them.
    pub placed_nodes: &'a [usize],
    /// Node label keys whose value all members must share (PodGroup topology constraints).
    pub required_keys: &'a [String],
    /// Nodes (indices) not to plan on (kube-scheduler turned them down for this group).
    pub excluded: &'a [usize],
}

/// How far apart a plan's members may be.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// All members on one node.
    Node,
    /// All members share the values of the first `k + 1` network levels (k = 0: the coarsest,
    /// e.g. the spine; the last level is the leaf switch).
    Level(usize),
    /// Anywhere (within the required keys' domain).
    Cluster,
}

/// A plan: one assignment per member, in the order of [`GroupAsk::members`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupPlan {
    pub scope: Scope,
    /// The domain in words: `node gpu-03`, `tor tor-2`, `spine spine-0`, `cluster`.
    pub domain: String,
    pub slots: Vec<PodAssignment>,
}

impl GroupPlan {
    /// Distinct nodes the plan uses.
    pub fn nodes(&self) -> Vec<&str> {
        let mut n: Vec<&str> = self.slots.iter().map(|s| s.node.as_str()).collect();
        n.sort_unstable();
        n.dedup();
        n
    }
}

/// Why no plan exists: a reason for kube-scheduler (the same text for every node and member, no
/// node's figures, no `%`), and figures for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoPlan {
    pub reason: String,
    /// The most members any single domain of the loosest allowed scope could hold.
    pub best: usize,
    pub needed: usize,
}

/// A group's name without its namespace (`ml/job-7` → `job-7`), as reasons name it.
pub fn group_name(key: &str) -> &str {
    key.split_once('/').map_or(key, |(_, n)| n)
}

/// The short name of a label key (`network.gpuplace.io/tor` → `tor`).
pub fn level_name(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// A member's shape in words, for reasons: `8 GPUs`, `1 GPU`, `a share of 25 percent of a GPU`.
pub fn shape_words(req: &PodRequest) -> String {
    let demands: Vec<&GpuDemand> = req.containers.iter().map(|c| &c.demand).collect();
    match demands.as_slice() {
        [GpuDemand::Whole { gpus: 1 }] => "1 GPU".into(),
        [GpuDemand::Whole { gpus }] => format!("{gpus} GPUs"),
        [GpuDemand::Shared { gpus: 1, core_pct, .. }] => format!("a {core_pct} percent share of a GPU"),
        [GpuDemand::Shared { gpus, core_pct, .. }] => format!("{core_pct} percent shares of {gpus} GPUs"),
        _ => format!("{} GPUs in {} containers", req.total_gpus(), req.containers.len()),
    }
}

/// What a member needs at least, for pruning domains: (whole GPUs, thousandths of GPUs in shares).
/// A share's thousandths are at least its compute fraction, so the bound never prunes a domain that
/// could hold the group.
fn need(req: &PodRequest) -> (u64, u64) {
    let mut whole = 0u64;
    let mut milli = 0u64;
    for c in &req.containers {
        match c.demand {
            GpuDemand::Whole { gpus } => whole += u64::from(gpus),
            GpuDemand::Shared { gpus, core_pct, .. } => milli += u64::from(gpus) * u64::from(core_pct) * 10,
        }
    }
    (whole, milli)
}

/// A node's free capacity for the same bound: (idle healthy GPUs, free thousandths on healthy GPUs).
fn room(node: &Node) -> (u64, u64) {
    let mut whole = 0u64;
    let mut milli = 0u64;
    for g in 0..node.gpus.len() {
        if !node.gpus[g].healthy {
            continue;
        }
        if node.is_gpu_free(g) {
            whole += 1;
        }
        milli += u64::from(node.free_milli(g));
    }
    (whole, milli)
}

/// A quick necessary test before the engine's: host CPU and memory (where the node tracks them),
/// the GPU model, and room by [`need`]'s bound.
fn could_host(node: &Node, req: &PodRequest) -> bool {
    if !req.accepts_isolation(node.isolation) {
        return false;
    }
    if (node.cpu_milli > 0 && node.cpu_free() < req.cpu_milli)
        || (node.memory_mib > 0 && node.mem_free() < req.memory_mib)
    {
        return false;
    }
    let (whole, _) = need(req);
    // a share's thousandths are at least its compute percent's
    let smallest_share = req
        .containers
        .iter()
        .filter_map(|c| match c.demand {
            GpuDemand::Shared { core_pct, .. } => Some(core_pct * 10),
            GpuDemand::Whole { .. } => None,
        })
        .min();
    let mut idle = 0u64;
    let mut widest = 0u32;
    for (g, gpu) in node.gpus.iter().enumerate() {
        if !gpu.healthy || !req.allows_model(&gpu.model) {
            continue;
        }
        if node.is_gpu_free(g) {
            idle += 1;
        }
        widest = widest.max(node.free_milli(g));
    }
    idle >= whole && smallest_share.is_none_or(|m| widest >= m.min(1000))
}

/// One domain: its name and member nodes (indices, in cluster order).
struct Domain {
    name: String,
    nodes: Vec<usize>,
    room: (u64, u64),
    /// The room of the network domain one level up (a node's ToR, a ToR's spine; the domain's own at
    /// the top): between domains of equal room, the one whose enclosing domain is fuller goes first,
    /// so that a whole spine is not broken while a broken one holds the group.
    enclosing: (u64, u64),
}

/// Plans the whole group, or says why it cannot be placed now.
pub fn plan_group(
    engine: &Engine,
    cluster: &mut Cluster,
    ask: &GroupAsk<'_>,
    now_unix_ms: i64,
) -> Result<GroupPlan, NoPlan> {
    let needed = ask.members.len();
    let mut members: Vec<(usize, PodRequest)> = ask
        .members
        .iter()
        .enumerate()
        .map(|(i, r)| {
            // the group's network scorer reads the whole cluster per call; inside one domain it is
            // the same everywhere, so members are placed as plain pods and the group is written after
            let mut r = r.clone();
            r.group = None;
            (i, r)
        })
        .collect();
    // largest first, as the engine places a pod's containers
    members.sort_by_key(|(i, r)| (std::cmp::Reverse(need(r).0 * 1000 + need(r).1), *i));
    let total_need = members.iter().fold((0u64, 0u64), |a, (_, r)| {
        let n = need(r);
        (a.0 + n.0, a.1 + n.1)
    });

    let levels = cluster.network_levels.len();
    let mut scopes = vec![Scope::Node];
    scopes.extend((0..levels).rev().map(Scope::Level));
    scopes.push(Scope::Cluster);

    let scratch = cluster;
    let mut loosest_best = 0usize;
    for (s, scope) in scopes.iter().enumerate() {
        let mut domains = domains_of(scratch, ask, scope);
        // best fit: the domain with the least free capacity that could hold the group goes first
        domains.retain(|d| d.room.0 >= total_need.0 && d.room.1 >= total_need.0 * 1000 + total_need.1);
        domains.sort_by(|a, b| {
            (a.room.1, a.room.0, a.enclosing.1, a.enclosing.0, &a.name).cmp(&(
                b.room.1,
                b.room.0,
                b.enclosing.1,
                b.enclosing.0,
                &b.name,
            ))
        });
        let mut scope_best = 0usize;
        for d in &domains {
            match try_domain(engine, scratch, ask, &members, &d.nodes, now_unix_ms) {
                Ok(slots) => {
                    return Ok(GroupPlan { scope: scope.clone(), domain: d.name.clone(), slots });
                }
                Err(placed) => scope_best = scope_best.max(placed),
            }
        }
        // the reason names the loosest scope only: what its largest domain holds when none passed the
        // bound (tried only for it, as a failing group is tried again and again)
        if domains.is_empty() && s + 1 == scopes.len() {
            scope_best = largest_partial(engine, scratch, ask, &members, scope, now_unix_ms);
        }
        loosest_best = scope_best;
    }
    Err(no_plan(ask, &members, needed, loosest_best))
}

/// The most members that the domain with the most room at `scope` would hold (for the reason only).
fn largest_partial(
    engine: &Engine,
    scratch: &mut Cluster,
    ask: &GroupAsk<'_>,
    members: &[(usize, PodRequest)],
    scope: &Scope,
    now_unix_ms: i64,
) -> usize {
    let domains = domains_of(scratch, ask, scope);
    let Some(d) = domains.iter().max_by(|a, b| (a.room.0, a.room.1, &b.name).cmp(&(b.room.0, b.room.1, &a.name)))
    else {
        return 0;
    };
    try_domain(engine, scratch, ask, members, &d.nodes, now_unix_ms).map_or_else(|n| n, |s| s.len())
}

fn no_plan(ask: &GroupAsk<'_>, members: &[(usize, PodRequest)], needed: usize, best: usize) -> NoPlan {
    let name = group_name(ask.key);
    let shape = members.first().map_or_else(|| "GPUs".to_string(), |(_, r)| shape_words(r));
    let (under, where_) = match ask.required_keys.last().map(|k| level_name(k)) {
        Some(l) => (format!(" under one {l}"), format!("best {l} holds {best}")),
        None => (String::new(), format!("the cluster holds {best} now")),
    };
    let pods = if needed == 1 { "pod" } else { "pods" };
    NoPlan { reason: format!("group {name} needs {needed} {pods} of {shape}{under}; {where_}"), best, needed }
}

/// The domains of one scope, honouring the required keys, the placed members and the exclusions.
fn domains_of(cluster: &Cluster, ask: &GroupAsk<'_>, scope: &Scope) -> Vec<Domain> {
    let mut by_key: BTreeMap<Vec<&str>, Vec<usize>> = BTreeMap::new();
    for (i, node) in cluster.nodes().iter().enumerate() {
        if ask.excluded.contains(&i) {
            continue;
        }
        let mut key: Vec<&str> = Vec::with_capacity(ask.required_keys.len() + 3);
        let mut ok = true;
        for k in ask.required_keys {
            match node.labels.get(k) {
                Some(v) => key.push(v),
                None => ok = false,
            }
        }
        match *scope {
            Scope::Node => key.push(&node.name),
            Scope::Level(k) => {
                for v in cluster.network_path(node).take(k + 1) {
                    match v {
                        Some(v) => key.push(v),
                        None => ok = false,
                    }
                }
            }
            Scope::Cluster => {}
        }
        if ok {
            by_key.entry(key).or_default().push(i);
        }
    }
    // the enclosing network domain: the first `up` levels of a node's path
    let up = match *scope {
        Scope::Node => Some(cluster.network_levels.len()),
        Scope::Level(k) => Some(k),
        Scope::Cluster => None,
    };
    let prefix = |i: usize| -> Option<Vec<&str>> {
        let node = cluster.nodes().get(i)?;
        cluster.network_path(node).take(up?).collect()
    };
    let mut enclosing: BTreeMap<Vec<&str>, (u64, u64)> = BTreeMap::new();
    if up.is_some() {
        for (i, node) in cluster.nodes().iter().enumerate() {
            if let Some(p) = prefix(i).filter(|_| !ask.excluded.contains(&i)) {
                let r = room(node);
                let e = enclosing.entry(p).or_default();
                *e = (e.0 + r.0, e.1 + r.1);
            }
        }
    }
    by_key
        .into_iter()
        .filter(|(_, nodes)| ask.placed_nodes.iter().all(|p| nodes.contains(p)))
        .map(|(key, nodes)| {
            let room = nodes.iter().fold((0, 0), |a, &i| {
                let r = room(&cluster.nodes()[i]);
                (a.0 + r.0, a.1 + r.1)
            });
            let outer = nodes.first().and_then(|&i| prefix(i)).and_then(|p| enclosing.get(&p).copied());
            let name = match *scope {
                Scope::Node => format!("node {}", key.last().copied().unwrap_or("")),
                Scope::Level(k) => format!(
                    "{} {}",
                    level_name(cluster.network_levels.get(k).map_or("", String::as_str)),
                    key.last().copied().unwrap_or("")
                ),
                Scope::Cluster if ask.required_keys.is_empty() => "cluster".into(),
                Scope::Cluster => format!(
                    "{} {}",
                    level_name(ask.required_keys.last().map_or("", String::as_str)),
                    key.last().copied().unwrap_or("")
                ),
            };
            Domain { name, nodes, room, enclosing: outer.unwrap_or(room) }
        })
        .collect()
}

/// Places every member inside `nodes` on `scratch`. `Ok(slots)` in the caller's member order, or
/// `Err(how many fitted)`. `scratch` is left as found.
///
/// First a cheap test: members go best fit (the node with the least free capacity that takes
/// them, no scoring). Only a domain that passes it is placed again with the engine's scores (best
/// node per member, as a single pod would be placed); should that greedy pass end short where the
/// best-fit one did not, the best-fit slots stand. Scoring every candidate domain cost a cluster-wide
/// evaluation per member per domain.
fn try_domain(
    engine: &Engine,
    scratch: &mut Cluster,
    ask: &GroupAsk<'_>,
    members: &[(usize, PodRequest)],
    nodes: &[usize],
    now_unix_ms: i64,
) -> Result<Vec<PodAssignment>, usize> {
    let fitted = place_members(scratch, ask, members, |scratch, req| {
        let mut order: Vec<(u64, usize)> = nodes.iter().map(|&n| (room(&scratch.nodes()[n]).1, n)).collect();
        order.sort_unstable();
        order
            .into_iter()
            .filter(|&(_, n)| could_host(&scratch.nodes()[n], req))
            .find_map(|(_, n)| engine.place(scratch, req, n).ok().map(|p| p.assignment))
    })?;
    if nodes.len() == 1 {
        return Ok(fitted);
    }
    Ok(place_members(scratch, ask, members, |scratch, req| {
        let ev = engine.evaluate(scratch, req, nodes, now_unix_ms);
        ev.ranked.first().and_then(|c| c.placement(scratch, req)).map(|p| p.assignment)
    })
    .unwrap_or(fitted))
}

/// Places the members one by one on `scratch` where `choose` says, then takes them all back.
fn place_members(
    scratch: &mut Cluster,
    ask: &GroupAsk<'_>,
    members: &[(usize, PodRequest)],
    mut choose: impl FnMut(&Cluster, &PodRequest) -> Option<PodAssignment>,
) -> Result<Vec<PodAssignment>, usize> {
    let mut placed: Vec<(usize, PodAssignment)> = Vec::with_capacity(members.len());
    let mut failed = false;
    for (i, req) in members {
        let Some(mut a) = choose(scratch, req) else {
            failed = true;
            break;
        };
        a.group = Some(ask.key.to_string());
        if scratch.allocate(a.clone()).is_err() {
            failed = true;
            break;
        }
        placed.push((*i, a));
    }
    for (_, a) in &placed {
        let _ = scratch.release(&a.pod);
    }
    if failed {
        return Err(placed.len());
    }
    placed.sort_by_key(|(i, _)| *i);
    Ok(placed.into_iter().map(|(_, a)| a).collect())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::placement::mix::WorkloadMix;
    use crate::placement::profile::Profile;
    use gpuplace_core::cluster::network_labels;
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::{GpuDemand, MemoryDemand};

    /// `n` nodes of 8 GPUs, 4 per ToR, 8 per spine.
    fn cluster(n: usize) -> Cluster {
        let board = Board::Flat { gpus: 8, model: "H100".into(), memory_mib: 81920 }.resolve(Path::new(".")).unwrap();
        let nodes = (0..n)
            .map(|i| {
                let labels = network_labels(format!("spine-{}", i / 8), format!("tor-{}", i / 4));
                board.node(&format!("gpu-{i:02}"), labels, 0, 0)
            })
            .collect();
        Cluster::new(nodes)
    }

    fn engine() -> Engine {
        Engine::new(Profile::default(), WorkloadMix::default())
    }

    fn members(group: &str, n: usize, demand: GpuDemand) -> Vec<PodRequest> {
        (0..n).map(|i| PodRequest::single(format!("{group}#{i}"), demand)).collect()
    }

    fn ask<'a>(key: &'a str, members: &'a [PodRequest], required: &'a [String]) -> GroupAsk<'a> {
        GroupAsk { key, members, placed_nodes: &[], required_keys: required, excluded: &[] }
    }

    fn fill(c: &mut Cluster, node: &str, gpus: u32) {
        let e = engine();
        let i = c.node_index(node).unwrap();
        let mut req = PodRequest::single(format!("ns/filler-{node}"), GpuDemand::Whole { gpus });
        req.group = None;
        let p = e.place(c, &req, i).unwrap();
        c.allocate(p.assignment).unwrap();
    }

    #[test]
    fn a_job_of_four_whole_nodes_goes_under_one_tor() {
        let mut c = cluster(16);
        let m = members("ns/job", 4, GpuDemand::Whole { gpus: 8 });
        let plan = plan_group(&engine(), &mut c, &ask("ns/job", &m, &[]), 0).unwrap();
        assert_eq!(plan.scope, Scope::Level(1));
        assert_eq!(plan.nodes().len(), 4);
        let tors: std::collections::BTreeSet<_> =
            plan.slots.iter().map(|s| c.node(&s.node).unwrap().labels["network.gpuplace.io/tor"].clone()).collect();
        assert_eq!(tors.len(), 1, "{plan:?}");
        assert!(plan.slots.iter().all(|s| s.group.as_deref() == Some("ns/job")));
        assert_eq!(
            plan.slots.iter().map(|s| s.pod.as_str()).collect::<Vec<_>>(),
            ["ns/job#0", "ns/job#1", "ns/job#2", "ns/job#3"]
        );
    }

    #[test]
    fn between_equal_tors_the_one_in_a_broken_spine_goes_first() {
        // spine-0 = tor-0, tor-1; spine-1 = tor-2, tor-3. tor-2 is full, so a job of 4 x 8 GPUs
        // fits tor-0, tor-1 and tor-3 alike: tor-3 (by name the last) keeps spine-0 whole
        let mut c = cluster(16);
        for n in ["gpu-08", "gpu-09", "gpu-10", "gpu-11"] {
            fill(&mut c, n, 8);
        }
        let m = members("ns/job", 4, GpuDemand::Whole { gpus: 8 });
        let plan = plan_group(&engine(), &mut c, &ask("ns/job", &m, &[]), 0).unwrap();
        assert_eq!(plan.domain, "tor tor-3", "{plan:?}");
    }

    #[test]
    fn best_fit_leaves_the_free_tor_whole() {
        let mut c = cluster(8);
        // tor-0 has one node half used; a job of 2 x 8 GPUs fits in both ToRs
        fill(&mut c, "gpu-00", 4);
        let m = members("ns/job", 2, GpuDemand::Whole { gpus: 8 });
        let plan = plan_group(&engine(), &mut c, &ask("ns/job", &m, &[]), 0).unwrap();
        assert_eq!(plan.domain, "tor tor-0", "{plan:?}");
    }

    #[test]
    fn a_required_tor_that_no_tor_satisfies_gives_one_reason() {
        let mut c = cluster(8);
        fill(&mut c, "gpu-00", 1);
        fill(&mut c, "gpu-04", 1);
        let m = members("ns/job-7", 4, GpuDemand::Whole { gpus: 8 });
        let req = ["network.gpuplace.io/tor".to_string()];
        let err = plan_group(&engine(), &mut c, &ask("ns/job-7", &m, &req), 0).unwrap_err();
        assert_eq!(err.reason, "group job-7 needs 4 pods of 8 GPUs under one tor; best tor holds 3");
        assert!(!err.reason.contains('%'));
        // without the requirement, the cluster holds it across ToRs
        let plan = plan_group(&engine(), &mut c, &ask("ns/job-7", &m, &[]), 0).unwrap();
        assert_eq!(plan.scope, Scope::Level(0), "{plan:?}");
    }

    #[test]
    fn fractional_trials_share_few_gpus_on_one_node() {
        let mut c = cluster(4);
        let share = GpuDemand::Shared { gpus: 1, memory: MemoryDemand::ProportionalToCore, core_pct: 25 };
        let m = members("ns/trials", 8, share);
        let plan = plan_group(&engine(), &mut c, &ask("ns/trials", &m, &[]), 0).unwrap();
        assert_eq!(plan.scope, Scope::Node);
        let gpus: std::collections::BTreeSet<u32> = plan.slots.iter().flat_map(|s| s.gpus()).collect();
        assert_eq!(gpus.len(), 2, "8 quarter shares fill two GPUs: {plan:?}");
    }

    #[test]
    fn the_domain_holds_the_bound_members() {
        let mut c = cluster(16);
        fill(&mut c, "gpu-09", 8);
        let m = members("ns/job", 2, GpuDemand::Whole { gpus: 8 });
        let placed = [c.node_index("gpu-09").unwrap()];
        let a = GroupAsk { key: "ns/job", members: &m, placed_nodes: &placed, required_keys: &[], excluded: &[] };
        let plan = plan_group(&engine(), &mut c, &a, 0).unwrap();
        assert_eq!(plan.domain, "tor tor-2", "{plan:?}");
        assert!(!plan.nodes().contains(&"gpu-09"), "{plan:?}");
    }

    #[test]
    fn excluded_nodes_are_not_planned_on() {
        let mut c = cluster(4);
        let m = members("ns/job", 4, GpuDemand::Whole { gpus: 8 });
        let ex = [0usize];
        let a = GroupAsk { key: "ns/job", members: &m, placed_nodes: &[], required_keys: &[], excluded: &ex };
        let err = plan_group(&engine(), &mut c, &a, 0).unwrap_err();
        assert_eq!(err.best, 3);
    }

    #[test]
    fn the_callers_allocations_are_as_they_were() {
        let mut c = cluster(8);
        fill(&mut c, "gpu-03", 3);
        let before = c.clone();
        let m = members("ns/job", 3, GpuDemand::Whole { gpus: 8 });
        plan_group(&engine(), &mut c, &ask("ns/job", &m, &[]), 0).unwrap();
        assert_eq!(c, before);
    }
}
