//! What the plugin needs from the GPU driver, behind one trait, so that everything above it runs the
//! same against NVML on a GPU node and against a topology file in tests and demos.
//!
//! - [`real::NvmlBackend`]: NVML through `nvml-wrapper`, which loads `libnvidia-ml.so.1` at run time,
//!   so the crate builds and its tests run on machines without a GPU or driver.
//! - [`fake::FakeBackend`]: a node from a `shared/topologies` file, with scriptable utilization and
//!   injectable faults.

pub mod fake;
pub mod real;

use std::collections::BTreeMap;
use std::time::Duration;

use gpuplace_core::topology::{
    GpuTopology, NvlinkFabric, PcieLevel, TopologyError, TopologyFile, TopologyGpu, TopologyLink,
};
use serde::{Deserialize, Serialize};

/// One physical GPU as discovered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index; the backend guarantees 0..n in order.
    pub index: u32,
    pub uuid: String,
    pub model: String,
    /// What the GPU's containers can allocate, what is advertised and placed against:
    /// [`total_mib`](Self::total_mib) less the driver's reserve and [`context_reserve_mib`]
    /// (Self::context_reserve_mib) (see [`Inventory::reserve_contexts`]).
    pub memory_mib: u64,
    /// The framebuffer NVML reports (`nvmlDeviceGetMemoryInfo_v2`'s `total`); 0 in inventories
    /// written before the field existed.
    #[serde(default)]
    pub total_mib: u64,
    /// Memory the driver keeps for itself (`nvmlMemory_v2_t.reserved`); `None` where the driver
    /// has no v2 call and the amount is unknown.
    #[serde(default)]
    pub reserved_mib: Option<u64>,
    /// Kept back for the CUDA contexts of the GPU's containers: slots per GPU times the context
    /// overhead (`--context-overhead-mib`), so that a grant of X MiB is X MiB the container can
    /// allocate beside full neighbours.
    #[serde(default)]
    pub context_reserve_mib: u64,
    pub numa_node: Option<u32>,
    /// `DDDD:BB:DD.F` (NVML's 8-digit domain shortened to the sysfs form).
    pub pci_bus_id: String,
    /// Active NVLink lanes that end on an NVSwitch rather than on a peer GPU.
    #[serde(default)]
    pub nvswitch_links: u32,
}

/// How one GPU pair is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairLink {
    pub a: u32,
    pub b: u32,
    /// Lanes between the pair, as nvidia-smi's `NV#`: direct lanes plus, through NVSwitch, the smaller
    /// of the two GPUs' switch lane counts (each GPU reaches every other at its own switch bandwidth).
    pub nvlinks: u32,
    /// PCIe common-ancestor level (what nvidia-smi shows when there is no NVLink).
    pub pcie: PcieLevel,
}

/// Everything discovery found on the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    /// `nvml` or `fake`.
    pub backend: String,
    /// A name for the board: the topology file's name, or the first GPU's model on real nodes.
    pub name: String,
    pub driver_version: Option<String>,
    pub nvlink_fabric: NvlinkFabric,
    pub gpus: Vec<GpuInfo>,
    /// One entry per unordered pair, `a < b`, sorted.
    pub links: Vec<PairLink>,
}

