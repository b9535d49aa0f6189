//! The reasons kube-scheduler receives from filter (and the errors from filter and bind) group across
//! nodes and never carry a `%`.
//!
//! kube-scheduler counts identical reason texts and writes "0/16 nodes are available: 12 <reason
//! A>, 4 <reason B>." into the pod's FailedScheduling event, which the API server refuses beyond
//! 1,024 characters; and it formats the reasons with Go's `fmt`, where `30% free` comes out as
//! `30%!f(MISSING)ree`. So a reason may depend on the pod's request and the kind of shortfall only,
//! and each node's own figures go to the placement log and the debug log.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use gpuplace::extender::wire::{ExtenderFilterResult, Pod};
use gpuplace::extender::Extender;
use gpuplace::placement::engine::Engine;
use gpuplace::placement::feasibility::{largest_gpus, oversized, Cause};
use gpuplace::placement::mix::WorkloadMix;
use gpuplace::placement::profile::Profile;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::Decision;
use gpuplace::scheduler::reasons::MAX_DETAILED_NODES;
use gpuplace::scheduler::service::{ServiceOptions, NOT_READY};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::inventory::{Board, ResolvedBoard};
use harness::{Harness, NOW};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tracing_subscriber::layer::{Layer, SubscriberExt};

#[path = "support/harness.rs"]
mod harness;

fn engine() -> Engine {
    Engine::new(Profile::default(), WorkloadMix::default())
}

fn service(cluster: Cluster, shape_cache: usize, log: Option<PlacementLog>) -> Extender {
    Harness::new(cluster)
        .options(ServiceOptions { shape_cache, ..ServiceOptions::default() })
        .clock(NOW)
        .placement_log(log)
        .build()
}

fn board(kind: usize) -> ResolvedBoard {
    let b = match kind {
        0 => Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 },
        1 => Board::Pcie {
            model: "L4".into(),
            memory_mib: 22491,
            sockets: 2,
            switches_per_socket: 2,
            gpus_per_switch: 2,
        },
        _ => Board::Flat { gpus: 2, model: "T4".into(), memory_mib: 15109 },
    };
    b.resolve(Path::new(".")).unwrap()
}

fn hold(c: &mut Cluster, pod: &str, node: &str, slices: Vec<GpuSlice>) {
    let containers = vec![ContainerAssignment { name: "c".into(), init: false, slices }];
    let a = PodAssignment { pod: pod.into(), node: node.into(), containers, cpu_milli: 0, memory_mib: 0, group: None };
    c.allocate(a).unwrap();
}

fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct, exclusive: false }
}

fn whole(gpu: u32, mem_mib: u64) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct: 100, exclusive: true }
}

/// A cluster of 6 to 20 nodes in random states: busy and idle GPUs, whole and shared, device-plugin
/// slots, unhealthy GPUs and GPUs of other models.
fn random_cluster(seed: u64) -> Cluster {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut nodes: Vec<Node> = (0..rng.random_range(6..=20))
        .map(|i| {
            let mut n = board(rng.random_range(0..3)).node(&format!("node-{i}"), BTreeMap::new(), 0, 0);
            if rng.random_bool(0.3) {
                n = n.with_slots_per_gpu(Some(rng.random_range(1..=3)));
            }
            let all_sick = rng.random_bool(0.1);
            for g in 0..n.gpus.len() {
                if all_sick || rng.random_bool(0.1) {
                    n.set_gpu_health(g, false);
                }
                if rng.random_bool(0.05) {
                    n.gpus[g].model = "A100".into();
                }
            }
            n
        })
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let plan: Vec<(String, Vec<u64>)> =
        nodes.iter().map(|n| (n.name.clone(), n.gpus.iter().map(|g| g.memory_mib).collect())).collect();
    let mut c = Cluster::new(nodes);
    let level = rng.random_range(0.0..1.0);
    let mut pod = 0;
    for (name, caps) in plan {
        for (g, &cap) in caps.iter().enumerate() {
            for _ in 0..rng.random_range(0..3) {
                if !rng.random_bool(level) {
                    continue;
                }
                let slice = if rng.random_bool(0.3) {
                    whole(g as u32, cap)
                } else {
                    share(g as u32, rng.random_range(0..=cap / 2), rng.random_range(0..=60))
                };
                pod += 1;
                let containers = vec![ContainerAssignment { name: "c".into(), init: false, slices: vec![slice] }];
                let a = PodAssignment {
                    pod: format!("fill/{pod}"),
                    node: name.clone(),
                    containers,
                    cpu_milli: 0,
                    memory_mib: 0,
                    group: None,
                };
                // over-full picks are simply not counted
                let _ = c.allocate(a);
            }
        }
    }
    c
}

