//! Groups placed whole, through the extender's verbs in static mode: plans, reservations, the
//! all-or-nothing answer, binds that take their reservation, bind failures, time-outs, a planned node
//! that leaves, PodGroups (gangs answered with an error when no plan exists), fractional trials, and a
//! restart that never double-books.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::extender::wire::ExtenderFilterResult;
use gpuplace::extender::Extender;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::scheduler::binder::{BindError, BindFuture, BindRequest, Binder, RecordingBinder};
use gpuplace::scheduler::groups::PodGroupInfo;
use gpuplace::scheduler::requeue::{RequeuePod, Requeuer};
use gpuplace::scheduler::service::ServiceOptions;
use gpuplace_core::cluster::{network_labels, Cluster};
use gpuplace_core::inventory::Board;
use harness::{bind, extender, filter, passed, pod_in, whole, Harness};
use serde_json::{json, Value};

#[path = "support/harness.rs"]
mod harness;

const TOR: &str = "network.gpuplace.io/tor";

/// `n` nodes of 8 H100s, 4 per ToR, 8 per spine.
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

fn extender_with(c: Cluster, binder: Arc<dyn Binder>, timeout: Duration) -> Extender {
    Harness::new(c)
        .binder(binder)
        .options(ServiceOptions { group_timeout: timeout, ..ServiceOptions::default() })
        .build()
}

/// A member of a `gpuplace.io/group` job of `size` pods, each asking `limits`.
fn member(job: &str, i: usize, size: usize, limits: Value) -> Value {
    json!({
        "metadata": { "name": format!("{job}-{i}"), "namespace": "ml", "uid": format!("uid-{job}-{i}"),
                      "labels": { "gpuplace.io/group": job },
                      "annotations": { "gpuplace.io/group-size": size.to_string() } },
        "spec": { "containers": [ { "name": "main", "resources": { "limits": limits } } ] }
    })
}

/// A member of the PodGroup `pg` (kube-scheduler's gang).
fn gang_member(pg: &str, i: usize, limits: Value) -> Value {
    json!({
        "metadata": { "name": format!("{pg}-{i}"), "namespace": "ml", "uid": format!("uid-{pg}-{i}") },
        "spec": { "schedulingGroup": { "podGroupName": pg },
                  "containers": [ { "name": "main", "resources": { "limits": limits } } ] }
    })
}

fn single(name: &str, gpus: u32) -> Value {
    pod_in("ml", name, whole(gpus))
}

/// Filter then bind to the one node passed; the node.
fn place(e: &Extender, pod: &Value) -> String {
    let r = filter(e, pod);
    let p = passed(&r);
    assert_eq!(p.len(), 1, "{} should go to exactly one node: {r:?}", pod["metadata"]["name"]);
    let err = bind(e, pod, &p[0]);
    assert!(err.is_empty(), "bind: {err}");
    p[0].clone()
}

fn tor_of(e: &Extender, node: &str) -> String {
    e.cluster().node(node).unwrap().labels[TOR].clone()
}

/// Fills `gpus` GPUs of `node` with a single pod.
fn fill(e: &Extender, name: &str, node: &str, gpus: u32) {
    let pod = single(name, gpus);
    assert!(passed(&filter(e, &pod)).contains(&node.to_string()));
    assert_eq!(bind(e, &pod, node), "");
}

fn reserved_gpus(e: &Extender) -> f64 {
    e.inspect(None).unwrap().groups.iter().flat_map(|g| g.reserved.iter()).map(|r| r.gpu_share).sum()
}

/// Pods (not reservations) holding GPUs.
fn real_pods(e: &Extender) -> usize {
    e.cluster().nodes().iter().flat_map(|n| n.pods()).filter(|a| !a.pod.contains('#')).count()
}

