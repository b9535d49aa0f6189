//! End to end on a real control plane: etcd, kube-apiserver and kube-scheduler (v1.36) on loopback,
//! with the project's own binaries (`gpuplace serve` in API-server mode, one
//! `gpuplace-device-plugin --fake-topology` per node for its API side) and the project's own
//! scheduler config and RBAC manifests. No kubelet runs: pods are bound, never started, and the
//! test writes the `gpuplace.io/gpu` capacity kubelet would.
//!
//! Each scenario starts its own control plane (scenarios run one at a time: 2 cores) and prints its
//! figures as `e2e figure: …` lines. Where the Kubernetes binaries come from: `cluster.rs`.

mod audit;
mod books;
mod cluster;
mod dra;
mod dra_compare;
mod dra_gpuplace;
mod dra_groups;
mod fleet;
mod groups;
mod netns;
mod node;
#[path = "../support/packages.rs"]
mod packages;
#[path = "../support/proc_usage.rs"]
mod proc_usage;
mod real_node;
mod scale;
mod security;
mod storms;
#[path = "../support/tls.rs"]
mod tls;
#[path = "../support/xz.rs"]
mod xz;
#[path = "../support/yaml_files.rs"]
mod yaml_files;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

use gpuplace::scheduler::inspect::InspectReport;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

use audit::{node_name, percentile, settle, snapshot, Audit};
use cluster::{apply, figure, repo, yaml_objects, ControlPlane, User};
use fleet::{create_pods, create_pods_as_a_controller, start_nodes, storm_shapes, wait_inventories, Extender};
use yaml_files::yaml_files;

/// One scenario at a time: each runs a whole control plane on CI's 2 cores. (tokio's lock: it is
/// held across awaits, and a failed scenario does not poison it for the next.)
pub(crate) static SERIAL: Mutex<()> = Mutex::const_new(());

const NODES: usize = 16;
pub(crate) const NS: &str = "e2e";

/// The project's manifests that a running install needs before the binaries start. The FlowSchema
/// too: the API server runs API Priority and Fairness (on by default since Kubernetes 1.20), and
/// without it the extender's requests, its Bindings among them, would share `workload-low` with
/// every other service account's where an install puts them at kube-scheduler's level. Not the
/// records policy (extender/records-policy.yaml): scenarios here write and strip records as the
/// admin, which it refuses; `security::only_gpuplaces_own_accounts_write_a_pods_gpu_records` applies it.
const INSTALL: [&str; 7] = [
    "scheduler-config/extender/namespace.yaml",
    "scheduler-config/device-plugin/namespace.yaml",
    "scheduler-config/extender/rbac.yaml",
    "scheduler-config/extender/flowschema.yaml",
    "scheduler-config/device-plugin/rbac.yaml",
    "scheduler-config/extender/admission-policy.yaml",
    "scheduler-config/device-plugin/admission-policy.yaml",
];

