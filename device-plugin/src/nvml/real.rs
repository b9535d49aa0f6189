//! NVML through `nvml-wrapper`. The library is opened at run time (`libnvidia-ml.so.1`), so this
//! compiles everywhere and fails with [`BackendError::NvmlUnavailable`] where there is no driver.

use std::ffi::OsStr;
use std::sync::Mutex;
use std::time::Duration;

use gpuplace_core::topology::PcieLevel;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor, TopologyLevel};
use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};

use super::{
    normalize_bus_id, pair_links, BackendError, DriverMemoryLimits, GpuBackend, GpuEvent, GpuEventKind, GpuInfo,
    GpuProcess, GpuSample, Inventory, LaneEnd,
};

/// Lane indices to ask about: `NVML_NVLINK_MAX_LINKS` (18, Hopper's count) in current NVML headers.
const MAX_NVLINKS: u32 = 18;

/// NVML 615's `nvmlSetMemoryLimits_v1_t` (unversioned): the cgroup's full path under the cgroup v2
/// mount, and the soft and hard limits in bytes.
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
}

type SetMemoryLimitsFn = unsafe extern "C" fn(
    nvml_wrapper_sys::bindings::nvmlDevice_t,
    *mut SetMemoryLimitsV1,
) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

/// The real driver.
pub struct NvmlBackend {
    // NVML is initialised once and never shut down: the plugin lives as long as the process, and a
    // 'static handle lets the event set (which borrows it) live in the same struct
    nvml: &'static Nvml,
    /// Created on the first `wait_events`; `None` until then or when no GPU supports events.
    events: Mutex<Option<EventSet<'static>>>,
    events_ready: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

fn nvml_err(call: &'static str, gpu: Option<u32>) -> impl FnOnce(NvmlError) -> BackendError {
    move |e| match (e, gpu) {
        (NvmlError::GpuLost, Some(g)) => BackendError::GpuLost(g),
        (e, gpu) => BackendError::Nvml { call, gpu, message: e.to_string() },
    }
}

/// nvidia-smi's names for NVML's common-ancestor levels. `Internal` (two GPUs on one board, e.g. a
/// K80) is at least as close as one switch.
pub fn pcie_level(level: TopologyLevel) -> PcieLevel {
    match level {
        TopologyLevel::Internal | TopologyLevel::Single => PcieLevel::Pix,
        TopologyLevel::Multiple => PcieLevel::Pxb,
        TopologyLevel::HostBridge => PcieLevel::Phb,
        TopologyLevel::Node => PcieLevel::Node,
        TopologyLevel::System => PcieLevel::Sys,
    }
}

/// Why NVML could not start, worded for an operator.
pub fn describe_init_error(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(e) => format!("cannot load libnvidia-ml.so.1: {e}"),
        NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".into(),
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".into(),
        other => other.to_string(),
    }
}

