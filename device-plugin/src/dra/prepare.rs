//! NodePrepareResources for one claim: from its allocation to a CDI spec that gives each request's
//! containers their GPUs and limits, gpuplace's contract (pure; [`crate::container_env`]).
//!
//! Only the allocation's results of this driver and this node's pool count (a claim may hold
//! devices of other drivers too). Each result names one of this node's GPUs (`gpu-<index>`); what it
//! consumed (`consumedCapacity`: `memory`, `cores`) is its limit, a result without it (a device not
//! shared) the whole GPU. One CDI device per request of the claim carries the environment for all of
//! that request's GPUs, since a container sees one `NVIDIA_VISIBLE_DEVICES`: it is handed to kubelet
//! with the request's first result, the others carry no CDI device of their own.
//!
//! Refused, with the reason kubelet shows on the pod: a claim not allocated, another claim under the
//! same name (UID differs), no result of this driver on this node, a device that is not one of this
//! node's GPUs, or a GPU that is unhealthy now.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

use super::devices::{device_index, CAPACITY_CORES, CAPACITY_MEMORY};
use crate::container_env::{gpu_env, limit_env, GpuLimit, MpsConnect};
use crate::nvml::Inventory;
use crate::plugin::GpuHealth;

/// The CDI spec version written: env and mount edits need no later one, and containerd 2's CDI
/// reads it.
pub const CDI_VERSION: &str = "0.6.0";

/// Why a claim cannot be prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrepareError {
    #[error("claim {claim} is not allocated")]
    NotAllocated { claim: String },
    #[error("claim {claim} has UID {found}, not {want}: it was deleted and made again")]
    OtherUid { claim: String, want: String, found: String },
    #[error("claim {claim} has no device of driver {driver} on node {node}")]
    NoDevice { claim: String, driver: String, node: String },
    #[error("claim {claim}: device {device} is not a GPU of node {node}")]
    UnknownDevice { claim: String, device: String, node: String },
    #[error("claim {claim}: GPU {index} ({device}) is unhealthy: {reason}")]
    Unhealthy { claim: String, device: String, index: u32, reason: String },
    #[error("claim {claim}: device {device} consumed {name} {value:?}, not a quantity")]
    BadCapacity { claim: String, device: String, name: String, value: String },
}

/// One result handed back to kubelet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    /// The request's CDI device on its first result, empty on the others.
    pub cdi_ids: Vec<String>,
}

/// A prepared claim: the CDI spec to write, and the devices for kubelet.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedClaim {
    pub spec: Value,
    pub devices: Vec<PreparedDevice>,
}

/// What preparing needs to know about this node.
pub struct NodeGpus<'a> {
    pub driver: &'a str,
    /// This node's name, which is its pool's.
    pub node: &'a str,
    pub inventory: &'a Inventory,
    /// By GPU index; a GPU without an entry counts as healthy.
    pub health: &'a [GpuHealth],
    /// How share containers reach the MPS daemon, when there is one.
    pub mps: Option<&'a MpsConnect>,
}

/// The CDI kind of the claims' devices: `<driver>/claim`.
pub fn cdi_kind(driver: &str) -> String {
    format!("{driver}/claim")
}

/// A CDI device name for `request` of claim `uid` (CDI names take letters, digits, `_.:-`; a
/// subrequest's `/` becomes `.`).
fn cdi_name(uid: &str, request: &str) -> String {
    let clean: String =
        request.chars().map(|c| if c.is_ascii_alphanumeric() || "_.:-".contains(c) { c } else { '.' }).collect();
    format!("{uid}-{clean}")
}

/// Whole MiB in a quantity of bytes, rounded down (the allocator rounds requests up to `1Mi`).
fn mib(q: &str) -> Option<u64> {
    let bytes = gpuplace_core::quantity::parse(q).ok()?.as_integer()?;
    u64::try_from(bytes / (1 << 20)).ok()
}

