//! ResourceClaims for gpuplace's devices: what an allocated claim holds ([`allocated`], the model's
//! record), what a claim asks for ([`claim_demand`], the placement engine's terms), and a placement
//! written as the claim's allocation ([`allocation`]).
//!
//! A claim's allocation is written whole, by one writer, under the rules kube-scheduler's
//! DynamicResources plugin needs to honour it (measured on v1.36, issue 32): an `allocationTimestamp`
//! (else its PreBind adds one and the API server refuses the change), a node selector that matches
//! only the devices' node, and a `shareID` and `consumedCapacity` on every result (a missing
//! consumption counts as nothing, a missing `shareID` as exclusive use). What each result consumes
//! follows the devices' request policies (docs/resources.md, "GPUs from DRA claims"): a capacity a
//! request does not name is taken whole, and every claim on a GPU takes one of its `shares`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceAttribute, DeviceClassConfiguration,
    DeviceRequestAllocationResult, ResourceClaim, ResourceClaimSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{device_index, device_name, CAPACITY_CORES, CAPACITY_MEMORY, CAPACITY_SHARES};
use crate::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
use crate::resources::{GpuDemand, MemoryDemand, MAX_GPUS_PER_CONTAINER};

/// The finalizer kube-scheduler puts on claims it allocates, so that an allocation is not lost
/// while its pod still runs; an allocation without it outlives a deleted claim's pod and its capacity
/// stays counted.
pub const DELETE_PROTECTION_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// The model's record key of a claim: claims and pods share the model, so a claim's key cannot be
/// taken for a pod's (`namespace/name`).
pub fn claim_key(namespace: &str, name: &str) -> String {
    format!("claim:{namespace}/{name}")
}

/// Whether a model record key is a claim's ([`claim_key`]).
pub fn is_claim_key(key: &str) -> bool {
    key.starts_with("claim:")
}

/// The model's record key of what a pod takes of a DRA node's host (CPU, memory): on DRA nodes gpuplace
/// chooses the node itself, so every pod's requests there count.
pub fn host_key(pod_uid: &str) -> String {
    format!("host:{pod_uid}")
}

/// The model's record of what a pod bound (or placed) on `node` takes of its host: `millicores` and
/// `mib`, under [`host_key`], no GPUs.
pub fn host_record(pod_uid: &str, node: &str, millicores: u64, mib: u64) -> PodAssignment {
    PodAssignment {
        pod: host_key(pod_uid),
        node: node.to_string(),
        containers: Vec::new(),
        cpu_milli: millicores,
        memory_mib: mib,
        group: None,
    }
}

/// Whether a record is one the API server's objects define (a claim's or a pod's host use), not a
/// pod's assignment annotation.
pub fn is_observed_key(key: &str) -> bool {
    is_claim_key(key) || key.starts_with("host:")
}

