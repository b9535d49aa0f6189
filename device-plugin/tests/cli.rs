//! The `gpuplace-device-plugin` binary: `discover`, and serving a fake kubelet end to end.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::kubelet::http_get;
use common::{assignment_keys, public_keys_configmap, topology, FakeKubelet};
use gpuplace_core::topology::TopologyFile;
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty, PreferredAllocationRequest,
};
use gpuplace_device_plugin::unix_socket::connect_unix;

const BIN: &str = env!("CARGO_BIN_EXE_gpuplace-device-plugin");

#[test]
fn discover_prints_text_and_topology_json() {
    let out =
        Command::new(BIN).args(["--fake-topology"]).arg(topology("pcie-l40s-8")).arg("discover").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("8 GPU(s) on pcie-l40s-8") && text.contains("PIX") && text.contains("SYS"), "{text}");

    let out =
        Command::new(BIN).args(["discover", "--json", "--fake-topology"]).arg(topology("dgx1-volta")).output().unwrap();
    assert!(out.status.success());
    let file: TopologyFile = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((file.name.as_str(), file.gpus.len(), file.links.len()), ("dgx1-volta", 8, 28));
    assert!(file.gpus.iter().all(|g| g.uuid.as_deref().is_some_and(|u| u.starts_with("GPU-"))));
    file.graph().unwrap();
}

