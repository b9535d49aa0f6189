//! gpuplace installed from its Helm chart and its images on a real node (the v1.36 kubelet,
//! containerd 2, runc), through kube-scheduler and the extender: pods really start, and each
//! container's environment is read back and checked against the pod's assignment.
//!
//! The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler with the chart's
//! KubeSchedulerConfiguration) runs on the host's loopback; the node, its pods and every address
//! they use live in a network namespace the test makes ([`crate::netns`], [`crate::node`]).
//! kube-controller-manager runs the chart's DaemonSet (the device plugin, on the real node, with
//! hostPath sockets and `--fake-topology`) and Deployment (the extender, which reaches the API
//! server with its projected ServiceAccount token through the `kubernetes` Service's IP).
//! Figures go out as `e2e figure: real node: …` lines.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplace::scheduler::inspect::InspectReport;
use gpuplace::scheduler::metrics::BindOutcome;
use gpuplace_core::annotations::{AssignedGpu, AssignmentAnnotation};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::audit::{node_name, percentile, snapshot, Audit};
use crate::cluster::{apply, figure, repo, shared_binary, workspace_bin, ControlPlane, User};
use crate::netns::Forward;
use crate::node::{build_images, RealNode, BUSYBOX_IMAGE};
use crate::SERIAL;

mod dra;
mod guard;
mod probes;

use probes::*;

const NODE: &str = "e2e-node";
const SYSTEM_NS: &str = "gpuplace-system";
const NS: &str = "real";
const CHART: &str = "scheduler-config/helm/gpuplace";
const ASSIGNMENT: &str = "gpuplace.io/assignment";

/// The chart rendered with `helm template` and the values of this install: the test's images, the
/// fake HGX H100 topology for the device plugin, the kubelet's private root folder (pod-resources),
/// kube-scheduler's
/// configuration only (this test runs kube-scheduler itself, on the host).
fn render_chart(images: &crate::node::Images, node: &RealNode) -> Vec<Value> {
    render_chart_with(images, node, &[])
}

/// [`render_chart`] with more `--set` values.
fn render_chart_with(images: &crate::node::Images, node: &RealNode, more: &[String]) -> Vec<Value> {
    let helm = shared_binary("helm");
    let topology = repo().join("../shared/topologies/hgx-h100-8.json");
    let (ext_repo, ext_tag) = images.extender.split_once(':').expect("name:tag");
    let (dp_repo, dp_tag) = images.device_plugin.split_once(':').expect("name:tag");
    let sets = [
        format!("extender.image.repository={ext_repo}"),
        format!("extender.image.tag={ext_tag}"),
        "extender.image.pullPolicy=Never".to_string(),
        format!("devicePlugin.image.repository={dp_repo}"),
        format!("devicePlugin.image.tag={dp_tag}"),
        "devicePlugin.image.pullPolicy=Never".to_string(),
        format!("devicePlugin.kubeletRootDir={}", node.root_dir.display()),
        "scheduler.mode=config".to_string(),
        // one CPU for the extender's two replicas would be more than this 2-core machine has free
        "extender.resources.requests.cpu=100m".to_string(),
    ];
    let mut cmd = Command::new(helm);
    cmd.args(["template", "gpuplace"])
        .arg(repo().join(CHART))
        .args(["--namespace", SYSTEM_NS, "--kube-version", "1.36.0"])
        .arg("--set-file")
        .arg(format!("devicePlugin.fakeTopology={}", topology.display()));
    for s in sets.iter().chain(more) {
        cmd.args(["--set", s]);
    }
    // the guard's processes file and a fast sample (issue 49, guard.rs)
    for (k, v) in guard::chart_values(&node.dir) {
        cmd.args(["--set-json", &format!("{k}={v}")]);
    }
    let out = cmd.output().expect("e2e: running helm");
    assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut objects = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = <Value as serde::Deserialize>::deserialize(doc).expect("helm's YAML");
        if !v.is_null() {
            objects.push(v);
        }
    }
    objects
}

