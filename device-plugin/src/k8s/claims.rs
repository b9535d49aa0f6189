//! [`ClaimSource`] over the API server: one GET of the claim kubelet names, at each
//! NodePrepareResources (a claim's allocation is written once, before its pod is bound, so there is
//! nothing to cache, and a fresh read never misses it).

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{Api, Client};

use super::{call, CALL_TIMEOUT};
use crate::dra::kubelet::ClaimSource;
use crate::sampler::Telemetry;

pub struct KubeClaims {
    client: Client,
    telemetry: std::sync::Arc<Telemetry>,
}

impl KubeClaims {
    pub fn new(client: Client, telemetry: std::sync::Arc<Telemetry>) -> Self {
        Self { client, telemetry }
    }
}

#[tonic::async_trait]
impl ClaimSource for KubeClaims {
    async fn claim(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
        call("resourceclaim_get", CALL_TIMEOUT, api.get_opt(name)).await.map_err(|e| {
            self.telemetry.api_error(e.op());
            e.to_string()
        })
    }
}
