//! The fake API server's HTTP side: routing, the verbs, watch streams, fault injection.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::select::Selector;
use super::store::{ApiError, Change, ChangeKind, Key, Part, PatchKind, Store};
use super::{RequestRecord, Resource, Shared};

pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// The real server closes a watch after a random 30 to 60 minutes when the client names no timeout.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// Serves one request and logs it.
pub(crate) async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let content_type = req.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let response = match respond(&shared, req, &method, &path, &query, content_type.as_deref()).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    let status = response.status().as_u16();
    tracing::debug!(%method, %path, %query, status, "fake apiserver request");
    shared.log(RequestRecord { method: method.to_string(), path, query, content_type, status });
    Ok(response)
}

async fn respond(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    method: &Method,
    path: &str,
    query: &str,
    content_type: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    if let Some(code) = shared.injected_failure(method.as_str(), path, query) {
        let message = match code {
            503 => "the server is currently unable to handle the request".to_owned(),
            _ => format!("fake API server: injected failure {code}"),
        };
        return Err(ApiError::new(code, message));
    }
    let q: HashMap<String, String> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
    let body = req
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?
        .to_bytes();
    let json_body = || -> Result<Value, ApiError> {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("decoding the request body: {e}")))
    };

    let route = route(path)?;
    match (route, method.clone()) {
        (Route::Version, Method::GET) => Ok(json_response(200, &version())),
        (Route::Health, Method::GET) => Ok(text_response(200, "ok")),
        (Route::Collection { r, ns }, Method::GET) => {
            let sel =
                Selector::parse(q.get("labelSelector").map(String::as_str), q.get("fieldSelector").map(String::as_str))
                    .map_err(ApiError::bad_request)?;
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
                watch(shared, r, ns, sel, &q)
            } else {
                list(shared, r, ns.as_deref(), &sel, &q)
            }
        }
        // Namespaced kinds are created in a namespace; POST to the all-namespaces path is 405.
        (Route::Collection { r, ns }, Method::POST) if ns.is_some() || !r.namespaced() => {
            let obj = shared.store().create(r, ns.as_deref().unwrap_or_default(), json_body()?)?;
            Ok(json_response(201, &obj))
        }
        (Route::Object { key, part: _ }, Method::GET) => {
            let store = shared.store();
            let obj = store.get(&key).ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
            Ok(json_response(200, obj))
        }
        (Route::Object { key, part }, Method::PUT) => {
            let obj = shared.store().replace(key, part, json_body()?)?;
            Ok(json_response(200, &obj))
        }
        (Route::Object { key, part }, Method::PATCH) => {
            let kind = patch_kind(content_type)?;
            let patch = json_body()?;
            if kind == PatchKind::Json && !patch.is_array() {
                return Err(ApiError::bad_request("a JSON patch must be an array of operations"));
            }
            let (created, obj) = shared.store().patch(key, part, kind, &patch)?;
            Ok(json_response(if created { 201 } else { 200 }, &obj))
        }
        (Route::Object { key, part: Part::Main }, Method::DELETE) => {
            let options = if body.is_empty() { None } else { Some(json_body()?) };
            let obj = shared.store().delete(key, options.as_ref())?;
            Ok(json_response(200, &obj))
        }
        (Route::Binding { ns, name }, Method::POST) => {
            let binding = json_body()?;
            let name = match name {
                Some(name) => name,
                None => binding.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned(),
            };
            shared.store().bind((Resource::Pods, ns, name), &binding)?;
            Ok(json_response(
                201,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
            ))
        }
        (_, method) => Err(ApiError::new(
            405,
            format!("the server does not allow this method on the requested resource ({method} {path})"),
        )),
    }
}

enum Route {
    Version,
    Health,
    /// A collection; `ns` None lists across namespaces.
    Collection {
        r: Resource,
        ns: Option<String>,
    },
    Object {
        key: Key,
        part: Part,
    },
    /// `pods/{name}/binding`, or `namespaces/{ns}/bindings` (name from the body).
    Binding {
        ns: String,
        name: Option<String>,
    },
}