impl NvmlBackend {
    /// Opens NVML; an error (never a panic) when the library or driver is missing.
    pub fn new() -> Result<Self, BackendError> {
        // the versioned name exists wherever the driver is installed; the unversioned one only with
        // development packages, which nvml-wrapper's default expects
        let nvml = Nvml::builder()
            .lib_path(OsStr::new("libnvidia-ml.so.1"))
            .init()
            .or_else(|_| Nvml::init())
            .map_err(|e| BackendError::NvmlUnavailable(describe_init_error(&e)))?;
        Ok(Self {
            nvml: Box::leak(Box::new(nvml)),
            events: Mutex::new(None),
            events_ready: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn device(&self, index: u32) -> Result<Device<'static>, BackendError> {
        self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex", Some(index)))
    }

    fn count(&self) -> Result<u32, BackendError> {
        self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount", None))
    }

    /// NUMA node from NVML, else from sysfs (older drivers lack nvmlDeviceGetNumaNodeId).
    fn numa_node(dev: &Device<'_>, bus_id: &str) -> Option<u32> {
        if let Ok(n) = dev.numa_node_id() {
            return Some(n);
        }
        let path = format!("/sys/bus/pci/devices/{bus_id}/numa_node");
        // -1 means the platform has no NUMA information
        std::fs::read_to_string(path).ok()?.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
    }

    /// Where each active NVLink lane of `dev` ends.
    fn lanes(dev: &Device<'_>, index: u32, gpu_buses: &[String]) -> Vec<(u32, LaneEnd)> {
        let mut out = Vec::new();
        for link in 0..MAX_NVLINKS {
            let l = dev.link_wrapper_for(link);
            if !matches!(l.is_active(), Ok(true)) {
                continue;
            }
            let remote_bus = l.remote_pci_info().ok().map(|p| normalize_bus_id(&p.bus_id));
            let end = match (l.remote_device_type(link), remote_bus) {
                (Ok(IntDeviceType::Switch), _) => LaneEnd::Switch,
                (_, Some(bus)) if gpu_buses.contains(&bus) => LaneEnd::Gpu(bus),
                (Ok(IntDeviceType::Gpu), Some(bus)) => LaneEnd::Gpu(bus),
                // drivers without the remote type call: on x86 the only non-GPU NVLink endpoint is an
                // NVSwitch (IBM NPUs exist only on POWER)
                (Err(_), Some(_)) if cfg!(not(target_arch = "powerpc64")) => LaneEnd::Switch,
                _ => LaneEnd::Other,
            };
            out.push((index, end));
        }
        out
    }

    fn open_events(&self) -> Option<EventSet<'static>> {
        let mut set = match self.nvml.create_event_set() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "NVML event set unavailable; health comes from sampling only");
                return None;
            }
        };
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        for i in 0..self.count().unwrap_or(0) {
            let Ok(dev) = self.device(i) else { continue };
            // registering an unsupported type fails and frees the set, so ask first
            let types = dev.supported_event_types().map(|s| s & wanted).unwrap_or(EventTypes::empty());
            if types.is_empty() {
                tracing::warn!(gpu = i, "GPU reports no XID/ECC events; its health comes from sampling only");
                continue;
            }
            set = match dev.register_events(types, set) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(gpu = i, error = %e.error, "registering NVML events failed; retrying without events");
                    return None;
                }
            };
        }
        Some(set)
    }

    /// Total framebuffer and the driver's reserve, MiB: `nvmlDeviceGetMemoryInfo_v2` (which
    /// nvml-wrapper's `memory_info` calls), else the v1 call with the reserve unknown (drivers
    /// before R510 lack v2).
    fn memory(&self, dev: &Device<'_>, i: u32) -> Result<(u64, Option<u64>), BackendError> {
        match dev.memory_info() {
            Ok(m) => Ok((m.total >> 20, Some(m.reserved >> 20))),
            Err(NvmlError::FunctionNotFound | NvmlError::NotSupported) => {
                let sym = self.nvml.lib().nvmlDeviceGetMemoryInfo.as_ref().map_err(|e| BackendError::Nvml {
                    call: "nvmlDeviceGetMemoryInfo",
                    gpu: Some(i),
                    message: e.to_string(),
                })?;
                let mut m = nvml_wrapper_sys::bindings::nvmlMemory_t { total: 0, free: 0, used: 0 };
                // SAFETY: the handle is live (NVML is never shut down) and `m` is the v1 struct the
                // v1 call writes
                let rc = unsafe { sym(dev.handle(), &mut m) };
                nvml_wrapper::error::nvml_try(rc).map_err(nvml_err("nvmlDeviceGetMemoryInfo", Some(i)))?;
                Ok((m.total >> 20, None))
            }
            Err(e) => Err(nvml_err("nvmlDeviceGetMemoryInfo_v2", Some(i))(e)),
        }
    }

    /// Asks every GPU for its UUID: the ones that fail with GPU_IS_LOST are reported lost.
    fn probe_lost(&self) -> Vec<GpuEvent> {
        (0..self.count().unwrap_or(0))
            .filter(|&i| {
                matches!(
                    self.device(i).and_then(|d| d.uuid().map_err(nvml_err("nvmlDeviceGetUUID", Some(i)))),
                    Err(BackendError::GpuLost(_))
                )
            })
            .map(|index| GpuEvent { index, kind: GpuEventKind::Lost })
            .collect()
    }
}

/// How far back per-process utilization samples are read: a few of the driver's sample periods.
const PROCESS_SAMPLE_WINDOW_US: u128 = 10_000_000;

