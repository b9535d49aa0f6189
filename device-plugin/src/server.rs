//! Serving the plugin on its unix socket and keeping it registered with kubelet.
//!
//! One round: bind `<dir>/<socket>`, start the gRPC server, register with `<dir>/kubelet.sock`, then
//! check the two sockets whenever an entry of the directory is created or removed (inotify), and
//! every `poll_interval` besides. When kubelet restarts it deletes every socket in the directory but
//! its own and recreates `kubelet.sock`; when our socket disappears or `kubelet.sock` is a different
//! file than the one we registered with, the round ends and a new one starts on the same [`Plugin`]
//! (health and allocation bookkeeping carry over).
//!
//! Why inotify and not polling alone: a restarted kubelet admits the pods bound while it was down
//! well under a second after it recreates `kubelet.sock` (0.8 s on the real v1.36 node of
//! tests/e2e/real_node.rs), and it refuses every pod it admits before our registration and first
//! device list (`UnexpectedAdmissionError`, "no healthy devices present"), for good: a bare pod never
//! runs. With a one-second poll 21 of 28 such pods were refused under load. The poll stays as the
//! fallback where a filesystem gives no events (some overlay and network filesystems). While
//! registration fails, a new `kubelet.sock` is tried at once, and the same one again after 25 ms,
//! doubling up to the retry interval: the kubelet creates its socket a moment before it accepts on
//! it, and a first attempt in between was seen on the real node (then a 2 s wait refused 28 pods).

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use crate::kubelet_api::v1beta1::device_plugin_server::DevicePluginServer;
use crate::kubelet_api::v1beta1::registration_client::RegistrationClient;
use crate::kubelet_api::v1beta1::RegisterRequest;
use crate::kubelet_api::{DEFAULT_DEVICE_PLUGIN_DIR, KUBELET_SOCKET, VERSION};
use crate::plugin::service::DevicePluginService;
use crate::plugin::Plugin;
use crate::unix_socket::connect_unix;

/// The first wait after a failed registration; it doubles up to [`ServeConfig::retry_interval`]
/// while `kubelet.sock` stays the same file.
const FIRST_RETRY: Duration = Duration::from_millis(25);

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// kubelet's device plugin directory.
    pub dir: PathBuf,
    /// Our socket's file name inside `dir` (the `endpoint` we register).
    pub socket_name: String,
    pub poll_interval: Duration,
    /// The longest wait between failed registration attempts (kubelet not up yet); the first is
    /// 25 ms, doubling.
    pub retry_interval: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from(DEFAULT_DEVICE_PLUGIN_DIR),
            socket_name: "gpuplace.sock".into(),
            poll_interval: Duration::from_secs(1),
            retry_interval: Duration::from_secs(2),
        }
    }
}

/// Why serving stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
}

/// Why a registration attempt failed (retried).
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("connecting to {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("kubelet refused registration: {0}")]
    Refused(tonic::Status),
}

/// A file's identity: a recreated file has another inode or change time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

pub(crate) fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::symlink_metadata(path).ok()?;
    Some(FileId { dev: m.dev(), ino: m.ino(), ctime: m.ctime(), ctime_nsec: m.ctime_nsec() })
}

/// Wakes a waiting round as soon as an entry of the device-plugin directory is created or removed.
/// `None` where no watch can be set up: the poll alone then.
struct DirWatch {
    // dropping the watcher ends its thread and the inotify watch
    _watcher: notify::RecommendedWatcher,
    wake: Arc<tokio::sync::Notify>,
}

impl DirWatch {
    fn new(dir: &Path) -> Option<DirWatch> {
        use notify::Watcher;
        let wake = Arc::new(tokio::sync::Notify::new());
        let w = wake.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            // any event (or a watch error, such as an overflowed queue) is a reason to look again;
            // notify_one keeps a permit, so an event between two waits is not lost
            let relevant = event.map_or(true, |e| !matches!(e.kind, notify::EventKind::Access(_)));
            if relevant {
                w.notify_one();
            }
        });
        let mut watcher = match watcher {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "no inotify; noticing a kubelet restart by polling alone");
                return None;
            }
        };
        if let Err(e) = watcher.watch(dir, notify::RecursiveMode::NonRecursive) {
            tracing::warn!(error = %e, dir = %dir.display(), "cannot watch the device-plugin directory; polling alone");
            return None;
        }
        Some(DirWatch { _watcher: watcher, wake })
    }

    /// Resolves at the next change in the directory; never without a watch.
    async fn changed(watch: Option<&DirWatch>) {
        match watch {
            Some(w) => w.wake.notified().await,
            None => std::future::pending().await,
        }
    }
}

/// One Register call to kubelet.
pub async fn register(plugin: &Plugin, cfg: &ServeConfig) -> Result<(), RegisterError> {
    let path = cfg.dir.join(KUBELET_SOCKET);
    let channel = connect_unix(&path).await.map_err(|source| RegisterError::Connect { path: path.clone(), source })?;
    let request = RegisterRequest {
        version: VERSION.into(),
        endpoint: cfg.socket_name.clone(),
        resource_name: plugin.config().resource_name.clone(),
        options: Some(plugin.options()),
    };
    let mut client = RegistrationClient::new(channel);
    // kubelet dials back before answering; bound the wait so a wedged kubelet is retried
    let mut req = tonic::Request::new(request);
    req.set_timeout(Duration::from_secs(10));
    client.register(req).await.map_err(RegisterError::Refused)?;
    Ok(())
}

