//! What a container was granted in DRA mode, for the guard: its claims' prepared CDI specs say
//! what each request of each claim got per GPU ([`spec_grants`], from the environment
//! [`super::prepare`] wrote), and the pod says which claims (and requests) each container uses
//! ([`container_grants`]). Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::dra::cdi::{device_env, env_numbers};
use crate::driver_limits::{status_container_id, ContainerGrants, PodGrants};
use crate::guard::Grant;

/// One request of a prepared claim: its GPUs and their limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimGrant {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// The claim's request (`request` or `request/subrequest`).
    pub request: String,
    pub grants: BTreeMap<u32, Grant>,
}

/// Each CDI device of a prepared claim's spec, as a [`ClaimGrant`] (whole GPUs included, marked
/// exclusive); devices without the claim's environment are skipped.
pub fn spec_grants(spec: &Value) -> Vec<ClaimGrant> {
    let mut out = Vec::new();
    for device in spec["devices"].as_array().into_iter().flatten() {
        let env = device_env(device);
        let (Some(claim), Some(request)) = (env.get("GPUPLACE_CLAIM"), env.get("GPUPLACE_CLAIM_REQUEST")) else {
            continue;
        };
        let list = |k: &str| env_numbers(&env, k);
        let (gpus, mem, core) =
            (list("GPUPLACE_GPU_INDICES"), list("GPUPLACE_GPU_MEM_MIB"), list("GPUPLACE_GPU_CORE_PCT"));
        let exclusive = env.get("GPUPLACE_EXCLUSIVE") != Some(&"false");
        let grants = gpus
            .iter()
            .enumerate()
            .filter_map(|(i, &gpu)| {
                let grant = Grant { mem_mib: *mem.get(i)?, core_pct: u32::try_from(*core.get(i)?).ok()?, exclusive };
                Some((u32::try_from(gpu).ok()?, grant))
            })
            .collect();
        out.push(ClaimGrant { claim: claim.to_string(), request: request.to_string(), grants });
    }
    out
}

/// What container `container` of `pod` was granted through its claims, by GPU; `None` when it uses
/// no claim prepared here (nothing of this driver: not the guard's to judge). A container naming a
/// claim without a request gets all its requests; a request names its subrequests too. Two claims
/// on one GPU add up.
pub fn container_grants(pod: &Pod, container: &str, prepared: &[ClaimGrant]) -> Option<BTreeMap<u32, Grant>> {
    let spec = pod.spec.as_ref()?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("");
    let c = spec.containers.iter().chain(spec.init_containers.iter().flatten()).find(|c| c.name == container)?;
    let refs = c.resources.as_ref().and_then(|r| r.claims.as_ref())?;
    let statuses = pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_ref());
    // the pod's claim entry -> the ResourceClaim's name: direct, or made from a template
    let claim_name = |entry: &str| -> Option<String> {
        let pc = spec.resource_claims.iter().flatten().find(|p| p.name == entry)?;
        match &pc.resource_claim_name {
            Some(n) => Some(n.clone()),
            None => statuses?.iter().find(|s| s.name == entry)?.resource_claim_name.clone(),
        }
    };
    let mut out: BTreeMap<u32, Grant> = BTreeMap::new();
    let mut found = false;
    for r in refs {
        let Some(name) = claim_name(&r.name) else { continue };
        let key = format!("{namespace}/{name}");
        let wanted = |request: &str| match r.request.as_deref() {
            None | Some("") => true,
            Some(want) => request == want || request.strip_prefix(want).is_some_and(|rest| rest.starts_with('/')),
        };
        for g in prepared.iter().filter(|g| g.claim == key && wanted(&g.request)) {
            found = true;
            for (gpu, grant) in &g.grants {
                out.entry(*gpu)
                    .and_modify(|e| {
                        e.mem_mib += grant.mem_mib;
                        e.core_pct = (e.core_pct + grant.core_pct).min(100);
                        e.exclusive |= grant.exclusive;
                    })
                    .or_insert(*grant);
            }
        }
    }
    found.then_some(out)
}

