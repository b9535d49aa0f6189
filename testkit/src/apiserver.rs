//! An in-process fake Kubernetes API server for tests: plain HTTP/1.1 on 127.0.0.1, with
//! the Pod, Node, Lease, Event, ConfigMap and Secret endpoints a kube-rs client and
//! `kube::runtime::watcher` use, and a test-side handle to seed objects, read what was written, and inject faults.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use gpuplace_testkit::apiserver::FakeApiServer;
//! use k8s_openapi::api::core::v1::Pod;
//! let fake = FakeApiServer::start().await?;
//! let client = fake.client()?;
//! let pods: kube::Api<Pod> = kube::Api::namespaced(client, "default");
//! # Ok(()) }
//! ```
//!
//! What it is not: no admission, defaulting, validation beyond names and versions, or field
//! ownership (server-side apply is a merge); strategic merge patches are JSON merge patches (lists
//! are replaced, not merged by key); deletion is immediate (no grace period or finalizers).

mod routes;
mod select;
mod store;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use store::Store;

/// Requests kept in the log; older ones are dropped.
const REQUEST_LOG: usize = 10_000;

/// The resources the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// `v1` pods, namespaced, with `status` and `binding` subresources.
    Pods,
    /// `v1` nodes, cluster-scoped, with a `status` subresource.
    Nodes,
    /// `coordination.k8s.io/v1` leases, namespaced.
    Leases,
    /// `v1` events, namespaced.
    Events,
    /// `events.k8s.io/v1` events, namespaced (what kube's event `Recorder` writes).
    EventsV1,
    /// `v1` configmaps, namespaced.
    ConfigMaps,
    /// `v1` secrets, namespaced.
    Secrets,
}

impl Resource {
    pub const ALL: [Resource; 7] = [
        Resource::Pods,
        Resource::Nodes,
        Resource::Leases,
        Resource::Events,
        Resource::EventsV1,
        Resource::ConfigMaps,
        Resource::Secrets,
    ];

    pub fn group(self) -> &'static str {
        match self {
            Resource::Leases => "coordination.k8s.io",
            Resource::EventsV1 => "events.k8s.io",
            _ => "",
        }
    }

    pub fn version(self) -> &'static str {
        "v1"
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Resource::Leases => "coordination.k8s.io/v1",
            Resource::EventsV1 => "events.k8s.io/v1",
            _ => "v1",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::Nodes => "Node",
            Resource::Leases => "Lease",
            Resource::Events | Resource::EventsV1 => "Event",
            Resource::ConfigMaps => "ConfigMap",
            Resource::Secrets => "Secret",
        }
    }

    /// The URL path segment (plural).
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::Nodes => "nodes",
            Resource::Leases => "leases",
            Resource::Events | Resource::EventsV1 => "events",
            Resource::ConfigMaps => "configmaps",
            Resource::Secrets => "secrets",
        }
    }

    pub fn namespaced(self) -> bool {
        self != Resource::Nodes
    }

    /// Whether writes to the object keep the old status and writes to `/status` keep the old spec.
    fn has_status(self) -> bool {
        matches!(self, Resource::Pods | Resource::Nodes)
    }

    /// `pods` or `leases.coordination.k8s.io`, as error messages name resources.
    fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            g => format!("{}.{g}", self.plural()),
        }
    }

    fn lookup(group: &str, version: &str, plural: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.group() == group && r.version() == version && r.plural() == plural)
    }
}

/// A k8s-openapi type the fake stores, for the typed handle methods.
pub trait Stored: k8s_openapi::Resource + Serialize + DeserializeOwned {
    const RESOURCE: Resource;
}

impl Stored for Pod {
    const RESOURCE: Resource = Resource::Pods;
}
impl Stored for Node {
    const RESOURCE: Resource = Resource::Nodes;
}
impl Stored for Lease {
    const RESOURCE: Resource = Resource::Leases;
}
impl Stored for Event {
    const RESOURCE: Resource = Resource::Events;
}
impl Stored for k8s_openapi::api::events::v1::Event {
    const RESOURCE: Resource = Resource::EventsV1;
}
impl Stored for k8s_openapi::api::core::v1::ConfigMap {
    const RESOURCE: Resource = Resource::ConfigMaps;
}
impl Stored for k8s_openapi::api::core::v1::Secret {
    const RESOURCE: Resource = Resource::Secrets;
}

/// One request the fake answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// `GET`, `POST`, `PUT`, `PATCH`, `DELETE`.
    pub method: String,
    /// The URL path, without the query.
    pub path: String,
    /// The raw (URL-encoded) query string, "" when none.
    pub query: String,
    pub content_type: Option<String>,
    /// The HTTP status answered (200 for a watch that started).
    pub status: u16,
}

