//! Keeps this node's Node object right: `gpuplace.io/gpu-mem` and `gpuplace.io/gpu-core` capacity and
//! allocatable in its status, and the `gpuplace.io/inventory` annotation; a `gpuplace.io/utilization`
//! annotation an older plugin left there is removed (utilization now lives in a ConfigMap,
//! [`super::utilization`]: a stale value must not linger, and the Node must stop changing with it).
//!
//! The inventory says `confirmsAllocations` once the plugin, in assignments mode, has been
//! registered by a kubelet (or the node already says so: a restarted plugin keeps the word its
//! predecessor gave until its own registration, rather than let binds through meanwhile); the
//! extender then binds pods the plugin could confuse one at a time (`core::admission`).
//!
//! The node also carries `gpuplace.io/allocation-counts`, the cross-check's counts over the plugin's
//! restarts: read once (the first pass), then written whenever the counts moved
//! ([`Telemetry::allocation_counts_changed`] wakes the loop). Mismatches are rare, so this adds no
//! steady Node writes.
//!
//! One pass ([`NodeSync::reconcile`]) reads the node and merge-patches only what differs, so a pass
//! that finds everything in place writes nothing. Passes run at start, at every registration with
//! kubelet (a restarted kubelet zeroes extended resources it does not manage in the node's status)
//! and again [`SETTLE`] later (kubelet may write its status after we registered), at every health
//! change (an unhealthy GPU is neither capacity nor placeable), and every resync interval. A failed
//! pass is counted and retried with backoff from 1 s up to the resync interval.

use std::sync::Arc;
use std::time::Duration;

use gpuplace_core::annotations::{
    AllocationCounts, NodeInventory, ANNOTATION_ALLOCATION_COUNTS, ANNOTATION_INVENTORY, ANNOTATION_UTILIZATION,
};
use gpuplace_core::resources::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEM};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::inventory::{capacity, node_inventory, NodeCapacity};
use super::{call, Backoff, CallError, CALL_TIMEOUT};
use crate::nvml::Inventory;
use crate::plugin::Plugin;
use crate::sampler::Telemetry;

/// The second look after a registration with kubelet.
pub const SETTLE: Duration = Duration::from_secs(5);

/// Why a pass failed (retried).
#[derive(Debug, thiserror::Error)]
pub enum NodeSyncError {
    #[error("node {0} does not exist (is --node-name / NODE_NAME this node's name?)")]
    Missing(String),
    #[error("node {node}: {source}")]
    Call {
        node: String,
        #[source]
        source: CallError,
    },
}

/// What a pass wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reconciled {
    pub status_patched: bool,
    pub inventory_patched: bool,
    /// An older plugin's utilization annotation was removed.
    pub stale_utilization_removed: bool,
    /// The allocation counts were written.
    pub counts_patched: bool,
}

/// See the module docs.
pub struct NodeSync {
    nodes: Api<Node>,
    name: String,
    inventory: Inventory,
    slots_per_gpu: u32,
    plugin: Arc<Plugin>,
    telemetry: Arc<Telemetry>,
    resync: Duration,
}

impl NodeSync {
    pub fn new(
        client: Client,
        name: &str,
        inventory: Inventory,
        plugin: Arc<Plugin>,
        telemetry: Arc<Telemetry>,
        resync: Duration,
    ) -> Self {
        let slots_per_gpu = plugin.config().slots_per_gpu;
        Self { nodes: Api::all(client), name: name.to_string(), inventory, slots_per_gpu, plugin, telemetry, resync }
    }

    fn failed(&self, source: CallError) -> NodeSyncError {
        self.telemetry.api_error(source.op());
        NodeSyncError::Call { node: self.name.clone(), source }
    }

    /// What the node should carry now, given whether its inventory already says the plugin confirms
    /// allocations.
    pub fn desired(&self, confirmed_before: bool) -> (NodeCapacity, NodeInventory) {
        let health = self.plugin.health();
        let confirms = self.plugin.applies_assignments() && (self.plugin.registered() || confirmed_before);
        let mode = self.plugin.config().isolation_mode();
        (
            capacity(&self.inventory, &health),
            node_inventory(&self.inventory, &health, self.slots_per_gpu, confirms, mode),
        )
    }

