//! The books on the API server (`scheduler::books`): one ConfigMap per node in the extender's
//! namespace, `gpuplace-books-<node>`, labelled `gpuplace.io/books=true`, holding the signed record
//! of every pod gpuplace counts on that node. Tenants cannot write there (RBAC gives them nothing in
//! gpuplace's namespace, and the extender's admission policy lets only the extender write those
//! names), so a record survives whatever a client does to the pod's annotations.
//!
//! - At start, every replica lists the books before its rebuild ([`load`], retried until the API
//!   server answers): a running pod whose annotation is missing or not trusted is counted from its
//!   book, and reported (`pods::rebuild`).
//! - The leader keeps the books current ([`run`]): every [`TICK`] it writes the books of the nodes
//!   whose records changed (an unconditional PUT of the whole book, created when absent), comparing
//!   with what it last wrote or listed, so an unchanged book costs no request; a new leader lists
//!   them first and compares all. It also writes back the record of every pod whose annotation was
//!   erased or rewritten (`resign::write_assignment`, as re-signing does).
//!
//! A bind is in the pod's annotation at once and in the book within a tick: a record erased within
//! that second, and followed by a restart before the tick, is the one the books cannot restore.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::k8s::leader::Leadership;
use crate::k8s::resign::{write_assignment, AssignmentWrite};
use crate::scheduler::books::{books_name, decode, encode, KeptRecords, NodeBook, BOOKS_LABEL};
use crate::scheduler::service::books::PutBack;
use crate::scheduler::Scheduler;

/// How often the leader writes the books that changed.
pub const TICK: Duration = Duration::from_secs(1);
/// How often the leader lists the books again, to repair one changed or deleted by someone else.
pub const RELIST_EVERY: Duration = Duration::from_secs(600);
/// Records written back on pods per tick.
const PUT_BACK_BATCH: usize = 100;

fn selector() -> ListParams {
    ListParams::default().labels(&format!("{BOOKS_LABEL}=true"))
}

/// Every node's book as written, by node. A ConfigMap that cannot be read whole is logged; the
/// entries it could read still count.
async fn list(api: &Api<ConfigMap>) -> Result<HashMap<String, NodeBook>, kube::Error> {
    let mut books = HashMap::new();
    for cm in api.list(&selector()).await?.items {
        let name = cm.metadata.name.clone().unwrap_or_default();
        match decode(&cm.data.unwrap_or_default()) {
            Ok((node, book, bad)) => {
                for e in bad {
                    tracing::warn!(configmap = %name, error = %e, "a record of the books is not readable; skipped");
                }
                books.insert(node, book);
            }
            Err(e) => tracing::warn!(configmap = %name, error = %e, "books ConfigMap not readable; skipped"),
        }
    }
    Ok(books)
}

/// The books for a rebuild, listed once; retried until the API server answers (a rebuild without
/// them would forget the GPUs of pods whose annotation was erased).
pub async fn load(api: &Api<ConfigMap>) -> KeptRecords {
    let mut wait = Duration::from_millis(200);
    loop {
        match list(api).await {
            Ok(books) => {
                let kept = KeptRecords::from_books(books);
                tracing::info!(records = kept.len(), "books listed for the rebuild");
                return kept;
            }
            Err(e) => {
                tracing::error!(error = %e, "listing gpuplace's books failed (RBAC: configmaps list in the extender's namespace); the rebuild waits for them");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// The ConfigMap of `node`'s book.
fn object(node: &str, book: &NodeBook) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(books_name(node)),
            labels: Some(BTreeMap::from([
                (BOOKS_LABEL.to_string(), "true".to_string()),
                ("app.kubernetes.io/part-of".to_string(), "gpuplace".to_string()),
            ])),
            ..ObjectMeta::default()
        },
        data: Some(encode(node, book)),
        ..ConfigMap::default()
    }
}

/// Writes `node`'s book whole: an unconditional replace (the leader is its only writer), created
/// when absent.
async fn write(api: &Api<ConfigMap>, node: &str, book: &NodeBook) -> Result<(), kube::Error> {
    let cm = object(node, book);
    let name = books_name(node);
    match api.replace(&name, &PostParams::default(), &cm).await {
        Ok(_) => Ok(()),
        // a 409 here (created meanwhile by a former leader's last write) is retried at the next tick
        Err(kube::Error::Api(s)) if s.code == 404 => api.create(&PostParams::default(), &cm).await.map(|_| ()),
        Err(e) => Err(e),
    }
}

/// Writes one record back on its pod; whether it is done with (written, or the pod is gone).
async fn put_back_one(client: &Client, p: &PutBack) -> bool {
    match write_assignment(client, &p.namespace, &p.name, &p.uid, &p.assignment).await {
        AssignmentWrite::Written => {
            tracing::info!(pod = %p.name, namespace = %p.namespace, "assignment written back on the pod from gpuplace's books");
            true
        }
        AssignmentWrite::Gone(_) => true,
        AssignmentWrite::Failed(e) => {
            tracing::warn!(pod = %p.name, namespace = %p.namespace, error = %e, "writing the assignment back failed; retried next tick");
            false
        }
    }
}

/// The leader's writer, forever: the books that changed every [`TICK`], all of them compared after
/// taking the lead and every [`RELIST_EVERY`], and the records to put back on pods.
pub async fn run(client: Client, api: Api<ConfigMap>, ext: Arc<Scheduler>, leadership: Arc<Leadership>) {
    // what is written, by node; `None` until listed as this replica's lead began
    let mut written: Option<HashMap<String, NodeBook>> = None;
    let mut listed_at = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        if !(ext.is_ready() && leadership.is_leader()) {
            written = None;
            continue;
        }
        if written.is_none() || listed_at.elapsed() >= RELIST_EVERY {
            match list(&api).await {
                Ok(books) => {
                    written = Some(books);
                    listed_at = tokio::time::Instant::now();
                    ext.books_mark_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "listing gpuplace's books failed; retried next tick");
                    continue;
                }
            }
        }
        let Some(known) = written.as_mut() else { continue };
        let empty = NodeBook::new();
        let mut writes = 0;
        for (node, book) in ext.books_due() {
            if known.get(&node).unwrap_or(&empty) == &book {
                continue;
            }
            match write(&api, &node, &book).await {
                Ok(()) => {
                    writes += 1;
                    known.insert(node, book);
                }
                Err(e) => {
                    tracing::warn!(node = %node, error = %e, "writing gpuplace's book of the node failed; retried next tick");
                    ext.books_retry(&node);
                }
            }
        }
        if writes > 0 {
            tracing::debug!(writes, "books written");
        }
        for p in ext.records_to_put_back(PUT_BACK_BATCH) {
            if !leadership.is_leader() {
                break;
            }
            if put_back_one(&client, &p).await {
                ext.put_back(&p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_books_object_is_labelled_and_named_for_its_node() {
        let cm = object("gpu-00", &NodeBook::new());
        assert_eq!(cm.metadata.name.as_deref(), Some("gpuplace-books-gpu-00"));
        assert_eq!(cm.metadata.labels.as_ref().and_then(|l| l.get(BOOKS_LABEL)).map(String::as_str), Some("true"));
        assert_eq!(cm.data.as_ref().and_then(|d| d.get("node")).map(String::as_str), Some("gpu-00"));
    }
}
