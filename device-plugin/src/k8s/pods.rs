//! This node's pods, watched (`spec.nodeName=<node>`) into a reflector cache: the assignments mode
//! reads its pods from it, the guard in DRA mode its containers' claims. A watch error is counted
//! (`pods_watch`), logged once per outage and retried with backoff.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use tokio::task::JoinHandle;

use crate::sampler::Telemetry;

/// Starts the watch; the store fills as it runs. Needs a tokio runtime; abort the handle to stop.
pub fn watch_node_pods(client: Client, node_name: &str, telemetry: Arc<Telemetry>) -> (Store<Pod>, JoinHandle<()>) {
    let (store, writer) = reflector::store();
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
    let stream = watcher(Api::<Pod>::all(client), config).default_backoff().reflect(writer);
    let node = node_name.to_string();
    let watch = tokio::spawn(async move {
        let mut failing = false;
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) if failing => {
                    failing = false;
                    tracing::info!(%node, "watching this node's pods again");
                }
                Ok(_) => {}
                Err(e) => {
                    telemetry.api_error("pods_watch");
                    // once per outage; the backoff retries
                    if !failing {
                        tracing::warn!(%node, error = %e, "watching this node's pods failed; retrying");
                    }
                    failing = true;
                }
            }
        }
    });
    (store, watch)
}
