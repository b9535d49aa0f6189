//! Issue 32 on the real node: the device plugin in DRA mode, installed from the chart
//! (`devicePlugin.dra.enabled`), registers with the v1.36 kubelet as the DRA driver
//! `gpu.gpuplace.io`; kube-scheduler alone (native DRA) allocates claims from its ResourceSlice; the
//! kubelet calls NodePrepareResources and hands the claim's CDI device to containerd 2, which applies
//! the CDI spec: each container's environment is read back and checked against its claim's
//! allocation. From the kubelet's side, its DRA checkpoint names each claim with the CDI device the
//! plugin answered; deleting the pods unprepares the claims (their CDI specs go). Then the same with
//! gpuplace allocating the claims (`devicePlugin.dra.allocator=gpuplace` and `gpuplace serve
//! --dra-driver`): the pods are gated at admission, gpuplace writes the allocations, and the kubelet
//! prepares those.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use super::{create_and_time, env_of, render_chart_with, wait_for, NS, SYSTEM_NS};
use crate::cluster::{apply, figure, repo, workspace_bin, ControlPlane, User};
use crate::fleet::Extender;
use crate::node::{build_images, RealNode, BUSYBOX_IMAGE};
use crate::SERIAL;

const NODE: &str = "e2e-dra-node";
const DRIVER: &str = "gpu.gpuplace.io";

/// A busybox pod that prints its environment and sleeps, with one claim: `template` (a
/// ResourceClaimTemplate) or a ResourceClaim's name.
fn claim_pod(name: &str, claim: &str, template: bool) -> Pod {
    let source =
        if template { json!({"resourceClaimTemplateName": claim}) } else { json!({"resourceClaimName": claim}) };
    let mut rc = json!({"name": "gpu"});
    rc.as_object_mut().unwrap().extend(source.as_object().unwrap().clone());
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [rc],
            "containers": [{
                "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "env; exec sleep 1000000"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
        },
    }))
    .expect("a claim pod")
}

/// The claim a pod's `gpu` claim resolved to (a template's generated claim, or the named one).
fn claim_name_of(p: &Pod) -> Option<String> {
    let spec = p.spec.as_ref()?.resource_claims.as_ref()?.first()?;
    if let Some(n) = &spec.resource_claim_name {
        return Some(n.clone());
    }
    p.status.as_ref()?.resource_claim_statuses.as_ref()?.iter().find(|s| s.name == "gpu")?.resource_claim_name.clone()
}

/// What the container's environment must say for its claim: the GPUs the allocation names (UUIDs
/// from the slice's attributes), in index order, with what each result consumed.
fn dra_env_problems(
    pod: &str,
    claim: &ResourceClaim,
    uuids: &BTreeMap<String, String>,
    env: &BTreeMap<String, String>,
) -> Vec<String> {
    let results = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref());
    // (index, UUID, MiB, cores)
    type Gpu = (u32, String, u64, u64);
    let mut gpus: Vec<Gpu> = Vec::new();
    for r in results.iter().flat_map(|d| d.results.iter().flatten()).filter(|r| r.driver == DRIVER) {
        let index: u32 = r.device.trim_start_matches("gpu-").parse().unwrap_or(u32::MAX);
        let q = |k: &str| r.consumed_capacity.as_ref().and_then(|c| c.get(k)).map(|q| q.0.clone()).unwrap_or_default();
        let mib = gpuplace_core::quantity::parse(&q("memory")).map(|v| (v.ceil_integer() >> 20) as u64).unwrap_or(0);
        let cores = q("cores").parse().unwrap_or(0);
        gpus.push((index, uuids.get(&r.device).cloned().unwrap_or_default(), mib, cores));
    }
    gpus.sort();
    let list = |f: &dyn Fn(&Gpu) -> String| gpus.iter().map(f).collect::<Vec<_>>().join(",");
    let mut want: BTreeMap<&str, String> = BTreeMap::new();
    want.insert("NVIDIA_VISIBLE_DEVICES", list(&|g| g.1.clone()));
    want.insert("GPUPLACE_GPU_INDICES", list(&|g| g.0.to_string()));
    want.insert("GPUPLACE_GPU_MEM_MIB", list(&|g| g.2.to_string()));
    want.insert("GPUPLACE_GPU_CORE_PCT", list(&|g| g.3.to_string()));
    want.insert("GPUPLACE_CLAIM", format!("{NS}/{}", claim.name_any()));
    let whole = gpus.iter().all(|g| g.3 == 100);
    want.insert("GPUPLACE_EXCLUSIVE", whole.to_string());
    if !whole {
        want.insert(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            gpus.iter().enumerate().map(|(i, g)| format!("{i}={}M", g.2)).collect::<Vec<_>>().join(","),
        );
    }
    want.iter()
        .filter(|(k, v)| env.get(**k) != Some(*v))
        .map(|(k, v)| format!("{pod}: {k}={:?}, the claim's allocation says {v:?}", env.get(*k)))
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn dra_claim_pods_get_their_gpus_through_node_prepare_resources_on_a_real_node() {
    claim_pods_run_on_the_real_node(false).await;
}