impl GpuBackend for NvmlBackend {
    fn inventory(&self) -> Result<Inventory, BackendError> {
        let n = self.count()?;
        let mut gpus = Vec::with_capacity(n as usize);
        let mut devices = Vec::with_capacity(n as usize);
        for i in 0..n {
            let dev = self.device(i)?;
            let uuid = dev.uuid().map_err(nvml_err("nvmlDeviceGetUUID", Some(i)))?;
            let model = dev.name().map_err(nvml_err("nvmlDeviceGetName", Some(i)))?;
            let (total_mib, reserved_mib) = self.memory(&dev, i)?;
            let pci_bus_id =
                normalize_bus_id(&dev.pci_info().map_err(nvml_err("nvmlDeviceGetPciInfo", Some(i)))?.bus_id);
            let numa_node = Self::numa_node(&dev, &pci_bus_id);
            gpus.push(GpuInfo {
                index: i,
                uuid,
                model,
                // contexts are kept back later (`Inventory::reserve_contexts`), knowing the slots
                memory_mib: super::allocatable_mib(total_mib, reserved_mib, 0),
                total_mib,
                reserved_mib,
                context_reserve_mib: 0,
                numa_node,
                pci_bus_id,
                nvswitch_links: 0,
            });
            devices.push(dev);
        }
        let buses: Vec<String> = gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
        let lanes: Vec<(u32, LaneEnd)> =
            devices.iter().enumerate().flat_map(|(i, d)| Self::lanes(d, i as u32, &buses)).collect();
        let (fabric, links, switch) = pair_links(&buses, &lanes, |a, b| {
            let da = &devices[a as usize];
            // the call takes the peer by value, so it gets a handle of its own
            match self.device(b).and_then(|other| {
                da.topology_common_ancestor(other).map_err(nvml_err("nvmlDeviceGetTopologyCommonAncestor", Some(a)))
            }) {
                Ok(level) => pcie_level(level),
                Err(e) => {
                    // the safe guess: an unknown path scores as crossing sockets
                    tracing::warn!(a, b, error = %e, "no PCIe level; assuming SYS");
                    PcieLevel::Sys
                }
            }
        });
        for (g, s) in gpus.iter_mut().zip(switch) {
            g.nvswitch_links = s;
        }
        let inventory = Inventory {
            backend: "nvml".into(),
            name: gpus.first().map_or_else(|| "no GPUs".into(), |g| format!("{}x {}", n, g.model)),
            driver_version: self.nvml.sys_driver_version().ok(),
            nvlink_fabric: fabric,
            gpus,
            links,
        };
        inventory.validate()?;
        Ok(inventory)
    }

    fn sample(&self, index: u32) -> Result<GpuSample, BackendError> {
        let dev = self.device(index)?;
        let g = Some(index);
        let util = dev.utilization_rates().map_err(nvml_err("nvmlDeviceGetUtilizationRates", g))?;
        let mem = dev.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo", g))?;
        Ok(GpuSample {
            index,
            util_pct: util.gpu,
            mem_used_mib: mem.used >> 20,
            mem_free_mib: mem.free >> 20,
            temperature_c: dev.temperature(TemperatureSensor::Gpu).map_err(nvml_err("nvmlDeviceGetTemperature", g))?,
            // not every board reports power; 0 rather than failing the whole sample
            power_mw: dev.power_usage().unwrap_or(0),
            sm_clock_mhz: dev.clock_info(Clock::SM).map_err(nvml_err("nvmlDeviceGetClockInfo", g))?,
        })
    }

