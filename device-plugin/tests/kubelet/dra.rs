//! DRA mode's node side as kubelet drives it, over the real gRPC stack on unix sockets: the plugin
//! watcher's GetInfo and NotifyRegistrationStatus on the registration socket, then
//! NodePrepareResources and NodeUnprepareResources on the endpoint it names, with claims from an
//! in-memory [`ClaimSource`] and CDI specs in a temp folder.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuplace_device_plugin::dra::kubelet::{serve, ClaimSource, DraConfig, DraNode};
use gpuplace_device_plugin::kubelet_api::dra::dra_plugin_client::DraPluginClient;
use gpuplace_device_plugin::kubelet_api::dra::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use gpuplace_device_plugin::kubelet_api::dra_health::dra_resource_health_client::DraResourceHealthClient;
use gpuplace_device_plugin::kubelet_api::dra_health::{HealthStatus, NodeWatchResourcesRequest};
use gpuplace_device_plugin::kubelet_api::pluginregistration::registration_client::RegistrationClient;
use gpuplace_device_plugin::kubelet_api::pluginregistration::{InfoRequest, RegistrationStatus};
use gpuplace_device_plugin::nvml::fake::{FakeBackend, Fault};
use gpuplace_device_plugin::nvml::GpuBackend;
use gpuplace_device_plugin::plugin::service::spawn_health_monitor;
use gpuplace_device_plugin::plugin::{Plugin, PluginConfig};
use gpuplace_device_plugin::sampler::Telemetry;
use gpuplace_device_plugin::unix_socket::connect_unix;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

use crate::common::{topology, WAIT};

const DRIVER: &str = "gpu.gpuplace.io";
const NODE: &str = "n1";

#[derive(Default)]
struct Claims(Mutex<HashMap<(String, String), ResourceClaim>>);

#[tonic::async_trait]
impl ClaimSource for Claims {
    async fn claim(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        if name == "unreadable" {
            return Err("the API server answered 503".into());
        }
        Ok(self.0.lock().unwrap().get(&(namespace.to_string(), name.to_string())).cloned())
    }
}

/// One allocated device of this node: request, device, consumed memory and cores.
type Allocated<'a> = (&'a str, &'a str, Option<(&'a str, &'a str)>);

/// A claim of namespace `ns` allocated `devices`.
fn claim(name: &str, uid: &str, devices: &[Allocated]) -> ResourceClaim {
    let results: Vec<Value> = devices
        .iter()
        .enumerate()
        .map(|(i, (req, dev, consumed))| {
            let mut r = json!({"request": req, "driver": DRIVER, "pool": NODE, "device": dev,
                               "shareID": format!("0b0e0c0a-0000-4000-8000-00000000000{i}")});
            if let Some((m, c)) = consumed {
                r["consumedCapacity"] = json!({"memory": m, "cores": c, "shares": "1"});
            }
            r
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results}}},
    }))
    .unwrap()
}

