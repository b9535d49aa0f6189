//! Groups placed whole on the real control plane: kube-scheduler 1.36's gangs (PodGroup with
//! `minCount` and a ToR topology key) and gpuplace's own group labels, on 16 nodes of 8 H100s (4 per
//! ToR) with exactly 3 ToRs wholly free; a cluster fragmented by share pods with jobs and fractional
//! trial groups; a planned node deleted and the extender killed (SIGKILL) while a plan waits for its
//! last members. Each prints its figures as `e2e figure: groups: …` lines.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod, PodSchedulingGate, PodSchedulingGroup};
use k8s_openapi::api::scheduling::v1alpha2::PodGroup;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};

use crate::audit::{node_name, snapshot, Audit, Snapshot};
use crate::cluster::{figure, ControlPlane, User};
use crate::fleet::{start_nodes_of, wait_inventories, Extender, Shape};
use crate::{install, log_lines, scheduler_config, Stage, NS, SERIAL};

const H100: &str = "hgx-h100-8";
const TOR: &str = "network.gpuplace.io/tor";
const SPINE: &str = "network.gpuplace.io/spine";

/// 16 nodes of 8 H100s (4 per ToR), the extender ready, kube-scheduler with the project's config;
/// `gangs`: the control plane serves PodGroups and kube-scheduler runs its gang plugins.
async fn h100_stage(name: &str, gangs: bool) -> (Stage, Extender) {
    h100_stage_of(name, gangs, 16).await
}

/// [`h100_stage`] with `n` nodes (4 per ToR, 8 per spine).
async fn h100_stage_of(name: &str, gangs: bool, n: usize) -> (Stage, Extender) {
    let mut cp = if gangs { ControlPlane::start_with_gangs(name).await } else { ControlPlane::start(name).await };
    let admin = cp.client(User::Admin).await;
    install(&admin).await;
    let mut nodes = start_nodes_of(&cp, n, &[H100]).await;
    wait_inventories(&cp, &mut nodes).await;
    // a line per filter call: the figures count calls per second per waiting group from the log
    let mut ext = Extender::start(&cp, "replica-a", 0, &["--placement-log-every-call"]);
    ext.wait_ready(Duration::from_secs(60)).await;
    cp.start_scheduler(&scheduler_config(), Some(&ext.url()));
    (Stage { cp, admin, nodes }, ext)
}

fn whole(gpus: &'static str) -> Shape {
    Shape { gpu: Some(gpus), kind: "group", ..Shape::default() }
}

/// The pods of one job: `gpuplace.io/group` and its size, plus `spec.schedulingGroup` when the job
/// is a PodGroup.
fn job_pods(job: &str, n: usize, shape: &Shape, pod_group: bool) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            let mut s = shape.clone();
            s.labels.push(("gpuplace.io/group", job.to_string()));
            s.annotations.push(("gpuplace.io/group-size", n.to_string()));
            let mut pod = s.pod(&format!("{job}-{i}"));
            if pod_group {
                if let Some(spec) = pod.spec.as_mut() {
                    spec.scheduling_group = Some(PodSchedulingGroup { pod_group_name: Some(job.to_string()) });
                }
            }
            pod
        })
        .collect()
}

async fn create(client: &Client, pods: Vec<Pod>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    for p in pods {
        let name = p.name_any();
        api.create(&PostParams::default(), &p).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
    }
}

async fn create_pod_group(client: &Client, name: &str, min_count: usize, topology: Option<&str>) {
    let mut spec = json!({ "schedulingPolicy": { "gang": { "minCount": min_count } } });
    if let Some(key) = topology {
        spec["schedulingConstraints"] = json!({ "topology": [ { "key": key } ] });
    }
    let pg: PodGroup = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
        "metadata": { "name": name, "namespace": NS }, "spec": spec,
    }))
    .expect("a PodGroup");
    Api::<PodGroup>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &pg)
        .await
        .unwrap_or_else(|e| panic!("create PodGroup {name}: {e}"));
}

