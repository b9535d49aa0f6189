//! Issue 32 on the real API server and kube-scheduler: the device plugin's DRA mode.
//!
//! Two nodes (an HGX H100 and a DGX-1 V100) run `gpuplace-device-plugin --dra` with their node-bound
//! credentials; the API server takes their ResourceSlices (so the slices pass its validation, with
//! consumable capacity on), a GPU that falls off the bus leaves its node's slice with the pool's
//! generation bumped, a deleted slice comes back, and a node's credential cannot write another
//! node's slice. Then kube-scheduler alone (native DRA, no extender) allocates whole GPUs, shares and
//! an NVLink pair from those slices: a claim that names no capacity takes the whole GPU, shares count
//! what they ask, and no device is over-committed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuplace_core::api_client::connect::{connect_with, Source, Transport};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::cluster::{apply, figure, repo, yaml_objects, ControlPlane, User};
use crate::fleet::{create_node, gpu_node_labels, start_plugin_with};
use crate::{install, scheduler_config, NS, SERIAL};

pub(crate) const DRIVER: &str = "gpu.gpuplace.io";
const H100_MIB: i128 = 81559;

pub(crate) async fn slices_of(api: &Api<ResourceSlice>, node: &str) -> Vec<ResourceSlice> {
    let fields = format!("spec.nodeName={node}");
    api.list(&ListParams::default().fields(&fields)).await.expect("list slices").items
}

/// Waits until `node` has exactly one slice and `ok` holds for it.
pub(crate) async fn wait_slice(
    api: &Api<ResourceSlice>,
    node: &str,
    what: &str,
    ok: impl Fn(&ResourceSlice) -> bool,
) -> ResourceSlice {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let found = slices_of(api, node).await;
        if let [one] = &found[..] {
            if ok(one) {
                return one.clone();
            }
        }
        assert!(Instant::now() < until, "{node}: {what} not seen in 60 s; slices: {found:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub(crate) fn device_names(s: &ResourceSlice) -> Vec<String> {
    s.spec.devices.iter().flatten().map(|d| d.name.clone()).collect()
}

/// A quantity as an integer (milli-units for `cores`-like plain numbers would not be whole; these
/// are MiB, percent and counts).
pub(crate) fn qty(q: &str) -> i128 {
    gpuplace_core::quantity::parse(q).unwrap_or_else(|e| panic!("{q}: {e}")).ceil_integer()
}

pub(crate) fn claim(name: &str, count: u32, capacity: Value, nvlink_pair: bool) -> ResourceClaim {
    let mut exactly = json!({"deviceClassName": DRIVER, "count": count});
    if !capacity.is_null() {
        exactly["capacity"] = json!({"requests": capacity});
    }
    let mut devices = json!({"requests": [{"name": "gpu", "exactly": exactly}]});
    if nvlink_pair {
        devices["constraints"] = json!([{"requests": ["gpu"], "matchAttribute": format!("{DRIVER}/nvlinkDomain")}]);
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"devices": devices}})).expect("a claim")
}

pub(crate) fn claim_pod(name: &str, claim: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }))
    .expect("a pod")
}

/// A control plane where gpuplace allocates the claims: its plugins, each node's slice, and the
/// extender.
pub(crate) struct GpuplaceDra {
    pub plugins: Vec<crate::cluster::Proc>,
    pub slices: Vec<ResourceSlice>,
    pub ext: crate::fleet::Extender,
}

