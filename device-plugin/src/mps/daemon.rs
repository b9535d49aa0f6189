//! The I/O of managed MPS: the control daemon's process, its client commands, and the loop that
//! supervises it ([`super::supervise`] decides), applies the server-side limits ([`super::limits`])
//! and reads its log ([`super::log`]). Nothing here fails the plugin: a missing binary or a daemon
//! that will not start is logged, counted and reported down through [`MpsHandle`], and shares run
//! with their client limits alone until it comes up.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::command::{check_silent, parse_server_list, script, AnswerError, Command};
use super::limits::{server_limits, Applied, DaemonGpu, ShareSlice};
use super::log::{LogEvent, LogState};
use super::supervise::{Action, Backoff, Seen, Supervisor};
use super::MpsLayout;

/// The control daemon's pid file in its pipe directory (written by `-d`).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// How managed MPS runs.
#[derive(Debug, Clone)]
pub struct MpsConfig {
    pub layout: MpsLayout,
    /// `nvidia-cuda-mps-control`, or a path to it.
    pub control_binary: PathBuf,
    /// How often the daemon is asked `get_server_list` (and the log read, the limits checked).
    pub health_interval: Duration,
    /// A client command (or the daemon's `-d` start) that takes longer is killed and counts as
    /// failed: a hung daemon is a dead one.
    pub command_timeout: Duration,
    pub backoff: Backoff,
}

impl MpsConfig {
    pub fn new(root: impl Into<PathBuf>, control_binary: impl Into<PathBuf>) -> Self {
        Self {
            layout: MpsLayout::new(root),
            control_binary: control_binary.into(),
            health_interval: Duration::from_secs(5),
            command_timeout: Duration::from_secs(5),
            backoff: Backoff::default(),
        }
    }
}

/// Why a daemon operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("the MPS control binary {binary} cannot be run: {source} (is the driver's compute capability in NVIDIA_DRIVER_CAPABILITIES?)")]
    Spawn { binary: String, source: std::io::Error },
    #[error("the MPS directories under {root}: {source}")]
    Dirs { root: String, source: std::io::Error },
    #[error("`{what}` took longer than {timeout:?} and was killed")]
    Timeout { what: String, timeout: Duration },
    #[error("`{what}` exited with {status}: {stderr}")]
    Failed { what: String, status: String, stderr: String },
    #[error(transparent)]
    Answer(#[from] AnswerError),
}

/// What the plugin knows of the shares, for the daemon's GPUs and limits.
pub trait ShareSource: Send + Sync {
    /// Every share held now, one entry per (container, GPU).
    fn shares(&self) -> Vec<ShareSlice>;
    /// The GPUs that can serve shares now (healthy ones), by node index.
    fn serving(&self) -> Vec<u32>;
    /// Bumped when the shares change, so limits follow at once rather than at the next check.
    fn changes(&self) -> Option<watch::Receiver<u64>> {
        None
    }
}

/// Told when a fault ended every client of a server (an Event on each pod with a share then).
pub trait FaultReporter: Send + Sync {
    fn server_fault(&self, pods: &[String], detail: &str);
}

/// Called with every new status (the metrics' copy).
pub type StatusHook = Box<dyn Fn(&MpsStatus) + Send + Sync>;

/// Managed MPS as the rest of the plugin sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MpsStatus {
    /// The daemon answered its last health check.
    pub up: bool,
    /// The GPUs (node indices) the running daemon serves.
    pub gpus: Vec<u32>,
    /// Its running servers' PIDs.
    pub servers: Vec<u32>,
    /// Starts after the first (the daemon died, hung, or its GPUs changed).
    pub restarts: u64,
    /// Faults that ended every client of a server.
    pub server_faults: u64,
    /// Clients that connected while another user's server ran (and so waited).
    pub uid_conflicts: u64,
    /// Such clients still waiting.
    pub clients_waiting: u64,
    /// Limit commands the daemon refused or did not answer.
    pub limit_errors: u64,
    /// Why it is down, when it is.
    pub last_error: Option<String>,
}

