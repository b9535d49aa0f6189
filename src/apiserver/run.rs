//! API-server mode, wired: the node and pod watchers, leader election and readiness around one
//! [`Extender`].
//!
//! Readiness is `rebuilt && leader`: allocations were rebuilt from the first complete lists, and
//! this replica holds the Lease (always, without election). Only the ready replica answers
//! `/readyz` with 200, so the Service in front sends kube-scheduler to the leader; the standby keeps
//! watching, so it is current when it takes over.
//!
//! Runtimes: actix-web runs its own system (one current-thread tokio runtime per worker), and
//! `http::serve_forever` owns the main thread until SIGTERM. The kube side gets one more
//! current-thread tokio runtime on a thread of its own ([`spawn_thread`]): the watchers and the
//! election never share a thread with HTTP workers, and no multi-thread runtime (another tokio
//! feature to build) is needed. The binder is called from the HTTP workers; kube's `Client` sends
//! its requests to a buffer task on the kube runtime, so calls from any runtime work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::apiserver::connect::{connect, ConnectError, Source};
use crate::apiserver::events::EventSink;
use crate::apiserver::leader::{self, LeaderConfig, Leadership};
use crate::apiserver::{nodes, pods};
use crate::extender::service::Extender;

/// What API-server mode watches and how it elects.
#[derive(Debug, Clone, Default)]
pub struct ApiOptions {
    /// Watch only Nodes with these labels (`gpu=true`); default: every node.
    pub node_selector: Option<String>,
    /// Leader election; `None`: this replica always leads (run one replica only).
    pub leader: Option<LeaderConfig>,
    /// This replica's name in Events (`reportingInstance`); empty: no Events are written.
    pub instance: String,
}

/// Turns the extender ready exactly when it is rebuilt and leads.
#[derive(Debug)]
pub struct Readiness {
    ext: Arc<Extender>,
    leadership: Arc<Leadership>,
    rebuilt: AtomicBool,
}

impl Readiness {
    pub fn new(ext: Arc<Extender>, leadership: Arc<Leadership>) -> Self {
        Self { ext, leadership, rebuilt: AtomicBool::new(false) }
    }

    pub fn set_rebuilt(&self) {
        self.rebuilt.store(true, Ordering::Relaxed);
        self.refresh();
    }

    pub fn is_rebuilt(&self) -> bool {
        self.rebuilt.load(Ordering::Relaxed)
    }

    pub fn refresh(&self) {
        let leader = self.leadership.is_leader();
        if self.leadership.is_elected() {
            self.ext.metrics().set_leader(leader);
        }
        self.ext.set_ready(self.is_rebuilt() && leader);
    }
}

/// The running tasks; dropping it (or [`stop`](Self::stop)) ends them.
#[derive(Debug)]
pub struct Controller {
    tasks: Vec<JoinHandle<()>>,
    pub readiness: Arc<Readiness>,
    pub leadership: Arc<Leadership>,
}

impl Controller {
    /// Ends every task (a replica going away: it stops renewing, the standby takes over) and
    /// turns readiness off, since nothing keeps the state current any more.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
        self.readiness.ext.set_ready(false);
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the watchers and, with `opts.leader`, the election, on the current tokio runtime.
/// `ext` must have been built with `ready: false` and a binder that checks `leadership`.
pub fn start(client: Client, ext: Arc<Extender>, leadership: Arc<Leadership>, opts: ApiOptions) -> Controller {
    ext.set_ready(false);
    let readiness = Arc::new(Readiness::new(ext.clone(), leadership.clone()));
    let events = (!opts.instance.is_empty()).then(|| EventSink::new(client.clone(), &opts.instance));
    let (synced_tx, synced_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(nodes::watch_nodes(
        Api::<Node>::all(client.clone()),
        opts.node_selector.clone(),
        ext.clone(),
        events.clone(),
        synced_tx,
    )));
    let r = readiness.clone();
    tasks.push(tokio::spawn(pods::watch_pods(
        Api::<Pod>::all(client.clone()),
        ext.clone(),
        events,
        synced_rx,
        move || r.set_rebuilt(),
    )));
    if let Some(cfg) = opts.leader {
        let r = readiness.clone();
        tasks.push(tokio::spawn(leader::run(client, cfg, leadership.clone(), move |_| r.refresh())));
    } else {
        readiness.refresh();
    }
    Controller { tasks, readiness, leadership }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("starting the Kubernetes runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("the Kubernetes thread ended before the extender was built")]
    Ended,
}

/// Starts the kube side on its own thread and runtime (see the module doc): connects, builds the
/// extender with `make` (given the client and the leadership its binder must check), starts the
/// controller, and returns the extender for the HTTP server. The thread runs until the process ends.
pub fn spawn_thread(
    source: Source,
    opts: ApiOptions,
    make: impl FnOnce(Client, Arc<Leadership>) -> Arc<Extender> + Send + 'static,
) -> Result<Arc<Extender>, RunError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(RunError::Runtime)?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("gpuplace-kube".into())
        .spawn(move || {
            rt.block_on(async move {
                let client = match connect(&source).await {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(RunError::Connect(e)));
                        return;
                    }
                };
                let leadership = if opts.leader.is_some() { Leadership::elected() } else { Leadership::always() };
                let ext = make(client.clone(), leadership.clone());
                let _controller = start(client, ext.clone(), leadership, opts);
                let _ = tx.send(Ok(ext));
                std::future::pending::<()>().await;
            })
        })
        .map_err(RunError::Runtime)?;
    rx.recv().map_err(|_| RunError::Ended)?
}
