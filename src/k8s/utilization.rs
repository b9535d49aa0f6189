//! The utilization ConfigMap watcher: the device plugins' per-node ConfigMaps
//! (`gpuplace_core::utilization_configmap`) in one namespace, selected by label, go to
//! [`Scheduler::observe_utilization`]; deleted ones (and ones a re-list no longer shows, or that stop
//! naming their node) to [`Scheduler::forget_utilization`].
//!
//! Utilization lives there rather than on the Node because kube-scheduler requeues every
//! unschedulable pod on every Node update. It is optional: readiness does not wait on this watch
//! (samples have freshness windows, and placement works without them), but its errors and staleness
//! are counted like the other watches' (`Watched::UtilizationConfigMaps`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, ResourceExt};

use crate::k8s::watch::next_event;
use crate::scheduler::metrics::Watched;
use crate::scheduler::service::utilization::UtilizationOutcome;
use crate::scheduler::Scheduler;
use gpuplace_core::utilization_configmap::{read, UTILIZATION_SELECTOR};

/// Applies one ConfigMap; `known` maps ConfigMap names to the node each last named, so that its
/// deletion (or a change that makes it unreadable) drops that node's samples.
pub fn apply(ext: &Scheduler, cm: &ConfigMap, known: &mut HashMap<String, String>) -> Option<UtilizationOutcome> {
    let name = cm.name_any();
    match read(&name, cm.data.as_ref()) {
        Ok((node, text)) => {
            if let Some(before) = known.insert(name.clone(), node.to_string()).filter(|b| b != node) {
                ext.forget_utilization(&before);
            }
            Some(ext.observe_utilization(node, text))
        }
        Err(e) => {
            tracing::warn!(configmap = %name, error = %e, "utilization ConfigMap not readable; ignored");
            if let Some(before) = known.remove(&name) {
                ext.forget_utilization(&before);
            }
            None
        }
    }
}

/// Watches the utilization ConfigMaps of `api`'s namespace until the stream ends, which it does
/// not: errors are counted and retried with backoff.
pub async fn watch_utilization(api: Api<ConfigMap>, ext: Arc<Scheduler>) {
    let config = watcher::Config::default().labels(UTILIZATION_SELECTOR).page_size(500);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut known: HashMap<String, String> = HashMap::new();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::UtilizationConfigMaps).await {
        match ev {
            Event::Init => listed.clear(),
            Event::InitApply(cm) => {
                listed.insert(cm.name_any());
                apply(&ext, &cm, &mut known);
            }
            Event::InitDone => {
                // deleted while the watch was broken
                let gone: Vec<String> = known.keys().filter(|n| !listed.contains(*n)).cloned().collect();
                for name in gone {
                    if let Some(node) = known.remove(&name) {
                        ext.forget_utilization(&node);
                    }
                }
            }
            Event::Apply(cm) => {
                apply(&ext, &cm, &mut known);
            }
            Event::Delete(cm) => {
                if let Some(node) = known.remove(&cm.name_any()) {
                    ext.forget_utilization(&node);
                }
            }
        }
    }
}
