//! The scheduler reads a pod through `PodView`, which each front end implements over its own
//! object: the extender's wire pod (`extender::adapt`) and the watchers' k8s-openapi pod
//! (`k8s::pod_view`, read from the typed object where a JSON round trip through the wire pod used to
//! be). The same pod must read the same through both: the fixtures' pods, and pods with every
//! field the views read.

#[path = "support/harness.rs"]
mod harness;

use gpuplace::extender::wire;
use gpuplace::scheduler::input::PodView;
use gpuplace::scheduler::service::observe::ObservedPod;
use serde_json::{json, Value};

/// Every reading the scheduler makes of a pod, through one view.
fn readings(p: &dyn PodView) -> Value {
    json!({
        "key": p.key(),
        "uid": p.uid(),
        "node": p.node_name(),
        "finished": p.is_finished(),
        "assignment": p.annotation("gpuplace.io/assignment"),
        "request": format!("{:?}", p.request()),
        "constraints": format!("{:?}", p.node_constraints()),
        "soft": p.has_soft_preferences(),
    })
}

fn both(pod: &Value) -> (wire::Pod, k8s_openapi::api::core::v1::Pod) {
    let w: wire::Pod = serde_json::from_value(pod.clone()).expect("the wire pod decodes");
    let k: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod.clone()).expect("k8s-openapi decodes");
    (w, k)
}

fn assert_same(pod: &Value, what: &str) {
    let (w, k) = both(pod);
    assert_eq!(readings(&w), readings(&k), "{what}: the two views read differently");
    assert_eq!(ObservedPod::of(&w), ObservedPod::of(&k), "{what}: the watcher's record differs");
}

#[test]
fn the_fixtures_pods_read_the_same_through_both_views() {
    let mut seen = 0;
    for mode in ["cache", "nocache", "nocache-preempt"] {
        let dir = harness::fixtures().join(mode);
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let body: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let mut pods: Vec<Value> = body.get("Pod").into_iter().filter(|p| !p.is_null()).cloned().collect();
            // the victims kube-scheduler sends in full (nodeCacheCapable false)
            for victims in body.get("NodeNameToVictims").and_then(Value::as_object).into_iter().flat_map(|m| m.values())
            {
                pods.extend(victims["Pods"].as_array().into_iter().flatten().cloned());
            }
            for pod in &pods {
                assert_same(pod, &path.display().to_string());
                seen += 1;
            }
        }
    }
    assert!(seen >= 20, "the fixtures hold pods ({seen})");
}

#[test]
fn every_field_the_views_read_reads_the_same() {
    let base = json!({
        "metadata": {
            "name": "train-0", "namespace": "ml", "uid": "u-1",
            "labels": {"gpuplace.io/group": "job", "gpuplace.io/group-size": "2"},
            "annotations": {"gpuplace.io/gpu-model": "NVIDIA H100 80GB HBM3", "gpuplace.io/assignment": "x",
                            "gpuplace.io/allocated": "c0"}
        },
        "spec": {
            "containers": [
                {"name": "main", "resources": {"limits": {"gpuplace.io/gpu": "2", "cpu": "4"}}},
                {"name": "share", "resources": {"requests": {"gpuplace.io/gpu-mem": "8192", "gpuplace.io/gpu-core": "30"},
                                                "limits": {"gpuplace.io/gpu-mem": "8192", "gpuplace.io/gpu-core": "30"}}}
            ],
            "initContainers": [{"name": "warm", "resources": {"limits": {"gpuplace.io/gpu": "1"}}}],
            "nodeSelector": {"gpuplace.io/pool": "a"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]}]}]}}},
            "schedulingGroup": {"podGroupName": "pg-1"},
            "priority": 100
        },
        "status": {"phase": "Pending"}
    });
    assert_same(&base, "a pending GPU pod with constraints");
    let mut variants = Vec::new();
    let mut bound = base.clone();
    bound["spec"]["nodeName"] = json!("gpu-1");
    bound["status"]["phase"] = json!("Running");
    variants.push(("bound", bound));
    let mut done = base.clone();
    done["status"]["phase"] = json!("Succeeded");
    variants.push(("finished", done));
    let mut soft = base.clone();
    soft["spec"]["affinity"]["podAntiAffinity"] = json!({"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]});
    variants.push(("preferred anti-affinity", soft));
    let mut spread = base.clone();
    spread["spec"]["topologySpreadConstraints"] =
        json!([{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]);
    variants.push(("a spread that may be broken", spread));
    let mut bad = base.clone();
    bad["spec"]["containers"][0]["resources"]["limits"]["gpuplace.io/gpu"] = json!("two");
    variants.push(("a malformed quantity", bad));
    let mut bad_affinity = base.clone();
    bad_affinity["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"][0]["matchExpressions"][0]["operator"] = json!("Near");
    variants.push(("an operator bind cannot check", bad_affinity));
    let mut bare = json!({"metadata": {"name": "cpu", "namespace": "ml", "uid": "u-2"},
                          "spec": {"containers": [{"name": "c"}]}});
    variants.push(("a pod without gpuplace resources", bare.clone()));
    bare["spec"]["schedulingGroup"] = json!({"podGroupName": ""});
    variants.push(("an empty PodGroup name", bare));
    for (what, pod) in &variants {
        assert_same(pod, what);
    }
    // the variants are told apart: a reading that ignored a field would pass the checks above
    let (w, _) = both(&variants[2].1);
    assert!(w.has_soft_preferences() && !both(&base).0.has_soft_preferences());
    assert!(PodView::request(&both(&variants[4].1).1).is_err());
    assert!(both(&variants[5].1).1.node_constraints().is_err());
    assert!(PodView::is_finished(&both(&variants[1].1).1));
}
