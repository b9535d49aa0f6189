//! Tests of the cluster model (and fixtures other modules' tests build nodes with).

use super::*;
use crate::assignment::{ContainerAssignment, GpuSlice};

pub(crate) fn node(name: &str, gpus: usize) -> Node {
    let g = (0..gpus)
        .map(|i| Gpu {
            uuid: format!("GPU-{name}-{i}"),
            index: i as u32,
            model: "T".into(),
            memory_mib: 1000,
            numa_node: Some((i / 4) as u32),
            pci_bus_id: String::new(),
            healthy: true,
        })
        .collect();
    Node::new(name, BTreeMap::new(), g, Arc::new(GpuTopology::flat(gpus)), 0, 0)
}

fn share(pod: &str, gpu: u32, mem: u64, core: u32) -> PodAssignment {
    PodAssignment {
        pod: pod.into(),
        node: "n".into(),
        containers: vec![ContainerAssignment {
            name: "c".into(),
            init: false,
            slices: vec![GpuSlice { gpu, mem_mib: mem, core_pct: core, exclusive: false }],
        }],
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    }
}

#[test]
fn refuses_overcommit_and_leaves_state_alone() {
    let mut c = Cluster::new(vec![node("n", 2)]);
    let before = c.clone();
    c.allocate(share("a", 0, 600, 50)).unwrap();
    let mid = c.clone();
    assert!(matches!(c.allocate(share("b", 0, 500, 10)), Err(AllocError::MemoryOvercommit { .. })));
    assert!(matches!(c.allocate(share("b", 0, 100, 60)), Err(AllocError::CoreOvercommit { .. })));
    assert!(matches!(c.allocate(share("a", 1, 1, 1)), Err(AllocError::AlreadyAllocated { .. })));
    let mut whole = share("w", 0, 1000, 100);
    whole.containers[0].slices[0].exclusive = true;
    assert!(matches!(c.allocate(whole.clone()), Err(AllocError::GpuShared { .. })));
    assert_eq!(c, mid);
    c.release("a").unwrap();
    assert_eq!(c, before);
    c.allocate(whole).unwrap();
    assert!(matches!(c.allocate(share("b", 0, 1, 1)), Err(AllocError::GpuExclusive { .. })));
}

#[test]
fn facts_follow_edits_through_node_mut() {
    let mut c = Cluster::new(vec![node("n", 10), node("m", 2)]);
    let n = c.node_mut("n").unwrap();
    assert_eq!(n.usages().len(), 10);
    drop(n);
    if let Some(mut n) = c.node_mut("n") {
        n.gpus[9].memory_mib = 7;
        n.gpus[3].healthy = false;
        n.gpus[1].numa_node = None;
    }
    let f = c.node("n").unwrap().gpu_facts();
    assert_eq!((f.len(), f[9].memory_mib, f[3].healthy, f[1].numa_node), (10, 7, false, None));
    c.node_mut("m").unwrap().set_gpu_health(0, false);
    assert!(!c.node("m").unwrap().gpu_facts()[0].healthy);
}

#[test]
fn every_change_takes_a_new_stamp_never_reused() {
    let mut c = Cluster::new(vec![node("n", 2)]);
    let mut seen = std::collections::HashSet::new();
    let mut stamp = |c: &Cluster| {
        let g = c.node("n").unwrap().generation();
        assert!(seen.insert(g), "stamp {g} reused");
    };
    stamp(&c);
    c.allocate(share("a", 0, 100, 10)).unwrap();
    stamp(&c);
    c.release("a").unwrap();
    stamp(&c);
    drop(c.node_mut("n").unwrap()); // a borrow may have edited public fields
    stamp(&c);
    c.node_mut("n").unwrap().set_utilization(0, Some(UtilSample { sm_pct: 1, mem_used_mib: 1, at_unix_ms: 1 }));
    stamp(&c);
    // a copy edited elsewhere and brought back is a new state, even though it was a clone
    let mut copy = c.clone();
    copy.node_mut("n").unwrap().labels.insert("k".into(), "v".into());
    let edited = copy.node("n").unwrap().clone();
    c.upsert_node(edited);
    stamp(&c);
    assert_eq!(c.stamps(), [c.node("n").unwrap().generation()], "the array follows every change");
    c.rebuild(vec![share("r", 1, 1, 1)]);
    stamp(&c);
    assert_eq!(c.stamps(), [c.node("n").unwrap().generation()]);
    let before = c.node("n").unwrap().generation();
    assert!(c.allocate(share("b", 0, 5000, 10)).is_err());
    assert_eq!(c.node("n").unwrap().generation(), before, "a refused change is no change");
}

