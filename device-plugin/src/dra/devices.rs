//! This node's GPUs as DRA devices: the `spec` of its ResourceSlice (pure).
//!
//! One device per healthy GPU, named `gpu-<index>`, with `allowMultipleAllocations` so that claims
//! can share it through consumable capacity (KEP-5075, beta and on by default in v1.36):
//!
//! | capacity | value | a request that does not name it takes | a request may ask |
//! |---|---|---|---|
//! | `memory` | the GPU's memory, `<MiB>Mi` | all of it | 1Mi and up, in whole MiB |
//! | `cores` | `100` (percent of the GPU's compute) | all of it | 0-100 |
//! | `shares` | K, the containers one GPU may serve (`--slots-per-gpu`) | 1 | 1 |
//!
//! So a claim that asks for a device and no capacity gets the whole GPU, as a `gpuplace.io/gpu`
//! request without `gpu-mem` or `gpu-core` does, and at most K claims share one GPU, as at most K
//! containers share it under the device plugin. A share names its `memory` (and its `cores`; left out,
//! it takes all the compute: DRA has one default per capacity, so gpuplace's "memory alone reserves
//! no compute" cannot be the default; `cores: 0` says it).
//!
//! Attributes (in the driver's domain, so `gpu.gpuplace.io/model` in CEL): `index`, `uuid`, `model`,
//! `pciBusId`, `numaNode` (when known), `nvlinkDomain` (GPUs joined by NVLink, directly or through
//! NVSwitch, share it: a multi-GPU claim's `matchAttribute`), `pcieRoot` (GPUs under one PCIe host
//! bridge share it), and the node's place in the network from its labels (`spine`, `tor`: the last
//! part of each of gpuplace's network level labels). Group values are the lowest GPU index of the
//! group, so they compare within a node only, as one claim's devices always are. For gpuplace's own
//! placement of claims, the whole link graph: `nvlinkFabric` and each GPU's row of it, `links`
//! (`gpuplace_core::dra::link_row`; boards of up to 32 GPUs).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, DeviceTaint,
    ResourcePool, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::nvml::Inventory;
use crate::plugin::GpuHealth;

use gpuplace_core::cluster::Gpu;
use gpuplace_core::dra::attributes::NodeAttributes;
pub use gpuplace_core::dra::{
    device_index, device_name, network_attribute, ATTR_INDEX, ATTR_ISOLATION, ATTR_LINKS, ATTR_MODEL, ATTR_NUMA_NODE,
    ATTR_NVLINK_DOMAIN, ATTR_NVLINK_FABRIC, ATTR_PCIE_ROOT, ATTR_PCI_BUS_ID, ATTR_UUID, CAPACITY_CORES,
    CAPACITY_MEMORY, CAPACITY_SHARES, DEFAULT_DRIVER,
};
use gpuplace_core::isolation::IsolationMode;
use gpuplace_core::topology::{GpuTopology, NvlinkFabric, PcieLevel};

fn capacity(value: String, policy: CapacityRequestPolicy) -> DeviceCapacity {
    DeviceCapacity { value: Quantity(value), request_policy: Some(policy) }
}

/// The devices: one per healthy GPU (`health` by GPU index; a GPU without an entry counts as
/// healthy), in index order. `node_labels` gives the network attributes.
pub fn devices(
    inventory: &Inventory,
    health: &[GpuHealth],
    node_labels: &BTreeMap<String, String>,
    slots_per_gpu: u32,
) -> Vec<Device> {
    // an inventory whose links do not make a graph is published as GPUs without links
    let topology = inventory
        .topology()
        .or_else(|_| GpuTopology::new(inventory.gpus.len(), NvlinkFabric::None, [], PcieLevel::Sys))
        .unwrap_or_else(|_| GpuTopology::flat(inventory.gpus.len()));
    let attributes = NodeAttributes::new(&topology, node_labels);
    inventory
        .gpus
        .iter()
        .filter(|g| health.get(g.index as usize).is_none_or(|h| h.healthy))
        .map(|g| {
            let gpu = Gpu {
                uuid: g.uuid.clone(),
                index: g.index,
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
                healthy: true,
            };
            let attributes = attributes.of(&gpu, &topology);
            let mib = format!("{}Mi", g.memory_mib);
            let capacity = BTreeMap::from([
                (
                    CAPACITY_MEMORY.to_string(),
                    capacity(
                        mib.clone(),
                        CapacityRequestPolicy {
                            default: Some(Quantity(mib)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: Quantity("1Mi".into()),
                                max: None,
                                step: Some(Quantity("1Mi".into())),
                            }),
                            valid_values: None,
                        },
                    ),
                ),
                (
                    CAPACITY_CORES.to_string(),
                    capacity(
                        "100".into(),
                        CapacityRequestPolicy {
                            default: Some(Quantity("100".into())),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: Quantity("0".into()),
                                max: Some(Quantity("100".into())),
                                step: Some(Quantity("1".into())),
                            }),
                            valid_values: None,
                        },
                    ),
                ),
                (
                    CAPACITY_SHARES.to_string(),
                    capacity(
                        slots_per_gpu.to_string(),
                        CapacityRequestPolicy {
                            default: Some(Quantity("1".into())),
                            valid_range: None,
                            valid_values: Some(vec![Quantity("1".into())]),
                        },
                    ),
                ),
            ]);
            Device {
                name: device_name(g.index),
                allow_multiple_allocations: Some(true),
                attributes: Some(attributes),
                capacity: Some(capacity),
                ..Default::default()
            }
        })
        .collect()
}