#[test]
fn a_job_is_planned_whole_under_one_tor_and_each_member_goes_to_its_own_node() {
    let e = extender(cluster(16));
    let job: Vec<Value> = (0..4).map(|i| member("job", i, 4, whole(8))).collect();
    // the first member's filter plans all four and reserves 32 GPUs
    let first = passed(&filter(&e, &job[0]));
    assert_eq!(first.len(), 1);
    assert_eq!(reserved_gpus(&e), 32.0);
    // a single pod cannot take the reserved GPUs
    let s = filter(&e, &single("s", 1));
    let reserved_nodes: BTreeSet<String> =
        e.inspect(None).unwrap().groups[0].reserved.iter().map(|r| r.node.clone()).collect();
    assert_eq!(reserved_nodes.len(), 4);
    for n in &reserved_nodes {
        assert!(!passed(&s).contains(n), "a single was offered reserved node {n}");
    }
    let nodes: Vec<String> = job.iter().map(|p| place(&e, p)).collect();
    let distinct: BTreeSet<&String> = nodes.iter().collect();
    assert_eq!(distinct.len(), 4, "{nodes:?}");
    let tors: BTreeSet<String> = nodes.iter().map(|n| tor_of(&e, n)).collect();
    assert_eq!(tors.len(), 1, "{nodes:?}");
    assert_eq!(reserved_gpus(&e), 0.0);
    let report = e.inspect(None).unwrap();
    assert_eq!(report.groups[0].members_bound, 4);
    assert!(report.groups[0].domain.is_none());
}

#[test]
fn five_jobs_on_three_free_tors_give_three_whole_jobs_and_two_empty_ones() {
    let e = extender(cluster(16));
    // tor-3 has one node in use: exactly 3 ToRs are wholly free
    fill(&e, "filler", "gpu-15", 1);
    let jobs: Vec<Vec<Value>> =
        (0..5).map(|j| (0..4).map(|i| member(&format!("job-{j}"), i, 4, whole(8))).collect()).collect();
    let mut whole_jobs = 0;
    let mut empty_jobs = 0;
    for job in &jobs {
        let r = filter(&e, &job[0]);
        if passed(&r).is_empty() {
            // every member is turned away with the same one reason, and none is bound
            let reasons: BTreeSet<&String> =
                r.failed_and_unresolvable_nodes.values().chain(r.failed_nodes.values()).collect();
            assert_eq!(reasons.len(), 1, "{r:?}");
            let reason = reasons.into_iter().next().unwrap();
            assert!(reason.contains("needs 4 pods of 8 GPUs"), "{reason}");
            assert!(!reason.contains('%'));
            for m in &job[1..] {
                assert!(passed(&filter(&e, m)).is_empty());
            }
            empty_jobs += 1;
            continue;
        }
        let nodes: Vec<String> = job.iter().map(|p| place(&e, p)).collect();
        let tors: BTreeSet<String> = nodes.iter().map(|n| tor_of(&e, n)).collect();
        assert_eq!(tors.len(), 1, "{nodes:?}");
        whole_jobs += 1;
    }
    assert_eq!((whole_jobs, empty_jobs), (3, 2));
    assert_eq!(real_pods(&e), 1 + 12);
    assert_eq!(reserved_gpus(&e), 0.0);
    let waiting = e.inspect(None).unwrap().groups.iter().filter(|g| g.waiting.is_some()).count();
    assert_eq!(waiting, 2);
    assert!(e.render_metrics().contains("gpuplace_groups{state=\"waiting\"} 2"));
}

#[test]
fn a_gang_with_no_plan_is_answered_with_an_error_and_a_planned_one_with_one_node() {
    let e = extender(cluster(8));
    fill(&e, "f0", "gpu-00", 1);
    fill(&e, "f1", "gpu-04", 1);
    e.observe_pod_group("ml/pg", PodGroupInfo { min_count: Some(4), topology_keys: vec![TOR.into()] });
    let r = filter(&e, &gang_member("pg", 0, whole(8)));
    assert_eq!(r.error, "gpuplace: group pg needs 4 pods of 8 GPUs under one tor; best tor holds 3", "{r:?}");
    assert!(passed(&r).is_empty());
    // a smaller gang fits under one ToR
    e.observe_pod_group("ml/small", PodGroupInfo { min_count: Some(3), topology_keys: vec![TOR.into()] });
    let nodes: Vec<String> = (0..3).map(|i| place(&e, &gang_member("small", i, whole(8)))).collect();
    assert_eq!(nodes.iter().map(|n| tor_of(&e, n)).collect::<BTreeSet<_>>().len(), 1);
    // a gang whose PodGroup gpuplace has not seen yet waits (an error: kube-scheduler backs it off)
    let r = filter(&e, &gang_member("unknown", 0, whole(1)));
    assert!(r.error.contains("not known to gpuplace yet"), "{r:?}");
}

