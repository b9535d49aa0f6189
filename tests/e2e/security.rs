//! Issue 29 on the real API server: what the admission policies of scheduler-config/ let the
//! device plugins' and the extender's credentials write, and what they refuse (the API server's own
//! answers are printed as `e2e figure:` lines).

use std::path::PathBuf;

use gpuplace_core::api_client::connect::{connect_with, Source, Transport};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

use crate::cluster::{figure, ControlPlane, User};
use crate::fleet::create_node;
use crate::{install, NS, SERIAL};

/// A client from a kubeconfig file.
async fn client_of(path: PathBuf) -> Client {
    connect_with(&Source::Kubeconfig(path), Transport::Multiplexed).await.expect("a client")
}

/// The API server's answer to a write: `Ok` or its status code and message.
fn answer<T>(r: Result<T, kube::Error>) -> Result<(), (u16, String)> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

/// Refused with 403 by the named admission policy; the message printed.
fn refused_by(what: &str, policy: &str, r: Result<(), (u16, String)>) {
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
