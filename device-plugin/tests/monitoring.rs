//! Every PromQL expression of scheduler-config/monitoring/ (the Grafana dashboard's panels and
//! template variables, the Prometheus rules) names only series that the binaries really serve on
//! `/metrics`, with only labels those series carry. Here rather than in the root crate because the
//! DCGM series' pod labels need kubelet's pod-resources, which only this crate fakes.
//!
//! Three processes run for real: `gpuplace serve` in static mode (driven with kube-scheduler's
//! recorded filter, prioritize, bind and preempt requests, so that per-pod and pending-pod series
//! exist), `gpuplace serve` in API-server mode (watch, leader and requeue series), both against or
//! beside the in-process fake API server, and `gpuplace-device-plugin` with its fake backend, that
//! API server and a fake pod-resources server naming a pod on GPU 0. The static extender and the
//! plugin run with `--metrics-pod-series` (off by default; issue 48), which the dashboard's per-pod
//! panels need.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::kubelet::FakePodResources;
use common::topology;
use gpuplace::extender::{http_client, pki};
use gpuplace_device_plugin::kubelet_api::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuplace_device_plugin::nvml::fake::FakeBackend;
use gpuplace_device_plugin::nvml::GpuBackend;
use gpuplace_device_plugin::slots::slot_id;
use gpuplace_testkit::apiserver::FakeApiServer;
use promql_check::{check, check_label_values, dashboard, dashboard_exprs, rules, scan, variable_queries, Exported};

#[path = "../../tests/support/promql_check.rs"]
mod promql_check;

/// The workspace root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A child process, killed and reaped when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port")
}

/// The extender's binary: another package's, so it has no `CARGO_BIN_EXE_` here; it sits beside
/// this package's after `cargo test --workspace` (as the e2e suite finds it). Refused when missing
/// or older than the root crate's sources, rather than checking the metrics of an old build.
fn gpuplace_bin() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_gpuplace-device-plugin")).with_file_name("gpuplace");
    let hint = "run `cargo test --workspace`, or `cargo build --profile test -p gpuplace --bin gpuplace` first";
    let built =
        std::fs::metadata(&bin).and_then(|m| m.modified()).unwrap_or_else(|e| panic!("{}: {e}; {hint}", bin.display()));
    let mut newest = Vec::new();
    rust_sources(&repo().join("src"), &mut newest);
    newest.extend(["Cargo.toml", "Cargo.lock"].map(|f| repo().join(f)));
    for f in newest {
        let changed = std::fs::metadata(&f).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
        assert!(changed <= built, "{} is older than {}; {hint}", bin.display(), f.display());
    }
    bin
}

