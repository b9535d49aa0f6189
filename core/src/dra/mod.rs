//! Dynamic Resource Allocation (`resource.k8s.io/v1`) in the cluster model's terms (pure).
//!
//! In DRA mode the device plugin publishes each node's GPUs as devices of one ResourceSlice, and pods
//! get GPUs through ResourceClaims. This module is the one place that reads and writes those objects
//! for gpuplace:
//!
//! - the names both sides use: the driver, the capacities, the attributes, the device names, and the
//!   node's link graph as one attribute per device ([`link_row`], [`topology_from_rows`]);
//! - [`attributes`]: the attributes a GPU's device carries, from the model (the device plugin
//!   publishes them, placement checks claims' constraints against them);
//! - [`slices`]: a node's slices as the model's GPUs, link graph and share limit;
//! - [`claims`]: what an allocated claim holds, as the model's allocation record; what a claim asks
//!   for, as the placement engine's demand; and a placement written back as the claim's allocation,
//!   with the rules kube-scheduler's DynamicResources plugin needs to honour it.

pub mod attributes;
pub mod claims;
pub mod slices;

use crate::topology::{GpuTopology, Link, NvlinkFabric, PcieLevel, TopologyError};

/// The DRA driver name gpuplace publishes its GPUs under by default; the DeviceClass of the same name
/// selects them.
pub const DEFAULT_DRIVER: &str = "gpu.gpuplace.io";

/// The capacity names (and so the names in a claim's `capacity.requests`).
pub const CAPACITY_MEMORY: &str = "memory";
pub const CAPACITY_CORES: &str = "cores";
pub const CAPACITY_SHARES: &str = "shares";

/// The attribute names, in the driver's domain.
pub const ATTR_INDEX: &str = "index";
pub const ATTR_UUID: &str = "uuid";
pub const ATTR_MODEL: &str = "model";
pub const ATTR_PCI_BUS_ID: &str = "pciBusId";
pub const ATTR_NUMA_NODE: &str = "numaNode";
pub const ATTR_NVLINK_DOMAIN: &str = "nvlinkDomain";
pub const ATTR_PCIE_ROOT: &str = "pcieRoot";
/// The GPU's row of the node's link graph ([`link_row`]).
pub const ATTR_LINKS: &str = "links";
/// `direct`, `nvswitch` or `none`: how the node's NVLink lanes end.
pub const ATTR_NVLINK_FABRIC: &str = "nvlinkFabric";

/// The node's isolation mode (`driver-limits`, `mps`, `guard`, `advisory`), on every device.
pub const ATTR_ISOLATION: &str = "isolation";

/// The longest string attribute value the API server accepts.
pub const MAX_ATTRIBUTE_STRING: usize = 64;

/// The device name of GPU `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index a device name stands for, if it is one of ours.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    // "gpu-01" is not a name this module writes
    if digits.len() > 1 && digits.starts_with('0') {
        return None;
    }
    digits.parse().ok()
}

/// The attribute name of a network level label: its name part (`network.gpuplace.io/tor` → `tor`).
pub fn network_attribute(label: &str) -> &str {
    label.rsplit('/').next().unwrap_or(label)
}

fn pcie_char(level: PcieLevel) -> char {
    match level {
        PcieLevel::Pix => 'P',
        PcieLevel::Pxb => 'X',
        PcieLevel::Phb => 'H',
        PcieLevel::Node => 'N',
        PcieLevel::Sys => 'S',
    }
}

fn pcie_of(c: char) -> Option<PcieLevel> {
    Some(match c {
        'P' => PcieLevel::Pix,
        'X' => PcieLevel::Pxb,
        'H' => PcieLevel::Phb,
        'N' => PcieLevel::Node,
        'S' => PcieLevel::Sys,
        _ => return None,
    })
}

/// NVLink lane counts above this are written as this (no GPU has more lanes to one peer).
const MAX_LANES: u32 = 35;

/// GPU `gpu`'s row of the link graph, as one string attribute: two characters per GPU of the node in
/// index order, the NVLink lanes to it (a base-36 digit) and the PCIe level (`P`IX, P`X`B, P`H`B,
/// `N`ODE, `S`YS), `--` for the GPU itself. `None` when the row would not fit in an attribute (boards
/// of more than 32 GPUs publish only their NVLink domains and PCIe roots).
pub fn link_row(topology: &GpuTopology, gpu: usize) -> Option<String> {
    let n = topology.len();
    if gpu >= n || 2 * n > MAX_ATTRIBUTE_STRING {
        return None;
    }
    let mut row = String::with_capacity(2 * n);
    for other in 0..n {
        match topology.link(gpu, other) {
            Some(link) if other != gpu => {
                let lanes = char::from_digit(link.nvlinks.min(MAX_LANES), 36)?.to_ascii_uppercase();
                row.push(lanes);
                row.push(pcie_char(link.pcie));
            }
            _ => row.push_str("--"),
        }
    }
    Some(row)
}

/// The attribute value of a fabric.
pub fn fabric_name(fabric: NvlinkFabric) -> &'static str {
    match fabric {
        NvlinkFabric::Direct => "direct",
        NvlinkFabric::Nvswitch => "nvswitch",
        NvlinkFabric::None => "none",
    }
}

