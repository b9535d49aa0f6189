//! Managed MPS against a stand-in of the MPS control daemon's command interface
//! (tests/support/fake-mps-control.sh): the daemon started with its environment and directories,
//! started again after it is killed, the limits of the shares sent as the daemon's commands, faults
//! and queued users read from its log, and `quit` at shutdown.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplace_device_plugin::mps::daemon::{self, FaultReporter, MpsConfig, MpsHandle, NodeGpu, ShareSource};
use gpuplace_device_plugin::mps::limits::ShareSlice;
use gpuplace_device_plugin::mps::supervise::Backoff;
use tokio::sync::watch;

const STAND_IN: &str = include_str!("support/fake-mps-control.sh");

/// The stand-in, executable, in `dir`.
fn stand_in(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin/nvidia-cuda-mps-control");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    std::fs::write(&bin, STAND_IN).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// Shares and healthy GPUs set by the test.
struct Shares {
    shares: Mutex<Vec<ShareSlice>>,
    serving: Vec<u32>,
    changes: watch::Sender<u64>,
}

impl Shares {
    fn set(&self, shares: Vec<ShareSlice>) {
        *self.shares.lock().unwrap() = shares;
        self.changes.send_modify(|n| *n += 1);
    }
}

impl ShareSource for Shares {
    fn shares(&self) -> Vec<ShareSlice> {
        self.shares.lock().unwrap().clone()
    }
    fn serving(&self) -> Vec<u32> {
        self.serving.clone()
    }
    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.changes.subscribe())
    }
}

#[derive(Default)]
struct Faults(Mutex<Vec<(Vec<String>, String)>>);

impl FaultReporter for Faults {
    fn server_fault(&self, pods: &[String], detail: &str) {
        self.0.lock().unwrap().push((pods.to_vec(), detail.to_string()));
    }
}

fn gpus() -> Vec<NodeGpu> {
    ["GPU-aaaa", "GPU-bbbb"]
        .iter()
        .enumerate()
        .map(|(i, u)| NodeGpu { index: i as u32, uuid: u.to_string(), memory_mib: 81559 })
        .collect()
}

