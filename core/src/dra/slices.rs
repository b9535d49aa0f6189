//! A node's ResourceSlices of gpuplace's driver as the model's GPUs, link graph and share limit.
//!
//! The device plugin publishes one slice per node (pool named after the node); this reads any number,
//! as the allocator does: only slices of the pool's highest generation count, the others are being
//! replaced. A GPU that left the slice (unhealthy) stays in the model, marked unhealthy, so that the
//! claims still holding it keep counting: its description is the last one seen, or, after a restart,
//! a copy of the node's largest GPU.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSliceSpec};

use super::{
    device_index, fabric_of, topology_from_domains, topology_from_rows, LinkRowError, ATTR_INDEX, ATTR_ISOLATION,
    ATTR_LINKS, ATTR_MODEL, ATTR_NUMA_NODE, ATTR_NVLINK_DOMAIN, ATTR_NVLINK_FABRIC, ATTR_PCIE_ROOT, ATTR_PCI_BUS_ID,
    ATTR_UUID, CAPACITY_MEMORY, CAPACITY_SHARES,
};
use crate::cluster::Gpu;
use crate::isolation::IsolationMode;
use crate::resources::MAX_GPUS_PER_CONTAINER;
use crate::topology::{GpuTopology, TopologyError};

/// What the model takes from a node's slices.
#[derive(Debug, Clone)]
pub struct SliceGpus {
    /// Every GPU by index, those not in the slice marked unhealthy.
    pub gpus: Vec<Gpu>,
    pub topology: GpuTopology,
    /// The fewest `shares` any device offers: at most this many claims share one GPU.
    pub slots_per_gpu: Option<u32>,
    /// The pool generation read.
    pub generation: i64,
    /// The weakest isolation mode the devices carry; `None` when one carries none (older plugins).
    pub isolation: Option<IsolationMode>,
}

/// Why a node's slices were not read. The node is then left out of DRA placement (its slices are
/// the device plugin's, so this is a version mismatch or a hand-written slice).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    #[error("device {device:?} has no {ATTR_INDEX} attribute and its name is not gpu-<index>")]
    NoIndex { device: String },
    #[error("devices {first:?} and {second:?} are both GPU {index}")]
    DuplicateIndex { first: String, second: String, index: u32 },
    #[error("device {device:?}: GPU index {index} is beyond the {max} a node may have")]
    IndexTooLarge { device: String, index: i64, max: u32 },
    #[error("device {device:?}: capacity {capacity:?} {value:?} is not a quantity gpuplace reads ({why})")]
    BadCapacity { device: String, capacity: &'static str, value: String, why: String },
    #[error(transparent)]
    Links(#[from] LinkRowError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

fn attr<'a>(d: &'a Device, name: &str) -> Option<&'a k8s_openapi::api::resource::v1::DeviceAttribute> {
    d.attributes.as_ref()?.get(name)
}

fn string_attr<'a>(d: &'a Device, name: &str) -> Option<&'a str> {
    attr(d, name)?.string.as_deref()
}

fn int_attr(d: &Device, name: &str) -> Option<i64> {
    attr(d, name)?.int
}

/// A capacity's value in whole units of `unit` (rounded down: a device offers no fraction it lacks).
fn capacity(d: &Device, name: &'static str, unit: i128) -> Result<Option<u64>, SliceError> {
    let Some(c) = d.capacity.as_ref().and_then(|c| c.get(name)) else { return Ok(None) };
    let bad =
        |why: String| SliceError::BadCapacity { device: d.name.clone(), capacity: name, value: c.value.0.clone(), why };
    let q = crate::quantity::parse(&c.value.0).map_err(|e| bad(e.to_string()))?;
    if q.is_negative() {
        return Err(bad("negative".into()));
    }
    let units = q.milli() / 1000 / unit;
    u64::try_from(units).map(Some).map_err(|_| bad("too large".into()))
}

const MIB: i128 = 1024 * 1024;