impl Inventory {
    /// Checks what the rest of the plugin relies on: indices 0..n in order, distinct UUIDs, and every
    /// link naming GPUs of this node.
    pub fn validate(&self) -> Result<(), BackendError> {
        let mut seen = std::collections::HashSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            if g.index as usize != i {
                return Err(BackendError::Inconsistent(format!("GPU at position {i} has index {}", g.index)));
            }
            if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
                return Err(BackendError::Inconsistent(format!("GPU {i} has an empty or repeated UUID {:?}", g.uuid)));
            }
        }
        let n = self.gpus.len() as u32;
        if let Some(l) = self.links.iter().find(|l| l.a >= n || l.b >= n || l.a >= l.b) {
            return Err(BackendError::Inconsistent(format!(
                "link {}-{} is not a pair of this node's {n} GPUs",
                l.a, l.b
            )));
        }
        Ok(())
    }

    /// In the `shared/topologies` schema, so `discover --json` output feeds the simulator and tests.
    pub fn to_topology_file(&self) -> TopologyFile {
        TopologyFile {
            name: self.name.clone(),
            description: format!("discovered by gpuplace-device-plugin ({} backend)", self.backend),
            nvlink_fabric: self.nvlink_fabric,
            gpus: self
                .gpus
                .iter()
                .map(|g| TopologyGpu {
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node,
                    pci_bus_id: g.pci_bus_id.clone(),
                    uuid: Some(g.uuid.clone()),
                })
                .collect(),
            links: self
                .links
                .iter()
                .map(|l| TopologyLink { a: l.a, b: l.b, nvlinks: l.nvlinks, pcie: l.pcie })
                .collect(),
        }
    }

    /// The core's link graph, for the set search.
    pub fn topology(&self) -> Result<GpuTopology, TopologyError> {
        self.to_topology_file().graph()
    }

    /// Keeps `slots_per_gpu * overhead_mib` of every GPU back for its containers' CUDA contexts:
    /// each GPU's `memory_mib` (what is advertised and placed against) becomes what is left of
    /// its total after the driver's reserve and the contexts. Called once, after discovery.
    pub fn reserve_contexts(&mut self, slots_per_gpu: u32, overhead_mib: u64) {
        for g in &mut self.gpus {
            g.context_reserve_mib = u64::from(slots_per_gpu).saturating_mul(overhead_mib);
            g.memory_mib = allocatable_mib(g.total_mib.max(g.memory_mib), g.reserved_mib, g.context_reserve_mib);
        }
    }

    /// The link between two GPUs, if discovery reported one.
    pub fn link(&self, a: u32, b: u32) -> Option<&PairLink> {
        let (a, b) = (a.min(b), a.max(b));
        self.links.iter().find(|l| l.a == a && l.b == b)
    }
}

/// What containers can allocate on a GPU of `total_mib` (at least 1 MiB: a GPU is never advertised
/// as empty, which the inventory refuses).
pub fn allocatable_mib(total_mib: u64, reserved_mib: Option<u64>, context_reserve_mib: u64) -> u64 {
    total_mib.saturating_sub(reserved_mib.unwrap_or(0)).saturating_sub(context_reserve_mib).max(1)
}

/// A CUDA context's framebuffer, MiB, per process (`--context-overhead-mib`). With lazy module
/// loading (the default since CUDA 12.2) a bare context is reported at about 300 MiB on A100-class
/// GPUs and 400–560 MiB on large Ada/Blackwell boards (nvidia-smi per process, PyTorch and
/// llama.cpp reports); it grows with the SM count. 512 MiB covers an H100's (132 SMs); an MPS
/// client's context on the server is not larger. To be measured on real GPUs.
pub const DEFAULT_CONTEXT_OVERHEAD_MIB: u64 = 512;

/// Whether the driver can cap a cgroup's GPU memory (NVML 615's `nvmlDeviceSetMemoryLimits_v1`,
/// "MPS v3 memory partitioning": cgroup v2, non-MIG), as found at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverMemoryLimits {
    pub supported: bool,
    /// What was found (driver version, symbols, cgroup v2), or why it is missing.
    pub detail: String,
}

impl DriverMemoryLimits {
    pub fn absent(why: impl Into<String>) -> Self {
        Self { supported: false, detail: why.into() }
    }

    /// The verdict from what was found: `driver_version` (NVML's), whether libnvidia-ml exports
    /// `nvmlDeviceSetMemoryLimits_v1` and `nvmlDeviceGetMemoryLimits_v1`, and whether cgroup v2 is
    /// mounted at /sys/fs/cgroup.
    pub fn judge(driver_version: Option<&str>, set: bool, get: bool, cgroup_v2: bool) -> Self {
        let driver = driver_version.unwrap_or("unknown");
        if !(set && get) {
            return Self::absent(format!(
                "driver {driver}: libnvidia-ml exports no nvmlDeviceSetMemoryLimits_v1/nvmlDeviceGetMemoryLimits_v1 (NVML 615 or newer has them)"
            ));
        }
        if !cgroup_v2 {
            return Self::absent(format!(
                "driver {driver} has per-cgroup memory limits, but cgroup v2 is not mounted at /sys/fs/cgroup"
            ));
        }
        Self { supported: true, detail: format!("driver {driver}: nvmlDeviceSetMemoryLimits_v1 with cgroup v2") }
    }
}