/// One GPU container: (GPUs, kind, MiB per GPU, percent per GPU). Kinds: whole GPUs, memory and
/// compute, compute only (memory in proportion), memory only. Compute may exceed 100 per GPU, which
/// the contract refuses with a message that has `%` in it.
type ContainerSpec = (u32, u8, u64, u32);

fn limits((gpus, kind, mem, core): ContainerSpec) -> Value {
    let n = gpus.to_string();
    match kind {
        0 => json!({ "gpuplace.io/gpu": n }),
        1 => json!({ "gpuplace.io/gpu": n, "gpuplace.io/gpu-mem": (mem * u64::from(gpus)).to_string(),
                     "gpuplace.io/gpu-core": (core * gpus).to_string() }),
        2 => json!({ "gpuplace.io/gpu": n, "gpuplace.io/gpu-core": (core * gpus).to_string() }),
        _ => json!({ "gpuplace.io/gpu": n, "gpuplace.io/gpu-mem": (mem * u64::from(gpus)).to_string() }),
    }
}

fn container() -> impl Strategy<Value = ContainerSpec> {
    (1u32..=4, 0u8..4, 1u64..=90_000, prop_oneof![8 => 1u32..=100, 1 => 101u32..=150])
}

#[derive(Debug, Clone)]
struct PodSpec {
    containers: Vec<ContainerSpec>,
    init: Option<ContainerSpec>,
    model: Option<&'static str>,
    numa_required: bool,
}

fn pod_spec() -> impl Strategy<Value = PodSpec> {
    let models =
        prop_oneof![4 => Just(None), 1 => Just(Some("H100")), 1 => Just(Some("T4,L4")), 1 => Just(Some("B200"))];
    (proptest::collection::vec(container(), 1..=2), proptest::option::of(container()), models, any::<bool>())
        .prop_map(|(containers, init, model, numa_required)| PodSpec { containers, init, model, numa_required })
}

fn pod_json(spec: &PodSpec, name: &str) -> Value {
    let containers: Vec<Value> = spec
        .containers
        .iter()
        .enumerate()
        .map(|(i, &c)| json!({ "name": format!("c{i}"), "resources": { "limits": limits(c) } }))
        .collect();
    let init: Vec<Value> =
        spec.init.iter().map(|&c| json!({ "name": "init", "resources": { "limits": limits(c) } })).collect();
    let mut annotations = serde_json::Map::new();
    if let Some(m) = spec.model {
        annotations.insert("gpuplace.io/gpu-model".into(), json!(m));
    }
    if spec.numa_required {
        annotations.insert("gpuplace.io/numa".into(), json!("required"));
    }
    json!({
        "metadata": { "name": name, "namespace": "ns", "uid": format!("uid-{name}"), "annotations": annotations },
        "spec": { "containers": containers, "initContainers": init }
    })
}

/// Unknown candidates: (name, what its Node object says in full-Nodes mode: 0 advertises GPUs, 1 not).
fn filter_body(pod: &Value, cluster: &Cluster, unknown: &[(String, u8)], as_nodes: bool) -> Vec<u8> {
    let mut names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    names.extend(unknown.iter().map(|(n, _)| n.clone()));
    let body = if as_nodes {
        let items: Vec<Value> = names
            .iter()
            .map(|n| match unknown.iter().find(|(u, _)| u == n) {
                Some((_, 0)) => {
                    json!({ "metadata": { "name": n }, "status": { "allocatable": { "gpuplace.io/gpu": "8" } } })
                }
                _ => json!({ "metadata": { "name": n } }),
            })
            .collect();
        json!({ "Pod": pod, "Nodes": { "metadata": {}, "items": items }, "NodeNames": null })
    } else {
        json!({ "Pod": pod, "Nodes": null, "NodeNames": names })
    };
    body.to_string().into_bytes()
}