fn env_of(spec: &Value) -> BTreeMap<String, String> {
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

async fn wait_for(path: &std::path::Path) {
    let until = tokio::time::Instant::now() + WAIT;
    while !path.exists() {
        assert!(tokio::time::Instant::now() < until, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn kubelet_registers_the_driver_and_prepares_claims_into_cdi_specs() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = Arc::new(FakeBackend::load(&topology("hgx-h100-8"), NODE).unwrap());
    let inventory = backend.inventory().unwrap();
    let plugin = Plugin::new(PluginConfig::default(), &inventory, None).unwrap();
    let stop_health = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let monitor = spawn_health_monitor(plugin.clone(), backend.clone(), stop_health.clone()).unwrap();
    let claims = Arc::new(Claims::default());
    let cfg = DraConfig {
        driver: DRIVER.into(),
        node: NODE.into(),
        registry_dir: tmp.path().join("plugins_registry"),
        plugins_dir: tmp.path().join("plugins"),
        cdi_dir: tmp.path().join("cdi"),
        mps_pipe_dir: Some("/run/nvidia/mps".into()),
        mps_shm_dir: None,
        poll_interval: Duration::from_millis(50),
    };
    let telemetry = Telemetry::new(inventory.gpus.len(), false);
    let node = DraNode::new(cfg.clone(), inventory.clone(), plugin.clone(), claims.clone(), telemetry.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        node.clone(),
        Box::pin(async move {
            let _ = stop_rx.await;
        }),
    ));

    // the plugin watcher: GetInfo on the registration socket, then the verdict
    let reg_sock = cfg.registry_dir.join(format!("{DRIVER}-reg.sock"));
    wait_for(&reg_sock).await;
    let mut reg = RegistrationClient::new(connect_unix(&reg_sock).await.unwrap());
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.r#type.as_str(), info.name.as_str()), ("DRAPlugin", DRIVER));
    assert_eq!(info.supported_versions, ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"]);
    let endpoint = std::path::PathBuf::from(&info.endpoint);
    assert_eq!(endpoint, cfg.plugins_dir.join(DRIVER).join("dra.sock"));
    reg.notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() }).await.unwrap();
    assert_eq!(node.registrations(), 1);

    // kubelet prepares a share, a pair and three claims that cannot be prepared, in one call
    {
        let mut m = claims.0.lock().unwrap();
        for c in [
            claim("share", "u-share", &[("gpu", "gpu-4", Some(("20000Mi", "25")))]),
            claim(
                "pair",
                "u-pair",
                &[("gpus", "gpu-7", Some(("81559Mi", "100"))), ("gpus", "gpu-6", Some(("81559Mi", "100")))],
            ),
            claim("sick", "u-sick", &[("gpu", "gpu-3", None)]),
            claim("elsewhere", "u-else", &[("gpu", "gpu-9", None)]),
        ] {
            m.insert(("ns".into(), c.metadata.name.clone().unwrap()), c);
        }
    }
    backend.inject(3, Fault::FallOffBus).unwrap();
    let until = tokio::time::Instant::now() + WAIT;
    while plugin.health()[3].healthy {
        assert!(tokio::time::Instant::now() < until, "GPU 3 never turned unhealthy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut dra = DraPluginClient::new(connect_unix(&endpoint).await.unwrap());
    // the resource health stream on the same socket: every GPU, GPU 3 unhealthy
    let mut health = DraResourceHealthClient::new(connect_unix(&endpoint).await.unwrap());
    let mut stream = health.node_watch_resources(NodeWatchResourcesRequest {}).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("a first health message");
    let states: Vec<(String, i32)> =
        first.devices.iter().map(|d| (d.device.as_ref().unwrap().device_name.clone(), d.health)).collect();
    assert_eq!(states.len(), 8);
    assert!(first.devices.iter().all(|d| d.device.as_ref().unwrap().pool_name == NODE && d.last_updated_time > 0));
    for (name, h) in &states {
        let want = if name == "gpu-3" { HealthStatus::Unhealthy } else { HealthStatus::Healthy };
        assert_eq!(*h, want as i32, "{name}");
    }
    let c = |name: &str, uid: &str| Claim { namespace: "ns".into(), uid: uid.into(), name: name.into() };
    let resp = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![
                c("share", "u-share"),
                c("pair", "u-pair"),
                c("sick", "u-sick"),
                c("elsewhere", "u-else"),
                c("gone", "u-gone"),
                c("unreadable", "u-unread"),
                c("share", "u-old-share"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 7, "every claim gets an entry");
    let share = &resp.claims["u-share"];
    assert!(share.error.is_empty(), "{}", share.error);
    assert_eq!(share.devices.len(), 1);
    assert_eq!((share.devices[0].pool_name.as_str(), share.devices[0].device_name.as_str()), (NODE, "gpu-4"));
    assert_eq!(share.devices[0].cdi_device_ids, ["gpu.gpuplace.io/claim=u-share-gpu"]);
    let pair = &resp.claims["u-pair"];
    assert_eq!(pair.devices.iter().map(|d| d.cdi_device_ids.len()).collect::<Vec<_>>(), [1, 0]);
    for (uid, want) in [
        ("u-sick", "claim ns/sick: GPU 3 (gpu-3) is unhealthy"),
        ("u-else", "claim ns/elsewhere: device gpu-9 is not a GPU of node n1"),
        ("u-gone", "claim ns/gone does not exist"),
        ("u-unread", "reading claim ns/unreadable: the API server answered 503"),
        ("u-old-share", "claim ns/share has UID u-share, not u-old-share"),
    ] {
        let e = &resp.claims[uid];
        assert!(e.error.starts_with(want) && e.devices.is_empty(), "{uid}: {:?}", e.error);
    }

    // the CDI specs hold the contract's environment
    let spec_of = |uid: &str| -> Value {
        let p = cfg.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
    };
    let s = spec_of("u-share");
    assert_eq!((s["cdiVersion"].as_str(), s["kind"].as_str()), (Some("0.6.0"), Some("gpu.gpuplace.io/claim")));
    assert_eq!(s["devices"][0]["name"], "u-share-gpu");
    let env = env_of(&s);
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], inventory.gpus[4].uuid);
    assert_eq!((env["GPUPLACE_GPU_MEM_MIB"].as_str(), env["GPUPLACE_GPU_CORE_PCT"].as_str()), ("20000", "25"));
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia/mps");
    let env = env_of(&spec_of("u-pair"));
    assert_eq!((env["GPUPLACE_GPU_INDICES"].as_str(), env["GPUPLACE_EXCLUSIVE"].as_str()), ("6,7", "true"));
    assert_eq!(std::fs::read_dir(&cfg.cdi_dir).unwrap().count(), 2, "no spec for a claim that failed");
    assert_eq!(node.prepared_claims().unwrap(), ["u-pair", "u-share"]);

    // prepare again (kubelet repeats calls): the same answer, the same spec
    let again = dra
        .node_prepare_resources(NodePrepareResourcesRequest { claims: vec![c("share", "u-share")] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims["u-share"], resp.claims["u-share"]);

    // counted for /metrics: 2 prepared and 5 refused so far, then the repeat
    let metrics =
        gpuplace_device_plugin::metrics::render("n1", &[], &[], &Default::default(), &telemetry.snapshot(), true);
    for line in [
        "gpuplace_dra_claims_total{Hostname=\"n1\",outcome=\"prepared\"} 3",
        "gpuplace_dra_claims_total{Hostname=\"n1\",outcome=\"refused\"} 5",
        "gpuplace_dra_registrations_total{Hostname=\"n1\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }

    // unprepare removes the spec; twice is fine
    for _ in 0..2 {
        let r = dra
            .node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![c("share", "u-share")] })
            .await
            .unwrap()
            .into_inner();
        assert!(r.claims["u-share"].error.is_empty());
    }
    assert!(!cfg.cdi_dir.join(format!("{DRIVER}-claim_u-share.json")).exists());
    assert_eq!(node.prepared_claims().unwrap(), ["u-pair"]);

    // a recovered GPU is reported healthy on the open stream
    backend.inject(3, Fault::Recover).unwrap();
    let until = tokio::time::Instant::now() + WAIT;
    loop {
        let m = tokio::time::timeout(WAIT, stream.message()).await.expect("a health update").unwrap().unwrap();
        if m.devices.iter().all(|d| d.health == HealthStatus::Healthy as i32) {
            break;
        }
        assert!(tokio::time::Instant::now() < until, "GPU 3 never reported healthy again");
    }

    // a removed registration socket is served again, and kubelet finds the driver there
    std::fs::remove_file(&reg_sock).unwrap();
    wait_for(&reg_sock).await;
    let mut reg = RegistrationClient::new(connect_unix(&reg_sock).await.unwrap());
    assert_eq!(reg.get_info(InfoRequest {}).await.unwrap().into_inner().name, DRIVER);

    // stopping removes both sockets (kubelet then deregisters the driver); the specs stay
    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(!reg_sock.exists() && !endpoint.exists());
    assert!(cfg.cdi_dir.join(format!("{DRIVER}-claim_u-pair.json")).exists());
    stop_health.store(true, std::sync::atomic::Ordering::Relaxed);
    monitor.join().unwrap();
}
