//! What runs on the control plane: GPU nodes (Node objects as kubelet would keep them, each with a
//! `gpuplace-device-plugin --fake-topology` for its API side), extender replicas, and the pods.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

use crate::cluster::{free_port, repo, workspace_bin, ControlPlane, Proc, User};

/// Device-plugin slots per GPU (the plugin's default, K).
pub const SLOTS_PER_GPU: u32 = 10;

/// The boards the nodes cycle through (shared/topologies).
pub const BOARDS: [&str; 5] = ["hgx-h100-8", "dgx1-volta", "pcie-l40s-8", "4x-rtx8000", "dgx1-pascal"];

pub struct GpuNode {
    pub name: String,
    pub board: &'static str,
    pub gpus: u32,
    pub plugin: Option<Proc>,
}

pub fn topology_file(board: &str) -> PathBuf {
    repo().join("../shared/topologies").join(format!("{board}.json"))
}

fn gpus_on(board: &str) -> u32 {
    let text = std::fs::read_to_string(topology_file(board)).expect("a shared topology");
    let v: Value = serde_json::from_str(&text).expect("topology JSON");
    v["gpus"].as_array().map_or(0, |g| g.len() as u32)
}

/// Creates `n` Node objects (4 per ToR, 8 per spine), Ready, untainted, with kubelet's
/// `gpuplace.io/gpu` capacity (K slots per GPU), and starts one device plugin per node.
pub async fn start_nodes(cp: &ControlPlane, n: usize) -> Vec<GpuNode> {
    start_nodes_of(cp, n, &BOARDS).await
}

/// [`start_nodes`] with the boards cycling through `boards`.
pub async fn start_nodes_of(cp: &ControlPlane, n: usize, boards: &[&'static str]) -> Vec<GpuNode> {
    let admin = cp.client(User::Admin).await;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let board = boards[i % boards.len()];
        let gpus = gpus_on(board);
        let name = format!("gpu-{i:02}");
        create_node(&admin, &name, gpu_node_labels(&name, i / 8, i / 4), Value::Null, gpus).await;
        out.push(GpuNode { name, board, gpus, plugin: None });
    }
    for node in &mut out {
        node.plugin = Some(start_plugin(cp, &node.name, node.board).await);
    }
    out
}

/// The labels of a GPU node: its hostname, `gpuplace.io/gpu-node`, and its spine and ToR.
pub fn gpu_node_labels(name: &str, spine: usize, tor: usize) -> Value {
    json!({
        "kubernetes.io/hostname": name,
        "gpuplace.io/gpu-node": "true",
        "network.gpuplace.io/spine": format!("spine-{spine}"),
        "network.gpuplace.io/tor": format!("tor-{tor}"),
    })
}

/// Creates a Node as it stands once kubelet has registered it: `labels`, `annotations` (null for
/// none), untainted, Ready, with kubelet's capacity for `gpus` GPUs ([`set_kubelet_status`]).
pub async fn create_node(client: &Client, name: &str, labels: Value, annotations: Value, gpus: u32) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
    }))
    .expect("a Node");
    nodes.create(&PostParams::default(), &node).await.unwrap_or_else(|e| panic!("create {name}: {e}"));
    // TaintNodesByCondition admission adds not-ready at creation; no node controller runs here
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"taints": null}})))
        .await
        .expect("untaint");
    set_kubelet_status(client, name, gpus).await;
}

/// What kubelet would write: capacity (with the device plugin's K slots per GPU as
/// `gpuplace.io/gpu`) and a Ready condition.
pub async fn set_kubelet_status(client: &Client, node: &str, gpus: u32) {
    let nodes: Api<Node> = Api::all(client.clone());
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let cap =
        json!({"cpu": "96", "memory": "1024Gi", "pods": "250", "gpuplace.io/gpu": (gpus * SLOTS_PER_GPU).to_string()});
    let status = json!({"status": {
        "capacity": cap, "allocatable": cap,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
    }});
    nodes.patch_status(node, &PatchParams::default(), &Patch::Merge(status)).await.expect("node status");
}

