use std::collections::BTreeMap;
use std::path::Path;

use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::dra::claims::claim_demand;
use gpuplace_core::dra::DEFAULT_DRIVER;
use gpuplace_core::inventory::Board;
use gpuplace_core::resources::{GpuDemand, MemoryDemand, PodRequest};
use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use serde_json::{json, Value};

use super::*;

const CLASS: &str = "gpu.gpuplace.io";

fn board(file: &str, name: &str) -> Node {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/topologies").join(file);
    Board::File { path }.resolve(Path::new(".")).expect("a board").node(name, BTreeMap::new(), 0, 0)
}

fn pcie(name: &str) -> Node {
    Board::Pcie { model: "L40S".into(), memory_mib: 46068, sockets: 2, switches_per_socket: 2, gpus_per_switch: 2 }
        .resolve(Path::new("."))
        .expect("a board")
        .node(name, BTreeMap::new(), 0, 0)
}

/// A claim of `requests` (name, count, capacity) with optional constraints.
fn claim(name: &str, requests: &[(&str, u32, Value)], constraints: Value) -> PodClaim {
    let reqs: Vec<Value> = requests
        .iter()
        .map(|(n, count, cap)| {
            let mut exactly = json!({"deviceClassName": CLASS, "count": count});
            if !cap.is_null() {
                exactly["capacity"] = json!({"requests": cap});
            }
            json!({"name": n, "exactly": exactly})
        })
        .collect();
    let mut devices = json!({"requests": reqs});
    if !constraints.is_null() {
        devices["constraints"] = constraints;
    }
    let spec: ResourceClaimSpec = serde_json::from_value(json!({"devices": devices})).expect("a spec");
    let demand = claim_demand(&spec, CLASS, DEFAULT_DRIVER).expect("valid").expect("ours");
    let claim = ResourceClaim {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ml".into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        },
        spec,
        status: None,
    };
    PodClaim { claim, demand, entry: format!("entry-{name}") }
}

fn base() -> PodRequest {
    PodRequest::single("ml/p", GpuDemand::Whole { gpus: 1 })
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(1_790_000_000).expect("in range"))
}

#[test]
fn each_claim_request_is_a_container_and_selectors_narrow_the_models() {
    let a = claim("a", &[("gpu", 2, Value::Null), ("share", 1, json!({"memory": "10Gi", "cores": "30"}))], Value::Null);
    let b = claim("b", &[("gpu", 1, json!({"memory": "1Gi"}))], Value::Null);
    let req = request(&base(), &[a.clone(), b]).unwrap();
    let names: Vec<&str> = req.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["entry-a/gpu", "entry-a/share", "entry-b/gpu"]);
    assert_eq!(req.containers[1].demand, GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(10240), core_pct: 30 });
    assert_eq!(req.key, "ml/p");
    assert!(req.allowed_models.is_empty());
    // the pod's gpuplace.io/isolation holds for its claims as for its extended resources
    let mut strict = base();
    strict.isolation = vec![gpuplace_core::isolation::IsolationMode::Guard];
    assert_eq!(request(&strict, std::slice::from_ref(&a)).unwrap().isolation, strict.isolation);

    let mut h100 = a.clone();
    h100.demand.requests[0].models = vec!["H100".into(), "A100".into()];
    let mut a100 = a.clone();
    a100.demand.requests[1].models = vec!["a100".into()];
    assert_eq!(request(&base(), &[h100.clone()]).unwrap().allowed_models, ["H100", "A100"]);
    assert_eq!(request(&base(), &[h100.clone(), a100]).unwrap().allowed_models, ["A100"]);
    let mut v100 = a;
    v100.demand.requests[0].models = vec!["V100".into()];
    assert!(matches!(request(&base(), &[h100, v100]), Err(PlanError::Models { .. })));
}