/// The taint on every device when gpuplace allocates the driver's claims (`--dra-allocator
/// gpuplace`): kube-scheduler's allocator then never picks a device for a claim that does not
/// tolerate it, so a pod that got past gpuplace's scheduling gate stays pending instead of being
/// allocated beside gpuplace's claims (nothing checks capacity across claims); a claim that tolerates
/// it is refused at admission (scheduler-config/dra/gpuplace-allocates.yaml). gpuplace writes its
/// allocations itself, and a taint with `NoSchedule` affects allocation only.
pub const ALLOCATOR_TAINT_KEY: &str = "gpu.gpuplace.io/allocator";
pub const ALLOCATOR_TAINT_VALUE: &str = "gpuplace";

/// Gives every device the node's isolation mode as its `isolation` attribute (gpuplace's DRA front
/// end refuses nodes whose mode a pod's `gpuplace.io/isolation` does not accept; a CEL selector may
/// read it too: `device.attributes["gpu.gpuplace.io"].isolation == "mps"`).
pub fn mark_isolation(devices: &mut [Device], mode: IsolationMode) {
    for d in devices {
        let value = DeviceAttribute { string: Some(mode.name().into()), ..Default::default() };
        d.attributes.get_or_insert_with(BTreeMap::new).insert(ATTR_ISOLATION.into(), value);
    }
}