/// Why a claim cannot be placed by gpuplace, or its allocation not read. Shown on the pod's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("request {request:?} uses firstAvailable: gpuplace allocates requests for exactly one kind of device")]
    FirstAvailable { request: String },
    #[error("request {request:?} asks for allocationMode {mode}: gpuplace allocates ExactCount requests")]
    AllocationMode { request: String, mode: String },
    #[error("request {request:?} asks for {count} devices: 1 to {max} are allowed")]
    Count { request: String, count: i64, max: u32 },
    #[error("request {request:?} asks for admin access, which gpuplace does not grant")]
    AdminAccess { request: String },
    #[error("request {request:?} names capacity {capacity:?}: gpuplace's GPUs offer memory, cores and shares")]
    UnknownCapacity { request: String, capacity: String },
    #[error("request {request:?}: {capacity} {value:?} {why}")]
    BadCapacity { request: String, capacity: &'static str, value: String, why: String },
    #[error(
        "request {request:?}: selector {expression:?} is not one gpuplace evaluates (it reads `device.driver == \"<driver>\"` and `device.attributes[\"<driver>\"].model == \"<model>\"`)"
    )]
    Selector { request: String, expression: String },
    #[error(
        "request {request:?} uses class {other:?} beside gpuplace's {ours:?}: a claim's allocation is written whole, so devices of other classes need a claim of their own"
    )]
    MixedClasses { request: String, ours: String, other: String },
    #[error("constraint on {attribute:?} names request {request:?}, which the claim does not have")]
    UnknownConstraintRequest { attribute: String, request: String },
    #[error("constraint {kind} {attribute:?} does not hold on the devices chosen for {requests:?}")]
    ConstraintUnmet { kind: &'static str, attribute: String, requests: Vec<String> },
    #[error("request {request:?}: {want} devices needed, {got} chosen")]
    WrongCount { request: String, want: u32, got: usize },
    #[error("request {request:?}: GPU {gpu} of node {node:?} has no known memory")]
    UnknownDevice { request: String, node: String, gpu: u32 },
    #[error("allocation result for request {request:?} names device {device:?}, which is not one of gpuplace's")]
    ForeignDevice { request: String, device: String },
    #[error("allocation result for request {request:?} consumed {capacity} {value:?}: {why}")]
    BadConsumption { request: String, capacity: &'static str, value: String, why: String },
    #[error("allocation results are in pools {first:?} and {second:?}: one claim's GPUs are on one node")]
    TwoPools { first: String, second: String },
}

/// One request of a claim in gpuplace's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDemand {
    pub name: String,
    /// Devices (GPUs) the request takes, each a different GPU.
    pub count: u32,
    /// `memory` named, in MiB (rounded up to the policy's 1Mi step); `None`: all of each GPU's.
    pub memory_mib: Option<u64>,
    /// `cores` named, in percent (rounded up to whole percent); `None`: all of each GPU's.
    pub cores: Option<u32>,
    /// Models a selector allows (empty: any).
    pub models: Vec<String>,
}

impl RequestDemand {
    /// The placement engine's demand: a request that does not name its memory takes all of it, so
    /// nothing else fits beside it (DRA's one default per capacity): a whole GPU.
    pub fn demand(&self) -> GpuDemand {
        match self.memory_mib {
            None => GpuDemand::Whole { gpus: self.count },
            Some(m) => GpuDemand::Shared {
                gpus: self.count,
                memory: MemoryDemand::Mib(m),
                core_pct: self.cores.unwrap_or(100),
            },
        }
    }

    /// What one result consumes on a GPU of `gpu_memory_mib`: memory in MiB and cores in percent.
    pub fn consumption(&self, gpu_memory_mib: u64) -> (u64, u32) {
        (self.memory_mib.unwrap_or(gpu_memory_mib), self.cores.unwrap_or(100))
    }
}

/// A `matchAttribute` (all devices share the value) or `distinctAttribute` (no two share it)
/// constraint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constraint {
    /// The requests it covers (every request of the claim when the claim lists none).
    pub requests: Vec<String>,
    /// Fully qualified (`gpu.gpuplace.io/nvlinkDomain`).
    pub attribute: String,
    pub distinct: bool,
}

/// What a claim asks of gpuplace's devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimDemand {
    pub requests: Vec<RequestDemand>,
    pub constraints: Vec<Constraint>,
}

/// The models a selector allows, or `None` for a selector that only says "the driver's devices".
fn selector_models(request: &str, expression: &str, driver: &str) -> Result<Option<String>, ClaimError> {
    let refuse = || ClaimError::Selector { request: request.to_string(), expression: expression.to_string() };
    let (lhs, rhs) = expression.split_once("==").ok_or_else(refuse)?;
    let quoted = |s: &str| -> Option<String> {
        let s = s.trim();
        let inner = ['"', '\''].iter().find_map(|&q| s.strip_prefix(q)?.strip_suffix(q))?;
        (!inner.contains(['"', '\'', '\\'])).then(|| inner.to_string())
    };
    let value = quoted(rhs).ok_or_else(refuse)?;
    let lhs: String = lhs.chars().filter(|c| !c.is_whitespace()).collect();
    if lhs == "device.driver" {
        return if value == driver { Ok(None) } else { Err(refuse()) };
    }
    let model_of = |q: char| format!("device.attributes[{q}{driver}{q}].{}", super::ATTR_MODEL);
    if lhs == model_of('"') || lhs == model_of('\'') {
        return Ok(Some(value));
    }
    Err(refuse())
}

fn parse_capacity(request: &str, name: &'static str, q: &Quantity) -> Result<crate::quantity::Quantity, ClaimError> {
    let bad =
        |why: String| ClaimError::BadCapacity { request: request.to_string(), capacity: name, value: q.0.clone(), why };
    let v = crate::quantity::parse(&q.0).map_err(|e| bad(e.to_string()))?;
    if v.is_negative() {
        return Err(bad("is negative".into()));
    }
    Ok(v)
}

