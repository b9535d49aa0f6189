//! Offer holds (`scheduler::service::offers`): when a filter answer names exactly one node where a
//! pod fits, kube-scheduler can only bind it there, and binds it after its cycle, in the background.
//! The GPUs are held meanwhile, so the next pod's filter does not name GPUs the previous pod is about
//! to take (before, its bind then failed with "no longer fits" and the pod went to back-off).

use std::collections::BTreeMap;
use std::path::Path;

use gpuplace::extender::Extender;
use gpuplace::scheduler::service::{NodesToScore, ServiceOptions};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::Board;
use harness::{bind, filter, passed, pod, whole, Harness};

#[path = "support/harness.rs"]
mod harness;

/// `n` nodes of 2 H100s.
fn cluster(n: usize) -> Cluster {
    let board = Board::Nvswitch { gpus: 2, model: "H100".into(), memory_mib: 81559, numa_nodes: 1, nvlinks: 18 }
        .resolve(Path::new("."))
        .unwrap();
    Cluster::new((0..n).map(|i| board.node(&format!("gpu-{i}"), BTreeMap::new(), 0, 0)).collect())
}

fn service(n: usize) -> Extender {
    Harness::new(cluster(n))
        .options(ServiceOptions { nodes_to_score: NodesToScore { plain: 1, soft: 4 }, ..ServiceOptions::default() })
        .build()
}

#[test]
fn the_next_filter_does_not_name_gpus_an_unbound_pod_was_promised() {
    // binpacking names the fullest node that fits: three pods of 1 GPU filtered before any bind
    // would all be told the same 2-GPU node without the hold
    let ext = service(3);
    let pods: Vec<_> = (0..3).map(|i| pod(&format!("p{i}"), whole(1))).collect();
    let named: Vec<String> = pods.iter().map(|p| passed(&filter(&ext, p)).remove(0)).collect();
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &named {
        *per_node.entry(n.as_str()).or_default() += 1;
    }
    assert!(per_node.values().all(|&c| c <= 2), "more pods named on a node than it has GPUs: {named:?}");
    assert_eq!(ext.scheduler().offer_holds().len(), 3);
    // every bind lands, each ending its hold
    for (p, n) in pods.iter().zip(&named) {
        assert_eq!(bind(&ext, p, n), "", "{n}");
    }
    assert!(ext.scheduler().offer_holds().is_empty());
    let bound: usize = ext.cluster().nodes().iter().map(|n| n.pods().count()).sum();
    assert_eq!(bound, 3, "only the pods' own allocations remain");
}

#[test]
fn a_pod_filtered_again_is_not_turned_away_by_its_own_hold() {
    // one node, one GPU's worth of room after p0's hold: p0 retried must still fit there
    let ext = service(1);
    let p0 = pod("p0", whole(2));
    assert_eq!(passed(&filter(&ext, &p0)), ["gpu-0"]);
    let other = pod("other", whole(1));
    assert!(passed(&filter(&ext, &other)).is_empty(), "p0's 2 GPUs are held");
    assert_eq!(passed(&filter(&ext, &p0)), ["gpu-0"], "p0's own hold does not count against it");
    assert_eq!(bind(&ext, &p0, "gpu-0"), "");
}

#[test]
fn a_bind_elsewhere_or_a_failed_bind_gives_the_hold_back() {
    let ext = service(2);
    let p = pod("p", whole(2));
    let named = passed(&filter(&ext, &p)).remove(0);
    let other = if named == "gpu-0" { "gpu-1" } else { "gpu-0" };
    // kube-scheduler's bind goes to another node (a second profile, say): the hold ends and the pod
    // is placed where it was bound
    assert_eq!(bind(&ext, &p, other), "");
    assert!(ext.scheduler().offer_holds().is_empty());
    let q = pod("q", whole(2));
    assert_eq!(passed(&filter(&ext, &q)), std::slice::from_ref(&named), "the held node is free again");
    // a bind of an unknown pod still ends nothing it does not have, and a failing bind ends q's hold
    assert!(!bind(&ext, &q, "no-such-node").is_empty());
    assert!(ext.scheduler().offer_holds().is_empty());
    let r = pod("r", whole(2));
    assert_eq!(passed(&filter(&ext, &r)), [named]);
}

#[test]
fn several_nodes_named_hold_nothing() {
    // every node named (nodes-to-score 0): kube-scheduler picks, so no hold is made
    let ext = Harness::new(cluster(3)).build();
    let p = pod("p", whole(1));
    assert_eq!(passed(&filter(&ext, &p)).len(), 3);
    assert!(ext.scheduler().offer_holds().is_empty());
}

/// The GPUs (index, MiB, percent) of pod `key` in the cluster model, sorted.
fn gpus_of(ext: &Extender, key: &str) -> Vec<(u32, u64, u32)> {
    let cluster = ext.cluster();
    let a = cluster.assignment(key).unwrap_or_else(|| panic!("{key} not counted"));
    let mut gpus: Vec<_> =
        a.containers.iter().flat_map(|c| c.slices.iter().map(|g| (g.gpu, g.mem_mib, g.core_pct))).collect();
    gpus.sort();
    gpus
}

#[test]
fn a_bind_to_the_held_node_takes_the_held_gpus_over_and_a_node_changed_since_is_placed_again() {
    let ext = service(1);
    let slice =
        || serde_json::json!({ "gpuplace.io/gpu": "1", "gpuplace.io/gpu-mem": "20000", "gpuplace.io/gpu-core": "30" });
    // nothing else on the node since the hold: the bind counts exactly the held GPUs
    let p = pod("p", slice());
    assert_eq!(passed(&filter(&ext, &p)), ["gpu-0"]);
    let held = gpus_of(&ext, "ns/p#offer");
    assert_eq!(bind(&ext, &p, "gpu-0"), "");
    assert_eq!(gpus_of(&ext, "ns/p"), held);
    assert!(ext.cluster().assignment("ns/p#offer").is_none());

    // q's hold, then r filtered and bound on the node first: q's node changed, so q is placed again
    // against the node as it is now, never over it
    let q = pod("q", slice());
    assert_eq!(passed(&filter(&ext, &q)), ["gpu-0"]);
    let r = pod("r", whole(1));
    assert_eq!(passed(&filter(&ext, &r)), ["gpu-0"]);
    assert_eq!(bind(&ext, &r, "gpu-0"), "");
    assert_eq!(bind(&ext, &q, "gpu-0"), "");
    let (q_gpus, r_gpus) = (gpus_of(&ext, "ns/q"), gpus_of(&ext, "ns/r"));
    assert!(q_gpus.iter().all(|g| r_gpus.iter().all(|w| w.0 != g.0)), "a whole GPU shared: q {q_gpus:?}, r {r_gpus:?}");
    assert!(ext.scheduler().offer_holds().is_empty());
    let bound: usize = ext.cluster().nodes().iter().map(|n| n.pods().count()).sum();
    assert_eq!(bound, 3);
}