impl RequestRecord {
    /// Whether this was a watch (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        self.query_param("watch").is_some_and(|w| w == "true" || w == "1")
    }

    /// A decoded query parameter.
    pub fn query_param(&self, name: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())
    }
}

struct Fault {
    method: String,
    pattern: String,
    remaining: usize,
    status: u16,
}

#[derive(Default)]
struct Control {
    down: bool,
    faults: Vec<Fault>,
    requests: VecDeque<RequestRecord>,
}

/// What the handle and the HTTP side share.
pub(crate) struct Shared {
    store: Mutex<Store>,
    control: Mutex<Control>,
    /// Bumped to end every open watch stream.
    close_tx: tokio::sync::watch::Sender<u64>,
    /// Bumped to make every open bookmark-enabled watch send a BOOKMARK.
    bookmark_tx: tokio::sync::watch::Sender<u64>,
    open_watches: AtomicUsize,
}

/// A poisoned lock only means a test panicked elsewhere; the data is still consistent enough to use.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    fn log(&self, record: RequestRecord) {
        let mut control = lock(&self.control);
        if control.requests.len() == REQUEST_LOG {
            control.requests.pop_front();
        }
        control.requests.push_back(record);
    }

    /// 503 while down, else the status of the first armed fault matching this request.
    fn injected_failure(&self, method: &str, path: &str, query: &str) -> Option<u16> {
        let mut control = lock(&self.control);
        if control.down {
            return Some(503);
        }
        let fault = control.faults.iter_mut().find(|f| {
            let target = if f.pattern.contains('?') { format!("{path}?{query}") } else { path.to_owned() };
            f.remaining > 0
                && (f.method == "*" || f.method.eq_ignore_ascii_case(method))
                && routes::glob_match(&f.pattern, &target)
        })?;
        fault.remaining -= 1;
        let status = fault.status;
        control.faults.retain(|f| f.remaining > 0);
        Some(status)
    }

    fn close_watches(&self) {
        self.close_tx.send_modify(|epoch| *epoch += 1);
    }
}

/// The fake API server and its test-side handle. Dropping it stops the server and ends every
/// connection. Handle methods are synchronous and may be called from any thread.
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.close_watches();
    }
}

impl FakeApiServer {
    /// Starts serving on 127.0.0.1 at a free port, on the current tokio runtime.
    pub async fn start() -> std::io::Result<FakeApiServer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            control: Mutex::new(Control::default()),
            close_tx: tokio::sync::watch::Sender::new(0),
            bookmark_tx: tokio::sync::watch::Sender::new(0),
            open_watches: AtomicUsize::new(0),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        tracing::debug!(%addr, "fake apiserver listening");
        Ok(FakeApiServer { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server: plain HTTP, no credentials (what gpuplace's `--apiserver URL`
    /// builds). Call inside a tokio runtime.
    pub fn client(&self) -> Result<kube::Client, kube::Error> {
        let uri: http::Uri = self.url().parse().map_err(|e: http::uri::InvalidUri| {
            kube::Error::Service(format!("fake apiserver URL {}: {e}", self.url()).into())
        })?;
        kube::Client::try_from(kube::Config::new(uri))
    }

    /// A kubeconfig (YAML) whose current context points at this server, for `--kubeconfig` tests.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    \
             user: fake\n    namespace: default\ncurrent-context: fake\n",
            self.url()
        )
    }

    // --- objects -------------------------------------------------------------------------------

    /// Creates or overwrites `obj` directly (no checks), as a controller elsewhere would: fills
    /// uid, creationTimestamp and resourceVersion, and emits ADDED or MODIFIED to watches.
    /// A namespaced object without a namespace goes to `default`. Returns the stored object.
    ///
    /// # Panics
    /// If `obj` has no `metadata.name`.
    pub fn put<K: Stored>(&self, obj: &K) -> K {
        from_value(self.put_value(K::RESOURCE, to_value(obj)))
    }

    /// [`put`](Self::put) for raw JSON.
    ///
    /// # Panics
    /// If `obj` has no `metadata.name`.
    pub fn put_value(&self, r: Resource, obj: Value) -> Value {
        let named = obj.pointer("/metadata/name").and_then(Value::as_str).is_some_and(|n| !n.is_empty());
        assert!(named, "FakeApiServer::put: the object has no metadata.name: {obj}");
        self.shared.store().put(r, obj)
    }

    /// The stored object (`namespace` is ignored for cluster-scoped kinds).
    pub fn get<K: Stored>(&self, namespace: &str, name: &str) -> Option<K> {
        self.get_value(K::RESOURCE, namespace, name).map(from_value)
    }

    pub fn get_value(&self, r: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store().get(&key(r, namespace, name)).cloned()
    }

    /// Every stored object of the kind, in (namespace, name) order.
    pub fn list<K: Stored>(&self) -> Vec<K> {
        self.list_values(K::RESOURCE).into_iter().map(from_value).collect()
    }

    pub fn list_values(&self, r: Resource) -> Vec<Value> {
        let everything = select::Selector::default();
        self.shared.store().list(r, None, &everything, None).cloned().collect()
    }

    /// Deletes the object (emitting DELETED); whether it existed.
    pub fn remove<K: Stored>(&self, namespace: &str, name: &str) -> bool {
        self.remove_value(K::RESOURCE, namespace, name).is_some()
    }

    pub fn remove_value(&self, r: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store().remove(key(r, namespace, name))
    }

    /// Every stored Event, `v1` and `events.k8s.io/v1` together, oldest first.
    pub fn events(&self) -> Vec<Value> {
        let mut events = self.list_values(Resource::Events);
        events.extend(self.list_values(Resource::EventsV1));
        // uids are issued in creation order, zero-padded.
        events.sort_by(|a, b| {
            a.pointer("/metadata/uid").map(Value::to_string).cmp(&b.pointer("/metadata/uid").map(Value::to_string))
        });
        events
    }

    /// The current (latest issued) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv
    }

