//! The plugin against a fake kubelet over the real gRPC stack (unix sockets in a temp dir). DRA
//! mode's node side (registration, NodePrepareResources): `dra.rs`.

#[path = "../common/mod.rs"]
mod common;
mod dra;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use common::{allocate, next_list, no_update_within, topology, Harness, SlotIds, WAIT};
use gpuplace_core::inventory::load_topology_file;
use gpuplace_device_plugin::assign::{pending_pod, share, whole, AssignmentSource, PodKey, StaticAssignments};
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::{
    ContainerPreferredAllocationRequest, Empty, PreferredAllocationRequest,
};
use gpuplace_device_plugin::nvml::fake::Fault;
use gpuplace_device_plugin::plugin::PluginConfig;
use tonic::transport::Channel;
use tonic::Code;

fn config(slots: u32) -> PluginConfig {
    PluginConfig { slots_per_gpu: slots, ..PluginConfig::default() }
}

async fn preferred(
    c: &mut DevicePluginClient<Channel>,
    available: Vec<String>,
    must: Vec<String>,
    size: i32,
) -> Result<Vec<String>, tonic::Status> {
    let req = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: must,
            allocation_size: size,
        }],
    };
    Ok(c.get_preferred_allocation(req).await?.into_inner().container_responses.remove(0).device_i_ds)
}

fn gpu_set(node: &SlotIds, ids: &[String]) -> BTreeSet<u32> {
    ids.iter().map(|id| node.gpu_of(id)).collect()
}

#[tokio::test]
async fn registers_and_advertises_slots_with_numa() {
    let mut h = Harness::start("hgx-h100-8", PluginConfig::default(), None).await;
    let (reg, mut c) = h.register_and_connect().await;
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.endpoint, "gpuplace.sock");
    assert_eq!(reg.resource_name, "gpuplace.io/gpu");
    let opts = reg.options.expect("options");
    assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);
    assert_eq!(c.get_device_plugin_options(Empty {}).await.unwrap().into_inner(), opts);

    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    let devices = next_list(&mut stream).await;
    // 8 GPUs x the default 10 slots
    assert_eq!(devices.len(), 80);
    let node = SlotIds::of(&h);
    let ids: BTreeSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 80);
    for g in 0..8u32 {
        for s in 0..10 {
            assert!(ids.contains(node.slot(g, s).as_str()));
        }
    }
    for d in &devices {
        assert_eq!(d.health, "Healthy");
        assert!(d.id.len() <= 63);
        let numa = d.topology.as_ref().expect("NUMA topology").nodes[0].id;
        assert_eq!(numa, if node.gpu_of(&d.id) < 4 { 0 } else { 1 }, "{}", d.id);
    }
    h.shutdown().await;
}

#[tokio::test]
async fn preferred_allocation_on_nvswitch_keeps_sets_in_one_socket_and_honours_must_include() {
    let k = 4;
    let mut h = Harness::start("hgx-h100-8", config(k), None).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);
    let all = node.slots_of(0..8, k);

    // 4 GPUs: NV18 everywhere, so the PCIe level decides: one socket (NODE) beats two (SYS)
    let got = preferred(&mut c, all.clone(), vec![], 4).await.unwrap();
    let gpus = gpu_set(&node, &got);
    assert_eq!(got.len(), 4);
    assert!(gpus == (0..4).collect() || gpus == (4..8).collect(), "{gpus:?}");

    // must-include GPU 6: its partner comes from socket 1, and the must-include ID is returned as is
    let must = node.slot(6, 2);
    let got = preferred(&mut c, all.clone(), vec![must.clone()], 2).await.unwrap();
    assert!(got.contains(&must));
    let gpus = gpu_set(&node, &got);
    assert_eq!(gpus.len(), 2);
    assert!(gpus.iter().all(|&g| g >= 4), "{gpus:?}");

    // 8 of 8, then more GPUs than exist: a clear refusal, not slots stacked on one GPU
    assert_eq!(gpu_set(&node, &preferred(&mut c, all.clone(), vec![], 8).await.unwrap()).len(), 8);
    let e = preferred(&mut c, all.clone(), vec![], 9).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("needs 9 different GPUs"), "{}", e.message());

    // one GPU: the least shared one. GPU 0 has 2 of 4 slots taken, GPU 1 none
    let mut avail = vec![node.slot(0, 2), node.slot(0, 3)];
    avail.extend(node.slots_of([1], k));
    let got = preferred(&mut c, avail, vec![], 1).await.unwrap();
    assert_eq!(got, vec![node.slot(1, 0)]);

    // must-include outside the available list, bad IDs, bad sizes: errors
    let e = preferred(&mut c, node.slots_of(0..2, k), vec![node.slot(5, 0)], 2).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = preferred(&mut c, vec!["GPU-nope::0".into()], vec![], 1).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(preferred(&mut c, all, vec![], 0).await.unwrap_err().code(), Code::InvalidArgument);
    h.shutdown().await;
}