fn config(root: &Path, bin: &Path) -> MpsConfig {
    MpsConfig {
        health_interval: Duration::from_millis(100),
        command_timeout: Duration::from_secs(5),
        backoff: Backoff {
            first: Duration::from_millis(50),
            max: Duration::from_millis(200),
            stable: Duration::from_secs(30),
        },
        ..MpsConfig::new(root.join("mps"), bin)
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The commands the stand-in received, health checks left out.
fn commands(pipe: &Path) -> Vec<String> {
    read(&pipe.join("commands.log")).lines().filter(|l| *l != "get_server_list").map(String::from).collect()
}

fn share(gpu: u32, mem_mib: u64, core_pct: u32, pod: &str) -> ShareSlice {
    ShareSlice { gpu, mem_mib, core_pct, pod: pod.into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_mps_starts_limits_restarts_reports_and_quits() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = stand_in(tmp.path());
    let cfg = config(tmp.path(), &bin);
    let (pipe, log) = (cfg.layout.pipe_dir(), cfg.layout.log_dir());
    let source = Arc::new(Shares { shares: Mutex::new(vec![]), serving: vec![0, 1], changes: watch::Sender::new(0) });
    let faults = Arc::new(Faults::default());
    let mps: Arc<MpsHandle> =
        daemon::start(cfg.clone(), gpus(), source.clone(), Some(faults.clone() as Arc<dyn FaultReporter>), None);

    // started at once, with its environment and directories
    until("the daemon up", || mps.is_running()).await;
    assert!(pipe.is_dir() && log.is_dir() && cfg.layout.shm_dir().is_dir());
    let starts = read(&log.join("standin-starts.log"));
    assert_eq!(
        starts.lines().collect::<Vec<_>>(),
        [format!(
            "start CUDA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_MPS_PIPE_DIRECTORY={} CUDA_MPS_LOG_DIRECTORY={}",
            pipe.display(),
            log.display()
        )]
    );
    assert_eq!(mps.status().gpus, [0, 1]);

    // no share yet: the defaults leave every GPU whole
    until("the first defaults", || commands(&pipe).len() >= 3).await;
    // two shares of GPU 0: the largest caps it, and the node's thread percentage
    source.set(vec![share(0, 20000, 25, "ns/a"), share(0, 30000, 50, "ns/b")]);
    until("the new defaults", || commands(&pipe).iter().any(|c| c == "set_default_active_thread_percentage 50")).await;
    // a server starts for a user: it gets them too
    std::fs::write(pipe.join("servers"), "4242\n").unwrap();
    until("the server's limits", || commands(&pipe).iter().any(|c| c == "set_active_thread_percentage 4242 50")).await;
    assert_eq!(
        commands(&pipe),
        [
            "set_default_device_pinned_mem_limit 0 81559M",
            "set_default_device_pinned_mem_limit 1 81559M",
            "set_default_active_thread_percentage 100",
            "set_default_device_pinned_mem_limit 0 30000M",
            "set_default_device_pinned_mem_limit 1 81559M",
            "set_default_active_thread_percentage 50",
            "set_device_pinned_mem_limit 4242 0 30000M",
            "set_device_pinned_mem_limit 4242 1 81559M",
            "set_active_thread_percentage 4242 50",
        ]
    );
    until("the server listed", || mps.status().servers == [4242]).await;

    // the log: a client of another user queues; a fatal fault ends every client of the server
    let mut f = std::fs::OpenOptions::new().append(true).open(log.join("control.log")).unwrap();
    use std::io::Write;
    writeln!(f, "[2024-05-01 10:00:01.000 Control 1] Starting new server 4242 for user 1000").unwrap();
    writeln!(
        f,
        "[2024-05-01 10:00:02.000 Control 1] NEW CLIENT 0 from user 2000: Server already exists for another user"
    )
    .unwrap();
    writeln!(f, "[2024-05-01 10:00:03.000 Control 1] Server 4242 has encountered a fatal exception").unwrap();
    drop(f);
    until("the fault and the queued user", || {
        let s = mps.status();
        s.server_faults == 1 && s.uid_conflicts == 1 && s.clients_waiting == 1
    })
    .await;
    let reported = faults.0.lock().unwrap().clone();
    assert_eq!(reported.len(), 1);
    assert_eq!(reported[0].0, ["ns/a", "ns/b"]);
    assert!(reported[0].1.contains("fatal exception"));

    // killed: started again (after the backoff), and given its limits again
    let pid = read(&pipe.join(daemon::PID_FILE)).trim().to_string();
    let killed = std::process::Command::new("kill").args(["-9", &pid]).status().unwrap();
    assert!(killed.success());
    until("the restart", || mps.status().restarts == 1 && mps.is_running()).await;
    assert_eq!(read(&log.join("standin-starts.log")).lines().count(), 2);
    assert_ne!(read(&pipe.join(daemon::PID_FILE)).trim(), pid);
    until("the limits again", || {
        commands(&pipe).iter().filter(|c| *c == "set_default_active_thread_percentage 50").count() == 2
    })
    .await;

    // shutdown: told to quit
    mps.shutdown().await;
    assert_eq!(commands(&pipe).last().map(String::as_str), Some("quit"));
    assert!(!pipe.join(daemon::PID_FILE).exists());
    assert!(!mps.is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_binary_is_reported_down_without_failing() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), &tmp.path().join("no/such/nvidia-cuda-mps-control"));
    let source = Arc::new(Shares { shares: Mutex::new(vec![]), serving: vec![0], changes: watch::Sender::new(0) });
    let seen = Arc::new(Mutex::new(None));
    let s2 = seen.clone();
    let mps = daemon::start(cfg, gpus(), source, None, Some(Box::new(move |s| *s2.lock().unwrap() = Some(s.clone()))));
    until("the error", || mps.status().last_error.is_some()).await;
    assert!(!mps.is_running());
    assert!(mps.status().last_error.unwrap().contains("cannot be run"), "{:?}", mps.status());
    // the metrics hook sees it too
    assert!(seen.lock().unwrap().as_ref().is_some_and(|s| !s.up));
    mps.shutdown().await;
}
