//! Issue 48, item 2, for the device plugin: no tenant can exhaust its `/metrics` port (9400).
//!
//! The binary serves the fake `hgx-h100-8` node to the test kubelet under the open-file limit a
//! container gets by default (1024, soft and hard). Against its metrics port: 2,000 idle
//! connections, 1,200 sending half a request line, and a recycling flood (connections opened and
//! reset as fast as they go). Meanwhile what the kubelet needs must keep answering, every time
//! within a second: the plugin's gRPC service over its unix socket, on the kubelet's connection and
//! on a new one each time (a new connection needs a descriptor). The plugin holds at most
//! `--metrics-max-connections` (64) metrics connections, never 1,024 descriptors, never logs `Too
//! many open files`, closes idle and slow connections after 2 s, and answers `/metrics` again once
//! the flood is gone. Everything on loopback, bounded in count and time (about 25 s).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::kubelet::http_get;
use common::{topology, FakeKubelet};
use flood::{closes_after, open_fds, open_many, recycle, Answers, Reap, CONTAINER_NOFILE};
use gpuplace_device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use gpuplace_device_plugin::kubelet_api::v1beta1::Empty;
use gpuplace_device_plugin::unix_socket::connect_unix;

#[path = "../../tests/support/flood.rs"]
mod flood;

const WATCH: Duration = Duration::from_secs(4);
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

type Client = DevicePluginClient<tonic::transport::Channel>;

/// What the kubelet got while a flood was held: its connection's calls, and new connections' calls.
#[derive(Default)]
struct Watched {
    kubelet: Answers,
    fresh: Answers,
    peak_fds: usize,
}

/// The kubelet's calls every 100 ms for `how_long`, each within [`ANSWER_WITHIN`].
async fn watch(pid: u32, c: &mut Client, socket: &std::path::Path, how_long: Duration) -> Watched {
    let mut w = Watched::default();
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        let t = Instant::now();
        let r = tokio::time::timeout(ANSWER_WITHIN, c.get_device_plugin_options(Empty {})).await;
        w.kubelet.record(
            "GetDevicePluginOptions",
            t,
            r.map_err(|e| e.to_string()).and_then(|r| r.map(|_| ()).map_err(|e| e.to_string())),
        );
        let t = Instant::now();
        let fresh = async {
            let mut c = DevicePluginClient::new(connect_unix(socket).await.map_err(|e| e.to_string())?);
            c.get_device_plugin_options(Empty {}).await.map(|_| ()).map_err(|e| e.to_string())
        };
        let r = tokio::time::timeout(ANSWER_WITHIN, fresh).await.map_err(|e| e.to_string()).and_then(|r| r);
        w.fresh.record("GetDevicePluginOptions on a new connection", t, r);
        w.peak_fds = w.peak_fds.max(open_fds(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w
}

fn judge(phase: &str, flood: &str, w: &Watched) {
    println!(
        "figure: device plugin, {phase}: {flood}; the kubelet's connection {}; new connections {}; the plugin's descriptors at most {}",
        w.kubelet.summary(),
        w.fresh.summary(),
        w.peak_fds
    );
    assert!(w.kubelet.failures.is_empty(), "{phase}: {:#?}", w.kubelet.failures);
    assert!(w.fresh.failures.is_empty(), "{phase}: {:#?}", w.fresh.failures);
    assert!(w.kubelet.worst() < ANSWER_WITHIN && !w.kubelet.latencies.is_empty());
    assert!((w.peak_fds as u64) < CONTAINER_NOFILE, "{phase}: the plugin held {} descriptors", w.peak_fds);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_on_the_metrics_port_never_starve_the_kubelets_calls() {
    flood::raise_own_limit(3_000);
    let dir = tempfile::Builder::new().prefix("gdpports").tempdir().expect("temp dir");
    let mut kubelet = FakeKubelet::start(dir.path());
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port");
    let log = dir.path().join("plugin.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuplace-device-plugin"));
    cmd.arg("--fake-topology")
        .arg(topology("hgx-h100-8"))
        .arg("--device-plugin-dir")
        .arg(dir.path())
        .args(["--node-name", "ports-node", "--no-apiserver", "--sample-interval", "200ms"])
        .args(["--metrics-listen", &metrics.to_string()])
        .arg("--pod-resources-socket")
        .arg(dir.path().join("no-pod-resources.sock"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"));
    flood::under_nofile(&mut cmd, CONTAINER_NOFILE, CONTAINER_NOFILE);
    let mut child = Reap(cmd.spawn().expect("run gpuplace-device-plugin"));
    let pid = child.0.id();
    let reg = kubelet.next_registration().await;
    let socket = dir.path().join(&reg.endpoint);
    let mut c = DevicePluginClient::new(connect_unix(&socket).await.expect("the plugin's socket"));
    assert_eq!(flood::nofile_of(pid), Some(CONTAINER_NOFILE));
    let until = Instant::now() + Duration::from_secs(20);
    while !http_get(metrics, "/metrics").await.is_ok_and(|r| r.0 == 200) {
        assert!(Instant::now() < until, "/metrics never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let partial: &'static [u8] = b"GET /metr";
    let (idle, slow) = (closes_after(metrics, b"").await, closes_after(metrics, partial).await);
    println!("figure: device plugin: one connection to /metrics closed by the plugin: idle after {idle:?}, half a request line after {slow:?}");
    assert!(idle < Duration::from_secs(4) && slow < Duration::from_secs(4), "{idle:?} {slow:?}");

    let f = open_many(metrics, 2_000, b"", Duration::from_millis(500)).await;
    let w = watch(pid, &mut c, &socket, WATCH).await;
    judge("2,000 idle connections to /metrics", &f.summary(), &w);
    drop(f);
    let f = open_many(metrics, 1_200, partial, Duration::from_millis(500)).await;
    let w = watch(pid, &mut c, &socket, WATCH).await;
    judge("1,200 connections with half a request line to /metrics", &f.summary(), &w);
    drop(f);
    let until = Instant::now() + WATCH;
    let flooding = tokio::spawn(async move {
        let (a, b) = tokio::join!(recycle(metrics, 2, until, 20_000, b""), recycle(metrics, 2, until, 20_000, partial));
        a + b
    });
    let w = watch(pid, &mut c, &socket, WATCH).await;
    let opened = flooding.await.expect("recycling flood");
    judge("a recycling flood on /metrics", &format!("{opened} connections opened and reset in {WATCH:?}"), &w);
    assert!(child.0.try_wait().expect("the plugin's status").is_none(), "the plugin exited");

    // the flood gone, /metrics answers again
    let t = Instant::now();
    let until = t + Duration::from_secs(10);
    while !tokio::time::timeout(ANSWER_WITHIN, http_get(metrics, "/metrics"))
        .await
        .is_ok_and(|r| r.is_ok_and(|r| r.0 == 200))
    {
        assert!(Instant::now() < until, "/metrics never answered again after the floods");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("figure: device plugin: /metrics answered again {:?} after the floods ended", t.elapsed());
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!log.contains("Too many open files"), "the plugin ran out of descriptors:\n{log}");
    assert!(log.contains("open-file limit"), "the open-file limit is not logged:\n{log}");
}