/// go-gpuallocator's own test cases on DGX-1 Volta (shared/topologies/oracle), through the plugin:
/// every answer holds the required GPUs and reaches the brute-force optimum (upstream misses it in
/// "Single NVLINK, prefer same switch"); the cases upstream refuses are refused.
#[tokio::test]
async fn preferred_allocation_on_dgx1_volta_matches_the_oracle_optimum() {
    let k = 2;
    let mut h = Harness::start("dgx1-volta", config(k), None).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);
    let topo = load_topology_file(&topology("dgx1-volta")).unwrap().graph().unwrap();
    let oracle: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(topology("oracle/dgx1-volta")).unwrap()).unwrap();
    let cases = oracle["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 11);
    let list = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let available = list(&case["available"]);
        let required = list(&case["required"]);
        let request = case["request"].as_i64().unwrap() as i32;
        // slot 0 of a required GPU stands for the device reused from an init container
        let must: Vec<String> = required.iter().map(|&g| node.slot(g, 0)).collect();
        let result = preferred(&mut c, node.slots_of(available.iter().copied(), k), must.clone(), request).await;
        match case["best"].get("score").and_then(|s| s.as_u64()) {
            None => assert!(result.is_err(), "{name}: upstream refuses, we answered {result:?}"),
            Some(best) => {
                let got = result.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(got.len(), request as usize, "{name}");
                assert!(must.iter().all(|m| got.contains(m)), "{name}: must-include dropped");
                let gpus: Vec<usize> = gpu_set(&node, &got).into_iter().map(|g| g as usize).collect();
                assert_eq!(gpus.len(), request as usize, "{name}: one slot per GPU");
                assert_eq!(u64::from(topo.set_score(&gpus)), best, "{name}: {gpus:?}");
            }
        }
    }
    // on the empty board, the best pair and quad of the whole machine
    let all = node.slots_of(0..8, k);
    for size in [2, 4] {
        let got = preferred(&mut c, all.clone(), vec![], size).await.unwrap();
        let gpus: Vec<usize> = gpu_set(&node, &got).into_iter().map(|g| g as usize).collect();
        assert_eq!(topo.set_score(&gpus), topo.best_set_score(size as usize), "size {size}: {gpus:?}");
    }
    h.shutdown().await;
}