#[test]
fn discover_with_dra_prints_the_slice_dra_mode_would_publish() {
    let out = Command::new(BIN)
        .args(["discover", "--dra", "--node-name", "gpu-07", "--slots-per-gpu", "4", "--fake-topology"])
        .arg(topology("hgx-h100-8"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(spec["driver"], "gpu.gpuplace.io");
    assert_eq!((spec["nodeName"].as_str(), spec["pool"]["name"].as_str()), (Some("gpu-07"), Some("gpu-07")));
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    assert_eq!(devices[0]["name"], "gpu-0");
    assert_eq!(devices[0]["allowMultipleAllocations"], true);
    assert_eq!(devices[0]["capacity"]["shares"]["value"], "4");
    assert_eq!(devices[0]["attributes"]["nvlinkDomain"]["int"], 0);
    assert!(devices[0]["attributes"]["uuid"]["string"].as_str().is_some_and(|u| u.starts_with("GPU-")));
}

#[test]
fn without_nvml_or_a_fake_node_it_fails_clearly() {
    let out = Command::new(BIN).arg("discover").output().unwrap();
    if out.status.success() {
        // a GPU node: real NVML answered
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NVML is not available") && err.contains("--fake-topology"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Kills the child on every exit path of the test.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The binary serving the fake `hgx-h100-8` node with K = 2: device-plugin directory `dir`, `/metrics`
/// on `metrics`, fast polling and sampling, no pod-resources socket, output discarded. The caller
/// adds how it reaches the API server.
fn serve(dir: &std::path::Path, metrics: std::net::SocketAddr) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--fake-topology")
        .arg(topology("hgx-h100-8"))
        .arg("--device-plugin-dir")
        .arg(dir)
        .args(["--slots-per-gpu", "2", "--poll-interval-ms", "50", "--sample-interval", "100ms"])
        .args(["--metrics-listen", &metrics.to_string()])
        .arg("--pod-resources-socket")
        .arg(dir.join("no-pod-resources.sock"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

#[tokio::test]
async fn binary_registers_with_the_test_kubelet_and_serves_allocations() {
    let dir = tempfile::Builder::new().prefix("gdp").tempdir().unwrap();
    let mut kubelet = FakeKubelet::start(dir.path());
    // a free port for /metrics (never the default 9400: tests run side by side)
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let child =
        Child(serve(dir.path(), metrics_addr).args(["--node-name", "cli-node", "--no-apiserver"]).spawn().unwrap());
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.resource_name, "gpuplace.io/gpu");
    let mut c = DevicePluginClient::new(connect_unix(&dir.path().join(&reg.endpoint)).await.unwrap());
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    let devices =
        tokio::time::timeout(Duration::from_secs(10), stream.message()).await.unwrap().unwrap().unwrap().devices;
    assert_eq!(devices.len(), 16);
    let ids: Vec<String> = devices.into_iter().map(|d| d.id).collect();
    let pref = c
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: ids,
                must_include_device_i_ds: vec![],
                allocation_size: 4,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let chosen = pref.container_responses[0].device_i_ds.clone();
    assert_eq!(chosen.len(), 4);
    let r = c
        .allocate(AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: chosen }] })
        .await
        .unwrap()
        .into_inner();
    let visible = &r.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"];
    assert_eq!(visible.split(',').count(), 4);
    // /metrics shows the DCGM-style series of the 8 fake GPUs, without pod labels (no pod-resources)
    let mut page = String::new();
    for _ in 0..100 {
        if let Ok((200, _, body)) = http_get(metrics_addr, "/metrics").await {
            if body.contains("gpuplace_podresources_errors_total{Hostname=\"cli-node\",reason=\"socket_missing\"} 1") {
                page = body;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for name in ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_TEMP"]
        .into_iter()
        .chain(["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_XID_ERRORS"])
    {
        let n = page
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{gpu=")) && l.contains("Hostname=\"cli-node\""))
            .count();
        assert_eq!(n, 8, "{name} in:\n{page}");
    }
    // kubelet restarts: the binary registers again
    kubelet.stop().await;
    let _ = std::fs::remove_file(dir.path().join(&reg.endpoint));
    kubelet = FakeKubelet::start(dir.path());
    assert_eq!(kubelet.next_registration().await.endpoint, reg.endpoint);
    // SIGTERM (what the kubelet's pod teardown sends): a clean exit that removes our socket
    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || {
        let mut child = child;
        let s = child.0.wait();
        (s, child)
    });
    let (status, _child) = tokio::time::timeout(Duration::from_secs(10), status).await.unwrap().unwrap();
    assert!(status.unwrap().success());
    assert!(!dir.path().join(&reg.endpoint).exists());
}

/// The binary against the fake API server (`--apiserver URL`): it writes the node's capacity and
/// inventory, removes an older version's utilization annotation, publishes utilization to its
/// ConfigMap, and Allocate applies a pod's assignment and marks it.
#[tokio::test]
async fn binary_with_an_api_server_writes_the_node_and_applies_assignments() {
    use gpuplace_core::annotations::{AssignmentAnnotation, ANNOTATION_ALLOCATED, ANNOTATION_ASSIGNMENT};
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_device_plugin::k8s::inventory::cluster_node;
    use gpuplace_device_plugin::nvml::fake::FakeBackend;
    use gpuplace_device_plugin::nvml::GpuBackend;
    use gpuplace_testkit::apiserver::FakeApiServer;
    use k8s_openapi::api::core::v1::{Binding, Container, Node, ObjectReference, Pod, PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::ResourceExt;

    const NODE: &str = "cli-api-node";
    let fake = FakeApiServer::start().await.unwrap();
    // what an older plugin left: removed at start
    let stale = [("gpuplace.io/utilization".to_string(), r#"{"version":1,"atUnixMs":1,"gpus":[]}"#.to_string())];
    let node = ObjectMeta { name: Some(NODE.into()), annotations: Some(stale.into()), ..Default::default() };
    fake.put(&Node { metadata: node, ..Default::default() });
    // without a node name there is nothing to select pods by: a clear error, not a standalone plugin
    let out = Command::new(BIN)
        .args(["--fake-topology"])
        .arg(topology("hgx-h100-8"))
        .args(["--apiserver", &fake.url()])
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-name"), "{}", String::from_utf8_lossy(&out.stderr));

    let dir = tempfile::Builder::new().prefix("gdp").tempdir().unwrap();
    let mut kubelet = FakeKubelet::start(dir.path());
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let _child = Child(
        serve(dir.path(), metrics_addr)
            .args(["--apiserver", &fake.url(), "--utilization-namespace", "gpuplace-test"])
            .env("NODE_NAME", NODE)
            .spawn()
            .unwrap(),
    );
    let reg = kubelet.next_registration().await;
    let node_has = |f: &FakeApiServer| {
        let n: Node = f.get("", NODE).unwrap();
        let cap = n.status.and_then(|s| s.capacity).unwrap_or_default();
        let ann = n.metadata.annotations.unwrap_or_default();
        cap.get("gpuplace.io/gpu-core").is_some_and(|q| q.0 == "800")
            && cap.get("gpuplace.io/gpu-mem").is_some_and(|q| q.0 == (8 * 81559).to_string())
            && ann.get("gpuplace.io/inventory").is_some_and(|t| t.contains(r#""slotsPerGpu":2"#))
            && !ann.contains_key("gpuplace.io/utilization")
    };
    assert!(fake.wait_until(Duration::from_secs(10), node_has).await, "{:?}", fake.get::<Node>("", NODE));
    // utilization: in the ConfigMap of the namespace given, all 8 GPUs of the first sweep
    let published = |f: &FakeApiServer| {
        let cm: Option<k8s_openapi::api::core::v1::ConfigMap> =
            f.get("gpuplace-test", "gpuplace-utilization-cli-api-node");
        cm.and_then(|c| c.data).and_then(|d| d.get("utilization").cloned()).is_some_and(|t| {
            gpuplace_core::annotations::UtilizationAnnotation::parse(&t).is_ok_and(|u| u.gpus.len() == 8)
        })
    };
    assert!(fake.wait_until(Duration::from_secs(10), published).await, "utilization ConfigMap");

    // a pod bound with the extender's assignment: GPU 6, a 25 % share
    let limits = [("gpuplace.io/gpu", "1"), ("gpuplace.io/gpu-mem", "20480"), ("gpuplace.io/gpu-core", "25")];
    let pod = Pod {
        metadata: ObjectMeta { name: Some("p".into()), namespace: Some("ns".into()), ..Default::default() },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".into(),
                resources: Some(ResourceRequirements {
                    limits: Some(limits.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let uid = fake.put(&pod).uid().unwrap();
    let model =
        cluster_node(&FakeBackend::load(&topology("hgx-h100-8"), NODE).unwrap().inventory().unwrap(), NODE, 2).unwrap();
    let record = PodAssignment {
        pod: "ns/p".into(),
        node: NODE.into(),
        containers: vec![ContainerAssignment {
            name: "main".into(),
            init: false,
            slices: vec![GpuSlice { gpu: 6, mem_mib: 20480, core_pct: 25, exclusive: false }],
        }],
        cpu_milli: 0,
        memory_mib: 0,
        group: None,
    };
    // the extender's leader publishes its public keys (after the plugin started: the plugin reads
    // them when the first signature names a key it has not loaded)
    fake.put(&public_keys_configmap());
    let ann =
        AssignmentAnnotation::from_assignment(&record, &uid, &model, 1).unwrap().signed(&assignment_keys()).to_json();
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some("p".into()),
            annotations: Some([(ANNOTATION_ASSIGNMENT.to_string(), ann)].into()),
            ..Default::default()
        },
        target: ObjectReference { kind: Some("Node".into()), name: Some(NODE.into()), ..Default::default() },
    };
    let pods: kube::Api<Pod> = kube::Api::namespaced(fake.client().unwrap(), "ns");
    let _: serde_json::Value =
        pods.create_subresource("binding", "p", &kube::api::PostParams::default(), &binding).await.unwrap();

    let mut c = DevicePluginClient::new(connect_unix(&dir.path().join(&reg.endpoint)).await.unwrap());
    let mut stream = c.list_and_watch(Empty {}).await.unwrap().into_inner();
    let devices =
        tokio::time::timeout(Duration::from_secs(10), stream.message()).await.unwrap().unwrap().unwrap().devices;
    let pref = c
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: devices.into_iter().map(|d| d.id).collect(),
                must_include_device_i_ds: vec![],
                allocation_size: 1,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let chosen = pref.container_responses[0].device_i_ds.clone();
    assert_eq!(chosen, vec![format!("{}::0", model.gpus[6].uuid)], "the assigned GPU is preferred");
    let r = c
        .allocate(AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: chosen }] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.container_responses[0].envs["GPUPLACE_POD"], "ns/p");
    assert_eq!(r.container_responses[0].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    let marked: Pod = fake.get("ns", "p").unwrap();
    assert!(marked.annotations()[ANNOTATION_ALLOCATED].contains(r#""containers":["main"]"#));
    // API errors are exported (none so far)
    let (_, _, page) = http_get(metrics_addr, "/metrics").await.unwrap();
    assert!(page.contains("gpuplace_apiserver_errors_total{Hostname=\"cli-api-node\",op=\"pod_patch\"} 0"), "{page}");
}

/// The `args:` items of the first container in a manifest's text, commented-out items (`# - --x`,
/// options the manifest offers to switch on) included.
fn manifest_args(text: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| l.trim() != "args:");
    let Some(head) = lines.next() else { return Vec::new() };
    let indent = head.len() - head.trim_start().len();
    let mut out = Vec::new();
    for l in lines {
        let t = l.trim_start();
        let at = l.len() - t.len();
        let item = t
            .strip_prefix("- ")
            .or_else(|| t.strip_prefix('#').map(str::trim_start).and_then(|c| c.strip_prefix("- ")));
        match item {
            Some(v) if at >= indent => out.push(v.trim().trim_matches('"').to_string()),
            _ if t.starts_with('#') && at >= indent => {}
            _ => break,
        }
    }
    out
}

/// Every option in the DaemonSet's `args:`, the commented-out ones switched on, parses with the
/// binary's own definitions, after the subcommand as the manifest writes them; so do options the
/// troubleshooting advice adds after `serve` (`--slots-per-gpu`), and options before it.
#[test]
fn the_daemonset_args_parse_uncommented_and_on_either_side_of_the_subcommand() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scheduler-config/device-plugin/daemonset.yaml");
    let args = manifest_args(&std::fs::read_to_string(&path).unwrap());
    assert_eq!(args.first().map(String::as_str), Some("serve"), "{args:?}");
    assert!(args.iter().any(|a| a == "--no-assignments"), "the commented option is read: {args:?}");
    let parses = |args: &[&str]| {
        let out = Command::new(BIN).args(args).arg("--help").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success() && !err.contains("error:"), err)
    };
    let listed: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, err) = parses(&listed);
    assert!(ok, "{listed:?}: {err}");
    for extra in [
        &["serve", "--slots-per-gpu", "20", "--no-assignments"][..],
        &["--slots-per-gpu", "20", "serve"],
        &["serve", "--kubeconfig", "/dev/null", "--metrics-listen", "0.0.0.0:9400", "--sample-interval", "1s"],
        &["discover", "--json", "--fake-topology", "x.json"],
    ] {
        let (ok, err) = parses(extra);
        assert!(ok, "{extra:?}: {err}");
    }
    // still refused: an unknown option, on either side
    assert!(!parses(&["serve", "--no-such-flag"]).0);
    assert!(!parses(&["--no-such-flag", "serve"]).0);
}

/// The binary serving the fake node without kubelet or API server, stderr piped as under kubelet:
/// its log lines (startup, and registration retries: there is no kubelet), read after a SIGTERM.
async fn serve_log(args: &[&str]) -> String {
    use std::io::Read;

    let dir = tempfile::Builder::new().prefix("gdplog").tempdir().unwrap();
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut child = Child(
        Command::new(BIN)
            .args(args)
            .arg("--fake-topology")
            .arg(topology("hgx-h100-8"))
            .args(["--no-apiserver", "--node-name", "log-node"])
            .arg("--device-plugin-dir")
            .arg(dir.path())
            .args(["--metrics-listen", &metrics_addr.to_string()])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = child.0.stderr.take().unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !http_get(metrics_addr, "/metrics").await.is_ok_and(|r| r.0 == 200) {
        assert!(std::time::Instant::now() < until, "no /metrics");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let _ = child.0.wait();
    let mut log = String::new();
    stderr.read_to_string(&mut log).unwrap();
    log
}

/// Logs to a pipe carry no ANSI colour codes; `--log-format json` writes one JSON object per line
/// with the level and the event's fields, the flag on either side of the subcommand.
#[tokio::test]
async fn logs_are_plain_text_to_a_pipe_and_json_when_asked() {
    let log = serve_log(&["serve"]).await;
    assert!(log.lines().any(|l| l.contains(" INFO ")), "no log line:\n{log}");
    assert!(!log.contains("\x1b["), "ANSI escapes in a piped log:\n{log:?}");
    for args in [&["serve", "--log-format", "json"][..], &["--log-format", "json", "serve"]] {
        let log = serve_log(args).await;
        let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "{args:?}: no log line");
        for l in lines {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {l}"));
            assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{l}");
        }
    }
}
