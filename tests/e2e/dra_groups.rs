//! Issue 32, item 3: groups of claim pods placed whole by gpuplace on the real API server and
//! kube-scheduler (`gpuplace serve --dra-driver`, scheduler-config/dra/gpuplace-allocates.yaml).
//!
//! Four H100 nodes, two per ToR, run `gpuplace-device-plugin --dra --dra-allocator gpuplace`; a pod
//! pinned to gpu-00 holds 6 of its GPUs, so tor-0 has 10 GPUs free and tor-1 16. Three jobs of
//! 4-GPU claim pods that must share a ToR arrive together: a `gpuplace.io/group` job of 4 (16 GPUs:
//! only tor-1 holds it), a kube-scheduler PodGroup gang of 2 (8 GPUs, minCount 2, ToR constraint:
//! tor-0's gpu-01), and a job of 3 (12 GPUs) for which no ToR has room. The first two are allocated
//! whole under one ToR each; the third holds nothing, every member gated, until the first job is
//! deleted, and then goes whole under tor-1. No device is over-committed.
//!
//! The gang names its ToR with `gpuplace.io/group-topology`, not the PodGroup's
//! `schedulingConstraints.topology`: with that constraint kube-scheduler 1.36 schedules the group by
//! placements, and rejects pods whose claims are already allocated on every one (`0/2 nodes are
//! available: 2 cannot allocate all claims`, about 1,700 tries a second for 90 s, measured here).
//! gpuplace leaves such a group's claims unallocated with a reason (the `d-topo` PodGroup).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::cluster::{apply, figure, ControlPlane, User};
use crate::dra::{claim, claim_pod, device_use, gpuplace_allocates_on, GpuplaceDra};
use crate::fleet::Extender;
use crate::{NS, SERIAL};

const TOR: &str = "network.gpuplace.io/tor";

/// The claim pod `name` of 4 whole GPUs: a member of the `gpuplace.io/group` job `job` of `size`
/// pods under one ToR, or of the PodGroup `job` (`size` 0).
fn member(name: &str, job: &str, size: usize) -> Pod {
    let mut pod = serde_json::to_value(claim_pod(name, name)).expect("json");
    if size == 0 {
        pod["spec"]["schedulingGroup"] = json!({"podGroupName": job});
        pod["metadata"]["annotations"] = json!({"gpuplace.io/group-topology": TOR});
    } else {
        pod["metadata"]["labels"] = json!({"gpuplace.io/group": job});
        pod["metadata"]["annotations"] =
            json!({"gpuplace.io/group-size": size.to_string(), "gpuplace.io/group-topology": TOR});
    }
    serde_json::from_value(pod).expect("a pod")
}

async fn create_job(client: &Client, job: &str, n: usize, gang: bool) -> Vec<String> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut names = Vec::new();
    for i in 0..n {
        let name = format!("{job}-{i}");
        claims.create(&PostParams::default(), &claim(&name, 4, Value::Null, false)).await.expect("create claim");
        let pod = member(&name, job, if gang { 0 } else { n });
        pods.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
        names.push(name);
    }
    names
}

/// Pod name → its node, for the pods named `prefix-*`.
async fn nodes_of(pods: &Api<Pod>, prefix: &str) -> BTreeMap<String, Option<String>> {
    let list = pods.list(&ListParams::default()).await.expect("list pods").items;
    list.into_iter()
        .filter(|p| p.name_any().starts_with(&format!("{prefix}-")))
        .map(|p| (p.name_any(), p.spec.and_then(|s| s.node_name)))
        .collect()
}