/// Taints every device for gpuplace's allocator (see [`ALLOCATOR_TAINT_KEY`]).
pub fn taint_for_gpuplace(devices: &mut [Device]) {
    for d in devices {
        d.taints = Some(vec![DeviceTaint {
            key: ALLOCATOR_TAINT_KEY.into(),
            value: Some(ALLOCATOR_TAINT_VALUE.into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
    }
}

/// Whether two device lists say the same, quantities compared by value: the API server stores them
/// canonicalized (`81920Mi` comes back as `80Gi`), so comparing text would rewrite the slice, and bump
/// its pool's generation, at every pass.
pub fn same_devices(a: &[Device], b: &[Device]) -> bool {
    fn by_value(q: &mut Quantity) {
        if let Ok(v) = gpuplace_core::quantity::parse(&q.0) {
            q.0 = v.milli().to_string();
        }
    }
    fn normalized(d: &Device) -> Device {
        let mut d = d.clone();
        // the API server stamps a taint's time when it is written
        for t in d.taints.iter_mut().flatten() {
            t.time_added = None;
        }
        for c in d.capacity.iter_mut().flat_map(|m| m.values_mut()) {
            by_value(&mut c.value);
            if let Some(p) = c.request_policy.as_mut() {
                p.default.iter_mut().for_each(by_value);
                p.valid_values.iter_mut().flatten().for_each(by_value);
                if let Some(r) = p.valid_range.as_mut() {
                    by_value(&mut r.min);
                    r.max.iter_mut().for_each(by_value);
                    r.step.iter_mut().for_each(by_value);
                }
            }
        }
        d
    }
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| normalized(x) == normalized(y))
}

/// The whole spec of this node's one slice: its pool is named after the node and holds this one
/// slice at `generation`.
pub fn slice_spec(driver: &str, node: &str, devices: Vec<Device>, generation: i64) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: driver.to_string(),
        node_name: Some(node.to_string()),
        pool: ResourcePool { name: node.to_string(), generation, resource_slice_count: 1 },
        devices: Some(devices),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::fake::FakeBackend;
    use crate::nvml::GpuBackend;

    fn board(name: &str) -> Inventory {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../shared/topologies/{name}.json"));
        FakeBackend::load(&path, "n1").unwrap().inventory().unwrap()
    }

    fn healthy(n: usize) -> Vec<GpuHealth> {
        vec![GpuHealth { healthy: true, reason: String::new(), xid_count: 0, last_xid: None }; n]
    }

    fn attr<'a>(d: &'a Device, name: &str) -> &'a k8s_openapi::api::resource::v1::DeviceAttribute {
        &d.attributes.as_ref().unwrap()[name]
    }

    fn cap<'a>(d: &'a Device, name: &str) -> &'a DeviceCapacity {
        &d.capacity.as_ref().unwrap()[name]
    }

    /// What gpuplace's own placement reads back from the published slice is the board's link graph,
    /// pair by pair, on every real board (and with a GPU gone from the slice).
    #[test]
    fn the_slice_carries_each_boards_whole_link_graph() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies");
        let mut boards = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let name = path.file_stem().unwrap().to_str().unwrap().to_string();
            let inv = board(&name);
            let want = inv.topology().unwrap();
            let mut health = healthy(inv.gpus.len());
            for gone in [None, Some(1)] {
                if let Some(g) = gone.filter(|&g| g < health.len()) {
                    health[g].healthy = false;
                }
                let spec = slice_spec(DEFAULT_DRIVER, "n1", devices(&inv, &health, &BTreeMap::new(), 4), 1);
                let read = gpuplace_core::dra::slices::slice_gpus(&[&spec], None).unwrap().unwrap();
                assert_eq!(read.gpus.len(), inv.gpus.len(), "{name}");
                assert_eq!(read.topology.fabric(), want.fabric(), "{name}");
                assert_eq!(read.slots_per_gpu, Some(4));
                for (a, b, link) in want.links() {
                    assert_eq!(read.topology.link(a, b), Some(link), "{name}: {a}-{b}");
                }
                for g in &inv.gpus {
                    let got = &read.gpus[g.index as usize];
                    assert_eq!(got.healthy, gone != Some(g.index as usize), "{name}");
                    if got.healthy {
                        assert_eq!((got.uuid.as_str(), got.memory_mib), (g.uuid.as_str(), g.memory_mib), "{name}");
                    }
                }
            }
            boards += 1;
        }
        assert!(boards >= 5, "only {boards} boards in {}", dir.display());
    }

    #[test]
    fn one_device_per_healthy_gpu_with_capacity_that_a_whole_request_takes_whole() {
        let inv = board("hgx-h100-8");
        let labels = gpuplace_core::cluster::network_labels("spine-1", "tor-3");
        let mut health = healthy(8);
        let devs = devices(&inv, &health, &labels, 10);
        assert_eq!(devs.len(), 8);
        let d = &devs[5];
        assert_eq!(d.name, "gpu-5");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        assert_eq!(attr(d, ATTR_UUID).string.as_deref(), Some(inv.gpus[5].uuid.as_str()));
        assert_eq!(attr(d, ATTR_INDEX).int, Some(5));
        assert_eq!(attr(d, "tor").string.as_deref(), Some("tor-3"));
        assert_eq!(attr(d, "spine").string.as_deref(), Some("spine-1"));
        let mem = cap(d, CAPACITY_MEMORY);
        let mib = format!("{}Mi", inv.gpus[5].memory_mib);
        assert_eq!(mem.value.0, mib);
        // a request that names no memory takes the whole GPU's
        assert_eq!(mem.request_policy.as_ref().unwrap().default.as_ref().unwrap().0, mib);
        let cores = cap(d, CAPACITY_CORES);
        assert_eq!(
            (cores.value.0.as_str(), cores.request_policy.as_ref().unwrap().default.as_ref().unwrap().0.as_str()),
            ("100", "100")
        );
        let shares = cap(d, CAPACITY_SHARES);
        assert_eq!(shares.value.0, "10");
        assert_eq!(shares.request_policy.as_ref().unwrap().valid_values.as_ref().unwrap()[0].0, "1");

        // an unhealthy GPU leaves the slice; the others keep their names
        health[3].healthy = false;
        let devs = devices(&inv, &health, &labels, 10);
        assert_eq!(
            devs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
            ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
        );
        // without network labels, no network attributes
        let bare = devices(&inv, &[], &BTreeMap::new(), 4);
        assert!(!bare[0].attributes.as_ref().unwrap().contains_key("tor"));
        assert_eq!(cap(&bare[0], CAPACITY_SHARES).value.0, "4");
    }

    #[test]
    fn nvlink_domains_and_pcie_roots_follow_the_links() {
        let nvlink_domains = |inv: &Inventory| gpuplace_core::dra::attributes::nvlink_domains(&inv.topology().unwrap());
        let pcie_roots = |inv: &Inventory| gpuplace_core::dra::attributes::pcie_roots(&inv.topology().unwrap());
        // NVSwitch: every GPU reaches every other over NVLink
        let h100 = board("hgx-h100-8");
        assert_eq!(nvlink_domains(&h100), vec![0; 8]);
        // each GPU's group is the lowest index of GPUs under its host bridge
        let roots = pcie_roots(&h100);
        for (i, r) in roots.iter().enumerate() {
            assert!(*r as usize <= i);
            for (j, s) in roots.iter().enumerate() {
                let same = h100.link(i as u32, j as u32).is_some_and(|l| l.pcie <= PcieLevel::Phb);
                assert!(!same || r == s, "GPUs {i} and {j} share a host bridge but not a root");
            }
        }
        // no links at all: every GPU is its own domain and root
        let mut lone = h100.clone();
        lone.links.clear();
        assert_eq!(nvlink_domains(&lone), (0..8).collect::<Vec<u32>>());
        assert_eq!(pcie_roots(&lone), (0..8).collect::<Vec<u32>>());
        // two NVLink islands
        let mut islands = lone.clone();
        for (a, b) in [(0, 1), (1, 2), (4, 5), (6, 7), (5, 7)] {
            islands.links.push(crate::nvml::PairLink { a, b, nvlinks: 2, pcie: PcieLevel::Sys });
        }
        assert_eq!(nvlink_domains(&islands), vec![0, 0, 0, 3, 4, 4, 4, 4]);
    }

    #[test]
    fn devices_compare_by_quantity_value() {
        let inv = board("hgx-h100-8");
        let a = devices(&inv, &[], &BTreeMap::new(), 10);
        let mut b = a.clone();
        // what the API server returns for an 80 GiB GPU written as 81920Mi
        for d in &mut b {
            let mem = d.capacity.as_mut().unwrap().get_mut(CAPACITY_MEMORY).unwrap();
            mem.value = Quantity(format!("{}Ki", inv.gpus[0].memory_mib * 1024));
        }
        assert!(same_devices(&a, &a.clone()));
        assert!(same_devices(&a, &b) == (inv.gpus.iter().all(|g| g.memory_mib == inv.gpus[0].memory_mib)));
        assert!(!same_devices(&a, &a[1..]));
        let mut c = a.clone();
        c[2].attributes.as_mut().unwrap().insert(
            ATTR_MODEL.into(),
            k8s_openapi::api::resource::v1::DeviceAttribute { string: Some("other".into()), ..Default::default() },
        );
        assert!(!same_devices(&a, &c));
    }

    #[test]
    fn gpuplaces_taint_is_on_every_device_and_its_server_stamp_is_not_a_change() {
        let inv = board("hgx-h100-8");
        let mut mine = devices(&inv, &[], &BTreeMap::new(), 4);
        let plain = mine.clone();
        taint_for_gpuplace(&mut mine);
        assert!(mine.iter().all(|d| d
            .taints
            .as_ref()
            .is_some_and(|t| t.len() == 1 && t[0].key == ALLOCATOR_TAINT_KEY && t[0].effect == "NoSchedule")));
        assert!(!same_devices(&mine, &plain));
        // the API server adds timeAdded: still the same devices
        let mut stored = mine.clone();
        for d in &mut stored {
            d.taints.as_mut().unwrap()[0].time_added =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        assert!(same_devices(&mine, &stored));
    }

    #[test]
    fn the_spec_names_one_pool_per_node() {
        let inv = board("hgx-h100-8");
        let spec = slice_spec(DEFAULT_DRIVER, "n1", devices(&inv, &[], &BTreeMap::new(), 10), 7);
        assert_eq!((spec.pool.name.as_str(), spec.pool.generation, spec.pool.resource_slice_count), ("n1", 7, 1));
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert_eq!(spec.devices.as_ref().unwrap().len(), 8);
    }

    #[test]
    fn the_isolation_mode_is_every_devices_attribute_and_reads_back_as_the_nodes() {
        let inv = board("hgx-h100-8");
        let mut devs = devices(&inv, &[], &BTreeMap::new(), 10);
        mark_isolation(&mut devs, IsolationMode::Mps);
        assert!(devs.iter().all(|d| d.attributes.as_ref().unwrap()[ATTR_ISOLATION].string.as_deref() == Some("mps")));
        let spec = slice_spec(DEFAULT_DRIVER, "n1", devs, 1);
        let read = gpuplace_core::dra::slices::slice_gpus(&[&spec], None).unwrap().unwrap();
        assert_eq!(read.isolation, Some(IsolationMode::Mps));
    }
}