/// One reading of a GPU's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSample {
    pub index: u32,
    /// Percent of the last sample period in which a kernel ran (NVML's "GPU utilization").
    pub util_pct: u32,
    pub mem_used_mib: u64,
    /// Free framebuffer memory. Not `total - used`: the driver reserves some memory on real GPUs.
    pub mem_free_mib: u64,
    pub temperature_c: u32,
    pub power_mw: u32,
    pub sm_clock_mhz: u32,
}

/// One process holding a CUDA context on a GPU, as NVML lists it (compute and MPS clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// The host's PID (NVML answers in the host's PID namespace; the plugin runs with `hostPID`).
    pub pid: u32,
    /// Framebuffer memory the process holds; `None` where the driver does not say (under MPS on
    /// some drivers, or without the privilege to read another user's processes).
    pub used_mib: Option<u64>,
    /// Percent of the last sample period in which the process's kernels ran (NVML's process
    /// utilization); `None` where the driver has no recent sample for it.
    #[serde(default)]
    pub sm_pct: Option<u32>,
}

/// What happened to a GPU's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuEventKind {
    /// An XID error reported by the driver.
    Xid(u64),
    /// The GPU no longer answers (fell off the bus, NVML `GPU_IS_LOST`).
    Lost,
    /// The GPU answers again (only the fake backend reports this; a real GPU needs a reset and a
    /// plugin restart).
    Recovered,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEvent {
    pub index: u32,
    pub kind: GpuEventKind,
}

/// XIDs caused by the application rather than the GPU (the set NVIDIA's device plugin also skips):
/// graphics engine exception (13), MMU fault (31), channel stopped by the user (43), preemptive
/// cleanup (45), video processor exception (68), context switch timeout (109). A GPU stays healthy
/// through them; every other XID marks it unhealthy.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Whether an XID means the device, not the workload, is in trouble.
pub fn xid_is_critical(xid: u64) -> bool {
    !APPLICATION_XIDS.contains(&xid)
}

/// Why a backend call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error(
        "NVML is not available ({0}): is the NVIDIA driver installed, and are the host's driver libraries \
         (libnvidia-ml.so.1) visible to this process? Without a GPU, run with --fake-topology FILE"
    )]
    NvmlUnavailable(String),
    #[error("NVML {call} failed{}: {message}", gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default())]
    Nvml { call: &'static str, gpu: Option<u32>, message: String },
    #[error("GPU {0} has fallen off the bus")]
    GpuLost(u32),
    #[error("no GPU with index {0}")]
    UnknownGpu(u32),
    #[error("inconsistent inventory: {0}")]
    Inconsistent(String),
    #[error("fake backend: {0}")]
    Fake(String),
}

/// The driver, as the plugin sees it.
pub trait GpuBackend: Send + Sync {
    /// GPUs, NVLink and PCIe facts. Called at start and by `discover`.
    fn inventory(&self) -> Result<Inventory, BackendError>;
    /// Current counters of one GPU; [`BackendError::GpuLost`] when it no longer answers.
    fn sample(&self, index: u32) -> Result<GpuSample, BackendError>;
    /// Blocks for at most `timeout` and returns the health events that arrived (possibly none).
    /// Called in a loop from one blocking thread.
    fn wait_events(&self, timeout: Duration) -> Result<Vec<GpuEvent>, BackendError>;
    /// The processes with a compute context on one GPU now, each PID once (the guard's input).
    fn processes(&self, index: u32) -> Result<Vec<GpuProcess>, BackendError>;
    /// Whether the driver can cap a cgroup's GPU memory (looked up once, at start).
    fn driver_memory_limits(&self) -> DriverMemoryLimits {
        DriverMemoryLimits::absent("this backend has no driver")
    }
    /// Caps the GPU memory that the processes of one cgroup (a full path under the cgroup v2 mount)
    /// may allocate on one GPU, hard and soft at `limit_mib` (`None`: no limit). Only where
    /// [`Self::driver_memory_limits`] said supported.
    fn set_memory_limit(
        &self,
        index: u32,
        cgroup: &std::path::Path,
        limit_mib: Option<u64>,
    ) -> Result<(), BackendError> {
        let _ = (index, cgroup, limit_mib);
        Err(BackendError::Nvml {
            call: "nvmlDeviceSetMemoryLimits_v1",
            gpu: Some(index),
            message: "this backend has no driver memory limits".into(),
        })
    }
}