/// Waits until the `n` pods of `prefix` are bound; their nodes.
async fn wait_bound(pods: &Api<Pod>, prefix: &str, n: usize, limit: Duration, ext: &Extender) -> BTreeSet<String> {
    let until = Instant::now() + limit;
    loop {
        let now = nodes_of(pods, prefix).await;
        let nodes: BTreeSet<String> = now.values().flatten().cloned().collect();
        if now.values().filter(|n| n.is_some()).count() >= n {
            return nodes;
        }
        assert!(Instant::now() < until, "{prefix}: {now:?} after {limit:?}; extender:\n{}", ext.proc.tail(30));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn tor_of(node: &str) -> String {
    let i: usize = node.trim_start_matches("gpu-").parse().expect("gpu-NN");
    format!("tor-{}", i / 2)
}

/// The claims of `prefix-*` that hold an allocation.
async fn allocated(claims: &Api<ResourceClaim>, prefix: &str) -> Vec<String> {
    let list = claims.list(&ListParams::default()).await.expect("list claims").items;
    list.into_iter()
        .filter(|c| c.name_any().starts_with(&format!("{prefix}-")))
        .filter(|c| c.status.as_ref().is_some_and(|s| s.allocation.is_some()))
        .map(|c| c.name_any())
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn groups_of_claim_pods_are_allocated_whole_under_one_tor_or_not_at_all() {
    let _serial = SERIAL.lock().await;
    let mut cp = ControlPlane::start_with_gangs("dra-groups").await;
    let admin = cp.client(User::Admin).await;
    let boards = ["gpu-00", "gpu-01", "gpu-02", "gpu-03"].map(|n| (n, "hgx-h100-8"));
    let GpuplaceDra { plugins, ext, .. } = gpuplace_allocates_on(&mut cp, &admin, &boards).await;
    let slices: Api<ResourceSlice> = Api::all(admin.clone());

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    // 6 GPUs of gpu-00 taken by a pod pinned there
    claims.create(&PostParams::default(), &claim("busy-0", 6, Value::Null, false)).await.expect("claim busy");
    let mut busy = serde_json::to_value(claim_pod("busy-0", "busy-0")).expect("json");
    busy["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": "gpu-00"});
    pods.create(&PostParams::default(), &serde_json::from_value(busy).expect("a pod")).await.expect("pod busy");
    let on = wait_bound(&pods, "busy", 1, Duration::from_secs(60), &ext).await;
    assert_eq!(on, BTreeSet::from(["gpu-00".to_string()]));

    // the three jobs at once, oldest first (the gate controller's order: creation, then name)
    apply(
        &admin,
        &json!({"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
            "metadata": {"name": "b-gang", "namespace": NS},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}}}),
        false,
    )
    .await
    .expect("create the PodGroup");
    // a gang kube-scheduler would place by its topology: refused, as kube-scheduler would never bind
    // it once its claims were allocated
    apply(
        &admin,
        &json!({"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
            "metadata": {"name": "d-topo", "namespace": NS},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 1}}, "schedulingConstraints": {"topology": [{"key": TOR}]}}}),
        false,
    )
    .await
    .expect("create the PodGroup");
    let started = Instant::now();
    let ring = create_job(&admin, "a-ring", 4, false).await;
    let gang = create_job(&admin, "b-gang", 2, true).await;
    let late = create_job(&admin, "c-late", 3, false).await;
    claims.create(&PostParams::default(), &claim("d-topo-0", 1, Value::Null, false)).await.expect("claim d-topo-0");
    let mut topo = serde_json::to_value(claim_pod("d-topo-0", "d-topo-0")).expect("json");
    topo["spec"]["schedulingGroup"] = json!({"podGroupName": "d-topo"});
    pods.create(&PostParams::default(), &serde_json::from_value(topo).expect("a pod")).await.expect("pod d-topo-0");
    let ring_nodes = wait_bound(&pods, "a-ring", ring.len(), Duration::from_secs(90), &ext).await;
    let gang_nodes = wait_bound(&pods, "b-gang", gang.len(), Duration::from_secs(90), &ext).await;
    let t_bound = started.elapsed().as_secs_f64();
    let tors = |nodes: &BTreeSet<String>| nodes.iter().map(|n| tor_of(n)).collect::<BTreeSet<_>>();
    figure(&format!(
        "dra groups: a job of 4 x 4 GPUs bound on {ring_nodes:?} and a gang of 2 x 4 on {gang_nodes:?} \
         {t_bound:.1} s after they were created"
    ));
    assert_eq!(tors(&ring_nodes), BTreeSet::from(["tor-1".to_string()]), "the 16-GPU job fits tor-1 only");
    assert_eq!(gang_nodes, BTreeSet::from(["gpu-01".to_string()]), "the gang fits tor-0's gpu-01 only");

    // the job no ToR has room for holds nothing, every member gated, for a while
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(allocated(&claims, "c-late").await.is_empty(), "a job without room must hold nothing");
    let waiting = nodes_of(&pods, "c-late").await;
    assert!(waiting.values().all(Option::is_none), "{waiting:?}");
    let events: Api<CoreEvent> = Api::namespaced(admin.clone(), NS);
    let all_events = events.list(&ListParams::default()).await.expect("list events").items;
    let reasons_of = |prefix: &str| -> BTreeSet<String> {
        all_events
            .iter()
            .filter(|e| e.involved_object.name.as_deref().is_some_and(|n| n.starts_with(prefix)))
            .filter_map(|e| e.message.clone())
            .collect()
    };
    let reasons = reasons_of("c-late-");
    figure(&format!("dra groups: the job of 3 x 4 GPUs waits, gated, holding nothing; its Events: {reasons:?}"));
    assert!(reasons.iter().any(|r| r.contains("group c-late")), "{reasons:?}");
    let topo = reasons_of("d-topo-");
    figure(&format!("dra groups: a PodGroup with a topology constraint is not allocated: {topo:?}"));
    assert!(topo.iter().any(|r| r.contains("schedulingConstraints.topology")), "{topo:?}");
    assert!(allocated(&claims, "d-topo").await.is_empty());

    // the first job goes: the waiting one is allocated whole under tor-1
    let freed = Instant::now();
    for name in &ring {
        pods.delete(name, &DeleteParams::default().grace_period(0)).await.expect("delete pod");
        claims.delete(name, &DeleteParams::default()).await.expect("delete claim");
    }
    let late_nodes = wait_bound(&pods, "c-late", late.len(), Duration::from_secs(90), &ext).await;
    figure(&format!(
        "dra groups: the job of 3 bound on {late_nodes:?} {:.1} s after the first job was deleted",
        freed.elapsed().as_secs_f64()
    ));
    assert_eq!(tors(&late_nodes), BTreeSet::from(["tor-1".to_string()]));

    let results = |name: &str| match name {
        "busy-0" => 6,
        n if n.starts_with("a-ring-") || n.starts_with("d-topo-") => 0,
        _ => 4,
    };
    let check = |_: &str, _: &BTreeMap<String, i128>, _: &BTreeMap<String, i128>| {};
    let (capacity, used, whole) = device_use(&slices, &claims, results, check).await;
    let over: usize = used.iter().map(|(key, u)| u.iter().filter(|(k, v)| **v > capacity[key][*k]).count()).sum();
    assert_eq!(over, 0, "over-committed devices: {used:?}");
    assert_eq!(whole, 6 + 8 + 12, "every result a whole GPU");
    figure(&format!("dra groups: {whole} whole GPUs allocated by gpuplace; 0 over-committed"));
    drop(plugins);
}