    /// The cross-check's counts the node should carry, when they differ from what it carries (read
    /// from it the first time: the counts of earlier runs).
    fn counts_to_write(&self, node: &Node) -> Option<AllocationCounts> {
        let current = match node.annotations().get(ANNOTATION_ALLOCATION_COUNTS).map(|t| AllocationCounts::parse(t)) {
            None => AllocationCounts::new(0, 0),
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                // unreadable: counted from 0 again, and overwritten with what this run finds
                tracing::warn!(node = %self.name, error = %e, "allocation counts on the node unreadable; counting from 0");
                AllocationCounts::new(0, 0)
            }
        };
        self.telemetry.load_allocation_counts(current);
        self.telemetry.allocation_counts().filter(|want| *want != current)
    }

    /// One pass: read the node, patch what differs.
    pub async fn reconcile(&self) -> Result<Reconciled, NodeSyncError> {
        let node = call("node_get", CALL_TIMEOUT, self.nodes.get_opt(&self.name))
            .await
            .map_err(|e| self.failed(e))?
            .ok_or_else(|| {
                self.telemetry.api_error("node_get");
                NodeSyncError::Missing(self.name.clone())
            })?;
        let current = node.annotations().get(ANNOTATION_INVENTORY).map(|t| NodeInventory::parse(t));
        let confirmed_before = matches!(&current, Some(Ok(c)) if c.confirms_allocations);
        let (cap, inv) = self.desired(confirmed_before);
        let mut done = Reconciled::default();

        let want = [(RESOURCE_GPU_MEM, cap.gpu_mem_mib.to_string()), (RESOURCE_GPU_CORE, cap.gpu_core.to_string())];
        let status = node.status.as_ref();
        let has = |list: Option<
            &std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
        >| { want.iter().all(|(k, v)| list.and_then(|l| l.get(*k)).is_some_and(|q| &q.0 == v)) };
        if !has(status.and_then(|s| s.capacity.as_ref())) || !has(status.and_then(|s| s.allocatable.as_ref())) {
            let values: serde_json::Map<String, serde_json::Value> =
                want.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
            let patch = json!({"status": {"capacity": values, "allocatable": values}});
            call(
                "node_status_patch",
                CALL_TIMEOUT,
                self.nodes.patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            .map_err(|e| self.failed(e))?;
            tracing::info!(node = %self.name, gpu_mem_mib = cap.gpu_mem_mib, gpu_core = cap.gpu_core, "node capacity patched");
            done.status_patched = true;
        }

        // compared as values, so key order or an older writer's formatting does not cause writes
        let write_inventory = !matches!(&current, Some(Ok(c)) if *c == inv);
        let stale_utilization = node.annotations().contains_key(ANNOTATION_UTILIZATION);
        let counts = self.counts_to_write(&node);
        if write_inventory || stale_utilization || counts.is_some() {
            // one merge patch for all; null deletes the key
            let mut annotations = serde_json::Map::new();
            if write_inventory {
                annotations.insert(ANNOTATION_INVENTORY.into(), json!(inv.to_json()));
            }
            if stale_utilization {
                annotations.insert(ANNOTATION_UTILIZATION.into(), serde_json::Value::Null);
            }
            if let Some(c) = &counts {
                annotations.insert(ANNOTATION_ALLOCATION_COUNTS.into(), json!(c.to_json()));
            }
            let patch = json!({"metadata": {"annotations": annotations}});
            call(
                "node_patch",
                CALL_TIMEOUT,
                self.nodes.patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
            .map_err(|e| self.failed(e))?;
            if write_inventory {
                let healthy = inv.gpus.iter().filter(|g| g.healthy).count();
                tracing::info!(node = %self.name, gpus = inv.gpus.len(), healthy, "inventory annotation written");
                done.inventory_patched = true;
            }
            if stale_utilization {
                tracing::info!(node = %self.name, "utilization annotation of an older plugin removed (now a ConfigMap)");
                done.stale_utilization_removed = true;
            }
            if let Some(c) = counts {
                tracing::info!(node = %self.name, mismatches = c.mismatches, corrections = c.corrections, "allocation counts written");
                done.counts_patched = true;
            }
        }
        Ok(done)
    }

    /// Passes until the plugin goes away (see the module docs); never returns an error.
    pub async fn run(self) {
        let mut registrations = self.plugin.subscribe_registrations();
        let mut devices = self.plugin.subscribe();
        let mut backoff = Backoff::new(self.resync);
        let mut settle_at: Option<tokio::time::Instant> = None;
        loop {
            let result = self.reconcile().await;
            let wait = backoff.after(result.is_ok());
            if let Err(e) = &result {
                tracing::warn!(error = %e, retry_in = ?wait, "node status and inventory not written");
            }
            let mut wake = tokio::time::Instant::now() + wait;
            if let Some(s) = settle_at {
                wake = wake.min(s);
            }
            tokio::select! {
                r = registrations.changed() => {
                    if r.is_err() { return; }
                    settle_at = Some(tokio::time::Instant::now() + SETTLE);
                }
                r = devices.changed() => if r.is_err() { return },
                _ = self.telemetry.allocation_counts_changed() => {}
                _ = tokio::time::sleep_until(wake) => {
                    if settle_at.is_some_and(|s| s <= tokio::time::Instant::now()) {
                        settle_at = None;
                    }
                }
            }
        }
    }
}