/// Every reason in the answer, by node, and whether it is unresolvable.
fn reasons(a: &ExtenderFilterResult) -> BTreeMap<&str, (&str, bool)> {
    let failed = a.failed_nodes.iter().map(|(n, r)| (n.as_str(), (r.as_str(), false)));
    failed.chain(a.failed_and_unresolvable_nodes.iter().map(|(n, r)| (n.as_str(), (r.as_str(), true)))).collect()
}

/// The message kube-scheduler builds from the answer (its own plugins' reasons left out): the nodes
/// counted by identical reason, "N reason" sorted.
fn scheduler_message(total: usize, a: &ExtenderFilterResult) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (r, _) in reasons(a).values() {
        *counts.entry(r).or_default() += 1;
    }
    let mut parts: Vec<String> = counts.iter().map(|(r, n)| format!("{n} {r}")).collect();
    parts.sort();
    format!("0/{total} nodes are available: {}.", parts.join(", "))
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    actix_web::rt::System::new().block_on(f)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Over random clusters and requests: no `%` in any text kube-scheduler receives, no node name
    /// in a reason, and nodes turned down for the same kind of shortfall get byte-identical reasons.
    #[test]
    fn reasons_group_by_cause_and_never_carry_a_percent_sign(
        seed in any::<u64>(),
        spec in pod_spec(),
        unknown in proptest::collection::vec(0u8..2, 0..4),
        as_nodes in any::<bool>(),
        shape_cache in any::<bool>(),
    ) {
        let cluster = random_cluster(seed);
        let ext = service(cluster.clone(), if shape_cache { 64 } else { 0 }, None);
        let unknown: Vec<(String, u8)> =
            unknown.iter().enumerate().map(|(i, &k)| (format!("unknown-{i}"), k)).collect();
        let pod = pod_json(&spec, "p");
        let a = ext.filter(&filter_body(&pod, &cluster, &unknown, as_nodes)).unwrap();
        prop_assert_eq!(&a.error, "");
        let all = reasons(&a);
        let names: Vec<&str> =
            cluster.nodes().iter().map(|n| n.name.as_str()).chain(unknown.iter().map(|(n, _)| n.as_str())).collect();
        for (node, (r, _)) in &all {
            prop_assert!(!r.contains('%'), "{}: {}", node, r);
            prop_assert!(r.starts_with("gpuplace: "), "{}: {}", node, r);
            prop_assert!(!names.iter().any(|n| r.contains(n)), "{} names a node: {}", node, r);
        }
        let wire_pod: Pod = serde_json::from_value(pod.clone()).unwrap();
        let Ok(req) = wire_pod.request() else {
            // refused by the contract: one reason for every node (the contract's message, scrubbed)
            prop_assert_eq!(all.len(), names.len());
            prop_assert_eq!(all.values().map(|(r, _)| *r).collect::<BTreeSet<_>>().len(), 1);
            return Ok(());
        };
        // a slice larger than every GPU the pod may use: one reason on every node of the cache, the
        // pod's own figure and the cluster's largest GPU, never fits
        if let Some(o) = oversized(&req, &largest_gpus(cluster.nodes())) {
            let want = format!("gpuplace: {o}");
            for n in cluster.nodes() {
                prop_assert_eq!(all.get(n.name.as_str()), Some(&(want.as_str(), true)), "{}", n.name);
            }
            prop_assert!(want.len() < 80, "{}", want);
            return Ok(());
        }
        // the engine's verdict on each rejected node of the cache: equal (class, cause), equal reason
        let engine = engine();
        let mut by_cause: HashMap<(bool, Cause), &str> = HashMap::new();
        for (i, n) in cluster.nodes().iter().enumerate() {
            let Some(&(r, unresolvable)) = all.get(n.name.as_str()) else { continue };
            let why = engine.explain(&cluster, &req, i).expect("rejected by filter, so by the engine");
            prop_assert_eq!(why.is_unresolvable(), unresolvable, "{}", n.name);
            prop_assert_eq!(r, format!("gpuplace: {}", why.cause()), "{}: {}", n.name, why.detail());
            let first = *by_cause.entry((unresolvable, why.cause())).or_insert(r);
            prop_assert_eq!(first, r, "{} and another node short of the same thing", n.name);
            prop_assert!(r.len() < 80, "{}", r);
        }
        // unknown candidates: one reason per kind, whatever their names
        let unknown_reasons: BTreeSet<&str> = unknown.iter().map(|(n, _)| all[n.as_str()].0).collect();
        let kinds: BTreeSet<u8> = unknown.iter().map(|&(_, k)| if as_nodes { k } else { 2 }).collect();
        prop_assert_eq!(unknown_reasons.len(), kinds.len(), "{:?}", unknown_reasons);
        // what a bind onto a rejected node answers reaches the pod's events too
        if let Some((node, _)) = all.iter().next() {
            let bind = json!({ "PodName": "p", "PodNamespace": "ns", "PodUID": "uid-p", "Node": node });
            let b = block_on(ext.bind(bind.to_string().as_bytes())).unwrap();
            prop_assert!(!b.error.is_empty() && !b.error.contains('%'), "{}", b.error);
        }
    }
}