#[test]
fn a_label_group_can_require_one_tor_and_a_bad_key_is_refused() {
    let e = extender(cluster(8));
    fill(&e, "f0", "gpu-00", 1);
    fill(&e, "f1", "gpu-04", 1);
    let pod = |i: usize, topology: &str| {
        let mut p = member("job", i, 4, whole(8));
        p["metadata"]["annotations"]["gpuplace.io/group-topology"] = json!(topology);
        p
    };
    // preference only: placed across the two ToRs; required: turned away with the ToR reason
    let r = filter(&e, &pod(0, TOR));
    assert!(passed(&r).is_empty(), "{r:?}");
    let reasons: BTreeSet<&String> = r.failed_and_unresolvable_nodes.values().collect();
    assert_eq!(
        reasons.into_iter().collect::<Vec<_>>(),
        ["gpuplace: group job needs 4 pods of 8 GPUs under one tor; best tor holds 3"]
    );
    let r = filter(&e, &member("other", 0, 4, whole(8)));
    assert_eq!(passed(&r).len(), 1, "without the requirement the job spans the ToRs: {r:?}");
    let r = filter(&e, &pod(1, "network.gpuplace.io/tor = x"));
    assert!(r.failed_and_unresolvable_nodes.values().all(|v| v.contains("gpuplace.io/group-topology")), "{r:?}");
}

/// A binder whose Bindings fail.
#[derive(Debug)]
struct Failing;
impl Binder for Failing {
    fn bind<'a>(&'a self, _: &'a BindRequest) -> BindFuture<'a> {
        Box::pin(async {
            Err(BindError::Api { call: "Binding", pod: "p".into(), status: Some(500), message: "injected".into() })
        })
    }
}

#[test]
fn a_member_whose_binding_fails_gets_its_slot_back_and_takes_nothing_from_the_others() {
    let e = extender_with(cluster(8), Arc::new(Failing), Duration::from_secs(300));
    let job: Vec<Value> = (0..2).map(|i| member("job", i, 2, whole(4))).collect();
    let node = passed(&filter(&e, &job[0]))[0].clone();
    let before = reserved_gpus(&e);
    assert_eq!(before, 8.0);
    let err = bind(&e, &job[0], &node);
    assert!(err.contains("binding failed"), "{err}");
    assert_eq!(reserved_gpus(&e), 8.0, "the slot is reserved again");
    assert_eq!(real_pods(&e), 0);
    // the same member is sent to the same node again
    assert_eq!(passed(&filter(&e, &job[0])), vec![node]);
}

#[test]
fn a_plan_past_the_time_out_gives_its_gpus_back_and_waits_for_every_member() {
    let e = extender_with(cluster(8), Arc::new(RecordingBinder::new()), Duration::from_millis(50));
    let m0 = member("job", 0, 3, whole(8));
    assert_eq!(passed(&filter(&e, &m0)).len(), 1);
    assert_eq!(reserved_gpus(&e), 24.0);
    std::thread::sleep(Duration::from_millis(80));
    // the time-out ends the reservation; with 1 of 3 members seen, no new plan is made
    let r = filter(&e, &m0);
    assert!(passed(&r).is_empty(), "{r:?}");
    assert_eq!(reserved_gpus(&e), 0.0);
    assert!(r.failed_and_unresolvable_nodes.values().all(|v| v.contains("waits for all 3 pods")), "{r:?}");
    // once all three exist it is planned again
    filter(&e, &member("job", 1, 3, whole(8)));
    let r = filter(&e, &member("job", 2, 3, whole(8)));
    assert_eq!(passed(&r).len(), 1, "{r:?}");
}

#[test]
fn a_planned_node_that_leaves_has_its_group_planned_again() {
    let e = extender(cluster(8));
    let job: Vec<Value> = (0..2).map(|i| member("job", i, 2, whole(8))).collect();
    let first = place(&e, &job[0]);
    let second = passed(&filter(&e, &job[1]))[0].clone();
    assert_ne!(first, second);
    e.remove_node(&second);
    assert_eq!(reserved_gpus(&e), 0.0);
    let again = passed(&filter(&e, &job[1]));
    assert_eq!(again.len(), 1);
    assert_ne!(again[0], second);
    assert_eq!(tor_of(&e, &again[0]), tor_of(&e, &first), "the new plan stays beside the bound member");
    assert_eq!(bind(&e, &job[1], &again[0]), "");
}

