//! A GPU node from a topology file (`shared/topologies` schema), for tests and demos without a GPU.
//!
//! Utilization is synthetic (a slow triangle wave, phase-shifted per GPU, so a demo shows movement)
//! until a script step or [`FakeBackend::set_reading`] fixes it. Temperature, power and SM clock follow
//! utilization unless a step fixes them too, so a script determines every field of a sample. Faults
//! are injected by script (`--fake-script FILE`) or by [`FakeBackend::inject`]:
//!
//! ```json
//! {"steps": [
//!   {"at_s": 0,  "gpu": 0, "util_pct": 90, "mem_used_mib": 40000},
//!   {"at_s": 0,  "gpu": 1, "temperature_c": 71, "power_w": 450, "sm_clock_mhz": 1755},
//!   {"at_s": 10, "gpu": 3, "fault": "fall_off_bus"},
//!   {"at_s": 20, "gpu": 5, "fault": {"xid_storm": {"xid": 48, "count": 100}}},
//!   {"at_s": 30, "gpu": 3, "fault": "recover"}
//! ]}
//! ```
//!
//! Per-process memory (what the guard reads) comes from [`FakeBackend::set_processes`] or from a file
//! re-read at every call (`--fake-processes FILE`), so a test can report the real PIDs of real
//! containers; PIDs that no longer exist are left out, as NVML lists only live processes:
//!
//! ```json
//! {"processes": [{"gpu": 0, "pid": 41234, "used_mib": 30000}]}
//! ```
//!
//! With a driver-limits file (`--fake-driver-limits FILE`) the fake driver has per-cgroup memory
//! limits (docs/isolation.md, `driver-limits`): each limit the plugin sets is written there, so a
//! test can read which cgroup got which cap:
//!
//! ```json
//! {"limits": [{"gpu": 0, "cgroup": "/sys/fs/cgroup/kubepods.slice/…/cri-containerd-<id>.scope", "limit_mib": 20992}]}
//! ```

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuplace_core::inventory::{load_topology_file, synthetic_uuid};
use gpuplace_core::topology::TopologyFile;
use serde::{Deserialize, Serialize};

use super::{BackendError, GpuBackend, GpuEvent, GpuEventKind, GpuInfo, GpuProcess, GpuSample, Inventory, PairLink};

/// A fault to inject into one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// The GPU stops answering: XID 79, a lost event, and every later sample fails.
    FallOffBus,
    /// `count` XID events with code `xid` at once.
    XidStorm { xid: u64, count: u32 },
    /// The GPU answers again.
    Recover,
}

/// One timed step of a script: set utilization, inject a fault, or both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptStep {
    /// Seconds after the backend was created.
    pub at_s: f64,
    pub gpu: u32,
    #[serde(default)]
    pub util_pct: Option<u32>,
    #[serde(default)]
    pub mem_used_mib: Option<u64>,
    #[serde(default)]
    pub temperature_c: Option<u32>,
    #[serde(default)]
    pub power_w: Option<u32>,
    #[serde(default)]
    pub sm_clock_mhz: Option<u32>,
    #[serde(default)]
    pub fault: Option<Fault>,
}

impl ScriptStep {
    fn reading(&self) -> FakeReading {
        FakeReading {
            util_pct: self.util_pct,
            mem_used_mib: self.mem_used_mib,
            temperature_c: self.temperature_c,
            power_w: self.power_w,
            sm_clock_mhz: self.sm_clock_mhz,
        }
    }
}

/// Fixed values for some fields of a GPU's samples; `None` leaves a field as it was.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeReading {
    pub util_pct: Option<u32>,
    pub mem_used_mib: Option<u64>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
}

