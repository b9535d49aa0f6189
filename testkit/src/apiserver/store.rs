//! The fake API server's object store: objects as JSON, one global resourceVersion, the change
//! history watches replay from, and the write verbs with the real server's checks.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Map, Value};
use tokio::sync::broadcast;

use super::select::Selector;
use super::Resource;

/// Changes kept for watches that resume from an older resourceVersion; older ones get 410 Gone.
const HISTORY: usize = 10_000;

/// (resource, namespace or "" for cluster-scoped, name)
pub(crate) type Key = (Resource, String, String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One committed change, as watches see it.
#[derive(Debug)]
pub(crate) struct Change {
    pub rv: u64,
    pub resource: Resource,
    pub kind: ChangeKind,
    /// The object after the change (for a deletion: its last state, at the deletion's version).
    pub object: Value,
    /// The object before the change, so a selector watch can turn "stopped matching" into DELETED.
    pub previous: Option<Value>,
}

/// An API error: becomes a `Status` object with this code and reason.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    pub(crate) fn new(code: u16, message: impl Into<String>) -> ApiError {
        ApiError { code, reason: reason_for(code), message: message.into(), details: None }
    }

    fn with_details(mut self, resource: &str, name: &str) -> ApiError {
        self.details = Some(json!({"name": name, "kind": resource}));
        self
    }

    pub(crate) fn not_found(r: Resource, name: &str) -> ApiError {
        ApiError::new(404, format!("{} {name:?} not found", r.qualified())).with_details(r.plural(), name)
    }

    fn already_exists(r: Resource, name: &str) -> ApiError {
        ApiError::new(409, format!("{} {name:?} already exists", r.qualified()))
            .with_reason("AlreadyExists")
            .with_details(r.plural(), name)
    }

    fn conflict(what: &str, name: &str, why: &str) -> ApiError {
        ApiError::new(409, format!("Operation cannot be fulfilled on {what} {name:?}: {why}")).with_details(what, name)
    }

    fn stale(r: Resource, name: &str) -> ApiError {
        ApiError::conflict(
            &r.qualified(),
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
        .with_details(r.plural(), name)
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, message)
    }

    fn invalid(r: Resource, name: &str, why: &str) -> ApiError {
        ApiError::new(422, format!("{} {name:?} is invalid: {why}", r.kind())).with_details(r.plural(), name)
    }

    pub(crate) fn with_reason(mut self, reason: &'static str) -> ApiError {
        self.reason = reason;
        self
    }

    /// The `Status` object the real API server sends.
    pub(crate) fn status(&self) -> Value {
        let mut s = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

/// The `reason` the API server gives with each status code (metav1.StatusReason).
pub(crate) fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

/// What a write applies to: the object, or its `status` subresource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Main,
    Status,
}

/// Patch flavours, by Content-Type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PatchKind {
    /// RFC 7386; also strategic merge (no list merge keys) and server-side apply (no field ownership).
    Merge,
    /// RFC 6902.
    Json,
    /// Server-side apply: a merge that creates the object if it is missing.
    Apply,
}

pub(crate) struct Store {
    pub rv: u64,
    /// Changes at or below this version are no longer in `history`.
    pub compacted: u64,
    uid_seq: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Change>>,
    /// Sent under the store's lock, so watchers receive changes in version order.
    tx: broadcast::Sender<Arc<Change>>,
}