#[test]
fn a_planned_gpu_that_turns_unhealthy_has_its_group_planned_again() {
    let e = extender(cluster(8));
    let job: Vec<Value> = (0..2).map(|i| member("job", i, 2, whole(8))).collect();
    let planned = passed(&filter(&e, &job[0]))[0].clone();
    assert_eq!(reserved_gpus(&e), 16.0);
    // the device plugin marks one GPU of the planned node unhealthy: the node's new inventory
    let mut sick = e.cluster().node(&planned).unwrap().clone();
    sick.gpus[3].healthy = false;
    e.upsert_node(sick);
    let report = e.inspect(None).unwrap();
    assert!(report.groups[0].reserved.is_empty(), "the plan on {planned} was dropped: {report:?}");
    let again = passed(&filter(&e, &job[0]));
    assert_eq!(again.len(), 1);
    assert_ne!(again[0], planned, "a node with 7 healthy GPUs cannot take 8");
    assert_eq!(bind(&e, &job[0], &again[0]), "");
}

#[test]
fn fractional_trials_are_packed_on_few_gpus_of_one_node() {
    let e = extender(cluster(4));
    let quarter = json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-core": "25" });
    let nodes: Vec<String> = (0..8).map(|i| place(&e, &member("trials", i, 8, quarter.clone()))).collect();
    assert_eq!(nodes.iter().collect::<BTreeSet<_>>().len(), 1, "{nodes:?}");
    let c = e.cluster();
    let gpus: BTreeSet<u32> = c.nodes().iter().flat_map(|n| n.pods()).flat_map(|a| a.gpus()).collect();
    assert_eq!(gpus.len(), 2, "8 quarter shares fill 2 GPUs");
}

#[test]
fn every_member_deleted_ends_the_reservation() {
    let e = extender(cluster(8));
    let job: Vec<Value> = (0..2).map(|i| member("job", i, 2, whole(8))).collect();
    filter(&e, &job[0]);
    filter(&e, &job[1]);
    assert_eq!(reserved_gpus(&e), 16.0);
    e.release_pod("uid-job-0");
    assert_eq!(reserved_gpus(&e), 16.0, "a deleted member's slot waits for its replacement");
    e.release_pod("uid-job-1");
    assert_eq!(reserved_gpus(&e), 0.0);
    assert!(e.cluster().nodes().iter().all(|n| n.pods().count() == 0));
}