#[test]
fn a_placement_is_written_as_each_claims_allocation_and_the_model_record_it_reads_back_as() {
    let mut cluster = Cluster::new(vec![board("hgx-h100-8.json", "n1")]);
    let a = claim("a", &[("gpu", 2, Value::Null)], Value::Null);
    let b = claim("b", &[("gpu", 1, json!({"memory": "20000Mi", "cores": "25"}))], Value::Null);
    let claims = [a, b];
    let req = request(&base(), &claims).unwrap();
    let engine = Engine::default();
    let p = choose(&engine, &cluster, &req, &claims, DEFAULT_DRIVER, &|_| true, 0).unwrap();
    let written = allocations(&cluster, &p, &claims, DEFAULT_DRIVER, &[], now()).unwrap();
    assert_eq!(written.len(), 2);
    assert_eq!(written[0].key, "claim:ml/a");
    let results = written[0].allocation.devices.as_ref().unwrap().results.as_ref().unwrap();
    assert_eq!(results.len(), 2);
    assert!(results.iter().all(|r| r.pool == "n1" && r.request == "gpu"));
    let gpus: Vec<u32> = p.assignment.containers[0].slices.iter().map(|s| s.gpu).collect();
    let named: Vec<String> = gpus.iter().map(|&g| gpuplace_core::dra::device_name(g)).collect();
    assert_eq!(results.iter().map(|r| r.device.clone()).collect::<Vec<_>>(), named);
    // the records count as the claims will when read back: both fit, and take what they consume
    for w in written {
        cluster.allocate(w.record).expect("the records fit");
    }
    let node = cluster.node("n1").unwrap();
    let share = p.assignment.containers[1].slices[0].gpu as usize;
    assert_eq!((node.usage(share).mem_mib, node.usage(share).core_pct), (20000, 25));
    assert_eq!(node.usage(gpus[0] as usize).core_pct, 100);
}

#[test]
fn constraints_send_the_claims_past_a_better_node_that_cannot_meet_them() {
    let cluster = Cluster::new(vec![pcie("a-pcie"), board("hgx-h100-8.json", "b-hgx")]);
    let engine = Engine::default();
    let pair = |constraints: Value| claim("pair", &[("gpu", 2, Value::Null)], constraints);
    let free_pair = pair(Value::Null);
    let req = request(&base(), std::slice::from_ref(&free_pair)).unwrap();
    let unconstrained = choose(&engine, &cluster, &req, &[free_pair], DEFAULT_DRIVER, &|_| true, 0).unwrap();
    // each board's best pair scores the same (topology counts against the board's best), so the
    // first by name wins
    assert_eq!(unconstrained.assignment.node, "a-pcie");
    // one NVLink domain: only the HGX has such a pair
    let joined = pair(json!([{"matchAttribute": "gpu.gpuplace.io/nvlinkDomain"}]));
    let constrained =
        choose(&engine, &cluster, &req, std::slice::from_ref(&joined), DEFAULT_DRIVER, &|_| true, 0).unwrap();
    assert_eq!(constrained.assignment.node, "b-hgx");
    // two GPUs of different NVLink domains: only the PCIe board has them
    let apart = pair(json!([{"distinctAttribute": "gpu.gpuplace.io/nvlinkDomain"}]));
    assert_eq!(
        choose(&engine, &cluster, &req, &[apart], DEFAULT_DRIVER, &|_| true, 0).unwrap().assignment.node,
        "a-pcie"
    );
    // a constraint no node meets is refused with the reason
    let lacking = pair(json!([{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]));
    let e = choose(&engine, &cluster, &req, &[lacking], DEFAULT_DRIVER, &|_| true, 0).unwrap_err();
    assert!(matches!(e, PlanError::Constraints { tried: 2, .. }), "{e}");
    assert!(!e.to_string().contains('\n'));
    // and a pod that fits nowhere says so
    let huge = claim("huge", &[("gpu", 9, Value::Null)], Value::Null);
    let req = request(&base(), std::slice::from_ref(&huge)).unwrap();
    assert!(matches!(
        choose(&engine, &cluster, &req, &[huge], DEFAULT_DRIVER, &|_| true, 0),
        Err(PlanError::NoRoom { rejected: 2 })
    ));
}
