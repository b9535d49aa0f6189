//! The guard's loop: sample, attribute, decide ([`super::policy`]), act. Nothing here fails the
//! plugin: a GPU that does not answer is skipped for that sample, a process that exits before it is
//! stopped is simply gone, a failed Event or eviction is counted and logged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::cgroup::{container_of, ContainerOfProcess};
use super::policy::{Action, Guard, GuardConfig, Holder, Owner, Seen};
use super::{ContainerDirectory, Lookup};
use crate::nvml::{BackendError, GpuBackend};
use crate::sampler::Telemetry;

/// Where the guard's findings go beyond the log and `/metrics`: Events on the pods, and evictions.
pub trait GuardOutlet: Send + Sync {
    /// A Warning Event on the holder's pod (best effort).
    fn warn(&self, holder: &Holder, reason: &'static str, note: &str);
    /// Evicts the holder's pod through the Eviction API.
    fn evict<'a>(&'a self, holder: &'a Holder) -> BoxFuture<'a, Result<(), String>>;
}

/// Event reasons.
pub const REASON_MEMORY_OVER: &str = "GpuMemoryOverGrant";
pub const REASON_KILLED: &str = "GpuMemoryGuardKilled";
pub const REASON_EVICTED: &str = "GpuMemoryGuardEvicted";
pub const REASON_COMPUTE_OVER: &str = "GpuComputeOverShare";

/// Why a process could not be stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StopError {
    #[error("process {0} is gone")]
    Gone(u32),
    #[error("process {pid} is no longer in container {container_id}: its PID was reused")]
    Reused { pid: u32, container_id: String },
    #[error("stopping process {pid}: {message}")]
    Os { pid: u32, message: String },
}

/// SIGKILL to `pid` only while it is still in `expect`'s container: the PID is pinned with a pidfd
/// first, so a PID reused between the sample and the kill is never signalled.
pub fn stop_process(proc_root: &std::path::Path, pid: u32, expect: &ContainerOfProcess) -> Result<(), StopError> {
    let os = |e: std::io::Error| StopError::Os { pid, message: e.to_string() };
    let ipid = libc::pid_t::try_from(pid).map_err(|_| StopError::Gone(pid))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new file descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, ipid, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ESRCH) { StopError::Gone(pid) } else { os(e) });
    }
    let fd = fd as libc::c_int;
    let result = match container_of(proc_root, pid) {
        Some(c) if c == *expect => {
            // SAFETY: a pidfd we own, a signal number, no siginfo, no flags.
            let rc = unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, fd, libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0)
            };
            if rc == 0 {
                Ok(())
            } else {
                let e = std::io::Error::last_os_error();
                Err(if e.raw_os_error() == Some(libc::ESRCH) { StopError::Gone(pid) } else { os(e) })
            }
        }
        Some(_) | None if !proc_root.join(pid.to_string()).exists() => Err(StopError::Gone(pid)),
        _ => Err(StopError::Reused { pid, container_id: expect.container_id.clone() }),
    };
    // SAFETY: closing the descriptor pidfd_open returned, once.
    unsafe { libc::close(fd) };
    result
}

/// See the module docs.
pub struct GuardRunner {
    backend: Arc<dyn GpuBackend>,
    gpus: u32,
    directory: Arc<dyn ContainerDirectory>,
    outlet: Option<Arc<dyn GuardOutlet>>,
    telemetry: Arc<Telemetry>,
    guard: Guard,
    proc_root: PathBuf,
    /// GPUs whose last listing failed, so the failure is logged once per change.
    failing: HashSet<u32>,
    /// Processes not judged, with why, as logged: each is logged once while it is listed.
    unjudged: HashMap<u32, String>,
}