/// The placement log records each plan, each group turned away and the totals after each member's
/// bind, and `gpuplace report` draws groups waiting and GPUs reserved over time from it.
#[test]
fn the_placement_log_and_the_report_show_groups_over_time() {
    let dir = std::env::temp_dir().join(format!("gpuplace-groups-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log_path = dir.join("placement.jsonl");
    let log = PlacementLog::open(log_path.to_str().unwrap(), 1 << 20).unwrap();
    let e = Harness::new(cluster(8)).placement_log(log).build();
    // one job fits (tor-0 or tor-1), the second waits: 2 x 4 x 8 GPUs on 8 nodes, one GPU taken
    fill(&e, "filler", "gpu-07", 1);
    for i in 0..4 {
        place(&e, &member("fits", i, 4, whole(8)));
    }
    assert!(passed(&filter(&e, &member("waits", 0, 4, whole(8)))).is_empty());
    let lines: Vec<Value> =
        std::fs::read_to_string(&log_path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let events: Vec<&str> =
        lines.iter().filter(|d| d["verb"] == "group").filter_map(|d| d["group_event"]["event"].as_str()).collect();
    assert_eq!(events, ["planned", "bound", "no_plan"], "{lines:#?}");
    let planned = lines.iter().find(|d| d["group_event"]["event"] == "planned").unwrap();
    assert_eq!(planned["group_event"]["totals"]["reserved_gpus"], 32.0);
    assert_eq!(planned["group_event"]["domain"], "tor tor-0");
    let member_binds: Vec<&Value> = lines.iter().filter(|d| d["verb"] == "bind" && d["group"] == "ml/fits").collect();
    assert_eq!(member_binds.len(), 4);
    // each bind takes its slot's 8 GPUs out of the reservation
    let reserved: Vec<f64> =
        member_binds.iter().map(|d| d["group_totals"]["reserved_gpus"].as_f64().unwrap()).collect();
    assert_eq!(reserved, [24.0, 16.0, 8.0, 0.0]);
    let filters = lines.iter().filter(|d| d["verb"] == "filter" && d["group"] == "ml/fits").count();
    assert_eq!(filters, 4);
    let no_plan = lines.iter().find(|d| d["group_event"]["event"] == "no_plan").unwrap();
    assert_eq!(no_plan["group_event"]["totals"]["waiting"], 1);

    let html = dir.join("report.html");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["report", "--placement-log", log_path.to_str().unwrap(), "-o", html.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<figure id=\"chart-groups\">"), "no groups chart");
    assert!(page.contains("GPUs reserved by plans"), "the chart's legend");
    assert!(page.contains("id=\"group-reserved-peak\">32.00<"), "peak reserved row");
    assert!(page.contains("id=\"group-waiting-last\">1<"), "groups waiting at the end");
    let _ = std::fs::remove_dir_all(&dir);
}

#[derive(Debug, Clone)]
enum Op {
    /// Filter (and, with `bind`, bind to the one node passed) member `i` of job `job`.
    Member { job: usize, i: usize, bind: bool },
    /// A single pod of `gpus` whole GPUs, bound to the first node passed.
    Single { gpus: u32 },
    /// A member deleted.
    Delete { job: usize, i: usize },
    /// A node leaves, or comes back.
    Node { n: usize, back: bool },
}

/// Member `i` of job `j` (job 3 is elastic, under one ToR).
fn job_member(j: usize, i: usize) -> Value {
    let (name, size, limits) = job(j);
    if j == 3 {
        elastic(name, i, size, 2)
    } else {
        member(name, i, size, limits)
    }
}

/// (name, pods, each pod's limits)
fn job(j: usize) -> (&'static str, usize, Value) {
    match j {
        0 => ("big", 2, whole(8)),
        1 => ("mid", 3, whole(4)),
        // elastic: needs 2 of 4 to start (see `job_member`)
        3 => ("el", 4, whole(8)),
        _ => ("trials", 4, json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-core": "50" })),
    }
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0usize..4, 0usize..4, any::<bool>()).prop_map(|(job, i, bind)| Op::Member { job, i, bind }),
        2 => prop::sample::select(vec![1u32, 2, 4, 8]).prop_map(|gpus| Op::Single { gpus }),
        1 => (0usize..4, 0usize..4).prop_map(|(job, i)| Op::Delete { job, i }),
        1 => (0usize..8, any::<bool>()).prop_map(|(n, back)| Op::Node { n, back }),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 96, ..Default::default() })]

    /// Whatever members, singles, deletions and node changes come, in any order: the GPUs reserved in
    /// the cluster are exactly the unbound slots of live plans, a plan never holds more slots than its
    /// group has members to place, a member passes at most one node, and a single pod is never offered
    /// a node whose GPUs a plan holds all of.
    #[test]
    fn reservations_are_exactly_the_unbound_slots_of_live_plans(ops in proptest::collection::vec(op(), 1..40)) {
        let all = cluster(8);
        let e = extender(all.clone());
        let mut singles = 0;
        // members bound (kube-scheduler filters a pod again only while it is pending)
        let mut bound: BTreeSet<(usize, usize)> = BTreeSet::new();
        for op in ops {
            match op {
                Op::Member { job: j, i, bind: b } => {
                    let (name, size, _) = job(j);
                    if i >= size || bound.contains(&(j, i)) {
                        continue;
                    }
                    let pod = job_member(j, i);
                    let p = passed(&filter(&e, &pod));
                    let planned = e.inspect(None).unwrap().groups.iter().any(|g| g.group == format!("ml/{name}") && g.domain.is_some());
                    proptest::prop_assert!(p.len() <= 1 || !planned, "a member with a plan passed {p:?}");
                    if b && p.len() == 1 && bind(&e, &pod, &p[0]).is_empty() {
                        bound.insert((j, i));
                    }
                }
                Op::Single { gpus } => {
                    let pod = single(&format!("s{singles}"), gpus);
                    singles += 1;
                    let p = passed(&filter(&e, &pod));
                    let report = e.inspect(None).unwrap();
                    for n in &p {
                        let node = report.nodes.iter().find(|x| &x.name == n).unwrap();
                        // a group's reservation (a single's own offer hold, `#offer`, is not one)
                        let all_reserved = node.gpus.iter().all(|g| g.holders.iter().any(|h| h.pod.contains('#') && !h.pod.ends_with("#offer")));
                        proptest::prop_assert!(!all_reserved, "single offered fully reserved node {n}");
                    }
                    if let Some(n) = p.first() {
                        bind(&e, &pod, n);
                    }
                }
                Op::Delete { job: j, i } => {
                    let (name, _, _) = job(j);
                    e.release_pod(&format!("uid-{name}-{i}"));
                    bound.remove(&(j, i));
                }
                Op::Node { n, back } => {
                    let name = format!("gpu-{n:02}");
                    if back {
                        if !e.has_node(&name) {
                            e.upsert_node(all.node(&name).unwrap().clone());
                        }
                    } else {
                        e.remove_node(&name);
                    }
                }
            }
            let report = e.inspect(None).unwrap();
            let mut held: BTreeMap<String, usize> = BTreeMap::new();
            for n in &report.nodes {
                let pods: BTreeSet<&str> =
                    n.gpus.iter().flat_map(|g| g.holders.iter()).map(|h| h.pod.as_str()).filter(|p| p.contains('#')).collect();
                held.insert(n.name.clone(), pods.len());
            }
            let mut planned: BTreeMap<String, usize> = BTreeMap::new();
            for g in &report.groups {
                proptest::prop_assert!(g.reserved.len() + g.members_bound <= g.size.max(g.members_seen), "{g:?}");
                if g.domain.is_none() {
                    proptest::prop_assert!(g.reserved.is_empty(), "{g:?}");
                }
                for r in &g.reserved {
                    *planned.entry(r.node.clone()).or_default() += 1;
                }
            }
            held.retain(|_, v| *v > 0);
            proptest::prop_assert_eq!(&held, &planned);
        }
    }
}

