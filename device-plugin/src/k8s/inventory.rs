//! What this node publishes about its GPUs, from discovery and current health (pure).
//!
//! - the `gpuplace.io/inventory` annotation (the core crate's [`NodeInventory`], with K, the slots
//!   per GPU, so the extender can keep at most K containers on one GPU);
//! - `gpuplace.io/gpu-mem` (MiB) and `gpuplace.io/gpu-core` (100 per GPU) capacity, over the healthy
//!   GPUs only: an unhealthy GPU takes no pods, so it is not capacity;
//! - the cluster model's view of the node, against which pod assignments are validated.

use std::collections::BTreeMap;

use gpuplace_core::annotations::{AnnotationError, InventoryGpu, InventoryLink, NodeInventory, INVENTORY_VERSION};
use gpuplace_core::cluster::Node;
use gpuplace_core::isolation::IsolationMode;

use crate::nvml::Inventory;
use crate::plugin::GpuHealth;

/// `gpuplace.io/gpu-mem` and `gpuplace.io/gpu-core` for the node's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCapacity {
    /// Sum of the healthy GPUs' memory, MiB.
    pub gpu_mem_mib: u64,
    /// 100 per healthy GPU.
    pub gpu_core: u64,
}

/// The inventory annotation. `health` is by GPU index; a GPU without an entry counts as healthy.
/// `confirms_allocations`: the plugin applies assignments in a kubelet's Allocate calls and marks
/// each on the pod (see [`NodeInventory::confirms_allocations`]). `isolation`: the mode chosen at
/// start (`None` publishes none: read as advisory).
pub fn node_inventory(
    inventory: &Inventory,
    health: &[GpuHealth],
    slots_per_gpu: u32,
    confirms_allocations: bool,
    isolation: Option<IsolationMode>,
) -> NodeInventory {
    NodeInventory {
        version: INVENTORY_VERSION,
        fabric: inventory.nvlink_fabric,
        gpus: inventory
            .gpus
            .iter()
            .map(|g| InventoryGpu {
                uuid: g.uuid.clone(),
                index: g.index,
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
                healthy: health.get(g.index as usize).is_none_or(|h| h.healthy),
            })
            .collect(),
        links: inventory
            .links
            .iter()
            .map(|l| InventoryLink { a: l.a, b: l.b, nvlinks: l.nvlinks, pcie: l.pcie })
            .collect(),
        slots_per_gpu: Some(slots_per_gpu),
        confirms_allocations,
        isolation,
    }
}

/// Capacity over the healthy GPUs.
pub fn capacity(inventory: &Inventory, health: &[GpuHealth]) -> NodeCapacity {
    let healthy = inventory.gpus.iter().filter(|g| health.get(g.index as usize).is_none_or(|h| h.healthy));
    let (mem, n) = healthy.fold((0u64, 0u64), |(m, n), g| (m.saturating_add(g.memory_mib), n + 1));
    NodeCapacity { gpu_mem_mib: mem, gpu_core: n * 100 }
}

/// The cluster model's node named `name`, as the extender sees it from the inventory annotation
/// this plugin publishes (all GPUs healthy, `slots_per_gpu` = K): what pod assignments are checked
/// against.
pub fn cluster_node(inventory: &Inventory, name: &str, slots_per_gpu: u32) -> Result<Node, AnnotationError> {
    node_inventory(inventory, &[], slots_per_gpu, false, None).to_node(name, BTreeMap::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::fake::FakeBackend;
    use crate::nvml::GpuBackend;

    fn h100() -> Inventory {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/hgx-h100-8.json");
        FakeBackend::load(&path, "n1").unwrap().inventory().unwrap()
    }

    fn healthy(n: usize) -> Vec<GpuHealth> {
        vec![GpuHealth { healthy: true, reason: String::new(), xid_count: 0, last_xid: None }; n]
    }

    #[test]
    fn inventory_capacity_and_model_follow_health() {
        let inv = h100();
        let mut health = healthy(8);
        let ann = node_inventory(&inv, &health, 10, false, None);
        assert_eq!(ann.slots_per_gpu, Some(10));
        assert!(!ann.confirms_allocations && node_inventory(&inv, &health, 10, true, None).confirms_allocations);
        assert_eq!(ann.gpus.len(), 8);
        assert_eq!(ann.links.len(), inv.links.len());
        let per_gpu = inv.gpus[0].memory_mib;
        assert_eq!(capacity(&inv, &health), NodeCapacity { gpu_mem_mib: 8 * per_gpu, gpu_core: 800 });

        health[3].healthy = false;
        let ann = node_inventory(&inv, &health, 10, false, None);
        assert!(!ann.gpus[3].healthy && ann.gpus[2].healthy);
        assert_eq!(capacity(&inv, &health), NodeCapacity { gpu_mem_mib: 7 * per_gpu, gpu_core: 700 });
        // the annotation reads back as the same node the extender will build
        let node = cluster_node(&inv, "n1", 10).unwrap();
        assert_eq!((node.gpus.len(), node.slots_per_gpu), (8, Some(10)));
        assert_eq!(node.gpus[5].uuid, inv.gpus[5].uuid);
        assert!(NodeInventory::parse(&ann.to_json()).unwrap().to_node("n1", BTreeMap::new()).is_ok());
        // the mode chosen at start is published, and reaches the extender's model
        let ann = node_inventory(&inv, &health, 10, false, Some(IsolationMode::Guard));
        let text = ann.to_json();
        assert!(text.contains(r#""isolation":"guard""#), "{text}");
        let node = NodeInventory::parse(&text).unwrap().to_node("n1", BTreeMap::new()).unwrap();
        assert_eq!(node.isolation, Some(IsolationMode::Guard));
    }
}
