//! This node's ResourceSlice (DRA mode, `--dra`): its healthy GPUs as devices of the driver
//! (`--dra-driver`), in a pool named after the node ([`crate::dra::devices`]).
//!
//! One pass ([`SliceSync::reconcile`]) reads the Node (its labels give the network attributes, its
//! UID the slice's owner, so the slice goes when the Node does) and the slices of this node and
//! driver, and writes only when they differ from what the node has now: the slice
//! `<node>-<driver>` replaced (or created) with the pool's generation one above the highest it finds,
//! then any other slice of the pool deleted. kube-scheduler's allocator uses only the slices of a
//! pool's highest generation, so it never mixes an old slice with a new one.
//!
//! Passes run at start, at every GPU health change (an unhealthy GPU leaves the slice), and every
//! resync interval (a slice deleted or edited by someone else comes back). A failed pass is counted
//! in `gpuplace_apiserver_errors_total{op}` and retried with backoff from 1 s up to the resync
//! interval.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};

use super::{call, Backoff, CallError, CALL_TIMEOUT};
use crate::dra::devices::{devices, mark_isolation, same_devices, slice_spec, taint_for_gpuplace};
use crate::nvml::Inventory;
use crate::plugin::Plugin;
use crate::sampler::Telemetry;

/// Why a pass failed (retried).
#[derive(Debug, thiserror::Error)]
pub enum SliceSyncError {
    #[error("node {0} does not exist (is --node-name / NODE_NAME this node's name?)")]
    Missing(String),
    #[error("ResourceSlice of node {node}: {source}")]
    Call {
        node: String,
        #[source]
        source: CallError,
    },
}

/// What a pass found or wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlicePass {
    /// The slice was created or replaced.
    pub written: bool,
    /// The pool's generation now.
    pub generation: i64,
    /// Devices in the slice (the healthy GPUs).
    pub devices: usize,
    /// Other slices of this node and driver that were deleted.
    pub deleted: usize,
}

/// The name of `node`'s slice of `driver`: `<node>-<driver>`, shortened with a hash when that is over
/// the 253 characters of a name.
pub fn slice_name(node: &str, driver: &str) -> String {
    let name = format!("{node}-{driver}");
    if name.len() <= 253 {
        return name;
    }
    // FNV-1a: stable across releases, unlike std's hasher
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut cut = 253 - 17;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{hash:016x}", name[..cut].trim_end_matches(['-', '.']))
}

/// See the module docs.
pub struct SliceSync {
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    driver: String,
    inventory: Inventory,
    slots_per_gpu: u32,
    plugin: Arc<Plugin>,
    telemetry: Arc<Telemetry>,
    resync: Duration,
    /// The devices carry gpuplace's allocator taint (`--dra-allocator gpuplace`).
    gpuplace_allocates: bool,
}

impl SliceSync {
    pub fn new(
        client: Client,
        node: &str,
        driver: &str,
        inventory: Inventory,
        plugin: Arc<Plugin>,
        telemetry: Arc<Telemetry>,
        resync: Duration,
    ) -> Self {
        let slots_per_gpu = plugin.config().slots_per_gpu;
        Self {
            slices: Api::all(client.clone()),
            nodes: Api::all(client),
            node: node.to_string(),
            driver: driver.to_string(),
            inventory,
            slots_per_gpu,
            plugin,
            telemetry,
            resync,
            gpuplace_allocates: false,
        }
    }

    /// Taints the devices for gpuplace's allocator (`dra::devices::taint_for_gpuplace`).
    pub fn with_gpuplace_allocating(mut self, yes: bool) -> Self {
        self.gpuplace_allocates = yes;
        self
    }

    fn failed(&self, source: CallError) -> SliceSyncError {
        self.telemetry.api_error(source.op());
        SliceSyncError::Call { node: self.node.clone(), source }
    }

