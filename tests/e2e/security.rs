//! Issue 29 on the real API server: what the admission policies of scheduler-config/ let the
//! device plugins' and the extender's credentials write, and what they refuse (the API server's own
//! answers are printed as `e2e figure:` lines); issue 48: neither credential changes ownerReferences
//! or finalizers, and only gpuplace's own accounts write a pod's GPU records (a tenant's
//! ServiceAccount, a cluster admin and a Binding are refused).

use std::path::PathBuf;

use gpuplace_core::annotations::{ANNOTATION_ALLOCATED, ANNOTATION_ASSIGNMENT};
use gpuplace_core::api_client::connect::{connect_with, Source, Transport};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, ServiceAccount};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

use crate::cluster::{apply, figure, repo, yaml_objects, ControlPlane, User};
use crate::fleet::create_node;
use crate::{install, NS, SERIAL};

/// The records policy: not in [`crate::INSTALL`], since scenarios there write forged records as the
/// admin (`forged_assignments_are_never_counted`) or strip one to see gpuplace survive it.
const RECORDS_POLICY: &str = "scheduler-config/extender/records-policy.yaml";

/// A client from a kubeconfig file.
async fn client_of(path: PathBuf) -> Client {
    connect_with(&Source::Kubeconfig(path), Transport::Multiplexed).await.expect("a client")
}

/// The API server's answer to a write: `Ok` or its status code and message.
pub(crate) fn answer<T>(r: Result<T, kube::Error>) -> Result<(), (u16, String)> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

/// Refused with 403 by the named admission policy; the message printed.
pub(crate) fn refused_by(what: &str, policy: &str, r: Result<(), (u16, String)>) {
    match r {
        Err((403, msg)) if msg.contains(policy) => figure(&format!("security: {what}: refused, 403: {msg}")),
        other => panic!("{what}: expected a 403 from {policy}, got {other:?}"),
    }
}

fn allowed(what: &str, r: Result<(), (u16, String)>) {
    assert_eq!(r, Ok(()), "{what}");
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

/// A JSON patch removing annotation `key`.
fn strip(key: &str) -> Patch<Value> {
    let path = format!("/metadata/annotations/{}", key.replace('~', "~0").replace('/', "~1"));
    Patch::Json(serde_json::from_value(json!([{"op": "remove", "path": path}])).expect("a JSON patch"))
}

/// A tenant: ServiceAccount `NS/name` with `rules` (a Role in NS) and a client with a token of its
/// own from the TokenRequest API, as its pods get one.
pub(crate) async fn tenant(cp: &ControlPlane, admin: &Client, name: &str, rules: Value) -> Client {
    let rbac = "rbac.authorization.k8s.io/v1";
    for obj in [
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": NS}}),
        json!({"apiVersion": rbac, "kind": "Role", "metadata": {"name": name, "namespace": NS}, "rules": rules}),
        json!({"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": name, "namespace": NS},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NS}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}),
    ] {
        apply(admin, &obj, false).await.unwrap_or_else(|e| panic!("the tenant's {obj}: {e}"));
    }
    let req: TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}})).expect("a TokenRequest");
    let token = Api::<ServiceAccount>::namespaced(admin.clone(), NS)
        .create_token_request(name, &Default::default(), &req)
        .await
        .unwrap_or_else(|e| panic!("a token for {NS}/{name}: {e}"))
        .status
        .and_then(|s| s.token)
        .expect("the token");
    client_of(cp.token_kubeconfig(&format!("tenant-{name}"), &token)).await
}

/// Waits until `probe` (a dry run the policy must refuse) is refused: the API server loads a new
/// policy within a second or so.
async fn until_refused<F: std::future::Future<Output = Result<(), (u16, String)>>>(what: &str, probe: impl Fn() -> F) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while probe().await.is_ok() {
        assert!(std::time::Instant::now() < deadline, "{what}: the admission policy took no effect within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A pod bound to `node` directly (nobody runs it).
async fn bound_pod(admin: &Client, name: &str, node: &str) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox"}]},
    }))
    .expect("a pod");
    Api::<Pod>::namespaced(admin.clone(), NS).create(&PostParams::default(), &pod).await.expect("create the pod");
}

