//! The attributes a GPU's device carries, worked out from the model: what the device plugin
//! publishes, and what gpuplace's placement checks a claim's `matchAttribute` and
//! `distinctAttribute` constraints against, so the two cannot disagree.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceAttribute;

use super::{
    fabric_name, link_row, network_attribute, ATTR_INDEX, ATTR_LINKS, ATTR_MODEL, ATTR_NUMA_NODE, ATTR_NVLINK_DOMAIN,
    ATTR_NVLINK_FABRIC, ATTR_PCIE_ROOT, ATTR_PCI_BUS_ID, ATTR_UUID,
};
use crate::cluster::{Gpu, DEFAULT_NETWORK_LEVELS};
use crate::topology::{GpuTopology, Link, PcieLevel};

/// Per GPU, the lowest index of the group it is joined to by the links `joins` accepts (itself when
/// none).
fn groups(topology: &GpuTopology, joins: impl Fn(&Link) -> bool) -> Vec<u32> {
    let n = topology.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for (a, b, link) in topology.links() {
        if !joins(&link) {
            continue;
        }
        let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
        // the lower index becomes the root, so the root is the group's lowest index
        let (lo, hi) = (ra.min(rb), ra.max(rb));
        parent[hi] = lo;
    }
    (0..n).map(|i| root(&mut parent, i) as u32).collect()
}

/// Per GPU, its NVLink domain: GPUs with NVLink lanes between them (direct or through NVSwitch).
pub fn nvlink_domains(topology: &GpuTopology) -> Vec<u32> {
    groups(topology, |l| l.nvlinks > 0)
}

/// Per GPU, its PCIe root: GPUs whose common PCIe ancestor is at most the host bridge.
pub fn pcie_roots(topology: &GpuTopology) -> Vec<u32> {
    groups(topology, |l| matches!(l.pcie, PcieLevel::Pix | PcieLevel::Pxb | PcieLevel::Phb))
}

fn int(v: i64) -> DeviceAttribute {
    DeviceAttribute { int: Some(v), ..Default::default() }
}

fn string(v: &str) -> DeviceAttribute {
    DeviceAttribute { string: Some(v.to_string()), ..Default::default() }
}

/// A node's GPUs as its devices' attributes, by GPU index (unqualified names: they are in the
/// driver's domain). `labels` are the node's (its place in the network).
#[derive(Debug, Clone)]
pub struct NodeAttributes {
    nvlink: Vec<u32>,
    pcie: Vec<u32>,
    network: Vec<(String, String)>,
}

impl NodeAttributes {
    pub fn new(topology: &GpuTopology, labels: &BTreeMap<String, String>) -> Self {
        let network = DEFAULT_NETWORK_LEVELS
            .iter()
            .filter_map(|label| labels.get(*label).map(|v| (network_attribute(label).to_string(), v.clone())))
            .collect();
        Self { nvlink: nvlink_domains(topology), pcie: pcie_roots(topology), network }
    }

    /// Every attribute of `gpu`'s device (`topology` gives the link row and fabric).
    pub fn of(&self, gpu: &Gpu, topology: &GpuTopology) -> BTreeMap<String, DeviceAttribute> {
        let i = gpu.index as usize;
        let mut out = BTreeMap::from([
            (ATTR_INDEX.to_string(), int(gpu.index.into())),
            (ATTR_UUID.to_string(), string(&gpu.uuid)),
            (ATTR_MODEL.to_string(), string(&gpu.model)),
            (ATTR_PCI_BUS_ID.to_string(), string(&gpu.pci_bus_id)),
            (ATTR_NVLINK_DOMAIN.to_string(), int(self.nvlink.get(i).copied().unwrap_or(gpu.index).into())),
            (ATTR_PCIE_ROOT.to_string(), int(self.pcie.get(i).copied().unwrap_or(gpu.index).into())),
            (ATTR_NVLINK_FABRIC.to_string(), string(fabric_name(topology.fabric()))),
        ]);
        if let Some(numa) = gpu.numa_node {
            out.insert(ATTR_NUMA_NODE.to_string(), int(numa.into()));
        }
        if let Some(row) = link_row(topology, i) {
            out.insert(ATTR_LINKS.to_string(), string(&row));
        }
        for (name, value) in &self.network {
            out.insert(name.clone(), string(value));
        }
        out
    }

    /// The attribute of `gpu`'s device under its fully qualified name (`<driver>/<name>`; a
    /// constraint names attributes so); `None` for another domain's or one the device lacks.
    pub fn qualified(&self, driver: &str, gpu: &Gpu, topology: &GpuTopology, name: &str) -> Option<DeviceAttribute> {
        let (domain, short) = name.split_once('/')?;
        if domain != driver {
            return None;
        }
        self.of(gpu, topology).remove(short)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::NvlinkFabric;

    fn gpu(index: u32) -> Gpu {
        Gpu {
            uuid: format!("GPU-{index}"),
            index,
            model: "A100".into(),
            memory_mib: 40960,
            numa_node: Some(index / 2),
            pci_bus_id: format!("0000:{index:02x}:00.0"),
            healthy: true,
        }
    }

    #[test]
    fn attributes_follow_the_links_and_the_nodes_labels() {
        // 0-1 NVLink, 2 and 3 alone; 0-2 under one host bridge
        let links =
            [(0, 1, Link { nvlinks: 2, pcie: PcieLevel::Sys }), (0, 2, Link { nvlinks: 0, pcie: PcieLevel::Phb })];
        let t = GpuTopology::new(4, NvlinkFabric::Direct, links, PcieLevel::Sys).unwrap();
        assert_eq!(nvlink_domains(&t), [0, 0, 2, 3]);
        assert_eq!(pcie_roots(&t), [0, 1, 0, 3]);
        let labels = crate::cluster::network_labels("spine-2", "tor-9");
        let attrs = NodeAttributes::new(&t, &labels);
        let of3 = attrs.of(&gpu(3), &t);
        assert_eq!(of3[ATTR_NVLINK_DOMAIN].int, Some(3));
        assert_eq!(of3[ATTR_NUMA_NODE].int, Some(1));
        assert_eq!(of3["tor"].string.as_deref(), Some("tor-9"));
        assert_eq!(of3[ATTR_NVLINK_FABRIC].string.as_deref(), Some("direct"));
        assert_eq!(of3[ATTR_LINKS].string.as_deref(), Some("0S0S0S--"));
        let q = |name: &str| attrs.qualified("gpu.gpuplace.io", &gpu(1), &t, name);
        assert_eq!(q("gpu.gpuplace.io/nvlinkDomain").and_then(|a| a.int), Some(0));
        assert_eq!(q("resource.kubernetes.io/pcieRoot"), None);
        assert_eq!(q("gpu.gpuplace.io/nothing"), None);
        assert_eq!(q("nvlinkDomain"), None);
    }
}