const MIB: i128 = 1024 * 1024;

/// A non-negative byte quantity in whole MiB, rounded up (requests and consumption both round so).
fn whole_mib(q: crate::quantity::Quantity) -> i128 {
    (q.ceil_integer() + MIB - 1) / MIB
}

/// What the claim asks of gpuplace's devices (`class` is gpuplace's DeviceClass, `driver` its
/// driver); `None` when no request uses the class (the claim is not gpuplace's to place).
pub fn claim_demand(spec: &ResourceClaimSpec, class: &str, driver: &str) -> Result<Option<ClaimDemand>, ClaimError> {
    let Some(devices) = spec.devices.as_ref() else { return Ok(None) };
    let requests = devices.requests.as_deref().unwrap_or_default();
    let ours = |r: &k8s_openapi::api::resource::v1::DeviceRequest| match (&r.exactly, &r.first_available) {
        (Some(e), _) => e.device_class_name == class,
        (None, Some(subs)) => subs.iter().any(|s| s.device_class_name == class),
        (None, None) => false,
    };
    if !requests.iter().any(ours) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        let request = r.name.clone();
        let Some(e) = r.exactly.as_ref() else { return Err(ClaimError::FirstAvailable { request }) };
        if e.device_class_name != class {
            return Err(ClaimError::MixedClasses { request, ours: class.into(), other: e.device_class_name.clone() });
        }
        match e.allocation_mode.as_deref() {
            None | Some("ExactCount") => {}
            Some(mode) => return Err(ClaimError::AllocationMode { request, mode: mode.into() }),
        }
        if e.admin_access == Some(true) {
            return Err(ClaimError::AdminAccess { request });
        }
        let count = e.count.unwrap_or(1);
        let max = MAX_GPUS_PER_CONTAINER;
        let count = u32::try_from(count).ok().filter(|c| (1..=max).contains(c)).ok_or_else(|| ClaimError::Count {
            request: request.clone(),
            count,
            max,
        })?;
        let mut models = Vec::new();
        for s in e.selectors.iter().flatten() {
            let expression = s.cel.as_ref().map(|c| c.expression.as_str()).unwrap_or_default();
            models.extend(selector_models(&request, expression, driver)?);
        }
        let (mut memory_mib, mut cores) = (None, None);
        for (name, q) in e.capacity.iter().flat_map(|c| c.requests.iter().flatten()) {
            match name.as_str() {
                CAPACITY_MEMORY => {
                    let v = parse_capacity(&request, CAPACITY_MEMORY, q)?;
                    // the policy's minimum and step are 1Mi: a request is rounded up to them
                    let mib = whole_mib(v).max(1);
                    memory_mib = Some(u64::try_from(mib).unwrap_or(u64::MAX));
                }
                CAPACITY_CORES => {
                    let v = parse_capacity(&request, CAPACITY_CORES, q)?.ceil_integer();
                    let pct = u32::try_from(v).ok().filter(|&p| p <= 100).ok_or_else(|| ClaimError::BadCapacity {
                        request: request.clone(),
                        capacity: CAPACITY_CORES,
                        value: q.0.clone(),
                        why: "is above 100 (cores are percent of one GPU)".into(),
                    })?;
                    cores = Some(pct);
                }
                CAPACITY_SHARES => {
                    if parse_capacity(&request, CAPACITY_SHARES, q)?.ceil_integer() > 1 {
                        return Err(ClaimError::BadCapacity {
                            request,
                            capacity: CAPACITY_SHARES,
                            value: q.0.clone(),
                            why: "is above 1 (a claim takes one share of each GPU)".into(),
                        });
                    }
                }
                other => return Err(ClaimError::UnknownCapacity { request, capacity: other.into() }),
            }
        }
        out.push(RequestDemand { name: request, count, memory_mib, cores, models });
    }
    let names: Vec<String> = out.iter().map(|r| r.name.clone()).collect();
    let mut constraints = Vec::new();
    for c in devices.constraints.iter().flatten() {
        let requests = match c.requests.as_deref() {
            Some(listed) if !listed.is_empty() => {
                if let Some(unknown) = listed.iter().find(|r| !names.contains(r)) {
                    let attribute = c.match_attribute.clone().or(c.distinct_attribute.clone()).unwrap_or_default();
                    return Err(ClaimError::UnknownConstraintRequest { attribute, request: unknown.clone() });
                }
                listed.to_vec()
            }
            _ => names.clone(),
        };
        if let Some(attribute) = &c.match_attribute {
            constraints.push(Constraint { requests: requests.clone(), attribute: attribute.clone(), distinct: false });
        }
        if let Some(attribute) = &c.distinct_attribute {
            constraints.push(Constraint { requests, attribute: attribute.clone(), distinct: true });
        }
    }
    Ok(Some(ClaimDemand { requests: out, constraints }))
}

