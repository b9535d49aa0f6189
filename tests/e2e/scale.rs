//! Thousands of nodes on the real control plane (docs/performance-journal.md, "Scale").
//!
//! The nodes are Node objects as kubelet and the device plugin keep them: kubelet's capacity and
//! Ready condition, and the device plugin's `gpuplace.io/inventory` annotation, written by the test
//! for all but a few nodes, which run a real `gpuplace-device-plugin --fake-topology`. The boards
//! cycle through five shared topologies; 16 nodes per ToR, 128 per spine, as the simulator's.
//!
//! Each scenario measures, in order:
//! 1. kube-scheduler's pace alone, then with gpuplace, on the same nodes and the same pods: whole
//!    GPUs through `gpuplace.io/gpu` only (which kube-scheduler alone can place too), all created
//!    before kube-scheduler starts, so that the pace is the scheduler's and not the creator's;
//! 2. the extender's time to ready (its first sync) on those nodes;
//! 3. the openb trace's request mix at a controller's pace, more pods than fit when the cluster is
//!    small, so that a deep queue of pending pods builds up: latencies, kube-scheduler's attempts,
//!    filter calls per pending pod per minute, the watch lag, the extender's CPU and memory;
//! 4. over-commits (none allowed) and `/inspect` against the annotations;
//! 5. the time to ready after a SIGKILL and restart, with every pod of 3. still there.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuplace_core::annotations::{NodeInventory, ANNOTATION_INVENTORY};
use gpuplace_core::inventory::{load_topology_file, ResolvedBoard};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::{json, Value};

use crate::audit::{node_name, snapshot, Audit};
use crate::cluster::{figure, repo, ControlPlane, Proc, User};
use crate::fleet::{
    create_node, create_pods, create_pods_as_a_controller, gpu_node_labels, start_plugin, topology_file,
    wait_inventories, Extender, GpuNode, Shape, BOARDS, SLOTS_PER_GPU,
};
use crate::proc_usage::usage;
use crate::{counter, inspect, install, scheduler_config, wait_scheduler_leading, NS, SERIAL};

mod burst;
use burst::{burst, restart_rss};

/// Node objects created at once.
const NODE_CREATES_IN_FLIGHT: usize = 48;

/// One scale scenario (what it leaves out: none).
#[derive(Default)]
pub struct Scale {
    pub name: &'static str,
    pub nodes: usize,
    /// Of which this many run a real device plugin (the first ones).
    pub plugins: usize,
    /// Pods of the openb request mix, created at a controller's pace.
    pub pods: usize,
    /// Whole-GPU pods for the pace of kube-scheduler alone against with gpuplace.
    pub pace_pods: usize,
    /// Also the pace with the extender naming every node that fits (`--nodes-to-score 0`, as
    /// before it named only the best).
    pub every_node_too: bool,
    /// Whole-GPU pods created at once while kube-scheduler runs with gpuplace, client limits
    /// raised: bind latency from both sides ([`burst`]); 0 for none.
    pub burst: usize,
    /// Pods of half a GPU bound before the extender's restart is measured ([`restart_rss`]); 0 for none.
    pub restart_pods: usize,
}

/// `gpu-0042`.
fn node_name_of(i: usize) -> String {
    format!("gpu-{i:04}")
}

