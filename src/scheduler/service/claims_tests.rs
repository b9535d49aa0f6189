use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::{Cluster, Gpu};
use gpuplace_core::dra::slices::SliceGpus;
use gpuplace_core::resources::{GpuDemand, GroupSpec};
use gpuplace_core::topology::GpuTopology;

use super::*;
use crate::scheduler::binder::RecordingBinder;
use crate::scheduler::service::observe::NodeOutcome;
use crate::scheduler::service::ServiceOptions;

fn scheduler() -> Scheduler {
    Scheduler::new(
        Cluster::new(Vec::new()),
        Engine::default(),
        Arc::new(RecordingBinder::new()),
        ServiceOptions::default(),
    )
}

fn slices(n: usize, mib: u64) -> SliceGpus {
    let gpus = (0..n as u32)
        .map(|i| Gpu {
            uuid: format!("GPU-{i}"),
            index: i,
            model: "H100".into(),
            memory_mib: mib,
            numa_node: None,
            pci_bus_id: String::new(),
            healthy: true,
        })
        .collect();
    SliceGpus { gpus, topology: GpuTopology::flat(n), slots_per_gpu: Some(4), generation: 1, isolation: None }
}

fn labels(tor: &str) -> BTreeMap<String, String> {
    gpuplace_core::cluster::network_labels("s1", tor)
}

fn claim(key: &str, node: &str, gpu: u32, mem: u64, core: u32) -> PodAssignment {
    PodAssignment {
        pod: key.into(),
        node: node.into(),
        containers: vec![ContainerAssignment {
            name: "gpu".into(),
            init: false,
            slices: vec![GpuSlice { gpu, mem_mib: mem, core_pct: core, exclusive: false }],
        }],
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    }
}

#[derive(Debug, thiserror::Error)]
#[error("no room")]
struct NoRoom;

#[test]
fn a_dra_node_is_its_slices_and_its_node_objects_labels_in_either_order() {
    let s = scheduler();
    // labels first: not a GPU node until its slices come
    assert_eq!(s.observe_node("a", &labels("t1"), &BTreeMap::new()), NodeOutcome::NotGpu);
    s.observe_slices("a", Some(slices(8, 81920)));
    let node = s.cluster().node("a").cloned().expect("a DRA node");
    assert_eq!(
        (node.gpus.len(), node.slots_per_gpu, node.labels.get("network.gpuplace.io/tor").map(String::as_str)),
        (8, Some(4), Some("t1"))
    );
    // slices first: a node when its Node object is seen
    s.observe_slices("b", Some(slices(4, 40960)));
    assert!(s.cluster().node("b").is_none());
    assert_eq!(s.observe_node("b", &labels("t2"), &BTreeMap::new()), NodeOutcome::Upserted { gpus: 4 });
    // heartbeats change nothing; new labels rebuild the node
    assert_eq!(s.observe_node("b", &labels("t2"), &BTreeMap::new()), NodeOutcome::Unchanged);
    assert_eq!(s.observe_node("b", &labels("t3"), &BTreeMap::new()), NodeOutcome::Upserted { gpus: 4 });
    // slices gone from a node that holds no claim: the node goes, but its labels stay for its return
    s.observe_slices("b", None);
    assert!(s.cluster().node("b").is_none());
    s.observe_slices("b", Some(slices(4, 40960)));
    assert_eq!(s.cluster().node("b").map(|n| n.gpus.len()), Some(4));
    // a deleted Node object takes the node and its labels
    s.remove_node("b");
    s.observe_slices("b", Some(slices(4, 40960)));
    assert!(s.cluster().node("b").is_none());
}