/// The same with gpuplace allocating the claims (`devicePlugin.dra.allocator=gpuplace`: the gate
/// policy, the tainted devices, `gpuplace serve --dra-driver`): the kubelet prepares what gpuplace
/// wrote, and each container's environment is gpuplace's allocation.
#[tokio::test(flavor = "current_thread")]
async fn claims_gpuplace_allocates_are_prepared_by_the_kubelet_on_a_real_node() {
    claim_pods_run_on_the_real_node(true).await;
}

/// The scenario of the module documentation; with `gpuplace`, gpuplace allocates the claims instead
/// of kube-scheduler.
async fn claim_pods_run_on_the_real_node(gpuplace: bool) {
    let _serial = SERIAL.lock().await;
    let who = if gpuplace { "gpuplace" } else { "native DRA" };
    let t0 = Instant::now();
    let bin_dir = workspace_bin("gpuplace-device-plugin").parent().expect("the binaries' folder").to_path_buf();
    let images = build_images(&bin_dir);
    let mut cp = ControlPlane::start(if gpuplace { "real-node-dra-gpuplace" } else { "real-node-dra" }).await;
    cp.start_controller_manager();
    let admin = cp.client(User::Admin).await;
    let node = RealNode::start(&cp, NODE, &images).await;
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"gpuplace.io/gpu-node": "true"}}})),
        )
        .await
        .expect("label the GPU node");

    // ---- the device plugin from the chart, in DRA mode; no extender (native DRA places the pods)
    let cdi_dir = node.dir.join("containerd/cdi");
    let mut more = vec![
        "devicePlugin.dra.enabled=true".to_string(),
        format!("devicePlugin.dra.cdiDir={}", cdi_dir.display()),
        "scheduler.mode=none".to_string(),
    ];
    if gpuplace {
        more.push("devicePlugin.dra.allocator=gpuplace".to_string());
    }
    let objects = render_chart_with(&images, &node, &more);
    for name in [SYSTEM_NS, NS] {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
        Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &ns).await.expect("create a namespace");
    }
    for o in objects.iter().filter(|o| o["kind"] != "Deployment") {
        apply(&admin, o, false).await.unwrap_or_else(|e| panic!("applying the chart's objects: {e}"));
    }
    cp.start_scheduler(&repo().join("scheduler-config/kube-scheduler-config-http.yaml"), None);
    // gpuplace's extender (not through kube-scheduler: claim pods never reach an extender) allocates
    let ext = if gpuplace {
        let mut ext = Extender::start(&cp, "replica-a", 0, &["--dra-driver", DRIVER]);
        // generous limits: CI machines are slower than the dev VM, and this scenario failed there
        // once before its first figure with the message cut out (stop 43)
        ext.wait_ready(Duration::from_secs(120)).await;
        crate::dra::wait_gate_policy(&admin, NS).await;
        Some(ext)
    } else {
        None
    };
    let t = Instant::now();
    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), SYSTEM_NS);
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    wait_for("the DRA driver's pod ready and its slice published", Duration::from_secs(120), || {
        let (daemonsets, slices) = (daemonsets.clone(), slices.clone());
        async move {
            let ds = daemonsets.get("gpuplace-device-plugin").await.map_err(|e| e.to_string())?;
            let ready = ds.status.map(|s| s.number_ready).unwrap_or(0);
            let lp = ListParams::default().fields(&format!("spec.nodeName={NODE}"));
            let found = slices.list(&lp).await.map_err(|e| e.to_string())?.items;
            let devices = found.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum::<usize>();
            if ready == 1 && devices == 8 {
                Ok(())
            } else {
                Err(format!("ready {ready}, {devices} devices in {} slices", found.len()))
            }
        }
    })
    .await;
    // kubelet registered the driver and connected to its service socket (its DRA plugin manager
    // logs the connection); claim pods created before that would wait on kubelet's back-off
    wait_for("the kubelet's registration of the DRA driver", Duration::from_secs(60), || {
        let log = std::fs::read_to_string(node.dir.join("kubelet.log")).unwrap_or_default();
        async move {
            let connected =
                log.lines().any(|l| l.contains(&format!("driverName=\"{DRIVER}\"")) && l.contains("connected=true"));
            if connected {
                Ok(())
            } else {
                // the kubelet's last lines about DRA plugins say how far it got
                let dra: Vec<&str> = log.lines().filter(|l| l.contains("DRA") || l.contains("plugin")).collect();
                let tail = dra[dra.len().saturating_sub(6)..].join("\n");
                Err(format!("the kubelet has not connected to {DRIVER}; its last plugin lines:\n{tail}"))
            }
        }
    })
    .await;
    figure(&format!(
        "real node: DRA driver {DRIVER} from the chart: pod ready, 8 devices published, registered with the kubelet in {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let slice =
        slices.list(&ListParams::default().fields(&format!("spec.nodeName={NODE}"))).await.expect("slices").items;
    let uuids: BTreeMap<String, String> = slice
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| {
            (
                d.name.clone(),
                d.attributes.as_ref().and_then(|a| a.get("uuid")).and_then(|a| a.string.clone()).unwrap_or_default(),
            )
        })
        .collect();

    // ---- claims: two shares from a template, and an NVLink pair
    let template = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "share-20g", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "20000Mi", "cores": "25"}}}}]}}},
    });
    apply(&admin, &template, false).await.expect("the claim template");
    let pair = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "pair", "namespace": NS},
        "spec": {"devices": {
            "requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": format!("{DRIVER}/nvlinkDomain")}],
        }},
    });
    apply(&admin, &pair, false).await.expect("the pair claim");
    let pods = vec![
        claim_pod("share-a", "share-20g", true),
        claim_pod("share-b", "share-20g", true),
        claim_pod("pair", "pair", false),
    ];
    let n = pods.len();
    let times = create_and_time(&admin, pods, Duration::from_secs(120)).await;
    let api: Api<Pod> = Api::namespaced(admin.clone(), NS);
    if times.len() < n {
        let mut report = String::new();
        for p in api.list(&ListParams::default()).await.expect("pods").items {
            report += &format!("{}: {:?}\n", p.name_any(), p.status.as_ref().and_then(|s| s.conditions.clone()));
        }
        let ext_log = ext.as_ref().map(|e| e.proc.tail(30)).unwrap_or_default();
        panic!(
            "only {:?} of {n} claim pods Running:\n{report}\nkubelet:\n{}\nextender:\n{ext_log}",
            times.keys(),
            node.kubelet_tail()
        );
    }

    // ---- each container's environment is its claim's allocation
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let mut problems = Vec::new();
    let mut claim_uids = Vec::new();
    for p in api.list(&ListParams::default()).await.expect("pods").items {
        let claim = claims.get(&claim_name_of(&p).expect("the pod's claim")).await.expect("the claim");
        claim_uids.push(claim.uid().unwrap_or_default());
        let until = Instant::now() + Duration::from_secs(10);
        let mut env = env_of(&node, &p);
        while !env.contains_key("GPUPLACE_CLAIM") && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
            env = env_of(&node, &p);
        }
        problems.extend(dra_env_problems(&p.name_any(), &claim, &uuids, &env));
        if gpuplace {
            // gpuplace's write: its deterministic share IDs on every result
            let uid = claim.uid().unwrap_or_default();
            let results = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref());
            for r in results.iter().flat_map(|d| d.results.iter().flatten()) {
                let gpu = gpuplace_core::dra::device_index(&r.device).expect("a gpuplace device");
                let want = gpuplace_core::dra::claims::share_id(&uid, &r.request, gpu);
                if r.share_id.as_deref() != Some(want.as_str()) {
                    problems.push(format!("{}: {} not allocated by gpuplace", p.name_any(), claim.name_any()));
                }
            }
        }
    }
    assert!(problems.is_empty(), "containers without their claim's environment:\n{}", problems.join("\n"));

    if !gpuplace {
        the_guard_holds_claim_shares(&admin, &node, &api).await;
    }

    // ---- the kubelet's side: its DRA checkpoint holds each claim with the plugin's CDI device
    let checkpoint =
        std::fs::read_to_string(node.root_dir.join("dra_manager_state")).expect("the kubelet's DRA checkpoint");
    for uid in &claim_uids {
        assert!(checkpoint.contains(uid.as_str()), "claim {uid} not in the kubelet's checkpoint:\n{checkpoint}");
        assert!(
            checkpoint.contains(&format!("{DRIVER}/claim={uid}-")),
            "claim {uid}'s CDI device not in the checkpoint"
        );
        assert!(cdi_dir.join(format!("{DRIVER}-claim_{uid}.json")).is_file(), "no CDI spec for claim {uid}");
    }
    // and its pod status shows each claim device's health from the plugin's health stream
    let t = Instant::now();
    wait_for("the claim devices' health in the pods' status", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let mut missing = Vec::new();
            for p in api.list(&ListParams::default()).await.map_err(|e| e.to_string())?.items {
                let statuses = p.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
                let healthy: Vec<String> = statuses
                    .iter()
                    .flat_map(|c| c.allocated_resources_status.iter().flatten())
                    .flat_map(|r| r.resources.iter().flatten())
                    .filter(|r| r.health.as_deref() == Some("Healthy") && r.resource_id.starts_with(DRIVER))
                    .map(|r| r.resource_id.clone())
                    .collect();
                if healthy.is_empty() {
                    missing.push(p.name_any());
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("no healthy {DRIVER} device in the status of {missing:?}"))
            }
        }
    })
    .await;
    figure(&format!(
        "real node ({who}): the kubelet shows the claim devices Healthy in the pods' status {:.1} s after they ran (the plugin's DRAResourceHealth stream)",
        t.elapsed().as_secs_f64()
    ));
    figure(&format!(
        "real node ({who} allocating): {n} DRA claim pods (2 shares of 20000Mi and 25 cores from a template, an NVLink pair) Running with their allocation's environment through NodePrepareResources and CDI; create to Running {:?} s",
        times.values().map(|t| (t * 10.0).round() / 10.0).collect::<Vec<_>>()
    ));

    // ---- deleted pods: the kubelet unprepares their claims, whose CDI specs go
    let t = Instant::now();
    for p in ["share-a", "share-b", "pair"] {
        api.delete(p, &DeleteParams::default()).await.expect("delete a pod");
    }
    wait_for("the claims unprepared", Duration::from_secs(60), || {
        let left: Vec<String> =
            claim_uids.iter().filter(|u| cdi_dir.join(format!("{DRIVER}-claim_{u}.json")).exists()).cloned().collect();
        async move {
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("CDI specs left for {left:?}"))
            }
        }
    })
    .await;
    figure(&format!(
        "real node ({who}): pods deleted, their claims unprepared (CDI specs removed) in {:.1} s; scenario {:.0} s",
        t.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    ));
    drop(ext);
    drop(node);
}