    fn processes(&self, index: u32) -> Result<Vec<GpuProcess>, BackendError> {
        let dev = self.device(index)?;
        let mut list =
            dev.running_compute_processes().map_err(nvml_err("nvmlDeviceGetComputeRunningProcesses", Some(index)))?;
        // MPS clients are listed apart on drivers that know MPS; older ones answer NotSupported
        match dev.mps_running_compute_processes() {
            Ok(mps) => list.extend(mps),
            Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => {}
            Err(e) => return Err(nvml_err("nvmlDeviceGetMPSComputeRunningProcesses", Some(index))(e)),
        }
        let mut out: Vec<GpuProcess> = Vec::with_capacity(list.len());
        for p in list {
            let used_mib = match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes >> 20),
                UsedGpuMemory::Unavailable => None,
            };
            match out.iter_mut().find(|o| o.pid == p.pid) {
                // one PID listed twice (compute and MPS): the larger reading
                Some(o) => o.used_mib = o.used_mib.max(used_mib),
                None => out.push(GpuProcess { pid: p.pid, used_mib, sm_pct: None }),
            }
        }
        // per-process SM use over the last seconds (the driver's sample buffer); none is not an error
        let since_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros().saturating_sub(PROCESS_SAMPLE_WINDOW_US) as u64)
            .unwrap_or(0);
        match dev.process_utilization_stats(since_us) {
            Ok(samples) => {
                let mut newest: std::collections::HashMap<u32, (u64, u32)> = std::collections::HashMap::new();
                for s in samples {
                    let e = newest.entry(s.pid).or_insert((0, 0));
                    if s.timestamp >= e.0 {
                        *e = (s.timestamp, s.sm_util.min(100));
                    }
                }
                for o in &mut out {
                    o.sm_pct = newest.get(&o.pid).map(|(_, u)| *u);
                }
            }
            Err(NvmlError::NotFound | NvmlError::NotSupported | NvmlError::FunctionNotFound) => {}
            Err(e) => tracing::debug!(gpu = index, error = %e, "nvmlDeviceGetProcessUtilization failed"),
        }
        Ok(out)
    }

    fn driver_memory_limits(&self) -> DriverMemoryLimits {
        // nvml-wrapper binds no NVML newer than its headers, so look the symbols up in the library
        // itself (already loaded: this only takes another reference)
        let has = |lib: &libloading::Library, name: &[u8]| {
            // SAFETY: only the symbol's presence is read; it is never called
            unsafe { lib.get::<unsafe extern "C" fn()>(name) }.is_ok()
        };
        // SAFETY: libnvidia-ml is already loaded and initialised by this process
        let (set, get) = match unsafe { libloading::Library::new("libnvidia-ml.so.1") } {
            Ok(lib) => (has(&lib, b"nvmlDeviceSetMemoryLimits_v1\0"), has(&lib, b"nvmlDeviceGetMemoryLimits_v1\0")),
            Err(_) => (false, false),
        };
        let cgroup_v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        DriverMemoryLimits::judge(self.nvml.sys_driver_version().ok().as_deref(), set, get, cgroup_v2)
    }

    fn set_memory_limit(
        &self,
        index: u32,
        cgroup: &std::path::Path,
        limit_mib: Option<u64>,
    ) -> Result<(), BackendError> {
        use std::os::unix::ffi::OsStrExt;
        const CALL: &str = "nvmlDeviceSetMemoryLimits_v1";
        let err = |message: String| BackendError::Nvml { call: CALL, gpu: Some(index), message };
        let dev = self.device(index)?;
        let path = std::ffi::CString::new(cgroup.as_os_str().as_bytes())
            .map_err(|_| err(format!("{}: a cgroup path with a NUL byte", cgroup.display())))?;
        // soft = hard: the whole grant is guaranteed and nothing above it is lent; no limit is
        // soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX
        let (soft, hard) = match limit_mib {
            Some(mib) => (mib << 20, mib << 20),
            None => (0, u64::MAX),
        };
        let mut limits = SetMemoryLimitsV1 { name_space: path.as_ptr(), soft_limit: soft, hard_limit: hard };
        // SAFETY: libnvidia-ml is already loaded and initialised by this process; this takes another
        // reference for as long as the call
        let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }.map_err(|e| err(e.to_string()))?;
        // SAFETY: the signature of NVML 615's nvmlDeviceSetMemoryLimits_v1
        let set = unsafe { lib.get::<SetMemoryLimitsFn>(b"nvmlDeviceSetMemoryLimits_v1\0") }
            .map_err(|e| err(format!("libnvidia-ml has no {CALL} ({e})")))?;
        // SAFETY: a live device handle and a struct whose path outlives the call
        let rc = unsafe { set(dev.handle(), &mut limits) };
        nvml_wrapper::error::nvml_try(rc).map_err(nvml_err(CALL, Some(index)))
    }

    fn wait_events(&self, timeout: Duration) -> Result<Vec<GpuEvent>, BackendError> {
        let mut guard = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if !self.events_ready.swap(true, std::sync::atomic::Ordering::Relaxed) {
            *guard = self.open_events();
        }
        let Some(set) = guard.as_ref() else {
            drop(guard);
            std::thread::sleep(timeout);
            return Ok(self.probe_lost());
        };
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match set.wait(ms) {
            Ok(data) => {
                let index = data.device.index().map_err(nvml_err("nvmlDeviceGetIndex", None))?;
                let kind = if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    match data.event_data {
                        Some(XidError::Value(x)) => GpuEventKind::Xid(x),
                        // an XID NVML cannot name is still an XID: treat as critical
                        _ => GpuEventKind::Xid(0),
                    }
                } else {
                    // a double-bit ECC error: XID 48 is how the driver reports the same thing
                    GpuEventKind::Xid(48)
                };
                Ok(vec![GpuEvent { index, kind }])
            }
            Err(NvmlError::Timeout) => Ok(Vec::new()),
            Err(NvmlError::GpuLost) => Ok(self.probe_lost()),
            Err(e) => Err(BackendError::Nvml { call: "nvmlEventSetWait", gpu: None, message: e.to_string() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_levels_map_to_nvidia_smi_names() {
        assert_eq!(pcie_level(TopologyLevel::Internal), PcieLevel::Pix);
        assert_eq!(pcie_level(TopologyLevel::Single), PcieLevel::Pix);
        assert_eq!(pcie_level(TopologyLevel::Multiple), PcieLevel::Pxb);
        assert_eq!(pcie_level(TopologyLevel::HostBridge), PcieLevel::Phb);
        assert_eq!(pcie_level(TopologyLevel::Node), PcieLevel::Node);
        assert_eq!(pcie_level(TopologyLevel::System), PcieLevel::Sys);
    }

    #[test]
    fn without_nvml_the_error_is_clear() {
        // CI and developer machines have no NVIDIA driver; on a GPU node this test checks discovery
        match NvmlBackend::new() {
            Err(e) => {
                let s = e.to_string();
                assert!(s.contains("NVML is not available") && s.contains("--fake-topology"), "{s}");
            }
            Ok(b) => {
                let inv = b.inventory().unwrap();
                assert!(inv.validate().is_ok());
            }
        }
    }
}