/// One single pod pinned to `node` by a node selector (kube-scheduler offers the extender that node
/// alone), bound before the function returns.
async fn pin(client: &Client, name: &str, node: &str, shape: Shape) {
    let mut pod = shape.pod(name);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_selector = Some(BTreeMap::from([("kubernetes.io/hostname".to_string(), node.to_string())]));
    }
    create(client, vec![pod]).await;
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let until = Instant::now() + Duration::from_secs(60);
    while api.get(name).await.ok().and_then(|p| p.spec.and_then(|s| s.node_name)).is_none() {
        assert!(Instant::now() < until, "{name} not bound to {node} in 60 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls until the number of bound pods of the namespace reaches `min` and then stays the same for
/// `quiet`; returns it.
async fn wait_stable(client: &Client, min: usize, quiet: Duration, limit: Duration) -> usize {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let until = Instant::now() + limit;
    let (mut last, mut since) = (usize::MAX, Instant::now());
    loop {
        let bound = api
            .list(&Default::default())
            .await
            .expect("list pods")
            .items
            .iter()
            .filter(|p| node_name(p).is_some())
            .count();
        if bound != last {
            (last, since) = (bound, Instant::now());
        }
        if bound >= min && since.elapsed() >= quiet {
            return bound;
        }
        assert!(Instant::now() < until, "only {bound} pods bound (wanted {min} and a quiet {quiet:?})");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Per job (the `gpuplace.io/group` label): pods, pods bound, ToRs of the bound ones, GPUs they hold.
#[derive(Debug, Default)]
struct Job {
    pods: usize,
    bound: usize,
    tors: BTreeSet<String>,
    nodes: BTreeSet<String>,
    gpus: f64,
}

fn jobs(s: &Snapshot) -> BTreeMap<String, Job> {
    let tor: BTreeMap<String, String> =
        s.nodes.iter().map(|n| (n.name_any(), n.labels().get(TOR).cloned().unwrap_or_default())).collect();
    let mut out: BTreeMap<String, Job> = BTreeMap::new();
    for p in &s.pods {
        let Some(job) = p.labels().get("gpuplace.io/group") else { continue };
        let j = out.entry(job.clone()).or_default();
        j.pods += 1;
        if let Some(node) = node_name(p) {
            j.bound += 1;
            j.tors.insert(tor.get(node).cloned().unwrap_or_default());
            j.nodes.insert(node.to_string());
            j.gpus += gpus_of(p);
        }
    }
    out
}

/// GPUs' worth a pod asks for (a share by its compute percent).
fn gpus_of(p: &Pod) -> f64 {
    let limits = p.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.resources.as_ref()?.limits.clone());
    let get = |k: &str| limits.as_ref().and_then(|l| l.get(k)).and_then(|q| q.0.parse::<f64>().ok());
    let n = get("gpuplace.io/gpu").unwrap_or(0.0);
    get("gpuplace.io/gpu-core").map_or(n, |c| n * c / 100.0)
}

/// Filter calls per second for the pods of `pods` (placement log lines of pods whose name starts
/// with one of the prefixes) over the last `window`.
fn filter_rate(ext: &Extender, prefixes: &[String], from_ms: f64, to_ms: f64) -> f64 {
    let n = log_lines(&ext.placement_log, "filter")
        .iter()
        .filter(|d| d["ts_unix_ms"].as_f64().is_some_and(|t| t >= from_ms && t < to_ms))
        .filter(|d| {
            let pod = d["pod"].as_str().unwrap_or("");
            let name = pod.split_once('/').map_or(pod, |(_, n)| n);
            prefixes.iter().any(|p| name.starts_with(p.as_str()))
        })
        .count();
    n as f64 / ((to_ms - from_ms) / 1000.0)
}

/// Binds refused (placement log `bind` lines with an error) for pods of a group.
fn group_bind_refusals(ext: &Extender) -> Vec<Value> {
    log_lines(&ext.placement_log, "bind")
        .into_iter()
        .filter(|d| d["error"].is_string() && d["group"].is_string())
        .collect()
}

fn unix_ms() -> f64 {
    crate::unix_ms()
}

/// The checks every scenario makes: no over-commit, no incomplete group holding GPUs, and the
/// extender's records equal to the annotations.
fn sound(name: &str, s: &Snapshot, ext: &Extender) -> BTreeMap<String, Job> {
    let audit = Audit::of(s);
    let js = jobs(s);
    let partial: Vec<(&String, &Job)> = js.iter().filter(|(_, j)| j.bound > 0 && j.bound < j.pods).collect();
    let held: f64 = partial.iter().map(|(_, j)| j.gpus).sum::<f64>() + 0.0;
    let refusals = group_bind_refusals(ext);
    let member_binds = log_lines(&ext.placement_log, "bind").iter().filter(|d| d["group"].is_string()).count();
    let bound_members: usize = js.values().map(|j| j.bound).sum();
    assert!(
        member_binds >= bound_members,
        "{name}: {member_binds} bind lines of group members for {bound_members} bound"
    );
    let diffs = audit.compare_inspect(&crate::inspect(ext));
    figure(&format!(
        "groups: {name}: over-commits {}, jobs partly bound {}, GPUs held by incomplete groups {held}, \
         bind refusals of group members {}, /inspect differences {}",
        audit.over_commits.len(),
        partial.len(),
        refusals.len(),
        diffs.len()
    ));
    for (job, j) in &js {
        figure(&format!("groups: {name}: {job}: {} of {} bound on ToR(s) {:?}", j.bound, j.pods, j.tors));
    }
    assert!(audit.over_commits.is_empty(), "{name}: over-commits {:#?}", audit.over_commits);
    assert!(partial.is_empty(), "{name}: partly bound jobs {partial:#?}");
    assert!(refusals.is_empty(), "{name}: group members' binds refused: {refusals:#?}");
    assert!(diffs.is_empty(), "{name}: /inspect differs from the annotations: {diffs:#?}");
    js
}

/// Measures the filter calls of the waiting jobs and of one single pod that fits nowhere, over 15 s.
async fn retry_rates(name: &str, st: &Stage, ext: &Extender, waiting: &[String]) {
    let lonely = Shape {
        gpu: Some("1"),
        annotations: vec![("gpuplace.io/gpu-model", "NoSuchGPU".into())],
        kind: "lonely",
        ..Shape::default()
    };
    create(&st.admin, vec![lonely.pod("lonely")]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let from = unix_ms();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let to = unix_ms();
    let per_group = if waiting.is_empty() {
        0.0
    } else {
        filter_rate(ext, &waiting.iter().map(|j| format!("{j}-")).collect::<Vec<_>>(), from, to) / waiting.len() as f64
    };
    let single = filter_rate(ext, &["lonely".to_string()], from, to);
    figure(&format!(
        "groups: {name}: filter calls per second per waiting group {per_group:.2} ({} groups waiting), \
         for one single pod that fits nowhere {single:.2} (15 s window)",
        waiting.len()
    ));
    // a waiting group costs about what a pending single pod costs (kube-scheduler backs both off)
    assert!(per_group < 20.0, "{name}: a waiting group drew {per_group:.1} filter calls a second");
}

/// 5 jobs of 4 pods x 8 GPUs on a cluster with exactly 3 free ToRs: 3 jobs whole (one ToR each) and
/// 2 with no pod bound.
async fn five_jobs_on_three_free_tors(name: &str, pod_groups: bool) {
    let (st, ext) = h100_stage(name, pod_groups).await;
    // one GPU in use on tor-3: exactly 3 ToRs stay wholly free
    pin(&st.admin, "filler", "gpu-15", whole("1")).await;
    let names: Vec<String> = (0..5).map(|j| format!("job-{j}")).collect();
    let started = Instant::now();
    for job in &names {
        if pod_groups {
            create_pod_group(&st.admin, job, 4, Some(TOR)).await;
        }
        create(&st.admin, job_pods(job, 4, &whole("8"), pod_groups)).await;
    }
    let bound = wait_stable(&st.admin, 13, Duration::from_secs(8), Duration::from_secs(180)).await;
    figure(&format!("groups: {name}: {bound} pods bound, stable after {:.1} s", started.elapsed().as_secs_f64()));
    let js = sound(name, &snapshot(&st.admin, NS).await, &ext);
    let whole_jobs: Vec<&Job> = js.values().filter(|j| j.bound == j.pods).collect();
    let empty = js.values().filter(|j| j.bound == 0).count();
    figure(&format!("groups: {name}: {} jobs whole, {empty} with no pod bound", whole_jobs.len()));
    assert_eq!(whole_jobs.len(), 3, "{js:#?}");
    assert_eq!(empty, 2, "{js:#?}");
    assert!(whole_jobs.iter().all(|j| j.tors.len() == 1 && j.nodes.len() == 4), "{js:#?}");
    let waiting: Vec<String> = js.iter().filter(|(_, j)| j.bound == 0).map(|(k, _)| k.clone()).collect();
    retry_rates(name, &st, &ext, &waiting).await;
    let m = ext.metrics();
    figure(&format!(
        "groups: {name}: metrics: {}",
        m.lines().filter(|l| l.starts_with("gpuplace_group")).collect::<Vec<_>>().join("; ")
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn gangs_of_pod_groups_on_three_free_tors() {
    let _serial = SERIAL.lock().await;
    five_jobs_on_three_free_tors("podgroups", true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn groups_by_label_on_three_free_tors() {
    let _serial = SERIAL.lock().await;
    five_jobs_on_three_free_tors("labels", false).await;
}

/// Share pods first, then jobs of 4 x 4 GPUs and two groups of 8 trials of a quarter GPU, through
/// both front doors at once (job-0, job-2 and trials-0 are PodGroups, the others labels only): no
/// job partly bound, each job that fits under one ToR placed under one, each trial group on one node.
#[tokio::test(flavor = "current_thread")]
async fn jobs_and_fractional_trials_on_a_cluster_fragmented_by_shares() {
    let _serial = SERIAL.lock().await;
    let (st, ext) = h100_stage("fragmented", true).await;
    let share = Shape { gpu: Some("1"), core: Some("30"), kind: "share", ..Shape::default() };
    let shares: Vec<Pod> = (0..24).map(|i| share.pod(&format!("share-{i}"))).collect();
    create(&st.admin, shares).await;
    wait_stable(&st.admin, 24, Duration::from_secs(3), Duration::from_secs(120)).await;
    let quarter = Shape { gpu: Some("1"), core: Some("25"), kind: "trial", ..Shape::default() };
    for j in 0..3 {
        let (name, pod_group) = (format!("job-{j}"), j % 2 == 0);
        if pod_group {
            create_pod_group(&st.admin, &name, 4, Some(TOR)).await;
        }
        create(&st.admin, job_pods(&name, 4, &whole("4"), pod_group)).await;
    }
    for t in 0..2 {
        let (name, pod_group) = (format!("trials-{t}"), t == 0);
        if pod_group {
            create_pod_group(&st.admin, &name, 8, None).await;
        }
        create(&st.admin, job_pods(&name, 8, &quarter, pod_group)).await;
    }
    let bound = wait_stable(&st.admin, 24 + 12 + 16, Duration::from_secs(6), Duration::from_secs(180)).await;
    figure(&format!("groups: fragmented: {bound} pods bound"));
    let js = sound("fragmented", &snapshot(&st.admin, NS).await, &ext);
    for (name, j) in &js {
        assert_eq!(j.bound, j.pods, "{name}: {js:#?}");
        if name.starts_with("trials") {
            assert_eq!(j.nodes.len(), 1, "{name} spread over {:?}", j.nodes);
        } else {
            assert_eq!(j.tors.len(), 1, "{name} spread over {:?}", j.tors);
        }
    }
}

/// A job of 4 x 8 GPUs whose last two pods are held back by a scheduling gate of their own: they
/// exist (a group reserves only for pods that exist, issue 48), so its plan holds two nodes for them.
/// One of those nodes is deleted (the plan is made again), then the extender is killed (SIGKILL) and
/// restarted (plans are in memory: rebuilt from the bound members); the last two pods are then
/// released. The job ends whole, nothing is over-committed, and a single pod never takes a reserved
/// GPU.
#[tokio::test(flavor = "current_thread")]
async fn a_planned_node_deleted_and_the_extender_killed_while_a_plan_waits() {
    let _serial = SERIAL.lock().await;
    let (mut st, mut ext) = h100_stage("replan", false).await;
    let mut first = job_pods("job", 4, &whole("8"), false);
    let mut last = first.split_off(2);
    for p in &mut last {
        let spec = p.spec.get_or_insert_with(Default::default);
        spec.scheduling_gates = Some(vec![PodSchedulingGate { name: "e2e.gpuplace.io/late".into() }]);
    }
    let late: Vec<String> = last.iter().map(|p| p.name_any()).collect();
    // the late ones first, so the extender has seen all four when the first two are filtered
    create(&st.admin, last).await;
    create(&st.admin, first).await;
    wait_stable(&st.admin, 2, Duration::from_secs(2), Duration::from_secs(60)).await;
    let report = crate::inspect(&ext);
    let g = report.groups.iter().find(|g| g.group == format!("{NS}/job")).expect("the job in /inspect");
    let reserved: Vec<String> = g.reserved.iter().map(|r| r.node.clone()).collect();
    figure(&format!(
        "groups: replan: 2 of 4 bound, {} GPUs reserved on {reserved:?} in {:?}",
        g.reserved.len() * 8,
        g.domain
    ));
    assert_eq!(reserved.len(), 2);
    // a node deleted under the plan: its plugin stops with it
    let gone = reserved[0].clone();
    if let Some(n) = st.nodes.iter_mut().find(|n| n.name == gone) {
        if let Some(mut p) = n.plugin.take() {
            p.kill();
        }
    }
    Api::<Node>::all(st.admin.clone()).delete(&gone, &DeleteParams::default()).await.expect("delete the node");
    let until = Instant::now() + Duration::from_secs(20);
    while crate::inspect(&ext).groups.iter().any(|g| g.reserved.iter().any(|r| r.node == gone)) {
        assert!(Instant::now() < until, "the plan still holds the deleted node {gone}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // killed and restarted while the job waits
    ext.proc.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ext2 = Extender::start(&st.cp, "replica-a", ext.port, &["--placement-log-every-call"]);
    ext2.wait_ready(Duration::from_secs(60)).await;
    let pods: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
    let ungate = json!({"spec": {"schedulingGates": null}});
    for name in &late {
        pods.patch(name, &PatchParams::default(), &Patch::Merge(&ungate)).await.expect("lift the late pod's gate");
    }
    let bound = wait_stable(&st.admin, 4, Duration::from_secs(4), Duration::from_secs(120)).await;
    let s = snapshot(&st.admin, NS).await;
    let js = sound("replan", &s, &ext2);
    figure(&format!(
        "groups: replan: after the node deletion and the SIGKILL, {bound} bound; job on {:?}",
        js["job"].nodes
    ));
    assert_eq!(js["job"].bound, 4);
    assert!(!js["job"].nodes.contains(&gone));
}

/// Whether the extender restarts between the shares and the jobs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Restart {
    No,
    /// Stopped (SIGTERM) and started again, its learned mix kept in a `--mix-state` file.
    WithMixState,
    /// Killed (SIGKILL) and started again with a fresh mix.
    Fresh,
}

/// Issue 30's sequence: 40 single-GPU shares of 20-40 GiB (15 GPUs of work) first, on 32 empty
/// nodes of 8 H100s whose device plugins publish live utilization; then 4 jobs of 2 x 8 GPUs under
/// one ToR and 2 of 8 x 8 under one spine, as PodGroups. The shares consolidate on at most 3 nodes
/// and every job starts whole under its switch.
#[tokio::test(flavor = "current_thread")]
async fn shares_first_then_jobs_on_empty_nodes() {
    let _serial = SERIAL.lock().await;
    shares_first_then_jobs("shares-first", Restart::No).await;
}

/// The same with the extender restarted between the shares and the jobs: with its mix kept, and
/// killed without it (the room it keeps comes from the cluster's state, not from the mix).
#[tokio::test(flavor = "current_thread")]
async fn shares_first_then_jobs_with_the_extender_restarted() {
    let _serial = SERIAL.lock().await;
    shares_first_then_jobs("shares-first-mix-state", Restart::WithMixState).await;
    shares_first_then_jobs("shares-first-fresh", Restart::Fresh).await;
}

async fn shares_first_then_jobs(name: &str, restart: Restart) {
    let (st, mut ext) = h100_stage_of(name, true, 32).await;
    let mix_state = st.cp.dir.join("mix-state.json");
    if restart == Restart::WithMixState {
        ext.proc.kill();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let flag = format!("--mix-state={}", mix_state.display());
        ext = Extender::start(&st.cp, "replica-a", ext.port, &["--placement-log-every-call", &flag]);
        ext.wait_ready(Duration::from_secs(60)).await;
    }
    const MIB: [&str; 5] = ["20480", "30720", "40960", "25600", "35840"];
    let shares: Vec<Pod> = (0..40)
        .map(|i| {
            Shape { gpu: Some("1"), mem: Some(MIB[i % 5]), kind: "share", ..Shape::default() }
                .pod(&format!("share-{i}"))
        })
        .collect();
    let started = Instant::now();
    create(&st.admin, shares).await;
    wait_stable(&st.admin, 40, Duration::from_secs(3), Duration::from_secs(180)).await;
    let s = snapshot(&st.admin, NS).await;
    let share_nodes: BTreeSet<String> = s
        .pods
        .iter()
        .filter(|p| p.name_any().starts_with("share-"))
        .filter_map(|p| node_name(p).map(str::to_string))
        .collect();
    figure(&format!(
        "groups: {name}: 40 shares bound in {:.1} s on {} nodes {share_nodes:?}",
        started.elapsed().as_secs_f64(),
        share_nodes.len()
    ));
    // why each share went where it did: the filter line's best nodes and their parts
    if let Some(last) = log_lines(&ext.placement_log, "filter")
        .iter()
        .rev()
        .find(|d| d["pod"].as_str().is_some_and(|p| p.ends_with("/share-39")))
    {
        figure(&format!("groups: {name}: share-39's filter line top: {}", last["top"]));
    }
    let room = crate::inspect(&ext).room;
    figure(&format!("groups: {name}: before the jobs, {}", room.summary()));
    assert!(share_nodes.len() <= 3, "40 shares on {} nodes: {share_nodes:?}", share_nodes.len());
    // 29 whole nodes; a whole ToR takes a job of 4 x 8 GPUs, a whole spine one of 8 x 8
    assert_eq!(room.whole_nodes.get(&8).copied(), Some(32 - share_nodes.len() as u64), "{}", room.summary());
    assert_eq!(room.levels.iter().map(|l| l.largest_job_pods).collect::<Vec<_>>(), [8, 4], "{}", room.summary());
    match restart {
        Restart::No => {}
        Restart::WithMixState => {
            ext.proc.terminate(Duration::from_secs(20));
            assert!(mix_state.exists(), "the mix written at shutdown");
            let flag = format!("--mix-state={}", mix_state.display());
            ext = Extender::start(&st.cp, "replica-a", ext.port, &["--placement-log-every-call", &flag]);
        }
        Restart::Fresh => {
            ext.proc.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            ext = Extender::start(&st.cp, "replica-a", ext.port, &["--placement-log-every-call"]);
        }
    }
    if restart != Restart::No {
        ext.wait_ready(Duration::from_secs(60)).await;
        figure(&format!("groups: {name}: extender restarted ({restart:?}) between the shares and the jobs"));
    }
    for j in 0..4 {
        let name = format!("tor-job-{j}");
        create_pod_group(&st.admin, &name, 2, Some(TOR)).await;
        create(&st.admin, job_pods(&name, 2, &whole("8"), true)).await;
    }
    for j in 0..2 {
        let name = format!("spine-job-{j}");
        create_pod_group(&st.admin, &name, 8, Some(SPINE)).await;
        create(&st.admin, job_pods(&name, 8, &whole("8"), true)).await;
    }
    let bound = wait_stable(&st.admin, 40 + 8 + 16, Duration::from_secs(6), Duration::from_secs(240)).await;
    let s = snapshot(&st.admin, NS).await;
    let js = sound(name, &s, &ext);
    let spine_of: BTreeMap<String, String> =
        s.nodes.iter().map(|n| (n.name_any(), n.labels().get(SPINE).cloned().unwrap_or_default())).collect();
    figure(&format!("groups: {name}: {bound} pods bound after {:.1} s", started.elapsed().as_secs_f64()));
    for (name, j) in &js {
        assert_eq!(j.bound, j.pods, "{name}: {js:#?}");
        if name.starts_with("tor-job") {
            assert_eq!(j.tors.len(), 1, "{name} spread over {:?}", j.tors);
        } else {
            let spines: BTreeSet<&String> = j.nodes.iter().filter_map(|n| spine_of.get(n)).collect();
            assert_eq!(spines.len(), 1, "{name} spread over {spines:?}");
        }
    }
    // what a capacity planner reads afterwards: the report names the room over time
    let html = st.cp.dir.join("report.html");
    let out = std::process::Command::new(crate::cluster::workspace_bin("gpuplace"))
        .args(["report", "--placement-log"])
        .arg(&ext.placement_log)
        .arg("-o")
        .arg(&html)
        .output()
        .expect("run gpuplace report");
    let summary = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "report: {}", String::from_utf8_lossy(&out.stderr));
    let room_line = summary.lines().find(|l| l.contains("at the last bind, room:")).unwrap_or("").trim().to_string();
    figure(&format!("groups: {name}: report: {room_line}"));
    assert!(room_line.contains("tor: ") && room_line.contains("spine: "), "{summary}");
    let page = std::fs::read_to_string(&html).expect("the report");
    assert!(page.contains("id=\"chart-room\"") && page.contains("id=\"chart-largest-job\""), "room charts");
}

/// Pods of the namespace whose name starts with `prefix`, by name: the node of each bound one.
async fn placed(client: &Client, prefix: &str) -> BTreeMap<String, Option<String>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pods = api.list(&Default::default()).await.expect("list pods").items;
    pods.iter()
        .filter(|p| p.name_any().starts_with(prefix))
        .map(|p| (p.name_any(), node_name(p).map(str::to_string)))
        .collect()
}

/// Waits until `n` pods of `prefix` are bound; returns their nodes.
async fn wait_bound(client: &Client, prefix: &str, n: usize, limit: Duration) -> BTreeSet<String> {
    let until = Instant::now() + limit;
    loop {
        let now = placed(client, prefix).await;
        let bound = now.values().filter(|n| n.is_some()).count();
        let nodes: BTreeSet<String> = now.into_values().flatten().collect();
        if bound >= n {
            return nodes;
        }
        assert!(Instant::now() < until, "{bound} of {n} pods of {prefix} bound in {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn delete_now(client: &Client, names: &[String]) {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    for n in names {
        api.delete(n, &DeleteParams::default().grace_period(0)).await.unwrap_or_else(|e| panic!("delete {n}: {e}"));
    }
}

/// Issue 30's elastic job, through both front doors: 4 pods of 8 GPUs that need 2 to start, under one
/// ToR, on 8 nodes where tor-0 has 2 whole nodes and tor-1 one. 2 start at once under tor-0 (the
/// whole node of tor-1 is not used), the other 2 wait holding nothing, and join under tor-0 once its
/// busy nodes are freed. As a kube-scheduler PodGroup (`minCount` 2; the pods name it and nothing
/// else, so gpuplace learns the gang's size from the pods it sees pending), then with gpuplace's
/// labels (`gpuplace.io/group-size` 4, `gpuplace.io/group-min` 2).
#[tokio::test(flavor = "current_thread")]
async fn elastic_groups_start_their_minimum_and_the_rest_join_as_room_appears() {
    let _serial = SERIAL.lock().await;
    let (st, ext) = h100_stage_of("elastic", true, 8).await;
    for door in ["podgroup", "labels"] {
        // tor-0 keeps gpu-02 and gpu-03 whole, tor-1 only gpu-07
        let busy_nodes = ["gpu-00", "gpu-01", "gpu-04", "gpu-05", "gpu-06"];
        let busy: Vec<String> = busy_nodes.iter().map(|n| format!("busy-{door}-{n}")).collect();
        for (name, node) in busy.iter().zip(busy_nodes) {
            pin(&st.admin, name, node, whole("8")).await;
        }
        let job = format!("el-{door}");
        let pods: Vec<Pod> = (0..4)
            .map(|i| {
                let mut s = whole("8");
                if door == "labels" {
                    s.labels.push(("gpuplace.io/group", job.clone()));
                    s.annotations.push(("gpuplace.io/group-size", "4".into()));
                    s.annotations.push(("gpuplace.io/group-min", "2".into()));
                    s.annotations.push(("gpuplace.io/group-topology", TOR.into()));
                }
                let mut pod = s.pod(&format!("{job}-{i}"));
                if door == "podgroup" {
                    if let Some(spec) = pod.spec.as_mut() {
                        spec.scheduling_group = Some(PodSchedulingGroup { pod_group_name: Some(job.clone()) });
                    }
                }
                pod
            })
            .collect();
        if door == "podgroup" {
            create_pod_group(&st.admin, &job, 2, Some(TOR)).await;
        }
        let started = Instant::now();
        create(&st.admin, pods).await;
        let first = wait_bound(&st.admin, &job, 2, Duration::from_secs(90)).await;
        let t_first = started.elapsed().as_secs_f64();
        // the other two stay pending (a quiet spell), holding nothing
        tokio::time::sleep(Duration::from_secs(8)).await;
        let now = placed(&st.admin, &job).await;
        let s = snapshot(&st.admin, NS).await;
        let reasons: BTreeSet<String> = now
            .iter()
            .filter(|(_, n)| n.is_none())
            .filter_map(|(p, _)| s.failed_scheduling.get(p).and_then(|m| m.last().cloned()))
            .collect();
        let inspect = crate::inspect(&ext);
        let g = inspect.groups.iter().find(|g| g.group == format!("{NS}/{job}")).expect("the group in /inspect");
        figure(&format!(
            "groups: elastic {door}: 2 bound on {first:?} after {t_first:.1} s; pending {:?}; /inspect size {} min {} \
             reserved {}; kube-scheduler says {reasons:?}",
            now.iter().filter(|(_, n)| n.is_none()).map(|(p, _)| p).collect::<Vec<_>>(),
            g.size,
            g.min,
            g.reserved.len()
        ));
        assert_eq!(first, BTreeSet::from(["gpu-02".to_string(), "gpu-03".to_string()]), "{now:?}");
        assert_eq!(now.values().filter(|n| n.is_some()).count(), 2, "{now:?}");
        assert_eq!((g.size, g.min), (4, 2), "{g:?}");
        assert!(g.reserved.is_empty(), "waiting members hold nothing: {g:?}");
        assert!(reasons.iter().any(|r| r.contains("has 2 pods placed")), "{reasons:?}");
        let audit = Audit::of(&s);
        assert!(audit.over_commits.is_empty(), "{:#?}", audit.over_commits);
        // room appears under tor-0: the other two join there
        let freed = Instant::now();
        delete_now(&st.admin, &busy[..2]).await;
        let all = wait_bound(&st.admin, &job, 4, Duration::from_secs(120)).await;
        figure(&format!(
            "groups: elastic {door}: the other 2 bound {:.1} s after tor-0's busy nodes were freed; all on {all:?}",
            freed.elapsed().as_secs_f64()
        ));
        let tor0: BTreeSet<String> = (0..4).map(|i| format!("gpu-{i:02}")).collect();
        assert_eq!(all, tor0, "all 4 under tor-0");
        let s = snapshot(&st.admin, NS).await;
        let audit = Audit::of(&s);
        assert!(audit.over_commits.is_empty(), "{:#?}", audit.over_commits);
        let diffs = audit.compare_inspect(&crate::inspect(&ext));
        assert!(diffs.is_empty(), "/inspect differs from the annotations: {diffs:#?}");
        // clean slate for the next door
        let mut everything: Vec<String> = placed(&st.admin, "").await.into_keys().collect();
        everything.retain(|p| !p.starts_with("lonely"));
        delete_now(&st.admin, &everything).await;
        let until = Instant::now() + Duration::from_secs(30);
        while crate::inspect(&ext).nodes.iter().any(|n| n.gpus.iter().any(|g| !g.holders.is_empty())) {
            assert!(Instant::now() < until, "the extender still counts deleted pods");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