#[test]
fn claims_count_as_read_even_past_capacity_and_wait_for_their_node() {
    let s = scheduler();
    // a claim seen before its node's slices is counted when they are
    assert_eq!(
        s.observe_claim("claim:ml/early", Some(claim("claim:ml/early", "a", 0, 1000, 10))),
        ClaimOutcome::Parked
    );
    s.observe_node("a", &labels("t1"), &BTreeMap::new());
    s.observe_slices("a", Some(slices(2, 81920)));
    assert_eq!(s.cluster().node("a").unwrap().usage(0).mem_mib, 1000);

    let c = claim("claim:ml/c", "a", 1, 81000, 100);
    assert_eq!(s.observe_claim("claim:ml/c", Some(c.clone())), ClaimOutcome::Counted(None));
    assert_eq!(s.observe_claim("claim:ml/c", Some(c)), ClaimOutcome::Unchanged);
    // another allocator's claim beside it: counted over capacity, never dropped
    let over = s.observe_claim("claim:ml/d", Some(claim("claim:ml/d", "a", 1, 2000, 0)));
    assert!(matches!(over, ClaimOutcome::Counted(Some(_))), "{over:?}");
    assert_eq!(s.cluster().node("a").unwrap().free_mem(1), 0);
    // a GPU the node does not have is refused
    assert!(matches!(s.observe_claim("claim:ml/x", Some(claim("claim:ml/x", "a", 9, 1, 1))), ClaimOutcome::Refused(_)));
    // released when the claim holds nothing
    assert_eq!(s.observe_claim("claim:ml/d", None), ClaimOutcome::Released);
    assert_eq!(s.observe_claim("claim:ml/d", None), ClaimOutcome::Unchanged);
    // slices gone while claims hold GPUs: the node stays, unhealthy, its claims counted
    s.observe_slices("a", None);
    let node = s.cluster().node("a").cloned().expect("kept");
    assert!(node.gpus.iter().all(|g| !g.healthy));
    assert_eq!(node.usage(1).mem_mib, 81000);
}

#[test]
fn a_held_placement_counts_at_once_survives_stale_events_and_is_settled_or_given_back() {
    let s = scheduler();
    s.observe_node("a", &labels("t1"), &BTreeMap::new());
    s.observe_slices("a", Some(slices(2, 1000)));
    let held = s
        .hold(|v| {
            assert!(v.cluster.node("a").is_some());
            Ok::<_, NoRoom>(vec![claim("claim:ml/p", "a", 0, 600, 50), claim("claim:ml/q", "a", 1, 600, 50)])
        })
        .unwrap();
    assert_eq!(held.len(), 2);
    assert_eq!(s.cluster().node("a").unwrap().usage(0).mem_mib, 600);
    // the watcher shows the claims before the write: the records stay
    assert_eq!(s.observe_claim("claim:ml/p", None), ClaimOutcome::Held);
    // the write seen: settled, and a later event without it releases it
    assert_eq!(s.observe_claim("claim:ml/p", Some(held[0].clone())), ClaimOutcome::Unchanged);
    assert_eq!(s.observe_claim("claim:ml/p", None), ClaimOutcome::Released);
    // the other write failed: given back
    s.release_held(&["claim:ml/q".to_string()]);
    assert_eq!(s.cluster().node("a").unwrap().usage(1).mem_mib, 0);

    // all or nothing: the second record does not fit, so the first is not counted either
    let before = s.cluster();
    let e =
        s.hold(|_| Ok::<_, NoRoom>(vec![claim("claim:ml/r", "a", 0, 500, 10), claim("claim:ml/s", "a", 0, 600, 10)]));
    assert!(matches!(e, Err(HoldError::Refused(_))), "{e:?}");
    assert_eq!(s.cluster(), before);
    assert!(matches!(s.hold(|_| Err::<Vec<PodAssignment>, _>(NoRoom)), Err(HoldError::Plan(NoRoom))));
    // not ready: nothing is placed
    s.set_ready(false);
    assert!(matches!(s.hold(|_| Ok::<_, NoRoom>(Vec::new())), Err(HoldError::NotReady(_))));
}