/// The handle main.rs and the isolation mode ask: is MPS up, and what does it serve.
#[derive(Debug)]
pub struct MpsHandle {
    cfg: MpsConfig,
    status: watch::Sender<MpsStatus>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl MpsHandle {
    /// Whether the daemon answered its last health check: MPS isolation is available.
    pub fn is_running(&self) -> bool {
        self.status.borrow().up
    }

    pub fn status(&self) -> MpsStatus {
        self.status.borrow().clone()
    }

    /// Every change of the status (the daemon coming up or going down among them).
    pub fn subscribe(&self) -> watch::Receiver<MpsStatus> {
        self.status.subscribe()
    }

    pub fn config(&self) -> &MpsConfig {
        &self.cfg
    }

    /// Stops supervising and tells the daemon to `quit`; returns once it has been told.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }
}

/// One GPU of the node, as the daemon needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGpu {
    pub index: u32,
    pub uuid: String,
    pub memory_mib: u64,
}

/// Starts supervising (inside a tokio runtime): the daemon is started at once when a GPU serves
/// shares. `on_status` is called with every new status (metrics).
pub fn start(
    cfg: MpsConfig,
    gpus: Vec<NodeGpu>,
    source: Arc<dyn ShareSource>,
    reporter: Option<Arc<dyn FaultReporter>>,
    on_status: Option<StatusHook>,
) -> Arc<MpsHandle> {
    let handle = Arc::new(MpsHandle {
        cfg: cfg.clone(),
        status: watch::Sender::new(MpsStatus::default()),
        stop: watch::Sender::new(false),
        task: Mutex::new(None),
    });
    let backoff = cfg.backoff;
    let looped = Loop {
        cfg,
        gpus,
        source,
        reporter,
        on_status,
        handle: handle.clone(),
        sup: Supervisor::new(backoff),
        applied: Applied::default(),
        log: LogState::default(),
        log_offset: 0,
        started: None,
        status: MpsStatus::default(),
    };
    let task = tokio::spawn(looped.run());
    *handle.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    handle
}

/// Runs `nvidia-cuda-mps-control` with `args` and `stdin`, in the daemon's environment, killing it
/// past `timeout`. Its stdout when it exits 0. Blocking.
fn control(cfg: &MpsConfig, args: &[&str], stdin: &str, what: &str) -> Result<String, MpsError> {
    let mut child = Process::new(&cfg.control_binary)
        .args(args)
        .env("CUDA_MPS_PIPE_DIRECTORY", cfg.layout.pipe_dir())
        .env("CUDA_MPS_LOG_DIRECTORY", cfg.layout.log_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| MpsError::Spawn { binary: cfg.control_binary.display().to_string(), source })?;
    wait(&mut child, stdin, cfg.command_timeout, what)
}

/// Waits for `child`, at most `timeout` (then it is killed).
fn wait_status(
    child: &mut std::process::Child,
    timeout: Duration,
    what: &str,
) -> Result<std::process::ExitStatus, MpsError> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Ok(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MpsError::Timeout { what: what.into(), timeout });
            }
        }
    }
}

/// Feeds `stdin` to `child` and waits for it, at most `timeout`; its stdout when it exits 0.
fn wait(child: &mut std::process::Child, stdin: &str, timeout: Duration, what: &str) -> Result<String, MpsError> {
    if let Some(mut input) = child.stdin.take() {
        // a client that exits without reading is judged by its status below
        let _ = input.write_all(stdin.as_bytes());
    }
    // read on threads so a chatty client never blocks on a full pipe while we wait for it
    fn reader<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    }
    let out_t = reader(child.stdout.take());
    let err_t = reader(child.stderr.take());
    let status = wait_status(child, timeout, what)?;
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    if status.success() {
        Ok(stdout)
    } else {
        let text = if stderr.trim().is_empty() { stdout } else { stderr };
        Err(MpsError::Failed { what: what.into(), status: status.to_string(), stderr: text.trim().to_string() })
    }
}

