//! The Node watcher: each Node object's labels and gpuplace annotations go to
//! [`Scheduler::observe_node`], deletions to [`Scheduler::remove_node`]. A re-list removes the nodes it
//! no longer shows (their deletion happened while the watch was broken). Refused inventories are
//! raised as Events on the node; nothing here can stop the loop.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource, ResourceExt};
use tokio::sync::watch;

use crate::k8s::watch::next_event;
use crate::scheduler::metrics::Watched;
use crate::scheduler::service::observe::NodeOutcome;
use crate::scheduler::Scheduler;
use gpuplace_core::api_client::events::{EventSink, REASON_INVENTORY};
use gpuplace_core::node_constraints::Taint;

/// The Node's taints as the core model reads them.
fn taints_of(node: &Node) -> Vec<Taint> {
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_ref());
    taints
        .into_iter()
        .flatten()
        .map(|t| Taint { key: t.key.clone(), value: t.value.clone().unwrap_or_default(), effect: t.effect.clone() })
        .collect()
}

/// Applies one Node object; returns whether gpuplace now knows it as a GPU node.
pub fn apply(ext: &Scheduler, node: &Node, events: Option<&EventSink>) -> bool {
    let name = node.name_any();
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    ext.observe_node_taints(&name, Some(taints_of(node)));
    // a DRA node's host is gpuplace's to check
    if ext.dra_enabled() {
        let (cpu, mib) = crate::k8s::dra::allocatable(node);
        ext.observe_allocatable(&name, cpu, mib);
    }
    match ext.observe_node(&name, labels, annotations) {
        NodeOutcome::Refused(why) => {
            if let Some(ev) = events {
                ev.warn(node.object_ref(&()), REASON_INVENTORY, "ReadInventory", &why);
            }
            ext.has_node(&name)
        }
        NodeOutcome::NotGpu | NodeOutcome::Removed { .. } => false,
        NodeOutcome::Unchanged | NodeOutcome::Upserted { .. } => ext.has_node(&name),
    }
}

/// Watches Nodes (optionally only those matching `selector`) until the stream ends, which it does
/// not: errors are retried with backoff. `synced` turns true after the first complete list.
pub async fn watch_nodes(
    api: Api<Node>,
    selector: Option<String>,
    ext: Arc<Scheduler>,
    events: Option<EventSink>,
    synced: watch::Sender<bool>,
) {
    let mut config = watcher::Config::default().page_size(500);
    if let Some(s) = &selector {
        config = config.labels(s);
    }
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    // GPU nodes applied from this watch, to find the ones a re-list no longer shows
    let mut known: HashSet<String> = HashSet::new();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::Nodes).await {
        match ev {
            Event::Init => listed.clear(),
            Event::InitApply(n) => {
                listed.insert(n.name_any());
                if apply(&ext, &n, events.as_ref()) {
                    known.insert(n.name_any());
                }
            }
            Event::InitDone => {
                for gone in known.iter().filter(|n| !listed.contains(*n)) {
                    tracing::info!(node = %gone, "node no longer listed; removed");
                    ext.observe_node_taints(gone, None);
                    ext.remove_node(gone);
                }
                known.retain(|n| listed.contains(n));
                synced.send_replace(true);
            }
            Event::Apply(n) => {
                if apply(&ext, &n, events.as_ref()) {
                    known.insert(n.name_any());
                } else {
                    known.remove(&n.name_any());
                }
            }
            Event::Delete(n) => {
                known.remove(&n.name_any());
                ext.observe_node_taints(&n.name_any(), None);
                ext.remove_node(&n.name_any());
            }
        }
    }
}