#[test]
fn init_containers_reuse_app_slices() {
    let mut c = Cluster::new(vec![node("n", 1)]);
    let mut a = share("a", 0, 300, 30);
    a.containers.push(ContainerAssignment {
        name: "init".into(),
        init: true,
        slices: vec![GpuSlice { gpu: 0, mem_mib: 500, core_pct: 20, exclusive: false }],
    });
    c.allocate(a).unwrap();
    let u = c.node("n").unwrap().usage(0);
    assert_eq!((u.mem_mib, u.core_pct, u.holders), (500, 30, 1));
}

#[test]
fn containers_count_against_the_device_plugins_slots() {
    let mut c = Cluster::new(vec![node("n", 2).with_slots_per_gpu(Some(3))]);
    // two app containers on GPU 0 hold two slots; the init container reuses one of theirs
    let mut a = share("a", 0, 100, 10);
    a.containers.push(ContainerAssignment {
        name: "side".into(),
        init: false,
        slices: vec![GpuSlice { gpu: 0, mem_mib: 100, core_pct: 10, exclusive: false }],
    });
    a.containers.push(ContainerAssignment {
        name: "init".into(),
        init: true,
        slices: vec![
            GpuSlice { gpu: 0, mem_mib: 100, core_pct: 10, exclusive: false },
            GpuSlice { gpu: 1, mem_mib: 100, core_pct: 10, exclusive: false },
        ],
    });
    c.allocate(a).unwrap();
    let n = c.node("n").unwrap();
    assert_eq!((n.usage(0).slots, n.usage(0).holders, n.free_slots(0)), (2, 1, 1));
    // an init container alone on a GPU still holds its slot for the pod's life
    assert_eq!((n.usage(1).slots, n.free_slots(1)), (1, 2));
    c.allocate(share("b", 0, 10, 1)).unwrap();
    let before = c.clone();
    // room in memory and compute, but no device left on GPU 0
    let err = c.allocate(share("x", 0, 10, 1)).unwrap_err();
    assert_eq!(err, AllocError::SlotsExhausted { pod: "x".into(), node: "n".into(), gpu: 0, need: 4, slots: 3 });
    assert!(err.to_string().contains("gives it 3 slots"), "{err}");
    assert_eq!(c, before);
    c.release("a").unwrap();
    let n = c.node("n").unwrap();
    assert_eq!((n.usage(0).slots, n.usage(1).slots, n.free_slots(0)), (1, 0, 2));
    // without a limit, slots are still counted but never refuse
    let mut free = Cluster::new(vec![node("n", 1)]);
    for i in 0..20 {
        free.allocate(share(&format!("p{i}"), 0, 10, 1)).unwrap();
    }
    assert_eq!((free.node("n").unwrap().usage(0).slots, free.node("n").unwrap().free_slots(0)), (20, u32::MAX));
}

