//! Nodes and clusters the crate's unit tests build on (compiled for tests only).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use gpuplace_core::cluster::{Cluster, Gpu, Node};
use gpuplace_core::inventory::Board;
use gpuplace_core::topology::GpuTopology;

/// A node of `gpus` 1000 MiB GPUs of model `T`, four per NUMA node, on a flat board (the fixture
/// `gpuplace_core`'s cluster tests build with, which another crate's tests cannot reach).
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

/// 8-GPU L40S PCIe boards: GPUs 0-3 on socket 0 and 4-7 on socket 1, two GPUs per PCIe switch.
/// Node `n<i>` has the GPUs `held[i]` taken whole.
pub(crate) fn pcie_cluster(held: &[&[u32]]) -> Cluster {
    let board =
        Board::Pcie { model: "L40S".into(), memory_mib: 46068, sockets: 2, switches_per_socket: 2, gpus_per_switch: 2 }
            .resolve(Path::new("."))
            .expect("a valid board");
    let mut c = Cluster::new((0..held.len()).map(|i| board.node(&format!("n{i}"), BTreeMap::new(), 0, 0)).collect());
    for (i, gpus) in held.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
        let slices = gpus.iter().map(|&gpu| GpuSlice { gpu, mem_mib: 46068, core_pct: 100, exclusive: true });
        let containers = vec![ContainerAssignment { name: "c".into(), init: false, slices: slices.collect() }];
        let (pod, node) = (format!("ns/busy-{i}"), format!("n{i}"));
        c.allocate(PodAssignment { pod, node, containers, cpu_milli: 0, memory_mib: 0, group: None })
            .expect("the held GPUs fit");
    }
    c
}