/// The fabric an attribute value names (`none` for anything else).
pub fn fabric_of(name: &str) -> NvlinkFabric {
    match name {
        "direct" => NvlinkFabric::Direct,
        "nvswitch" => NvlinkFabric::Nvswitch,
        _ => NvlinkFabric::None,
    }
}

/// Why link rows do not make a graph.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkRowError {
    #[error("GPU {gpu}'s link row {row:?} is not two characters for each of the node's {n} GPUs")]
    Length { gpu: u32, row: String, n: usize },
    #[error("GPU {gpu}'s link row {row:?} has {pair:?} at position {at}, not a lane digit and a PCIe level")]
    Malformed { gpu: u32, row: String, pair: String, at: usize },
    #[error("GPUs {a} and {b} disagree on their link ({ab} against {ba})")]
    Asymmetric { a: u32, b: u32, ab: String, ba: String },
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// Parses one pair of a row.
fn pair(gpu: u32, row: &str, at: usize) -> Result<Option<Link>, LinkRowError> {
    let text = row.get(2 * at..2 * at + 2).unwrap_or_default();
    let malformed = || LinkRowError::Malformed { gpu, row: row.to_string(), pair: text.to_string(), at };
    if text == "--" {
        return Ok(None);
    }
    let mut chars = text.chars();
    let (Some(lanes), Some(level)) = (chars.next(), chars.next()) else {
        return Err(malformed());
    };
    let nvlinks = lanes.to_digit(36).ok_or_else(malformed)?;
    let pcie = pcie_of(level).ok_or_else(malformed)?;
    Ok(Some(Link { nvlinks, pcie }))
}

/// The node's link graph from its `n` GPUs' rows (`rows[i]` is GPU `i`'s; a GPU without one, one that
/// left the slice, takes its peers' word on their links to it). Pairs nobody describes are taken as
/// `SYS`.
pub fn topology_from_rows(n: usize, fabric: NvlinkFabric, rows: &[Option<&str>]) -> Result<GpuTopology, LinkRowError> {
    let mut links: Vec<Option<Link>> = vec![None; n * n];
    for (gpu, row) in rows.iter().enumerate().take(n) {
        let Some(row) = row else { continue };
        if row.len() != 2 * n || !row.is_ascii() {
            return Err(LinkRowError::Length { gpu: gpu as u32, row: row.to_string(), n });
        }
        for other in 0..n {
            let link = pair(gpu as u32, row, other)?;
            if other == gpu {
                continue;
            }
            let Some(link) = link else {
                return Err(LinkRowError::Malformed {
                    gpu: gpu as u32,
                    row: row.to_string(),
                    pair: "--".into(),
                    at: other,
                });
            };
            let (lo, hi) = (gpu.min(other), gpu.max(other));
            match links[lo * n + hi] {
                Some(seen) if seen != link => {
                    let show = |l: Link| format!("{} lanes, {:?}", l.nvlinks, l.pcie);
                    return Err(LinkRowError::Asymmetric {
                        a: gpu as u32,
                        b: other as u32,
                        ab: show(link),
                        ba: show(seen),
                    });
                }
                _ => links[lo * n + hi] = Some(link),
            }
        }
    }
    let described = (0..n)
        .flat_map(|lo| (lo + 1..n).map(move |hi| (lo, hi)))
        .filter_map(|(lo, hi)| links[lo * n + hi].map(|l| (lo as u32, hi as u32, l)));
    Ok(GpuTopology::new(n, fabric, described.collect::<Vec<_>>(), PcieLevel::Sys)?)
}

/// One GPU's `(nvlinkDomain, pcieRoot, numaNode)` attributes, each when published.
pub type GpuDomains = (Option<i64>, Option<i64>, Option<i64>);