/// An elastic member (`gpuplace.io/group-min`) of a job of `size` pods that needs `min` to start,
/// under one ToR.
fn elastic(job: &str, i: usize, size: usize, min: usize) -> Value {
    let mut p = member(job, i, size, whole(8));
    p["metadata"]["annotations"]["gpuplace.io/group-min"] = json!(min.to_string());
    p["metadata"]["annotations"]["gpuplace.io/group-topology"] = json!(TOR);
    p
}

/// 8 nodes, 2 ToRs: tor-0 keeps gpu-02 and gpu-03 whole, tor-1 only gpu-07.
fn two_whole_nodes_in_tor_0() -> Extender {
    let e = extender(cluster(8));
    for (i, n) in ["gpu-00", "gpu-01", "gpu-04", "gpu-05", "gpu-06"].iter().enumerate() {
        fill(&e, &format!("busy-{i}"), n, 8);
    }
    e
}

/// The one reason every node got.
fn reason(r: &ExtenderFilterResult) -> String {
    let reasons: BTreeSet<&String> = r.failed_and_unresolvable_nodes.values().collect();
    assert_eq!(reasons.len(), 1, "{r:?}");
    reasons.into_iter().next().cloned().unwrap_or_default()
}

#[test]
fn an_elastic_group_starts_its_minimum_and_the_rest_join_under_its_tor_as_room_appears() {
    let e = two_whole_nodes_in_tor_0();
    let job: Vec<Value> = (0..4).map(|i| elastic("el", i, 4, 2)).collect();
    // room for 2 of 4 under one ToR: the 2 start there
    let a = place(&e, &job[0]);
    let b = place(&e, &job[1]);
    assert_eq!([tor_of(&e, &a), tor_of(&e, &b)], ["tor-0", "tor-0"]);
    // the other 2 wait, though gpu-07 in tor-1 is whole
    for m in &job[2..] {
        let r = filter(&e, m);
        assert!(passed(&r).is_empty() && r.error.is_empty(), "{r:?}");
        assert_eq!(reason(&r), "gpuplace: group el has 2 pods placed; its tor has no room for more");
    }
    assert_eq!(reserved_gpus(&e), 0.0, "members that wait hold nothing");
    // room appears under tor-0, one node at a time: each waiting member joins there
    e.release_pod("uid-busy-0");
    assert_eq!(place(&e, &job[2]), "gpu-00");
    assert!(passed(&filter(&e, &job[3])).is_empty());
    e.release_pod("uid-busy-1");
    assert_eq!(place(&e, &job[3]), "gpu-01");
    let g = &e.inspect(None).unwrap().groups[0];
    assert_eq!((g.size, g.min, g.members_bound), (4, 2, 4), "{g:?}");
}

