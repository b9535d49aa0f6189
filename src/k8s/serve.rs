//! API-server mode, wired: the node, pod and utilization ConfigMap watchers, leader election and
//! readiness around one [`Scheduler`].
//!
//! Readiness (`/readyz`, [`Readiness::synced`]) is `rebuilt && keys`: allocations were rebuilt from
//! the first complete lists, and the assignment key ring is loaded from its Secret and well-formed
//! (`keys`; the rebuild itself waits for the ring, which verifies every assignment it counts). It does
//! not depend on leadership, so both replicas are Ready and a rolling update with no unavailable
//! replica finishes. Deciding is the leader's alone: the extender answers verbs itself only while
//! synced *and* leading ([`Scheduler::set_ready`]), and a replica that does not lead forwards every
//! verb to the leader at the URL the leader published on its Lease ([`Readiness`] is the forward's
//! [`Role`]; `extender::forward`). The leader also re-signs records made with an old key (`resign`),
//! removes assignments left on unbound pods (`stale`), keeps gpuplace's books of who holds what
//! (`books`), and with mTLS by default keeps kube-scheduler's client certificate in its Secret
//! (`certificates`); pods just turned away from GPUs that are then freed are sent back to
//! kube-scheduler's queue (`requeue`). The utilization watch is not part of readiness: samples are
//! optional and age out by themselves. The standby keeps watching, so it is
//! current when it takes over.
//!
//! Runtimes: actix-web runs its own system (one current-thread tokio runtime per worker), and
//! `http::serve_forever` owns the main thread until SIGTERM. The kube side gets one more
//! current-thread tokio runtime on a thread of its own ([`spawn_thread`]): the watchers and the
//! election never share a thread with HTTP workers, and no multi-thread runtime (another tokio
//! feature to build) is needed. Binds get a client, thread and runtime of their own
//! (`spawn_client_thread`, `gpuplace-bind`): the HTTP worker that takes a bind hands the API
//! calls to that runtime and awaits their outcome (`KubeBinder::run_calls_on`). When the HTTP
//! server has stopped (in-flight binds done), [`KubeSide::shutdown`] ends the kube side and hands the
//! Lease back, so the standby leads within a retry period instead of a lease duration.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::k8s::watched_pod::WatchedPod;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::extender::forward::{Role, Route};
use crate::k8s::certificates::{self, SchedulerTls};
use crate::k8s::dra::{self, DraOptions};
use crate::k8s::keys::{self, KeyOptions, KeyStatus};
use crate::k8s::leader::{self, LeaderConfig, Leadership};
use crate::k8s::stale;
use crate::k8s::{books, nodes, pod_groups, pods, requeue, resign, utilization};
use crate::scheduler::Scheduler;
use gpuplace_core::api_client::connect::{connect, connect_with, ConnectError, Source, Transport};
use gpuplace_core::api_client::events::EventSink;

/// How long an assignment may sit on an unbound pod before the leader removes it ([`stale`]), at
/// least: a bind writes the annotation and creates the Binding within milliseconds.
pub const DEFAULT_STALE_GRACE: Duration = Duration::from_secs(15);

/// What API-server mode watches and how it elects.
#[derive(Debug, Clone, Default)]
pub struct ApiOptions {
    /// Watch only Nodes with these labels (`gpu=true`); default: every node.
    pub node_selector: Option<String>,
    /// Leader election; `None`: this replica always leads (run one replica only).
    pub leader: Option<LeaderConfig>,
    /// This replica's name in Events (`reportingInstance`); empty: no Events are written.
    pub instance: String,
    /// Namespace of the device plugins' utilization ConfigMaps; `None`: not watched (samples only
    /// from the deprecated Node annotation).
    pub utilization_namespace: Option<String>,
    /// The Secret holding the assignment key ring, and how often the leader re-signs.
    pub keys: KeyOptions,
    /// mTLS by default: the Secret where the leader keeps kube-scheduler's client certificate, and
    /// the CA that signs it (`certificates`); `None`: certificates are the operator's.
    pub scheduler_tls: Option<SchedulerTls>,
    /// The DRA front end (`dra`): gpuplace allocates the claims of this driver's DeviceClass.
    pub dra: Option<DraOptions>,
    /// Namespace of gpuplace's books (`books`: every pod's record per node, where tenants cannot
    /// write; the extender's own); `None`: none kept, a rebuild trusts annotations alone.
    pub books_namespace: Option<String>,
}