fn now() -> Value {
    serde_json::to_value(Time(Timestamp::now())).unwrap_or(Value::Null)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn metadata_mut(obj: &mut Value) -> Option<&mut Map<String, Value>> {
    let map = obj.as_object_mut()?;
    map.entry("metadata").or_insert_with(|| json!({})).as_object_mut()
}

impl Store {
    pub(crate) fn new() -> Store {
        // Large enough that a watcher falls behind only when it stops reading; one that does is
        // closed and resumes from `history`.
        let (tx, _) = broadcast::channel(4096);
        Store { rv: 1, compacted: 0, uid_seq: 0, objects: BTreeMap::new(), history: VecDeque::new(), tx }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<Change>> {
        self.tx.subscribe()
    }

    pub(crate) fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    /// Objects of `r` (in `ns` when given) matching `sel`, in (namespace, name) order, after `after`.
    pub(crate) fn list<'a>(
        &'a self,
        r: Resource,
        ns: Option<&'a str>,
        sel: &'a Selector,
        after: Option<&'a (String, String)>,
    ) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects
            .range((r, String::new(), String::new())..)
            .take_while(move |((res, _, _), _)| *res == r)
            .filter(move |((_, n, name), _)| {
                ns.is_none_or(|ns| ns == n) && after.is_none_or(|(an, aname)| (n, name) > (an, aname))
            })
            .map(|(_, v)| v)
            .filter(move |v| sel.matches(v))
    }

    /// Changes after `rv`, or None when some of them were already compacted away.
    pub(crate) fn history_after(&self, rv: u64) -> Option<Vec<Arc<Change>>> {
        if rv < self.compacted {
            return None;
        }
        Some(self.history.iter().filter(|c| c.rv > rv).cloned().collect())
    }

    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    fn commit(&mut self, key: Key, kind: ChangeKind, mut object: Value, previous: Option<Value>) -> Value {
        self.rv += 1;
        if let Some(meta) = metadata_mut(&mut object) {
            meta.insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        }
        match kind {
            ChangeKind::Deleted => {
                self.objects.remove(&key);
            }
            ChangeKind::Added | ChangeKind::Modified => {
                self.objects.insert(key.clone(), object.clone());
            }
        }
        let change = Arc::new(Change { rv: self.rv, resource: key.0, kind, object: object.clone(), previous });
        if self.history.len() == HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        self.history.push_back(change.clone());
        // No receivers is fine: nobody is watching.
        let _ = self.tx.send(change);
        tracing::trace!(rv = self.rv, resource = key.0.plural(), ns = %key.1, name = %key.2, ?kind, "fake apiserver commit");
        object
    }

    /// Fills what the server sets on creation: type, namespace, uid, creationTimestamp.
    fn stamp_new(&mut self, r: Resource, ns: &str, obj: &mut Value) {
        self.uid_seq += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", self.uid_seq);
        if let Some(map) = obj.as_object_mut() {
            map.insert("apiVersion".into(), r.api_version().into());
            map.insert("kind".into(), r.kind().into());
        }
        if let Some(meta) = metadata_mut(obj) {
            if r.namespaced() {
                meta.insert("namespace".into(), ns.into());
            } else {
                meta.remove("namespace");
            }
            meta.insert("uid".into(), uid.into());
            meta.insert("creationTimestamp".into(), now());
            meta.remove("resourceVersion");
        }
    }

    /// POST to a collection.
    pub(crate) fn create(&mut self, r: Resource, ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        match meta_str(&obj, "namespace") {
            Some(n) if r.namespaced() && !n.is_empty() && n != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ))
            }
            _ => {}
        }
        let name = match (meta_str(&obj, "name").filter(|n| !n.is_empty()), meta_str(&obj, "generateName")) {
            (Some(name), _) => name.to_owned(),
            (None, Some(prefix)) => format!("{prefix}{:05x}", self.uid_seq + 1),
            (None, None) => {
                return Err(ApiError::invalid(r, "", "metadata.name: Required value: name or generateName is required"))
            }
        };
        let key = (r, if r.namespaced() { ns.to_owned() } else { String::new() }, name.clone());
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(r, &name));
        }
        if let Some(meta) = metadata_mut(&mut obj) {
            meta.insert("name".into(), name.into());
        }
        self.stamp_new(r, ns, &mut obj);
        Ok(self.commit(key, ChangeKind::Added, obj, None))
    }

    /// PUT to an object (or its status): optimistic concurrency on metadata.resourceVersion.
    pub(crate) fn replace(&mut self, key: Key, part: Part, new: Value) -> Result<Value, ApiError> {
        let old = self.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
        if let Some(name) = meta_str(&new, "name").filter(|n| *n != key.2) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({name}) does not match the name on the URL ({})",
                key.2
            )));
        }
        self.update(key, part, old, new)
    }

    /// PATCH an object (or its status). Returns whether the object was created (apply only).
    pub(crate) fn patch(
        &mut self,
        key: Key,
        part: Part,
        kind: PatchKind,
        patch: &Value,
    ) -> Result<(bool, Value), ApiError> {
        let old = match (self.objects.get(&key).cloned(), kind) {
            (Some(old), _) => old,
            (None, PatchKind::Apply) if part == Part::Main => {
                let mut obj = json!({"metadata": {"name": key.2}});
                json_patch::merge(&mut obj, patch);
                return self.create(key.0, &key.1, obj).map(|o| (true, o));
            }
            (None, _) => return Err(ApiError::not_found(key.0, &key.2)),
        };
        let mut new = old.clone();
        // The version a patch carries is a precondition, checked against the stored one below.
        if let Some(meta) = metadata_mut(&mut new) {
            meta.remove("resourceVersion");
        }
        match kind {
            PatchKind::Merge | PatchKind::Apply => json_patch::merge(&mut new, patch),
            PatchKind::Json => {
                let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                    .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
                // On the stored object, version included: a `test` or `replace` of
                // metadata.resourceVersion is a precondition, checked by `update`.
                new = old.clone();
                json_patch::patch(&mut new, &ops).map_err(|e| ApiError::invalid(key.0, &key.2, &e.to_string()))?;
            }
        }
        self.update(key, part, old, new).map(|o| (false, o))
    }

    /// The checks and rules shared by PUT and PATCH; a change that changes nothing commits nothing.
    fn update(&mut self, key: Key, part: Part, old: Value, mut new: Value) -> Result<Value, ApiError> {
        let r = key.0;
        if !new.is_object() {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or_default().to_owned();
        if let Some(rv) = meta_str(&new, "resourceVersion").filter(|rv| !rv.is_empty()) {
            if rv != old_rv {
                return Err(ApiError::stale(r, &key.2));
            }
        }
        // A UID in the body is a precondition, as in the real registry: a patch or update meant for
        // a pod that was deleted and re-created under the same name must not land on the new one.
        if let Some(uid) = meta_str(&new, "uid").filter(|u| !u.is_empty()) {
            let have = meta_str(&old, "uid").unwrap_or_default();
            if uid != have {
                return Err(ApiError::conflict(
                    &r.qualified(),
                    &key.2,
                    &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {have}"),
                ));
            }
        }
        // Identity and server-set fields are the server's, whatever the body says.
        if let (Some(meta), Some(old_meta)) = (metadata_mut(&mut new), old.get("metadata")) {
            for field in ["name", "namespace", "uid", "creationTimestamp"] {
                match old_meta.get(field) {
                    Some(v) => meta.insert(field.into(), v.clone()),
                    None => meta.remove(field),
                };
            }
            meta.insert("resourceVersion".into(), old_rv.into());
        }
        if let Some(map) = new.as_object_mut() {
            map.insert("apiVersion".into(), r.api_version().into());
            map.insert("kind".into(), r.kind().into());
            // Pods and Nodes: the object ignores status changes and the status subresource ignores
            // everything but status and metadata, as the real registry strategies do.
            if r.has_status() {
                let keep = if part == Part::Status { "spec" } else { "status" };
                match old.get(keep) {
                    Some(v) => map.insert(keep.into(), v.clone()),
                    None => map.remove(keep),
                };
            }
        }
        if new == old {
            return Ok(old);
        }
        Ok(self.commit(key, ChangeKind::Modified, new, Some(old)))
    }

    /// DELETE, with the optional preconditions of a DeleteOptions body.
    pub(crate) fn delete(&mut self, key: Key, options: Option<&Value>) -> Result<Value, ApiError> {
        let old = self.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
        let pre = options.and_then(|o| o.get("preconditions"));
        for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            if let Some(want) = pre.and_then(|p| p.get(field)).and_then(Value::as_str) {
                let have = meta_str(&old, field).unwrap_or_default();
                if want != have {
                    return Err(ApiError::conflict(
                        &key.0.qualified(),
                        &key.2,
                        &format!(
                            "Precondition failed: {label} in precondition: {want}, {label} in object meta: {have}"
                        ),
                    ));
                }
            }
        }
        Ok(self.commit(key, ChangeKind::Deleted, old.clone(), Some(old)))
    }

    /// A Binding for pod `key`: sets spec.nodeName, copies the Binding's annotations and marks the pod
    /// scheduled. A pod that already has a node is a conflict, even for the same node, as in the real
    /// registry.
    pub(crate) fn bind(&mut self, key: Key, binding: &Value) -> Result<(), ApiError> {
        let node = binding.pointer("/target/name").and_then(Value::as_str).unwrap_or_default();
        if node.is_empty() {
            return Err(ApiError::invalid(Resource::Pods, &key.2, "target.name: Required value"));
        }
        let old = self.objects.get(&key).cloned().ok_or_else(|| ApiError::not_found(Resource::Pods, &key.2))?;
        // the Binding's UID, when given, is a precondition (as in the real registry)
        let want_uid = binding.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or_default();
        let have_uid = meta_str(&old, "uid").unwrap_or_default();
        if !want_uid.is_empty() && want_uid != have_uid {
            return Err(ApiError::conflict(
                "pods/binding",
                &key.2,
                &format!("Precondition failed: UID in precondition: {want_uid}, UID in object meta: {have_uid}"),
            ));
        }
        let current = old.pointer("/spec/nodeName").and_then(Value::as_str).unwrap_or_default();
        if !current.is_empty() {
            return Err(ApiError::conflict(
                "pods/binding",
                &key.2,
                &format!("pod {} is already assigned to node {current:?}", key.2),
            ));
        }
        if old.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::new(500, format!("pod {} is being deleted, cannot be assigned to a host", key.2)));
        }
        let mut new = old.clone();
        new["spec"]["nodeName"] = node.into();
        if let Some(annotations) = binding.pointer("/metadata/annotations").and_then(Value::as_object) {
            if let Some(meta) = metadata_mut(&mut new) {
                let target = meta.entry("annotations").or_insert_with(|| json!({}));
                for (k, v) in annotations {
                    target[k] = v.clone();
                }
            }
        }
        let condition = json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": now()});
        let conditions = &mut new["status"]["conditions"];
        match conditions.as_array_mut() {
            Some(list) => {
                list.retain(|c| c.get("type").and_then(Value::as_str) != Some("PodScheduled"));
                list.push(condition);
            }
            None => *conditions = json!([condition]),
        }
        self.commit(key, ChangeKind::Modified, new, Some(old));
        Ok(())
    }

    /// Test side: create or overwrite, with no checks; server-set fields are filled as on create.
    pub(crate) fn put(&mut self, r: Resource, mut obj: Value) -> Value {
        let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
        let ns =
            if r.namespaced() { meta_str(&obj, "namespace").unwrap_or("default").to_owned() } else { String::new() };
        let key = (r, ns.clone(), name);
        match self.objects.get(&key).cloned() {
            Some(old) => {
                if let (Some(meta), Some(old_meta)) = (metadata_mut(&mut obj), old.get("metadata")) {
                    for field in ["uid", "creationTimestamp"] {
                        if let Some(v) = old_meta.get(field) {
                            meta.insert(field.into(), v.clone());
                        }
                    }
                    if r.namespaced() {
                        meta.insert("namespace".into(), ns.into());
                    }
                }
                if let Some(map) = obj.as_object_mut() {
                    map.insert("apiVersion".into(), r.api_version().into());
                    map.insert("kind".into(), r.kind().into());
                }
                self.commit(key, ChangeKind::Modified, obj, Some(old))
            }
            None => {
                self.stamp_new(r, &ns, &mut obj);
                self.commit(key, ChangeKind::Added, obj, None)
            }
        }
    }

    /// Test side: delete if present.
    pub(crate) fn remove(&mut self, key: Key) -> Option<Value> {
        let old = self.objects.get(&key).cloned()?;
        Some(self.commit(key, ChangeKind::Deleted, old.clone(), Some(old)))
    }
}