/// Creates the nodes: the first `s.plugins` get a real device plugin, the others the inventory the
/// plugin would write. Returns them and the seconds it took.
async fn create_nodes(cp: &ControlPlane, admin: &Client, s: &Scale) -> (Vec<GpuNode>, f64) {
    let started = Instant::now();
    let boards: HashMap<&str, ResolvedBoard> = BOARDS
        .iter()
        .map(|b| {
            let file = load_topology_file(&topology_file(b)).expect("a shared topology");
            (*b, ResolvedBoard::from_file(&file).expect("a board"))
        })
        .collect();
    let creates = (0..s.nodes).map(|i| {
        let board = BOARDS[i % BOARDS.len()];
        let resolved = &boards[board];
        let with_plugin = i < s.plugins;
        async move {
            let name = node_name_of(i);
            let labels = gpu_node_labels(&name, i / 128, i / 16);
            let annotations = if with_plugin {
                Value::Null
            } else {
                // the inventory the device plugin would write (the model's labels play no part in it)
                let mut inventory = NodeInventory::from_node(&resolved.node(&name, BTreeMap::new(), 0, 0));
                inventory.slots_per_gpu = Some(SLOTS_PER_GPU);
                json!({ ANNOTATION_INVENTORY: inventory.to_json() })
            };
            let gpus = resolved.gpus.len() as u32;
            create_node(admin, &name, labels, annotations, gpus).await;
            GpuNode { name, board, gpus, plugin: None }
        }
    });
    let mut nodes: Vec<GpuNode> = futures::stream::iter(creates).buffered(NODE_CREATES_IN_FLIGHT).collect().await;
    for node in nodes.iter_mut().take(s.plugins) {
        node.plugin = Some(start_plugin(cp, &node.name, node.board).await);
    }
    wait_inventories(cp, &mut nodes).await;
    (nodes, started.elapsed().as_secs_f64())
}