impl FakeReading {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What is fixed of one GPU. Utilization and memory are fixed together (the wave drives both);
/// sensors left unfixed are derived from utilization.
#[derive(Debug, Clone, Copy, Default)]
struct Fixed {
    util: Option<(u32, u64)>,
    temperature_c: Option<u32>,
    power_w: Option<u32>,
    sm_clock_mhz: Option<u32>,
}

impl Fixed {
    fn merge(&mut self, r: &FakeReading) {
        if r.util_pct.is_some() || r.mem_used_mib.is_some() {
            let (u, m) = self.util.unwrap_or((0, 0));
            self.util = Some((r.util_pct.unwrap_or(u).min(100), r.mem_used_mib.unwrap_or(m)));
        }
        self.temperature_c = r.temperature_c.or(self.temperature_c);
        self.power_w = r.power_w.or(self.power_w);
        self.sm_clock_mhz = r.sm_clock_mhz.or(self.sm_clock_mhz);
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeScript {
    pub steps: Vec<ScriptStep>,
}

impl FakeScript {
    pub fn load(path: &Path) -> Result<Self, BackendError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| BackendError::Fake(format!("reading script {}: {e}", path.display())))?;
        serde_json::from_str(&text).map_err(|e| BackendError::Fake(format!("parsing script {}: {e}", path.display())))
    }
}

/// One line of a processes file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeProcess {
    pub gpu: u32,
    pub pid: u32,
    #[serde(default)]
    pub used_mib: Option<u64>,
    #[serde(default)]
    pub sm_pct: Option<u32>,
}

/// A processes file (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeProcesses {
    pub processes: Vec<FakeProcess>,
}

/// One memory limit the fake driver holds (`--fake-driver-limits FILE`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FakeLimit {
    pub gpu: u32,
    pub cgroup: PathBuf,
    pub limit_mib: u64,
}

/// The driver-limits file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FakeLimits {
    pub limits: Vec<FakeLimit>,
}

#[derive(Debug)]
struct FakeState {
    /// What is fixed per GPU; the rest follows the synthetic wave.
    fixed: Vec<Fixed>,
    lost: Vec<bool>,
    events: VecDeque<GpuEvent>,
    /// Script steps already applied (the script is sorted by time).
    applied: usize,
    /// Script time set by [`FakeBackend::advance_to`]; wall time since creation when `None`.
    clock: Option<Duration>,
    /// Set by [`FakeBackend::set_processes`], per GPU.
    processes: Vec<Vec<GpuProcess>>,
    /// The memory limits set, by GPU and cgroup.
    limits: std::collections::BTreeMap<(u32, PathBuf), u64>,
}

/// See the module docs.
#[derive(Debug)]
pub struct FakeBackend {
    inventory: Inventory,
    script: Vec<ScriptStep>,
    processes_file: Option<PathBuf>,
    limits_file: Option<PathBuf>,
    start: Instant,
    state: Mutex<FakeState>,
    wake: Condvar,
}

/// Period of the synthetic utilization wave.
const WAVE_PERIOD_S: f64 = 120.0;