/// The device plugin of `node` (a fake topology of `board`), as its ServiceAccount with a token bound
/// to the Node.
pub async fn start_plugin(cp: &ControlPlane, node: &str, board: &str) -> Proc {
    start_plugin_with(cp, node, board, &[]).await
}

/// [`start_plugin`] with `extra` arguments.
pub async fn start_plugin_with(cp: &ControlPlane, node: &str, board: &str, extra: &[&str]) -> Proc {
    let kubeconfig = cp.node_bound_kubeconfig(node).await;
    let dir = cp.dir.join("device-plugins").join(node);
    std::fs::create_dir_all(&dir).expect("plugin folder");
    let dra_dir = std::env::temp_dir().join(format!("gp-{}-{node}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dra_dir);
    Proc::spawn(
        &format!("device-plugin {node}"),
        Command::new(workspace_bin("gpuplace-device-plugin"))
            .arg("--fake-topology")
            .arg(topology_file(board))
            .args(["--node-name", node])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--device-plugin-dir")
            .arg(&dir)
            .arg("--pod-resources-socket")
            .arg(dir.join("pod-resources.sock"))
            // DRA mode's kubelet folders: the test's own, never the host's, one per node, and short
            // (a socket's path must fit in sockaddr_un)
            .arg("--plugins-registry-dir")
            .arg(dra_dir.join("r"))
            .arg("--plugins-dir")
            .arg(dra_dir.join("p"))
            .arg("--cdi-dir")
            .arg(dra_dir.join("c"))
            // port 0: sixteen plugins picking free ports at once could pick the same one
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(["--sample-interval", "1s", "--publish-min-interval", "1s", "--publish-max-interval", "5s"])
            .args(extra)
            .env("RUST_LOG", "info"),
        cp.dir.join(format!("device-plugin-{node}.log")),
    )
}

/// Waits until every node carries the device plugin's inventory annotation.
pub async fn wait_inventories(cp: &ControlPlane, nodes: &mut [GpuNode]) {
    let api: Api<Node> = Api::all(cp.client(User::Admin).await);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let list = api.list(&Default::default()).await.expect("list nodes");
        let with = list
            .items
            .iter()
            .filter(|n| n.metadata.annotations.as_ref().is_some_and(|a| a.contains_key("gpuplace.io/inventory")))
            .count();
        if with >= nodes.len() {
            return;
        }
        for n in nodes.iter_mut() {
            if let Some(p) = n.plugin.as_mut() {
                assert!(p.running(), "{} exited:\n{}", p.name, p.tail(30));
            }
        }
        assert!(Instant::now() < until, "only {with} of {} nodes got an inventory in 60 s", nodes.len());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// One `gpuplace serve` replica in API-server mode.
pub struct Extender {
    pub identity: String,
    pub port: u16,
    pub proc: Proc,
    pub placement_log: PathBuf,
}

impl Extender {
    /// Starts a replica as the extender's ServiceAccount on `port` (0: a free one).
    pub fn start(cp: &ControlPlane, identity: &str, port: u16, extra: &[&str]) -> Extender {
        let port = if port == 0 { free_port() } else { port };
        let placement_log = cp.dir.join(format!("placement-{identity}.jsonl"));
        let proc = Proc::spawn(
            &format!("gpuplace serve {identity}"),
            Command::new(workspace_bin("gpuplace"))
                .arg("serve")
                .arg("--kubeconfig")
                .arg(cp.kubeconfig(User::Extender))
                .args(["--listen", &format!("127.0.0.1:{port}")])
                // where the other replica forwards the verbs while this one leads (in a pod: POD_IP)
                .args(["--advertise-url", &format!("http://127.0.0.1:{port}/gpuplace")])
                .args(["--leader-elect-identity", identity])
                .arg("--placement-log")
                .arg(&placement_log)
                .args(extra)
                // GPUPLACE_E2E_LOG: a log filter for the extender when digging into a run
                .env("RUST_LOG", std::env::var("GPUPLACE_E2E_LOG").unwrap_or_else(|_| "info".into())),
            cp.dir.join(format!("extender-{identity}.log")),
        );
        Extender { identity: identity.to_string(), port, proc, placement_log }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/gpuplace", self.port)
    }

    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.port, path)
    }

    /// `/readyz` answers 200: rebuilt and the key ring loaded, whether or not it leads.
    pub fn ready(&self) -> bool {
        self.get("/readyz").is_some_and(|(s, _)| s == 200)
    }

    /// It holds the Lease (`gpuplace_leader 1`).
    pub fn leads(&self) -> bool {
        self.metrics().lines().any(|l| l == "gpuplace_leader 1")
    }

    /// Waits until `/readyz` answers 200 and it leads (one replica: it then decides).
    pub async fn wait_ready(&mut self, limit: Duration) {
        let until = Instant::now() + limit;
        while !(self.ready() && self.leads()) {
            assert!(self.proc.running(), "{} exited:\n{}", self.proc.name, self.proc.tail(40));
            assert!(Instant::now() < until, "{} not ready in {limit:?}:\n{}", self.proc.name, self.proc.tail(40));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn metrics(&self) -> String {
        self.get("/metrics").map(|(_, b)| b).unwrap_or_default()
    }
}

/// A plain HTTP/1.1 GET on loopback: (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http_request(port, "GET", path, "")
}

/// A plain HTTP/1.1 POST of JSON on loopback, as kube-scheduler sends a verb: (status, body).
pub fn http_post(port: u16, path: &str, body: &str) -> Option<(u16, String)> {
    http_request(port, "POST", path, body)
}

fn http_request(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    Some((status, if chunked { crate::tls::dechunk(body) } else { body.to_string() }))
}

/// What a pod asks for, per its single container.
#[derive(Clone, Debug, Default)]
pub struct Shape {
    pub gpu: Option<&'static str>,
    pub mem: Option<&'static str>,
    pub core: Option<&'static str>,
    /// Extra resources in limits (an unknown `gpuplace.io/` name, say).
    pub other: Option<(&'static str, &'static str)>,
    pub annotations: Vec<(&'static str, String)>,
    pub labels: Vec<(&'static str, String)>,
    /// What the pod stands for in the figures: `mem-share`, `whole-2`, `invalid`, …
    pub kind: &'static str,
}

impl Shape {
    pub fn pod(&self, name: &str) -> Pod {
        let mut limits = BTreeMap::new();
        for (k, v) in
            [("gpuplace.io/gpu", self.gpu), ("gpuplace.io/gpu-mem", self.mem), ("gpuplace.io/gpu-core", self.core)]
        {
            if let Some(v) = v {
                limits.insert(k.to_string(), Quantity(v.to_string()));
            }
        }
        if let Some((k, v)) = self.other {
            limits.insert(k.to_string(), Quantity(v.to_string()));
        }
        let mut labels: BTreeMap<String, String> =
            self.labels.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        labels.insert("e2e/kind".into(), self.kind.into());
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                labels: Some(labels),
                annotations: Some(self.annotations.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("registry.k8s.io/pause:3.10".into()),
                    resources: Some(ResourceRequirements {
                        limits: Some(limits),
                        requests: Some(BTreeMap::from([("cpu".into(), Quantity("100m".into()))])),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                termination_grace_period_seconds: Some(0),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }
}

/// The storm's mix: `n` pods cycling through every shape the issue names (shares by memory, by
/// compute, both; whole GPUs 1/2/4/8; a 3-GPU share; NUMA required; a ToR-local group; invalid).
pub fn storm_shapes(n: usize) -> Vec<Shape> {
    let s = |gpu, mem, core, kind| Shape { gpu, mem, core, kind, ..Shape::default() };
    let mut cycle = vec![
        s(Some("1"), Some("4096"), None, "mem-share"),
        s(Some("1"), Some("8192"), None, "mem-share"),
        s(Some("1"), Some("20480"), None, "mem-share"),
        s(Some("1"), None, Some("25"), "core-share"),
        s(Some("1"), None, Some("50"), "core-share"),
        s(Some("1"), Some("8192"), Some("30"), "mem-core-share"),
        s(Some("1"), Some("12288"), Some("20"), "mem-core-share"),
        s(Some("1"), None, None, "whole-1"),
        s(Some("2"), None, None, "whole-2"),
        s(Some("1"), Some("2048"), None, "mem-share"),
        s(Some("3"), Some("18432"), Some("240"), "share-3gpu"),
        s(Some("4"), None, None, "whole-4"),
        s(Some("1"), None, Some("10"), "core-share"),
        Shape {
            annotations: vec![("gpuplace.io/numa", "required".into())],
            ..s(Some("2"), None, None, "numa-required")
        },
        s(Some("8"), None, None, "whole-8"),
    ];
    // invalid requests: more than 100 compute per GPU, memory without gpu, a typo'd resource,
    // an absurd memory request
    let invalid = [
        s(Some("1"), None, Some("150"), "invalid"),
        s(None, Some("4096"), None, "invalid"),
        Shape { other: Some(("gpuplace.io/gpus", "1")), ..s(None, None, None, "invalid") },
        s(Some("1"), Some("4000000000"), None, "invalid"),
    ];
    cycle.extend(invalid);
    let mut out: Vec<Shape> = (0..n).map(|i| cycle[i % cycle.len()].clone()).collect();
    // one 4-pod job that wants one ToR, first in the storm so that it finds room
    for shape in out.iter_mut().take(4) {
        *shape = Shape {
            labels: vec![("gpuplace.io/group", "job-tor".into())],
            annotations: vec![("gpuplace.io/group-size", "4".into())],
            ..s(Some("2"), None, None, "group")
        };
    }
    out
}

/// kube-controller-manager's client limits (`--kube-api-qps`, `--kube-api-burst`, their defaults):
/// the pace at which a Job or ReplicaSet controller creates pods.
pub const CONTROLLER_QPS: f64 = 20.0;
pub const CONTROLLER_BURST: usize = 30;

/// Creates the pods `<prefix>-NNN` in `ns` at a controller's pace: client-go's token bucket with
/// [`CONTROLLER_QPS`] and [`CONTROLLER_BURST`] (full at the start), each create sent as soon as it
/// has a token. Returns when the last create has returned.
pub async fn create_pods_as_a_controller(client: &Client, ns: &str, prefix: &str, shapes: &[Shape]) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let start = tokio::time::Instant::now();
    let futs = shapes.iter().enumerate().map(|(i, shape)| {
        let name = format!("{prefix}-{i:03}");
        let pod = shape.pod(&name);
        let api = api.clone();
        let token_at = (i + 1).saturating_sub(CONTROLLER_BURST) as f64 / CONTROLLER_QPS;
        async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(token_at)).await;
            api.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
        }
    });
    futures::future::join_all(futs).await;
}

/// Creates the pods `<prefix>-NNN` in `ns` as fast as the API server takes them (a storm).
pub async fn create_pods(client: &Client, ns: &str, prefix: &str, shapes: &[Shape]) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    for (c, shapes) in shapes.chunks(25).enumerate() {
        let futs = shapes.iter().enumerate().map(|(i, shape)| {
            let name = format!("{prefix}-{:03}", c * 25 + i);
            let pod = shape.pod(&name);
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
            }
        });
        futures::future::join_all(futs).await;
    }
}

/// What a Service with readiness does for kube-scheduler: a loopback port that hands each new
/// connection to the next backend, in turn, whose `/readyz` answers 200 (round robin over the ready
/// ones; threads copying bytes both ways; stops accepting when dropped).
pub struct ReadyProxy {
    pub port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ReadyProxy {
    pub fn start(backends: Vec<u16>) -> ReadyProxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            let mut next = 0;
            while !stopped.load(Ordering::Relaxed) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = client.set_nonblocking(false);
                let n = backends.len();
                let Some(backend) = (0..n)
                    .map(|i| backends[(next + i) % n])
                    .find(|&b| http_get(b, "/readyz").is_some_and(|(s, _)| s == 200))
                else {
                    continue; // no ready endpoint: the connection is refused, as by a Service
                };
                next = (next + 1) % n.max(1);
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", backend)) else { continue };
                for (mut from, mut to) in
                    [(client.try_clone(), upstream.try_clone()), (upstream.try_clone(), client.try_clone())]
                        .into_iter()
                        .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        ReadyProxy { port, stop }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/gpuplace", self.port)
    }
}

impl Drop for ReadyProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
