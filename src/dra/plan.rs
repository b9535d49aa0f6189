//! A pod's claims of gpuplace's DeviceClass as one request to the placement engine, and the
//! engine's placement written back as each claim's allocation (pure).
//!
//! Each request of each claim is one container of the engine's request (named
//! `<claim>/<request>`), so a pod's claims are placed together, on one node, with the same
//! fragmentation, topology, utilization and group logic as a pod asking for gpuplace's own
//! resources. The engine's ranking is then walked best first until a candidate meets every claim's
//! `matchAttribute`/`distinctAttribute` constraints, checked against the attributes the devices
//! publish (`gpuplace_core::dra::attributes`).

use std::collections::BTreeMap;

use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::dra::attributes::NodeAttributes;
use gpuplace_core::dra::claims::{
    allocated, allocation, check_constraints, claim_key, Chosen, ClaimDemand, ClaimError, Placement as ClaimPlacement,
};
use gpuplace_core::resources::{ContainerDemand, PodRequest};
use k8s_openapi::api::resource::v1::{AllocationResult, DeviceClassConfiguration, ResourceClaim, ResourceClaimStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::placement::engine::Engine;
use crate::placement::feasibility::Placement;

/// One of the pod's claims that gpuplace places: the claim as read, what it asks, and the name the
/// pod gives it (its `spec.resourceClaims[].name`, the same in every pod of a template, where the
/// claims' own names differ).
#[derive(Debug, Clone)]
pub struct PodClaim {
    pub claim: ResourceClaim,
    pub demand: ClaimDemand,
    pub entry: String,
}

impl PodClaim {
    pub fn name(&self) -> &str {
        self.claim.metadata.name.as_deref().unwrap_or_default()
    }

    /// The model's record key ([`claim_key`]).
    pub fn key(&self) -> String {
        claim_key(self.claim.metadata.namespace.as_deref().unwrap_or_default(), self.name())
    }
}

/// Why a pod's claims have no placement. Shown on the pod's events, so one line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("claim {claim}: {source}")]
    Claim { claim: String, source: ClaimError },
    #[error("the pod's claims ask for GPU models that no one GPU is ({first:?} and {second:?})")]
    Models { first: Vec<String>, second: Vec<String> },
    #[error("no node has room for the pod's claims ({rejected} nodes without room)")]
    NoRoom { rejected: usize },
    #[error("none of the {nodes} GPU nodes matches the pod's node selector, affinity and tolerations")]
    NoNode { nodes: usize },
    #[error("no node with room meets the claims' constraints ({tried} nodes tried; the best: {why})")]
    Constraints { tried: usize, why: ClaimError },
}

/// The engine's container name for a request of the claim the pod calls `entry`: neither name (DNS
/// labels) holds a `/`, so the two are read back apart. By the pod's names, not the claim's, so the
/// members of a group made from one template ask for the same shape (a group's slot serves any
/// member of its shape).
pub fn container_name(entry: &str, request: &str) -> String {
    format!("{entry}/{request}")
}

/// The engine's request for the pod: one container per request of each claim, the pod's own
/// policies, group and host resources from `base` (its request as read from its annotations, as for
/// any pod), and the GPU models every selector allows.
pub fn request(base: &PodRequest, claims: &[PodClaim]) -> Result<PodRequest, PlanError> {
    let mut containers = Vec::new();
    let mut models: Option<Vec<String>> = None;
    for c in claims {
        for r in &c.demand.requests {
            containers.push(ContainerDemand { name: container_name(&c.entry, &r.name), demand: r.demand() });
            if r.models.is_empty() {
                continue;
            }
            models = Some(match models {
                None => r.models.clone(),
                Some(seen) => {
                    let both: Vec<String> =
                        seen.iter().filter(|m| r.models.iter().any(|o| o.eq_ignore_ascii_case(m))).cloned().collect();
                    if both.is_empty() {
                        return Err(PlanError::Models { first: seen, second: r.models.clone() });
                    }
                    both
                }
            });
        }
    }
    let mut allowed = base.allowed_models.clone();
    if let Some(m) = models {
        allowed = if allowed.is_empty() {
            m
        } else {
            let both: Vec<String> =
                allowed.iter().filter(|a| m.iter().any(|o| o.eq_ignore_ascii_case(a))).cloned().collect();
            if both.is_empty() {
                return Err(PlanError::Models { first: allowed, second: m });
            }
            both
        };
    }
    Ok(PodRequest { containers, init_containers: Vec::new(), allowed_models: allowed, ..base.clone() })
}

