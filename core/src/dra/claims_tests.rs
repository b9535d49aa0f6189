use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequirements, DeviceClaim, DeviceClaimConfiguration, DeviceConstraint, DeviceRequest,
    DeviceSelector, DeviceSubRequest, ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use proptest::prelude::*;

use super::*;
use crate::cluster::{Cluster, Gpu, Node};
use crate::dra::DEFAULT_DRIVER;
use crate::topology::GpuTopology;

const CLASS: &str = "gpu.gpuplace.io";

fn exact(name: &str, count: Option<i64>, capacity: &[(&str, &str)]) -> DeviceRequest {
    let requests: BTreeMap<String, Quantity> =
        capacity.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect();
    DeviceRequest {
        name: name.into(),
        exactly: Some(ExactDeviceRequest {
            device_class_name: CLASS.into(),
            count,
            capacity: (!requests.is_empty()).then_some(CapacityRequirements { requests: Some(requests) }),
            ..Default::default()
        }),
        first_available: None,
    }
}

fn spec(requests: Vec<DeviceRequest>) -> ResourceClaimSpec {
    ResourceClaimSpec { devices: Some(DeviceClaim { requests: Some(requests), ..Default::default() }) }
}

fn demand_of(requests: Vec<DeviceRequest>) -> Result<Option<ClaimDemand>, ClaimError> {
    claim_demand(&spec(requests), CLASS, DEFAULT_DRIVER)
}

fn one(requests: Vec<DeviceRequest>) -> RequestDemand {
    demand_of(requests).expect("valid").expect("ours").requests.remove(0)
}

#[test]
fn requests_map_to_gpuplace_demands_with_dra_defaults() {
    let whole = one(vec![exact("gpu", None, &[])]);
    assert_eq!(whole.demand(), GpuDemand::Whole { gpus: 1 });
    assert_eq!(whole.consumption(81920), (81920, 100));

    let share = one(vec![exact("gpu", Some(2), &[("memory", "20000Mi"), ("cores", "25")])]);
    assert_eq!(share.demand(), GpuDemand::Shared { gpus: 2, memory: MemoryDemand::Mib(20000), core_pct: 25 });
    assert_eq!(share.consumption(81920), (20000, 25));

    // memory alone takes all the compute: DRA has one default per capacity
    let mem_only = one(vec![exact("gpu", None, &[("memory", "20Gi")])]);
    assert_eq!(mem_only.demand(), GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(20480), core_pct: 100 });
    // cores alone takes all the memory, so nothing fits beside it: a whole GPU
    let cores_only = one(vec![exact("gpu", None, &[("cores", "30")])]);
    assert_eq!(cores_only.demand(), GpuDemand::Whole { gpus: 1 });
    assert_eq!(cores_only.consumption(40960), (40960, 30));

    // rounded up to the policies' steps: 1Mi and one percent
    let odd = one(vec![exact("gpu", None, &[("memory", "1.5Mi"), ("cores", "12.5"), ("shares", "1")])]);
    assert_eq!((odd.memory_mib, odd.cores), (Some(2), Some(13)));
    let tiny = one(vec![exact("gpu", None, &[("memory", "1")])]);
    assert_eq!(tiny.memory_mib, Some(1));
}