impl GuardRunner {
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        gpus: u32,
        directory: Arc<dyn ContainerDirectory>,
        telemetry: Arc<Telemetry>,
        cfg: GuardConfig,
    ) -> Self {
        telemetry.enable_guard();
        Self {
            backend,
            gpus,
            directory,
            outlet: None,
            telemetry,
            guard: Guard::new(cfg),
            proc_root: PathBuf::from("/proc"),
            failing: HashSet::new(),
            unjudged: HashMap::new(),
        }
    }

    pub fn with_outlet(mut self, outlet: Arc<dyn GuardOutlet>) -> Self {
        self.outlet = Some(outlet);
        self
    }

    /// Another `/proc` (tests).
    pub fn with_proc_root(mut self, root: PathBuf) -> Self {
        self.proc_root = root;
        self
    }

    /// Samples every `interval`, forever.
    pub async fn run(mut self, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.tick(Instant::now()).await;
        }
    }

    /// One sample and what it led to (returned for tests).
    pub async fn tick(&mut self, now: Instant) -> Vec<Action> {
        let (seen, util, owners) = self.observe();
        self.log_unjudged(&seen);
        let (actions, summary) = self.guard.step(now, &util, &seen);
        self.telemetry.guard_sampled(summary.over_memory, summary.unattributed, summary.unmeasured);
        for a in &actions {
            self.act(a, &owners).await;
        }
        actions
    }

    /// Every GPU's processes, attributed; each GPU's utilization; each attributed PID's container.
    #[allow(clippy::type_complexity)]
    fn observe(&mut self) -> (Vec<Seen>, BTreeMap<u32, u32>, HashMap<u32, ContainerOfProcess>) {
        let (mut seen, mut util, mut owners) = (Vec::new(), BTreeMap::new(), HashMap::new());
        for gpu in 0..self.gpus {
            let listed = match self.backend.processes(gpu) {
                Ok(l) => {
                    if self.failing.remove(&gpu) {
                        tracing::info!(gpu, "the guard lists this GPU's processes again");
                    }
                    l
                }
                Err(e) => {
                    if self.failing.insert(gpu) {
                        let lost = matches!(e, BackendError::GpuLost(_));
                        tracing::warn!(gpu, error = %e, lost, "the guard cannot list this GPU's processes; skipping it until it can");
                    }
                    continue;
                }
            };
            // the sampler's last sweep, at most one interval old: no second NVML reading per GPU
            if let Some(u) = self.telemetry.last_util(gpu) {
                util.insert(gpu, u);
            }
            for p in listed {
                let owner = match container_of(&self.proc_root, p.pid) {
                    None => Owner::Other(format!("process {} is in no pod's cgroup", p.pid)),
                    Some(c) => {
                        let owner = match self.directory.lookup(c.pod_uid.as_deref(), &c.container_id) {
                            Lookup::Granted { holder, grants } => {
                                Owner::Granted { grant: grants.get(&gpu).copied(), holder }
                            }
                            Lookup::NotGranted(why) => Owner::Other(why),
                            Lookup::Unknown => {
                                Owner::Other(format!("container {} is in no known pod (yet)", c.container_id))
                            }
                        };
                        owners.insert(p.pid, c);
                        owner
                    }
                };
                seen.push(Seen { gpu, pid: p.pid, used_mib: p.used_mib, sm_pct: p.sm_pct, owner });
            }
        }
        (seen, util, owners)
    }

    /// Says once per process why the guard does not judge it (no pod, no trusted grant), so an
    /// operator can tell a guarded GPU from one whose processes nobody holds to a grant.
    fn log_unjudged(&mut self, seen: &[Seen]) {
        let mut now: HashMap<u32, String> = HashMap::new();
        for s in seen {
            if let Owner::Other(why) = &s.owner {
                if self.unjudged.get(&s.pid) != Some(why) {
                    tracing::info!(pid = s.pid, gpu = s.gpu, used_mib = ?s.used_mib, why = %why, "the guard does not judge this process");
                }
                now.insert(s.pid, why.clone());
            }
        }
        self.unjudged = now;
    }

    fn warn(&self, holder: &Holder, reason: &'static str, note: &str) {
        if let Some(o) = &self.outlet {
            o.warn(holder, reason, note);
        }
    }

    async fn act(&self, action: &Action, owners: &HashMap<u32, ContainerOfProcess>) {
        let cfg = *self.guard.config();
        match action {
            Action::MemoryOver { holder, gpu, pids, used_mib, granted_mib, limit_mib, grace } => {
                self.telemetry.guard_action("memory_over");
                let then = match cfg.action {
                    super::OverrunAction::Kill => "its largest process on that GPU is killed",
                    super::OverrunAction::Evict => "the pod is evicted",
                };
                let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
                let note = format!(
                    "container {} holds {used_mib} MiB on GPU {gpu} (process {}), over its grant of {granted_mib} MiB \
                     ({limit_mib} MiB with {} MiB of CUDA context per process): unless it frees memory within {} s, {then}",
                    holder.container,
                    pids.join(", "),
                    cfg.context_overhead_mib,
                    grace.as_secs()
                );
                tracing::warn!(pod = %format!("{}/{}", holder.namespace, holder.pod), container = %holder.container, gpu, used_mib, limit_mib, "GPU memory over the grant");
                self.warn(holder, REASON_MEMORY_OVER, &note);
            }
            Action::Kill { holder, gpu, pid, used_mib, limit_mib } => {
                let Some(expect) = owners.get(pid) else { return };
                match stop_process(&self.proc_root, *pid, expect) {
                    Ok(()) => {
                        self.telemetry.guard_action("killed");
                        let note = format!(
                            "killed process {pid} of container {} holding {used_mib} MiB on GPU {gpu}: the container stayed over its limit of {limit_mib} MiB for {} s",
                            holder.container,
                            cfg.grace.as_secs()
                        );
                        tracing::warn!(%holder, pid, gpu, used_mib, limit_mib, "killed a process over its GPU memory grant");
                        self.warn(holder, REASON_KILLED, &note);
                    }
                    Err(StopError::Gone(_)) => {
                        tracing::info!(%holder, pid, "the process over its grant exited by itself")
                    }
                    Err(e) => {
                        self.telemetry.guard_action("stop_failed");
                        tracing::error!(%holder, pid, error = %e, "could not stop a process over its GPU memory grant");
                    }
                }
            }
            Action::Evict { holder, gpu, used_mib, limit_mib } => {
                let Some(o) = &self.outlet else {
                    self.telemetry.guard_action("stop_failed");
                    tracing::error!(%holder, "the guard's policy is evict, and it has no API server to evict with");
                    return;
                };
                match o.evict(holder).await {
                    Ok(()) => {
                        self.telemetry.guard_action("evicted");
                        let note = format!(
                            "evicted: container {} held {used_mib} MiB on GPU {gpu}, over its limit of {limit_mib} MiB for {} s",
                            holder.container,
                            cfg.grace.as_secs()
                        );
                        tracing::warn!(%holder, gpu, used_mib, limit_mib, "evicted a pod over its GPU memory grant");
                        self.warn(holder, REASON_EVICTED, &note);
                    }
                    Err(e) => {
                        self.telemetry.guard_action("stop_failed");
                        tracing::error!(%holder, error = %e, "could not evict a pod over its GPU memory grant");
                    }
                }
            }
            Action::MemoryBack { holder, gpu } => {
                tracing::info!(%holder, gpu, "back within its GPU memory grant; nothing stopped");
            }
            Action::ComputeOver { holder, gpu, sm_pct, core_pct, starved } => {
                self.telemetry.guard_action("compute_over");
                let names: Vec<String> = starved.iter().map(|h| format!("{}/{}", h.namespace, h.pod)).collect();
                let note = format!(
                    "container {} used {sm_pct} percent of GPU {gpu}'s SMs for {} samples, over its share of {core_pct} percent, \
                     while {} got less than theirs",
                    holder.container,
                    cfg.compute_samples,
                    names.join(", ")
                );
                tracing::warn!(%holder, gpu, sm_pct, core_pct, starved = ?names, "GPU compute over the share while a neighbour starves");
                self.warn(holder, REASON_COMPUTE_OVER, &note);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::policy::Grant;
    use crate::nvml::fake::FakeBackend;
    use crate::nvml::GpuProcess;
    use std::path::Path;
    use std::process::{Child, Command};
    use std::sync::Mutex;

    const UID_A: &str = "0f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";
    const UID_B: &str = "1f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b";

    fn cid(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    /// A `/proc` whose `<pid>/cgroup` files put real child processes in made-up containers (the
    /// processes are real so that the kill really happens).
    struct Procs {
        dir: tempfile::TempDir,
        children: Vec<Child>,
    }

    impl Procs {
        fn new() -> Self {
            Self { dir: tempfile::tempdir().unwrap(), children: Vec::new() }
        }
        fn spawn(&mut self, uid: &str, cid: &str) -> u32 {
            let child = Command::new("sleep").arg("600").spawn().unwrap();
            let pid = child.id();
            let d = self.dir.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cgroup"), format!("0::/kubepods/besteffort/pod{uid}/{cid}\n")).unwrap();
            self.children.push(child);
            pid
        }
        fn exited(&mut self, pid: u32) -> bool {
            let c = self.children.iter_mut().find(|c| c.id() == pid).unwrap();
            for _ in 0..100 {
                if c.try_wait().unwrap().is_some() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        }
    }

    impl Drop for Procs {
        fn drop(&mut self) {
            for c in &mut self.children {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    struct Directory;
    impl ContainerDirectory for Directory {
        fn lookup(&self, pod_uid: Option<&str>, container_id: &str) -> Lookup {
            let (pod, mem) = match pod_uid {
                Some(UID_A) => ("small", 20_480),
                Some(UID_B) => ("big", 40_960),
                _ => return Lookup::Unknown,
            };
            let pod_uid = pod_uid.unwrap_or_default();
            let holder = Holder {
                namespace: "ml".into(),
                pod: pod.into(),
                pod_uid: pod_uid.into(),
                container: "main".into(),
                container_id: container_id.into(),
            };
            Lookup::Granted {
                holder,
                grants: BTreeMap::from([(0, Grant { mem_mib: mem, core_pct: 30, exclusive: false })]),
            }
        }
    }

    #[derive(Default)]
    struct Recorder(Mutex<Vec<(String, &'static str)>>);
    impl GuardOutlet for Recorder {
        fn warn(&self, holder: &Holder, reason: &'static str, _note: &str) {
            self.0.lock().unwrap().push((holder.pod.clone(), reason));
        }
        fn evict<'a>(&'a self, holder: &'a Holder) -> BoxFuture<'a, Result<(), String>> {
            self.0.lock().unwrap().push((holder.pod.clone(), "evict"));
            Box::pin(async { Ok(()) })
        }
    }

    fn topo() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/hgx-h100-8.json")
    }

    #[tokio::test]
    async fn the_offender_is_killed_after_the_grace_and_its_neighbour_is_untouched() {
        let mut procs = Procs::new();
        let small = procs.spawn(UID_A, &cid('a'));
        let big = procs.spawn(UID_B, &cid('b'));
        let fake = Arc::new(FakeBackend::load(&topo(), "n").unwrap());
        fake.set_processes(
            0,
            vec![
                GpuProcess { pid: small, used_mib: Some(30_720), sm_pct: None },
                GpuProcess { pid: big, used_mib: Some(40_960), sm_pct: None },
            ],
        )
        .unwrap();
        let telemetry = Telemetry::new(8, false);
        let outlet = Arc::new(Recorder::default());
        let cfg = GuardConfig { grace: Duration::from_secs(10), context_overhead_mib: 512, ..GuardConfig::default() };
        let mut runner = GuardRunner::new(fake.clone(), 8, Arc::new(Directory), telemetry.clone(), cfg)
            .with_outlet(outlet.clone())
            .with_proc_root(procs.dir.path().to_path_buf());
        let t0 = Instant::now();
        let a = runner.tick(t0).await;
        assert!(matches!(a[..], [Action::MemoryOver { .. }]), "{a:?}");
        assert_eq!(telemetry.snapshot().guard.unwrap().over_memory, 1);
        runner.tick(t0 + Duration::from_secs(5)).await;
        let a = runner.tick(t0 + Duration::from_secs(10)).await;
        assert!(matches!(a[..], [Action::Kill { pid, .. }] if pid == small), "{a:?}");
        assert!(procs.exited(small), "the offender still runs");
        assert!(!procs.exited(big), "the neighbour was stopped");
        assert_eq!(
            *outlet.0.lock().unwrap(),
            vec![("small".to_string(), REASON_MEMORY_OVER), ("small".to_string(), REASON_KILLED)]
        );
        let g = telemetry.snapshot().guard.unwrap();
        assert_eq!((g.actions.get("memory_over"), g.actions.get("killed")), (Some(&1), Some(&1)));
        // the fake still lists it: the next tick finds it gone and stops nothing else
        fake.set_processes(0, vec![GpuProcess { pid: big, used_mib: Some(40_960), sm_pct: None }]).unwrap();
        let a = runner.tick(t0 + Duration::from_secs(15)).await;
        assert!(a.is_empty(), "{a:?}");
        assert_eq!(telemetry.snapshot().guard.unwrap().over_memory, 0);
    }

    /// Compute is judged on the sampler's last sweep: no sweep, no verdict; a busy GPU where the
    /// small share runs far over its 30 percent while the big one gets less than its own 30 is
    /// reported after `compute_samples` samples.
    #[tokio::test]
    async fn compute_is_judged_on_the_samplers_last_utilization() {
        let mut procs = Procs::new();
        let small = procs.spawn(UID_A, &cid('a'));
        let big = procs.spawn(UID_B, &cid('b'));
        let fake = Arc::new(FakeBackend::load(&topo(), "n").unwrap());
        fake.set_processes(
            0,
            vec![
                GpuProcess { pid: small, used_mib: Some(1_000), sm_pct: Some(90) },
                GpuProcess { pid: big, used_mib: Some(1_000), sm_pct: Some(5) },
            ],
        )
        .unwrap();
        let telemetry = Telemetry::new(8, false);
        let outlet = Arc::new(Recorder::default());
        let cfg = GuardConfig::default();
        let mut runner = GuardRunner::new(fake.clone(), 8, Arc::new(Directory), telemetry.clone(), cfg)
            .with_outlet(outlet.clone())
            .with_proc_root(procs.dir.path().to_path_buf());
        let t0 = Instant::now();
        for i in 0..cfg.compute_samples + 1 {
            let a = runner.tick(t0 + Duration::from_secs(u64::from(i))).await;
            assert!(a.is_empty(), "no sweep yet, so no utilization to judge by: {a:?}");
        }
        let busy = crate::nvml::GpuSample { util_pct: 100, ..fake.sample(0).unwrap() };
        let mut sweep = vec![None; 8];
        sweep[0] = Some(busy);
        telemetry.record_samples(sweep);
        let mut said = Vec::new();
        for i in 0..cfg.compute_samples {
            said.extend(runner.tick(t0 + Duration::from_secs(10 + u64::from(i))).await);
        }
        assert!(
            said.iter().any(|a| matches!(a, Action::ComputeOver { holder, .. } if holder.pod == "small")),
            "{said:?}"
        );
    }

    #[tokio::test]
    async fn a_reused_pid_or_a_process_outside_pods_is_never_killed() {
        let mut procs = Procs::new();
        let pid = procs.spawn(UID_A, &cid('a'));
        let root = procs.dir.path().to_path_buf();
        let other = ContainerOfProcess { pod_uid: Some(UID_A.into()), container_id: cid('c') };
        assert_eq!(stop_process(&root, pid, &other), Err(StopError::Reused { pid, container_id: cid('c') }));
        assert!(!procs.exited(pid));
        assert_eq!(
            stop_process(&root, u32::MAX - 7, &other),
            Err(StopError::Gone(u32::MAX - 7)),
            "a PID above pid_max"
        );
        // a process in no pod's cgroup is counted, never judged
        let fake = Arc::new(FakeBackend::load(&topo(), "n").unwrap());
        let me = std::process::id();
        fake.set_processes(0, vec![GpuProcess { pid: me, used_mib: Some(80_000), sm_pct: None }]).unwrap();
        let telemetry = Telemetry::new(8, false);
        let cfg = GuardConfig { grace: Duration::ZERO, ..GuardConfig::default() };
        let mut runner = GuardRunner::new(fake, 8, Arc::new(Directory), telemetry.clone(), cfg).with_proc_root(root);
        for _ in 0..2 {
            assert!(runner.tick(Instant::now()).await.is_empty());
        }
        assert_eq!(telemetry.snapshot().guard.unwrap().unattributed, 1);
    }
}