#[tokio::test(flavor = "current_thread")]
async fn a_nodes_device_plugin_credential_changes_only_its_own_node_and_the_extenders_only_its_records() {
    let _serial = SERIAL.lock().await;
    let cp = ControlPlane::start("security").await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    for n in ["node-a", "node-b"] {
        create_node(&admin, n, json!({"kubernetes.io/hostname": n}), Value::Null, 8).await;
    }
    bound_pod(&admin, "on-a", "node-a").await;
    bound_pod(&admin, "on-b", "node-b").await;
    // the API server compiles a new policy within a second or so: wait until a write it must refuse is
    let unbound: Api<Node> = Api::all(cp.client(User::DevicePlugin).await);
    let probe = merge(json!({"metadata": {"annotations": {"gpuplace.io/probe": "1"}}}));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while answer(unbound.patch("node-a", &PatchParams::default(), &probe).await).is_ok() {
        assert!(std::time::Instant::now() < deadline, "the admission policies took no effect within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let plugin_a = client_of(cp.node_bound_kubeconfig("node-a").await).await;
    let nodes: Api<Node> = Api::all(plugin_a.clone());
    let pods: Api<Pod> = Api::namespaced(plugin_a.clone(), NS);
    let util: Api<ConfigMap> = Api::namespaced(plugin_a.clone(), "gpuplace-utilization");
    let pp = PatchParams::default();
    const PLUGIN: &str = "gpuplace-device-plugin-node-scope";

    // its own node: what the plugin writes goes through
    allowed(
        "A's inventory",
        answer(
            nodes
                .patch("node-a", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/inventory": "{}"}}})))
                .await,
        ),
    );
    let capacity = json!({"status": {"capacity": {"gpuplace.io/gpu-mem": "652472"}, "allocatable": {"gpuplace.io/gpu-mem": "652472"}}});
    allowed("A's gpu-mem capacity", answer(nodes.patch_status("node-a", &pp, &merge(capacity.clone())).await));
    allowed(
        "A's pod's marker",
        answer(
            pods.patch("on-a", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/allocated": "{}"}}})))
                .await,
        ),
    );
    let own =
        json!({"metadata": {"name": "gpuplace-utilization-node-a"}, "data": {"node": "node-a", "utilization": "{}"}});
    let own: ConfigMap = serde_json::from_value(own).expect("a ConfigMap");
    allowed("A's utilization ConfigMap", answer(util.create(&PostParams::default(), &own).await));

    // node B, or more than gpuplace's own fields: refused by the API server
    refused_by(
        "node A's credential patching node B's annotation",
        PLUGIN,
        answer(
            nodes
                .patch("node-b", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/inventory": "{}"}}})))
                .await,
        ),
    );
    refused_by(
        "node A's credential patching node B's capacity",
        PLUGIN,
        answer(nodes.patch_status("node-b", &pp, &merge(capacity)).await),
    );
    refused_by(
        "node A's credential patching a pod on node B",
        PLUGIN,
        answer(
            pods.patch("on-b", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/allocated": "{}"}}})))
                .await,
        ),
    );
    refused_by(
        "node A's credential relabelling its own node",
        PLUGIN,
        answer(
            nodes
                .patch("node-a", &pp, &merge(json!({"metadata": {"labels": {"gpuplace.io/gpu-node": "false"}}})))
                .await,
        ),
    );
    refused_by(
        "node A's credential tainting its own node",
        PLUGIN,
        answer(nodes.patch("node-a", &pp, &merge(json!({"spec": {"unschedulable": true}}))).await),
    );
    refused_by(
        "node A's credential changing its node's cpu capacity",
        PLUGIN,
        answer(nodes.patch_status("node-a", &pp, &merge(json!({"status": {"capacity": {"cpu": "1000"}}}))).await),
    );
    refused_by(
        "node A's credential changing its own pod's image",
        PLUGIN,
        answer(
            pods.patch(
                "on-a",
                &pp,
                &Patch::Strategic(json!({"spec": {"containers": [{"name": "main", "image": "evil"}]}})),
            )
            .await,
        ),
    );
    refused_by(
        "node A's credential changing its own pod's other annotations",
        PLUGIN,
        answer(pods.patch("on-a", &pp, &merge(json!({"metadata": {"annotations": {"example.com/x": "y"}}}))).await),
    );
    let other =
        json!({"metadata": {"name": "gpuplace-utilization-node-b"}, "data": {"node": "node-a", "utilization": "{}"}});
    let other: ConfigMap = serde_json::from_value(other).expect("a ConfigMap");
    refused_by(
        "node A's credential writing node B's utilization ConfigMap",
        PLUGIN,
        answer(util.create(&PostParams::default(), &other).await),
    );
    // issue 48: an owner that does not exist has the garbage collector delete the object, a finalizer
    // pins it
    let ghost = json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
        "name": "gone", "uid": "00000000-0000-0000-0000-000000000048"}]}});
    let pin = json!({"metadata": {"finalizers": ["example.com/pin"]}});
    refused_by(
        "node A's credential giving its own pod an owner that does not exist",
        PLUGIN,
        answer(pods.patch("on-a", &pp, &merge(ghost.clone())).await),
    );
    refused_by(
        "node A's credential pinning its own pod with a finalizer",
        PLUGIN,
        answer(pods.patch("on-a", &pp, &merge(pin.clone())).await),
    );
    refused_by(
        "node A's credential giving its own Node an owner",
        PLUGIN,
        answer(nodes.patch("node-a", &pp, &merge(ghost.clone())).await),
    );
    let b_owns = json!({"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "node-b",
        "uid": "00000000-0000-0000-0000-000000000048"}]}});
    refused_by(
        "node A's credential making node B the owner of its utilization ConfigMap",
        PLUGIN,
        answer(util.patch("gpuplace-utilization-node-a", &pp, &merge(b_owns)).await),
    );
    // a credential that names no node (a static token of the same ServiceAccount) changes nothing
    refused_by(
        "the plugin's ServiceAccount without a node-bound token",
        PLUGIN,
        answer(
            unbound
                .patch("node-a", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/inventory": "{}"}}})))
                .await,
        ),
    );
    // the admin's view: node B unchanged
    let b = Api::<Node>::all(admin.clone()).get("node-b").await.expect("node B");
    assert!(!b.metadata.annotations.unwrap_or_default().contains_key("gpuplace.io/inventory"));

    // the extender's credential: gpuplace.io/ annotations of pods, its key Secret and public keys only
    const EXTENDER: &str = "gpuplace-extender-scope";
    let ext = cp.client(User::Extender).await;
    let ext_pods: Api<Pod> = Api::namespaced(ext.clone(), NS);
    allowed(
        "the extender's requeue nudge",
        answer(
            ext_pods
                .patch("on-b", &pp, &merge(json!({"metadata": {"annotations": {"gpuplace.io/requeued": "1"}}})))
                .await,
        ),
    );
    refused_by(
        "the extender's credential relabelling a pod",
        EXTENDER,
        answer(ext_pods.patch("on-b", &pp, &merge(json!({"metadata": {"labels": {"app": "other"}}}))).await),
    );
    refused_by(
        "the extender's credential changing a pod's image",
        EXTENDER,
        answer(
            ext_pods
                .patch(
                    "on-b",
                    &pp,
                    &Patch::Strategic(json!({"spec": {"containers": [{"name": "main", "image": "evil"}]}})),
                )
                .await,
        ),
    );
    let secrets: Api<Secret> = Api::namespaced(ext.clone(), "gpuplace-system");
    let planted: Secret =
        serde_json::from_value(json!({"metadata": {"name": "planted"}, "stringData": {"x": "y"}})).expect("a Secret");
    refused_by(
        "the extender's credential creating another Secret",
        EXTENDER,
        answer(secrets.create(&PostParams::default(), &planted).await),
    );
    let cms: Api<ConfigMap> = Api::namespaced(ext, "gpuplace-system");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "gpuplace-scheduler-config"}, "data": {"x": "y"}}))
            .expect("a ConfigMap");
    refused_by(
        "the extender's credential creating another ConfigMap",
        EXTENDER,
        answer(cms.create(&PostParams::default(), &cm).await),
    );
    refused_by(
        "the extender's credential giving a pod an owner that does not exist",
        EXTENDER,
        answer(ext_pods.patch("on-b", &pp, &merge(ghost)).await),
    );
    refused_by(
        "the extender's credential pinning a pod with a finalizer",
        EXTENDER,
        answer(ext_pods.patch("on-b", &pp, &merge(pin)).await),
    );
    let pod = Api::<Pod>::namespaced(admin.clone(), NS).get("on-b").await.expect("pod on-b");
    assert!(pod.metadata.owner_references.is_none() && pod.metadata.finalizers.is_none(), "{:?}", pod.metadata);

    // the books: a ConfigMap per node in gpuplace-system, deleted once its node is gone. RBAC for the
    // delete comes with the books (extender/rbac.yaml); granted here, so that the policy decides
    let grant = [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "e2e-extender-deletes-configmaps", "namespace": "gpuplace-system"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["delete"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "e2e-extender-deletes-configmaps", "namespace": "gpuplace-system"},
            "subjects": [{"kind": "ServiceAccount", "name": "gpuplace-extender", "namespace": "gpuplace-system"}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "e2e-extender-deletes-configmaps"}}),
    ];
    for obj in grant {
        apply(&admin, &obj, false).await.expect("grant configmaps delete");
    }
    let cms: Api<ConfigMap> = Api::namespaced(cp.client(User::Extender).await, "gpuplace-system");
    let configmap = |name: &str, meta: Value| -> ConfigMap {
        let mut v = json!({"metadata": {"name": name}, "data": {"node": "node-a"}});
        v["metadata"].as_object_mut().expect("metadata").extend(meta.as_object().cloned().unwrap_or_default());
        serde_json::from_value(v).expect("a ConfigMap")
    };
    let post = PostParams::default();
    allowed(
        "the extender's books of node A",
        answer(cms.create(&post, &configmap("gpuplace-books-node-a", json!({}))).await),
    );
    allowed(
        "the extender's public keys",
        answer(cms.create(&post, &configmap("gpuplace-assignment-public-keys", json!({}))).await),
    );
    refused_by(
        "the extender's credential creating books with a finalizer",
        EXTENDER,
        answer(
            cms.create(&post, &configmap("gpuplace-books-node-b", json!({"finalizers": ["example.com/pin"]}))).await,
        ),
    );
    let dp = DeleteParams::default();
    allowed("the extender deleting the books of a node gone", answer(cms.delete("gpuplace-books-node-a", &dp).await));
    refused_by(
        "the extender's credential deleting the public keys",
        EXTENDER,
        answer(cms.delete("gpuplace-assignment-public-keys", &dp).await),
    );
}