#[test]
fn requests_gpuplace_cannot_place_are_refused_with_the_reason() {
    let refused = |r: DeviceRequest| demand_of(vec![r]).unwrap_err();
    assert!(matches!(
        refused(exact("a", None, &[("cores", "150")])),
        ClaimError::BadCapacity { capacity: "cores", .. }
    ));
    assert!(matches!(
        refused(exact("a", None, &[("memory", "-1Gi")])),
        ClaimError::BadCapacity { capacity: "memory", .. }
    ));
    assert!(matches!(refused(exact("a", None, &[("memory", "lots")])), ClaimError::BadCapacity { .. }));
    assert!(matches!(
        refused(exact("a", None, &[("shares", "2")])),
        ClaimError::BadCapacity { capacity: "shares", .. }
    ));
    assert!(matches!(refused(exact("a", None, &[("bandwidth", "1")])), ClaimError::UnknownCapacity { .. }));
    assert!(matches!(refused(exact("a", Some(0), &[])), ClaimError::Count { count: 0, .. }));
    assert!(matches!(refused(exact("a", Some(65), &[])), ClaimError::Count { count: 65, .. }));

    let mut all = exact("a", None, &[]);
    all.exactly.as_mut().unwrap().allocation_mode = Some("All".into());
    assert!(matches!(refused(all), ClaimError::AllocationMode { .. }));
    let mut admin = exact("a", None, &[]);
    admin.exactly.as_mut().unwrap().admin_access = Some(true);
    assert!(matches!(refused(admin), ClaimError::AdminAccess { .. }));

    let alternatives = DeviceRequest {
        name: "a".into(),
        exactly: None,
        first_available: Some(vec![DeviceSubRequest {
            name: "big".into(),
            device_class_name: CLASS.into(),
            ..Default::default()
        }]),
    };
    let e = refused(alternatives);
    assert!(matches!(e, ClaimError::FirstAvailable { .. }), "{e}");

    let mut other = exact("nic", None, &[]);
    other.exactly.as_mut().unwrap().device_class_name = "rdma.example.com".into();
    let e = demand_of(vec![exact("gpu", None, &[]), other.clone()]).unwrap_err();
    assert!(matches!(e, ClaimError::MixedClasses { ref other, .. } if other == "rdma.example.com"), "{e}");
    // a claim with no request of gpuplace's class is not gpuplace's
    assert_eq!(demand_of(vec![other]).unwrap(), None);
    assert_eq!(claim_demand(&ResourceClaimSpec { devices: None }, CLASS, DEFAULT_DRIVER).unwrap(), None);
    // every error is one line a pod's event can show
    assert!(!e.to_string().contains('\n'));
}