enum RoundEnd {
    Stop,
    Restart(&'static str),
}

/// A future that ends serving.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Serves and re-registers until `stop` resolves; removes our socket on the way out.
// `stop` is boxed rather than generic so that the server stack is compiled once, in this crate,
// instead of again in every caller (the binary and each test crate): a minute of build time each
pub async fn run(plugin: Arc<Plugin>, cfg: ServeConfig, mut stop: StopSignal) -> Result<(), ServeError> {
    let sock = cfg.dir.join(&cfg.socket_name);
    // one watch for every round: kubelet's restart deletes our socket and recreates its own within
    // milliseconds, and both must be seen
    let watch = DirWatch::new(&cfg.dir);
    let mut round = 0u64;
    loop {
        round += 1;
        match serve_round(&plugin, &cfg, &sock, watch.as_ref(), &mut stop).await? {
            RoundEnd::Stop => break,
            RoundEnd::Restart(why) => tracing::info!(round, why, "re-registering"),
        }
    }
    // leave no socket behind for kubelet to dial
    let _ = std::fs::remove_file(&sock);
    Ok(())
}

async fn serve_round(
    plugin: &Arc<Plugin>,
    cfg: &ServeConfig,
    sock: &Path,
    watch: Option<&DirWatch>,
    stop: &mut StopSignal,
) -> Result<RoundEnd, ServeError> {
    match std::fs::remove_file(sock) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(ServeError::Io { action: "removing stale socket", path: sock.to_path_buf(), source: e })
        }
        _ => {}
    }
    let listener = UnixListener::bind(sock).map_err(|source| ServeError::Io {
        action: "binding",
        path: sock.to_path_buf(),
        source,
    })?;
    let our_id = file_id(sock);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let service = DevicePluginServer::new(DevicePluginService::new(plugin.clone(), shutdown_rx.clone()));
    let mut server_done = shutdown_rx.clone();
    let mut server = tokio::spawn(async move {
        Server::builder()
            .serve_with_incoming_shutdown(service, UnixListenerStream::new(listener), async move {
                let _ = server_done.wait_for(|s| *s).await;
            })
            .await
    });
    tracing::info!(socket = %sock.display(), "serving");

    let kubelet_sock = cfg.dir.join(KUBELET_SOCKET);
    let mut registered: Option<Option<FileId>> = None;
    // kubelet.sock as it was at the last failed attempt, when to try again regardless, and the wait
    // that gave that time
    let mut failed: Option<(Option<FileId>, tokio::time::Instant, Duration)> = None;
    let mut server_finished = false;
    let end = loop {
        // after a failure, again at the retry interval, or at once when kubelet.sock appears or is
        // created anew: kubelet's node status (and so pods' admission) waits for our registration
        let due = failed.is_none_or(|(id, at, _)| tokio::time::Instant::now() >= at || file_id(&kubelet_sock) != id);
        if registered.is_none() && due {
            // the identity before the call: a kubelet restart during it is then seen as a change
            let kubelet_id = file_id(&kubelet_sock);
            match register(plugin, cfg).await {
                Ok(()) => {
                    tracing::info!(resource = %plugin.config().resource_name, "registered with kubelet");
                    plugin.note_registered();
                    registered = Some(kubelet_id);
                    failed = None;
                }
                Err(e) => {
                    // a kubelet.sock just created may not accept yet (the kubelet binds, then
                    // serves): retry within milliseconds, backing off to the retry interval, since
                    // the kubelet admits waiting pods within a second and refuses them until then
                    let wait = match failed {
                        Some((id, _, wait)) if id == kubelet_id => (wait * 2).min(cfg.retry_interval),
                        _ => FIRST_RETRY.min(cfg.retry_interval),
                    };
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "registration failed; retrying");
                    failed = Some((kubelet_id, tokio::time::Instant::now() + wait, wait));
                }
            }
        }
        let wait = match (registered, failed) {
            (Some(_), _) => cfg.poll_interval,
            (None, Some((_, at, _))) => {
                cfg.poll_interval.min(at.saturating_duration_since(tokio::time::Instant::now()))
            }
            (None, None) => cfg.poll_interval.min(cfg.retry_interval),
        };
        tokio::select! {
            _ = stop.as_mut() => break RoundEnd::Stop,
            r = &mut server => {
                server_finished = true;
                if let Ok(Err(e)) = r {
                    tracing::warn!(error = %e, "gRPC server failed");
                }
                break RoundEnd::Restart("gRPC server stopped");
            }
            _ = tokio::time::sleep(wait) => {}
            _ = DirWatch::changed(watch) => {}
        }
        if file_id(sock) != our_id {
            break RoundEnd::Restart("our socket was removed");
        }
        if let Some(id) = registered {
            if file_id(&kubelet_sock) != id {
                break RoundEnd::Restart("kubelet.sock was recreated");
            }
        }
    };
    let _ = shutdown_tx.send(true);
    // streams end on the shutdown signal; a connection that will not close is not worth waiting for
    if !server_finished && tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
        server.abort();
    }
    Ok(end)
}