/// The GPUs of each claim's requests in an assignment made for [`request`], by claim name.
pub fn split(assignment: &PodAssignment, claims: &[PodClaim]) -> BTreeMap<String, Chosen> {
    let mut out: BTreeMap<String, Chosen> = BTreeMap::new();
    for c in claims {
        let chosen = out.entry(c.name().to_string()).or_default();
        for r in &c.demand.requests {
            let name = container_name(&c.entry, &r.name);
            let gpus =
                assignment.containers.iter().find(|a| a.name == name).map(|a| a.slices.iter().map(|s| s.gpu).collect());
            chosen.insert(r.name.clone(), gpus.unwrap_or_default());
        }
    }
    out
}

/// The best placement whose GPUs meet every claim's constraints: the engine's ranking of the nodes
/// the pod may run on (`admits`), walked best first. The engine checks the node's host too (the
/// request's CPU and memory against what the node's pods ask), as kube-scheduler will.
pub fn choose(
    engine: &Engine,
    cluster: &Cluster,
    req: &PodRequest,
    claims: &[PodClaim],
    driver: &str,
    admits: &dyn Fn(&Node) -> bool,
    now_unix_ms: i64,
) -> Result<Placement, PlanError> {
    // the pod's node selector, affinity and tolerations first: kube-scheduler binds the pod where
    // its claims are, and would leave it pending on a node it may not run on
    let allowed: Vec<usize> = (0..cluster.nodes().len()).filter(|&i| admits(&cluster.nodes()[i])).collect();
    if allowed.is_empty() {
        return Err(PlanError::NoNode { nodes: cluster.nodes().len() });
    }
    let ev = engine.evaluate(cluster, req, &allowed, now_unix_ms);
    let mut first_unmet: Option<ClaimError> = None;
    for c in &ev.ranked {
        let (Some(node), Some(p)) = (cluster.nodes().get(c.node), c.placement(cluster, req)) else { continue };
        let attrs = NodeAttributes::new(&node.topology, &node.labels);
        let chosen = split(&p.assignment, claims);
        let unmet = claims.iter().find_map(|claim| {
            let picks = chosen.get(claim.name())?;
            let attribute = |gpu: u32, name: &str| {
                let g = node.gpus.get(gpu as usize)?;
                attrs.qualified(driver, g, &node.topology, name)
            };
            check_constraints(&claim.demand, picks, attribute).err()
        });
        match unmet {
            None => return Ok(p),
            Some(e) => {
                first_unmet.get_or_insert(e);
            }
        }
    }
    match first_unmet {
        Some(why) => Err(PlanError::Constraints { tried: ev.ranked.len(), why }),
        None => Err(PlanError::NoRoom { rejected: ev.rejected.len() }),
    }
}

/// Each claim's allocation for a placement, with the model's record of it (as the claim watcher
/// will read it back, so the model does not change when the write is seen).
pub struct Written {
    pub key: String,
    pub allocation: AllocationResult,
    pub record: PodAssignment,
}

/// The allocations of a placement made by [`choose`]: one per claim, in the claims' order.
pub fn allocations(
    cluster: &Cluster,
    placement: &Placement,
    claims: &[PodClaim],
    driver: &str,
    class_config: &[DeviceClassConfiguration],
    now: Time,
) -> Result<Vec<Written>, PlanError> {
    let node_name = placement.assignment.node.as_str();
    let node = cluster.node(node_name);
    let memory = |gpu: u32| node.and_then(|n| n.gpus.get(gpu as usize)).map(|g| g.memory_mib);
    let chosen = split(&placement.assignment, claims);
    let mut out = Vec::with_capacity(claims.len());
    for c in claims {
        let err = |source| PlanError::Claim { claim: c.name().to_string(), source };
        let empty = Chosen::new();
        let picks = chosen.get(c.name()).unwrap_or(&empty);
        let where_ = ClaimPlacement { node: node_name, chosen: picks, gpu_memory_mib: &memory };
        let uid = c.claim.metadata.uid.as_deref().unwrap_or_default();
        let a = allocation(uid, &c.claim.spec, &c.demand, driver, class_config, &where_, now.clone()).map_err(err)?;
        let mut read_back = c.claim.clone();
        read_back.status = Some(ResourceClaimStatus { allocation: Some(a.clone()), ..Default::default() });
        let record = allocated(&read_back, driver).map_err(err)?.ok_or(err(ClaimError::WrongCount {
            request: String::new(),
            want: 1,
            got: 0,
        }))?;
        out.push(Written { key: c.key(), allocation: a, record });
    }
    Ok(out)
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