/// Issue 48, item 1's first line, on the real API server: with the records policy
/// (scheduler-config/extender/records-policy.yaml), a tenant's ServiceAccount that RBAC lets edit its
/// pods cannot strip, change or plant `gpuplace.io/assignment` or `gpuplace.io/allocated`, nor can a
/// cluster admin or a Binding carry one; the extender writes and removes the assignment, the node's
/// device plugin writes the marker, and neither the other's record.
#[tokio::test(flavor = "current_thread")]
async fn only_gpuplaces_own_accounts_write_a_pods_gpu_records() {
    let _serial = SERIAL.lock().await;
    let cp = ControlPlane::start("records").await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    for obj in yaml_objects(&repo().join(RECORDS_POLICY)) {
        apply(&admin, &obj, false).await.unwrap_or_else(|e| panic!("{RECORDS_POLICY}: {e}"));
    }
    create_node(&admin, "node-a", json!({"kubernetes.io/hostname": "node-a"}), Value::Null, 8).await;
    bound_pod(&admin, "held", "node-a").await;
    let rules = json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "update", "patch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}]);
    let tenant_pods: Api<Pod> = Api::namespaced(tenant(&cp, &admin, "tenant", rules).await, NS);
    let admin_pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let pp = PatchParams::default();
    let set = |key: &str, value: &str| merge(json!({"metadata": {"annotations": {key: value}}}));
    const RECORDS: &str = "gpuplace-records";
    let dry = PatchParams { dry_run: true, ..PatchParams::default() };
    let probe = set(ANNOTATION_ASSIGNMENT, "{}");
    until_refused("the records policy", || {
        let (api, dry, probe) = (&admin_pods, &dry, &probe);
        async move { answer(api.patch("held", dry, probe).await) }
    })
    .await;

    // gpuplace's own accounts: the extender's assignment, node A's plugin's marker
    let ext_pods: Api<Pod> = Api::namespaced(cp.client(User::Extender).await, NS);
    let plugin_pods: Api<Pod> = Api::namespaced(client_of(cp.node_bound_kubeconfig("node-a").await).await, NS);
    allowed(
        "the extender writing an assignment",
        answer(ext_pods.patch("held", &pp, &set(ANNOTATION_ASSIGNMENT, "{\"signed\":1}")).await),
    );
    allowed(
        "node A's plugin writing its marker",
        answer(plugin_pods.patch("held", &pp, &set(ANNOTATION_ALLOCATED, "{\"containers\":[]}")).await),
    );

    // the tenant: its pod's other metadata as it likes, the records not at all
    allowed(
        "the tenant annotating and labelling its pod",
        answer(
            tenant_pods
                .patch(
                    "held",
                    &pp,
                    &merge(json!({"metadata": {"annotations": {"example.com/note": "x"}, "labels": {"team": "a"}}})),
                )
                .await,
        ),
    );
    for key in [ANNOTATION_ASSIGNMENT, ANNOTATION_ALLOCATED] {
        refused_by(
            &format!("the tenant stripping {key}"),
            RECORDS,
            answer(tenant_pods.patch("held", &pp, &strip(key)).await),
        );
        refused_by(
            &format!("the tenant rewriting {key}"),
            RECORDS,
            answer(tenant_pods.patch("held", &pp, &set(key, "{}")).await),
        );
    }
    // the API server takes a pod's annotations through its status too
    refused_by(
        "the tenant stripping the assignment through pods/status",
        RECORDS,
        answer(tenant_pods.patch_status("held", &pp, &strip(ANNOTATION_ASSIGNMENT)).await),
    );
    let mut copied: Value = json!({"metadata": {"name": "copy", "annotations": {ANNOTATION_ASSIGNMENT: "{\"signed\":1}"}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]}});
    refused_by(
        "the tenant creating a pod that carries an assignment",
        RECORDS,
        answer(
            tenant_pods.create(&PostParams::default(), &serde_json::from_value(copied.clone()).expect("a pod")).await,
        ),
    );

    // a cluster admin is refused too (docs/deploy.md, "Security": the binding is the admin's switch)
    refused_by(
        "a cluster admin stripping the assignment",
        RECORDS,
        answer(admin_pods.patch("held", &pp, &strip(ANNOTATION_ASSIGNMENT)).await),
    );
    copied["metadata"]["annotations"] = json!({});
    admin_pods.create(&PostParams::default(), &serde_json::from_value(copied).expect("a pod")).await.expect("pod copy");
    let binding = json!({"apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": "copy", "annotations": {ANNOTATION_ASSIGNMENT: "{\"signed\":1}"}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-a"}});
    refused_by(
        "a cluster admin's Binding carrying an assignment",
        RECORDS,
        answer(admin_pods.create_subresource::<_, Value>("binding", "copy", &PostParams::default(), &binding).await),
    );

    // each of gpuplace's accounts writes its own record only
    refused_by(
        "node A's plugin writing an assignment",
        RECORDS,
        answer(plugin_pods.patch("held", &pp, &set(ANNOTATION_ASSIGNMENT, "{}")).await),
    );
    refused_by(
        "the extender writing the plugin's marker",
        RECORDS,
        answer(ext_pods.patch("held", &pp, &set(ANNOTATION_ALLOCATED, "{}")).await),
    );
    let held = admin_pods.get("held").await.expect("pod held");
    let annotations = held.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(annotations.get(ANNOTATION_ASSIGNMENT).map(String::as_str), Some("{\"signed\":1}"), "{annotations:?}");
    assert_eq!(
        annotations.get(ANNOTATION_ALLOCATED).map(String::as_str),
        Some("{\"containers\":[]}"),
        "{annotations:?}"
    );
    // the extender removes a stale assignment (src/k8s/stale.rs) as before
    allowed(
        "the extender removing an assignment",
        answer(ext_pods.patch("held", &pp, &strip(ANNOTATION_ASSIGNMENT)).await),
    );
    figure("security: the records are written by gpuplace's own accounts only; the tenant's other edits went through");
}

/// Issue 29's H1 probe on the real control plane: a pod whose nodeSelector matches no node, which
/// kube-scheduler leaves Pending, once went to a node of the caller's choosing through one `/filter`
/// (its body without the nodeSelector) and one `/bind` sent straight to the extender's port. Now the
/// extender places pods as the API server has them: the bind is refused and the pod stays Pending,
/// while kube-scheduler schedules the other pods as usual.
#[tokio::test(flavor = "current_thread")]
async fn a_filter_and_bind_from_another_client_never_bind_a_pod_kube_scheduler_left_pending() {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use crate::fleet::{http_post, Shape};
    use crate::{scheduler_config, stage_with_extender, stays_pending, wait_bound};

    let _serial = SERIAL.lock().await;
    let (mut st, ext) = stage_with_extender("foreign-bind").await;
    st.cp.start_scheduler(&scheduler_config(), Some(&ext.url()));
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let pp = PostParams::default();
    let one = Shape { gpu: Some("1"), kind: "whole-1", ..Default::default() };
    let mut stuck = one.pod("stuck");
    stuck.spec.as_mut().expect("a spec").node_selector =
        Some(BTreeMap::from([("gpuplace.io/pool".to_string(), "none".to_string())]));
    let stuck = pods.create(&pp, &stuck).await.expect("create the stuck pod");
    pods.create(&pp, &one.pod("fine")).await.expect("create the fine pod");
    assert_eq!(wait_bound(&st.admin, NS, 1, Duration::from_secs(60)).await, 1, "kube-scheduler binds the fine pod");
    assert!(stays_pending(&pods, "stuck", Duration::from_secs(3)).await, "kube-scheduler leaves it Pending");

    // another client, with access to the port: a filter body without the nodeSelector, then a bind
    let node = st.nodes[0].name.clone();
    let mut forged = serde_json::to_value(&stuck).expect("the pod as JSON");
    forged["spec"].as_object_mut().expect("a spec").remove("nodeSelector");
    let filter = json!({"Pod": forged, "Nodes": null, "NodeNames": [node]});
    let (status, answer) = http_post(ext.port, "/gpuplace/filter", &filter.to_string()).expect("filter answered");
    figure(&format!("security: another client's /filter for the stuck pod on {node}: {status} {answer}"));
    let uid = stuck.metadata.uid.clone().expect("a UID");
    let bind = json!({"PodName": "stuck", "PodNamespace": NS, "PodUID": uid, "Node": node});
    let (status, answer) = http_post(ext.port, "/gpuplace/bind", &bind.to_string()).expect("bind answered");
    figure(&format!("security: another client's /bind of the stuck pod to {node}: {status} {answer}"));
    assert_eq!(status, 200);
    assert!(answer.contains("does not match the pod's nodeSelector gpuplace.io/pool=none"), "{answer}");
    assert!(stays_pending(&pods, "stuck", Duration::from_secs(3)).await, "the stuck pod was bound");
    figure("security: the stuck pod is still Pending; kube-scheduler bound the other pod as usual");
}