/// The node's link graph from the coarser attributes alone (boards too large for link rows, or
/// slices written by an older plugin): GPUs of one NVLink domain are joined by one lane, GPUs of one
/// PCIe root meet at the host bridge, GPUs of one NUMA node at `NODE`, others at `SYS`. Entry `i` is
/// GPU `i`'s domains, `None` for a GPU not in the slice.
pub fn topology_from_domains(fabric: NvlinkFabric, gpus: &[Option<GpuDomains>]) -> Result<GpuTopology, TopologyError> {
    let n = gpus.len();
    let mut links = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let (Some(ga), Some(gb)) = (gpus[a], gpus[b]) else { continue };
            let same = |x: Option<i64>, y: Option<i64>| x.is_some() && x == y;
            let pcie = if same(ga.1, gb.1) {
                PcieLevel::Phb
            } else if same(ga.2, gb.2) {
                PcieLevel::Node
            } else {
                PcieLevel::Sys
            };
            let nvlinks = u32::from(same(ga.0, gb.0));
            links.push((a as u32, b as u32, Link { nvlinks, pcie }));
        }
    }
    GpuTopology::new(n, fabric, links, PcieLevel::Sys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn device_names_round_trip_and_foreign_names_are_not_ours() {
        assert_eq!(device_name(7), "gpu-7");
        assert_eq!(device_index("gpu-7"), Some(7));
        assert_eq!(device_index("gpu-12"), Some(12));
        for foreign in ["gpu-", "gpu-07", "gpu-x", "mig-1", "gpu--1"] {
            assert_eq!(device_index(foreign), None, "{foreign}");
        }
        assert_eq!(network_attribute("network.gpuplace.io/tor"), "tor");
        assert_eq!(network_attribute("rack"), "rack");
    }

    fn any_topology() -> impl Strategy<Value = GpuTopology> {
        (1usize..=32)
            .prop_flat_map(|n| {
                let pairs = n * (n - 1) / 2;
                (
                    Just(n),
                    prop::collection::vec((0u32..=18, 0usize..5), pairs),
                    prop::sample::select(vec![NvlinkFabric::Direct, NvlinkFabric::Nvswitch, NvlinkFabric::None]),
                )
            })
            .prop_map(|(n, links, fabric)| {
                let levels = [PcieLevel::Pix, PcieLevel::Pxb, PcieLevel::Phb, PcieLevel::Node, PcieLevel::Sys];
                let pairs = (0..n).flat_map(|a| (a + 1..n).map(move |b| (a as u32, b as u32)));
                let links = pairs.zip(links).map(|((a, b), (nvlinks, l))| (a, b, Link { nvlinks, pcie: levels[l] }));
                GpuTopology::new(n, fabric, links.collect::<Vec<_>>(), PcieLevel::Sys).expect("valid links")
            })
    }

    proptest! {
        /// Every board of up to 32 GPUs goes through its link rows unchanged, even with GPUs missing
        /// from the slice (their peers' rows still describe them).
        #[test]
        fn link_rows_carry_the_whole_graph(t in any_topology(), missing in prop::collection::vec(any::<bool>(), 32)) {
            let n = t.len();
            let rows: Vec<String> = (0..n).map(|g| link_row(&t, g).expect("fits")).collect();
            prop_assert!(rows.iter().all(|r| r.len() <= MAX_ATTRIBUTE_STRING));
            // a GPU may leave the slice, but not all of them
            let shown: Vec<Option<&str>> =
                rows.iter().enumerate().map(|(g, r)| (g == 0 || !missing[g]).then_some(r.as_str())).collect();
            let back = topology_from_rows(n, t.fabric(), &shown).expect("parses");
            prop_assert_eq!(back.fabric(), t.fabric());
            for a in 0..n {
                for b in 0..n {
                    if a == b {
                        continue;
                    }
                    let described = shown[a].is_some() || shown[b].is_some();
                    let want = if described { t.link(a, b) } else { Some(Link { nvlinks: 0, pcie: PcieLevel::Sys }) };
                    prop_assert_eq!(back.link(a, b), want, "{} {}", a, b);
                }
            }
        }
    }

    #[test]
    fn boards_over_32_gpus_have_no_rows() {
        let t = GpuTopology::flat(33);
        assert_eq!(link_row(&t, 0), None);
        assert!(link_row(&GpuTopology::flat(32), 31).is_some());
    }

    #[test]
    fn bad_rows_are_refused_with_the_gpu_and_the_place() {
        let e = topology_from_rows(2, NvlinkFabric::None, &[Some("--0H"), Some("0S--")]).unwrap_err();
        assert!(matches!(e, LinkRowError::Asymmetric { a: 1, b: 0, .. }), "{e}");
        let e = topology_from_rows(2, NvlinkFabric::None, &[Some("--0Q"), None]).unwrap_err();
        assert!(matches!(e, LinkRowError::Malformed { gpu: 0, at: 1, .. }), "{e}");
        let e = topology_from_rows(3, NvlinkFabric::None, &[Some("--0H"), None, None]).unwrap_err();
        assert!(matches!(e, LinkRowError::Length { gpu: 0, n: 3, .. }), "{e}");
        let e = topology_from_rows(2, NvlinkFabric::None, &[Some("--0H"), Some("----")]).unwrap_err();
        assert!(matches!(e, LinkRowError::Malformed { gpu: 1, at: 0, .. }), "{e}");
        // a multi-byte character is refused, not sliced through
        let e = topology_from_rows(1, NvlinkFabric::None, &[Some("é")]).unwrap_err();
        assert!(matches!(e, LinkRowError::Length { .. }), "{e}");
    }

    #[test]
    fn domains_give_a_coarse_graph() {
        let gpus = [
            Some((Some(0), Some(0), Some(0))),
            Some((Some(0), Some(1), Some(0))),
            None,
            Some((Some(3), Some(3), Some(1))),
        ];
        let t = topology_from_domains(NvlinkFabric::Nvswitch, &gpus).expect("graph");
        assert_eq!(t.link(0, 1), Some(Link { nvlinks: 1, pcie: PcieLevel::Node }));
        assert_eq!(t.link(0, 3), Some(Link { nvlinks: 0, pcie: PcieLevel::Sys }));
        assert_eq!(t.link(0, 2), Some(Link { nvlinks: 0, pcie: PcieLevel::Sys }));
    }
}