/// When the test first saw each pod of the namespace bound (a watch, so that counting binds puts no
/// list of thousands of pods on the API server while it is measured).
struct Binds {
    state: Arc<Mutex<BindState>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct BindState {
    /// Pod name → when it was first seen bound.
    bound: HashMap<String, Instant>,
    /// Pods that exist (bound or not).
    pods: usize,
    exists: std::collections::HashSet<String>,
}

impl Binds {
    fn start(client: &Client) -> Binds {
        let api: Api<Pod> = Api::namespaced(client.clone(), NS);
        let state = Arc::new(Mutex::new(BindState::default()));
        let s = state.clone();
        let task = tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(e) = events.next().await {
                let mut st = s.lock().expect("bind state");
                match e {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                        let name = p.metadata.name.clone().unwrap_or_default();
                        if st.exists.insert(name.clone()) {
                            st.pods += 1;
                        }
                        if node_name(&p).is_some() {
                            st.bound.entry(name).or_insert_with(Instant::now);
                        }
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        let name = p.metadata.name.clone().unwrap_or_default();
                        if st.exists.remove(&name) {
                            st.pods -= 1;
                        }
                        st.bound.remove(&name);
                    }
                    _ => {}
                }
            }
        });
        Binds { state, task }
    }

    fn bound(&self) -> usize {
        self.state.lock().expect("bind state").bound.len()
    }

    fn pods(&self) -> usize {
        self.state.lock().expect("bind state").pods
    }

    /// Pod name → when it was first seen bound.
    fn bound_at(&self) -> HashMap<String, Instant> {
        self.state.lock().expect("bind state").bound.clone()
    }

    /// The first and the last bind seen.
    fn span(&self) -> Option<(Instant, Instant)> {
        let st = self.state.lock().expect("bind state");
        Some((*st.bound.values().min()?, *st.bound.values().max()?))
    }

    /// Waits until `n` pods are bound, or until no pod was bound for `quiet` (then fewer).
    async fn wait(&self, n: usize, quiet: Duration, limit: Duration) -> usize {
        let started = Instant::now();
        let (mut last, mut since) = (0, Instant::now());
        loop {
            let bound = self.bound();
            if bound >= n {
                return bound;
            }
            if bound != last {
                (last, since) = (bound, Instant::now());
            }
            if since.elapsed() >= quiet || started.elapsed() >= limit {
                return bound;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Binds {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A histogram's buckets, `(le, cumulative count)`, summed over the lines of exposition `text` that
/// start with `prefix` and hold every label of `labels` (other labels summed over).
fn buckets(text: &str, prefix: &str, labels: &[&str]) -> Vec<(f64, f64)> {
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with(prefix) && labels.iter().all(|want| l.contains(want))) {
        let Some(le) = l.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
        let Some(count) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if !le.is_nan() {
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += count;
        }
    }
    let mut out: Vec<(f64, f64)> = by_le.into_values().collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// A quantile (ms) of histogram buckets (`(le seconds, cumulative count)`, ascending), interpolated
/// linearly inside its bucket (so as coarse as the buckets around it).
fn quantile_ms(buckets: &[(f64, f64)], q: f64) -> f64 {
    let Some(&(_, total)) = buckets.last() else { return f64::NAN };
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= rank {
            if le.is_infinite() {
                return lo * 1e3;
            }
            let within = if cum > below { (rank - below) / (cum - below) } else { 0.0 };
            return (lo + (le - lo) * within) * 1e3;
        }
        (lo, below) = (le, cum);
    }
    f64::NAN
}

/// A latency quantile (ms) of one verb from the extender's metrics.
fn histogram_quantile(metrics: &str, verb: &str, q: f64) -> f64 {
    let verb = format!("verb=\"{verb}\"");
    quantile_ms(&buckets(metrics, "gpuplace_request_duration_seconds_bucket{", &[&verb]), q)
}

/// kube-scheduler's scheduling attempts in its log so far (`-v=2` logs each outcome).
fn scheduler_attempts(cp: &ControlPlane) -> usize {
    let log = std::fs::read_to_string(cp.dir.join("kube-scheduler.log")).unwrap_or_default();
    log.lines()
        .filter(|l| {
            l.contains("\"Successfully bound pod to node\"")
                || l.contains("\"Unable to schedule pod; no fit; waiting\"")
                || l.contains("\"Error scheduling pod; retrying\"")
        })
        .count()
}

/// Pods of the openb trace's request mix (its GPU pods in trace order, again from the start when
/// more are asked for): whole GPUs through `gpuplace.io/gpu`, shares as a compute share of one GPU.
fn openb_shapes(n: usize) -> Vec<Shape> {
    let dir = repo().join("../shared/traces/alibaba-openb");
    let pods = gpuplace::sim::trace::load_pods(&dir, "default").expect("the openb trace");
    let gpu_pods: Vec<_> = pods.into_iter().filter(|p| p.num_gpu > 0).collect();
    // Shape holds &'static str: a few distinct quantities, each leaked once
    let mut texts: HashMap<u32, &'static str> = HashMap::new();
    let mut text = |v: u32| *texts.entry(v).or_insert_with(|| Box::leak(v.to_string().into_boxed_str()));
    (0..n)
        .map(|i| {
            let p = &gpu_pods[i % gpu_pods.len()];
            if p.gpu_milli >= 1000 {
                Shape { gpu: Some(text(p.num_gpu)), kind: "whole", ..Shape::default() }
            } else {
                let pct = p.gpu_milli.div_ceil(10).clamp(1, 99);
                Shape { gpu: Some("1"), core: Some(text(pct)), kind: "share", ..Shape::default() }
            }
        })
        .collect()
}

/// kube-scheduler's pace on `pods` whole-GPU pods created while it is stopped: (pods a second from
/// its leading to the last bind, from the first bind to the last, its attempts a second).
async fn pace(
    cp: &mut ControlPlane,
    admin: &Client,
    label: &str,
    config: &std::path::Path,
    ext: Option<&Extender>,
    n: usize,
) -> (f64, f64, f64) {
    let url = ext.map(Extender::url);
    let url = url.as_deref();
    if let Some(mut s) = cp.scheduler.take() {
        s.kill();
    }
    let whole = Shape { gpu: Some("1"), kind: "whole-1", ..Shape::default() };
    create_pods(admin, NS, "pace", &vec![whole; n]).await;
    let binds = Binds::start(admin);
    let _ = std::fs::remove_file(cp.dir.join("kube-scheduler.log"));
    // before kube-scheduler starts: the API server's metrics take a moment to read
    let requests_before = api_requests(admin).await;
    cp.start_scheduler(config, url);
    wait_scheduler_leading(cp).await;
    let led = Instant::now();
    let mut procs = vec![
        ("kube-scheduler", cp.scheduler.as_ref().map_or(0, Proc::pid)),
        ("kube-apiserver", cp.apiserver.pid()),
        ("etcd", cp.etcd.pid()),
        ("the test", std::process::id()),
    ];
    if let Some(ext) = ext {
        procs.push(("gpuplace", ext.proc.pid()));
    }
    let before = CpuSplit::take(&procs);
    let bound = binds.wait(n, Duration::from_secs(60), Duration::from_secs(900)).await;
    let after = CpuSplit::take(&procs);
    let requests_after = api_requests(admin).await;
    assert_eq!(bound, n, "{label}: only {bound} of {n} whole-GPU pods bound");
    let (first, last) = binds.span().expect("binds");
    let attempts = scheduler_attempts(cp) as f64;
    let from_lead = n as f64 / last.saturating_duration_since(led).as_secs_f64();
    let steady = (n - 1) as f64 / last.duration_since(first).as_secs_f64().max(1e-3);
    figure(&format!(
        "scale {}: {label}: {n} whole-GPU pods bound {from_lead:.1} pods/s from leading to the last bind, \
         {steady:.1} pods/s from the first bind to the last, {:.1} scheduling attempts/s",
        cp.dir.file_name().and_then(|f| f.to_str()).unwrap_or("?"),
        attempts / last.saturating_duration_since(led).as_secs_f64()
    ));
    figure(&format!(
        "scale {}: {label}: CPU ms per pod (leading to the last bind) {}",
        cp.dir.file_name().and_then(|f| f.to_str()).unwrap_or("?"),
        after.per_pod_since(&before, n)
    ));
    let mut calls: Vec<(String, f64)> = requests_after
        .iter()
        .map(|(k, v)| (k.clone(), v - requests_before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d >= 5.0)
        .collect();
    calls.sort_by(|a, b| b.1.total_cmp(&a.1));
    figure(&format!(
        "scale {}: {label}: API requests per pod {}",
        cp.dir.file_name().and_then(|f| f.to_str()).unwrap_or("?"),
        calls.iter().map(|(k, d)| format!("{k} {:.2}", d / n as f64)).collect::<Vec<_>>().join(", ")
    ));
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    pods.delete_collection(&DeleteParams::default().grace_period(0), &Default::default()).await.expect("delete pods");
    let until = Instant::now() + Duration::from_secs(120);
    while binds.pods() > 0 {
        assert!(Instant::now() < until, "{label}: pods not deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (from_lead, steady, attempts / last.saturating_duration_since(led).as_secs_f64())
}

/// The API server's metrics text (empty when it cannot be read).
async fn apiserver_metrics(admin: &Client) -> String {
    let req = http::Request::get("/metrics").body(Vec::new()).expect("a request");
    admin.request_text(req).await.unwrap_or_default()
}

/// The API server's `apiserver_request_total`, summed by client, verb, resource and subresource.
async fn api_requests(admin: &Client) -> HashMap<String, f64> {
    let text = apiserver_metrics(admin).await;
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let label = |key: &str| {
            line.split(&format!("{key}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or("").to_string()
        };
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let sub = label("subresource");
        let key =
            format!("{} {}{}", label("verb"), label("resource"), if sub.is_empty() { sub } else { format!("/{sub}") });
        *out.entry(key).or_insert(0.0) += value;
    }
    out
}

/// The run with the median pace from leading to the last bind.
fn median_pace(mut runs: Vec<(f64, f64, f64)>) -> (f64, f64, f64) {
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    runs[runs.len() / 2]
}

/// Waits until the extender has seen a run's pods deleted (the next run starts on idle GPUs).
async fn wait_released(ext: &Extender) {
    let until = Instant::now() + Duration::from_secs(60);
    while counter(&ext.metrics(), "gpuplace_pods_bound", "") > 0.0 {
        assert!(Instant::now() < until, "the extender still counts the deleted pods");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// CPU time so far of the machine (busy, idle and stolen, all cores) and of named processes, in
/// seconds.
struct CpuSplit {
    busy: f64,
    idle: f64,
    /// Time the hypervisor ran something else while this VM had work: the same code takes up to
    /// twice the CPU per pod from one hour to the next on the dev VM, and this says whether steal
    /// is why.
    steal: f64,
    procs: Vec<(&'static str, f64)>,
}

impl CpuSplit {
    fn take(procs: &[(&'static str, u32)]) -> CpuSplit {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<f64> =
            stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|t| t.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal: idle and iowait are not busy, nor steal
        let tick = |i: usize| ticks.get(i).copied().unwrap_or(0.0);
        let (idle, steal) = (tick(3) + tick(4), tick(7));
        let busy = ticks.iter().take(8).sum::<f64>() - idle - steal;
        let procs = procs.iter().map(|&(name, pid)| (name, usage(pid).2)).collect();
        CpuSplit { busy: busy / 100.0, idle: idle / 100.0, steal: steal / 100.0, procs }
    }

    /// `name a.b` per process, the rest of the machine, its idle time and the time stolen from it,
    /// each in ms per pod.
    fn per_pod_since(&self, before: &CpuSplit, n: usize) -> String {
        let per = |s: f64| s * 1e3 / n as f64;
        let mut named = 0.0;
        let mut parts: Vec<String> = self
            .procs
            .iter()
            .zip(&before.procs)
            .map(|((name, now), (_, then))| {
                named += now - then;
                format!("{name} {:.2}", per(now - then))
            })
            .collect();
        parts.push(format!("the rest {:.2}", per(self.busy - before.busy - named)));
        parts.push(format!("idle {:.2}", per(self.idle - before.idle)));
        parts.push(format!("steal {:.2}", per(self.steal - before.steal)));
        parts.join(", ")
    }
}

/// How long until `/inspect/NODE` shows a change to the node's inventory (a GPU marked unhealthy,
/// then healthy again): the extender's watch lag, with the API server and etcd in the path. (ms)
async fn watch_lag(admin: &Client, ext: &Extender, node: &str) -> f64 {
    let api: Api<Node> = Api::all(admin.clone());
    let text =
        api.get(node).await.expect("get node").metadata.annotations.unwrap_or_default()[ANNOTATION_INVENTORY].clone();
    let mut inventory = NodeInventory::parse(&text).expect("an inventory");
    let healthy_now = !inventory.gpus[0].healthy;
    inventory.gpus[0].healthy = healthy_now;
    let patch = json!({"metadata": {"annotations": {ANNOTATION_INVENTORY: inventory.to_json()}}});
    let started = Instant::now();
    api.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch the inventory");
    loop {
        let shown = ext
            .get(&format!("/inspect/{node}"))
            .and_then(|(_, body)| serde_json::from_str::<gpuplace::scheduler::inspect::InspectReport>(&body).ok())
            .and_then(|r| Some(r.nodes.first()?.gpus.first()?.healthy));
        if shown == Some(healthy_now) {
            return started.elapsed().as_secs_f64() * 1e3;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{node}: the inventory change never showed in /inspect");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub async fn scale(s: Scale) {
    let _serial = SERIAL.lock().await;
    let mut cp = ControlPlane::start(s.name).await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    let (nodes, created_s) = create_nodes(&cp, &admin, &s).await;
    let gpus: u32 = nodes.iter().map(|n| n.gpus).sum();
    figure(&format!(
        "scale {}: {} nodes ({gpus} GPUs, {} with a real device plugin) created in {created_s:.1} s",
        s.name, s.nodes, s.plugins
    ));

    // 1. the pace of kube-scheduler alone and with gpuplace: with the project's config (its client
    // at the default 50 requests a second, burst 100, which its own Binding calls wait for), and
    // with that limit raised, so that the scheduling itself is compared
    let project = scheduler_config();
    let unthrottled = cp.dir.join("kube-scheduler-config-unthrottled.yaml");
    let mut doc: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(&project).expect("the scheduler config")).expect("yaml");
    doc["clientConnection"]["qps"] = json!(5000);
    doc["clientConnection"]["burst"] = json!(5000);
    std::fs::write(&unthrottled, serde_norway::to_string(&doc).expect("yaml")).expect("write a config");
    let mut configs = vec![("the project's config", &project), ("client limits raised", &unthrottled)];
    if std::env::var("GPUPLACE_E2E_PACE_RAISED_ONLY").is_ok_and(|v| v == "1") {
        configs.remove(0);
    }
    // GPUPLACE_E2E_PACE_RUNS: runs of each (the median is compared), for the acceptance's "median of 3".
    // Alone and with gpuplace take turns, run by run (alone with no extender process at all, then
    // with a fresh extender; an untimed run to warm it up first made no difference), so that the
    // machine's pace, which drifts over the minutes of a series (docs/performance-journal.md, "One
    // watch of pods, and the machine's own pace"), weighs on both alike.
    let runs: usize = std::env::var("GPUPLACE_E2E_PACE_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let medians = if runs > 1 { format!(", medians of {runs} runs") } else { String::new() };
    let mut alone = Vec::new();
    for &(what, config) in configs.iter().filter(|_| s.pace_pods > 0) {
        let (mut each_alone, mut each_with) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            each_alone
                .push(pace(&mut cp, &admin, &format!("kube-scheduler alone, {what}"), config, None, s.pace_pods).await);
            let mut ext = Extender::start(&cp, "replica-a", 0, &[]);
            ext.wait_ready(Duration::from_secs(600)).await;
            let label = format!("kube-scheduler with gpuplace, {what}");
            each_with.push(pace(&mut cp, &admin, &label, config, Some(&ext), s.pace_pods).await);
            wait_released(&ext).await;
        }
        let pairs: Vec<String> = each_alone.iter().zip(&each_with).map(|(a, w)| format!("{:.2}", w.0 / a.0)).collect();
        let (a, w) = (median_pace(each_alone), median_pace(each_with));
        alone.push(a);
        figure(&format!(
            "scale {}: {what}: pods/s with gpuplace / alone = {:.2} (from leading to the last bind), \
             {:.2} (first to last bind){medians}{}",
            s.name,
            w.0 / a.0,
            w.1 / a.1,
            if runs > 1 { format!("; run by run (from leading) {}", pairs.join(", ")) } else { String::new() },
        ));
    }

    if s.burst > 0 {
        burst(&mut cp, &admin, &s, &unthrottled, None).await;
    }

    // 2. the extender's first sync, on the cluster without pods
    let started = Instant::now();
    let mut ext = Extender::start(&cp, "replica-a", 0, &[]);
    ext.wait_ready(Duration::from_secs(600)).await;
    let ready_s = started.elapsed().as_secs_f64();
    let (rss, _, cpu) = usage(ext.proc.pid());
    figure(&format!(
        "scale {}: extender ready (first sync) {ready_s:.2} s after its start; RSS {rss:.0} MiB, CPU {cpu:.2} s",
        s.name
    ));

    // every node that fits named in the answer, against the medians alone above
    if s.every_node_too && s.pace_pods > 0 {
        let variant = ", every node that fits named";
        ext.proc.kill();
        ext = Extender::start(&cp, "replica-a", ext.port, &["--nodes-to-score", "0"]);
        ext.wait_ready(Duration::from_secs(600)).await;
        for (&(what, config), alone) in configs.iter().zip(&alone) {
            let label = format!("kube-scheduler with gpuplace{variant}, {what}");
            let mut each = Vec::new();
            for _ in 0..runs {
                each.push(pace(&mut cp, &admin, &label, config, Some(&ext), s.pace_pods).await);
                wait_released(&ext).await;
            }
            let with = median_pace(each);
            figure(&format!(
                "scale {}: {what}{variant}: pods/s with gpuplace / alone = {:.2} (from leading to the last bind), \
                 {:.2} (first to last bind){medians}",
                s.name,
                with.0 / alone.0,
                with.1 / alone.1,
            ));
        }
        ext.proc.kill();
        ext = Extender::start(&cp, "replica-a", ext.port, &[]);
        ext.wait_ready(Duration::from_secs(600)).await;
    }
    if s.burst > 0 {
        burst(&mut cp, &admin, &s, &unthrottled, Some(&ext)).await;
    }
    if s.restart_pods > 0 {
        ext = restart_rss(&mut cp, &admin, &s, &unthrottled, ext).await;
    }
    if s.pods == 0 {
        return;
    }
    let url = ext.url();
    // the mix runs with the project's config
    cp.start_scheduler(&project, Some(&url));
    wait_scheduler_leading(&mut cp).await;

    // 3. the openb mix at a controller's pace
    let binds = Binds::start(&admin);
    let metrics_before = ext.metrics();
    let attempts_before = scheduler_attempts(&cp);
    let (_, _, cpu_before) = usage(ext.proc.pid());
    let started = Instant::now();
    create_pods_as_a_controller(&admin, NS, "ob", &openb_shapes(s.pods)).await;
    let created_s = started.elapsed().as_secs_f64();
    let bound = binds.wait(s.pods, Duration::from_secs(30), Duration::from_secs(1800)).await;
    let busy_s = binds.span().map_or(created_s, |(_, last)| last.duration_since(started).as_secs_f64());
    let (rss, hwm, cpu_after) = usage(ext.proc.pid());
    let attempts = scheduler_attempts(&cp) - attempts_before;
    let metrics = ext.metrics();
    let delta = |name: &str, filter: &str| counter(&metrics, name, filter) - counter(&metrics_before, name, filter);
    figure(&format!(
        "scale {}: {} openb pods created in {created_s:.1} s at a controller's pace; {bound} bound, {} pending; \
         last bind {busy_s:.1} s after the first create, {:.1} pods bound/s",
        s.name,
        s.pods,
        s.pods - bound,
        bound as f64 / busy_s
    ));
    figure(&format!(
        "scale {}: kube-scheduler {attempts} scheduling attempts, {:.1}/s; extender calls: filter {}, prioritize {}, bind {}",
        s.name,
        attempts as f64 / busy_s,
        delta("gpuplace_requests_total", "verb=\"filter\""),
        delta("gpuplace_requests_total", "verb=\"prioritize\""),
        delta("gpuplace_requests_total", "verb=\"bind\"")
    ));
    figure(&format!(
        "scale {}: extender latency (metrics, whole run) filter p50/p99 {:.2}/{:.2} ms, prioritize {:.2}/{:.2} ms, \
         bind {:.2}/{:.2} ms; RSS {rss:.0} MiB (peak {hwm:.0}), CPU {:.1} s over {busy_s:.0} s",
        s.name,
        histogram_quantile(&metrics, "filter", 0.5),
        histogram_quantile(&metrics, "filter", 0.99),
        histogram_quantile(&metrics, "prioritize", 0.5),
        histogram_quantile(&metrics, "prioritize", 0.99),
        histogram_quantile(&metrics, "bind", 0.5),
        histogram_quantile(&metrics, "bind", 0.99),
        cpu_after - cpu_before
    ));

    let log = std::fs::read_to_string(&ext.placement_log).unwrap_or_default();
    figure(&format!(
        "scale {}: placement log (the default: decisions, repeats counted) {} bytes, {} lines, {:.0} bytes per pod",
        s.name,
        log.len(),
        log.lines().count(),
        log.len() as f64 / s.pods as f64
    ));

    // the deep queue: filter calls per pending pod per minute while nothing else happens
    let pending = s.pods - bound;
    if pending > 0 {
        let window = Duration::from_secs(60);
        let filters = || counter(&ext.metrics(), "gpuplace_requests_total", "verb=\"filter\"");
        let before = filters();
        tokio::time::sleep(window).await;
        let per_min = (filters() - before) / window.as_secs_f64() * 60.0;
        figure(&format!(
            "scale {}: {pending} pods pending: {:.3} filter calls per pending pod per minute (60 s, no change)",
            s.name,
            per_min / pending as f64
        ));
    }

    let mut lags: Vec<f64> = Vec::new();
    for i in 0..5 {
        // a node without a real device plugin, whose inventory only the test writes
        lags.push(watch_lag(&admin, &ext, &node_name_of(s.plugins + i * 7)).await);
    }
    lags.sort_by(f64::total_cmp);
    figure(&format!(
        "scale {}: watch lag (an inventory patch until /inspect shows it) median {:.1} ms, max {:.1} ms, 5 samples",
        s.name, lags[2], lags[4]
    ));
    for i in 0..5 {
        // put them back as they were
        watch_lag(&admin, &ext, &node_name_of(s.plugins + i * 7)).await;
    }

    // 4. nothing over-committed, and the extender's view is the annotations'
    let snap = snapshot(&admin, NS).await;
    let audit = Audit::of(&snap);
    figure(&format!(
        "scale {}: over-commits {}, bad assignments {}, {} bound pods audited",
        s.name,
        audit.over_commits.len(),
        audit.bad_assignments.len(),
        audit.bound
    ));
    audit.assert_sound(true);
    let diffs = audit.compare_inspect(&inspect(&ext));
    assert!(diffs.is_empty(), "/inspect differs from the annotations: {:#?}", &diffs[..diffs.len().min(20)]);

    // 5. a restart with the pods bound
    ext.proc.kill();
    let started = Instant::now();
    let mut ext = Extender::start(&cp, "replica-a", ext.port, &[]);
    ext.wait_ready(Duration::from_secs(600)).await;
    let ready_s = started.elapsed().as_secs_f64();
    let (rss, _, _) = usage(ext.proc.pid());
    figure(&format!(
        "scale {}: extender ready {ready_s:.2} s after a restart with {} bound pods; RSS {rss:.0} MiB",
        s.name, audit.bound
    ));
    let diffs = audit.compare_inspect(&inspect(&ext));
    assert!(
        diffs.is_empty(),
        "after the restart /inspect differs from the annotations: {:#?}",
        &diffs[..diffs.len().min(20)]
    );
    drop(nodes);
}

/// The size `.ci/run` runs.
#[tokio::test(flavor = "current_thread")]
async fn scale_100_nodes_800_openb_pods() {
    scale(Scale {
        name: "scale-100",
        nodes: 100,
        plugins: 3,
        pods: 800,
        pace_pods: 200,
        burst: 200,
        ..Scale::default()
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 25 minutes"]
async fn scale_1000_nodes_10000_openb_pods() {
    scale(Scale {
        name: "scale-1000",
        nodes: 1000,
        plugins: 4,
        pods: 10_000,
        pace_pods: 1000,
        every_node_too: true,
        ..Scale::default()
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 40 minutes"]
async fn scale_5000_nodes_10000_openb_pods() {
    scale(Scale { name: "scale-5000", nodes: 5000, plugins: 4, pods: 10_000, pace_pods: 1000, ..Scale::default() })
        .await;
}

/// The pace on 100 nodes with 600 pods (`.ci/run`'s scenario runs 200 and then the openb mix).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 2 minutes"]
async fn pace_on_100_nodes() {
    scale(Scale { name: "pace-100", nodes: 100, pace_pods: 600, ..Scale::default() }).await;
}

/// Only the pace, alone and with gpuplace naming the best node or every node (for working on it).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 8 minutes"]
async fn pace_on_1000_nodes() {
    scale(Scale { name: "pace-1000", nodes: 1000, pace_pods: 1000, every_node_too: true, ..Scale::default() }).await;
}

/// The pace on 5,000 nodes with 1,000 pods (issue 33 asks at least 0.95 there too).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 5 minutes"]
async fn pace_on_5000_nodes() {
    scale(Scale { name: "pace-5000", nodes: 5000, pace_pods: 1000, ..Scale::default() }).await;
}

/// Issue 33's burst: 1,000 whole-GPU pods created at once on 1,000 nodes while kube-scheduler runs
/// with gpuplace, its client limits raised; bind latency p50/p99 from both sides.
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 5 minutes"]
async fn burst_on_1000_nodes() {
    scale(Scale { name: "burst-1000", nodes: 1000, burst: 1000, ..Scale::default() }).await;
}

/// Issue 33's restart: the extender's memory after a restart with 10,000 pods bound, against its
/// steady state (1,000 nodes).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md: about 5 minutes"]
async fn restart_with_10000_pods_on_1000_nodes() {
    scale(Scale { name: "restart-1000", nodes: 1000, restart_pods: 10_000, ..Scale::default() }).await;
}