/// Runs `commands` through one client, blocking (off the runtime's threads).
async fn send(cfg: &MpsConfig, commands: Vec<Command>) -> Result<String, MpsError> {
    let cfg = cfg.clone();
    let what = commands.first().map(ToString::to_string).unwrap_or_default();
    tokio::task::spawn_blocking(move || control(&cfg, &[], &script(&commands), &what)).await.unwrap_or_else(|e| {
        Err(MpsError::Failed { what: "control client".into(), status: e.to_string(), stderr: String::new() })
    })
}

/// Starts the daemon (`-d`: it forks and the command returns) for `gpus`, blocking. Its output
/// goes to a file rather than a pipe: the forked daemon may keep what it inherited open.
fn start_daemon(cfg: &MpsConfig, gpus: &[&NodeGpu]) -> Result<(), MpsError> {
    let dirs = |source| MpsError::Dirs { root: cfg.layout.root.display().to_string(), source };
    cfg.layout.create().map_err(dirs)?;
    let out_path = cfg.layout.log_dir().join("gpuplace-start.log");
    let out = std::fs::File::create(&out_path).map_err(dirs)?;
    let err = out.try_clone().map_err(dirs)?;
    let visible = gpus.iter().map(|g| g.uuid.as_str()).collect::<Vec<_>>().join(",");
    let mut child = Process::new(&cfg.control_binary)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", cfg.layout.pipe_dir())
        .env("CUDA_MPS_LOG_DIRECTORY", cfg.layout.log_dir())
        // the daemon's ordinals are its GPUs in PCI order, which is the node's index order: the
        // limit commands' device numbers are positions in `gpus`
        .env("CUDA_VISIBLE_DEVICES", &visible)
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|source| MpsError::Spawn { binary: cfg.control_binary.display().to_string(), source })?;
    let what = "nvidia-cuda-mps-control -d";
    let status = wait_status(&mut child, cfg.command_timeout, what)?;
    if status.success() {
        return Ok(());
    }
    let said = std::fs::read_to_string(&out_path).unwrap_or_default();
    Err(MpsError::Failed { what: what.into(), status: status.to_string(), stderr: said.trim().to_string() })
}

/// The daemon's PID from its pid file.
fn daemon_pid(layout: &MpsLayout) -> Option<i32> {
    std::fs::read_to_string(layout.pipe_dir().join(PID_FILE)).ok()?.trim().parse().ok()
}

/// Collects a dead daemon when it was reparented to this process (the plugin is its container's
/// PID 1), so dead daemons do not stay as zombies.
fn reap(layout: &MpsLayout) {
    if let Some(pid) = daemon_pid(layout).filter(|&p| p > 0) {
        let mut status = 0;
        // SAFETY: waitpid on one PID with WNOHANG only reads its exit status if it is our child.
        unsafe {
            libc::waitpid(pid, &mut status, libc::WNOHANG);
        }
    }
}

/// The bytes of `path` past `offset` (all of it when it shrank: a new daemon's log).
fn read_from(path: &Path, offset: &mut u64) -> Option<(String, bool)> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let restarted = len < *offset;
    if restarted {
        *offset = 0;
    }
    f.seek(SeekFrom::Start(*offset)).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    *offset += buf.len() as u64;
    Some((String::from_utf8_lossy(&buf).into_owned(), restarted))
}

struct Loop {
    cfg: MpsConfig,
    gpus: Vec<NodeGpu>,
    source: Arc<dyn ShareSource>,
    reporter: Option<Arc<dyn FaultReporter>>,
    on_status: Option<StatusHook>,
    handle: Arc<MpsHandle>,
    sup: Supervisor,
    applied: Applied,
    log: LogState,
    log_offset: u64,
    /// The GPUs of the daemon this loop started (and has not told to quit).
    started: Option<Vec<u32>>,
    status: MpsStatus,
}