/// Records the pods sent back to kube-scheduler's queue.
#[derive(Default)]
struct Requeued(std::sync::Mutex<Vec<String>>);

impl Requeuer for Requeued {
    fn requeue(&self, pods: Vec<RequeuePod>) {
        self.0.lock().unwrap().extend(pods.into_iter().map(|p| p.name));
    }
}

/// kube-scheduler retries a pod it was told fits nowhere only on a cluster event; its retry after a
/// deletion can reach the extender before the extender's own watch saw the deletion. A member that
/// waits for its group's room is then sent back to the queue once the GPUs are freed (measured in
/// tests/e2e: without it, one of the elastic job's members stayed pending for two minutes).
#[test]
fn a_waiting_member_rejected_just_before_a_freeing_goes_back_to_the_queue() {
    let e = two_whole_nodes_in_tor_0();
    let requeued = Arc::new(Requeued::default());
    e.set_requeuer(requeued.clone());
    let job: Vec<Value> = (0..4).map(|i| elastic("el", i, 4, 2)).collect();
    place(&e, &job[0]);
    place(&e, &job[1]);
    assert!(passed(&filter(&e, &job[2])).is_empty());
    assert!(requeued.0.lock().unwrap().is_empty());
    e.release_pod("uid-busy-0");
    assert_eq!(*requeued.0.lock().unwrap(), ["el-2"], "sent back once, when GPUs were freed");
    // placed now; a member offered a node is not remembered: the next freeing sends nothing back
    assert_eq!(place(&e, &job[2]), "gpu-00");
    e.release_pod("uid-busy-1");
    assert_eq!(requeued.0.lock().unwrap().len(), 1);
}

#[test]
fn an_elastic_group_with_room_for_all_starts_all_and_one_short_of_its_minimum_starts_none() {
    let e = extender(cluster(8));
    let job: Vec<Value> = (0..4).map(|i| elastic("all", i, 4, 2)).collect();
    let nodes: Vec<String> = job.iter().map(|m| place(&e, m)).collect();
    assert_eq!(nodes.iter().map(|n| tor_of(&e, n)).collect::<BTreeSet<_>>().len(), 1, "{nodes:?}");
    // one whole node left per ToR: a job that needs 2 to start starts none
    let e = two_whole_nodes_in_tor_0();
    fill(&e, "busy-x", "gpu-03", 8);
    let r = filter(&e, &elastic("el", 0, 4, 2));
    assert_eq!(reason(&r), "gpuplace: group el needs 2 pods of 8 GPUs under one tor; best tor holds 1");
    assert_eq!(reserved_gpus(&e), 0.0);
}

#[test]
fn a_gang_beyond_its_min_count_waits_with_plain_rejections_while_its_quorum_is_placed() {
    let e = two_whole_nodes_in_tor_0();
    e.observe_pod_group("ml/pg", PodGroupInfo { min_count: Some(2), topology_keys: vec![TOR.into()] });
    let gang: Vec<Value> = (0..4).map(|i| gang_member("pg", i, whole(8))).collect();
    // kube-scheduler's group cycle filters all four: two get the ToR's nodes, two are rejected on
    // every node without an error (an error would end the cycle for the two that fit)
    let planned: Vec<String> = gang[..2].iter().map(|m| passed(&filter(&e, m))[0].clone()).collect();
    for m in &gang[2..] {
        let r = filter(&e, m);
        assert!(r.error.is_empty() && passed(&r).is_empty(), "{r:?}");
    }
    for (m, n) in gang[..2].iter().zip(&planned) {
        assert_eq!(bind(&e, m, n), "");
    }
    // started: a retry with no room is an error (kube-scheduler's error back-off), then room appears
    let r = filter(&e, &gang[2]);
    assert_eq!(r.error, "gpuplace: group pg has 2 pods placed; its tor has no room for more");
    e.release_pod("uid-busy-0");
    e.release_pod("uid-busy-1");
    let joined: Vec<String> = gang[2..].iter().map(|m| place(&e, m)).collect();
    assert_eq!(joined, ["gpu-00", "gpu-01"]);
}