/// Whether this replica is synced (rebuilt, key ring loaded: `/readyz`), and whether it decides
/// (synced and leading: the extender answers verbs itself, [`Scheduler::set_ready`]).
#[derive(Debug)]
pub struct Readiness {
    ext: Arc<Scheduler>,
    leadership: Arc<Leadership>,
    rebuilt: AtomicBool,
    keys_loaded: AtomicBool,
    /// The watchers were stopped: nothing keeps the state current any more.
    stopped: AtomicBool,
}

impl Readiness {
    pub fn new(ext: Arc<Scheduler>, leadership: Arc<Leadership>) -> Self {
        Self {
            ext,
            leadership,
            rebuilt: AtomicBool::new(false),
            keys_loaded: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// Rebuilt and the key ring loaded, and still watching: what `/readyz` reports, whoever leads.
    pub fn synced(&self) -> bool {
        !self.stopped.load(Ordering::Relaxed) && self.is_rebuilt() && self.keys_loaded()
    }

    /// Whether the key Secret is loaded and well-formed (a malformed one keeps the replica unready).
    pub fn set_keys_loaded(&self, loaded: bool) {
        self.keys_loaded.store(loaded, Ordering::Relaxed);
        self.refresh();
    }

    pub fn keys_loaded(&self) -> bool {
        self.keys_loaded.load(Ordering::Relaxed)
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
        self.ext.set_ready(self.synced() && leader);
    }
}

impl Role for Readiness {
    fn synced(&self) -> bool {
        Readiness::synced(self)
    }

    fn route(&self) -> Route {
        if self.leadership.is_leader() {
            Route::Local
        } else {
            self.leadership.leader_url().map_or(Route::Unknown, Route::Leader)
        }
    }
}

/// The running tasks; dropping it (or [`stop`](Self::stop)) ends them.
pub struct Controller {
    tasks: Vec<JoinHandle<()>>,
    pub readiness: Arc<Readiness>,
    pub leadership: Arc<Leadership>,
    /// The election, for handing the Lease back at shutdown.
    election: Option<(Client, LeaderConfig)>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("tasks", &self.tasks.len())
            .field("leadership", &self.leadership)
            .field("lease", &self.election.as_ref().map(|(_, cfg)| cfg))
            .finish_non_exhaustive()
    }
}

impl Controller {
    /// A graceful end (the process is shutting down, in-flight binds are done): stops every task,
    /// stops leading, and hands the Lease back so the standby takes over at once rather than after a
    /// lease duration. A failed hand-back is logged; the Lease then expires as usual.
    pub async fn shutdown(&self) {
        self.stop();
        self.leadership.resign();
        if let Some((client, cfg)) = &self.election {
            match leader::release(client.clone(), cfg).await {
                Ok(true) => tracing::info!(identity = %cfg.identity, "leader lease released"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "releasing the leader lease failed; it expires by itself"),
            }
        }
    }

