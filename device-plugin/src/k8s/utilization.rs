//! The Kubernetes [`UtilizationSink`]: `gpuplace.io/utilization` on this node, by merge patch of the
//! node's metadata (no read first, and no conflict with kubelet's status writes). When to write is
//! the publish policy's business ([`crate::publish`]); a failure here is counted and retried by it.

use std::sync::Arc;

use gpuplace::core::annotations::{UtilizationAnnotation, ANNOTATION_UTILIZATION};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use super::{call, CALL_TIMEOUT};
use crate::publish::{SinkError, UtilizationSink};
use crate::sampler::Telemetry;

pub struct KubeUtilizationSink {
    nodes: Api<Node>,
    name: String,
    telemetry: Arc<Telemetry>,
}

impl KubeUtilizationSink {
    pub fn new(client: Client, node_name: &str, telemetry: Arc<Telemetry>) -> Self {
        Self { nodes: Api::all(client), name: node_name.to_string(), telemetry }
    }
}

#[tonic::async_trait]
impl UtilizationSink for KubeUtilizationSink {
    async fn publish(&self, value: &UtilizationAnnotation) -> Result<(), SinkError> {
        let patch = json!({"metadata": {"annotations": {ANNOTATION_UTILIZATION: value.to_json()}}});
        match call(
            "node_patch",
            CALL_TIMEOUT,
            self.nodes.patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                self.telemetry.api_error("node_patch");
                Err(SinkError(format!("node {}: {e}", self.name)))
            }
        }
    }
}