impl FakeBackend {
    /// GPUs keep the file's UUIDs where it has them; otherwise they get deterministic ones derived
    /// from `uuid_seed` (the node name), so two fake nodes never share a UUID.
    pub fn from_topology(file: &TopologyFile, uuid_seed: &str) -> Result<Self, BackendError> {
        // the core's graph check refuses bad links before anything relies on them
        file.graph().map_err(|e| BackendError::Fake(format!("topology {}: {e}", file.name)))?;
        let mut gpus: Vec<GpuInfo> = file
            .gpus
            .iter()
            .map(|g| GpuInfo {
                index: g.index,
                uuid: g.uuid.clone().unwrap_or_else(|| synthetic_uuid(uuid_seed, g.index)),
                model: g.model.clone(),
                // a topology file's memory is the whole GPU, and the fake driver keeps none of it
                memory_mib: g.memory_mib,
                total_mib: g.memory_mib,
                reserved_mib: Some(0),
                context_reserve_mib: 0,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id.clone(),
                nvswitch_links: 0,
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        let fabric = file.nvlink_fabric;
        let mut links: Vec<PairLink> = file
            .links
            .iter()
            .map(|l| PairLink { a: l.a.min(l.b), b: l.a.max(l.b), nvlinks: l.nvlinks, pcie: l.pcie })
            .collect();
        links.sort_by_key(|l| (l.a, l.b));
        if fabric == gpuplace_core::topology::NvlinkFabric::Nvswitch {
            // NVML would report each GPU's lanes into the switch: the NV# it shares with its peers
            for g in &mut gpus {
                g.nvswitch_links =
                    links.iter().filter(|l| l.a == g.index || l.b == g.index).map(|l| l.nvlinks).max().unwrap_or(0);
            }
        }
        let n = gpus.len();
        let inventory = Inventory {
            backend: "fake".into(),
            name: file.name.clone(),
            driver_version: None,
            nvlink_fabric: fabric,
            gpus,
            links,
        };
        inventory.validate()?;
        Ok(Self {
            inventory,
            script: Vec::new(),
            processes_file: None,
            limits_file: None,
            start: Instant::now(),
            state: Mutex::new(FakeState {
                fixed: vec![Fixed::default(); n],
                lost: vec![false; n],
                events: VecDeque::new(),
                applied: 0,
                clock: None,
                processes: vec![Vec::new(); n],
                limits: Default::default(),
            }),
            wake: Condvar::new(),
        })
    }

    /// Loads a topology file.
    pub fn load(path: &Path, uuid_seed: &str) -> Result<Self, BackendError> {
        let file = load_topology_file(path).map_err(|e| BackendError::Fake(e.to_string()))?;
        Self::from_topology(&file, uuid_seed)
    }

    /// Adds a script; steps naming GPUs the node does not have are refused.
    pub fn with_script(mut self, mut script: FakeScript) -> Result<Self, BackendError> {
        let n = self.inventory.gpus.len() as u32;
        if let Some(s) = script.steps.iter().find(|s| s.gpu >= n || !s.at_s.is_finite() || s.at_s < 0.0) {
            return Err(BackendError::Fake(format!(
                "script step at {}s names GPU {} of {n} or a bad time",
                s.at_s, s.gpu
            )));
        }
        script.steps.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        self.script = script.steps;
        Ok(self)
    }

    /// Reports the processes of a file, read again at every call (a missing file lists none).
    pub fn with_processes_file(mut self, path: PathBuf) -> Self {
        self.processes_file = Some(path);
        self
    }

    /// A driver with per-cgroup memory limits, which it writes to `path` as they are set.
    pub fn with_driver_limits_file(mut self, path: PathBuf) -> Self {
        self.limits_file = Some(path);
        self
    }

    /// The memory limits set, by GPU and cgroup.
    pub fn memory_limits(&self) -> Vec<FakeLimit> {
        let st = self.lock();
        st.limits
            .iter()
            .map(|((gpu, cgroup), mib)| FakeLimit { gpu: *gpu, cgroup: cgroup.clone(), limit_mib: *mib })
            .collect()
    }

    /// Fixes the processes of one GPU (added to those of the processes file).
    pub fn set_processes(&self, index: u32, processes: Vec<GpuProcess>) -> Result<(), BackendError> {
        let i = self.check(index)?;
        self.lock().processes[i] = processes;
        Ok(())
    }

    fn file_processes(&self, index: u32) -> Result<Vec<GpuProcess>, BackendError> {
        let Some(path) = &self.processes_file else { return Ok(Vec::new()) };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(BackendError::Fake(format!("reading processes {}: {e}", path.display()))),
        };
        let file: FakeProcesses = serde_json::from_str(&text)
            .map_err(|e| BackendError::Fake(format!("parsing processes {}: {e}", path.display())))?;
        Ok(file
            .processes
            .into_iter()
            .filter(|p| p.gpu == index && Path::new(&format!("/proc/{}", p.pid)).exists())
            .map(|p| GpuProcess { pid: p.pid, used_mib: p.used_mib, sm_pct: p.sm_pct.map(|u| u.min(100)) })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        // a panic elsewhere while holding the lock leaves plain data behind; keep serving it
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, index: u32) -> Result<usize, BackendError> {
        let i = index as usize;
        if i < self.inventory.gpus.len() {
            Ok(i)
        } else {
            Err(BackendError::UnknownGpu(index))
        }
    }

    /// Fixes a GPU's utilization and memory use.
    pub fn set_utilization(&self, index: u32, util_pct: u32, mem_used_mib: u64) -> Result<(), BackendError> {
        self.set_reading(
            index,
            FakeReading { util_pct: Some(util_pct), mem_used_mib: Some(mem_used_mib), ..FakeReading::default() },
        )
    }

    /// Fixes some fields of a GPU's samples (what a script step does).
    pub fn set_reading(&self, index: u32, reading: FakeReading) -> Result<(), BackendError> {
        let i = self.check(index)?;
        self.lock().fixed[i].merge(&reading);
        Ok(())
    }

    /// Injects a fault now.
    pub fn inject(&self, index: u32, fault: Fault) -> Result<(), BackendError> {
        let i = self.check(index)?;
        let mut st = self.lock();
        Self::apply_fault(&mut st, i, fault);
        drop(st);
        self.wake.notify_all();
        Ok(())
    }

    /// Drives the script clock by hand (tests): applies every step due at `elapsed`.
    pub fn advance_to(&self, elapsed: Duration) {
        let mut st = self.lock();
        st.clock = Some(elapsed);
        self.apply_due(&mut st);
        drop(st);
        self.wake.notify_all();
    }

    fn apply_fault(st: &mut FakeState, i: usize, fault: Fault) {
        let index = i as u32;
        match fault {
            Fault::FallOffBus => {
                st.lost[i] = true;
                st.events.push_back(GpuEvent { index, kind: GpuEventKind::Xid(79) });
                st.events.push_back(GpuEvent { index, kind: GpuEventKind::Lost });
            }
            Fault::XidStorm { xid, count } => {
                st.events.extend((0..count).map(|_| GpuEvent { index, kind: GpuEventKind::Xid(xid) }));
            }
            Fault::Recover => {
                st.lost[i] = false;
                st.events.push_back(GpuEvent { index, kind: GpuEventKind::Recovered });
            }
        }
    }

    fn now(&self, st: &FakeState) -> Duration {
        st.clock.unwrap_or_else(|| self.start.elapsed())
    }

    fn apply_due(&self, st: &mut FakeState) {
        let now = self.now(st).as_secs_f64();
        while let Some(step) = self.script.get(st.applied).filter(|s| s.at_s <= now) {
            let i = step.gpu as usize;
            let reading = step.reading();
            if !reading.is_empty() {
                st.fixed[i].merge(&reading);
            }
            if let Some(f) = step.fault {
                Self::apply_fault(st, i, f);
            }
            st.applied += 1;
        }
    }
}

impl GpuBackend for FakeBackend {
    fn inventory(&self) -> Result<Inventory, BackendError> {
        Ok(self.inventory.clone())
    }

    fn driver_memory_limits(&self) -> super::DriverMemoryLimits {
        match &self.limits_file {
            Some(f) => super::DriverMemoryLimits {
                supported: true,
                detail: format!("fake driver: per-cgroup memory limits, written to {}", f.display()),
            },
            None => {
                super::DriverMemoryLimits::absent("fake driver: no per-cgroup memory limits (--fake-driver-limits)")
            }
        }
    }

    fn set_memory_limit(&self, index: u32, cgroup: &Path, limit_mib: Option<u64>) -> Result<(), BackendError> {
        let i = self.check(index)?;
        let Some(file) = &self.limits_file else {
            return Err(BackendError::Fake("no per-cgroup memory limits (--fake-driver-limits)".into()));
        };
        let mut st = self.lock();
        if st.lost[i] {
            return Err(BackendError::GpuLost(index));
        }
        // as the driver: a cgroup that does not exist cannot be limited
        if !cgroup.is_dir() {
            return Err(BackendError::Fake(format!("cgroup {} does not exist", cgroup.display())));
        }
        match limit_mib {
            Some(mib) => st.limits.insert((index, cgroup.to_path_buf()), mib),
            None => st.limits.remove(&(index, cgroup.to_path_buf())),
        };
        // as the driver: a removed cgroup took its limits with it
        st.limits.retain(|(_, cg), _| cg.is_dir());
        let all = FakeLimits {
            limits: st
                .limits
                .iter()
                .map(|((gpu, cgroup), mib)| FakeLimit { gpu: *gpu, cgroup: cgroup.clone(), limit_mib: *mib })
                .collect(),
        };
        let text = serde_json::to_string_pretty(&all).map_err(|e| BackendError::Fake(e.to_string()))?;
        // whole or not at all, for a reader polling the file
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, file))
            .map_err(|e| BackendError::Fake(format!("writing driver limits {}: {e}", file.display())))
    }