/// A pod refused by the contract with a message that has `%` in it (150% compute on one GPU): the
/// reason every node gets, and bind's error, spell it out.
#[test]
fn contract_refusals_spell_out_percent_signs() {
    let cluster = random_cluster(7);
    let ext = service(cluster.clone(), 64, None);
    let spec = PodSpec { containers: vec![(1, 1, 1024, 150)], init: None, model: None, numa_required: false };
    let a = ext.filter(&filter_body(&pod_json(&spec, "p"), &cluster, &[], false)).unwrap();
    let texts: BTreeSet<&str> = reasons(&a).values().map(|(r, _)| *r).collect();
    assert_eq!(texts.len(), 1, "{texts:?}");
    let r = texts.first().unwrap();
    assert!(r.contains("150 percent per GPU") && !r.contains('%'), "{r}");
    let bind = json!({ "PodName": "p", "PodNamespace": "ns", "PodUID": "uid-p", "Node": "node-0" });
    let b = block_on(ext.bind(bind.to_string().as_bytes())).unwrap();
    assert!(b.error.contains("150 percent per GPU") && !b.error.contains('%'), "{}", b.error);
}

/// Not ready: filter's and bind's `Error` (shown in events too) have no `%` either.
#[test]
fn not_ready_errors_carry_no_percent_sign() {
    assert!(!NOT_READY.contains('%'));
    let cluster = random_cluster(1);
    let opts = ServiceOptions { ready: false, ..ServiceOptions::default() };
    let ext = Harness::new(cluster.clone()).options(opts).build();
    let spec = PodSpec { containers: vec![(1, 0, 0, 0)], init: None, model: None, numa_required: false };
    let a = ext.filter(&filter_body(&pod_json(&spec, "p"), &cluster, &[], false)).unwrap();
    assert_eq!(a.error, NOT_READY);
    let bind = json!({ "PodName": "p", "PodNamespace": "ns", "PodUID": "uid-p", "Node": "node-0" });
    assert_eq!(block_on(ext.bind(bind.to_string().as_bytes())).unwrap().error, NOT_READY);
}