    /// Forgets the change history: a watch resuming from an older version gets a 410 Expired
    /// ERROR event, and kube's watcher re-lists.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    // --- requests and faults -------------------------------------------------------------------

    /// Every request answered so far (the latest 10,000), in the order they were answered.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.control).requests.iter().cloned().collect()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.control).requests.clear();
    }

    /// While down, every request is answered 503 ServiceUnavailable; going down also closes open
    /// watches. Note that kube's client retries 503 (and 429, 504) itself with a short backoff
    /// from 5 ms, so a brief outage delays calls rather than failing them.
    pub fn set_down(&self, down: bool) {
        lock(&self.shared.control).down = down;
        if down {
            self.shared.close_watches();
        }
    }

    /// Fails the next `times` requests whose method is `method` (`"*"` for any) and whose path
    /// matches `path_glob` (`*` matches anything, `/` included; a pattern with `?` is matched against
    /// `path?query`) with `status` and a Status of the matching reason (409 Conflict, 500
    /// InternalError, ...). Faults are checked in the order they were added.
    pub fn fail_next(&self, method: &str, path_glob: &str, times: usize, status: u16) {
        lock(&self.shared.control).faults.push(Fault {
            method: method.to_owned(),
            pattern: path_glob.to_owned(),
            remaining: times,
            status,
        });
    }

    pub fn clear_faults(&self) {
        lock(&self.shared.control).faults.clear();
    }

    /// Ends every open watch stream, as an API server restart or a load balancer would.
    pub fn close_watches(&self) {
        self.shared.close_watches();
    }

    /// Makes every open watch that asked for bookmarks send one now, at the latest version it has seen.
    pub fn send_bookmarks(&self) {
        self.shared.bookmark_tx.send_modify(|epoch| *epoch += 1);
    }

    /// Watch streams now open.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Polls `cond` every few milliseconds until it holds or `timeout` passes; whether it held.
    pub async fn wait_until(&self, timeout: Duration, mut cond: impl FnMut(&FakeApiServer) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if cond(self) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

fn key(r: Resource, namespace: &str, name: &str) -> store::Key {
    (r, if r.namespaced() { namespace.to_owned() } else { String::new() }, name.to_owned())
}

fn to_value<K: Serialize>(obj: &K) -> Value {
    serde_json::to_value(obj)
        .unwrap_or_else(|e| panic!("FakeApiServer: serializing {}: {e}", std::any::type_name::<K>()))
}

fn from_value<K: DeserializeOwned>(v: Value) -> K {
    serde_json::from_value(v)
        .unwrap_or_else(|e| panic!("FakeApiServer: decoding a {}: {e}", std::any::type_name::<K>()))
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Owned here, so aborting this task (dropping the server) aborts every connection too.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let shared = shared.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |req| routes::handle(shared.clone(), req));
                        if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
                            tracing::debug!(error = %e, "fake apiserver connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fake apiserver accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_agree_with_k8s_openapi() {
        fn check<K: Stored>() {
            let r = K::RESOURCE;
            assert_eq!((r.api_version(), r.group(), r.version()), (K::API_VERSION, K::GROUP, K::VERSION));
            assert_eq!((r.kind(), r.plural()), (K::KIND, K::URL_PATH_SEGMENT));
        }
        check::<Pod>();
        check::<Node>();
        check::<Lease>();
        check::<Event>();
        check::<k8s_openapi::api::events::v1::Event>();
    }
}
