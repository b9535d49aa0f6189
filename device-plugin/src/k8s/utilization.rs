//! The Kubernetes [`UtilizationSink`]: this node's utilization ConfigMap
//! (`gpuplace_core::utilization_configmap`: `gpuplace-utilization-<node>` in the plugin's namespace),
//! not the Node object. Every Node update makes kube-scheduler move every unschedulable pod back to
//! its active queue; kube-scheduler does not watch ConfigMaps.
//!
//! A publish is one merge PATCH of the ConfigMap's data (and labels, so a removed label comes back).
//! Only when that answers 404 (first publish, or the ConfigMap was deleted) is it created, with an
//! ownerReference to this node's Node object, read for its UID right then: the garbage collector
//! deletes the ConfigMap with the Node, and a Node deleted and registered again gets a ConfigMap
//! owned by the new one. No `blockOwnerDeletion`, which would need update rights on the Node's
//! finalizers. When to publish is the policy's business ([`crate::publish`]); a failure here is
//! counted and retried by it.

use std::sync::Arc;

use gpuplace_core::annotations::UtilizationAnnotation;
use gpuplace_core::utilization_configmap::{configmap_name, data, labels};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use super::{call, CallError, CALL_TIMEOUT};
use crate::publish::{SinkError, UtilizationSink};
use crate::sampler::Telemetry;

pub struct KubeUtilizationSink {
    configmaps: Api<ConfigMap>,
    nodes: Api<Node>,
    node: String,
    namespace: String,
    /// The ConfigMap's name, derived from the node's.
    name: String,
    telemetry: Arc<Telemetry>,
}

impl KubeUtilizationSink {
    /// Writes `node`'s utilization ConfigMap in `namespace`.
    pub fn new(client: Client, node: &str, namespace: &str, telemetry: Arc<Telemetry>) -> Self {
        Self {
            configmaps: Api::namespaced(client.clone(), namespace),
            nodes: Api::all(client),
            node: node.to_string(),
            namespace: namespace.to_string(),
            name: configmap_name(node),
            telemetry,
        }
    }

    /// The ConfigMap's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn failed(&self, e: CallError) -> SinkError {
        self.telemetry.api_error(e.op());
        SinkError(format!("ConfigMap {}/{} of node {}: {e}", self.namespace, self.name, self.node))
    }

    async fn patch(&self, value: &UtilizationAnnotation) -> Result<(), CallError> {
        let patch = json!({"metadata": {"labels": labels()}, "data": data(&self.node, value.to_json())});
        let params = PatchParams::default();
        call("configmap_patch", CALL_TIMEOUT, self.configmaps.patch(&self.name, &params, &Patch::Merge(&patch)))
            .await
            .map(|_| ())
    }

    async fn create(&self, value: &UtilizationAnnotation) -> Result<(), SinkError> {
        let node = call("node_get", CALL_TIMEOUT, self.nodes.get_opt(&self.node)).await.map_err(|e| self.failed(e))?;
        let Some(uid) = node.and_then(|n| n.metadata.uid) else {
            self.telemetry.api_error("node_get");
            return Err(SinkError(format!(
                "node {} does not exist (is --node-name / NODE_NAME this node's name?); its utilization ConfigMap \
                 needs it as owner",
                self.node
            )));
        };
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: self.node.clone(),
                    uid,
                    ..Default::default()
                }]),
                ..Default::default()
            },
            data: Some(data(&self.node, value.to_json())),
            ..Default::default()
        };
        match call("configmap_create", CALL_TIMEOUT, self.configmaps.create(&PostParams::default(), &cm)).await {
            Ok(_) => {
                tracing::info!(namespace = %self.namespace, configmap = %self.name, "utilization ConfigMap created");
                Ok(())
            }
            // created in between (a second plugin instance during a rollout): it exists now
            Err(e) if e.status() == Some(409) => self.patch(value).await.map_err(|e| self.failed(e)),
            Err(e) => Err(self.failed(e)),
        }
    }
}

#[tonic::async_trait]
impl UtilizationSink for KubeUtilizationSink {
    async fn publish(&self, value: &UtilizationAnnotation) -> Result<(), SinkError> {
        match self.patch(value).await {
            Ok(()) => Ok(()),
            Err(e) if e.status() == Some(404) => self.create(value).await,
            Err(e) => Err(self.failed(e)),
        }
    }
}