#[test]
fn a_relist_releases_unlisted_claims_but_not_ones_held_since_it_started() {
    let s = scheduler();
    s.observe_node("a", &labels("t1"), &BTreeMap::new());
    s.observe_slices("a", Some(slices(2, 1000)));
    s.observe_claim("claim:ml/old", Some(claim("claim:ml/old", "a", 0, 100, 10)));
    s.observe_claim("claim:ml/kept", Some(claim("claim:ml/kept", "a", 0, 100, 10)));
    let listed_at = Instant::now() - Duration::from_millis(50);
    s.hold(|_| Ok::<_, NoRoom>(vec![claim("claim:ml/new", "a", 1, 100, 10)])).unwrap();
    s.retain_claims(&HashSet::from(["claim:ml/kept".to_string()]), listed_at);
    let c = s.cluster();
    assert!(c.assignment("claim:ml/old").is_none());
    assert!(c.assignment("claim:ml/kept").is_some());
    assert!(c.assignment("claim:ml/new").is_some(), "held after the list started: its write may be newer");
    // a restore (pod annotations) keeps the claims' records
    s.restore(Vec::new());
    assert!(s.cluster().assignment("claim:ml/kept").is_some());
}

#[test]
fn pods_host_requests_count_on_dra_nodes_once_the_front_end_is_on() {
    let s = scheduler();
    let used = |s: &Scheduler| s.cluster().node("a").map(|n| (n.cpu_milli, n.cpu_used(), n.mem_used()));
    // off: nothing is kept
    s.observe_allocatable("a", 8000, 4096);
    s.observe_host_use("u0", Some(("a", 1000, 100)));
    s.enable_dra();
    s.observe_allocatable("a", 8000, 4096);
    // a pod bound before the node's slices are seen counts once they are
    s.observe_host_use("u1", Some(("a", 6000, 1000)));
    s.observe_node("a", &labels("t1"), &BTreeMap::new());
    s.observe_slices("a", Some(slices(2, 1000)));
    assert_eq!(used(&s), Some((8000, 6000, 1000)));
    s.observe_host_use("u2", Some(("a", 1000, 100)));
    assert_eq!(used(&s), Some((8000, 7000, 1100)));
    // the same again changes nothing; a finished pod gives its requests back
    s.observe_host_use("u2", Some(("a", 1000, 100)));
    s.observe_host_use("u1", None);
    assert_eq!(used(&s), Some((8000, 1000, 100)));
    // a re-list without the pod
    s.retain_host_uses(&HashSet::new());
    assert_eq!(used(&s), Some((8000, 0, 0)));
}

/// A member of the group `job` of `size` pods asking one whole GPU each, under one ToR.
fn member(job: &str, size: u32) -> PodRequest {
    let mut r = PodRequest::single(format!("ml/{job}"), GpuDemand::Whole { gpus: 1 });
    let mut g = GroupSpec::labelled(format!("ml/{job}"), size);
    g.required = vec![gpuplace_core::cluster::DEFAULT_NETWORK_LEVELS[1].to_string()];
    r.group = Some(g);
    r
}

/// The engine's best placement where the hold allows, as the claim `key`'s record.
fn engine_plan(v: &HoldView<'_>, req: &PodRequest, key: &str) -> Result<Vec<PodAssignment>, NoRoom> {
    let allowed: Vec<usize> = (0..v.cluster.nodes().len()).filter(|&i| v.may_use(&v.cluster.nodes()[i].name)).collect();
    let ev = v.engine.evaluate(v.cluster, req, &allowed, v.now_ms);
    let best = ev.ranked.first().and_then(|c| c.placement(v.cluster, req)).ok_or(NoRoom)?;
    let mut a = best.assignment;
    a.pod = key.into();
    Ok(vec![a])
}

/// DRA nodes a and b under ToR t1 with 2 GPUs each, c under t2 with 4, and a node of the
/// extender's own resources (no slices) under t1 with 8.
fn three_dra_nodes_and_a_plain_one() -> Scheduler {
    let s = scheduler();
    for (n, tor, gpus) in [("a", "t1", 2), ("b", "t1", 2), ("c", "t2", 4)] {
        s.observe_node(n, &labels(tor), &BTreeMap::new());
        s.observe_slices(n, Some(slices(gpus, 1000)));
    }
    let board = gpuplace_core::inventory::Board::Flat { gpus: 8, model: "H100".into(), memory_mib: 1000 };
    let board = board.resolve(std::path::Path::new(".")).unwrap();
    s.upsert_node(board.node("plain", labels("t1"), 0, 0));
    s
}