fn route(path: &str) -> Result<Route, ApiError> {
    let not_found = || ApiError::new(404, "the server could not find the requested resource");
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Ok(Route::Version),
        ["healthz" | "readyz" | "livez"] => return Ok(Route::Health),
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(not_found()),
    };
    let (ns, plural, tail) = match rest {
        ["namespaces", ns, plural, tail @ ..] => (Some(*ns), *plural, tail),
        [plural, tail @ ..] => (None, *plural, tail),
        [] => return Err(not_found()),
    };
    if (group, version, plural, tail) == ("", "v1", "bindings", &[][..]) {
        return ns.map(|ns| Route::Binding { ns: ns.to_owned(), name: None }).ok_or_else(not_found);
    }
    let r = Resource::lookup(group, version, plural).ok_or_else(not_found)?;
    if ns.is_some() != r.namespaced() && !(ns.is_none() && tail.is_empty()) {
        return Err(not_found());
    }
    let key = |name: &str| (r, ns.unwrap_or_default().to_owned(), name.to_owned());
    match tail {
        [] => Ok(Route::Collection { r, ns: ns.map(str::to_owned) }),
        [name] => Ok(Route::Object { key: key(name), part: Part::Main }),
        [name, "status"] if r.has_status() => Ok(Route::Object { key: key(name), part: Part::Status }),
        [name, "binding"] if r == Resource::Pods => {
            Ok(Route::Binding { ns: ns.unwrap_or_default().to_owned(), name: Some((*name).to_owned()) })
        }
        _ => Err(not_found()),
    }
}

fn patch_kind(content_type: Option<&str>) -> Result<PatchKind, ApiError> {
    let mime = content_type.unwrap_or("").split(';').next().unwrap_or("").trim();
    match mime {
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => Ok(PatchKind::Merge),
        "application/json-patch+json" => Ok(PatchKind::Json),
        "application/apply-patch+yaml" => Ok(PatchKind::Apply),
        other => Err(ApiError::new(
            415,
            format!(
                "the body of the request was in an unknown format ({other:?}) - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
            ),
        )),
    }
}

fn list(
    shared: &Shared,
    r: Resource,
    ns: Option<&str>,
    sel: &Selector,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => usize::MAX,
        Some(Ok(0)) => usize::MAX,
        Some(Ok(n)) => n,
        Some(Err(_)) => return Err(ApiError::bad_request("limit must be a non-negative integer")),
    };
    // The continue token is the (namespace, name) of the last item sent.
    let after = match q.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(token) => match token.split_once('/') {
            Some((n, name)) => Some((n.to_owned(), name.to_owned())),
            None => return Err(ApiError::new(410, "the provided continue parameter is too old").with_reason("Expired")),
        },
    };
    let store = shared.store();
    let mut items: Vec<Value> = store.list(r, ns, sel, after.as_ref()).take(limit.saturating_add(1)).cloned().collect();
    let mut metadata = json!({"resourceVersion": store.rv.to_string()});
    if items.len() > limit {
        items.truncate(limit);
        if let Some(last) = items.last() {
            let token = format!("{}/{}", meta(last, "namespace"), meta(last, "name"));
            metadata["continue"] = token.into();
        }
    }
    let body = json!({"kind": format!("{}List", r.kind()), "apiVersion": r.api_version(), "metadata": metadata, "items": items});
    Ok(json_response(200, &body))
}

fn meta<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj.get("metadata").and_then(|m| m.get(field)).and_then(Value::as_str).unwrap_or("")
}

/// Which changes one watch sends, and how.
struct WatchFilter {
    r: Resource,
    ns: Option<String>,
    sel: Selector,
}

impl WatchFilter {
    fn in_scope(&self, obj: &Value) -> bool {
        self.ns.as_deref().is_none_or(|ns| meta(obj, "namespace") == ns) && self.sel.matches(obj)
    }

