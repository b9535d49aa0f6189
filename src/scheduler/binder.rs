//! Carrying out a bind: the seam between the scheduler's decision and the API server.
//!
//! The scheduler decides (re-check, final GPUs, allocation counted at once) and then asks a
//! [`Binder`] to make it real: write the assignment annotation on the pod and create the pod's
//! `Binding`. The kube-rs binder (`k8s::binder::KubeBinder`) does both in one call, a Binding that
//! carries the annotation, which the registry applies atomically. In static mode
//! (`gpuplace serve --cluster`) there is no API server: [`RecordingBinder`] keeps what would have
//! been written, for tests and `/inspect`.
//!
//! Contract: `Err` means the pod is not bound and the binder left nothing behind (or undid what it
//! wrote); the scheduler then rolls its allocation back. The trait returns a boxed future, not an
//! `async fn`, so that it stays usable as `dyn Binder` without an extra crate.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

/// What to write for one bind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindRequest {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    /// Annotations to set on the pod with the Binding (the assignment; empty for a pod that asks
    /// for no gpuplace resources).
    pub annotations: BTreeMap<String, String>,
}

/// Why a bind could not be carried out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// The API server refused or failed a call (`status` is its HTTP status, when there was one).
    #[error("{call} for pod {pod}: {message}")]
    Api { call: &'static str, pod: String, status: Option<u16>, message: String },
    /// The binder is not in a state to bind (for example not the leader any more).
    #[error("cannot bind pod {pod}: {message}")]
    Unavailable { pod: String, message: String },
}

pub type BindFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BindError>> + Send + 'a>>;

/// Makes a bind decision real. See the module documentation for the contract.
pub trait Binder: Send + Sync + 'static {
    fn bind<'a>(&'a self, request: &'a BindRequest) -> BindFuture<'a>;
}

/// Static mode's binder: records every bind (latest per pod UID) and never fails.
#[derive(Debug, Default)]
pub struct RecordingBinder {
    bound: Mutex<BTreeMap<String, BindRequest>>,
}

impl RecordingBinder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every recorded bind, by pod UID.
    pub fn bindings(&self) -> BTreeMap<String, BindRequest> {
        // a poisoned lock only means another thread panicked while inserting; the map is still whole
        self.bound.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Binder for RecordingBinder {
    fn bind<'a>(&'a self, request: &'a BindRequest) -> BindFuture<'a> {
        Box::pin(async move {
            self.bound.lock().unwrap_or_else(|e| e.into_inner()).insert(request.uid.clone(), request.clone());
            Ok(())
        })
    }
}