/// The GPUs chosen for each request (by request name; each list in the order the results are written).
pub type Chosen = BTreeMap<String, Vec<u32>>;

/// Whether the claim's constraints hold on the chosen GPUs; `attribute(gpu, name)` is the GPU's
/// attribute of that fully qualified name (`None` when it has none: the constraint then fails, as
/// the allocator's does for a device without the attribute).
pub fn check_constraints(
    demand: &ClaimDemand,
    chosen: &Chosen,
    attribute: impl Fn(u32, &str) -> Option<DeviceAttribute>,
) -> Result<(), ClaimError> {
    for c in &demand.constraints {
        let gpus: Vec<u32> = c.requests.iter().flat_map(|r| chosen.get(r).into_iter().flatten().copied()).collect();
        let values: Vec<Option<DeviceAttribute>> = gpus.iter().map(|&g| attribute(g, &c.attribute)).collect();
        let holds = values.iter().all(Option::is_some)
            && if c.distinct {
                values.iter().enumerate().all(|(i, v)| !values[..i].contains(v))
            } else {
                values.windows(2).all(|w| w[0] == w[1])
            };
        if !holds {
            return Err(ClaimError::ConstraintUnmet {
                kind: if c.distinct { "distinctAttribute" } else { "matchAttribute" },
                attribute: c.attribute.clone(),
                requests: c.requests.clone(),
            });
        }
    }
    Ok(())
}

/// A `shareID` for one result: a UUID derived from the claim's UID, the request and the GPU, so that
/// writing the same allocation again writes the same IDs.
pub fn share_id(claim_uid: &str, request: &str, gpu: u32) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, format!("{claim_uid}/{request}/{gpu}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest.as_ref()[..16]);
    // RFC 9562 layout: version 8 (custom), variant 10
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// The node selector of an allocation on `node`'s devices: that node only, by name.
pub fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".into(),
                operator: "In".into(),
                values: Some(vec![node.to_string()]),
            }]),
            ..Default::default()
        }],
    }
}

/// Where a claim is placed: the node (its pool has the node's name), the GPUs chosen per request,
/// and each GPU's memory there.
pub struct Placement<'a> {
    pub node: &'a str,
    pub chosen: &'a Chosen,
    pub gpu_memory_mib: &'a dyn Fn(u32) -> Option<u64>,
}