    fn sample(&self, index: u32) -> Result<GpuSample, BackendError> {
        let i = self.check(index)?;
        let mut st = self.lock();
        self.apply_due(&mut st);
        if st.lost[i] {
            return Err(BackendError::GpuLost(index));
        }
        let gpu = &self.inventory.gpus[i];
        let fixed = st.fixed[i];
        let (util_pct, mem_used_mib) = fixed.util.unwrap_or_else(|| {
            let n = self.inventory.gpus.len().max(1) as f64;
            let phase = (self.now(&st).as_secs_f64() / WAVE_PERIOD_S + i as f64 / n).fract();
            let tri = 1.0 - (2.0 * phase - 1.0).abs();
            let u = (tri * 100.0).round() as u32;
            (u, gpu.memory_mib * u64::from(u) / 200)
        });
        let mem_used_mib = mem_used_mib.min(gpu.memory_mib);
        Ok(GpuSample {
            index,
            util_pct,
            mem_used_mib,
            mem_free_mib: gpu.memory_mib - mem_used_mib,
            temperature_c: fixed.temperature_c.unwrap_or(30 + util_pct / 2),
            power_mw: fixed.power_w.map_or(60_000 + util_pct * 3_000, |w| w.saturating_mul(1000)),
            sm_clock_mhz: fixed.sm_clock_mhz.unwrap_or(if util_pct > 0 { 1_980 } else { 345 }),
        })
    }