#[test]
fn members_beyond_a_quorum_leave_the_room_a_whole_waiting_group_needs() {
    let e = two_whole_nodes_in_tor_0();
    let el: Vec<Value> = (0..4).map(|i| elastic("el", i, 4, 2)).collect();
    place(&e, &el[0]);
    place(&e, &el[1]);
    // a job of 2 whole nodes under one ToR waits: no ToR has 2 whole nodes now
    let job: Vec<Value> = (0..2)
        .map(|i| {
            let mut p = member("job", i, 2, whole(8));
            p["metadata"]["annotations"]["gpuplace.io/group-topology"] = json!(TOR);
            p
        })
        .collect();
    assert!(passed(&filter(&e, &job[0])).is_empty());
    // tor-0 gets 2 whole nodes back: the elastic group's extra member does not take one of them
    e.release_pod("uid-busy-0");
    e.release_pod("uid-busy-1");
    let r = filter(&e, &el[2]);
    assert_eq!(reason(&r), "gpuplace: group el has 2 pods placed; room for more is kept for group job");
    let nodes: BTreeSet<String> = job.iter().map(|m| place(&e, m)).collect();
    assert_eq!(nodes, BTreeSet::from(["gpu-00".to_string(), "gpu-01".to_string()]));
}

/// The pod watcher saw `pod` pending (API-server mode), as `k8s::pods` reports it.
fn seen_pending(e: &Extender, pod: &Value) {
    let w: gpuplace::extender::wire::Pod = serde_json::from_value(pod.clone()).expect("a wire pod");
    e.observe_pod(&gpuplace::scheduler::service::observe::ObservedPod::of(&w));
}

/// Issue 48: where every pod is watched, a group reserves room only for the pods that exist. One pod
/// claiming `gpuplace.io/group-size: 16` (two ToRs of whole nodes) holds nothing; the group is planned
/// once its pods all exist, and the members turned away meanwhile are sent back to the queue then.
#[test]
fn where_pods_are_watched_a_group_reserves_only_for_the_pods_that_exist() {
    let e = extender_with(cluster(16), Arc::new(RecordingBinder::new()), Duration::from_secs(300));
    e.set_pods_watched();
    let requeued = Arc::new(Requeued::default());
    e.set_requeuer(requeued.clone());
    // a lone pod naming a size no pods back
    let greedy = member("greedy", 0, 16, whole(8));
    seen_pending(&e, &greedy);
    let r = filter(&e, &greedy);
    assert!(passed(&r).is_empty(), "{r:?}");
    assert!(
        r.failed_and_unresolvable_nodes
            .values()
            .all(|v| v.contains("waits for all 16 pods (1 exist) before it reserves")),
        "{r:?}"
    );
    assert_eq!(reserved_gpus(&e), 0.0, "a size no pods back reserved GPUs");
    // a real job of 4: its first members wait, reserving nothing; the last one's arrival plans it and
    // sends the ones turned away back to the queue
    let job: Vec<Value> = (0..4).map(|i| member("job", i, 4, whole(8))).collect();
    for (i, m) in job.iter().enumerate().take(3) {
        seen_pending(&e, m);
        assert!(passed(&filter(&e, m)).is_empty(), "member {i} passed before the group's pods all exist");
    }
    assert_eq!(reserved_gpus(&e), 0.0);
    assert!(requeued.0.lock().unwrap().is_empty());
    seen_pending(&e, &job[3]);
    let mut woken = requeued.0.lock().unwrap().clone();
    woken.sort();
    assert_eq!(woken, ["job-0", "job-1", "job-2"], "the members turned away go back to the queue");
    let nodes: BTreeSet<String> = job.iter().map(|m| place(&e, m)).collect();
    assert_eq!(nodes.len(), 4, "one whole node each");
    assert_eq!(nodes.iter().map(|n| tor_of(&e, n)).collect::<BTreeSet<_>>().len(), 1, "under one ToR");
    // static mode (no watcher: members known from their filters) keeps reserving for the whole size
    let s = extender_with(cluster(16), Arc::new(RecordingBinder::new()), Duration::from_secs(300));
    assert_eq!(passed(&filter(&s, &member("job", 0, 4, whole(8)))).len(), 1);
    assert_eq!(reserved_gpus(&s), 32.0);
}
