//! The Kubernetes API: building a client ([`connect()`]) and the extender's API-server mode as thin adapters around
//! [`Extender`], one concern each: [`binder`] (one Binding
//! that carries the assignment annotation), [`nodes`], [`pods`], [`utilization`] and [`pod_groups`] (watchers), [`leader`] (Lease election),
//! [`events`] (Kubernetes Events), [`keys`] (the assignment key Secret), [`resign`] (re-signing after
//! a key rotation), [`stale`] (assignments left on unbound pods), [`requeue`] (pending pods sent back
//! to kube-scheduler's queue when GPUs are freed), [`run`] (wiring and readiness).
//! Named `apiserver`, not `kube`, so the `kube` crate stays visible.

pub mod binder;
pub mod connect;
pub mod events;
pub mod keys;
pub mod leader;
pub mod nodes;
pub mod pod_groups;
pub mod pods;
pub mod requeue;
pub mod resign;
pub mod run;
pub mod stale;
pub mod utilization;

use futures::stream::BoxStream;
use futures::StreamExt;
use kube::runtime::watcher::{self, Event};

use crate::extender::clock::now_unix_ms;
use crate::extender::metrics::Watched;
use crate::extender::service::Extender;

pub use binder::KubeBinder;
pub use connect::{client_for_url, connect, ConnectArgs, ConnectError, Source};
pub use leader::{LeaderConfig, Leadership};
pub use run::{ApiOptions, Controller, DedicatedClient};

/// The next event of a watch (`None` when the stream ends): a failure is counted and logged and
/// the watcher's backoff retries it; an event marks the watch fresh.
pub(crate) async fn next_event<K>(
    stream: &mut BoxStream<'static, Result<Event<K>, watcher::Error>>,
    ext: &Extender,
    watched: Watched,
) -> Option<Event<K>> {
    loop {
        match stream.next().await? {
            Ok(ev) => {
                ext.metrics().watch_fresh(watched, now_unix_ms());
                return Some(ev);
            }
            Err(e) => {
                ext.metrics().watch_error(watched);
                tracing::warn!(error = %e, watch = watched.name(), "watch failed; retrying");
            }
        }
    }
}
