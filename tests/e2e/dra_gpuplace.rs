//! Issue 32, item 3, on the real API server and kube-scheduler: gpuplace allocates the claims of its
//! DeviceClass (`gpuplace serve --dra-driver`, scheduler-config/dra/gpuplace-allocates.yaml).
//!
//! Three nodes run `gpuplace-device-plugin --dra --dra-allocator gpuplace` (tainted devices). The
//! admission policy gates every new pod with claims; gpuplace's extender allocates the claims of its
//! class (whole GPUs, shares, an NVLink pair, a claim made from a template by kube-controller-manager's
//! resourceclaim controller) and lifts the gates, and kube-scheduler binds each pod where its claims
//! are. A pod whose claims are of another class is let go at once; one that also asks for gpuplace's
//! own resources stays gated with an Event; one that got past the gate (policy unbound) is never
//! allocated by kube-scheduler, because the devices are tainted. No device is over-committed.
//!
//! Issue 48, item 3: the gate holds against a tenant. Its ServiceAccount cannot lift the gate of its
//! own pod, nor make a claim or template that tolerates the devices' taint; a tolerating claim from
//! before the policy is never allocated by kube-scheduler (its write is refused).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuplace_core::dra::claims::{share_id, DELETE_PROTECTION_FINALIZER};
use gpuplace_core::dra::device_index;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::cluster::{apply, figure, repo, yaml_objects, ControlPlane, User};
use crate::dra::{
    claim, claim_pod, create_claim_pods, device_names, device_use, gpuplace_allocates_on, wait_gate_policy, wait_slice,
    GpuplaceDra, DRIVER,
};
use crate::fleet::{create_node, gpu_node_labels, start_plugin_with};
use crate::security::{answer, refused_by, tenant};
use crate::{install, scheduler_config, NS, SERIAL};

const GATE: &str = "gpuplace.io/dra";

fn gates(p: &Pod) -> Vec<String> {
    p.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref()).into_iter().flatten().map(|g| g.name.clone()).collect()
}

fn node_of(p: &Pod) -> Option<String> {
    p.spec.as_ref().and_then(|s| s.node_name.clone())
}

async fn create(client: &Client, obj: Value) {
    apply(client, &obj, false).await.unwrap_or_else(|e| panic!("create {obj}: {e}"));
}