pub(crate) async fn install(client: &Client) {
    for file in INSTALL {
        for obj in yaml_objects(&repo().join(file)) {
            apply(client, &obj, false).await.unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("namespace");
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create the test namespace");
    // no controller manager runs to make it, and the ServiceAccount admission plugin wants it
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
    Api::<ServiceAccount>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &sa)
        .await
        .expect("default sa");
}

/// A control plane with the project installed and 16 GPU nodes with their device plugins.
struct Stage {
    cp: ControlPlane,
    admin: Client,
    nodes: Vec<fleet::GpuNode>,
}

async fn stage(name: &str) -> Stage {
    stage_of(name, NODES).await
}

/// [`stage`] with `n` nodes.
async fn stage_of(name: &str, n: usize) -> Stage {
    let cp = ControlPlane::start(name).await;
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    let mut nodes = start_nodes(&cp, n).await;
    wait_inventories(&cp, &mut nodes).await;
    Stage { cp, admin, nodes }
}

/// [`stage`] with one extender replica, ready.
async fn stage_with_extender(name: &str) -> (Stage, Extender) {
    stage_with_extender_of(name, NODES, &[]).await
}

/// [`stage_with_extender`] with `n` nodes and `extra` flags for the extender.
async fn stage_with_extender_of(name: &str, n: usize, extra: &[&str]) -> (Stage, Extender) {
    let st = stage_of(name, n).await;
    let mut ext = Extender::start(&st.cp, "replica-a", 0, extra);
    ext.wait_ready(Duration::from_secs(60)).await;
    (st, ext)
}

/// The scenarios run the extender on the host over plain HTTP (`Extender::start`), so kube-scheduler
/// gets the reference configuration's plain-HTTP twin (identical but for urlPrefix, enableHTTPS and
/// tlsConfig: tests/scheduler_config.rs); the real-node scenario runs the chart's default, mTLS.
fn scheduler_config() -> std::path::PathBuf {
    repo().join("scheduler-config/kube-scheduler-config-http.yaml")
}

/// A counter (summed over its label sets matching `filter`) from Prometheus text.
fn counter(metrics: &str, name: &str, filter: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The lines of one verb in a placement log (none when it cannot be read), in the log's order.
fn log_lines(log: &std::path::Path, verb: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(|d| d["verb"] == verb).collect()
}

/// (when the decision began, Unix ms; its latency, ms) of one placement log line.
fn began_and_latency(d: &Value) -> Option<(f64, f64)> {
    let ms = d["latency_us"].as_f64()? / 1000.0;
    Some((d["ts_unix_ms"].as_f64()? - ms, ms))
}

/// [`began_and_latency`] of each decision of one verb in a placement log, in the log's order.
fn timings(log: &std::path::Path, verb: &str) -> Vec<(f64, f64)> {
    log_lines(log, verb).iter().filter_map(began_and_latency).collect()
}

/// "`label` n=… p50=… p90=… p99=… max=…" of latencies in ms.
fn spread(label: &str, mut l: Vec<f64>) -> String {
    l.sort_by(f64::total_cmp);
    format!(
        "{label} n={} p50={:.2} ms p90={:.2} ms p99={:.2} ms max={:.2} ms",
        l.len(),
        percentile(&l, 0.5),
        percentile(&l, 0.9),
        percentile(&l, 0.99),
        l.last().copied().unwrap_or(f64::NAN)
    )
}

fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Bind latencies split at the moment the test's last create returned: the binds that began while
/// the API server was still taking the burst of creates, and those after.
fn burst_figure(scenario: &str, log: &std::path::Path, creates_began_ms: f64, creates_done_ms: f64) {
    let (mut during, mut after): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for (began, ms) in timings(log, "bind").into_iter().filter(|(b, _)| *b >= creates_began_ms) {
        if began < creates_done_ms { &mut during } else { &mut after }.push(ms);
    }
    for (when, l) in [("while the creates were in flight", during), ("after the last create", after)] {
        figure(&spread(&format!("{scenario}: bind latency {when}"), l));
    }
}

fn latency_figure(scenario: &str, log: &std::path::Path) {
    for verb in ["filter", "prioritize", "bind"] {
        let l: Vec<f64> = timings(log, verb).into_iter().map(|(_, ms)| ms).collect();
        if l.is_empty() {
            continue;
        }
        figure(&spread(&format!("{scenario}: {verb} latency"), l));
    }
}

fn inspect(ext: &Extender) -> InspectReport {
    let (status, body) = ext.get("/inspect").expect("GET /inspect");
    assert_eq!(status, 200, "/inspect: {body}");
    serde_json::from_str(&body).expect("an inspect report")
}

/// Polls until `n` pods of `ns` are bound; returns how many are.
async fn wait_bound(client: &Client, ns: &str, n: usize, limit: Duration) -> usize {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let until = Instant::now() + limit;
    loop {
        let pods = api.list(&Default::default()).await.expect("list pods").items;
        let bound = pods.iter().filter(|p| node_name(p).is_some()).count();
        if bound >= n || Instant::now() > until {
            return bound;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Placement log lines of `verb` for `pod` (`ns/name`; `None`: any pod) with `outcome`.
fn decisions(ext: &Extender, verb: &str, pod: Option<&str>, outcome: Option<&str>) -> usize {
    log_lines(&ext.placement_log, verb)
        .iter()
        .filter(|d| pod.is_none_or(|p| d["pod"] == p))
        .filter(|d| outcome.is_none_or(|o| d["outcome"] == o))
        .count()
}

/// The pods (`ns/name`) a replica's placement log says it bound.
fn bound_pods(ext: &Extender) -> std::collections::BTreeSet<String> {
    log_lines(&ext.placement_log, "bind")
        .iter()
        .filter(|d| d["outcome"] == "bound")
        .filter_map(|d| d["pod"].as_str().map(str::to_owned))
        .collect()
}

/// Two replicas behind a router that spreads connections over every ready replica, as a Service
/// does: both are Ready (what lets a rolling update finish), one leads, and the standby passes every
/// verb to the leader, so every bind is the leader's; then the leader's SIGKILL and SIGTERM.
#[tokio::test(flavor = "current_thread")]
async fn two_replicas_fail_over_within_the_lease() {
    let _serial = SERIAL.lock().await;
    let mut st = stage("failover").await;
    let lease = Duration::from_secs(15);
    let retry = Duration::from_secs(2);
    let mut replicas = [Extender::start(&st.cp, "replica-a", 0, &[]), Extender::start(&st.cp, "replica-b", 0, &[])];
    let until = Instant::now() + Duration::from_secs(60);
    while !(replicas.iter().all(Extender::ready) && replicas.iter().any(Extender::leads)) {
        assert!(Instant::now() < until, "the replicas did not both turn ready:\n{}", replicas[0].proc.tail(30));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leads: Vec<bool> = replicas.iter().map(Extender::leads).collect();
    assert_eq!(leads.iter().filter(|l| **l).count(), 1, "exactly one leads: {leads:?}");
    assert!(replicas.iter().all(Extender::ready), "both stay ready, whichever leads");
    let leader = usize::from(!leads[0]);
    let standby = 1 - leader;
    // the standby reads the leader's URL from the Lease at its next election round
    let forwarding = format!("ready: standby, forwarding to the leader at {}", replicas[leader].url());
    let until = Instant::now() + 3 * retry;
    loop {
        let (_, role) = replicas[standby].get("/readyz").expect("/readyz");
        if role == forwarding {
            break;
        }
        assert!(Instant::now() < until, "the standby says {role:?}, not {forwarding:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let proxy = fleet::ReadyProxy::start(replicas.iter().map(|r| r.port).collect());
    st.cp.start_scheduler(&scheduler_config(), Some(&proxy.url()));
    let pre = storm_shapes(40);
    create_pods(&st.admin, NS, "pre", &pre).await;
    settle(&st.admin, NS, Duration::from_secs(3), Duration::from_secs(120)).await;

    // a filter and a bind sent to the standby itself, as kube-scheduler sends them: the leader
    // answers and binds (the pod names a scheduler nobody runs, so only these calls place it)
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let mut direct = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..fleet::Shape::default() }.pod("direct");
    direct.spec.as_mut().expect("spec").scheduler_name = Some("e2e-nobody".into());
    let direct = pods.create(&PostParams::default(), &direct).await.expect("create the direct pod");
    let names: Vec<&str> = st.nodes.iter().map(|n| n.name.as_str()).collect();
    let filter = json!({"Pod": direct, "NodeNames": names, "Nodes": null}).to_string();
    let (status, body) = fleet::http_post(replicas[standby].port, "/gpuplace/filter", &filter).expect("filter");
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("a filter answer");
    assert_eq!(answer["Error"], "", "{body}");
    let node = answer["NodeNames"][0].as_str().unwrap_or_else(|| panic!("no node fits: {body}")).to_string();
    let uid = direct.metadata.uid.clone().expect("uid");
    let bind = json!({"PodName": "direct", "PodNamespace": NS, "PodUID": uid, "Node": node}).to_string();
    let (status, body) = fleet::http_post(replicas[standby].port, "/gpuplace/bind", &bind).expect("bind");
    assert_eq!((status, body.as_str()), (200, r#"{"Error":""}"#));
    let bound = pods.get("direct").await.expect("the direct pod");
    assert_eq!(node_name(&bound), Some(node.as_str()));
    let key = format!("{NS}/direct");
    assert_eq!(decisions(&replicas[leader], "bind", Some(&key), Some("bound")), 1, "the leader bound it");
    assert_eq!(decisions(&replicas[standby], "bind", Some(&key), None), 0, "the standby only forwarded");
    // every bind so far, kube-scheduler's through either replica included, is the leader's
    let standby_metrics = replicas[standby].metrics();
    let forwarded = |verb: &str| {
        counter(&standby_metrics, "gpuplace_forwarded_requests_total", &format!("verb=\"{verb}\",result=\"answered\""))
    };
    let bound_now = wait_bound(&st.admin, NS, 0, Duration::ZERO).await;
    let leader_bound = bound_pods(&replicas[leader]);
    let leader_binds = leader_bound.len();
    figure(&format!(
        "failover: both replicas ready; through the standby {} filters, {} prioritizes and {} binds went to the leader; \
         {bound_now} pods bound, {leader_binds} by the leader, {} by the standby",
        forwarded("filter"),
        forwarded("prioritize"),
        forwarded("bind"),
        decisions(&replicas[standby], "bind", None, Some("bound")),
    ));
    assert!(forwarded("bind") >= 1.0, "no bind forwarded:\n{standby_metrics}");
    assert_eq!(decisions(&replicas[standby], "bind", None, Some("bound")), 0, "the standby bound pods itself");
    let snap = snapshot(&st.admin, NS).await;
    let not_by_leader: Vec<String> = snap
        .pods
        .iter()
        .filter(|p| node_name(p).is_some())
        .map(|p| format!("{NS}/{}", p.metadata.name.as_deref().unwrap_or_default()))
        .filter(|k| !leader_bound.contains(k))
        .collect();
    assert!(not_by_leader.is_empty(), "bound, but not by the leader: {not_by_leader:?}");
    Audit::of(&snap).assert_sound(false);

    // SIGKILL the leader: the standby takes the Lease once it expires and binds
    replicas[leader].proc.kill();
    let killed = Instant::now();
    let whole = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..fleet::Shape::default() };
    create_pods(&st.admin, NS, "post", &vec![whole.clone(); 10]).await;
    while !replicas[standby].leads() {
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "the standby never led:\n{}",
            replicas[standby].proc.tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let led_s = killed.elapsed().as_secs_f64();
    wait_bound(&st.admin, NS, bound_now + 1, Duration::from_secs(60)).await;
    let bound_s = killed.elapsed().as_secs_f64();
    figure(&format!(
        "failover: leader SIGKILLed; the standby led after {led_s:.1} s and bound its first pod after {bound_s:.1} s \
         (lease {lease:?}, retry {retry:?})"
    ));
    // the worst case is lease + 2 retries: the standby sees the leader's last renewal up to one retry
    // after it was written (it dates expiry from when it saw it, as client-go's observedTime does),
    // and checks for expiry once a retry; one more second for the API calls on this busy machine
    let worst = lease + 2 * retry + Duration::from_secs(1);
    assert!(led_s <= worst.as_secs_f64(), "the standby took {led_s:.1} s to lead, more than {worst:?}");

    // the killed replica comes back and turns ready as the standby (a rollout's new pod); SIGTERM on
    // the leader hands the Lease over at once
    let old = replicas[leader].identity.clone();
    replicas[leader] = Extender::start(&st.cp, &old, replicas[leader].port, &[]);
    let until = Instant::now() + Duration::from_secs(60);
    while !replicas[leader].ready() {
        assert!(
            Instant::now() < until,
            "the restarted replica never turned ready:\n{}",
            replicas[leader].proc.tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!replicas[leader].leads(), "two replicas lead");
    let termed = Instant::now();
    let status = replicas[standby].proc.terminate(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "the leader did not exit cleanly on SIGTERM: {status:?}");
    while !replicas[leader].leads() {
        assert!(termed.elapsed() < lease, "no hand-over within the lease:\n{}", replicas[leader].proc.tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handover_s = termed.elapsed().as_secs_f64();
    create_pods(&st.admin, NS, "after", &vec![whole; 5]).await;
    settle(&st.admin, NS, Duration::from_secs(3), Duration::from_secs(120)).await;
    figure(&format!("failover: SIGTERM on the leader; the standby led {handover_s:.1} s later"));
    assert!(handover_s <= (retry * 2).as_secs_f64() + 1.0, "SIGTERM hand-over took {handover_s:.1} s");
    let snap = snapshot(&st.admin, NS).await;
    let audit = Audit::of(&snap);
    audit.assert_sound(true);
    let after_bound = snap
        .pods
        .iter()
        .filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with("after")) && node_name(p).is_some())
        .count();
    figure(&format!(
        "failover: {after_bound} of 5 pods created after the hand-over bound; over-commits {}",
        audit.over_commits.len()
    ));
    assert!(after_bound > 0, "nothing bound after the SIGTERM hand-over");
}

#[tokio::test(flavor = "current_thread")]
async fn manifests_and_scheduler_configs_are_accepted_by_the_real_control_plane() {
    let _serial = SERIAL.lock().await;
    let cp = ControlPlane::start("manifests").await;
    let admin = cp.client(User::Admin).await;
    // namespaced objects are dry-run into them, so they must exist
    for file in ["scheduler-config/extender/namespace.yaml", "scheduler-config/device-plugin/namespace.yaml"] {
        for obj in yaml_objects(&repo().join(file)) {
            apply(&admin, &obj, false).await.expect("the namespace");
        }
    }
    let mut applied = Vec::new();
    let mut refused = Vec::new();
    let mut configs: Vec<(String, String)> = Vec::new();
    for file in yaml_files(&repo().join("scheduler-config")) {
        let rel = file.strip_prefix(repo()).unwrap_or(&file).display().to_string();
        for obj in yaml_objects(&file) {
            match obj["kind"].as_str() {
                Some("KubeSchedulerConfiguration") => {
                    configs.push((rel.clone(), serde_norway::to_string(&obj).expect("yaml")));
                    continue;
                }
                // kubeadm's own configuration, not an API object
                Some("ClusterConfiguration") => continue,
                // the Prometheus operator's kinds (scheduler-config/monitoring/): its CRDs are not
                // installed here; tests/monitoring.rs checks these objects
                Some("ServiceMonitor" | "PodMonitor" | "PrometheusRule") => continue,
                _ => {}
            }
            if let Some(data) = obj["data"].as_object() {
                for (key, v) in data {
                    if v.as_str().is_some_and(|t| t.contains("kind: KubeSchedulerConfiguration")) {
                        configs.push((format!("{rel}#{key}"), v.as_str().unwrap_or_default().to_string()));
                    }
                }
            }
            match apply(&admin, &obj, true).await {
                Ok(id) => applied.push(id),
                Err(e) => refused.push(format!("{rel}: {e}")),
            }
        }
    }
    figure(&format!(
        "manifests: {} objects accepted by server-side dry-run apply, {} refused",
        applied.len(),
        refused.len()
    ));
    assert!(refused.is_empty(), "refused by the API server: {refused:#?}");
    assert!(applied.len() >= 10, "too few objects found: {applied:?}");
    let mut loaded = 0;
    for (name, text) in &configs {
        cp.scheduler_loads(name, text).unwrap_or_else(|e| panic!("{name} does not load in kube-scheduler:\n{e}"));
        loaded += 1;
    }
    figure(&format!(
        "manifests: {loaded} scheduler configurations load in kube-scheduler: {:?}",
        configs.iter().map(|c| &c.0).collect::<Vec<_>>()
    ));
    assert!(loaded >= 2, "expected the reference config and the second profile's: {configs:?}");
    // the check can fail: a config kube-scheduler refuses (an extender weight of 0) does not load
    let broken = configs[0].1.replace("weight: 10", "weight: 0");
    assert_ne!(broken, configs[0].1, "the reference config no longer has weight: 10");
    assert!(cp.scheduler_loads("broken", &broken).is_err(), "kube-scheduler loaded an invalid extender weight");
}

/// Waits until kube-scheduler leads (it only schedules then).
async fn wait_scheduler_leading(cp: &mut ControlPlane) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let s = cp.scheduler.as_mut().expect("a scheduler");
        if std::fs::read_to_string(&s.log).unwrap_or_default().matches("Successfully acquired lease").count() > 0 {
            return;
        }
        assert!(s.running(), "kube-scheduler exited:\n{}", s.tail(30));
        assert!(Instant::now() < until, "kube-scheduler never led:\n{}", s.tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn whole_gpu_pods_per_second_with_and_without_the_extender() {
    let _serial = SERIAL.lock().await;
    let (mut st, ext) = stage_with_extender("throughput").await;
    let gpus: u32 = st.nodes.iter().map(|n| n.gpus).sum();
    // whole GPUs through gpuplace.io/gpu only, no more than there are GPUs: both can place them all
    let n = 100.min(gpus as usize);
    let whole = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..fleet::Shape::default() };
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let mut rates = BTreeMap::new();
    for (label, url) in [("kube-scheduler alone", None), ("kube-scheduler with gpuplace", Some(ext.url()))] {
        // the scheduler log is rewritten per start: a fresh file per run
        let _ = std::fs::remove_file(st.cp.dir.join("kube-scheduler.log"));
        st.cp.start_scheduler(&scheduler_config(), url.as_deref());
        wait_scheduler_leading(&mut st.cp).await;
        let started = Instant::now();
        create_pods(&st.admin, NS, "tp", &vec![whole.clone(); n]).await;
        let bound = wait_bound(&st.admin, NS, n, Duration::from_secs(180)).await;
        let secs = started.elapsed().as_secs_f64();
        assert_eq!(bound, n, "{label}: only {bound} of {n} bound");
        let rate = n as f64 / secs;
        figure(&format!("throughput: {label}: {n} whole-GPU pods bound in {secs:.2} s, {rate:.1} pods/s"));
        rates.insert(label, rate);
        delete_all(&pods, &ext).await;
    }
    let ratio = rates["kube-scheduler with gpuplace"] / rates["kube-scheduler alone"];
    figure(&format!("throughput: with the extender / alone = {ratio:.2}"));
    assert!(ratio > 0.1, "the extender slows binding down tenfold: {ratio:.2}");
    latency_figure("throughput", &ext.placement_log);
}

/// Deletes every pod of `pods` and waits until they are gone and the extender has released them
/// (its watch saw the deletions), so that the next run starts on idle GPUs.
async fn delete_all(pods: &Api<Pod>, ext: &Extender) {
    pods.delete_collection(&DeleteParams::default().grace_period(0), &Default::default()).await.expect("delete pods");
    let until = Instant::now() + Duration::from_secs(60);
    while !pods.list(&Default::default()).await.expect("list").items.is_empty() {
        assert!(Instant::now() < until, "pods not deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let until = Instant::now() + Duration::from_secs(30);
    while inspect(ext).nodes.iter().flat_map(|n| &n.gpus).any(|g| !g.holders.is_empty()) {
        assert!(Instant::now() < until, "the extender still counts deleted pods");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Holders (pod names) of `node`'s GPUs in `/inspect`.
fn inspect_holders(ext: &Extender, node: &str) -> std::collections::BTreeSet<String> {
    inspect(ext)
        .nodes
        .iter()
        .filter(|n| n.name == node)
        .flat_map(|n| n.gpus.iter().flat_map(|g| g.holders.iter().map(|h| h.pod.clone())))
        .collect()
}

/// A pod of `shape` on `node`: pinned by nodeSelector (for kube-scheduler), or bound directly with
/// `spec.nodeName`, or left to no scheduler at all (`schedulerName` nobody serves: stays pending).
enum Placed<'a> {
    Pinned(&'a str),
    Direct(&'a str),
    Unscheduled,
}

fn placed_pod(shape: &fleet::Shape, name: &str, how: Placed, assignment: Option<&str>) -> Pod {
    let mut pod = shape.pod(name);
    let spec = pod.spec.get_or_insert_with(Default::default);
    match how {
        Placed::Pinned(node) => {
            spec.node_selector = Some(BTreeMap::from([("kubernetes.io/hostname".into(), node.into())]))
        }
        Placed::Direct(node) => spec.node_name = Some(node.into()),
        Placed::Unscheduled => spec.scheduler_name = Some("e2e-nobody".into()),
    }
    if let Some(text) = assignment {
        pod.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(gpuplace_core::annotations::ANNOTATION_ASSIGNMENT.into(), text.into());
    }
    pod
}

/// Whether `pod` stays unbound for `d` (polled).
async fn stays_pending(pods: &Api<Pod>, pod: &str, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if pods.get(pod).await.ok().as_ref().and_then(node_name).is_some() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    true
}

/// Scenario d: what anyone who can edit pods can write, aimed at the 8 GPUs a genuine pod holds on
/// gpu-00: its annotation replayed on a pod bound directly with `spec.nodeName`, rewritten for the
/// forger's own UID with a bindSeq far ahead (its MAC kept, now wrong) and bound by a Binding of the
/// forger's, and copied onto a pod that stays unbound. The forgers' names sort before `genuine`
/// (collisions at a rebuild were once settled in name order). While the extender runs and after a
/// SIGKILL and restart: only the genuine pod holds the GPUs, a pod pinned to the node stays pending,
/// and once the forgers and then the genuine pod are gone it binds, continuing the genuine bind
/// sequence.
#[tokio::test(flavor = "current_thread")]
async fn forged_assignments_are_never_counted() {
    use gpuplace_core::annotations::{AssignmentAnnotation, ANNOTATION_ASSIGNMENT};
    use k8s_openapi::api::core::v1::{Binding, Event, ObjectReference};
    use kube::api::{ListParams, Patch, PatchParams};

    let _serial = SERIAL.lock().await;
    let (mut st, ext) = stage_with_extender("forgery").await;
    st.cp.start_scheduler(&scheduler_config(), Some(&ext.url()));
    let node = st.nodes[0].name.clone();
    assert_eq!(st.nodes[0].gpus, 8, "gpu-00 is an 8-GPU board");
    let whole_node = fleet::Shape { gpu: Some("8"), kind: "whole-node", ..Default::default() };
    let one = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..Default::default() };
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let pp = PostParams::default();

    pods.create(&pp, &placed_pod(&whole_node, "genuine", Placed::Pinned(&node), None)).await.expect("genuine");
    assert_eq!(wait_bound(&st.admin, NS, 1, Duration::from_secs(60)).await, 1, "genuine not bound");
    let genuine_pod = pods.get("genuine").await.expect("genuine");
    assert_eq!(node_name(&genuine_pod), Some(node.as_str()));
    let text = genuine_pod.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ASSIGNMENT)).cloned();
    let text = text.expect("the genuine pod's assignment");
    let genuine = AssignmentAnnotation::parse(&text).expect("a valid assignment");

    // 1. replayed verbatim on a pod bound directly: the MAC holds, the UID not
    pods.create(&pp, &placed_pod(&whole_node, "a-replay", Placed::Direct(&node), Some(&text))).await.expect("a-replay");
    // 2. rewritten for the forger's own UID, bindSeq 100, bound by the forger's own Binding
    let forger =
        pods.create(&pp, &placed_pod(&whole_node, "a-forge", Placed::Unscheduled, None)).await.expect("a-forge");
    let own_uid = forger.metadata.uid.clone().expect("a UID");
    let rewritten = AssignmentAnnotation { pod_uid: own_uid.clone(), bind_seq: 100, ..genuine.clone() }.to_json();
    let patch = json!({"metadata": {"annotations": {ANNOTATION_ASSIGNMENT: rewritten}}});
    pods.patch("a-forge", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("annotate a-forge");
    let binding = Binding {
        metadata: kube::api::ObjectMeta { name: Some("a-forge".into()), uid: Some(own_uid), ..Default::default() },
        target: ObjectReference { kind: Some("Node".into()), name: Some(node.clone()), ..Default::default() },
    };
    pods.create_subresource::<_, Value>("binding", "a-forge", &pp, &binding).await.expect("the forger's Binding");
    // 3. copied onto a pod nobody binds
    pods.create(&pp, &placed_pod(&whole_node, "a-unbound", Placed::Unscheduled, Some(&text))).await.expect("a-unbound");

    let events: Api<Event> = Api::namespaced(st.admin.clone(), NS);
    let not_trusted = || async {
        let list = events.list(&ListParams::default()).await.expect("events").items;
        list.into_iter()
            .filter(|e| e.reason.as_deref() == Some(gpuplace_core::api_client::events::REASON_ASSIGNMENT))
            .filter_map(|e| e.involved_object.name)
            .collect::<std::collections::BTreeSet<String>>()
    };
    let until = Instant::now() + Duration::from_secs(30);
    while not_trusted().await.len() < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let reported = not_trusted().await;
    let genuine_only = std::collections::BTreeSet::from([format!("{NS}/genuine")]);
    let running_holders = inspect_holders(&ext, &node);
    let bad = counter(&ext.metrics(), "gpuplace_conflicts_total", "kind=\"bad_assignment\"");
    pods.create(&pp, &placed_pod(&one, "late", Placed::Pinned(&node), None)).await.expect("late");
    let late_pending_running = stays_pending(&pods, "late", Duration::from_secs(5)).await;
    figure(&format!(
        "forgery: while running: holders of {node} {running_holders:?}, AssignmentNotTrusted on {reported:?}, \
         bad_assignment conflicts {bad}, a pod pinned to the node pending: {late_pending_running}"
    ));
    assert_eq!(running_holders, genuine_only, "a forged assignment was counted");
    assert!(reported.contains("a-replay") && reported.contains("a-forge"), "not reported: {reported:?}");
    assert!(bad >= 2.0);
    assert!(late_pending_running, "a second pod was placed on the genuine pod's GPUs");

    // across a restart (the rebuild settles collisions): still only the genuine pod
    let mut ext = ext;
    ext.proc.kill();
    let mut ext = Extender::start(&st.cp, "replica-a", ext.port, &[]);
    ext.wait_ready(Duration::from_secs(60)).await;
    let restarted_holders = inspect_holders(&ext, &node);
    for pod in ["a-replay", "a-forge", "a-unbound"] {
        pods.delete(pod, &DeleteParams::default()).await.expect("delete a forger");
    }
    let late_pending_restarted = stays_pending(&pods, "late", Duration::from_secs(8)).await;
    figure(&format!(
        "forgery: after a SIGKILL and restart: holders of {node} {restarted_holders:?}; forgers deleted, \
         the pinned pod pending: {late_pending_restarted}"
    ));
    assert_eq!(restarted_holders, genuine_only, "a forged assignment was counted at the rebuild");
    assert!(late_pending_restarted, "the forgers' deletion freed the genuine pod's GPUs");

    // the genuine pod gone: the pinned pod binds, continuing the genuine sequence
    pods.delete("genuine", &DeleteParams::default()).await.expect("delete genuine");
    let until = Instant::now() + Duration::from_secs(60);
    let late = loop {
        let p = pods.get("late").await.expect("late");
        if node_name(&p).is_some() || Instant::now() > until {
            break p;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(node_name(&late), Some(node.as_str()), "the pinned pod was not bound once the GPUs were free");
    let late_text = late.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ASSIGNMENT)).cloned();
    let seq = AssignmentAnnotation::parse(&late_text.expect("late's assignment")).expect("valid").bind_seq;
    let requeued = counter(&ext.metrics(), "gpuplace_requeued_pods_total", "result=\"annotated\"");
    figure(&format!(
        "forgery: the genuine pod deleted: the pinned pod bound with bindSeq {seq} (genuine {}, forged 100); \
         requeued by the extender {requeued} time(s) (when kube-scheduler retried it before the extender saw the deletion)",
        genuine.bind_seq
    ));
    assert_eq!(seq, genuine.bind_seq + 1, "the bind sequence did not continue the genuine one");
    let audit = Audit::of(&snapshot(&st.admin, NS).await);
    audit.assert_sound(true);
    let diffs = audit.compare_inspect(&inspect(&ext));
    assert!(diffs.is_empty(), "/inspect differs from the annotations: {diffs:#?}");
}

/// kube-scheduler's own Binding calls in one run, from its `-v=6` log: (the call's latency, the
/// wait in its client's rate limiter before it), ms, one per pod.
fn scheduler_binding_calls(log: &std::path::Path) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let pod = |l: &str| Some(l.split("/pods/").nth(1)?.split('/').next()?.to_string());
    let (mut waited, mut took) = (BTreeMap::new(), BTreeMap::new());
    for l in text.lines().filter(|l| l.contains("/binding")) {
        let Some(p) = pod(l) else { continue };
        if l.contains("Waited before sending request") {
            // delay="1.003583279s" or "52.1ms"
            let d = l.split("delay=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("");
            let ms = d
                .strip_suffix("ms")
                .and_then(|v| v.parse::<f64>().ok())
                .or_else(|| d.strip_suffix('s').and_then(|v| v.parse::<f64>().ok()).map(|v| v * 1e3));
            waited.insert(p, ms.unwrap_or(f64::NAN));
        } else if l.contains("\"Response\"") {
            if let Some(ms) = l.split("milliseconds=").nth(1).and_then(|r| r.split_whitespace().next()?.parse().ok()) {
                took.insert(p, ms);
            }
        }
    }
    took.into_iter().map(|(p, ms)| (ms, waited.get(&p).copied().unwrap_or(0.0))).collect()
}

/// A measurement for docs/performance.md, not a check (`cargo test -p gpuplace --test e2e --
/// --ignored --nocapture binds_in_a_burst`, about a minute): 300 whole-GPU pods created as fast as
/// the API server takes them (25 in flight), bound once by kube-scheduler alone (its own binder) and
/// once through gpuplace, on the same nodes. kube-scheduler runs at `-v=6` in both, which logs each
/// of its API calls with its latency and each wait in its client's rate limiter. The question: how
/// fast can any binder bind while the API server on these cores is taking a burst of creates.
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md"]
async fn binds_in_a_burst_of_creates_by_kube_scheduler_alone_and_through_gpuplace() {
    let _serial = SERIAL.lock().await;
    let (mut st, ext) = stage_with_extender("burst").await;
    st.cp.scheduler_verbosity = "6".into();
    let whole = fleet::Shape { gpu: Some("1"), kind: "whole-1", ..fleet::Shape::default() };
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    for (label, url) in [("kube-scheduler alone", None), ("through gpuplace", Some(ext.url()))] {
        let _ = std::fs::remove_file(st.cp.dir.join("kube-scheduler.log"));
        st.cp.start_scheduler(&scheduler_config(), url.as_deref());
        wait_scheduler_leading(&mut st.cp).await;
        let began_ms = unix_ms();
        let started = Instant::now();
        create_pods(&st.admin, NS, "burst", &vec![whole.clone(); 300]).await;
        let created_s = started.elapsed().as_secs_f64();
        let creates_done_ms = unix_ms();
        settle(&st.admin, NS, Duration::from_secs(4), Duration::from_secs(300)).await;
        let bound = wait_bound(&st.admin, NS, 300, Duration::ZERO).await;
        figure(&format!("burst, {label}: 300 pods created in {created_s:.2} s, {bound} bound"));
        let calls = scheduler_binding_calls(&st.cp.dir.join("kube-scheduler.log"));
        if url.is_none() {
            assert_eq!(calls.len(), bound, "kube-scheduler's -v=6 log shows a Binding call per bound pod");
            figure(&spread(&format!("burst, {label}: its Binding calls"), calls.iter().map(|c| c.0).collect()));
            figure(&spread(
                &format!("burst, {label}: its Binding calls with the wait in its rate limiter"),
                calls.iter().map(|c| c.0 + c.1).collect(),
            ));
        } else {
            assert!(calls.is_empty(), "kube-scheduler bound pods itself while gpuplace binds");
            // this run's binds that bound (a bind can also be refused: the GPU went to a pod whose
            // bind came first, and kube-scheduler tries again)
            let binds: Vec<f64> = log_lines(&ext.placement_log, "bind")
                .iter()
                .filter(|d| d["outcome"] == "bound")
                .filter_map(began_and_latency)
                .filter(|(began, _)| *began >= began_ms)
                .map(|(_, ms)| ms)
                .collect();
            assert_eq!(binds.len(), bound, "the placement log shows a bind per bound pod");
            figure(&spread(&format!("burst, {label}: its binds"), binds));
            burst_figure(&format!("burst, {label}"), &ext.placement_log, began_ms, creates_done_ms);
        }
        delete_all(&pods, &ext).await;
    }
}
