//! What every watcher of the extender shares: reading the next event of a kube-rs watch.

use futures::stream::BoxStream;
use futures::StreamExt;
use kube::runtime::watcher::{self, Event};

use crate::scheduler::metrics::Watched;
use crate::scheduler::Scheduler;
use gpuplace_core::clock::now_unix_ms;

/// The next event of a watch (`None` when the stream ends): a failure is counted and logged and
/// the watcher's backoff retries it; an event marks the watch fresh.
pub(crate) async fn next_event<K>(
    stream: &mut BoxStream<'static, Result<Event<K>, watcher::Error>>,
    ext: &Scheduler,
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