/// The claim's `status.allocation` for a placement: a result per chosen GPU with its `shareID` and
/// consumption, the class's and the claim's configuration for the driver (class first, as
/// kube-scheduler writes them), the node selector and the time.
pub fn allocation(
    claim_uid: &str,
    spec: &ResourceClaimSpec,
    demand: &ClaimDemand,
    driver: &str,
    class_config: &[DeviceClassConfiguration],
    placement: &Placement<'_>,
    now: Time,
) -> Result<AllocationResult, ClaimError> {
    let mut results = Vec::new();
    for r in &demand.requests {
        let gpus = placement.chosen.get(&r.name).map(Vec::as_slice).unwrap_or_default();
        if gpus.len() != r.count as usize {
            return Err(ClaimError::WrongCount { request: r.name.clone(), want: r.count, got: gpus.len() });
        }
        for &gpu in gpus {
            let memory = (placement.gpu_memory_mib)(gpu).ok_or_else(|| ClaimError::UnknownDevice {
                request: r.name.clone(),
                node: placement.node.to_string(),
                gpu,
            })?;
            let (mib, cores) = r.consumption(memory);
            results.push(DeviceRequestAllocationResult {
                request: r.name.clone(),
                driver: driver.to_string(),
                pool: placement.node.to_string(),
                device: device_name(gpu),
                share_id: Some(share_id(claim_uid, &r.name, gpu)),
                consumed_capacity: Some(BTreeMap::from([
                    (CAPACITY_MEMORY.to_string(), Quantity(format!("{mib}Mi"))),
                    (CAPACITY_CORES.to_string(), Quantity(cores.to_string())),
                    (CAPACITY_SHARES.to_string(), Quantity("1".into())),
                ])),
                ..Default::default()
            });
        }
    }
    let all: Vec<String> = demand.requests.iter().map(|r| r.name.clone()).collect();
    let mut config: Vec<DeviceAllocationConfiguration> = class_config
        .iter()
        .filter(|c| c.opaque.as_ref().is_some_and(|o| o.driver == driver))
        .map(|c| DeviceAllocationConfiguration {
            opaque: c.opaque.clone(),
            requests: Some(all.clone()),
            source: "FromClass".into(),
        })
        .collect();
    let claim_config = spec.devices.as_ref().and_then(|d| d.config.as_ref()).into_iter().flatten();
    config.extend(claim_config.filter(|c| c.opaque.as_ref().is_some_and(|o| o.driver == driver)).map(|c| {
        DeviceAllocationConfiguration {
            opaque: c.opaque.clone(),
            requests: c.requests.clone(),
            source: "FromClaim".into(),
        }
    }));
    Ok(AllocationResult {
        allocation_timestamp: Some(now),
        devices: Some(DeviceAllocationResult {
            config: (!config.is_empty()).then_some(config),
            results: Some(results),
        }),
        node_selector: Some(node_selector(placement.node)),
    })
}

fn consumed(
    r: &DeviceRequestAllocationResult,
    name: &'static str,
) -> Result<Option<crate::quantity::Quantity>, ClaimError> {
    let Some(q) = r.consumed_capacity.as_ref().and_then(|c| c.get(name)) else { return Ok(None) };
    let bad = |why: String| ClaimError::BadConsumption {
        request: r.request.clone(),
        capacity: name,
        value: q.0.clone(),
        why,
    };
    let v = crate::quantity::parse(&q.0).map_err(|e| bad(e.to_string()))?;
    if v.is_negative() {
        return Err(bad("is negative".into()));
    }
    Ok(Some(v))
}

/// What an allocated claim holds on `driver`'s devices, as the model's record (keyed by
/// [`claim_key`], one container per request); `None` when it holds none. A result without a
/// `shareID` is exclusive use, as kube-scheduler counts it; consumption is rounded up to MiB and
/// percent.
pub fn allocated(claim: &ResourceClaim, driver: &str) -> Result<Option<PodAssignment>, ClaimError> {
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let mut pool: Option<&str> = None;
    let mut containers: Vec<ContainerAssignment> = Vec::new();
    for r in results.into_iter().flatten().filter(|r| r.driver == driver) {
        match pool {
            Some(p) if p != r.pool => return Err(ClaimError::TwoPools { first: p.into(), second: r.pool.clone() }),
            _ => pool = Some(&r.pool),
        }
        let gpu = device_index(&r.device)
            .ok_or_else(|| ClaimError::ForeignDevice { request: r.request.clone(), device: r.device.clone() })?;
        let mem_mib = consumed(r, CAPACITY_MEMORY)?.map_or(0, whole_mib);
        let core_pct = consumed(r, CAPACITY_CORES)?.map_or(0, |q| q.ceil_integer());
        let slice = GpuSlice {
            gpu,
            mem_mib: u64::try_from(mem_mib).unwrap_or(u64::MAX),
            core_pct: u32::try_from(core_pct).unwrap_or(u32::MAX),
            exclusive: r.share_id.is_none(),
        };
        match containers.iter_mut().find(|c| c.name == r.request) {
            Some(c) => c.slices.push(slice),
            None => containers.push(ContainerAssignment { name: r.request.clone(), init: false, slices: vec![slice] }),
        }
    }
    let Some(node) = pool else { return Ok(None) };
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    Ok(Some(PodAssignment {
        pod: claim_key(namespace, name),
        node: node.to_string(),
        containers,
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    }))
}

#[cfg(test)]
#[path = "claims_tests.rs"]
mod tests;
