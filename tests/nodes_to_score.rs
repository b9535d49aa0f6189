//! Filter names only the best nodes that fit (`serve --nodes-to-score`, `NodesToScore`): kube-scheduler
//! then scores only those, and with one it skips its score plugins and the prioritize call. Pods with
//! preferences kube-scheduler weighs get more; a pod that fits nowhere still gets every reason.

use std::collections::BTreeMap;
use std::path::Path;

use gpuplace::extender::wire::ExtenderFilterResult;
use gpuplace::extender::Extender;
use gpuplace::placement_log::writer::PlacementLog;
use gpuplace::placement_log::Decision;
use gpuplace::scheduler::service::{NodesToScore, ServiceOptions};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::Board;
use harness::{args, Harness};
use serde_json::{json, Value};

#[path = "support/harness.rs"]
mod harness;

/// 12 nodes of 8 H100s; node `gpu-k` has k of its GPUs held whole, so nodes differ in how well a
/// share packs.
fn cluster() -> Cluster {
    let board = Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 }
        .resolve(Path::new("."))
        .unwrap();
    let nodes = (0..12).map(|i| board.node(&format!("gpu-{i:02}"), BTreeMap::new(), 0, 0)).collect();
    let mut c = Cluster::new(nodes);
    for i in 0..12u32 {
        let slices: Vec<GpuSlice> =
            (0..i % 8).map(|g| GpuSlice { gpu: g, mem_mib: 81559, core_pct: 100, exclusive: true }).collect();
        if slices.is_empty() {
            continue;
        }
        let containers = vec![ContainerAssignment { name: "c".into(), init: false, slices }];
        let node = format!("gpu-{i:02}");
        let a =
            PodAssignment { pod: format!("ns/busy-{i}"), node, containers, cpu_milli: 0, memory_mib: 0, group: None };
        c.allocate(a).unwrap();
    }
    c
}

fn service(nodes_to_score: NodesToScore, log: Option<PlacementLog>) -> Extender {
    Harness::new(cluster())
        .options(ServiceOptions { nodes_to_score, ..ServiceOptions::default() })
        .placement_log(log)
        .build()
}

/// [`harness::pod`] with `spec_extra`'s fields added to its spec.
fn pod(name: &str, limits: Value, spec_extra: Value) -> Value {
    let mut p = harness::pod(name, limits);
    if let (Some(s), Some(extra)) = (p["spec"].as_object_mut(), spec_extra.as_object()) {
        s.extend(extra.clone());
    }
    p
}

fn body(pod: &Value) -> Vec<u8> {
    let names: Vec<String> = (0..12).map(|i| format!("gpu-{i:02}")).collect();
    args(pod, &names)
}

fn filter(ext: &Extender, pod: &Value) -> ExtenderFilterResult {
    let a = ext.filter(&body(pod)).unwrap();
    // the encoder kube-scheduler reads gives the same answer
    let encoded: ExtenderFilterResult = serde_json::from_slice(&ext.filter_json(&body(pod)).unwrap()).unwrap();
    assert_eq!(a, encoded);
    a
}

fn share() -> Value {
    json!({"gpuplace.io/gpu": "1", "gpuplace.io/gpu-core": "30"})
}

#[test]
fn only_the_best_node_is_named_and_it_is_the_best_scored() {
    let every = service(NodesToScore::default(), None);
    let best = service(NodesToScore { plain: 1, soft: 4 }, None);
    let p = pod("share", share(), json!({}));
    let all = filter(&every, &p);
    assert_eq!(all.node_names.as_ref().unwrap().len(), 12, "every node fits a share");
    let one = filter(&best, &p);
    let named = one.node_names.unwrap();
    assert_eq!(named.len(), 1);
    assert!(one.failed_nodes.is_empty() && one.failed_and_unresolvable_nodes.is_empty());
    // the node named has the highest prioritize score of all
    let scores = every.prioritize(&body(&p)).unwrap();
    let top = scores.iter().map(|h| h.score).max().unwrap();
    let chosen = scores.iter().find(|h| h.host == named[0]).unwrap();
    assert_eq!(chosen.score, top, "{named:?} is not among the best scored: {scores:?}");
}

#[test]
fn pods_with_preferences_kube_scheduler_weighs_get_more_nodes() {
    let ext = service(NodesToScore { plain: 1, soft: 4 }, None);
    let preferred = json!({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}
    ]}}});
    let spread = json!({"topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ]});
    let hard = json!({"topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    ]});
    for (extra, want) in [(preferred, 4), (spread, 4), (hard, 1)] {
        let a = filter(&ext, &pod("p", share(), extra.clone()));
        assert_eq!(a.node_names.unwrap().len(), want, "{extra}");
    }
}

#[test]
fn a_pod_that_fits_nowhere_still_gets_every_reason() {
    let ext = service(NodesToScore { plain: 1, soft: 4 }, None);
    let a = filter(&ext, &pod("big", json!({"gpuplace.io/gpu": "16"}), json!({})));
    assert!(a.node_names.unwrap().is_empty());
    assert_eq!(a.failed_nodes.len() + a.failed_and_unresolvable_nodes.len(), 12);
    // fewer nodes fit than may be named: all of them, with the reasons of the others
    let whole8 = filter(&ext, &pod("w8", json!({"gpuplace.io/gpu": "8"}), json!({})));
    let fits = whole8.node_names.unwrap();
    assert_eq!(fits.len(), 1, "only gpu-00 and gpu-08 have 8 idle GPUs; the best of them: {fits:?}");
    let every = service(NodesToScore::default(), None);
    let all = filter(&every, &pod("w8", json!({"gpuplace.io/gpu": "8"}), json!({})));
    assert_eq!(all.node_names.unwrap(), ["gpu-00", "gpu-08"]);
    assert_eq!(all.failed_nodes.len() + all.failed_and_unresolvable_nodes.len(), 10);
}

#[test]
fn the_placement_log_keeps_what_fit_and_says_how_many_were_named() {
    let dir = std::env::temp_dir().join(format!("gpuplace-offer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("p.jsonl");
    let log = PlacementLog::open(path.to_str().unwrap(), 1 << 30).unwrap();
    let ext = service(NodesToScore { plain: 1, soft: 4 }, Some(log));
    filter(&ext, &pod("w4", json!({"gpuplace.io/gpu": "4"}), json!({})));
    drop(ext);
    let text = std::fs::read_to_string(&path).unwrap();
    let d: Decision = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    // gpu-00..04 and gpu-08..11 have 4 idle GPUs or more
    assert_eq!((d.feasible, d.offered), (9, Some(1)));
    assert_eq!(d.rejections.values().sum::<usize>(), 3, "the rejected nodes' reasons stay in the log");
    let _ = std::fs::remove_dir_all(&dir);
}