/// Issue 49 in DRA mode: a share's grant is its claim's allocation (the prepared CDI spec). The fake
/// driver has per-cgroup limits: each share's cgroup is capped at its claim, the whole-GPU pair's
/// not. The guard behind them: share-a at 10000 MiB over its 20000Mi gets `GpuMemoryOverGrant` and,
/// after the grace, its process is killed; share-b within its own is untouched.
async fn the_guard_holds_claim_shares(admin: &kube::Client, node: &RealNode, api: &Api<Pod>) {
    use super::guard::{cap_of, capped, container, events_of, pids_of, write_processes, GRACE};
    let dir = super::guard::host_dir(&node.dir);
    let (a, b) = (api.get("share-a").await.expect("share-a"), api.get("share-b").await.expect("share-b"));
    let gpu_of = |p: &Pod| -> u32 {
        let env = env_of(node, p);
        env.get("GPUPLACE_GPU_INDICES").and_then(|g| g.parse().ok()).expect("a share's one GPU")
    };
    let (ga, gb) = (gpu_of(&a), gpu_of(&b));
    let ((a_cid, a_restarts), (b_cid, b_restarts)) = (container(&a), container(&b));
    // driver-limits (the fake driver has them): each claim share's cgroup capped at its claim, the
    // whole-GPU pair not at all
    let a_cap_s = capped(&node.dir, "share-a", &a_cid, 20_000).await;
    let b_cap_s = capped(&node.dir, "share-b", &b_cid, 20_000).await;
    let pair = api.get("pair").await.expect("pair");
    assert_eq!(cap_of(&dir, &container(&pair).0), None, "the whole-GPU pair was capped");
    figure(&format!(
        "real node (DRA): driver-limits: the two claim shares' cgroups capped at 20000 MiB ({a_cap_s:.1} s, {b_cap_s:.1} s after Running), the whole-GPU pair not capped"
    ));
    let a_pid = *pids_of(&a_cid).first().expect("share-a's process");
    let b_pid = *pids_of(&b_cid).first().expect("share-b's process");
    write_processes(&dir, &[(ga, a_pid, 30_000), (gb, b_pid, 20_000)]);
    let t = Instant::now();
    wait_for("share-a's GpuMemoryOverGrant Event in DRA mode", Duration::from_secs(30), || {
        let admin = admin.clone();
        async move {
            let ev = events_of(&admin, "share-a").await;
            if ev.contains_key("GpuMemoryOverGrant") {
                Ok(())
            } else {
                Err(format!("its events {ev:?}"))
            }
        }
    })
    .await;
    let event_s = t.elapsed().as_secs_f64();
    wait_for("share-a's process killed in DRA mode", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let alive = std::path::Path::new(&format!("/proc/{a_pid}")).exists();
            let now = container(&api.get("share-a").await.map_err(|e| e.to_string())?).1;
            if !alive && now > a_restarts {
                Ok(())
            } else {
                Err(format!("process alive {alive}, restarts {a_restarts} -> {now}"))
            }
        }
    })
    .await;
    let kill_s = t.elapsed().as_secs_f64();
    assert!(kill_s >= GRACE.as_secs_f64(), "killed before the grace: {kill_s:.1} s");
    let b_now = api.get("share-b").await.expect("share-b");
    assert_eq!(container(&b_now), (b_cid.clone(), b_restarts), "share-b, within its claim, was touched");
    assert!(std::path::Path::new(&format!("/proc/{b_pid}")).exists(), "share-b's process is gone");
    assert!(events_of(admin, "share-b").await.keys().all(|r| !r.starts_with("GpuMemory")), "share-b got an Event");
    write_processes(&dir, &[]);
    figure(&format!(
        "real node (DRA): guard: share-a (claim of 20000Mi on GPU {ga}) at 30000 MiB: GpuMemoryOverGrant after {event_s:.1} s, its process killed after {kill_s:.1} s (grace {} s); share-b (GPU {gb}) within its claim untouched",
        GRACE.as_secs()
    ));
}