/// The KubeSchedulerConfiguration among the chart's objects (`scheduler.mode=config`: a ConfigMap).
fn scheduler_config_of(objects: &[Value]) -> String {
    objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap")
        .flat_map(|o| o["data"].as_object().into_iter().flat_map(|d| d.values()))
        .filter_map(Value::as_str)
        .find(|t| t.contains("kind: KubeSchedulerConfiguration"))
        .expect("the chart renders a KubeSchedulerConfiguration")
        .to_string()
}

/// A pod of the busybox image that prints its environment and sleeps; `limits` are gpuplace's.
fn pod(name: &str, limits: &[(&str, &str)], labels: &[(&str, &str)], group: Option<&str>) -> Pod {
    let limits: serde_json::Map<String, Value> =
        limits.iter().map(|(k, v)| (format!("gpuplace.io/{k}"), Value::String(v.to_string()))).collect();
    let labels: serde_json::Map<String, Value> =
        labels.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect();
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "env; exec sleep 1000000"],
                "resources": {"limits": limits},
            }],
        },
    });
    if let Some(g) = group {
        p["spec"]["schedulingGroup"] = json!({"podGroupName": g});
    }
    serde_json::from_value(p).expect("a pod")
}

fn running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        && p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|c| c.iter().all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some())))
}

/// Creates `pods` now: when each create was sent, per pod name.
async fn create_all(client: &Client, pods: Vec<Pod>) -> BTreeMap<String, Instant> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut created = BTreeMap::new();
    for p in pods {
        let name = p.name_any();
        api.create(&PostParams::default(), &p).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
        created.insert(name, Instant::now());
    }
    created
}

/// Creates `pods` now and returns when each was first seen Running (or `limit` passed): the
/// seconds from its create call to that, per pod name.
async fn create_and_time(client: &Client, pods: Vec<Pod>, limit: Duration) -> BTreeMap<String, f64> {
    let created = create_all(client, pods).await;
    wait_running(client, created, limit).await
}