#[tokio::test(flavor = "current_thread")]
async fn gpuplace_allocates_the_claims_of_its_class_and_kube_scheduler_binds_their_pods() {
    let _serial = SERIAL.lock().await;
    let mut cp = ControlPlane::start("dra-gpuplace").await;
    let admin = cp.client(User::Admin).await;
    let boards = [("gpu-00", "hgx-h100-8"), ("gpu-01", "dgx1-volta"), ("gpu-02", "hgx-h100-8")];
    let GpuplaceDra { plugins, slices: published, mut ext } = gpuplace_allocates_on(&mut cp, &admin, &boards).await;
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    for ((node, _), s) in boards.iter().zip(&published) {
        // the API server kept the taint (it drops it when DRADeviceTaints is off)
        let taints = s.spec.devices.as_ref().and_then(|d| d[0].taints.clone()).unwrap_or_default();
        assert_eq!(taints.len(), 1, "{node}: the allocator taint was not kept: {taints:?}");
        assert_eq!((taints[0].key.as_str(), taints[0].effect.as_str()), ("gpu.gpuplace.io/allocator", "NoSchedule"));
    }

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let started = Instant::now();
    let mut ours = create_claim_pods(&claims, &pods, 3, 6).await;
    // a share from a template: kube-controller-manager makes the claim after the pod
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": {"name": "small-share"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "10Gi", "cores": "10"}}}}]}}},
    }))
    .expect("a template");
    Api::<ResourceClaimTemplate>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &template)
        .await
        .expect("create the template");
    create(
        &admin,
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "templated", "namespace": NS}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "small-share"}],
        "containers": [{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}]}}),
    )
    .await;
    ours.push("templated".into());
    // a claim of another class: let go at once (nothing publishes such devices, so it stays pending)
    create(
        &admin,
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "nic.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == \"nic.example.com\""}}]}}),
    )
    .await;
    create(&admin, json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "nic", "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}]}}}))
    .await;
    pods.create(&PostParams::default(), &claim_pod("nic", "nic")).await.expect("pod nic");
    // claims and gpuplace's own resources in one pod: refused with a reason
    claims.create(&PostParams::default(), &claim("mixed", 1, Value::Null, false)).await.expect("claim mixed");
    let mut mixed: Value = serde_json::to_value(claim_pod("mixed", "mixed")).expect("json");
    mixed["spec"]["containers"][0]["resources"]["limits"] = json!({"gpuplace.io/gpu": "1"});
    pods.create(&PostParams::default(), &serde_json::from_value(mixed).expect("a pod")).await.expect("pod mixed");

    // every pod of gpuplace's claims bound; the others as described
    let until = Instant::now() + Duration::from_secs(90);
    let list = loop {
        let list = pods.list(&ListParams::default()).await.expect("list pods").items;
        let bound = list.iter().filter(|p| ours.contains(&p.name_any()) && node_of(p).is_some()).count();
        let nic_free = list.iter().any(|p| p.name_any() == "nic" && gates(p).is_empty());
        if bound == ours.len() && nic_free {
            break list;
        }
        assert!(
            Instant::now() < until,
            "{bound} of {} pods bound in 90 s (nic gate lifted: {nic_free}); extender:\n{}\nkube-scheduler:\n{}",
            ours.len(),
            ext.proc.tail(40),
            cp.scheduler.as_ref().map(|s| s.tail(20)).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    figure(&format!(
        "dra gpuplace: {} claim pods gated at admission, allocated by gpuplace and bound by kube-scheduler in {:.1} s",
        ours.len(),
        started.elapsed().as_secs_f64()
    ));
    let mixed = list.iter().find(|p| p.name_any() == "mixed").expect("pod mixed");
    assert_eq!(gates(mixed), [GATE], "a pod mixing claims and gpuplace.io resources stays gated");
    assert!(node_of(list.iter().find(|p| p.name_any() == "nic").expect("nic")).is_none());

    // each claim: written by gpuplace (its share IDs), protected, on its pod's node
    let all = claims.list(&ListParams::default()).await.expect("list claims").items;
    let mut on_node: BTreeMap<String, usize> = BTreeMap::new();
    for c in all.iter().filter(|c| c.name_any() != "nic" && c.name_any() != "mixed") {
        let name = c.name_any();
        let a = c.status.as_ref().and_then(|s| s.allocation.as_ref()).unwrap_or_else(|| panic!("{name} not allocated"));
        assert!(c.finalizers().iter().any(|f| f == DELETE_PROTECTION_FINALIZER), "{name}: no delete protection");
        let uid = c.uid().unwrap_or_default();
        for r in a.devices.iter().flat_map(|d| d.results.iter().flatten()) {
            let gpu = device_index(&r.device).expect("a gpuplace device");
            assert_eq!(
                r.share_id.as_deref(),
                Some(share_id(&uid, &r.request, gpu).as_str()),
                "{name}: not gpuplace's write"
            );
            *on_node.entry(r.pool.clone()).or_default() += 1;
        }
        let node = a
            .node_selector
            .as_ref()
            .and_then(|s| s.node_selector_terms[0].match_fields.as_ref())
            .map(|f| f[0].values.clone());
        let pod_name = if name.starts_with("templated") { "templated".to_string() } else { name.clone() };
        let pod = list.iter().find(|p| p.name_any() == pod_name).unwrap_or_else(|| panic!("no pod for claim {name}"));
        assert_eq!(
            node,
            Some(Some(vec![node_of(pod).expect("bound")])),
            "{name}: pod and allocation on different nodes"
        );
    }
    let claims_all: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let results = |name: &str| match name {
        "pair" => 2,
        "nic" | "mixed" => 0,
        _ => 1,
    };
    let check = |_: &str, _: &BTreeMap<String, i128>, _: &BTreeMap<String, i128>| {};
    let (capacity, used, whole) = device_use(&slices, &claims_all, results, check).await;
    let mut over = 0;
    for (key, u) in &used {
        for (k, v) in u {
            over += usize::from(*v > capacity[key][k]);
        }
    }
    assert_eq!(over, 0, "over-committed devices: {used:?}");
    let shared = used.values().filter(|u| u["shares"] > 1).count();
    figure(&format!(
        "dra gpuplace: {} results on {} devices of {} nodes ({whole} whole GPUs, {shared} devices shared: the 7 shares on {shared}); 0 over-committed",
        on_node.values().sum::<usize>(),
        used.len(),
        on_node.len()
    ));

    // past the gate (the policy unbound), kube-scheduler cannot allocate the tainted devices
    let bindings: Api<DynamicObject> = Api::all_with(admin.clone(), &mutating_binding_resource());
    bindings.delete("gpuplace-dra-gate", &DeleteParams::default()).await.expect("unbind the gate policy");
    claims.create(&PostParams::default(), &claim("ungated", 1, Value::Null, false)).await.expect("claim ungated");
    let until = Instant::now() + Duration::from_secs(30);
    // the policy's unbinding reaches the API server's admission shortly: probed with dry runs
    let dry = PostParams { dry_run: true, ..PostParams::default() };
    loop {
        let p = pods.create(&dry, &claim_pod("ungated", "ungated")).await.expect("dry run");
        if gates(&p).is_empty() {
            break;
        }
        assert!(Instant::now() < until, "the gate policy still applies 30 s after its binding was deleted");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    pods.create(&PostParams::default(), &claim_pod("ungated", "ungated")).await.expect("pod ungated");
    let why = loop {
        let p = pods.get("ungated").await.expect("pod");
        let cond = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled").cloned());
        if let Some(c) = cond {
            let claim = claims.get("ungated").await.expect("claim");
            assert_eq!(c.status, "False", "the ungated pod was scheduled: {:?}", claim.status);
            break c.message.unwrap_or_default();
        }
        assert!(Instant::now() < until, "kube-scheduler did not judge the ungated pod: {:?}", p.status);
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = claims.get("ungated").await.expect("claim");
    assert!(
        c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none(),
        "kube-scheduler allocated a tainted device"
    );
    assert!(node_of(&pods.get("ungated").await.expect("pod")).is_none());
    figure(&format!("dra gpuplace: a claim pod past the gate stays unscheduled on tainted devices: {why}"));

    for mut p in plugins {
        assert!(p.running(), "{} exited:\n{}", p.name, p.tail(30));
        p.kill();
    }
    assert!(ext.proc.running(), "the extender exited:\n{}", ext.proc.tail(40));
}

fn mutating_binding_resource() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: "MutatingAdmissionPolicyBinding".into(),
        plural: "mutatingadmissionpolicybindings".into(),
    }
}

/// A claim of one whole GPU whose request (`exactly`) carries `tolerations`.
fn tolerating(name: &str, tolerations: Value) -> ResourceClaim {
    let mut c = serde_json::to_value(claim(name, 1, Value::Null, false)).expect("json");
    c["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = tolerations;
    serde_json::from_value(c).expect("a claim")
}

const TAINT: &str = "gpu.gpuplace.io/allocator";

#[tokio::test(flavor = "current_thread")]
async fn a_tenant_can_neither_lift_the_dra_gate_nor_tolerate_gpuplaces_taint() {
    let _serial = SERIAL.lock().await;
    let mut cp = ControlPlane::start("dra-gate-holds").await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    for obj in yaml_objects(&repo().join("scheduler-config/device-plugin/dra.yaml")) {
        apply(&admin, &obj, false).await.expect("device-plugin/dra.yaml");
    }
    create_node(&admin, "gpu-00", gpu_node_labels("gpu-00", 0, 0), Value::Null, 8).await;
    let extra = ["--dra", "--dra-allocator", "gpuplace", "--node-sync-interval", "1s"];
    let mut plugin = start_plugin_with(&cp, "gpu-00", "hgx-h100-8", &extra).await;
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    wait_slice(&slices, "gpu-00", "8 tainted devices", |s| device_names(s).len() == 8).await;

    // from before the policies: a claim that tolerates the taint, and its pod (never gated)
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let pp = PostParams::default();
    let exists = json!([{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}]);
    claims.create(&pp, &tolerating("before", exists.clone())).await.expect("claim before");
    pods.create(&pp, &claim_pod("before", "before")).await.expect("pod before");
    for obj in yaml_objects(&repo().join("scheduler-config/dra/gpuplace-allocates.yaml")) {
        apply(&admin, &obj, false).await.expect("dra/gpuplace-allocates.yaml");
    }
    wait_gate_policy(&admin, NS).await;
    let dry = PostParams { dry_run: true, ..PostParams::default() };
    let until = Instant::now() + Duration::from_secs(30);
    while claims.create(&dry, &tolerating("probe", exists.clone())).await.is_ok() {
        assert!(Instant::now() < until, "the gate-holds policy took no effect within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cp.start_scheduler(&scheduler_config(), None);

    // the tenant: RBAC lets it write its pods, claims and templates
    let rules = json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "create", "update", "patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaimtemplates"], "verbs": ["get", "create"]}]);
    let tenant = tenant(&cp, &admin, "tenant", rules).await;
    let t_claims: Api<ResourceClaim> = Api::namespaced(tenant.clone(), NS);
    let t_pods: Api<Pod> = Api::namespaced(tenant.clone(), NS);
    const HOLDS: &str = "gpuplace-dra-gate-holds";
    t_claims.create(&pp, &claim("mine", 1, Value::Null, false)).await.expect("the tenant's claim");
    let walker = t_pods.create(&pp, &claim_pod("walker", "mine")).await.expect("the tenant's pod");
    assert_eq!(gates(&walker), [GATE], "the tenant's pod is gated");
    let lift: json_patch::Patch =
        serde_json::from_value(json!([{"op": "remove", "path": "/spec/schedulingGates/0"}])).expect("a JSON patch");
    let patch = PatchParams::default();
    refused_by(
        "the tenant lifting the gate of its own pod",
        HOLDS,
        answer(t_pods.patch("walker", &patch, &Patch::<()>::Json(lift.clone())).await),
    );
    refused_by(
        "the tenant clearing its pod's gates with a merge patch",
        HOLDS,
        answer(t_pods.patch("walker", &patch, &Patch::Merge(json!({"spec": {"schedulingGates": null}}))).await),
    );

    // claims that tolerate the taint, however they say it
    let mut all = serde_json::to_value(tolerating("all", exists.clone())).expect("json");
    all["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] = json!("All");
    all["spec"]["devices"]["requests"][0]["exactly"].as_object_mut().expect("exactly").remove("count");
    let mut first = serde_json::to_value(claim("first", 1, Value::Null, false)).expect("json");
    first["spec"]["devices"]["requests"][0] = json!({"name": "gpu", "firstAvailable": [
        {"name": "small", "deviceClassName": "nic.example.com"},
        {"name": "any", "deviceClassName": DRIVER, "tolerations": [{"key": TAINT, "operator": "Exists"}]}]});
    let cases = [
        ("its key, Exists", tolerating("key", exists.clone())),
        ("every taint (no key, Exists)", tolerating("every", json!([{"operator": "Exists"}]))),
        (
            "its key and value",
            tolerating("value", json!([{"key": TAINT, "value": "gpuplace", "effect": "NoSchedule"}])),
        ),
        ("allocationMode All", serde_json::from_value(all).expect("a claim")),
        ("a firstAvailable subrequest", serde_json::from_value(first).expect("a claim")),
    ];
    for (how, c) in &cases {
        refused_by(
            &format!("the tenant's claim tolerating the taint: {how}"),
            HOLDS,
            answer(t_claims.create(&pp, c).await),
        );
    }
    let template: ResourceClaimTemplate = serde_json::from_value(json!({"metadata": {"name": "tolerant"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER,
            "tolerations": [{"key": TAINT, "operator": "Exists"}]}}]}}}}))
    .expect("a template");
    refused_by(
        "the tenant's template tolerating the taint",
        HOLDS,
        answer(Api::<ResourceClaimTemplate>::namespaced(tenant, NS).create(&pp, &template).await),
    );
    // tolerations of other taints, or of another effect, are the tenant's business
    let other = json!([{"key": "example.com/maintenance", "operator": "Exists"}, {"key": TAINT, "operator": "Exists", "effect": "NoExecute"}]);
    t_claims.create(&pp, &tolerating("other", other)).await.expect("a claim tolerating other taints");

    // the extender's credential lifts the gate (as the extender does once it has allocated)
    let ext_pods: Api<Pod> = Api::namespaced(cp.client(User::Extender).await, NS);
    let lifted = ext_pods.patch("walker", &patch, &Patch::<()>::Json(lift)).await.expect("the extender lifts the gate");
    assert!(gates(&lifted).is_empty());

    // the tolerating claim from before: kube-scheduler picks a tainted device, and its write is refused
    let until = Instant::now() + Duration::from_secs(60);
    let why = loop {
        let p = pods.get("before").await.expect("pod before");
        let msg = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
            .and_then(|c| c.message.clone())
            .unwrap_or_default();
        assert!(node_of(&p).is_none(), "kube-scheduler bound the pod of a tolerating claim");
        if msg.contains(HOLDS) && msg.contains("only gpuplace's extender allocates devices of gpu.gpuplace.io") {
            break msg;
        }
        assert!(
            Instant::now() < until,
            "kube-scheduler's allocation was not refused in 60 s ({msg}); kube-scheduler:\n{}",
            cp.scheduler.as_ref().map(|s| s.tail(20)).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    figure(&format!("security: kube-scheduler allocating a tolerating claim from before the policy: refused: {why}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = claims.get("before").await.expect("claim before");
    assert!(c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none(), "allocated: {:?}", c.status);
    assert!(node_of(&pods.get("before").await.expect("pod")).is_none());
    assert!(plugin.running(), "the plugin exited:\n{}", plugin.tail(30));
    plugin.kill();
}