    /// The line for `change`: an object that stops matching the selector is DELETED for this watch
    /// (its previous state at the change's version), one that starts matching is ADDED.
    fn line(&self, change: &Change) -> Option<Bytes> {
        if change.resource != self.r {
            return None;
        }
        let now = self.in_scope(&change.object);
        let before = change.previous.as_ref().is_some_and(|p| self.in_scope(p));
        match (change.kind, before, now) {
            (ChangeKind::Added, _, true) => Some(event_line("ADDED", &change.object)),
            (ChangeKind::Modified, true, true) => Some(event_line("MODIFIED", &change.object)),
            (ChangeKind::Modified, false, true) => Some(event_line("ADDED", &change.object)),
            (ChangeKind::Modified, true, false) => {
                let mut gone = change.previous.clone().unwrap_or(Value::Null);
                gone["metadata"]["resourceVersion"] = change.rv.to_string().into();
                Some(event_line("DELETED", &gone))
            }
            (ChangeKind::Deleted, _, true) => Some(event_line("DELETED", &change.object)),
            _ => None,
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        event_line(
            "BOOKMARK",
            &json!({"kind": self.r.kind(), "apiVersion": self.r.api_version(), "metadata": metadata}),
        )
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn watch(
    shared: &Arc<Shared>,
    r: Resource,
    ns: Option<String>,
    sel: Selector,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let flag = |name: &str| matches!(q.get(name).map(String::as_str), Some("true" | "1"));
    let bookmarks = flag("allowWatchBookmarks");
    let send_initial = flag("sendInitialEvents");
    let timeout = match q.get("timeoutSeconds").map(|t| t.parse::<u64>()) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(Ok(secs)) => Duration::from_secs(secs),
        Some(Err(_)) => return Err(ApiError::bad_request("timeoutSeconds must be a non-negative integer")),
    };
    let from = match q.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(rv) => {
            Some(rv.parse::<u64>().map_err(|_| ApiError::bad_request(format!("invalid resource version {rv:?}")))?)
        }
    };
    let filter = WatchFilter { r, ns, sel };
    let mut initial = Vec::new();
    let mut ends_now = false;
    // Subscribe under the store's lock: no change falls between the replay and the live feed.
    let (seen, rx) = {
        let store = shared.store();
        match from {
            // "Start at most recent" and streaming lists: the current state as ADDED first.
            None => initial_state(&store, &filter, send_initial && bookmarks, &mut initial),
            Some(_) if send_initial => initial_state(&store, &filter, bookmarks, &mut initial),
            Some(rv) => match store.history_after(rv) {
                Some(changes) => initial.extend(changes.iter().filter_map(|c| filter.line(c))),
                None => {
                    let status = ApiError::new(410, format!("too old resource version: {rv} ({})", store.compacted))
                        .with_reason("Expired")
                        .status();
                    initial.push(event_line("ERROR", &status));
                    ends_now = true;
                }
            },
        }
        (store.rv, store.subscribe())
    };
    let (tx, body_rx) = mpsc::channel(64);
    let stream = WatchStream {
        filter,
        seen,
        bookmarks,
        deadline: tokio::time::Instant::now() + timeout,
        close_rx: shared.close_tx.subscribe(),
        bookmark_rx: shared.bookmark_tx.subscribe(),
    };
    shared.open_watches.fetch_add(1, Ordering::SeqCst);
    tokio::spawn(stream.run(shared.clone(), initial, ends_now, rx, tx));
    let mut response = Response::new(ChannelBody(body_rx).boxed());
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

/// A watch that starts from the current state: every object as ADDED, then (streaming lists) the
/// bookmark that marks the end of the initial events.
fn initial_state(store: &Store, filter: &WatchFilter, end_bookmark: bool, lines: &mut Vec<Bytes>) {
    lines.extend(store.list(filter.r, filter.ns.as_deref(), &filter.sel, None).map(|o| event_line("ADDED", o)));
    if end_bookmark {
        lines.push(filter.bookmark(store.rv, true));
    }
}

struct WatchStream {
    filter: WatchFilter,
    /// Every change up to this version has been sent or filtered out: a bookmark may name it.
    seen: u64,
    bookmarks: bool,
    deadline: tokio::time::Instant,
    close_rx: tokio::sync::watch::Receiver<u64>,
    bookmark_rx: tokio::sync::watch::Receiver<u64>,
}

impl WatchStream {
    async fn run(
        mut self,
        shared: Arc<Shared>,
        initial: Vec<Bytes>,
        ends_now: bool,
        rx: broadcast::Receiver<Arc<Change>>,
        tx: mpsc::Sender<Bytes>,
    ) {
        self.feed(initial, ends_now, rx, &tx).await;
        shared.open_watches.fetch_sub(1, Ordering::SeqCst);
    }

    async fn feed(
        &mut self,
        initial: Vec<Bytes>,
        ends_now: bool,
        mut rx: broadcast::Receiver<Arc<Change>>,
        tx: &mpsc::Sender<Bytes>,
    ) {
        for line in initial {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        if ends_now {
            return;
        }
        self.close_rx.borrow_and_update();
        self.bookmark_rx.borrow_and_update();
        loop {
            let line = tokio::select! {
                // Closing wins over a change that arrived at the same time, so a test that closes
                // and then writes sees the write through the resumed watch.
                biased;
                _ = self.close_rx.changed() => return,
                _ = tx.closed() => return,
                _ = tokio::time::sleep_until(self.deadline) => {
                    // As the real server does before a timeout, so the client resumes from here.
                    if self.bookmarks {
                        let _ = tx.send(self.filter.bookmark(self.seen, false)).await;
                    }
                    return;
                }
                changed = self.bookmark_rx.changed() => {
                    if changed.is_err() || !self.bookmarks {
                        continue;
                    }
                    self.filter.bookmark(self.seen, false)
                }
                received = rx.recv() => match received {
                    Ok(change) if change.rv > self.seen => {
                        self.seen = change.rv;
                        match self.filter.line(&change) {
                            Some(line) => line,
                            None => continue,
                        }
                    }
                    Ok(_) => continue,
                    // Fell behind, or the server is going away: the client resumes from its last
                    // version, replayed from history.
                    Err(_) => return,
                },
            };
            if tx.send(line).await.is_err() {
                return;
            }
        }
    }
}

/// A streamed response body fed by a channel (one watch event per chunk).
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|line| line.map(|l| Ok(Frame::data(l))))
    }
}

