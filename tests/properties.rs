//! Property tests of the model and the engine: no over-commit under any sequence of allocations and
//! releases, exact restore on release, scores in range, determinism, and `numa: required` honoured.

use std::collections::BTreeMap;
use std::path::Path;

use gpuplace::placement::engine::Engine;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::inventory::Board;
use gpuplace_core::resources::{GpuDemand, MemoryDemand, NumaPolicy, PodRequest};
use proptest::prelude::*;

fn nodes() -> Vec<Node> {
    let boards = [
        Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81559, numa_nodes: 2, nvlinks: 18 },
        Board::Pcie { model: "L40S".into(), memory_mib: 46068, sockets: 2, switches_per_socket: 2, gpus_per_switch: 2 },
        Board::Flat { gpus: 2, model: "T4".into(), memory_mib: 15109 },
    ];
    boards
        .iter()
        .enumerate()
        .map(|(i, b)| b.resolve(Path::new(".")).unwrap().node(&format!("n{i}"), BTreeMap::new(), 0, 0))
        // the T4 node's device plugin gives each GPU 2 slots: a third container must go elsewhere
        .map(|n| if n.gpus.len() == 2 { n.with_slots_per_gpu(Some(2)) } else { n })
        .collect()
}

fn demand() -> impl Strategy<Value = GpuDemand> {
    prop_oneof![
        (1u32..=4).prop_map(|gpus| GpuDemand::Whole { gpus }),
        (1u32..=3, 0u64..=40000, 0u32..=100).prop_map(|(gpus, mem, core)| GpuDemand::Shared {
            gpus,
            memory: if mem == 0 { MemoryDemand::ProportionalToCore } else { MemoryDemand::Mib(mem) },
            core_pct: if mem == 0 { core.max(1) } else { core },
        }),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Place(GpuDemand, NumaPolicy),
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (demand(), prop_oneof![Just(NumaPolicy::Required), Just(NumaPolicy::Preferred), Just(NumaPolicy::None)])
            .prop_map(|(d, n)| Op::Place(d, n)),
        1 => (0usize..64).prop_map(Op::Release),
    ]
}

fn assert_within_capacity(c: &Cluster) {
    for n in c.nodes() {
        for (g, gpu) in n.gpus.iter().enumerate() {
            let u = n.usage(g);
            assert!(u.mem_mib <= gpu.memory_mib, "{} GPU {g}: {} MiB > {}", n.name, u.mem_mib, gpu.memory_mib);
            assert!(u.core_pct <= 100, "{} GPU {g}: {}%", n.name, u.core_pct);
            if u.exclusive {
                assert_eq!(u.holders, 1, "{} GPU {g}: exclusive GPU shared", n.name);
            }
            // every pod on the GPU holds at least one slot; the node's K bounds them all
            assert!(u.slots >= u.holders, "{} GPU {g}: {} slots for {} pods", n.name, u.slots, u.holders);
            if let Some(k) = n.slots_per_gpu {
                assert!(u.slots <= k, "{} GPU {g}: {} containers on {k} slots", n.name, u.slots);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn never_overcommits_and_release_restores(ops in proptest::collection::vec(op(), 1..40)) {
        let engine = Engine::default();
        let mut c = Cluster::new(nodes());
        let mut placed: Vec<(String, Cluster)> = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Place(d, numa) => {
                    let mut req = PodRequest::single(format!("ns/p{i}"), d);
                    req.numa = numa;
                    let before = c.clone();
                    let ev = engine.evaluate_all(&c, &req, 0);
                    for cand in &ev.ranked {
                        prop_assert!((0..=10).contains(&cand.score));
                        prop_assert!((0.0..=1.0).contains(&cand.total));
                        if numa == NumaPolicy::Required {
                            let node = &c.nodes()[cand.node];
                            let numas: std::collections::BTreeSet<_> =
                                cand.gpus().iter().map(|&g| node.gpus[g as usize].numa_node).collect();
                            prop_assert!(numas.len() <= 1, "numa required violated: {:?}", cand.gpus());
                        }
                    }
                    if let Ok(a) = engine.schedule(&mut c, &req, 0) {
                        prop_assert_eq!(a.pod.clone(), format!("ns/p{i}"));
                        placed.push((a.pod, before));
                    }
                }
                Op::Release(k) => {
                    // releasing the most recent allocation restores the state before it exactly
                    if k % 2 == 0 {
                        if let Some((pod, before)) = placed.pop() {
                            c.release(&pod).unwrap();
                            prop_assert!(c == before, "release of {} did not restore the prior state", pod);
                        }
                    } else if !placed.is_empty() {
                        let (pod, _) = placed.remove(k % placed.len());
                        c.release(&pod).unwrap();
                        // the other snapshots no longer describe what came before each pod
                        placed.clear();
                    }
                }
            }
            assert_within_capacity(&c);
        }
    }

    #[test]
    fn same_input_same_answer(ds in proptest::collection::vec(demand(), 1..12)) {
        let engine = Engine::default();
        let mut a = Cluster::new(nodes());
        let mut b = Cluster::new(nodes());
        for (i, d) in ds.into_iter().enumerate() {
            let req = PodRequest::single(format!("ns/p{i}"), d);
            let ea = engine.evaluate_all(&a, &req, 0);
            let eb = engine.evaluate_all(&b, &req, 0);
            prop_assert_eq!(&ea, &eb);
            prop_assert_eq!(engine.schedule(&mut a, &req, 0).ok(), engine.schedule(&mut b, &req, 0).ok());
        }
        prop_assert!(a == b);
    }
}