#[test]
fn selectors_on_the_driver_and_the_model_are_read_and_others_refused() {
    let with = |expression: &str| {
        let mut r = exact("gpu", None, &[]);
        r.exactly.as_mut().unwrap().selectors =
            Some(vec![DeviceSelector { cel: Some(CELDeviceSelector { expression: expression.into() }) }]);
        demand_of(vec![r]).map(|d| d.expect("ours").requests.remove(0).models)
    };
    assert_eq!(with(r#"device.driver == "gpu.gpuplace.io""#).unwrap(), Vec::<String>::new());
    assert_eq!(
        with(r#"device.attributes["gpu.gpuplace.io"].model == "NVIDIA H100 80GB HBM3""#).unwrap(),
        ["NVIDIA H100 80GB HBM3"]
    );
    assert_eq!(with("device.attributes['gpu.gpuplace.io'].model=='A100'").unwrap(), ["A100"]);
    for unread in [
        r#"device.driver == "other.example.com""#,
        r#"device.attributes["gpu.gpuplace.io"].model != "A100""#,
        r#"device.attributes["gpu.gpuplace.io"].model == "A100" || true"#,
        r#"device.capacity["gpu.gpuplace.io"].memory.compareTo(quantity("40Gi")) >= 0"#,
        "",
    ] {
        assert!(matches!(with(unread), Err(ClaimError::Selector { .. })), "{unread}");
    }
}

#[test]
fn constraints_cover_their_requests_and_are_checked_on_the_chosen_gpus() {
    let mut s = spec(vec![exact("a", Some(2), &[]), exact("b", None, &[])]);
    s.devices.as_mut().unwrap().constraints = Some(vec![
        DeviceConstraint { match_attribute: Some("gpu.gpuplace.io/nvlinkDomain".into()), ..Default::default() },
        DeviceConstraint {
            distinct_attribute: Some("gpu.gpuplace.io/pcieRoot".into()),
            requests: Some(vec!["a".into()]),
            ..Default::default()
        },
    ]);
    let d = claim_demand(&s, CLASS, DEFAULT_DRIVER).unwrap().unwrap();
    assert_eq!(d.constraints[0].requests, ["a", "b"]);
    assert_eq!(d.constraints[1].requests, ["a"]);
    // GPUs 0-3 in NVLink domain 0, 4-7 in domain 4; PCIe roots in pairs
    let attr = |gpu: u32, name: &str| -> Option<DeviceAttribute> {
        let v = match name {
            "gpu.gpuplace.io/nvlinkDomain" => i64::from(gpu / 4 * 4),
            "gpu.gpuplace.io/pcieRoot" => i64::from(gpu / 2 * 2),
            _ => return None,
        };
        Some(DeviceAttribute { int: Some(v), ..Default::default() })
    };
    let chosen = |a: [u32; 2], b: u32| Chosen::from([("a".to_string(), a.to_vec()), ("b".to_string(), vec![b])]);
    assert_eq!(check_constraints(&d, &chosen([0, 2], 3), attr), Ok(()));
    let e = check_constraints(&d, &chosen([0, 2], 4), attr).unwrap_err();
    assert!(matches!(e, ClaimError::ConstraintUnmet { kind: "matchAttribute", .. }), "{e}");
    let e = check_constraints(&d, &chosen([0, 1], 3), attr).unwrap_err();
    assert!(matches!(e, ClaimError::ConstraintUnmet { kind: "distinctAttribute", .. }), "{e}");
    // an attribute the devices lack fails the constraint, as in the allocator
    let mut lacking = d.clone();
    lacking.constraints[0].attribute = "resource.kubernetes.io/pcieRoot".into();
    assert!(check_constraints(&lacking, &chosen([0, 2], 3), attr).is_err());

    s.devices.as_mut().unwrap().constraints.as_mut().unwrap()[1].requests = Some(vec!["c".into()]);
    let e = claim_demand(&s, CLASS, DEFAULT_DRIVER).unwrap_err();
    assert!(matches!(e, ClaimError::UnknownConstraintRequest { ref request, .. } if request == "c"), "{e}");
}

fn claim(name: &str, uid: &str, spec: ResourceClaimSpec) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ml".into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec,
        status: None,
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(1_790_000_000).expect("in range"))
}

fn written(
    c: &mut ResourceClaim,
    demand: &ClaimDemand,
    node: &str,
    chosen: &Chosen,
    memory: &dyn Fn(u32) -> Option<u64>,
) -> Result<(), ClaimError> {
    let uid = c.metadata.uid.clone().unwrap_or_default();
    let placement = Placement { node, chosen, gpu_memory_mib: memory };
    let a = allocation(&uid, &c.spec, demand, DEFAULT_DRIVER, &[], &placement, now())?;
    c.status = Some(ResourceClaimStatus { allocation: Some(a), ..Default::default() });
    Ok(())
}

#[test]
fn an_allocation_follows_the_rules_kube_scheduler_honours_and_reads_back_as_the_model_record() {
    let s = spec(vec![exact("pair", Some(2), &[("memory", "20000Mi"), ("cores", "25")]), exact("whole", None, &[])]);
    let mut c = claim("train-0", "6f1c1f8e-1a2b-4c3d-8e9f-001122334455", s);
    let d = claim_demand(&c.spec, CLASS, DEFAULT_DRIVER).unwrap().unwrap();
    let chosen = Chosen::from([("pair".to_string(), vec![2, 3]), ("whole".to_string(), vec![5])]);
    written(&mut c, &d, "node-7", &chosen, &|_| Some(81920)).unwrap();
    let a = c.status.as_ref().unwrap().allocation.as_ref().unwrap();
    assert!(a.allocation_timestamp.is_some());
    let term = &a.node_selector.as_ref().unwrap().node_selector_terms[0];
    let field = &term.match_fields.as_ref().unwrap()[0];
    assert_eq!((field.key.as_str(), field.operator.as_str()), ("metadata.name", "In"));
    assert_eq!(field.values.as_deref(), Some(&["node-7".to_string()][..]));
    let results = a.devices.as_ref().unwrap().results.as_ref().unwrap();
    assert_eq!(results.len(), 3);
    let ids: Vec<&str> = results.iter().map(|r| r.share_id.as_deref().expect("a shareID on every result")).collect();
    assert!(ids.iter().all(|id| id.len() == 36 && id.matches('-').count() == 4));
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
    // the same placement writes the same IDs
    assert_eq!(share_id("6f1c1f8e-1a2b-4c3d-8e9f-001122334455", "pair", 2), ids[0]);
    let cap = |i: usize, k: &str| results[i].consumed_capacity.as_ref().unwrap()[k].0.clone();
    assert_eq!((cap(0, "memory"), cap(0, "cores"), cap(0, "shares")), ("20000Mi".into(), "25".into(), "1".into()));
    assert_eq!((cap(2, "memory"), cap(2, "cores")), ("81920Mi".into(), "100".into()));
    assert_eq!(results[2].device, "gpu-5");
    assert_eq!(results[2].pool, "node-7");

    let record = allocated(&c, DEFAULT_DRIVER).unwrap().unwrap();
    assert_eq!(record.pod, "claim:ml/train-0");
    assert_eq!(record.node, "node-7");
    assert_eq!(record.containers.len(), 2);
    assert_eq!(
        record.containers[0].slices,
        [2, 3].map(|gpu| GpuSlice { gpu, mem_mib: 20000, core_pct: 25, exclusive: false })
    );
    assert_eq!(record.containers[1].slices, [GpuSlice { gpu: 5, mem_mib: 81920, core_pct: 100, exclusive: false }]);

    // wrong counts and unknown GPUs are errors, not partial allocations
    let short = Chosen::from([("pair".to_string(), vec![2]), ("whole".to_string(), vec![5])]);
    assert!(matches!(
        written(&mut c, &d, "node-7", &short, &|_| Some(81920)),
        Err(ClaimError::WrongCount { want: 2, got: 1, .. })
    ));
    assert!(matches!(
        written(&mut c, &d, "node-7", &chosen, &|g| (g != 5).then_some(81920)),
        Err(ClaimError::UnknownDevice { gpu: 5, .. })
    ));
}

#[test]
fn configuration_for_the_driver_is_copied_class_first() {
    let opaque = |driver: &str| {
        Some(OpaqueDeviceConfiguration {
            driver: driver.into(),
            parameters: RawExtension(serde_json::json!({"mps": true})),
        })
    };
    let mut s = spec(vec![exact("gpu", None, &[])]);
    s.devices.as_mut().unwrap().config = Some(vec![
        DeviceClaimConfiguration { opaque: opaque(DEFAULT_DRIVER), requests: Some(vec!["gpu".into()]) },
        DeviceClaimConfiguration { opaque: opaque("other.example.com"), requests: None },
    ]);
    let d = claim_demand(&s, CLASS, DEFAULT_DRIVER).unwrap().unwrap();
    let class = [DeviceClassConfiguration { opaque: opaque(DEFAULT_DRIVER) }];
    let chosen = Chosen::from([("gpu".to_string(), vec![0])]);
    let placement = Placement { node: "n", chosen: &chosen, gpu_memory_mib: &|_| Some(1024) };
    let a = allocation("uid", &s, &d, DEFAULT_DRIVER, &class, &placement, now()).unwrap();
    let config = a.devices.unwrap().config.unwrap();
    let sources: Vec<&str> = config.iter().map(|c| c.source.as_str()).collect();
    assert_eq!(sources, ["FromClass", "FromClaim"]);
}

#[test]
fn allocations_gpuplace_cannot_count_are_errors_and_others_drivers_are_ignored() {
    let result = |pool: &str, device: &str, share: Option<&str>, memory: &str| DeviceRequestAllocationResult {
        request: "gpu".into(),
        driver: DEFAULT_DRIVER.into(),
        pool: pool.into(),
        device: device.into(),
        share_id: share.map(String::from),
        consumed_capacity: Some(BTreeMap::from([("memory".to_string(), Quantity(memory.into()))])),
        ..Default::default()
    };
    let with = |results: Vec<DeviceRequestAllocationResult>| {
        let mut c = claim("c", "u", spec(vec![]));
        c.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult { results: Some(results), config: None }),
                ..Default::default()
            }),
            ..Default::default()
        });
        allocated(&c, DEFAULT_DRIVER)
    };
    let e = with(vec![result("a", "gpu-0", Some("s"), "1Gi"), result("b", "gpu-1", Some("s"), "1Gi")]).unwrap_err();
    assert!(matches!(e, ClaimError::TwoPools { .. }), "{e}");
    assert!(matches!(with(vec![result("a", "mig-0", Some("s"), "1Gi")]), Err(ClaimError::ForeignDevice { .. })));
    assert!(matches!(with(vec![result("a", "gpu-0", Some("s"), "x")]), Err(ClaimError::BadConsumption { .. })));
    // without a shareID a result is exclusive use, as kube-scheduler counts it; bytes round up to MiB
    let r = with(vec![result("a", "gpu-0", None, "1025Ki")]).unwrap().unwrap();
    assert_eq!(r.containers[0].slices, [GpuSlice { gpu: 0, mem_mib: 2, core_pct: 0, exclusive: true }]);
    let mut foreign = result("a", "nic-0", None, "1");
    foreign.driver = "rdma.example.com".into();
    assert_eq!(with(vec![foreign]).unwrap(), None);
    assert_eq!(allocated(&claim("c", "u", spec(vec![])), DEFAULT_DRIVER).unwrap(), None);
}