    /// One pass: read the Node and its slices, write what differs.
    pub async fn reconcile(&self) -> Result<SlicePass, SliceSyncError> {
        let node = call("node_get", CALL_TIMEOUT, self.nodes.get_opt(&self.node))
            .await
            .map_err(|e| self.failed(e))?
            .ok_or_else(|| {
                self.telemetry.api_error("node_get");
                SliceSyncError::Missing(self.node.clone())
            })?;
        let mut want = devices(&self.inventory, &self.plugin.health(), node.labels(), self.slots_per_gpu);
        if let Some(mode) = self.plugin.config().isolation_mode() {
            mark_isolation(&mut want, mode);
        }
        if self.gpuplace_allocates {
            taint_for_gpuplace(&mut want);
        }
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: node.uid().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: None,
        };
        let fields = format!("spec.nodeName={},spec.driver={}", self.node, self.driver);
        let found = call("resourceslices_list", CALL_TIMEOUT, self.slices.list(&ListParams::default().fields(&fields)))
            .await
            .map_err(|e| self.failed(e))?
            .items;
        let name = slice_name(&self.node, &self.driver);
        let ours = found.iter().find(|s| s.name_any() == name);
        let highest = found.iter().map(|s| s.spec.pool.generation).max();
        let current = ours.is_some_and(|s| {
            s.spec.pool.name == self.node
                && s.spec.pool.resource_slice_count == 1
                && Some(s.spec.pool.generation) == highest
                && s.owner_references() == std::slice::from_ref(&owner)
                && same_devices(s.spec.devices.as_deref().unwrap_or_default(), &want)
        });
        let count = want.len();
        if current && found.len() == 1 {
            return Ok(SlicePass {
                written: false,
                generation: highest.unwrap_or_default(),
                devices: count,
                deleted: 0,
            });
        }
        let generation = if current { highest.unwrap_or_default() } else { highest.map_or(0, |g| g.saturating_add(1)) };
        if !current {
            let slice = ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    owner_references: Some(vec![owner]),
                    resource_version: ours.and_then(|s| s.resource_version()),
                    ..Default::default()
                },
                spec: slice_spec(&self.driver, &self.node, want, generation),
            };
            let pp = PostParams::default();
            match ours {
                Some(_) => call("resourceslice_replace", CALL_TIMEOUT, self.slices.replace(&name, &pp, &slice)).await,
                None => call("resourceslice_create", CALL_TIMEOUT, self.slices.create(&pp, &slice)).await,
            }
            .map_err(|e| self.failed(e))?;
            tracing::info!(node = %self.node, slice = %name, generation, devices = count, "ResourceSlice written");
        }
        // the new generation is in place: the allocator no longer reads the others
        let mut deleted = 0;
        for other in found.iter().filter(|s| s.name_any() != name) {
            let other = other.name_any();
            match call("resourceslice_delete", CALL_TIMEOUT, self.slices.delete(&other, &DeleteParams::default())).await
            {
                Ok(_) => deleted += 1,
                // gone already (someone else cleaned up): what we wanted
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(self.failed(e)),
            }
            tracing::info!(node = %self.node, slice = %other, "stale ResourceSlice of this node deleted");
        }
        Ok(SlicePass { written: !current, generation, devices: count, deleted })
    }

    /// Passes until the plugin goes away (see the module docs); never returns an error.
    pub async fn run(self) {
        let mut devices = self.plugin.subscribe();
        let mut backoff = Backoff::new(self.resync);
        loop {
            let result = self.reconcile().await;
            let wait = backoff.after(result.is_ok());
            if let Err(e) = &result {
                tracing::warn!(error = %e, retry_in = ?wait, "ResourceSlice not written");
            }
            tokio::select! {
                r = devices.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_names_fit_in_a_name() {
        assert_eq!(slice_name("gpu-01", "gpu.gpuplace.io"), "gpu-01-gpu.gpuplace.io");
        let long = "n".repeat(250);
        let a = slice_name(&long, "gpu.gpuplace.io");
        assert_eq!(a.len(), 253);
        assert_ne!(a, slice_name(&"n".repeat(251), "gpu.gpuplace.io"));
        assert_eq!(a, slice_name(&long, "gpu.gpuplace.io"));
    }
}