/// A running pod's containers with claims prepared here, for the driver's memory caps; `None` for
/// a finished pod or one with none.
pub fn pod_grants(pod: &Pod, prepared: &[ClaimGrant]) -> Option<PodGrants> {
    let status = pod.status.as_ref();
    if matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let names = spec
        .containers
        .iter()
        .map(|c| (c.name.as_str(), false))
        .chain(spec.init_containers.iter().flatten().map(|c| (c.name.as_str(), true)));
    let containers: Vec<ContainerGrants> = names
        .filter_map(|(name, init)| {
            let grants = container_grants(pod, name, prepared)?;
            Some(ContainerGrants { name: name.to_string(), container_id: status_container_id(pod, name), init, grants })
        })
        .collect();
    (!containers.is_empty()).then(|| PodGrants {
        pod: format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or(""),
            pod.metadata.name.as_deref().unwrap_or("")
        ),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        containers,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn device(claim: &str, request: &str, gpus: &str, mem: &str, core: &str, exclusive: bool) -> Value {
        json!({"name": "x", "containerEdits": {"env": [
            format!("GPUPLACE_CLAIM={claim}"),
            format!("GPUPLACE_CLAIM_REQUEST={request}"),
            format!("GPUPLACE_GPU_INDICES={gpus}"),
            format!("GPUPLACE_GPU_MEM_MIB={mem}"),
            format!("GPUPLACE_GPU_CORE_PCT={core}"),
            format!("GPUPLACE_EXCLUSIVE={exclusive}"),
        ]}})
    }

    fn share(mem_mib: u64, core_pct: u32) -> Grant {
        Grant { mem_mib, core_pct, exclusive: false }
    }

    #[test]
    fn specs_give_each_requests_gpus_and_limits() {
        let spec = json!({"devices": [
            device("ml/a", "gpu", "3", "20480", "30", false),
            device("ml/a", "pair", "0,1", "81559,81559", "100,100", true),
            {"name": "foreign", "containerEdits": {"env": ["A=b"]}}
        ]});
        let g = spec_grants(&spec);
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].claim.as_str(), g[0].request.as_str()), ("ml/a", "gpu"));
        assert_eq!(g[0].grants, BTreeMap::from([(3, share(20_480, 30))]));
        let whole = Grant { mem_mib: 81_559, core_pct: 100, exclusive: true };
        assert_eq!(g[1].grants, BTreeMap::from([(0, whole), (1, whole)]));
    }

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u"},
            "spec": {
                "resourceClaims": [
                    {"name": "shared", "resourceClaimName": "team-gpu"},
                    {"name": "own", "resourceClaimTemplateName": "one-share"}
                ],
                "containers": [
                    {"name": "main", "image": "i", "resources": {"claims": [{"name": "own"}, {"name": "shared", "request": "small"}]}},
                    {"name": "sidecar", "image": "i"}
                ]
            },
            "status": {"resourceClaimStatuses": [{"name": "own", "resourceClaimName": "p-own-x7k2q"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_container_gets_the_requests_of_the_claims_it_names() {
        let prepared = vec![
            ClaimGrant {
                claim: "ml/p-own-x7k2q".into(),
                request: "gpu".into(),
                grants: [(2, share(10_000, 20))].into(),
            },
            ClaimGrant {
                claim: "ml/team-gpu".into(),
                request: "small/a".into(),
                grants: [(2, share(4_000, 10))].into(),
            },
            ClaimGrant { claim: "ml/team-gpu".into(), request: "big".into(), grants: [(5, share(40_000, 50))].into() },
            // the same names in another namespace are another claim
            ClaimGrant { claim: "other/team-gpu".into(), request: "small".into(), grants: [(6, share(1, 1))].into() },
        ];
        let got = container_grants(&pod(), "main", &prepared).unwrap();
        assert_eq!(got, BTreeMap::from([(2, share(14_000, 30))]));
        assert_eq!(container_grants(&pod(), "sidecar", &prepared), None, "no claims: not judged");
        assert_eq!(container_grants(&pod(), "nobody", &prepared), None);
        // claims named but none prepared here (another driver's)
        assert_eq!(container_grants(&pod(), "main", &[]), None);
    }

    #[test]
    fn a_running_pods_claimed_containers_are_its_grants_for_the_driver_caps() {
        let prepared = vec![ClaimGrant {
            claim: "ml/p-own-x7k2q".into(),
            request: "gpu".into(),
            grants: [(2, share(10_000, 20))].into(),
        }];
        let mut p = pod();
        let id = "A".repeat(64);
        p.status.as_mut().unwrap().container_statuses = Some(vec![serde_json::from_value(json!({
            "name": "main", "containerID": format!("containerd://{id}"), "image": "", "imageID": "", "ready": true, "restartCount": 0
        }))
        .unwrap()]);
        let g = pod_grants(&p, &prepared).unwrap();
        assert_eq!((g.pod.as_str(), g.uid.as_str()), ("ml/p", "u"));
        assert_eq!(g.containers.len(), 1, "the sidecar names no claim");
        let c = &g.containers[0];
        assert_eq!(
            (c.name.as_str(), c.container_id.as_deref(), c.init),
            ("main", Some("a".repeat(64).as_str()), false)
        );
        assert_eq!(c.grants, BTreeMap::from([(2, share(10_000, 20))]));
        assert_eq!(pod_grants(&p, &[]), None, "no claim prepared here");
        p.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert_eq!(pod_grants(&p, &prepared), None, "finished");
    }
}