/// gpuplace as the DRA allocator on `cp`: the project and the DRA manifests installed
/// (scheduler-config/dra/gpuplace-allocates.yaml: the gate policy), `boards` (node, board) as GPU
/// nodes, two per ToR, whose plugins publish tainted slices (`--dra-allocator gpuplace`), then
/// kube-controller-manager's resourceclaim controller, `gpuplace serve --dra-driver` and
/// kube-scheduler (no extender: claim pods never reach one), once every slice has its 8 devices and
/// the gate policy applies.
pub(crate) async fn gpuplace_allocates_on(
    cp: &mut ControlPlane,
    admin: &Client,
    boards: &[(&str, &str)],
) -> GpuplaceDra {
    install(admin).await;
    for file in ["scheduler-config/device-plugin/dra.yaml", "scheduler-config/dra/gpuplace-allocates.yaml"] {
        for obj in yaml_objects(&repo().join(file)) {
            apply(admin, &obj, false).await.unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
    for (i, (node, _)) in boards.iter().enumerate() {
        create_node(admin, node, gpu_node_labels(node, 0, i / 2), Value::Null, 8).await;
    }
    let mut plugins = Vec::new();
    for (node, board) in boards {
        let extra = ["--dra", "--dra-allocator", "gpuplace", "--node-sync-interval", "1s"];
        plugins.push(start_plugin_with(cp, node, board, &extra).await);
    }
    let api: Api<ResourceSlice> = Api::all(admin.clone());
    let mut slices = Vec::new();
    for (node, _) in boards {
        slices.push(wait_slice(&api, node, "8 devices", |s| device_names(s).len() == 8).await);
    }
    cp.start_controllers("resourceclaim-controller");
    let mut ext = crate::fleet::Extender::start(cp, "replica-a", 0, &["--dra-driver", DRIVER]);
    ext.wait_ready(Duration::from_secs(60)).await;
    cp.start_scheduler(&scheduler_config(), None);
    wait_gate_policy(admin, NS).await;
    GpuplaceDra { plugins, slices, ext }
}

/// Waits until the gate policy applies to new claim pods in `namespace`: the API server's admission
/// loads a policy shortly after it is written, and a pod created before that is not gated (probed
/// with dry runs).
pub(crate) async fn wait_gate_policy(admin: &Client, namespace: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let dry = PostParams { dry_run: true, ..PostParams::default() };
    let limit = Duration::from_secs(60);
    let until = Instant::now() + limit;
    loop {
        // an error (the API server still loading the policy) is retried like an ungated answer
        let seen = match pods.create(&dry, &claim_pod("probe", "probe")).await {
            Ok(p) if p.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref()).is_some_and(|g| !g.is_empty()) => return,
            Ok(_) => "the probe pod was not gated".to_string(),
            Err(e) => format!("the dry run failed: {e}"),
        };
        assert!(Instant::now() < until, "the gate policy does not apply {limit:?} after it was written: {seen}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `whole` claims of one whole GPU (`whole-<i>`), `shares` of 20000Mi and 25 cores (`share-<i>`) and
/// an NVLink pair (`pair`), each with a pod of its name; the names, in that order.
pub(crate) async fn create_claim_pods(
    claims: &Api<ResourceClaim>,
    pods: &Api<Pod>,
    whole: usize,
    shares: usize,
) -> Vec<String> {
    let mut made = Vec::new();
    for i in 0..whole {
        made.push((format!("whole-{i}"), claim(&format!("whole-{i}"), 1, Value::Null, false)));
    }
    for i in 0..shares {
        let share = json!({"memory": "20000Mi", "cores": "25"});
        made.push((format!("share-{i}"), claim(&format!("share-{i}"), 1, share, false)));
    }
    made.push(("pair".to_string(), claim("pair", 2, Value::Null, true)));
    for (name, c) in &made {
        claims.create(&PostParams::default(), c).await.unwrap_or_else(|e| panic!("create claim {name}: {e}"));
        pods.create(&PostParams::default(), &claim_pod(name, name))
            .await
            .unwrap_or_else(|e| panic!("create pod {name}: {e}"));
    }
    made.into_iter().map(|(name, _)| name).collect()
}

#[tokio::test(flavor = "current_thread")]
async fn dra_mode_publishes_slices_that_native_dra_allocates_without_over_commit() {
    let _serial = SERIAL.lock().await;
    let mut cp = ControlPlane::start("dra").await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    let dra_file = repo().join("scheduler-config/device-plugin/dra.yaml");
    for obj in yaml_objects(&dra_file) {
        apply(&admin, &obj, false).await.unwrap_or_else(|e| panic!("device-plugin/dra.yaml: {e}"));
    }
    let boards = [("gpu-00", "hgx-h100-8"), ("gpu-01", "dgx1-volta")];
    for (i, (node, _)) in boards.iter().enumerate() {
        create_node(&admin, node, gpu_node_labels(node, 0, i), Value::Null, 8).await;
    }
    // GPU 3 of the H100 node falls off the bus 6 s after its plugin starts
    let script = cp.dir.join("gpu-00-script.json");
    std::fs::write(&script, json!({"steps": [{"at_s": 6, "gpu": 3, "fault": "fall_off_bus"}]}).to_string())
        .expect("write the script");
    let script = script.display().to_string();
    let started = Instant::now();
    let mut plugins = Vec::new();
    for (node, board) in boards {
        let mut extra = vec!["--dra", "--node-sync-interval", "1s"];
        if node == "gpu-00" {
            extra.extend(["--fake-script", &script]);
        }
        plugins.push(start_plugin_with(&cp, node, board, &extra).await);
    }

    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let nodes: Api<Node> = Api::all(admin.clone());
    let h100 = wait_slice(&slices, "gpu-00", "8 devices", |s| device_names(s).len() == 8).await;
    let v100 = wait_slice(&slices, "gpu-01", "8 devices", |s| device_names(s).len() == 8).await;
    figure(&format!("dra: both slices published {:.1} s after the plugins started", started.elapsed().as_secs_f64()));
    for (s, node) in [(&h100, "gpu-00"), (&v100, "gpu-01")] {
        assert_eq!(s.name_any(), format!("{node}-{DRIVER}"));
        assert_eq!(
            (s.spec.driver.as_str(), s.spec.pool.name.as_str(), s.spec.pool.resource_slice_count),
            (DRIVER, node, 1)
        );
        let uid = nodes.get(node).await.expect("the node").uid();
        let owner = &s.owner_references()[0];
        assert_eq!((owner.kind.as_str(), owner.name.as_str(), Some(owner.uid.clone())), ("Node", node, uid));
        // what the API server kept of the consumable capacity (dropped if DRAConsumableCapacity were off)
        let d = &s.spec.devices.as_ref().expect("devices")[0];
        assert_eq!(d.allow_multiple_allocations, Some(true), "{node}: allowMultipleAllocations kept");
        let cap = d.capacity.as_ref().expect("capacity");
        assert!(cap["memory"].request_policy.is_some() && cap["cores"].request_policy.is_some(), "{cap:?}");
        let attrs = d.attributes.as_ref().expect("attributes");
        assert_eq!(
            attrs["tor"].string.as_deref(),
            Some(format!("tor-{}", if node == "gpu-00" { 0 } else { 1 }).as_str())
        );
        assert_eq!(attrs["nvlinkDomain"].int, Some(0), "{node}: every GPU is on one NVLink domain");
    }
    let h100_mem = &h100.spec.devices.as_ref().unwrap()[0].capacity.as_ref().unwrap()["memory"].value.0;
    assert_eq!(qty(h100_mem), H100_MIB * 1024 * 1024, "{h100_mem}");

    // passes that find the slice right write nothing
    let rv = v100.resource_version();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = wait_slice(&slices, "gpu-01", "the slice", |_| true).await;
    assert_eq!(again.resource_version(), rv, "a pass rewrote an unchanged slice");

    // an unhealthy GPU leaves the slice; the pool's generation goes up
    let gen = h100.spec.pool.generation;
    let lost = wait_slice(&slices, "gpu-00", "7 devices", |s| device_names(s).len() == 7).await;
    assert!(!device_names(&lost).contains(&"gpu-3".to_string()), "{:?}", device_names(&lost));
    assert_eq!(lost.spec.pool.generation, gen + 1);
    figure(&format!(
        "dra: GPU 3 of gpu-00 left its slice {:.1} s after the plugin started (fault at 6 s); pool generation {} -> {}",
        started.elapsed().as_secs_f64(),
        gen,
        lost.spec.pool.generation
    ));

    // a deleted slice comes back at the next pass
    slices.delete(&v100.name_any(), &DeleteParams::default()).await.expect("delete a slice");
    let t = Instant::now();
    wait_slice(&slices, "gpu-01", "the slice back", |s| device_names(s).len() == 8).await;
    figure(&format!("dra: a deleted slice was back in {:.1} s (resync 1 s)", t.elapsed().as_secs_f64()));

    // a node's credential writes only its own node's slices
    let other = connect_with(&Source::Kubeconfig(cp.node_bound_kubeconfig("gpu-00").await), Transport::Multiplexed)
        .await
        .expect("gpu-00's client");
    let mut foreign = again.clone();
    foreign.metadata = kube::api::ObjectMeta { name: Some("forged".into()), ..Default::default() };
    match Api::<ResourceSlice>::all(other.clone()).create(&PostParams::default(), &foreign).await {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("gpuplace-device-plugin-node-scope") => {
            figure(&format!("dra: gpu-00's plugin writing gpu-01's slice: refused, 403: {}", s.message))
        }
        other => panic!("gpu-00's credential wrote a slice of gpu-01: {other:?}"),
    }
    match Api::<ResourceSlice>::all(other).delete(&again.name_any(), &DeleteParams::default()).await {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("gpu-00's credential deleted gpu-01's slice: {other:?}"),
    }

    native_dra_allocates_without_over_commit(&mut cp, &admin, &slices).await;
    for mut p in plugins {
        assert!(p.running(), "{} exited:\n{}", p.name, p.tail(30));
        p.kill();
    }
}

/// kube-scheduler alone allocates claims from the plugins' slices: 5 whole GPUs, 8 shares of
/// 20000Mi and 25 cores, and an NVLink pair; every pod binds, and no device's memory, cores or
/// shares are over-committed.
async fn native_dra_allocates_without_over_commit(cp: &mut ControlPlane, admin: &Client, slices: &Api<ResourceSlice>) {
    cp.start_scheduler(&scheduler_config(), None);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let made = create_claim_pods(&claims, &pods, 5, 8).await;
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let list = pods.list(&ListParams::default()).await.expect("list pods").items;
        let bound = list.iter().filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()).count();
        if bound == made.len() {
            break;
        }
        assert!(
            Instant::now() < until,
            "{bound} of {} claim pods bound in 90 s; kube-scheduler:\n{}",
            made.len(),
            cp.scheduler.as_ref().map(|s| s.tail(40)).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let results = |name: &str| if name == "pair" { 2 } else { 1 };
    let check = |name: &str, consumed: &BTreeMap<String, i128>, cap: &BTreeMap<String, i128>| {
        if name.starts_with("share") {
            assert_eq!((consumed["memory"], consumed["cores"], consumed["shares"]), (20000 * 1024 * 1024, 25, 1));
        } else {
            // no capacity asked: the whole GPU, and one share of it
            assert_eq!(consumed["memory"], cap["memory"], "claim {name}: {consumed:?}");
            assert_eq!((consumed["cores"], consumed["shares"]), (100, 1), "claim {name}");
        }
    };
    let (capacity, used, whole) = device_use(slices, &claims, results, check).await;
    for (key, u) in &used {
        for (k, v) in u {
            assert!(*v <= capacity[key][k], "device {key:?} over-committed on {k}: {v} of {}", capacity[key][k]);
        }
    }
    let shared = used.values().filter(|u| u["shares"] > 1).count();
    figure(&format!(
        "dra: native DRA allocated {} claims on {} devices ({whole} whole-GPU results, {shared} devices shared); 0 over-committed",
        made.len(),
        used.len()
    ));
}

/// Per device (pool, name): its capacities from the slices, and what the claims' allocations
/// consume of them; and the number of results that took a whole GPU. Every claim must be allocated
/// with `results(name)` results (none: skipped), each with a `shareID`, on a device of a slice; `check` sees each
/// result's consumption beside its device's capacity.
pub(crate) type DeviceTotals = BTreeMap<(String, String), BTreeMap<String, i128>>;

pub(crate) async fn device_use(
    slices: &Api<ResourceSlice>,
    claims: &Api<ResourceClaim>,
    results: impl Fn(&str) -> usize,
    check: impl Fn(&str, &BTreeMap<String, i128>, &BTreeMap<String, i128>),
) -> (DeviceTotals, DeviceTotals, usize) {
    let mut capacity: DeviceTotals = BTreeMap::new();
    for s in slices.list(&ListParams::default()).await.expect("list slices").items {
        for d in s.spec.devices.iter().flatten() {
            let caps = d.capacity.iter().flatten().map(|(k, c)| (k.clone(), qty(&c.value.0))).collect();
            capacity.insert((s.spec.pool.name.clone(), d.name.clone()), caps);
        }
    }
    let mut used: DeviceTotals = BTreeMap::new();
    let mut whole = 0;
    for c in claims.list(&ListParams::default()).await.expect("list claims").items {
        let name = c.name_any();
        if results(&name) == 0 {
            // left unallocated on purpose
            continue;
        }
        let allocation = c.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref());
        let got = &allocation.unwrap_or_else(|| panic!("claim {name} not allocated")).results;
        assert_eq!(got.as_ref().map_or(0, |r| r.len()), results(&name), "claim {name}: {got:?}");
        for r in got.iter().flatten() {
            assert_eq!(r.driver, DRIVER);
            assert!(r.share_id.is_some(), "claim {name}: a result without shareID counts as exclusive");
            let key = (r.pool.clone(), r.device.clone());
            let cap = capacity.get(&key).unwrap_or_else(|| panic!("claim {name}: device {key:?} is in no slice"));
            let consumed: BTreeMap<String, i128> =
                r.consumed_capacity.iter().flatten().map(|(k, q)| (k.clone(), qty(&q.0))).collect();
            check(&name, &consumed, cap);
            if consumed["memory"] == cap["memory"] && consumed["cores"] == 100 {
                whole += 1;
            }
            for (k, v) in consumed {
                *used.entry(key.clone()).or_default().entry(k).or_default() += v;
            }
        }
    }
    (capacity, used, whole)
}