    /// Ends every task (a replica going away: it stops renewing, the standby takes over) and
    /// turns readiness off, since nothing keeps the state current any more.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
        self.readiness.stopped.store(true, Ordering::Relaxed);
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
pub fn start(client: Client, ext: Arc<Scheduler>, leadership: Arc<Leadership>, opts: ApiOptions) -> Controller {
    ext.set_ready(false);
    // bind places pods as the API server has them, never as a filter body says (issue 29)
    ext.set_pods_watched();
    let readiness = Arc::new(Readiness::new(ext.clone(), leadership.clone()));
    let events = (!opts.instance.is_empty()).then(|| EventSink::new(client.clone(), &opts.instance));
    let (synced_tx, synced_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let (keys_tx, keys_rx) = watch::channel(KeyStatus::Loading);
    let secret = opts.keys.secret.clone();
    let secrets = Api::<Secret>::namespaced(client.clone(), &secret.namespace);
    tasks.push(tokio::spawn(keys::watch_keys(secrets, secret, ext.clone(), keys_tx)));
    let public = opts.keys.public_keys.clone();
    let configmaps = Api::<ConfigMap>::namespaced(client.clone(), &public.namespace);
    tasks.push(tokio::spawn(keys::publish(configmaps, public, ext.clone(), leadership.clone())));
    let (r, mut status) = (readiness.clone(), keys_rx.clone());
    tasks.push(tokio::spawn(async move {
        loop {
            let loaded = status.borrow_and_update().is_loaded();
            r.set_keys_loaded(loaded);
            if status.changed().await.is_err() {
                return;
            }
        }
    }));
    tasks.push(tokio::spawn(nodes::watch_nodes(
        Api::<Node>::all(client.clone()),
        opts.node_selector.clone(),
        ext.clone(),
        events.clone(),
        synced_tx,
    )));
    if let Some(d) = &opts.dra {
        ext.enable_dra();
        let store = Arc::new(dra::ClaimStore::default());
        let (slices_tx, slices_rx) = watch::channel(false);
        let (claims_tx, claims_rx) = watch::channel(false);
        let slices = Api::<ResourceSlice>::all(client.clone());
        tasks.push(tokio::spawn(dra::watch_slices(slices, d.driver.clone(), ext.clone(), slices_tx)));
        let claims = Api::<ResourceClaim>::all(client.clone());
        tasks.push(tokio::spawn(dra::watch_claims(claims, d.driver.clone(), ext.clone(), store.clone(), claims_tx)));
        let synced = dra::Synced { slices: slices_rx, claims: claims_rx };
        tasks.push(tokio::spawn(dra::run_gates(client.clone(), ext.clone(), d.clone(), store, events.clone(), synced)));
    }
    let r = readiness.clone();
    let unbound = Arc::new(stale::UnboundAssignments::default());
    let books = opts.books_namespace.as_ref().map(|ns| Api::<ConfigMap>::namespaced(client.clone(), ns));
    if let Some(api) = &books {
        tasks.push(tokio::spawn(books::run(client.clone(), api.clone(), ext.clone(), leadership.clone())));
    }
    tasks.push(tokio::spawn(pods::watch_pods(
        Api::<WatchedPod>::all(client.clone()),
        ext.clone(),
        unbound.clone(),
        events,
        pods::RebuildWaits { nodes_synced: synced_rx, keys: keys_rx.clone(), books },
        move || r.set_rebuilt(),
    )));
    // optional: readiness does not wait on it (see `utilization`)
    if let Some(ns) = &opts.utilization_namespace {
        let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
        tasks.push(tokio::spawn(utilization::watch_utilization(api, ext.clone())));
    }
    // optional too: kube-scheduler's PodGroups, where the API server serves them
    tasks.push(tokio::spawn(pod_groups::watch_pod_groups(client.clone(), ext.clone())));
    tasks.push(tokio::spawn(resign::run(
        client.clone(),
        ext.clone(),
        leadership.clone(),
        keys_rx,
        opts.keys.resign_every,
    )));
    if let Some(tls) = &opts.scheduler_tls {
        let api = Api::<Secret>::namespaced(client.clone(), &tls.secret.namespace);
        tasks.push(tokio::spawn(certificates::keep_scheduler_secret(
            api,
            tls.secret.clone(),
            tls.ca.clone(),
            leadership.clone(),
            tls.every,
        )));
    }
    let (requeuer, requeue_rx) = requeue::channel();
    ext.set_requeuer(Arc::new(requeuer));
    tasks.push(tokio::spawn(requeue::run(client.clone(), ext.clone(), requeue_rx)));
    // a bind of a former leader is over once its Lease has expired
    let grace = opts.leader.as_ref().map_or(DEFAULT_STALE_GRACE, |cfg| cfg.lease_duration.max(DEFAULT_STALE_GRACE));
    tasks.push(tokio::spawn(stale::run(client.clone(), ext.clone(), leadership.clone(), unbound, grace)));
    let election = opts.leader.map(|cfg| (client.clone(), cfg));
    if let Some((client, cfg)) = election.clone() {
        let r = readiness.clone();
        tasks.push(tokio::spawn(leader::run(client, cfg, leadership.clone(), move |_| r.refresh())));
    } else {
        readiness.refresh();
    }
    Controller { tasks, readiness, leadership, election }
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

/// The kube side running on its thread: the extender and its readiness (the forward's role) for
/// the HTTP server, and a graceful end.
#[derive(Debug)]
pub struct KubeSide {
    pub scheduler: Arc<Scheduler>,
    pub readiness: Arc<Readiness>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: std::sync::mpsc::Receiver<()>,
}

impl KubeSide {
    /// Ends the kube side ([`Controller::shutdown`]: stop leading, hand the Lease back), waiting at
    /// most `limit` for it.
    pub fn shutdown(mut self, limit: std::time::Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = self.done.recv_timeout(limit);
    }
}

/// A client whose requests (and TLS connections) are driven on a thread and runtime of their own,
/// which then run for the life of the process. Binds use it: on the watchers' thread, a burst of
/// pod events (hundreds while kube-scheduler works through a backlog) delayed every bind's
/// requests behind their decoding. Its requests share one HTTP/2 connection ([`Transport`]).
fn spawn_client_thread(source: Source, name: &str) -> Result<DedicatedClient, RunError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(RunError::Runtime)?;
    let runtime = rt.handle().clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            rt.block_on(async move {
                match connect_with(&source, Transport::Multiplexed).await {
                    Ok(client) => {
                        let _ = tx.send(Ok(client.clone()));
                        // open the connection now, not in the first bind of a burst (measured in
                        // tests/e2e: a burst's first binds waited 55-90 ms for its handshake)
                        if let Err(e) = client.apiserver_version().await {
                            tracing::debug!(error = %e, "the bind client cannot reach the API server yet");
                        }
                        // the client's buffer task and its connections live on this runtime
                        std::future::pending::<()>().await
                    }
                    Err(e) => {
                        let _ = tx.send(Err(RunError::Connect(e)));
                    }
                }
            })
        })
        .map_err(RunError::Runtime)?;
    let client = rx.recv().map_err(|_| RunError::Ended)??;
    Ok(DedicatedClient { client, runtime })
}

/// A client with a thread of its own (`spawn_client_thread`), and that thread's runtime, on which
/// calls can run beside the connection.
#[derive(Clone)]
pub struct DedicatedClient {
    pub client: Client,
    pub runtime: tokio::runtime::Handle,
}

/// Starts the kube side on its own thread and runtime (see the module doc): connects, builds the
/// extender with `make` (given a client for binds, on a thread and runtime of its own, and the
/// leadership its binder must check), starts the controller, and returns the extender for the HTTP
/// server. The thread runs until [`KubeSide::shutdown`] (or the end of the process).
pub fn spawn_thread(
    source: Source,
    opts: ApiOptions,
    make: impl FnOnce(DedicatedClient, Arc<Leadership>) -> Arc<Scheduler> + Send + 'static,
) -> Result<KubeSide, RunError> {
    let bind_client = spawn_client_thread(source.clone(), "gpuplace-bind")?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(RunError::Runtime)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
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
                let ext = make(bind_client, leadership.clone());
                let controller = start(client, ext.clone(), leadership, opts);
                let _ = tx.send(Ok((ext, controller.readiness.clone())));
                // a dropped handle ends it the same way
                let _ = stop_rx.await;
                controller.shutdown().await;
                let _ = done_tx.send(());
            })
        })
        .map_err(RunError::Runtime)?;
    let (scheduler, readiness) = rx.recv().map_err(|_| RunError::Ended)??;
    Ok(KubeSide { scheduler, readiness, stop: Some(stop_tx), done: done_rx })
}