/// Prepares `claim` (`uid` is the one kubelet names) on this node.
pub fn prepare(claim: &ResourceClaim, uid: &str, node: &NodeGpus) -> Result<PreparedClaim, PrepareError> {
    let name = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or(""),
        claim.metadata.name.as_deref().unwrap_or("")
    );
    let found = claim.metadata.uid.as_deref().unwrap_or("");
    if found != uid {
        return Err(PrepareError::OtherUid { claim: name, want: uid.into(), found: found.into() });
    }
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    let results = allocation
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| PrepareError::NotAllocated { claim: name.clone() })?
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == node.driver && r.pool == node.node);
    // by request, in the order of the allocation: (GPU index, its limit, device name)
    type Held = (u32, GpuLimit, String);
    let mut requests: Vec<(String, Vec<Held>)> = Vec::new();
    for r in results {
        let index = device_index(&r.device).filter(|&i| (i as usize) < node.inventory.gpus.len()).ok_or_else(|| {
            PrepareError::UnknownDevice { claim: name.clone(), device: r.device.clone(), node: node.node.into() }
        })?;
        if let Some(h) = node.health.get(index as usize).filter(|h| !h.healthy) {
            return Err(PrepareError::Unhealthy {
                claim: name,
                device: r.device.clone(),
                index,
                reason: h.reason.clone(),
            });
        }
        let total = node.inventory.gpus[index as usize].memory_mib;
        let consumed = |cap: &str| -> Result<Option<u64>, PrepareError> {
            match r.consumed_capacity.as_ref().and_then(|c| c.get(cap)) {
                None => Ok(None),
                Some(q) => {
                    let v = if cap == CAPACITY_MEMORY {
                        mib(&q.0)
                    } else {
                        gpuplace_core::quantity::parse(&q.0)
                            .ok()
                            .and_then(|v| v.as_integer())
                            .and_then(|v| u64::try_from(v).ok())
                    };
                    v.map(Some).ok_or_else(|| PrepareError::BadCapacity {
                        claim: name.clone(),
                        device: r.device.clone(),
                        name: cap.into(),
                        value: q.0.clone(),
                    })
                }
            }
        };
        let mem = consumed(CAPACITY_MEMORY)?.unwrap_or(total).min(total);
        let core = consumed(CAPACITY_CORES)?.unwrap_or(100).min(100) as u32;
        // no shareID: the allocator gave the device to this claim alone
        let exclusive = r.share_id.is_none() || (mem >= total && core >= 100);
        let limit = GpuLimit { mem_mib: mem, core_pct: core, exclusive };
        match requests.iter_mut().find(|(q, _)| *q == r.request) {
            Some((_, gpus)) => gpus.push((index, limit, r.device.clone())),
            None => requests.push((r.request.clone(), vec![(index, limit, r.device.clone())])),
        }
    }
    if requests.is_empty() {
        return Err(PrepareError::NoDevice { claim: name, driver: node.driver.into(), node: node.node.into() });
    }
    let kind = cdi_kind(node.driver);
    let mut cdi_devices = Vec::new();
    let mut devices = Vec::new();
    for (request, mut gpus) in requests {
        let cdi = cdi_name(uid, &request);
        // results in allocation order for kubelet; the environment in GPU index order
        for (i, (_, _, device)) in gpus.iter().enumerate() {
            devices.push(PreparedDevice {
                request: request.clone(),
                pool: node.node.into(),
                device: device.clone(),
                cdi_ids: if i == 0 { vec![format!("{kind}={cdi}")] } else { Vec::new() },
            });
        }
        gpus.sort_by_key(|g| g.0);
        let ids: Vec<(u32, &str)> =
            gpus.iter().map(|g| (g.0, node.inventory.gpus[g.0 as usize].uuid.as_str())).collect();
        let limits: Vec<GpuLimit> = gpus.iter().map(|g| g.1).collect();
        let mut env: BTreeMap<String, String> = gpu_env(&ids).into_iter().collect();
        let uuids: Vec<&str> = ids.iter().map(|i| i.1).collect();
        let (limit_vars, mounts) = limit_env(&limits, &uuids, node.mps);
        env.extend(limit_vars);
        env.insert("GPUPLACE_CLAIM".into(), name.clone());
        env.insert("GPUPLACE_CLAIM_REQUEST".into(), request.clone());
        let mut edits = json!({"env": env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>()});
        if !mounts.is_empty() {
            let mounts: Vec<Value> = mounts
                .iter()
                .map(
                    |m| json!({"hostPath": m.host_path, "containerPath": m.container_path, "options": ["rbind", "rw"]}),
                )
                .collect();
            edits["mounts"] = json!(mounts);
        }
        cdi_devices.push(json!({"name": cdi, "containerEdits": edits}));
    }
    Ok(PreparedClaim { spec: json!({"cdiVersion": CDI_VERSION, "kind": kind, "devices": cdi_devices}), devices })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::fake::FakeBackend;
    use crate::nvml::GpuBackend;

    fn h100() -> Inventory {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/topologies/hgx-h100-8.json");
        FakeBackend::load(&path, "n1").unwrap().inventory().unwrap()
    }

    /// One result: request, driver, pool, device, shared, consumed memory and cores.
    type Allocated<'a> = (&'a str, &'a str, &'a str, &'a str, bool, Option<(&'a str, &'a str)>);

    /// A claim allocated `results`.
    fn claim(uid: &str, results: &[Allocated]) -> ResourceClaim {
        let results: Vec<Value> = results
            .iter()
            .map(|(req, driver, pool, device, shared, consumed)| {
                let mut r = json!({"request": req, "driver": driver, "pool": pool, "device": device});
                if *shared {
                    r["shareID"] = json!("0b0e0c0a-0000-4000-8000-000000000001");
                }
                if let Some((m, c)) = consumed {
                    r["consumedCapacity"] = json!({"memory": m, "cores": c, "shares": "1"});
                }
                r
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": uid},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}},
        }))
        .unwrap()
    }

    fn env_of(spec: &Value, i: usize) -> BTreeMap<String, String> {
        spec["devices"][i]["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect()
    }

    #[test]
    fn a_share_and_a_pair_get_their_limits_and_one_cdi_device_per_request() {
        let inv = h100();
        let mps = MpsConnect { pipe_dir: "/run/mps/pipe".into(), shm_dir: Some("/run/mps/shm".into()) };
        let node = NodeGpus { driver: "gpu.gpuplace.io", node: "n1", inventory: &inv, health: &[], mps: Some(&mps) };
        let c = claim(
            "u1",
            &[
                ("share", "gpu.gpuplace.io", "n1", "gpu-4", true, Some(("20000Mi", "25"))),
                ("pair", "gpu.gpuplace.io", "n1", "gpu-7", true, Some(("81559Mi", "100"))),
                ("pair", "gpu.gpuplace.io", "n1", "gpu-6", false, None),
                // another driver's device in the same claim: not ours to prepare
                ("nic", "nic.example.com", "n1", "eth1", false, None),
            ],
        );
        let p = prepare(&c, "u1", &node).unwrap();
        assert_eq!(p.spec["kind"], "gpu.gpuplace.io/claim");
        assert_eq!(p.devices.len(), 3);
        assert_eq!(p.devices[0].cdi_ids, ["gpu.gpuplace.io/claim=u1-share"]);
        assert_eq!(p.devices[1].cdi_ids, ["gpu.gpuplace.io/claim=u1-pair"]);
        assert!(p.devices[2].cdi_ids.is_empty() && p.devices[2].device == "gpu-6");
        let share = env_of(&p.spec, 0);
        assert_eq!(share["NVIDIA_VISIBLE_DEVICES"], inv.gpus[4].uuid);
        assert_eq!((share["GPUPLACE_GPU_MEM_MIB"].as_str(), share["GPUPLACE_GPU_CORE_PCT"].as_str()), ("20000", "25"));
        assert_eq!(share["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=20000M");
        assert_eq!(share["GPUPLACE_CLAIM"], "ns/c");
        let mounts = &p.spec["devices"][0]["containerEdits"]["mounts"];
        assert_eq!(
            (&mounts[0]["hostPath"], &mounts[0]["containerPath"]),
            (&json!("/run/mps/pipe"), &json!("/run/mps/pipe"))
        );
        assert_eq!((&mounts[1]["hostPath"], &mounts[1]["containerPath"]), (&json!("/run/mps/shm"), &json!("/dev/shm")));
        assert_eq!(share["CUDA_MPS_PIPE_DIRECTORY"], "/run/mps/pipe");
        assert_eq!(share["CUDA_VISIBLE_DEVICES"], inv.gpus[4].uuid);
        // the pair: GPU index order, whole GPUs (all consumed, or not shared at all)
        let pair = env_of(&p.spec, 1);
        assert_eq!(pair["GPUPLACE_GPU_INDICES"], "6,7");
        assert_eq!(pair["NVIDIA_VISIBLE_DEVICES"], format!("{},{}", inv.gpus[6].uuid, inv.gpus[7].uuid));
        assert_eq!(pair["GPUPLACE_EXCLUSIVE"], "true");
        assert!(!pair.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        assert!(!pair.contains_key("CUDA_MPS_PIPE_DIRECTORY") && !pair.contains_key("CUDA_VISIBLE_DEVICES"));
        assert!(p.spec["devices"][1]["containerEdits"].get("mounts").is_none());
    }

    #[test]
    fn claims_that_cannot_be_prepared_say_why() {
        let inv = h100();
        let mut health = vec![GpuHealth { healthy: true, reason: String::new(), xid_count: 0, last_xid: None }; 8];
        health[2] = GpuHealth { healthy: false, reason: "fell off the bus".into(), xid_count: 0, last_xid: None };
        let node = NodeGpus { driver: "gpu.gpuplace.io", node: "n1", inventory: &inv, health: &health, mps: None };
        let ok = claim("u1", &[("g", "gpu.gpuplace.io", "n1", "gpu-1", false, None)]);
        assert!(matches!(prepare(&ok, "u2", &node), Err(PrepareError::OtherUid { .. })));
        let mut bare = ok.clone();
        bare.status = None;
        assert_eq!(prepare(&bare, "u1", &node), Err(PrepareError::NotAllocated { claim: "ns/c".into() }));
        let elsewhere = claim("u1", &[("g", "gpu.gpuplace.io", "n2", "gpu-1", false, None)]);
        assert!(matches!(prepare(&elsewhere, "u1", &node), Err(PrepareError::NoDevice { .. })));
        for device in ["gpu-8", "gpu-01", "nvme0"] {
            let c = claim("u1", &[("g", "gpu.gpuplace.io", "n1", device, false, None)]);
            assert!(matches!(prepare(&c, "u1", &node), Err(PrepareError::UnknownDevice { .. })), "{device}");
        }
        let sick = claim("u1", &[("g", "gpu.gpuplace.io", "n1", "gpu-2", false, None)]);
        let e = prepare(&sick, "u1", &node).unwrap_err();
        assert_eq!(e.to_string(), "claim ns/c: GPU 2 (gpu-2) is unhealthy: fell off the bus");
        let bad = claim("u1", &[("g", "gpu.gpuplace.io", "n1", "gpu-1", true, Some(("lots", "25")))]);
        assert!(matches!(prepare(&bad, "u1", &node), Err(PrepareError::BadCapacity { .. })));
    }
}