/// Every `.rs` file under `dir`.
fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap_or_else(|e| panic!("{}: {e}", dir.display())).path();
        if p.is_dir() {
            rust_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `/metrics` of `addr` once `ready` holds for it.
fn scrape_when(addr: SocketAddr, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < until {
        if let Ok(r) = http_client::request(&addr.to_string(), "GET", "/metrics", b"", Duration::from_secs(5)) {
            let page = r.text();
            if r.status == 200 && ready(&page) {
                return page;
            }
            last = page;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: /metrics never got there; last page:\n{last}");
}

fn fixture(rel: &str) -> Vec<u8> {
    let p = repo().join("../shared/fixtures/kube-scheduler-v1.36").join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// One scrape of each process, with traffic enough that every family queried has samples.
async fn scrape_all() -> Exported {
    const NODE: &str = "mon-node";
    let gpuplace = gpuplace_bin();
    let fake = FakeApiServer::start().await.expect("fake API server");
    let node = k8s_openapi::api::core::v1::Node {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(NODE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    fake.put(&node);
    let dir = tempfile::Builder::new().prefix("gdpmon").tempdir().expect("temp dir");
    // kubelet's pod-resources: a pod's container holds a slot of GPU 0
    let uuid = FakeBackend::load(&topology("hgx-h100-8"), NODE).unwrap().inventory().unwrap().gpus[0].uuid.clone();
    let holder = PodResources {
        name: "train".into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: "gpuplace.io/gpu".into(),
                device_ids: vec![slot_id(&uuid, 0)],
                topology: None,
            }],
            ..Default::default()
        }],
    };
    let socket = dir.path().join("pod-resources.sock");
    let _pod_resources =
        FakePodResources::start(&socket, ListPodResourcesResponse { pod_resources: vec![holder] }).unwrap();

    let (static_addr, api_addr, plugin_addr) = (free_addr(), free_addr(), free_addr());
    // the static extender serves the verbs over mTLS, as the default install does, so that the
    // client-certificate series exist; /metrics from its metrics port
    let static_metrics = free_addr();
    let now = std::time::SystemTime::now();
    let ca = pki::Ca::generate(now).expect("a CA");
    let server = ca.issue(&pki::Leaf::replica(vec!["127.0.0.1".into()]), now, pki::LEAF_VALIDITY).expect("server");
    let client = ca.issue(&pki::Leaf::scheduler(), now, pki::LEAF_VALIDITY).expect("client");
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write a PEM file");
        p
    };
    let (ca_file, server_cert, server_key) =
        (file("ca.crt", &ca.cert_pem), file("tls.crt", &server.cert_pem), file("tls.key", &server.key_pem));
    let (client_cert, client_key) = (file("client.crt", &client.cert_pem), file("client.key", &client.key_pem));
    let client_tls = std::sync::Arc::new(
        gpuplace::extender::tls::client_config(Some(&ca_file), Some((&client_cert, &client_key))).expect("client TLS"),
    );
    let quiet = |c: &mut Command| {
        c.env_remove("RUST_LOG").stdout(Stdio::null()).stderr(Stdio::null());
    };
    let mut c = Command::new(&gpuplace);
    c.arg("serve")
        .arg("--cluster")
        .arg(repo().join("examples/clusters/fixture-cluster.yaml"))
        .args(["--listen", &static_addr.to_string(), "--metrics-listen", &static_metrics.to_string()])
        // the per-pod series the dashboard's per-pod panels query, off by default
        .arg("--metrics-pod-series")
        .arg("--tls-cert")
        .arg(&server_cert)
        .arg("--tls-key")
        .arg(&server_key)
        .arg("--tls-client-ca")
        .arg(&ca_file);
    quiet(&mut c);
    let _static = Proc(c.spawn().expect("gpuplace serve --cluster"));
    let mut c = Command::new(&gpuplace);
    c.args(["serve", "--apiserver", &fake.url(), "--listen", &api_addr.to_string(), "--workers", "1"]).args([
        "--leader-elect-identity",
        "mon",
        "--leader-elect-namespace",
        "gpuplace-system",
    ]);
    quiet(&mut c);
    let _api = Proc(c.spawn().expect("gpuplace serve --apiserver"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpuplace-device-plugin"));
    c.arg("--fake-topology")
        .arg(topology("hgx-h100-8"))
        .args(["--node-name", NODE, "--apiserver", &fake.url()])
        .arg("--device-plugin-dir")
        .arg(dir.path())
        .arg("--pod-resources-socket")
        .arg(&socket)
        .args(["--metrics-listen", &plugin_addr.to_string(), "--sample-interval", "100ms"])
        .arg("--metrics-pod-series")
        // managed MPS exports its series (the daemon's binary is missing here: reported down)
        .arg("--mps-daemon")
        .arg("--mps-root")
        .arg(dir.path().join("mps"))
        .arg("--mps-control-binary")
        .arg(dir.path().join("no-nvidia-cuda-mps-control"));
    quiet(&mut c);
    let _plugin = Proc(c.spawn().expect("gpuplace-device-plugin"));

    // kube-scheduler's recorded traffic: a 4-GPU pod filtered and bound, a preemption, and two pods
    // whose requests break the contract (pending, class contract): `c-frac` and `c-memonly` ask for
    // gpu-mem (and gpu-core) without `gpuplace.io/gpu`, so c-frac's recorded bind is refused too
    scrape_when(static_metrics, "static extender", |p| p.contains("gpuplace_ready 1"));
    for rel in [
        "cache/filter-001",
        "cache/prioritize-001",
        "cache/bind-001",
        "cache/filter-002",
        "cache/bind-002",
        "cache/filter-004",
        "cache/preempt-001",
    ] {
        let verb = rel.split(['/', '-']).nth(1).unwrap_or_default();
        let body = fixture(&format!("{rel}.request.json"));
        let path = format!("/gpuplace/{verb}");
        let url = format!("https://{static_addr}{path}");
        let r = http_client::request_tls(&url, "POST", &body, Duration::from_secs(10), client_tls.clone(), None)
            .unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(r.status, 200, "{rel}: {}", r.text());
    }
    let mut exported = Exported::default();
    exported.add(&scrape_when(static_metrics, "static extender", |p| {
        p.contains("gpuplace_pod_gpu_memory_allocated_mib{")
            && p.contains("gpuplace_client_certificate_expiry_timestamp_seconds{subject=\"gpuplace:kube-scheduler\"}")
            && p.contains("gpuplace_pending_pods{reason=\"contract\"} 2\n")
    }));
    exported.add(&scrape_when(api_addr, "API-server-mode extender", |p| {
        p.contains("gpuplace_leader 1")
            && ["nodes", "pods", "configmaps"]
                .iter()
                .all(|r| p.contains(&format!("gpuplace_watch_staleness_seconds{{resource=\"{r}\"}}")))
    }));
    exported.add(&scrape_when(plugin_addr, "device plugin", |p| {
        p.contains("gpuplace_podresources_up{Hostname=\"mon-node\"} 1")
            && p.contains("pod=\"train\"")
            && p.contains("gpuplace_apiserver_errors_total{")
            // exported once the node pass has read the counts of earlier runs
            && p.contains("gpuplace_allocation_mismatches_total{")
    }));
    exported
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_rules_query_only_series_the_binaries_export() {
    let exported = scrape_all().await;
    let d = dashboard(&repo());
    let mut exprs = Vec::new();
    dashboard_exprs(&d, &mut exprs);
    assert!(exprs.len() >= 20, "the dashboard has only {} queries", exprs.len());
    let mut problems: Vec<String> = exprs.iter().flat_map(|e| check(e, &exported)).collect();
    let vars = variable_queries(&d);
    assert!(!vars.is_empty(), "no query variable");
    problems.extend(vars.iter().flat_map(|q| check_label_values(q, &exported)));
    let rules = rules(&repo());
    assert!(rules.len() >= 10, "only {} rules", rules.len());
    for (name, expr) in &rules {
        problems.extend(check(expr, &exported).into_iter().map(|p| format!("rule {name}: {p}")));
    }
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));

    // what the issue asks to see is queried somewhere
    let named: BTreeSet<String> = exprs
        .iter()
        .chain(rules.iter().map(|(_, e)| e))
        .flat_map(|e| scan(e).map(|r| r.metrics).unwrap_or_default())
        .map(|m| m.0)
        .collect();
    for want in [
        "gpuplace_gpu_memory_allocated_mib",
        "gpuplace_gpu_memory_used_mib",
        "gpuplace_gpu_core_allocated_percent",
        "gpuplace_gpu_core_used_percent",
        "gpuplace_pod_gpu_memory_allocated_mib",
        "DCGM_FI_DEV_GPU_UTIL",
        "gpuplace_fragmentation_ratio",
        "gpuplace_pending_pods",
        "gpuplace_request_duration_seconds_bucket",
        "gpuplace_bind_failures_total",
        "gpuplace_watch_staleness_seconds",
        "gpuplace_allocation_mismatches_total",
        "gpuplace_gpu_xid_errors_total",
        "DCGM_FI_DEV_XID_ERRORS",
    ] {
        assert!(named.contains(want), "nothing queries {want}");
    }

    // and the check fails where it should: a misspelt series, a label no series of the expression
    // has, a label the selected series lacks, a function that makes up labels
    for wrong in [
        "histogram_quantile(0.99, sum by (verb, le) (rate(gpuplace_request_duration_second_bucket[5m])))",
        "sum by (nodename) (gpuplace_pod_gpu_memory_allocated_mib)",
        "gpuplace_gpu_memory_used_mib{node=\"x\"}",
        "label_replace(gpuplace_gpus, \"a\", \"$1\", \"state\", \"(.*)\")",
    ] {
        assert!(!check(wrong, &exported).is_empty(), "the check passed {wrong}");
    }
    assert!(!check_label_values("label_values(gpuplace_gpu_healthy, node)", &exported).is_empty());
}