impl Loop {
    async fn run(mut self) {
        let mut stop = self.handle.stop.subscribe();
        let mut changes = self.source.changes();
        // the daemon's log of an earlier run of the plugin is history: only what follows counts
        self.log_offset = std::fs::metadata(self.control_log()).map(|m| m.len()).unwrap_or(0);
        loop {
            self.tick().await;
            let changed = async {
                match changes.as_mut() {
                    Some(rx) => {
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.health_interval) => {}
                _ = changed => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        if self.started.is_some() {
            match send(&self.cfg, vec![Command::Quit]).await {
                Ok(_) => tracing::info!("MPS control daemon told to quit"),
                Err(e) => tracing::warn!(error = %e, "telling the MPS control daemon to quit failed"),
            }
            self.sup.stopped();
            self.started = None;
        }
        self.status.up = false;
        self.status.servers.clear();
        self.publish();
    }

    fn control_log(&self) -> PathBuf {
        self.cfg.layout.log_dir().join("control.log")
    }

    /// `get_server_list`, as the supervisor sees it.
    async fn check(&mut self) -> Seen {
        if self.started.is_none() {
            return Seen::NotRunning;
        }
        match send(&self.cfg, vec![Command::GetServerList]).await.and_then(|o| Ok(parse_server_list(&o)?)) {
            Ok(servers) => Seen::Up { servers },
            Err(e) => {
                if self.status.up {
                    tracing::warn!(error = %e, "the MPS control daemon does not answer");
                }
                self.status.last_error = Some(e.to_string());
                Seen::Down
            }
        }
    }

    async fn tick(&mut self) {
        let mut want = self.source.serving();
        want.retain(|i| self.gpus.iter().any(|g| g.index == *i));
        want.sort_unstable();
        want.dedup();
        let mut seen = self.check().await;
        let was_deferred = self.sup.deferred();
        match self.sup.decide(Instant::now(), &want, &seen) {
            Action::Nothing => {}
            Action::Quit => {
                self.quit("no GPU serves shares").await;
                seen = Seen::NotRunning;
            }
            Action::Replace { gpus } => {
                self.quit("the GPUs that serve shares changed").await;
                self.status.restarts += 1;
                seen = self.launch(&gpus).await;
            }
            Action::Start { gpus, restart } => {
                if restart {
                    self.status.restarts += 1;
                    tracing::warn!(gpus = ?gpus, restarts = self.status.restarts, "restarting the MPS control daemon");
                    reap(&self.cfg.layout);
                }
                seen = self.launch(&gpus).await;
            }
        }
        if self.sup.deferred() && !was_deferred {
            tracing::info!(want = ?want, running = ?self.started, "the GPUs that serve shares changed; the MPS daemon is restarted for them once its servers end");
        }
        match seen {
            Seen::Up { servers } => {
                if !self.status.up {
                    tracing::info!(gpus = ?self.started, "MPS control daemon up");
                }
                self.status.up = true;
                self.status.last_error = None;
                self.apply_limits(&servers).await;
                self.status.servers = servers;
            }
            Seen::Down | Seen::NotRunning => {
                self.status.up = false;
                self.status.servers.clear();
            }
        }
        self.status.gpus = self.started.clone().unwrap_or_default();
        self.read_log();
        self.publish();
    }

    /// Starts the daemon for `gpus` and waits briefly for it to answer.
    async fn launch(&mut self, gpus: &[u32]) -> Seen {
        let chosen: Vec<NodeGpu> = self.gpus.iter().filter(|g| gpus.contains(&g.index)).cloned().collect();
        let cfg = self.cfg.clone();
        let started = tokio::task::spawn_blocking(move || start_daemon(&cfg, &chosen.iter().collect::<Vec<_>>()))
            .await
            .unwrap_or_else(|e| {
                Err(MpsError::Failed { what: "start".into(), status: e.to_string(), stderr: String::new() })
            });
        // a new daemon: its servers, limits and log are new
        self.applied.reset();
        self.log.reset();
        if let Err(e) = started {
            tracing::error!(error = %e, "the MPS control daemon did not start; shares run with their client limits alone until it does");
            self.status.last_error = Some(e.to_string());
            self.started = None;
            return Seen::Down;
        }
        self.started = Some(gpus.to_vec());
        tracing::info!(gpus = ?gpus, root = %self.cfg.layout.root.display(), "MPS control daemon started");
        for _ in 0..20 {
            if let seen @ Seen::Up { .. } = self.check().await {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Seen::Down
    }

    async fn quit(&mut self, why: &str) {
        if let Err(e) = send(&self.cfg, vec![Command::Quit]).await {
            tracing::warn!(error = %e, "telling the MPS control daemon to quit failed");
        } else {
            tracing::info!(reason = why, "MPS control daemon told to quit");
        }
        self.started = None;
        self.applied.reset();
    }

    /// Sends the limits that changed since they were last applied (see [`super::limits`]).
    async fn apply_limits(&mut self, servers: &[u32]) {
        let Some(running) = &self.started else { return };
        let daemon_gpus: Vec<DaemonGpu> = self
            .gpus
            .iter()
            .filter(|g| running.contains(&g.index))
            .map(|g| DaemonGpu { index: g.index, memory_mib: g.memory_mib })
            .collect();
        let want = server_limits(&daemon_gpus, &self.source.shares());
        for (target, commands) in self.applied.pending(&want, servers) {
            let lines: Vec<String> = commands.iter().map(ToString::to_string).collect();
            match send(&self.cfg, commands).await.and_then(|o| Ok(check_silent(&o)?)) {
                Ok(()) => {
                    tracing::info!(server = ?target, commands = ?lines, "MPS limits applied");
                    self.applied.done(target, &want);
                }
                Err(e) => {
                    self.status.limit_errors += 1;
                    tracing::warn!(server = ?target, error = %e, "applying MPS limits failed; retried at the next check");
                }
            }
        }
    }

    /// Reads what the daemon logged since the last call, and reports it.
    fn read_log(&mut self) {
        let Some((chunk, restarted)) = read_from(&self.control_log(), &mut self.log_offset) else { return };
        if restarted {
            self.log.reset();
        }
        for event in self.log.feed(&chunk) {
            match event {
                LogEvent::Fault { pid, line } => {
                    self.status.server_faults += 1;
                    let mut pods: Vec<String> = self.source.shares().into_iter().map(|s| s.pod).collect();
                    pods.sort();
                    pods.dedup();
                    tracing::warn!(server = ?pid, pods = ?pods, log = %line, "an MPS client's fatal fault ended every client of its server: these pods' GPU work failed with it, not through a fault of their own");
                    if let Some(r) = &self.reporter {
                        r.server_fault(&pods, &line);
                    }
                }
                LogEvent::ClientWaiting { uid, server_uid } => {
                    self.status.uid_conflicts += 1;
                    tracing::warn!(uid, server_uid, "an MPS client of user {uid} waits until the server of user {server_uid} has no client left: MPS runs one server at a time; run this node's share pods as one UID, or use the guard isolation mode");
                }
                LogEvent::ServerStarted { pid, uid } => tracing::info!(server = pid, uid, "MPS server started"),
                LogEvent::ServerExited { pid, status } => tracing::info!(server = pid, status, "MPS server exited"),
            }
        }
        self.status.clients_waiting = self.log.waiting();
    }

    fn publish(&self) {
        if let Some(f) = &self.on_status {
            f(&self.status);
        }
        self.handle.status.send_if_modified(|s| {
            let changed = *s != self.status;
            *s = self.status.clone();
            changed
        });
    }
}