/// 16 nodes in mixed states, none with room for a 20480 MiB / 30 percent share: the H100s full or
/// fragmented (each with a different most-free GPU), L4s likewise, T4s too small, one node with
/// every GPU unhealthy, one whose GPUs have room but no device-plugin slot, two unknown names.
fn mixed_cluster() -> (Cluster, Vec<(String, u8)>) {
    let mut nodes = Vec::new();
    for i in 0..6 {
        nodes.push(board(0).node(&format!("h100-{i}"), BTreeMap::new(), 0, 0));
    }
    for i in 0..4 {
        nodes.push(board(1).node(&format!("l4-{i}"), BTreeMap::new(), 0, 0));
    }
    for i in 0..2 {
        nodes.push(board(2).node(&format!("t4-{i}"), BTreeMap::new(), 0, 0));
    }
    let mut sick = board(0).node("sick-0", BTreeMap::new(), 0, 0);
    for g in 0..sick.gpus.len() {
        sick.set_gpu_health(g, false);
    }
    nodes.push(sick);
    nodes.push(board(1).node("slots-0", BTreeMap::new(), 0, 0).with_slots_per_gpu(Some(1)));
    let mut c = Cluster::new(nodes);
    for i in 0..3 {
        hold(&mut c, &format!("w/{i}"), &format!("h100-{i}"), (0..8).map(|g| whole(g, 81559)).collect());
    }
    for i in 3..6u64 {
        // most free: 12108 MiB on h100-3, 12108 - 997 on h100-4, ...
        let used = 81559 - 12108 + (i - 3) * 997;
        hold(&mut c, &format!("s/{i}"), &format!("h100-{i}"), (0..8).map(|g| share(g, used, 20)).collect());
    }
    for i in 0..4u64 {
        hold(&mut c, &format!("l/{i}"), &format!("l4-{i}"), (0..8).map(|g| share(g, 8000 + i * 1111, 10)).collect());
    }
    hold(&mut c, "slots/0", "slots-0", (0..8).map(|g| share(g, 100, 1)).collect());
    (c, vec![("gpu-node-x".into(), 0), ("gpu-node-y".into(), 0)])
}

fn share_pod(name: &str) -> Value {
    let spec = PodSpec { containers: vec![(1, 1, 20480, 30)], init: None, model: None, numa_required: false };
    pod_json(&spec, name)
}