#[tokio::test]
async fn allocate_without_assignments_exposes_the_slots_gpus() {
    let k = 3;
    let mut h = Harness::start("hgx-h100-8", config(k), None).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);
    let r = allocate(&mut c, vec![node.slot(5, 2), node.slot(2, 0)]).await.unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], format!("{},{}", node.uuids[2], node.uuids[5]));
    assert_eq!(r.envs["GPUPLACE_GPU_INDICES"], "2,5");
    assert_eq!(r.envs["GPUPLACE_GPU_UUIDS"], r.envs["NVIDIA_VISIBLE_DEVICES"]);
    assert!(!r.envs.contains_key("GPUPLACE_POD") && !r.envs.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
    // two slots of one GPU for a two-GPU container: refused, not silently one GPU
    let e = allocate(&mut c, vec![node.slot(1, 0), node.slot(1, 1)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("needs that many different GPUs"), "{}", e.message());
    let e = allocate(&mut c, vec![node.slot(1, 3)]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "slot 3 of 3");
    assert_eq!(allocate(&mut c, vec![]).await.unwrap_err().code(), Code::InvalidArgument);
    h.shutdown().await;
}

#[tokio::test]
async fn allocate_finds_the_pod_by_assignment_and_refuses_when_none_matches() {
    let k = 4;
    let source = Arc::new(StaticAssignments::new(vec![
        // a share of GPU 1
        pending_pod("ns/share-a", 1, &[("main", false, vec![share(1, 20480, 25)])]),
        // two whole GPUs
        pending_pod("ns/pair", 3, &[("train", false, vec![whole(2, 81559), whole(3, 81559)])]),
        // bound after the others, admitted before share-b
        pending_pod("ns/late", 4, &[("main", false, vec![share(6, 4096, 0)])]),
    ]));
    let cfg = PluginConfig {
        mps_pipe_dir: Some("/run/nvidia/mps".into()),
        mps_shm_dir: Some("/run/gpuplace/mps/shm".into()),
        ..config(k)
    };
    let mut h = Harness::start("hgx-h100-8", cfg, Some(source.clone() as Arc<dyn AssignmentSource>)).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);
    let all = node.slots_of(0..8, k);

    // the two-GPU pod: preference follows its assignment ({2,3}), not the topology search ({0,1})
    let got = preferred(&mut c, all.clone(), vec![], 2).await.unwrap();
    assert_eq!(gpu_set(&node, &got), BTreeSet::from([2, 3]));
    let r = allocate(&mut c, got).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/pair");
    assert_eq!(r.envs["GPUPLACE_EXCLUSIVE"], "true");
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], format!("{},{}", node.uuids[2], node.uuids[3]));
    assert!(!r.envs.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "whole GPUs get no MPS limits");
    // and stay off MPS: no pipe directory, no daemon's /dev/shm, no MPS variable
    assert!(r.mounts.is_empty() && r.envs.keys().all(|k| !k.starts_with("CUDA_")), "{r:?}");

    // a one-GPU pod: the earliest bind (share-a) on GPU 1, with its MPS limits and the pipe mount
    let got = preferred(&mut c, all.clone(), vec![], 1).await.unwrap();
    assert_eq!(gpu_set(&node, &got), BTreeSet::from([1]));
    let r = allocate(&mut c, got).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/share-a");
    assert_eq!(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=20480M");
    assert_eq!(r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(r.envs["GPUPLACE_GPU_MEM_MIB"], "20480");
    assert_eq!(r.envs["GPUPLACE_GPU_CORE_PCT"], "25");
    assert_eq!(r.envs["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia/mps");
    assert_eq!(r.envs["CUDA_VISIBLE_DEVICES"], node.uuids[1]);
    // the pipe directory at its own path, the daemon's shm directory as /dev/shm
    let mounts: Vec<(&str, &str, bool)> =
        r.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only)).collect();
    assert_eq!(mounts, [("/run/nvidia/mps", "/run/nvidia/mps", false), ("/run/gpuplace/mps/shm", "/dev/shm", false)]);
    // a share of GPU 1 with other limits, bound once share-a was allocated (as the extender binds
    // such pods on a node whose plugin confirms allocations)
    source.bind(pending_pod("ns/share-b", 5, &[("main", false, vec![share(1, 10240, 10)])]));

    // out of bind order: kubelet admits ns/late before ns/share-b; GPU 6 identifies it
    let r = allocate(&mut c, vec![node.slot(6, 0)]).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/late");
    assert!(!r.envs.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "memory-only share sets no compute limit");
    let r = allocate(&mut c, vec![node.slot(1, 1)]).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/share-b");
    assert_eq!(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");

    // nothing left for GPU 1 or GPU 7: refused loudly
    for gpu in [1, 7] {
        let e = allocate(&mut c, vec![node.slot(gpu, 2)]).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.message().contains("no pod bound to this node has a gpuplace assignment"), "{}", e.message());
    }
    let key = |p: &str| {
        (PodKey { pod: p.into(), uid: format!("uid-{p}") }, if p == "ns/pair" { "train" } else { "main" }.to_string())
    };
    assert_eq!(source.marks(), vec![key("ns/pair"), key("ns/share-a"), key("ns/late"), key("ns/share-b")]);

    // the pod cannot be marked allocated: refused, so a restart can never match it twice
    source.bind(pending_pod("ns/next", 6, &[("main", false, vec![share(0, 1024, 10)])]));
    source.fail_marks(true);
    let e = allocate(&mut c, vec![node.slot(0, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    source.fail_marks(false);
    assert_eq!(allocate(&mut c, vec![node.slot(0, 0)]).await.unwrap().envs["GPUPLACE_POD"], "ns/next");
    h.shutdown().await;
}

/// Issue 28: kubelet's Allocate does not name the pod, and kubelet may admit pods in any order.
#[tokio::test]
async fn pods_with_other_limits_on_one_gpu_are_refused_and_twins_are_matched_either_way() {
    let k = 4;
    let twin = |name: &str, seq| pending_pod(name, seq, &[("main", false, vec![share(3, 4096, 40)])]);
    let source = Arc::new(StaticAssignments::new(vec![
        pending_pod("ns/x", 1, &[("main", false, vec![share(0, 1024, 10)])]),
        pending_pod("ns/y", 2, &[("main", false, vec![share(0, 2048, 20)])]),
        twin("ns/t1", 3),
        twin("ns/t2", 4),
        pending_pod("ns/quad", 5, &[("train", false, (4..8).map(|g| whole(g, 81559)).collect())]),
    ]));
    let mut h = Harness::start("hgx-h100-8", config(k), Some(source.clone() as Arc<dyn AssignmentSource>)).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);

    // x and y wait for GPU 0 with different limits: whichever kubelet admits, a guess could give it
    // the other's limits, so neither is applied
    let e = allocate(&mut c, vec![node.slot(0, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let m = e.message();
    assert!(m.contains("ns/x (bind #1, container main: 1024 MiB and 10% of GPU 0)"), "{m}");
    assert!(m.contains("ns/y (bind #2, container main: 2048 MiB and 20% of GPU 0)"), "{m}");
    assert!(m.contains("with different limits") && m.contains("refusing"), "{m}");
    assert!(source.marks().is_empty(), "nothing marked");

    // t1 and t2 wait for GPU 3 with the same limits: either match is right; the first is a guess,
    // marked unconfirmed until pod-resources shows who got the devices, the second is certain
    for slot in [0, 1] {
        let r = allocate(&mut c, vec![node.slot(3, slot)]).await.unwrap();
        assert_eq!(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
        assert_eq!(r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "40");
    }
    let main = || BTreeSet::from(["main".to_string()]);
    assert_eq!(source.record("ns/t1"), (main(), main()));
    assert_eq!(source.record("ns/t2"), (main(), BTreeSet::new()));

    // a four-GPU container, devices in kubelet's order (7, 4, 6, 5): every list in GPU index order,
    // so the i-th entries of all of them name one GPU
    let sent: Vec<String> = [7, 4, 6, 5].iter().map(|&g| node.slot(g, 1)).collect();
    let r = allocate(&mut c, sent).await.unwrap();
    assert_eq!(r.envs["GPUPLACE_POD"], "ns/quad");
    assert_eq!(r.envs["GPUPLACE_GPU_INDICES"], "4,5,6,7");
    let uuids: Vec<&str> = (4..8).map(|g| node.uuids[g].as_str()).collect();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], uuids.join(","));
    assert_eq!(r.envs["GPUPLACE_GPU_UUIDS"], uuids.join(","));
    let ids: Vec<String> = (4..8).map(|g| node.slot(g, 1)).collect();
    assert_eq!(r.envs["GPUPLACE_DEVICE_IDS"], ids.join(","));
    assert_eq!(r.envs["GPUPLACE_GPU_MEM_MIB"], ["81559"; 4].join(","));
    h.shutdown().await;
}

#[tokio::test]
async fn kubelet_restart_and_socket_removal_lead_to_re_registration() {
    let mut h = Harness::start("dgx1-volta", config(2), None).await;
    let (_, mut c) = h.register_and_connect().await;
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(next_list(&mut stream).await.len(), 16);
    // health set before the restart must survive it
    h.backend.inject(4, Fault::FallOffBus).unwrap();
    let after_fault = next_list(&mut stream).await;
    assert_eq!(after_fault.iter().filter(|d| d.health == "Unhealthy").count(), 2);

    h.restart_kubelet().await;
    let (reg, mut c2) = h.register_and_connect().await;
    assert_eq!(reg.resource_name, "gpuplace.io/gpu");
    // the old stream ends with the old server
    let end = tokio::time::timeout(WAIT, stream.message()).await.expect("old stream ends");
    assert!(!matches!(end, Ok(Some(_))), "old stream still sending: {end:?}");
    let mut stream2 = c2.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(next_list(&mut stream2).await, after_fault);

    // our socket deleted (by an operator or a cleanup job): back within a poll interval
    std::fs::remove_file(h.dir.path().join("gpuplace.sock")).unwrap();
    let (_, mut c3) = h.register_and_connect().await;
    assert!(c3.get_device_plugin_options(Empty {}).await.unwrap().into_inner().get_preferred_allocation_available);
    h.shutdown().await;
}

/// After a kubelet restart `gpuplace.io/gpu` is 0 in the node's allocatable until kubelet has the
/// plugin's registration, and a real v1.36 kubelet refuses for good every pod it admits before then
/// (0.8 s after it recreates `kubelet.sock` on the real node): a `kubelet.sock` created anew is tried
/// at once, seen through the directory's events rather than after the poll or retry interval.
#[tokio::test]
async fn a_kubelet_that_comes_up_is_registered_with_at_once() {
    use gpuplace_device_plugin::nvml::fake::FakeBackend;
    use gpuplace_device_plugin::nvml::GpuBackend;
    use gpuplace_device_plugin::plugin::Plugin;
    use gpuplace_device_plugin::server::{run, ServeConfig};

    let dir = tempfile::Builder::new().prefix("gdpreg").tempdir().unwrap();
    let backend = FakeBackend::load(&topology("hgx-h100-8"), "test-node").unwrap();
    let plugin = Plugin::new(config(2), &backend.inventory().unwrap(), None).unwrap();
    // poll and retry intervals far beyond the test's patience: only the directory's events can
    // explain a registration in time
    let cfg = ServeConfig {
        dir: dir.path().to_path_buf(),
        socket_name: "gpuplace.sock".into(),
        poll_interval: Duration::from_secs(600),
        retry_interval: Duration::from_secs(600),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = tokio::spawn(run(
        plugin.clone(),
        cfg,
        Box::pin(async {
            let _ = stop_rx.await;
        }),
    ));
    // no kubelet yet: the first attempt fails
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!plugin.registered());
    let mut kubelet = common::FakeKubelet::start(dir.path());
    let started = std::time::Instant::now();
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.resource_name, "gpuplace.io/gpu");
    assert!(started.elapsed() < Duration::from_secs(5), "registered after {:?}", started.elapsed());
    // noted once kubelet's answer is in
    let deadline = std::time::Instant::now() + WAIT;
    while !plugin.registered() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(plugin.registered());

    // the kubelet restarts as a real one does: it stops, deletes every socket in the directory
    // (ours included) and serves a new kubelet.sock; the plugin is back before a poll could tell
    kubelet.stop().await;
    for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let mut kubelet = common::FakeKubelet::start(dir.path());
    let restarted = std::time::Instant::now();
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.endpoint, "gpuplace.sock");
    assert!(restarted.elapsed() < Duration::from_secs(5), "registered again after {:?}", restarted.elapsed());
    assert!(dir.path().join("gpuplace.sock").exists(), "our socket is served again");

    // once more, with a kubelet.sock that refuses dials for its first 300 ms (bound, not yet
    // listening): the same file is tried again within milliseconds, not after the retry interval
    kubelet.stop().await;
    for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let mut kubelet = common::FakeKubelet::start_late(dir.path(), Duration::from_millis(300));
    let restarted = std::time::Instant::now();
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.endpoint, "gpuplace.sock");
    assert!(restarted.elapsed() < Duration::from_secs(3), "registered again after {:?}", restarted.elapsed());
    let _ = stop_tx.send(());
    serve.await.unwrap().unwrap();
}

#[tokio::test]
async fn unhealthy_gpus_are_streamed_once_and_avoided() {
    let k = 2;
    let mut h = Harness::start("hgx-h100-8", config(k), None).await;
    let (_, mut c) = h.register_and_connect().await;
    let node = SlotIds::of(&h);
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert!(next_list(&mut stream).await.iter().all(|d| d.health == "Healthy"));
    let unhealthy = |devs: &[gpuplace_device_plugin::kubelet_api::v1beta1::Device]| -> BTreeMap<u32, usize> {
        let mut m = BTreeMap::new();
        for d in devs.iter().filter(|d| d.health == "Unhealthy") {
            *m.entry(node.gpu_of(&d.id)).or_default() += 1;
        }
        m
    };

    // GPU 3 falls off the bus: all its slots turn unhealthy in one update
    h.backend.inject(3, Fault::FallOffBus).unwrap();
    assert_eq!(unhealthy(&next_list(&mut stream).await), BTreeMap::from([(3, 2)]));
    // an XID storm of double-bit ECC errors on GPU 5: one update, not 500
    h.backend.inject(5, Fault::XidStorm { xid: 48, count: 500 }).unwrap();
    assert_eq!(unhealthy(&next_list(&mut stream).await), BTreeMap::from([(3, 2), (5, 2)]));
    no_update_within(&mut stream, Duration::from_millis(300)).await;
    // application XIDs (13: the workload's fault) leave the GPU healthy
    h.backend.inject(6, Fault::XidStorm { xid: 13, count: 100 }).unwrap();
    no_update_within(&mut stream, Duration::from_millis(300)).await;

    // unhealthy GPUs are neither preferred nor allocated
    let all = node.slots_of(0..8, k);
    let e = preferred(&mut c, all.clone(), vec![], 7).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    let got = preferred(&mut c, all, vec![], 6).await.unwrap();
    assert_eq!(gpu_set(&node, &got), BTreeSet::from([0, 1, 2, 4, 6, 7]));
    let e = allocate(&mut c, vec![node.slot(5, 0)]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("GPU 5 is unhealthy (XID 48)"), "{}", e.message());

    // back on the bus
    h.backend.inject(3, Fault::Recover).unwrap();
    assert_eq!(unhealthy(&next_list(&mut stream).await), BTreeMap::from([(5, 2)]));
    h.shutdown().await;
}