fn version() -> Value {
    json!({
        "major": "1", "minor": "36", "gitVersion": "v1.36.0-gpuplace-fake", "gitCommit": "",
        "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z", "goVersion": "go1.25",
        "compiler": "gc", "platform": "linux/amd64",
    })
}

fn with_status(mut response: Response<Body>, code: u16, content_type: &'static str) -> Response<Body> {
    *response.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    with_status(Response::new(Full::new(Bytes::from(bytes)).boxed()), code, "application/json")
}

fn text_response(code: u16, body: &'static str) -> Response<Body> {
    with_status(Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed()), code, "text/plain")
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.status())
}

/// `*` matches any run of characters, `/` included.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == text;
    };
    let Some(mut remaining) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    for (i, part) in parts.iter().enumerate() {
        if i == parts.len() - 1 {
            return remaining.ends_with(part);
        }
        match remaining.find(part) {
            Some(at) => remaining = &remaining[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("/api/v1/pods", "/api/v1/pods"));
        assert!(!glob_match("/api/v1/pods", "/api/v1/pods/x"));
        assert!(glob_match("/api/v1/namespaces/*/pods/*/binding", "/api/v1/namespaces/ns/pods/p/binding"));
        assert!(!glob_match("/api/v1/namespaces/*/pods/*/binding", "/api/v1/namespaces/ns/pods/p"));
        assert!(glob_match("*", "/anything"));
        assert!(glob_match("/api/v1/pods?*watch=true*", "/api/v1/pods?watch=true&x=1"));
        assert!(glob_match("*leases*", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l"));
    }

    #[test]
    fn routes() {
        let obj = |p: &str| match route(p) {
            Ok(Route::Object { key, part }) => Some((key.0, key.1, key.2, part)),
            _ => None,
        };
        assert_eq!(obj("/api/v1/namespaces/ns/pods/p"), Some((Resource::Pods, "ns".into(), "p".into(), Part::Main)));
        assert_eq!(obj("/api/v1/nodes/n/status"), Some((Resource::Nodes, "".into(), "n".into(), Part::Status)));
        assert!(obj("/api/v1/pods/p").is_none());
        assert!(obj("/api/v1/namespaces/ns/nodes/n").is_none());
        assert!(matches!(route("/api/v1/pods"), Ok(Route::Collection { r: Resource::Pods, ns: None })));
        assert!(matches!(route("/api/v1/namespaces/ns/pods/p/binding"), Ok(Route::Binding { .. })));
        assert!(matches!(route("/api/v1/namespaces/ns/bindings"), Ok(Route::Binding { name: None, .. })));
        assert!(matches!(
            route("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l"),
            Ok(Route::Object { key: (Resource::Leases, _, _), .. })
        ));
        assert!(route("/apis/apps/v1/deployments").is_err());
        assert!(route("/api/v1/namespaces/ns/leases").is_err());
    }
}