/// Where one NVLink lane of a GPU ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneEnd {
    /// Another GPU, by PCI bus id.
    Gpu(String),
    /// An NVSwitch chip.
    Switch,
    /// Something else (an IBM NPU, or an endpoint NVML cannot name): adds no GPU-GPU bandwidth.
    Other,
}

/// Bus ids compare equal in NVML's 8-digit-domain form and the sysfs 4-digit form.
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 && domain[..domain.len() - 4].bytes().all(|b| b == b'0') => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

/// Turns per-lane facts into pair links: direct lanes are counted per peer, NVSwitch lanes give every
/// pair of switch-attached GPUs the smaller of their switch lane counts. `pcie(a, b)` supplies the
/// PCIe level of each pair. Returns the fabric, the pair links and each GPU's switch lane count.
pub fn pair_links(
    bus_ids: &[String],
    lanes: &[(u32, LaneEnd)],
    mut pcie: impl FnMut(u32, u32) -> PcieLevel,
) -> (NvlinkFabric, Vec<PairLink>, Vec<u32>) {
    let n = bus_ids.len();
    let by_bus: BTreeMap<String, u32> =
        bus_ids.iter().enumerate().map(|(i, b)| (normalize_bus_id(b), i as u32)).collect();
    let mut direct = vec![0u32; n * n];
    let mut switch = vec![0u32; n];
    for (gpu, end) in lanes {
        let g = *gpu as usize;
        if g >= n {
            continue;
        }
        match end {
            LaneEnd::Gpu(bus) => {
                if let Some(&peer) = by_bus.get(&normalize_bus_id(bus)) {
                    if peer as usize != g {
                        direct[g * n + peer as usize] += 1;
                    }
                }
            }
            LaneEnd::Switch => switch[g] += 1,
            LaneEnd::Other => {}
        }
    }
    let mut links = Vec::with_capacity(n * n.saturating_sub(1) / 2);
    for a in 0..n {
        for b in a + 1..n {
            // each side reports its own lanes to the peer; they agree on healthy hardware, and the
            // smaller count is the usable one when a lane is down on one side
            let direct_lanes = direct[a * n + b].min(direct[b * n + a]);
            let switched = switch[a].min(switch[b]);
            links.push(PairLink {
                a: a as u32,
                b: b as u32,
                nvlinks: direct_lanes + switched,
                pcie: pcie(a as u32, b as u32),
            });
        }
    }
    let fabric = if switch.iter().any(|&s| s > 0) {
        NvlinkFabric::Nvswitch
    } else if direct.iter().any(|&d| d > 0) {
        NvlinkFabric::Direct
    } else {
        NvlinkFabric::None
    };
    (fabric, links, switch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_normalize_to_sysfs_form() {
        assert_eq!(normalize_bus_id("00000000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id("0000:1b:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id("00000001:1B:00.0"), "0001:1b:00.0");
        assert_eq!(normalize_bus_id("garbage"), "garbage");
    }

    #[test]
    fn switch_lanes_connect_every_pair() {
        // 4 GPUs with 18 lanes each into NVSwitch: every pair is NV18, as nvidia-smi shows on HGX H100
        let bus: Vec<String> = (0..4).map(|i| format!("00000000:{:02X}:00.0", 0x10 + i)).collect();
        let lanes: Vec<(u32, LaneEnd)> = (0..4).flat_map(|g| (0..18).map(move |_| (g, LaneEnd::Switch))).collect();
        let (fabric, links, sw) =
            pair_links(&bus, &lanes, |a, b| if a / 2 == b / 2 { PcieLevel::Node } else { PcieLevel::Sys });
        assert_eq!(fabric, NvlinkFabric::Nvswitch);
        assert_eq!(sw, vec![18; 4]);
        assert_eq!(links.len(), 6);
        assert!(links.iter().all(|l| l.nvlinks == 18));
        assert_eq!(links[0].pcie, PcieLevel::Node);
        assert_eq!(links[1].pcie, PcieLevel::Sys);
    }

    #[test]
    fn direct_lanes_count_per_peer_and_ignore_strangers() {
        let bus: Vec<String> = vec!["0000:06:00.0".into(), "0000:07:00.0".into(), "0000:0a:00.0".into()];
        let lanes = vec![
            // 0 <-> 1 with two lanes, reported from both sides, in NVML's long form on one side
            (0, LaneEnd::Gpu("00000000:07:00.0".into())),
            (0, LaneEnd::Gpu("00000000:07:00.0".into())),
            (1, LaneEnd::Gpu("0000:06:00.0".into())),
            (1, LaneEnd::Gpu("0000:06:00.0".into())),
            // 1 -> 2 seen from one side only (a lane down on GPU 2): not usable
            (1, LaneEnd::Gpu("0000:0a:00.0".into())),
            // an NPU and an unknown bus id add nothing
            (2, LaneEnd::Other),
            (2, LaneEnd::Gpu("0000:ff:00.0".into())),
            // out of range GPU is ignored rather than a panic
            (9, LaneEnd::Switch),
        ];
        let (fabric, links, sw) = pair_links(&bus, &lanes, |_, _| PcieLevel::Pix);
        assert_eq!(fabric, NvlinkFabric::Direct);
        assert_eq!(sw, vec![0; 3]);
        let get = |a, b| links.iter().find(|l| l.a == a && l.b == b).unwrap().nvlinks;
        assert_eq!(get(0, 1), 2);
        assert_eq!(get(1, 2), 0);
        assert_eq!(get(0, 2), 0);
    }

    #[test]
    fn advertised_memory_is_total_less_the_reserve_and_the_contexts() {
        assert_eq!(allocatable_mib(81559, Some(453), 10 * 512), 81559 - 453 - 5120);
        assert_eq!(allocatable_mib(81559, None, 0), 81559);
        assert_eq!(allocatable_mib(1000, Some(600), 5120), 1);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/hgx-h100-8.json");
        let mut inv = crate::nvml::fake::FakeBackend::load(&path, "n").unwrap().inventory().unwrap();
        let (total, reserved) = (inv.gpus[0].total_mib, inv.gpus[0].reserved_mib);
        inv.reserve_contexts(10, 512);
        assert_eq!(inv.gpus[0].context_reserve_mib, 5120);
        assert_eq!(inv.gpus[0].memory_mib, allocatable_mib(total, reserved, 5120));
        // again with other figures: from the total, not from the last result
        inv.reserve_contexts(4, 0);
        assert_eq!(inv.gpus[0].memory_mib, allocatable_mib(total, reserved, 0));
    }

    #[test]
    fn driver_memory_limits_need_the_symbols_and_cgroup_v2() {
        let no = DriverMemoryLimits::judge(Some("550.54.15"), false, false, true);
        assert!(!no.supported && no.detail.contains("550.54.15") && no.detail.contains("NVML 615"), "{no:?}");
        assert!(!DriverMemoryLimits::judge(Some("615.1"), true, false, true).supported);
        let v1 = DriverMemoryLimits::judge(Some("615.1"), true, true, false);
        assert!(!v1.supported && v1.detail.contains("cgroup v2"), "{v1:?}");
        assert!(DriverMemoryLimits::judge(Some("615.1"), true, true, true).supported);
    }

    #[test]
    fn xid_classes() {
        assert!(!xid_is_critical(13));
        assert!(!xid_is_critical(43));
        assert!(xid_is_critical(48)); // double-bit ECC
        assert!(xid_is_critical(79)); // fell off the bus
    }

    #[test]
    fn backend_errors_name_the_cause() {
        let e = BackendError::NvmlUnavailable("libnvidia-ml.so.1: cannot open shared object file".into());
        let s = e.to_string();
        assert!(s.contains("libnvidia-ml.so.1") && s.contains("--fake-topology"), "{s}");
        let e = BackendError::Nvml { call: "nvmlDeviceGetUUID", gpu: Some(3), message: "Unknown".into() };
        assert_eq!(e.to_string(), "NVML nvmlDeviceGetUUID failed on GPU 3: Unknown");
    }
}