/// A claim drawn for the property: each request `(count, memory MiB, cores)`.
type DrawnClaim = Vec<(u32, Option<u64>, Option<u32>)>;

fn drawn_spec(requests: &DrawnClaim) -> ResourceClaimSpec {
    let rs = requests
        .iter()
        .enumerate()
        .map(|(i, &(count, mib, cores))| {
            let mut cap: Vec<(&str, String)> = Vec::new();
            if let Some(m) = mib {
                cap.push(("memory", format!("{m}Mi")));
            }
            if let Some(c) = cores {
                cap.push(("cores", c.to_string()));
            }
            let cap: Vec<(&str, &str)> = cap.iter().map(|(k, v)| (*k, v.as_str())).collect();
            exact(&format!("r{i}"), Some(count.into()), &cap)
        })
        .collect();
    spec(rs)
}

proptest! {
    /// The model refuses exactly what would over-commit a device by DRA's own count: claims written
    /// whenever the model accepts their record never sum past any device's memory, cores or shares,
    /// and every claim the model refused would have.
    #[test]
    fn the_model_counts_claims_as_dra_does(
        memories in prop::collection::vec(prop::sample::select(vec![16384u64, 40960, 81920]), 1..=8),
        k in 1u32..=4,
        claims in prop::collection::vec(
            prop::collection::vec((1u32..=3, prop::option::of(1u64..=90000), prop::option::of(0u32..=100)), 1..=3),
            1..=40,
        ),
        seeds in prop::collection::vec(any::<u64>(), 40),
    ) {
        let n = memories.len();
        let gpus: Vec<Gpu> = memories.iter().enumerate().map(|(i, &m)| Gpu {
            uuid: format!("GPU-{i}"), index: i as u32, model: "H100".into(), memory_mib: m, numa_node: None,
            pci_bus_id: String::new(), healthy: true,
        }).collect();
        let node = Node::new("n1", BTreeMap::new(), gpus, Arc::new(GpuTopology::flat(n)), 0, 0).with_slots_per_gpu(Some(k));
        let mut cluster = Cluster::new(vec![node]);
        let memory = |g: u32| memories.get(g as usize).copied();
        // DRA's count: per device, memory, cores and shares consumed by the written claims
        let mut used = vec![(0u64, 0u32, 0u32); n];
        for (i, drawn) in claims.iter().enumerate() {
            let mut c = claim(&format!("c{i}"), &format!("uid-{i}"), drawn_spec(drawn));
            let d = claim_demand(&c.spec, CLASS, DEFAULT_DRIVER).unwrap().unwrap();
            // distinct GPUs per request, drawn from the seed
            let mut seed = seeds[i];
            let mut chosen = Chosen::new();
            let mut fits_board = true;
            for r in &d.requests {
                if r.count as usize > n {
                    fits_board = false;
                    break;
                }
                let mut pool: Vec<u32> = (0..n as u32).collect();
                let mut pick = Vec::new();
                for _ in 0..r.count {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    pick.push(pool.remove((seed >> 33) as usize % pool.len()));
                }
                chosen.insert(r.name.clone(), pick);
            }
            if !fits_board {
                continue;
            }
            written(&mut c, &d, "n1", &chosen, &memory).unwrap();
            let record = allocated(&c, DEFAULT_DRIVER).unwrap().unwrap();
            let mut after = used.clone();
            for r in c.status.as_ref().unwrap().allocation.as_ref().unwrap().devices.as_ref().unwrap().results.as_ref().unwrap() {
                let g = device_index(&r.device).unwrap() as usize;
                let cap = r.consumed_capacity.as_ref().unwrap();
                let q = |k: &str| crate::quantity::parse(&cap[k].0).unwrap().ceil_integer();
                after[g].0 += u64::try_from(q("memory") / MIB).unwrap();
                after[g].1 += u32::try_from(q("cores")).unwrap();
                after[g].2 += u32::try_from(q("shares")).unwrap();
            }
            let over = after.iter().zip(&memories).any(|(&(m, c, s), &cap)| m > cap || c > 100 || s > k);
            match cluster.allocate(record) {
                Ok(()) => {
                    prop_assert!(!over, "the model took claim {} past a device's capacity: {:?}", i, after);
                    used = after;
                }
                Err(e) => prop_assert!(over, "the model refused claim {} that DRA would fit: {}", i, e),
            }
        }
    }
}