#[test]
fn sixteen_mixed_nodes_give_a_handful_of_reasons_and_a_short_event() {
    let (cluster, unknown) = mixed_cluster();
    let log_path = std::env::temp_dir().join(format!("gpuplace-reasons-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&log_path);
    let log = PlacementLog::open(log_path.to_str().unwrap(), 1 << 20).unwrap();
    let logged = service(cluster.clone(), 64, Some(log));
    let cached = service(cluster.clone(), 64, None);
    let body = filter_body(&share_pod("p"), &cluster, &unknown, false);
    let a = logged.filter(&body).unwrap();
    assert_eq!(a, cached.filter(&body).unwrap(), "the shape cache answers alike");
    assert_eq!(a.node_names, Some(vec![]));
    let all = reasons(&a);
    assert_eq!(all.len(), 16);
    let distinct: BTreeSet<&str> = all.values().map(|(r, _)| *r).collect();
    assert_eq!(
        distinct,
        BTreeSet::from([
            "gpuplace: no GPU with 20480 MiB and 30 percent free",
            "gpuplace: no healthy GPU of an allowed model",
            "gpuplace: no device-plugin slot left on the GPUs with room",
            "gpuplace: node not in gpuplace's node cache, its GPUs are unknown",
        ])
    );
    let message = scheduler_message(16, &a);
    assert_eq!(
        message,
        "0/16 nodes are available: 1 gpuplace: no device-plugin slot left on the GPUs with room, \
         1 gpuplace: no healthy GPU of an allowed model, \
         12 gpuplace: no GPU with 20480 MiB and 30 percent free, \
         2 gpuplace: node not in gpuplace's node cache, its GPUs are unknown."
    );
    assert!(message.len() < 300 && !message.contains('%'), "{}", message.len());

    // each node's own figures are in the placement log, as they would have been in the reasons
    let line = std::fs::read_to_string(&log_path).unwrap();
    let d: Decision = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let _ = std::fs::remove_file(&log_path);
    assert_eq!(d.rejection_details.len(), 16);
    assert!(d.rejection_details["h100-3"].contains("most free is 12108 MiB / 80%"), "{:?}", d.rejection_details);
    assert!(d.rejection_details["h100-4"].contains("most free is 11111 MiB"), "{:?}", d.rejection_details);
    assert!(d.rejection_details["gpu-node-x"].contains("gpu-node-x"), "{:?}", d.rejection_details);
    assert_eq!(d.rejections.len(), 4, "{:?}", d.rejections);
    assert_eq!(d.rejections["gpuplace: no GPU with 20480 MiB and 30 percent free"], 12);
    // which is what made the event too long to be recorded
    let per_node: usize = d.rejection_details.values().map(|r| format!("1 gpuplace: {r}, ").len()).sum();
    assert!(per_node > 1024, "the per-node texts would have made a {per_node}-character message");
}

/// Issue 28, item 3: a pod too big for any GPU is told it can never fit, and how big the largest GPU
/// is, in one reason on every node: not "no GPU with 200000 MiB and 30 percent free", which reads like
/// a full cluster.
#[test]
fn a_slice_larger_than_any_gpu_says_it_never_fits_and_names_the_largest_gpu() {
    let (cluster, unknown) = mixed_cluster();
    let largest = cluster.nodes().iter().flat_map(|n| &n.gpus).map(|g| g.memory_mib).max().unwrap();
    for shape_cache in [0, 64] {
        let ext = service(cluster.clone(), shape_cache, None);
        let spec = PodSpec { containers: vec![(1, 1, 200_000, 30)], init: None, model: None, numa_required: false };
        let a = ext.filter(&filter_body(&pod_json(&spec, "big"), &cluster, &unknown, false)).unwrap();
        assert_eq!(a.node_names, Some(vec![]));
        let want = format!("gpuplace: asks 200000 MiB of one GPU; the largest GPU has {largest} MiB");
        for n in cluster.nodes() {
            assert_eq!(reasons(&a)[n.name.as_str()], (want.as_str(), true), "{}", n.name);
        }
        let message = scheduler_message(16, &a);
        assert!(message.contains(&format!("14 {want}")) && !message.contains('%'), "{message}");
        // with a model named, the largest of that model
        let spec = PodSpec { model: Some("L4"), ..spec };
        let a = ext.filter(&filter_body(&pod_json(&spec, "big-l4"), &cluster, &[], false)).unwrap();
        let l4 = cluster.nodes().iter().flat_map(|n| &n.gpus).filter(|g| g.model == "L4").map(|g| g.memory_mib).max();
        let want = format!("gpuplace: asks 200000 MiB of one GPU; its models' largest GPU has {} MiB", l4.unwrap());
        assert!(reasons(&a).values().all(|(r, u)| *r == want && *u), "{:?}", reasons(&a));
    }
    // what fits the largest GPU is judged node by node as before
    let ext = service(cluster.clone(), 0, None);
    let spec = PodSpec { containers: vec![(1, 1, largest, 30)], init: None, model: None, numa_required: false };
    let a = ext.filter(&filter_body(&pod_json(&spec, "fits"), &cluster, &[], false)).unwrap();
    assert!(reasons(&a).values().all(|(r, _)| !r.contains("never") && !r.contains("largest GPU")), "{:?}", reasons(&a));
}

#[test]
fn details_are_bounded_for_large_clusters() {
    let nodes: Vec<Node> =
        (0..3 * MAX_DETAILED_NODES).map(|i| board(2).node(&format!("t4-{i:03}"), BTreeMap::new(), 0, 0)).collect();
    let cluster = Cluster::new(nodes);
    let log_path = std::env::temp_dir().join(format!("gpuplace-reasons-big-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&log_path);
    let ext = service(cluster.clone(), 64, Some(PlacementLog::open(log_path.to_str().unwrap(), 1 << 20).unwrap()));
    let a = ext.filter(&filter_body(&share_pod("p"), &cluster, &[], false)).unwrap();
    assert_eq!(reasons(&a).values().map(|(r, _)| *r).collect::<BTreeSet<_>>().len(), 1, "T4s are too small alike");
    let line = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    let d: Decision = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert_eq!(d.rejection_details.len(), MAX_DETAILED_NODES);
    assert_eq!(d.rejection_classes["unresolvable"], 3 * MAX_DETAILED_NODES);
    // the first ones in the order sent
    assert_eq!(d.rejection_details.keys().next().map(String::as_str), Some("t4-000"));
    assert!(d.rejection_details.contains_key(&format!("t4-{:03}", MAX_DETAILED_NODES - 1)));
}

/// A writer the debug log lines are captured in.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

thread_local! {
    /// Whether this thread's events are captured (the other tests run without a debug log).
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
}

/// The log lines of `f`, at every level. One global subscriber that takes events only from threads
/// that capture: a scoped one (`with_default`) misses events whose callsites another test thread
/// registered first.
fn captured(f: impl FnOnce()) -> String {
    static OUT: OnceLock<Captured> = OnceLock::new();
    let out = OUT.get_or_init(|| {
        let out = Captured::default();
        let writer = out.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .with_filter(tracing_subscriber::filter::dynamic_filter_fn(|_, _| CAPTURING.with(Cell::get)));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();
        out
    });
    CAPTURING.with(|c| c.set(true));
    f();
    CAPTURING.with(|c| c.set(false));
    let text = String::from_utf8(std::mem::take(&mut *out.0.lock().unwrap())).unwrap();
    text
}

#[test]
fn debug_log_keeps_each_nodes_figures() {
    let (cluster, unknown) = mixed_cluster();
    let ext = service(cluster.clone(), 64, None);
    let text = captured(|| {
        ext.filter(&filter_body(&share_pod("p"), &cluster, &unknown, false)).unwrap();
    });
    let rejected: Vec<&str> = text.lines().filter(|l| l.contains("node rejected")).collect();
    assert_eq!(rejected.len(), 16, "{text}");
    let h100 = rejected.iter().find(|l| l.contains("node=h100-3")).unwrap();
    assert!(h100.contains("most free is 12108 MiB"), "{h100}");
}

/// Issue 49, item 5: a pod that requires an enforced isolation mode (`gpuplace.io/isolation`) is
/// turned down, with one reason that groups, on nodes whose published mode does not enforce memory
/// (or that publish none: advisory), and placed where the mode does; a list names the modes
/// accepted; a value that is neither is refused as a contract error that says what to write.
#[test]
fn a_pod_requiring_enforced_isolation_is_refused_on_advisory_nodes_and_placed_on_a_guard_node() {
    use gpuplace_core::isolation::IsolationMode;
    let nodes = vec![
        board(2).node("advisory-0", BTreeMap::new(), 0, 0).with_isolation(Some(IsolationMode::Advisory)),
        board(2).node("older-0", BTreeMap::new(), 0, 0),
        board(2).node("guard-0", BTreeMap::new(), 0, 0).with_isolation(Some(IsolationMode::Guard)),
        board(2).node("mps-0", BTreeMap::new(), 0, 0).with_isolation(Some(IsolationMode::Mps)),
    ];
    let cluster = Cluster::new(nodes);
    let spec = PodSpec { containers: vec![(1, 1, 4096, 30)], init: None, model: None, numa_required: false };
    let pod = |name: &str, requirement: Option<&str>| {
        let mut p = pod_json(&spec, name);
        if let Some(r) = requirement {
            p["metadata"]["annotations"]["gpuplace.io/isolation"] = json!(r);
        }
        p
    };
    let refused = "gpuplace: node's isolation mode is not one gpuplace.io/isolation accepts";
    for shape_cache in [0, 64] {
        let ext = service(cluster.clone(), shape_cache, None);
        let answer = |p: Value| ext.filter(&filter_body(&p, &cluster, &[], false)).unwrap();
        let a = answer(pod("free", None));
        assert_eq!(a.node_names.map(|n| n.len()), Some(4), "no requirement: every node");
        let a = answer(pod("strict", Some("enforced")));
        assert_eq!(a.node_names, Some(vec!["guard-0".to_string(), "mps-0".to_string()]));
        let r = reasons(&a);
        assert_eq!(r, BTreeMap::from([("advisory-0", (refused, true)), ("older-0", (refused, true))]));
        assert!(!refused.contains('%'));
        assert_eq!(scheduler_message(4, &a), format!("0/4 nodes are available: 2 {refused}."));
        let a = answer(pod("mps-only", Some("mps,driver-limits")));
        assert_eq!(a.node_names, Some(vec!["mps-0".to_string()]));
        assert_eq!(reasons(&a)["guard-0"], (refused, true));
        let a = answer(pod("typo", Some("strict")));
        assert_eq!(a.node_names.clone().unwrap_or_default(), Vec::<String>::new());
        let texts: BTreeSet<&str> = reasons(&a).values().map(|(r, _)| *r).collect();
        let r = texts.first().unwrap();
        assert!(texts.len() == 1 && r.contains("gpuplace.io/isolation") && r.contains("enforced"), "{texts:?}");
    }
}