#[test]
fn a_shrunk_inventory_keeps_counting_what_pods_still_hold() {
    let mut c = Cluster::new(vec![node("n", 2).with_slots_per_gpu(Some(3))]);
    for p in ["a", "b", "c"] {
        c.allocate(share(p, 0, 100, 10)).unwrap();
    }
    c.allocate(share("d", 1, 100, 10)).unwrap();
    // the device plugin restarts with K = 2: kubelet's running containers keep their devices
    let conflicts = c.upsert_node(node("n", 2).with_slots_per_gpu(Some(2)));
    assert_eq!(conflicts.len(), 1);
    assert!(conflicts[0].kept && matches!(conflicts[0].reason, AllocError::SlotsExhausted { .. }));
    let n = c.node("n").unwrap();
    assert_eq!((n.pods().count(), n.usage(0).slots, n.free_slots(0), n.usage(0).mem_mib), (4, 3, 0, 300));
    assert!(c.assignment(&conflicts[0].pod).is_some(), "still findable, so it can be released");
    assert!(matches!(c.allocate(share("x", 0, 1, 1)), Err(AllocError::SlotsExhausted { .. })));
    c.release("a").unwrap();
    assert_eq!(c.node("n").unwrap().free_slots(0), 0, "two of two slots still taken");
    c.release("b").unwrap();
    c.allocate(share("x", 0, 1, 1)).unwrap();
    // a GPU that is gone takes its records with it: they cannot be counted anywhere
    let conflicts = c.upsert_node(node("n", 1));
    assert_eq!(conflicts.len(), 1);
    assert_eq!((conflicts[0].pod.as_str(), conflicts[0].kept), ("d", false));
    assert!(matches!(conflicts[0].reason, AllocError::UnknownGpu { .. }));
    assert!(c.assignment("d").is_none());
    assert!(c.assignment("c").is_some() && c.assignment("x").is_some());
}

#[test]
fn rebuild_refuses_conflicting_records() {
    let mut c = Cluster::new(vec![node("n", 1)]);
    let conflicts = c.rebuild(vec![share("a", 0, 600, 10), share("b", 0, 600, 10), share("c", 3, 1, 1)]);
    assert_eq!(conflicts.len(), 2);
    assert_eq!(conflicts[0].pod, "b");
    assert!(c.assignment("a").is_some());
    assert!(c.assignment("b").is_none());
}

#[test]
fn remove_node_keeps_the_other_nodes_and_their_pods_findable() {
    let mut c = Cluster::new(vec![node("m", 1), node("n", 1), node("o", 1)]);
    c.allocate(share("a", 0, 100, 10)).unwrap();
    let mut on_o = share("b", 0, 100, 10);
    on_o.node = "o".into();
    c.allocate(on_o).unwrap();
    let layout = c.layout();
    let gone = c.remove_node("n").unwrap();
    assert_ne!(c.layout(), layout, "indices after n moved");
    let stamps: Vec<u64> = c.nodes().iter().map(|n| n.generation()).collect();
    assert_eq!(c.stamps(), stamps, "the stamp array follows the removal");
    assert_eq!(gone.pods().count(), 1);
    assert!(c.assignment("a").is_none() && c.node("n").is_none());
    assert_eq!(c.assignment("b").map(|a| a.node.as_str()), Some("o"));
    assert_eq!(c.node_index("o"), Some(1));
    assert!(c.remove_node("n").is_none());
    assert_eq!(c.name_rank(), [0, 1]);
}

#[test]
fn an_observed_allocation_counts_even_past_capacity_and_releases_exactly() {
    let mut c = Cluster::new(vec![node("n", 2)]);
    let empty = c.clone();
    c.allocate(share("a", 0, 600, 50)).unwrap();
    // another allocator put 500 MiB beside it: it holds them, so it counts, over capacity
    let over = c.count_observed(share("b", 0, 500, 10)).unwrap();
    assert!(matches!(over, Some(AllocError::MemoryOvercommit { need: 1100, .. })), "{over:?}");
    assert_eq!(c.node("n").unwrap().usage(0).mem_mib, 1100);
    assert_eq!(c.node("n").unwrap().free_mem(0), 0);
    assert_eq!(c.count_observed(share("c", 1, 10, 10)), Ok(None));
    // what allocate refuses for any other reason is refused here too
    assert!(matches!(c.count_observed(share("b", 1, 1, 1)), Err(AllocError::AlreadyAllocated { .. })));
    assert!(matches!(c.count_observed(share("d", 7, 1, 1)), Err(AllocError::UnknownGpu { .. })));
    for p in ["a", "b", "c"] {
        c.release(p).unwrap();
    }
    assert_eq!(c, empty);
}
