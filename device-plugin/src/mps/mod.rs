//! Managed MPS (`--mps-daemon`): the device plugin runs and supervises NVIDIA's MPS control daemon
//! for the node's GPUs, connects every share container to it, and sets the server-side limits the
//! MPS interface allows (issue 49).
//!
//! - [`command`]: the control daemon's command lines and the parsing of its answers (pure).
//! - [`limits`]: the server-side limits from the shares on each GPU, as commands (pure).
//! - [`supervise`]: when to start, restart (with backoff) and stop the daemon (pure).
//! - [`log`]: the daemon's `control.log`: servers started and exited, clients of other users
//!   queued, fatal faults (pure).
//! - [`daemon`]: the I/O: the daemon process, client commands with a timeout, the supervision loop
//!   and the [`daemon::MpsHandle`] the rest of the plugin asks whether MPS is up.
//!
//! # What is limited where
//!
//! MPS has two places a limit can live, and they are not equally strong:
//!
//! - **Per server** (set by the plugin through the control daemon): `set_default_device_pinned_mem_limit
//!   <dev> <MiB>M` per GPU and `set_default_active_thread_percentage <pct>` for servers started
//!   later, `set_device_pinned_mem_limit <pid> <dev> <MiB>M` and `set_active_thread_percentage <pid>
//!   <pct>` for each running one. A client can never get more than its server's limit, whatever its
//!   environment says. But one server serves every client of one user on all the daemon's GPUs, so
//!   the server's limit on a GPU is the **largest share on that GPU**, and its thread percentage
//!   the largest share's on the node (MPS has no per-device thread percentage); a GPU without a
//!   share is left at its whole memory.
//! - **Per container** (its environment, from Allocate or the claim's CDI spec):
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (by container ordinal) and
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. The client applies them below the server's limit. A
//!   container that unsets or raises them gets the server's limit instead: the largest share on its
//!   GPU, not its own. That gap (a small share on a GPU that also holds a big one) is what the guard
//!   (the process-memory watchdog) backstops; the scheduler's accounting never relies on it.
//!
//! The thread percentage applies to clients that connect after it is set (MPS provisions a
//! client's SMs when it connects); the pinned-memory limits to allocations made after it is set.
//!
//! # Known pitfalls, and what the plugin does about them
//!
//! - **One server per user ID.** The daemon runs one server at a time for its GPUs; a client of
//!   another UID waits until that server has no client left and exits. The plugin reads the
//!   daemon's log, counts such clients (`gpuplace_mps_clients_waiting`,
//!   `gpuplace_mps_uid_conflicts_total`) and logs a warning naming both UIDs. Remedy: run every share
//!   pod on a node as one UID (`securityContext.runAsUser`), or use the guard isolation mode on
//!   nodes that must mix users.
//! - **A fatal fault ends every client.** A client's fatal GPU fault (an illegal address, say) makes
//!   the server tear down every client on it; the daemon starts a new server at the next connection.
//!   The plugin reports it from the log as what it is (a warning, `gpuplace_mps_server_faults_total`
//!   and an `MpsServerFault` Event on each pod with a share then), so the other pods' failures are
//!   not mistaken for their own bugs.
//! - **Multi-GPU shares.** The daemon sees all the node's healthy GPUs in PCI order
//!   (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, UUIDs in index order), so one pipe directory serves a
//!   container whatever its GPUs; the container gets `CUDA_VISIBLE_DEVICES` with its own GPUs' UUIDs
//!   in index order, so its ordinals (and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`'s) are its GPUs in the
//!   order of `NVIDIA_VISIBLE_DEVICES`.
//! - **Whole-GPU containers stay off MPS**: no pipe directory, no `/dev/shm` of the daemon, no MPS
//!   variable ([`crate::container_env::limit_env`]).

pub mod command;
pub mod daemon;
pub mod limits;
pub mod log;
pub mod supervise;

use std::path::{Path, PathBuf};

/// `--mps-root`'s default: a host directory, mounted at the same path in the plugin's container.
pub const DEFAULT_MPS_ROOT: &str = "/run/gpuplace/mps";

/// `--mps-control-binary`'s default (found on `PATH`, which the NVIDIA container toolkit fills with
/// the driver's binaries when `NVIDIA_DRIVER_CAPABILITIES` includes `compute`).
pub const DEFAULT_CONTROL_BINARY: &str = "nvidia-cuda-mps-control";

/// The directories under `--mps-root`. The pipe directory's path is the same on the host and in
/// every container (clients find the daemon by it); the shm directory is every share container's
/// `/dev/shm`, and must be the daemon's too (the DaemonSet mounts it at the plugin's `/dev/shm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsLayout {
    pub root: PathBuf,
}

impl MpsLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// `CUDA_MPS_PIPE_DIRECTORY`: the control daemon's socket and its servers' pipes.
    pub fn pipe_dir(&self) -> PathBuf {
        self.root.join("pipe")
    }

    /// `CUDA_MPS_LOG_DIRECTORY`: `control.log`, `server.log`.
    pub fn log_dir(&self) -> PathBuf {
        self.root.join("log")
    }

    /// The host directory shared as `/dev/shm` by the daemon and its clients.
    pub fn shm_dir(&self) -> PathBuf {
        self.root.join("shm")
    }

    /// Creates the three directories (world-writable pipe and shm: clients of any UID connect).
    pub fn create(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for (dir, mode) in [(self.pipe_dir(), 0o1777), (self.log_dir(), 0o755), (self.shm_dir(), 0o1777)] {
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(())
    }
}

/// Whether `a` and `b` are the same directory (same device and inode): the plugin's `/dev/shm` must
/// be the shm directory the clients get, or the daemon and its clients cannot meet.
pub fn same_dir(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}