/// One device as a GPU, with its index.
fn gpu_of(d: &Device) -> Result<(u32, Gpu), SliceError> {
    let index = match int_attr(d, ATTR_INDEX) {
        Some(i) => i,
        None => device_index(&d.name).map(i64::from).ok_or_else(|| SliceError::NoIndex { device: d.name.clone() })?,
    };
    let max = 2 * MAX_GPUS_PER_CONTAINER;
    let index = u32::try_from(index).ok().filter(|&i| i < max).ok_or_else(|| SliceError::IndexTooLarge {
        device: d.name.clone(),
        index,
        max,
    })?;
    let memory_mib = capacity(d, CAPACITY_MEMORY, MIB)?.unwrap_or(0);
    let gpu = Gpu {
        uuid: string_attr(d, ATTR_UUID).unwrap_or_default().to_string(),
        index,
        model: string_attr(d, ATTR_MODEL).unwrap_or_default().to_string(),
        memory_mib,
        numa_node: int_attr(d, ATTR_NUMA_NODE).and_then(|n| u32::try_from(n).ok()),
        pci_bus_id: string_attr(d, ATTR_PCI_BUS_ID).unwrap_or_default().to_string(),
        healthy: true,
    };
    Ok((index, gpu))
}

/// The node's GPUs from `slices` (the node's slices of the driver; others must be filtered out by the
/// caller). `previous` is what was read last time, for GPUs that have since left the slice. `None`
/// when the slices hold no device.
pub fn slice_gpus(slices: &[&ResourceSliceSpec], previous: Option<&[Gpu]>) -> Result<Option<SliceGpus>, SliceError> {
    let Some(generation) = slices.iter().map(|s| s.pool.generation).max() else { return Ok(None) };
    let devices: Vec<&Device> =
        slices.iter().filter(|s| s.pool.generation == generation).flat_map(|s| s.devices.iter().flatten()).collect();
    if devices.is_empty() {
        return Ok(None);
    }
    let mut by_index: BTreeMap<u32, (&Device, Gpu)> = BTreeMap::new();
    let mut slots: Option<u32> = None;
    for d in &devices {
        let (index, gpu) = gpu_of(d)?;
        if let Some((first, _)) = by_index.get(&index) {
            return Err(SliceError::DuplicateIndex { first: first.name.clone(), second: d.name.clone(), index });
        }
        if let Some(k) = capacity(d, CAPACITY_SHARES, 1)? {
            let k = u32::try_from(k).unwrap_or(u32::MAX);
            slots = Some(slots.map_or(k, |s| s.min(k)));
        }
        by_index.insert(index, (d, gpu));
    }
    // a row is two characters per GPU of the node, so it also says how many GPUs the node has
    let row_gpus = devices.iter().filter_map(|d| string_attr(d, ATTR_LINKS)).map(|r| r.len() / 2).max().unwrap_or(0);
    let highest = by_index.keys().next_back().map_or(0, |&i| i as usize + 1);
    let n = highest.max(row_gpus).max(previous.map_or(0, <[Gpu]>::len));
    let largest = by_index.values().map(|(_, g)| g).max_by_key(|g| g.memory_mib).cloned();
    let gpus: Vec<Gpu> = (0..n as u32)
        .map(|i| match by_index.get(&i) {
            Some((_, g)) => g.clone(),
            None => {
                let last = previous.and_then(|p| p.iter().find(|g| g.index == i)).cloned();
                let mut g = last.or_else(|| largest.clone()).unwrap_or_else(|| Gpu {
                    uuid: String::new(),
                    index: i,
                    model: String::new(),
                    memory_mib: 0,
                    numa_node: None,
                    pci_bus_id: String::new(),
                    healthy: false,
                });
                if g.index != i {
                    // a stand-in copied from another GPU: only its capacity is borrowed
                    g.uuid.clear();
                    g.pci_bus_id.clear();
                    g.index = i;
                }
                g.healthy = false;
                g
            }
        })
        .collect();
    let fabric = devices.iter().find_map(|d| string_attr(d, ATTR_NVLINK_FABRIC)).map_or(Default::default(), fabric_of);
    let rows: Vec<Option<&str>> =
        (0..n as u32).map(|i| by_index.get(&i).and_then(|(d, _)| string_attr(d, ATTR_LINKS))).collect();
    let every_row = by_index.values().all(|(d, _)| string_attr(d, ATTR_LINKS).is_some());
    let topology = if every_row && row_gpus == n {
        topology_from_rows(n, fabric, &rows)?
    } else {
        let domains: Vec<_> = (0..n as u32)
            .map(|i| {
                by_index.get(&i).map(|(d, _)| {
                    (int_attr(d, ATTR_NVLINK_DOMAIN), int_attr(d, ATTR_PCIE_ROOT), int_attr(d, ATTR_NUMA_NODE))
                })
            })
            .collect();
        topology_from_domains(fabric, &domains)?
    };
    // a mode this reader does not know counts as advisory, as in the inventory annotation
    let modes: Option<Vec<IsolationMode>> = devices
        .iter()
        .map(|d| string_attr(d, ATTR_ISOLATION).map(|m| m.parse().unwrap_or(IsolationMode::Advisory)))
        .collect();
    let isolation = modes.and_then(|m| m.into_iter().max());
    Ok(Some(SliceGpus { gpus, topology, slots_per_gpu: slots, generation, isolation }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Link, NvlinkFabric, PcieLevel};
    use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceCapacity, ResourcePool};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    pub(crate) fn device(index: u32, mib: &str, row: Option<&str>) -> Device {
        let mut attributes = BTreeMap::from([
            (ATTR_INDEX.to_string(), DeviceAttribute { int: Some(index.into()), ..Default::default() }),
            (ATTR_MODEL.to_string(), DeviceAttribute { string: Some("H100".into()), ..Default::default() }),
            (ATTR_UUID.to_string(), DeviceAttribute { string: Some(format!("GPU-{index}")), ..Default::default() }),
            (ATTR_NVLINK_FABRIC.to_string(), DeviceAttribute { string: Some("nvswitch".into()), ..Default::default() }),
        ]);
        if let Some(row) = row {
            attributes.insert(ATTR_LINKS.into(), DeviceAttribute { string: Some(row.into()), ..Default::default() });
        }
        let cap = |v: &str| DeviceCapacity { value: Quantity(v.into()), request_policy: None };
        Device {
            name: super::super::device_name(index),
            allow_multiple_allocations: Some(true),
            attributes: Some(attributes),
            capacity: Some(BTreeMap::from([(CAPACITY_MEMORY.into(), cap(mib)), (CAPACITY_SHARES.into(), cap("4"))])),
            ..Default::default()
        }
    }

    fn slice(generation: i64, devices: Vec<Device>) -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: super::super::DEFAULT_DRIVER.into(),
            node_name: Some("n1".into()),
            pool: ResourcePool { name: "n1".into(), generation, resource_slice_count: 1 },
            devices: Some(devices),
            ..Default::default()
        }
    }

    #[test]
    fn the_weakest_isolation_mode_of_the_devices_is_the_nodes() {
        let with = |index, mode: Option<&str>| {
            let mut d = device(index, "80Gi", None);
            if let Some(m) = mode {
                let a = DeviceAttribute { string: Some(m.into()), ..Default::default() };
                d.attributes.as_mut().unwrap().insert(ATTR_ISOLATION.into(), a);
            }
            d
        };
        let read = |devices| slice_gpus(&[&slice(1, devices)], None).unwrap().unwrap().isolation;
        assert_eq!(read(vec![with(0, Some("mps")), with(1, Some("mps"))]), Some(IsolationMode::Mps));
        assert_eq!(read(vec![with(0, Some("mps")), with(1, Some("guard"))]), Some(IsolationMode::Guard));
        assert_eq!(read(vec![with(0, Some("mps")), with(1, None)]), None);
        assert_eq!(read(vec![with(0, Some("someday"))]), Some(IsolationMode::Advisory));
    }

    #[test]
    fn devices_become_gpus_with_their_graph_and_share_limit() {
        let s = slice(
            3,
            vec![
                device(0, "80Gi", Some("--4H2S")),
                device(1, "81920Mi", Some("4H--2S")),
                device(2, "80Gi", Some("2S2S--")),
            ],
        );
        let old = slice(2, vec![device(0, "1Gi", None)]);
        let g = slice_gpus(&[&old, &s], None).unwrap().unwrap();
        assert_eq!(g.generation, 3);
        assert_eq!(g.gpus.len(), 3);
        assert!(g.gpus.iter().all(|g| g.memory_mib == 81920 && g.healthy && g.model == "H100"));
        assert_eq!(g.slots_per_gpu, Some(4));
        assert_eq!(g.isolation, None);
        assert_eq!(g.topology.fabric(), NvlinkFabric::Nvswitch);
        assert_eq!(g.topology.link(0, 1), Some(Link { nvlinks: 4, pcie: PcieLevel::Phb }));
        assert_eq!(g.topology.link(1, 2), Some(Link { nvlinks: 2, pcie: PcieLevel::Sys }));
    }

    #[test]
    fn a_gpu_that_left_the_slice_stays_unhealthy_with_its_last_capacity() {
        let full = slice(1, vec![device(0, "80Gi", Some("--4H")), device(1, "40Gi", Some("4H--"))]);
        let before = slice_gpus(&[&full], None).unwrap().unwrap();
        let without = slice(2, vec![device(0, "80Gi", Some("--4H"))]);
        let after = slice_gpus(&[&without], Some(&before.gpus)).unwrap().unwrap();
        assert_eq!(after.gpus.len(), 2);
        assert!(!after.gpus[1].healthy);
        assert_eq!(after.gpus[1].memory_mib, 40960);
        assert_eq!(after.gpus[1].uuid, "GPU-1");
        assert_eq!(after.topology.link(0, 1), Some(Link { nvlinks: 4, pcie: PcieLevel::Phb }));
        // after a restart: the node's largest GPU stands in
        let cold = slice_gpus(&[&without], None).unwrap().unwrap();
        assert!(!cold.gpus[1].healthy);
        assert_eq!(cold.gpus[1].memory_mib, 81920);
        assert_eq!(cold.gpus[1].uuid, "");
    }

    #[test]
    fn devices_without_rows_get_the_coarse_graph() {
        let mut a = device(0, "80Gi", None);
        let mut b = device(1, "80Gi", None);
        for d in [&mut a, &mut b] {
            d.attributes
                .as_mut()
                .unwrap()
                .insert(ATTR_NVLINK_DOMAIN.into(), DeviceAttribute { int: Some(0), ..Default::default() });
        }
        let g = slice_gpus(&[&slice(1, vec![a, b])], None).unwrap().unwrap();
        assert_eq!(g.topology.link(0, 1).map(|l| l.nvlinks), Some(1));
    }

    #[test]
    fn bad_devices_are_refused_with_their_name() {
        let mut d = device(0, "80Gi", None);
        d.capacity
            .as_mut()
            .unwrap()
            .insert(CAPACITY_MEMORY.into(), DeviceCapacity { value: Quantity("lots".into()), request_policy: None });
        let e = slice_gpus(&[&slice(1, vec![d])], None).unwrap_err();
        assert!(matches!(e, SliceError::BadCapacity { ref device, .. } if device == "gpu-0"), "{e}");
        let e = slice_gpus(&[&slice(1, vec![device(1, "1Gi", None), device(1, "1Gi", None)])], None).unwrap_err();
        assert!(matches!(e, SliceError::DuplicateIndex { index: 1, .. }), "{e}");
        let mut far = device(0, "1Gi", None);
        far.attributes
            .as_mut()
            .unwrap()
            .insert(ATTR_INDEX.into(), DeviceAttribute { int: Some(1 << 40), ..Default::default() });
        assert!(matches!(slice_gpus(&[&slice(1, vec![far])], None), Err(SliceError::IndexTooLarge { .. })));
        assert!(slice_gpus(&[], None).unwrap().is_none());
        assert!(slice_gpus(&[&slice(1, vec![])], None).unwrap().is_none());
    }
}