#[test]
fn a_group_of_claim_pods_is_planned_whole_on_dra_nodes_and_each_member_takes_its_slot() {
    let s = three_dra_nodes_and_a_plain_one();
    let admits = |_: &Node| true;
    let req = member("job", 4);
    // the first member plans all four under one ToR: t2's node c, not t1's plain node of 8
    let mut nodes = Vec::new();
    for i in 0..4 {
        let uid = format!("u{i}");
        let held = s.hold_pod(&uid, &req, &admits, |v| {
            assert!(v.slot.is_some(), "a member goes to its slot");
            engine_plan(v, &req, &format!("claim:ml/c{i}"))
        });
        let held = held.unwrap();
        nodes.push(held[0].node.clone());
        s.member_written(&uid);
        if i == 0 {
            // the other three slots hold their room: a single pod of 4 GPUs (only c has 4) cannot take it
            let single = PodRequest::single("ml/single", GpuDemand::Whole { gpus: 4 });
            let e = s.hold_pod("s", &single, &admits, |v| engine_plan(v, &single, "claim:ml/s"));
            assert!(matches!(e, Err(HoldError::Plan(NoRoom))), "{e:?}");
        }
    }
    assert_eq!(nodes, ["c", "c", "c", "c"]);
    assert_eq!(s.cluster().node("plain").map(|n| n.pods().count()), Some(0));
    // a fifth member of a full group is refused as the extender's would be
    let held = s.hold_pod("u4", &req, &admits, |v| engine_plan(v, &req, "claim:ml/c4"));
    assert!(matches!(&held, Err(HoldError::Group(why)) if why.contains("every pod bound")), "{held:?}");
}

#[test]
fn a_group_without_room_holds_nothing_and_a_member_not_written_gets_its_slot_back() {
    let s = three_dra_nodes_and_a_plain_one();
    let admits = |_: &Node| true;
    // 5 under one ToR: t1 has 4 DRA GPUs (its plain node does not count), t2 4
    let big = member("big", 5);
    let before = s.cluster();
    let e = s.hold_pod("b0", &big, &admits, |v| engine_plan(v, &big, "claim:ml/b0"));
    match e {
        Err(HoldError::Group(why)) => assert!(why.contains("group big"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.cluster(), before, "nothing held");
    // a pair whose node selector refuses c goes under t1
    let pair = member("pair", 2);
    let not_c = |n: &Node| n.name != "c";
    let held = s.hold_pod("p0", &pair, &not_c, |v| engine_plan(v, &pair, "claim:ml/p0")).unwrap();
    assert_ne!(held[0].node, "c");
    // its write failed: the claim goes back and the slot is held again
    s.release_held(&["claim:ml/p0".to_string()]);
    s.member_not_written("p0");
    let reserved =
        |s: &Scheduler| s.cluster().nodes().iter().flat_map(|n| n.pods()).filter(|a| !is_claim_key(&a.pod)).count();
    assert_eq!(reserved(&s), 2, "both slots reserved again");
    let again = s.hold_pod("p0", &pair, &not_c, |v| engine_plan(v, &pair, "claim:ml/p0")).unwrap();
    assert_eq!(again[0].node, held[0].node);
    assert_eq!(reserved(&s), 1);
}

#[test]
fn a_bound_claim_pod_of_a_group_is_its_member_on_a_dra_node() {
    let s = three_dra_nodes_and_a_plain_one();
    let req = member("job", 2);
    s.observe_claim_member("u0", "ml/job-0", &req, "plain");
    assert_eq!(s.read().groups.bound_node("u0"), None, "not a DRA node");
    s.observe_claim_member("u0", "ml/job-0", &req, "c");
    assert_eq!(s.read().groups.bound_node("u0"), Some("c"));
    // the other member is planned next to it
    let held = s.hold_pod("u1", &req, &|_: &Node| true, |v| engine_plan(v, &req, "claim:ml/c1")).unwrap();
    assert_eq!(held[0].node, "c");
}