/// Polls until each pod of `created` (name: when its create was sent) is Running, or `limit`.
async fn wait_running(client: &Client, created: BTreeMap<String, Instant>, limit: Duration) -> BTreeMap<String, f64> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let until = Instant::now() + limit;
    let mut seen = BTreeMap::new();
    while seen.len() < created.len() && Instant::now() < until {
        if let Ok(list) = api.list(&ListParams::default()).await {
            for p in list.items.iter().filter(|p| running(p)) {
                let name = p.name_any();
                if let Some(t) = created.get(&name) {
                    seen.entry(name).or_insert_with(|| t.elapsed().as_secs_f64());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen
}

/// What the device plugin must have put into a container's environment for its part of the
/// assignment, checked against what the container printed. Empty when they agree.
fn env_problems(pod: &Pod, env: &BTreeMap<String, String>) -> Vec<String> {
    let name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    let Some(text) = pod.annotations().get(ASSIGNMENT) else {
        return vec![format!("{name}: no {ASSIGNMENT}")];
    };
    let a = match AssignmentAnnotation::parse(text) {
        Ok(a) => a,
        Err(e) => return vec![format!("{name}: {ASSIGNMENT}: {e}")],
    };
    let Some(c) = a.containers.iter().find(|c| c.name == "main") else {
        return vec![format!("{name}: the assignment has no container main")];
    };
    let mut gpus: Vec<&AssignedGpu> = c.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    let list = |f: &dyn Fn(&AssignedGpu) -> String| gpus.iter().map(|g| f(g)).collect::<Vec<_>>().join(",");
    let exclusive = gpus.iter().all(|g| g.exclusive);
    let mut want: BTreeMap<&str, String> = BTreeMap::new();
    want.insert("NVIDIA_VISIBLE_DEVICES", list(&|g| g.uuid.clone()));
    want.insert("GPUPLACE_GPU_UUIDS", list(&|g| g.uuid.clone()));
    want.insert("GPUPLACE_GPU_INDICES", list(&|g| g.index.to_string()));
    want.insert("GPUPLACE_GPU_MEM_MIB", list(&|g| g.memory_mib.to_string()));
    want.insert("GPUPLACE_GPU_CORE_PCT", list(&|g| g.core_percent.to_string()));
    want.insert("GPUPLACE_EXCLUSIVE", exclusive.to_string());
    want.insert("GPUPLACE_POD", name.clone());
    want.insert("GPUPLACE_CONTAINER", "main".into());
    if !exclusive {
        let limits: Vec<String> = gpus.iter().enumerate().map(|(i, g)| format!("{i}={}M", g.memory_mib)).collect();
        want.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limits.join(","));
        let core = gpus.iter().map(|g| g.core_percent).min().unwrap_or(0);
        if (1..100).contains(&core) {
            want.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", core.to_string());
        }
    }
    let mut problems: Vec<String> = want
        .iter()
        .filter(|(k, v)| env.get(**k) != Some(*v))
        .map(|(k, v)| format!("{name}: {k}={:?}, the assignment says {v:?}", env.get(*k)))
        .collect();
    // the kubelet's device IDs (`<uuid>::<slot>`) name the same GPUs, in the same order
    let ids = env.get("GPUPLACE_DEVICE_IDS").cloned().unwrap_or_default();
    let mut order: Vec<&str> = Vec::new();
    for id in ids.split(',').filter(|s| !s.is_empty()) {
        let uuid = id.split("::").next().unwrap_or(id);
        if order.last() != Some(&uuid) {
            order.push(uuid);
        }
    }
    let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    if order != uuids {
        problems.push(format!("{name}: GPUPLACE_DEVICE_IDS={ids} is not the GPUs {uuids:?} in that order"));
    }
    problems
}

/// `KEY=VALUE` lines a container printed.
fn env_of(node: &RealNode, p: &Pod) -> BTreeMap<String, String> {
    let uid = p.uid().unwrap_or_default();
    node.container_log(NS, &p.name_any(), &uid, "main")
        .into_iter()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

/// Checks the environment of every Running GPU pod of the namespace (waiting briefly for its
/// log): (pods checked, problems).
async fn check_envs(client: &Client, node: &RealNode) -> (usize, Vec<String>) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods.list(&ListParams::default()).await.expect("list pods");
    let mut checked = 0;
    let mut problems = Vec::new();
    for p in list.items.iter().filter(|p| running(p)) {
        let until = Instant::now() + Duration::from_secs(10);
        let mut env = env_of(node, p);
        while !env.contains_key("GPUPLACE_POD") && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
            env = env_of(node, p);
        }
        checked += 1;
        problems.extend(env_problems(p, &env));
    }
    (checked, problems)
}

/// Keeps `targets` at the ready endpoints of Service `gpuplace-extender` (what kube-proxy routes).
fn follow_endpoints(client: Client, targets: Arc<Mutex<Vec<SocketAddr>>>) {
    tokio::spawn(async move {
        let api: Api<EndpointSlice> = Api::namespaced(client, SYSTEM_NS);
        let lp = ListParams::default().labels("kubernetes.io/service-name=gpuplace-extender");
        loop {
            if let Ok(list) = api.list(&lp).await {
                let mut ready = Vec::new();
                for s in &list.items {
                    // the verbs' port by name: the Service also has `metrics`, which serves no verb
                    let http = s.ports.iter().flatten().find(|p| p.name.as_deref() == Some("http"));
                    let port = http.and_then(|p| p.port).unwrap_or(8888);
                    for e in s.endpoints.iter().flatten() {
                        if e.conditions.as_ref().and_then(|c| c.ready) == Some(true) {
                            ready.extend(
                                e.addresses.iter().filter_map(|a| format!("{a}:{port}").parse::<SocketAddr>().ok()),
                            );
                        }
                    }
                }
                if let Ok(mut t) = targets.lock() {
                    *t = ready;
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
}

async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let until = Instant::now() + limit;
    loop {
        match check().await {
            Ok(()) => return,
            Err(e) if Instant::now() >= until => panic!("e2e: {what} not within {limit:?}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// The namespace's pods audited from their assignments: over-commits and bad assignments.
async fn audit(client: &Client) -> Audit {
    Audit::of(&snapshot(client, NS).await)
}

fn spread(v: &BTreeMap<String, f64>) -> String {
    let mut l: Vec<f64> = v.values().copied().collect();
    l.sort_by(f64::total_cmp);
    format!(
        "n={} p50={:.2} s p99={:.2} s max={:.2} s",
        l.len(),
        percentile(&l, 0.5),
        percentile(&l, 0.99),
        l.last().copied().unwrap_or(f64::NAN)
    )
}

#[tokio::test(flavor = "current_thread")]
async fn gpuplace_from_its_chart_and_images_on_a_real_node() {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let bin_dir = workspace_bin("gpuplace-device-plugin").parent().expect("the binaries' folder").to_path_buf();
    let images = build_images(&bin_dir);
    figure(&format!("real node: images built in {:.1} s: {}", images.seconds, images.report.replace('\n', "; ")));

    let mut cp = ControlPlane::start_with_gangs("real-node").await;
    cp.start_controller_manager();
    let admin = cp.client(User::Admin).await;
    let t = Instant::now();
    let mut node = RealNode::start(&cp, NODE, &images).await;
    figure(&format!("real node: node {NODE} Ready {:.1} s after the kubelet started", t.elapsed().as_secs_f64()));
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"gpuplace.io/gpu-node": "true"}}})),
        )
        .await
        .expect("label the GPU node");

    // ---- install from the chart
    let t = Instant::now();
    let objects = render_chart(&images, &node);
    for name in [SYSTEM_NS, NS] {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
        Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &ns).await.expect("create a namespace");
    }
    let mut applied = Vec::new();
    for o in &objects {
        applied.push(apply(&admin, o, false).await.unwrap_or_else(|e| panic!("applying the chart's objects: {e}")));
    }
    figure(&format!("real node: the chart's {} objects applied: {}", applied.len(), applied.join(" ")));
    // kube-scheduler with the chart's configuration (it also places the DaemonSet's and the
    // Deployment's pods), to the extender's pods as kube-proxy routes
    let targets = Arc::new(Mutex::new(Vec::new()));
    follow_endpoints(admin.clone(), targets.clone());
    let to_extender = Forward::out_of_ns(&node.netns, targets.clone());
    let config_path = cp.dir.join("chart-kube-scheduler-config.yaml");
    std::fs::write(&config_path, scheduler_config_of(&objects)).expect("write the chart's scheduler config");
    // the chart's configuration is HTTPS with a client certificate (mTLS by default); until the
    // extender has written kube-scheduler's certificate, kube-scheduler starts with one the test
    // makes, which is enough to place the system pods (they ask for no gpuplace resource)
    let extender_url = format!("https://{}/gpuplace", to_extender.addr);
    cp.start_scheduler(&config_path, Some(&extender_url));

    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), SYSTEM_NS);
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), SYSTEM_NS);
    wait_for(
        "the device plugin's DaemonSet pod ready and the node's GPUs allocatable",
        Duration::from_secs(120),
        || {
            let (daemonsets, nodes) = (daemonsets.clone(), nodes.clone());
            async move {
                let ds = daemonsets.get("gpuplace-device-plugin").await.map_err(|e| e.to_string())?;
                let ready = ds.status.map(|s| s.number_ready).unwrap_or(0);
                let n = nodes.get(NODE).await.map_err(|e| e.to_string())?;
                let gpus = n
                    .status
                    .and_then(|s| s.allocatable)
                    .and_then(|a| a.get("gpuplace.io/gpu").map(|q| q.0.clone()))
                    .unwrap_or_default();
                let inventory = n.metadata.annotations.is_some_and(|a| a.contains_key("gpuplace.io/inventory"));
                if ready == 1 && gpus == "80" && inventory {
                    Ok(())
                } else {
                    Err(format!("ready {ready}, allocatable gpu {gpus:?}, inventory {inventory}"))
                }
            }
        },
    )
    .await;
    wait_for("the extender's Deployment available", Duration::from_secs(120), || {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get("gpuplace-extender").await.map_err(|e| e.to_string())?;
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            if ready == want {
                Ok(())
            } else {
                Err(format!("{ready} of {want} replicas ready"))
            }
        }
    })
    .await;
    figure(&format!(
        "real node: installed from the chart (device plugin registered, extender ready) in {:.1} s",
        t.elapsed().as_secs_f64()
    ));

    // ---- mTLS by default: kube-scheduler gets the client certificate the extender wrote, as an
    // option B operator copies it (docs/deploy.md, "TLS"), and is restarted to read it
    let t = Instant::now();
    let mtls = scheduler_certificate(&admin).await;
    mtls.install(&cp.dir.join("tls"));
    cp.start_scheduler(&config_path, Some(&extender_url));
    figure(&format!(
        "real node: kube-scheduler restarted with the client certificate from Secret gpuplace-scheduler-tls ({:.1} s after the extender was ready)",
        t.elapsed().as_secs_f64()
    ));
    tenant_scraper_gets_no_answer(&admin, &node, &targets, &to_extender, &mtls).await;

    // ---- share, multi-GPU, exclusive and gang pods
    create_pod_group(&admin, "gang", 2).await;
    let share =
        |n: &str, mem: &str, core: &str| pod(n, &[("gpu", "1"), ("gpu-mem", mem), ("gpu-core", core)], &[], None);
    let first = vec![
        share("share-a", "20000", "30"),
        share("share-b", "10000", "20"),
        share("share-c", "30000", "40"),
        share("share-d", "8000", "10"),
        pod("share-2gpu", &[("gpu", "2"), ("gpu-mem", "20000"), ("gpu-core", "40")], &[], None),
        pod("whole-2gpu", &[("gpu", "2")], &[], None),
        pod("exclusive", &[("gpu", "1")], &[], None),
        pod("gang-0", &[("gpu", "1"), ("gpu-mem", "16000"), ("gpu-core", "25")], &[], Some("gang")),
        pod("gang-1", &[("gpu", "1"), ("gpu-mem", "16000"), ("gpu-core", "25")], &[], Some("gang")),
    ];
    let n_first = first.len();
    let times = create_and_time(&admin, first, Duration::from_secs(120)).await;
    assert_eq!(
        times.len(),
        n_first,
        "only {:?} of {n_first} pods Running:\n{}",
        times.keys(),
        pending_report(&admin).await
    );
    let (checked, problems) = check_envs(&admin, &node).await;
    figure(&format!("real node: {checked} of {n_first} GPU pods Running with the environment of their assignment; create to Running {}", spread(&times)));
    assert!(problems.is_empty(), "containers without their assignment's environment:\n{}", problems.join("\n"));
    let a = audit(&admin).await;
    assert!(a.over_commits.is_empty() && a.bad_assignments.is_empty(), "{:?} {:?}", a.over_commits, a.bad_assignments);

    // ---- a deleted pod frees its share and the next pod gets it: fill the node, then one more
    // pod waits until a share is deleted
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let free_gpus = 8 - used_gpus(&admin).await;
    let fillers: Vec<Pod> = (0..free_gpus).map(|i| pod(&format!("filler-{i}"), &[("gpu", "1")], &[], None)).collect();
    let filled = create_and_time(&admin, fillers, Duration::from_secs(60)).await;
    assert_eq!(filled.len(), free_gpus, "fillers Running: {filled:?}\n{}", pending_report(&admin).await);
    // the GPU with the most compute left (every other is full or has less) and a share on it: a
    // pod asking for that much plus the share's compute fits nowhere until the share is deleted
    let a = audit(&admin).await;
    let (gpu, use_) = a
        .gpus
        .iter()
        .filter(|(_, u)| u.exclusive_holders == 0)
        .max_by_key(|(_, u)| 100 - u.core_percent.min(100))
        .expect("a shared GPU");
    let (victim, _, _, victim_core) = use_.holders.first().cloned().expect("a holder");
    let victim = victim.rsplit('/').next().unwrap_or_default().to_string();
    let core = (100 - use_.core_percent + victim_core).to_string();
    let waiting = pod("next-share", &[("gpu", "1"), ("gpu-mem", "1000"), ("gpu-core", &core)], &[], None);
    pods.create(&PostParams::default(), &waiting).await.expect("create next-share");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = pods.get("next-share").await.expect("next-share");
    assert!(node_name(&p).is_none(), "next-share ({core} percent) was placed while no GPU had that much free");
    pods.delete(&victim, &DeleteParams::default().grace_period(0)).await.expect("delete the share");
    let t = Instant::now();
    let got = wait_running(&admin, BTreeMap::from([("next-share".to_string(), t)]), Duration::from_secs(60)).await;
    assert_eq!(got.len(), 1, "next-share not Running after {victim} was deleted:\n{}", pending_report(&admin).await);
    let p = pods.get("next-share").await.expect("next-share");
    let on = p.annotations().get(ASSIGNMENT).and_then(|t| AssignmentAnnotation::parse(t).ok());
    assert!(
        on.is_some_and(|a| a.containers.iter().flat_map(|c| &c.gpus).any(|g| g.uuid == gpu.1)),
        "next-share did not get the GPU {victim} freed"
    );
    figure(&format!(
        "real node: a deleted share's slice ({victim}, {victim_core} percent) went to the waiting pod in {:.1} s",
        got["next-share"]
    ));

    // ---- 20 pairs of share pods created while the kubelet restarts: no container with another
    // pod's limits
    delete_all(&pods).await;
    // pods that run across the restart must keep their containers and GPUs
    let keepers = vec![
        pod("keep-whole", &[("gpu", "2")], &[], None),
        share("keep-share-a", "20000", "30"),
        share("keep-share-b", "10000", "20"),
    ];
    let kept = create_and_time(&admin, keepers, Duration::from_secs(60)).await;
    assert_eq!(kept.len(), 3, "keepers Running: {kept:?}\n{}", pending_report(&admin).await);
    let before_restart = containers_of(&pods).await;
    let registrations_before = registrations(&node);
    node.stop_kubelet();
    let mut pairs = Vec::new();
    for i in 0..20 {
        pairs.push(share(&format!("pair-{i:02}-a"), "6000", "10"));
        pairs.push(share(&format!("pair-{i:02}-b"), "4000", "8"));
    }
    let created = create_all(&admin, pairs).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let bound_while_down =
        pods.list(&ListParams::default()).await.expect("list").items.iter().filter(|p| node_name(p).is_some()).count();
    node.start_kubelet();
    let pair_times = wait_running(&admin, created, Duration::from_secs(240)).await;
    let (checked, problems) = check_envs(&admin, &node).await;
    figure(&format!(
        "real node: kubelet restarted with 3 pods running and 40 share pods created ({bound_while_down} bound while it was down): {checked} pods Running with their own limits (the 3 with the same containers), {} containers with another pod's limits; create to Running {}",
        problems.len(),
        spread(&pair_times)
    ));
    assert_eq!(pair_times.len(), 40, "pairs Running: {}\n{}", pair_times.len(), pending_report(&admin).await);
    let after_restart = containers_of(&pods).await;
    for (name, id) in &before_restart {
        assert_eq!(after_restart.get(name), Some(id), "{name}: its container did not survive the kubelet's restart");
    }
    assert!(
        registrations(&node) > registrations_before,
        "the device plugin did not register with the restarted kubelet"
    );
    // the kubelet refuses for good the pods it admits before the plugin is back (well under a
    // second after it starts its registration server): how close that was
    if let Some(lag) = registration_lag(&node) {
        figure(&format!(
            "real node: after the kubelet's restart the device plugin registered {:.0} ms after the kubelet's registration server started",
            lag * 1e3
        ));
    }
    assert!(problems.is_empty(), "containers without their own assignment's environment:\n{}", problems.join("\n"));
    let a = audit(&admin).await;
    assert!(a.over_commits.is_empty() && a.bad_assignments.is_empty(), "{:?} {:?}", a.over_commits, a.bad_assignments);
    inspect_agrees(&admin, &to_extender, &mtls).await;

    delete_all(&pods).await;

    // ---- the device plugin's pod deleted: the DaemonSet brings it back, it registers again,
    // running pods keep their GPUs, and no GPU is handed out twice
    let before = registrations(&node);
    let sys_pods: Api<Pod> = Api::namespaced(admin.clone(), SYSTEM_NS);
    let plugin_pods = sys_pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=gpuplace-device-plugin"))
        .await
        .expect("list the plugin's pods");
    let old = plugin_pods.items.first().map(|p| p.name_any()).expect("the device plugin's pod");
    let t = Instant::now();
    sys_pods.delete(&old, &DeleteParams::default()).await.expect("delete the device plugin's pod");
    wait_for("the DaemonSet's new device-plugin pod registered", Duration::from_secs(90), || {
        let (sys_pods, old) = (sys_pods.clone(), old.clone());
        let n = registrations(&node);
        async move {
            let list = sys_pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=gpuplace-device-plugin"))
                .await
                .map_err(|e| e.to_string())?;
            let fresh = list.items.iter().any(|p| p.name_any() != old && running(p));
            if fresh && n > before {
                Ok(())
            } else {
                Err(format!("new pod running {fresh}, registrations {before} -> {n}"))
            }
        }
    })
    .await;
    figure(&format!(
        "real node: device-plugin pod deleted: the DaemonSet's new pod registered in {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let more: Vec<Pod> = (0..4).map(|i| share(&format!("after-plugin-{i}"), "6000", "10")).collect();
    let after = create_and_time(&admin, more, Duration::from_secs(90)).await;
    assert_eq!(after.len(), 4, "pods after the plugin's restart: {after:?}\n{}", pending_report(&admin).await);
    let (checked, problems) = check_envs(&admin, &node).await;
    assert!(problems.is_empty(), "after the plugin's restart:\n{}", problems.join("\n"));
    let a = audit(&admin).await;
    assert!(a.over_commits.is_empty() && a.bad_assignments.is_empty(), "{:?} {:?}", a.over_commits, a.bad_assignments);
    figure(&format!(
        "real node: after the plugin's restart {checked} pods Running with their own environment, 0 over-commits"
    ));

    // ---- a pod gpuplace did not place: bound by nodeName, past kube-scheduler and the extender,
    // asking for a GPU while a gpuplace share waits for its own. The kubelet lists it as the pod it
    // admits (pod-resources), none of gpuplace's waiting: Allocate refuses it, so it holds no GPU the
    // extender did not assign, and the share runs with its own limits
    let mut intruder = pod("intruder", &[("gpu", "1")], &[], None);
    if let Some(spec) = intruder.spec.as_mut() {
        spec.node_name = Some(NODE.to_string());
    }
    pods.create(&PostParams::default(), &intruder).await.expect("create the intruder");
    let honest = create_and_time(&admin, vec![share("honest", "6000", "10")], Duration::from_secs(60)).await;
    assert_eq!(honest.len(), 1, "a gpuplace share beside the intruder: {honest:?}\n{}", pending_report(&admin).await);
    wait_for("the intruder refused by the kubelet", Duration::from_secs(60), || {
        let pods = pods.clone();
        async move {
            let p = pods.get("intruder").await.map_err(|e| e.to_string())?;
            let phase = p.status.and_then(|s| s.phase);
            if phase.as_deref() == Some("Failed") {
                Ok(())
            } else {
                Err(format!("intruder phase {phase:?}"))
            }
        }
    })
    .await;
    let st = pods.get("intruder").await.expect("the intruder").status.unwrap_or_default();
    let (reason, message) = (st.reason.unwrap_or_default(), st.message.unwrap_or_default());
    figure(&format!("real node: a pod bound by nodeName past gpuplace: {reason}: {message}"));
    assert_eq!(reason, "UnexpectedAdmissionError", "{message}");
    assert!(message.contains("a pod that gpuplace did not place"), "{message}");
    let (checked, problems) = check_envs(&admin, &node).await;
    assert!(problems.is_empty(), "beside the intruder:\n{}", problems.join("\n"));
    let a = audit(&admin).await;
    assert!(a.over_commits.is_empty() && a.bad_assignments.is_empty(), "{:?} {:?}", a.over_commits, a.bad_assignments);
    figure(&format!("real node: beside the refused intruder {checked} pods Running with their own environment"));

    // how often a bind waited for the plugin to see an earlier pod's Allocate (pods with other limits
    // on one GPU), from the replica the Service routes to (the leader: it made every bind so far)
    if let Some((200, page)) = mtls.get(&to_extender, "/metrics") {
        let binds: Vec<String> = BindOutcome::ALL
            .iter()
            .map(|o| (o.name(), crate::counter(&page, "gpuplace_binds_total", &format!("result=\"{}\"", o.name()))))
            .filter(|(_, n)| *n > 0.0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        figure(&format!("real node: the leading extender's binds so far by result: {}", binds.join(", ")));
    }

    // ---- the leading extender's pod killed in a burst of pods: nothing lost, no over-commit
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(admin.clone(), SYSTEM_NS);
    let leader = leases
        .get("gpuplace-extender")
        .await
        .ok()
        .and_then(|l| l.spec.and_then(|s| s.holder_identity))
        .expect("the extender's Lease holder");
    let burst: Vec<Pod> = (0..12)
        .map(|i| {
            if i % 3 == 0 {
                pod(&format!("burst-{i:02}"), &[("gpu", "1")], &[], None)
            } else {
                share(&format!("burst-{i:02}"), "5000", "5")
            }
        })
        .collect();
    let mut created = BTreeMap::new();
    for (i, p) in burst.into_iter().enumerate() {
        let name = p.name_any();
        pods.create(&PostParams::default(), &p).await.unwrap_or_else(|e| panic!("create {name}: {e}"));
        created.insert(name, Instant::now());
        if i == 3 {
            // SIGKILL, as a node failure or an OOM kill would: no hand-over
            sys_pods.delete(&leader, &DeleteParams::default().grace_period(0)).await.expect("kill the leader");
        }
    }
    let burst_times = wait_running(&admin, created, Duration::from_secs(180)).await;
    let (checked, problems) = check_envs(&admin, &node).await;
    let a = audit(&admin).await;
    figure(&format!(
        "real node: leader {leader} killed in a burst of 12 pods: {} of 12 Running (create to Running {}), {checked} pods checked, {} with another pod's environment, {} over-commits",
        burst_times.len(),
        spread(&burst_times),
        problems.len(),
        a.over_commits.len()
    ));
    assert_eq!(burst_times.len(), 12, "burst pods Running: {burst_times:?}\n{}", pending_report(&admin).await);
    assert!(problems.is_empty(), "after the extender's kill:\n{}", problems.join("\n"));
    assert!(a.over_commits.is_empty() && a.bad_assignments.is_empty(), "{:?} {:?}", a.over_commits, a.bad_assignments);
    inspect_agrees(&admin, &to_extender, &mtls).await;

    // ---- issue 49: the guard holds a share to its grant, and never touches its neighbour
    guard::shares_hold_on_the_real_node(&admin, &node.dir).await;
    figure(&format!("real node: scenario done in {:.1} s", t0.elapsed().as_secs_f64()));
    drop(to_extender);
    drop(node);
}