    fn processes(&self, index: u32) -> Result<Vec<GpuProcess>, BackendError> {
        let i = self.check(index)?;
        let mut out = {
            let st = self.lock();
            if st.lost[i] {
                return Err(BackendError::GpuLost(index));
            }
            st.processes[i].clone()
        };
        for p in self.file_processes(index)? {
            if !out.iter().any(|o| o.pid == p.pid) {
                out.push(p);
            }
        }
        Ok(out)
    }

    fn wait_events(&self, timeout: Duration) -> Result<Vec<GpuEvent>, BackendError> {
        let mut st = self.lock();
        self.apply_due(&mut st);
        if st.events.is_empty() {
            // wake early for the next script step, so scripted faults arrive on time
            let next_step = self
                .script
                .get(st.applied)
                .map(|s| Duration::from_secs_f64(s.at_s).saturating_sub(self.now(&st)).max(Duration::from_millis(1)));
            let wait = next_step.map_or(timeout, |d| d.min(timeout));
            st = self.wake.wait_timeout(st, wait).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
            self.apply_due(&mut st);
        }
        Ok(st.events.drain(..).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo_path(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies").join(format!("{name}.json"))
    }

    fn h100() -> FakeBackend {
        FakeBackend::load(&topo_path("hgx-h100-8"), "node-a").unwrap()
    }

    #[test]
    fn inventory_from_topology_file() {
        let b = h100();
        let inv = b.inventory().unwrap();
        assert_eq!(inv.gpus.len(), 8);
        assert_eq!(inv.links.len(), 28);
        assert_eq!(inv.nvlink_fabric, gpuplace_core::topology::NvlinkFabric::Nvswitch);
        assert!(inv.gpus.iter().all(|g| g.nvswitch_links == 18 && g.uuid.starts_with("GPU-")));
        assert_eq!(inv.gpus[5].numa_node, Some(1));
        // another node name, other UUIDs
        let other = FakeBackend::load(&topo_path("hgx-h100-8"), "node-b").unwrap().inventory().unwrap();
        assert_ne!(other.gpus[0].uuid, inv.gpus[0].uuid);
        // the file round-trips through the topology schema
        assert_eq!(inv.topology().unwrap().pair_score(0, 1), 18 * 100 + 20);
    }

    #[test]
    fn processes_come_from_the_test_and_from_a_file_of_live_pids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("processes.json");
        let b = h100().with_processes_file(path.clone());
        // no file yet: none
        assert_eq!(b.processes(0).unwrap(), vec![]);
        let me = std::process::id();
        let dead = u32::MAX - 7; // above pid_max: never a live process
        std::fs::write(
            &path,
            format!(
                r#"{{"processes": [{{"gpu": 0, "pid": {me}, "used_mib": 30000}}, {{"gpu": 0, "pid": {dead}, "used_mib": 5}},
                   {{"gpu": 1, "pid": {me}, "sm_pct": 40}}]}}"#
            ),
        )
        .unwrap();
        assert_eq!(b.processes(0).unwrap(), vec![GpuProcess { pid: me, used_mib: Some(30000), sm_pct: None }]);
        assert_eq!(b.processes(1).unwrap(), vec![GpuProcess { pid: me, used_mib: None, sm_pct: Some(40) }]);
        b.set_processes(2, vec![GpuProcess { pid: 7, used_mib: Some(1), sm_pct: None }]).unwrap();
        assert_eq!(b.processes(2).unwrap(), vec![GpuProcess { pid: 7, used_mib: Some(1), sm_pct: None }]);
        // a file that does not parse is an error the caller sees, not an empty GPU
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(b.processes(0), Err(BackendError::Fake(m)) if m.contains("parsing processes")));
        b.inject(3, Fault::FallOffBus).unwrap();
        assert_eq!(b.processes(3), Err(BackendError::GpuLost(3)));
        assert_eq!(b.processes(9), Err(BackendError::UnknownGpu(9)));
    }

    #[test]
    fn faults_and_scripted_utilization() {
        let script: FakeScript = serde_json::from_str(
            r#"{"steps": [
                {"at_s": 0, "gpu": 1, "util_pct": 70, "mem_used_mib": 1000},
                {"at_s": 5, "gpu": 3, "fault": "fall_off_bus"},
                {"at_s": 6, "gpu": 4, "fault": {"xid_storm": {"xid": 48, "count": 50}}},
                {"at_s": 9, "gpu": 3, "fault": "recover"}
            ]}"#,
        )
        .unwrap();
        let b = h100().with_script(script).unwrap();
        b.advance_to(Duration::from_secs(1));
        let s = b.sample(1).unwrap();
        assert_eq!((s.util_pct, s.mem_used_mib), (70, 1000));
        assert!(b.wait_events(Duration::from_millis(1)).unwrap().is_empty());
        b.advance_to(Duration::from_secs(7));
        assert_eq!(b.sample(3), Err(BackendError::GpuLost(3)));
        let ev = b.wait_events(Duration::from_millis(1)).unwrap();
        assert_eq!(ev.len(), 2 + 50);
        assert_eq!(ev[1], GpuEvent { index: 3, kind: GpuEventKind::Lost });
        assert!(ev[2..].iter().all(|e| *e == GpuEvent { index: 4, kind: GpuEventKind::Xid(48) }));
        b.advance_to(Duration::from_secs(10));
        assert!(b.sample(3).is_ok());
        assert_eq!(
            b.wait_events(Duration::from_millis(1)).unwrap(),
            vec![GpuEvent { index: 3, kind: GpuEventKind::Recovered }]
        );
        assert_eq!(b.sample(8), Err(BackendError::UnknownGpu(8)));
    }

    #[test]
    fn scripts_fix_every_field_of_a_sample() {
        let script: FakeScript = serde_json::from_str(
            r#"{"steps": [
                {"at_s": 0, "gpu": 2, "util_pct": 40, "mem_used_mib": 30000},
                {"at_s": 1, "gpu": 2, "temperature_c": 71, "power_w": 450, "sm_clock_mhz": 1755},
                {"at_s": 2, "gpu": 2, "util_pct": 0}
            ]}"#,
        )
        .unwrap();
        let b = h100().with_script(script).unwrap();
        b.advance_to(Duration::from_millis(500));
        let s = b.sample(2).unwrap();
        // sensors follow utilization until fixed
        assert_eq!(
            s,
            GpuSample {
                index: 2,
                util_pct: 40,
                mem_used_mib: 30000,
                mem_free_mib: 81559 - 30000,
                temperature_c: 50,
                power_mw: 180_000,
                sm_clock_mhz: 1980
            }
        );
        b.advance_to(Duration::from_secs(2));
        let s = b.sample(2).unwrap();
        assert_eq!((s.util_pct, s.mem_used_mib), (0, 30000), "a step keeps the fields it does not name");
        assert_eq!((s.temperature_c, s.power_mw, s.sm_clock_mhz), (71, 450_000, 1755));
    }

    #[test]
    fn synthetic_wave_stays_in_range_and_bad_scripts_are_refused() {
        let b = h100();
        for t in [0, 17, 60, 119, 500] {
            b.advance_to(Duration::from_secs(t));
            for g in 0..8 {
                let s = b.sample(g).unwrap();
                assert!(s.util_pct <= 100 && s.mem_used_mib <= 81559, "{s:?}");
            }
        }
        let bad = FakeScript {
            steps: vec![ScriptStep {
                at_s: 0.0,
                gpu: 8,
                util_pct: Some(1),
                mem_used_mib: None,
                temperature_c: None,
                power_w: None,
                sm_clock_mhz: None,
                fault: None,
            }],
        };
        assert!(h100().with_script(bad).is_err());
        assert!(serde_json::from_str::<FakeScript>(r#"{"steps":[{"at_s":0,"gpu":0,"falt":"recover"}]}"#).is_err());
    }

    #[test]
    fn wait_wakes_on_injection() {
        let b = std::sync::Arc::new(h100());
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.wait_events(Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        b.inject(2, Fault::FallOffBus).unwrap();
        let ev = t.join().unwrap();
        assert_eq!(ev.len(), 2);
    }
}
