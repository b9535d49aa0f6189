//! Issue 49's guard on the real node: two share pods on one GPU, 20 GiB and 40 GiB. The fake NVML
//! backend reports per-process memory from a file this test writes with the containers' real host
//! PIDs (found from their cgroups, as the guard finds their containers); the chart's device plugin
//! runs with `--fake-processes`, `--sample-interval=1s` and `--guard-grace=4s`.
//!
//! The 20 GiB pod goes to 30 GiB: within two sample intervals it gets `GpuMemoryOverGrant`, after
//! the grace its process is killed (`GpuMemoryGuardKilled`; the kubelet restarts the container),
//! and the 40 GiB pod keeps the same container, never restarted. Then the same with the device
//! plugin's pod deleted while the 20 GiB pod is over: the DaemonSet's new plugin kills it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuplace_core::annotations::{AssignmentAnnotation, NodeInventory, ANNOTATION_INVENTORY};
use gpuplace_core::isolation::IsolationMode;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::probes::delete_all;
use super::{create_and_time, figure, pending_report, pod, wait_for, ASSIGNMENT, NODE, NS, SYSTEM_NS};

/// Where the test writes the processes file, on the host; the chart mounts the folder into the
/// plugin's pod at [`MOUNT`].
pub(super) fn host_dir(node_dir: &Path) -> PathBuf {
    node_dir.join("guard")
}
/// The folder inside the plugin's pod.
pub(super) const MOUNT: &str = "/var/run/gpuplace-e2e";
pub(super) const SAMPLE: Duration = Duration::from_secs(1);
/// Longer than the old plugin takes to stop after its pod is deleted, so that in the restart round
/// the kill is the new plugin's.
pub(super) const GRACE: Duration = Duration::from_secs(6);

/// The chart values of the guard's part: more device-plugin arguments and the folder's mount.
pub(super) fn chart_values(node_dir: &Path) -> Vec<(String, String)> {
    let dir = host_dir(node_dir);
    std::fs::create_dir_all(&dir).expect("the guard's folder");
    vec![
        (
            "devicePlugin.extraArgs".into(),
            json!([
                format!("--fake-processes={MOUNT}/processes.json"),
                format!("--fake-driver-limits={MOUNT}/limits.json"),
                format!("--sample-interval={}s", SAMPLE.as_secs()),
                format!("--guard-grace={}s", GRACE.as_secs()),
            ])
            .to_string(),
        ),
        // the fake driver has per-cgroup memory limits: the node runs in driver-limits mode, the
        // guard as its backstop
        ("devicePlugin.driverLimits.enabled".into(), "true".into()),
        (
            "devicePlugin.extraVolumes".into(),
            json!([{"name": "e2e-guard", "hostPath": {"path": dir, "type": "Directory"}}]).to_string(),
        ),
        (
            "devicePlugin.extraVolumeMounts".into(),
            // read-write: the fake driver writes its limits there
            json!([{"name": "e2e-guard", "mountPath": MOUNT}]).to_string(),
        ),
    ]
}

/// The host PIDs of the processes in a container, from every process's cgroup.
pub(super) fn pids_of(container_id: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        if cgroup.contains(container_id) {
            pids.push(pid);
        }
    }
    pids.sort();
    pids
}

/// (container ID, restart count) of the pod's first container.
pub(super) fn container(p: &Pod) -> (String, i32) {
    let c = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first());
    let id = c.and_then(|c| c.container_id.clone()).unwrap_or_default();
    let bare = id.split_once("://").map_or(id.as_str(), |(_, b)| b).to_string();
    (bare, c.map_or(0, |c| c.restart_count))
}

/// The GPU index of the pod's single-GPU assignment.
fn gpu_of(p: &Pod) -> u32 {
    let a = p.annotations().get(ASSIGNMENT).and_then(|t| AssignmentAnnotation::parse(t).ok()).expect("an assignment");
    a.containers[0].gpus[0].index
}

/// Reason -> times observed, of the pod's Events (events.k8s.io: a repeat of an Event is one more
/// in its `series`, not a new object).
pub(super) async fn events_of(client: &Client, pod: &str) -> BTreeMap<String, i32> {
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let list = events.list(&ListParams::default()).await.expect("events").items;
    let mut out = BTreeMap::new();
    for e in list.into_iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)) {
        let times = e.series.as_ref().map_or(e.deprecated_count.unwrap_or(1), |s| s.count).max(1);
        *out.entry(e.reason.unwrap_or_default()).or_insert(0) += times;
    }
    out
}

/// The device plugins' log lines about the guard (every plugin pod the node ran), for a failure's
/// message.
fn guard_log(node_dir: &Path) -> String {
    let mut lines = Vec::new();
    for pod in std::fs::read_dir(node_dir.join("pod-logs")).into_iter().flatten().flatten() {
        if !pod.file_name().to_string_lossy().starts_with("gpuplace-system_gpuplace-device-plugin-") {
            continue;
        }
        for log in std::fs::read_dir(pod.path().join("device-plugin")).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            lines.extend(text.lines().filter(|l| l.contains("guard")).map(str::to_string));
        }
    }
    lines.sort();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

pub(super) fn write_processes(dir: &Path, entries: &[(u32, u32, u64)]) {
    let processes: Vec<_> =
        entries.iter().map(|(gpu, pid, mib)| json!({"gpu": gpu, "pid": pid, "used_mib": mib})).collect();
    let tmp = dir.join("processes.json.tmp");
    std::fs::write(&tmp, json!({"processes": processes}).to_string()).expect("write the processes");
    // renamed into place: the plugin never reads half a file
    std::fs::rename(&tmp, dir.join("processes.json")).expect("rename the processes");
}

/// The fake driver's cap on the cgroup of container `cid` (its cgroup's last segment names it).
pub(super) fn cap_of(dir: &Path, cid: &str) -> Option<(PathBuf, u64)> {
    let text = std::fs::read_to_string(dir.join("limits.json")).ok()?;
    let limits: serde_json::Value = serde_json::from_str(&text).ok()?;
    limits["limits"].as_array()?.iter().find_map(|l| {
        let cgroup = PathBuf::from(l["cgroup"].as_str()?);
        let named = cgroup.file_name().is_some_and(|n| n.to_string_lossy().contains(cid));
        named.then(|| (cgroup, l["limit_mib"].as_u64().unwrap_or(0)))
    })
}

/// Waits until the driver caps container `cid`'s cgroup at `mib`; the seconds it took.
pub(super) async fn capped(node_dir: &Path, who: &str, cid: &str, mib: u64) -> f64 {
    let t = Instant::now();
    let dir = host_dir(node_dir);
    wait_for(&format!("{who}'s container capped at {mib} MiB by the driver"), Duration::from_secs(30), || {
        let got = cap_of(&dir, cid);
        let text = std::fs::read_to_string(dir.join("limits.json")).unwrap_or_default();
        async move {
            match got {
                Some((cgroup, m)) if m == mib && cgroup.is_dir() => Ok(()),
                other => Err(format!("its cap {other:?}; the driver's limits: {text}")),
            }
        }
    })
    .await;
    t.elapsed().as_secs_f64()
}

/// The waiting of one round: the Event's delay and the kill's, in seconds.
async fn round(
    client: &Client,
    node_dir: &Path,
    gpu: u32,
    small: &str,
    big_pid: u32,
    events_before: i32,
    restart_plugin: bool,
) -> (f64, f64) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let p = pods.get(small).await.expect("the small share");
    let (cid, restarts) = container(&p);
    let pid = *pids_of(&cid).first().unwrap_or_else(|| panic!("no process in {small}'s container {cid}"));
    write_processes(&host_dir(node_dir), &[(gpu, pid, 30 * 1024), (gpu, big_pid, 40 * 1024)]);
    let t = Instant::now();
    wait_for(&format!("{small}'s GpuMemoryOverGrant Event"), Duration::from_secs(30), || {
        let client = client.clone();
        async move {
            let ev = events_of(&client, small).await;
            let n = ev.get("GpuMemoryOverGrant").copied().unwrap_or(0);
            if n > events_before {
                Ok(())
            } else {
                Err(format!("events {ev:?}"))
            }
        }
    })
    .await;
    let event_s = t.elapsed().as_secs_f64();
    if restart_plugin {
        let sys: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NS);
        let lp = ListParams::default().labels("app.kubernetes.io/name=gpuplace-device-plugin");
        let old: Vec<String> =
            sys.list(&lp).await.expect("the plugin's pod").items.iter().map(|p| p.name_any()).collect();
        for name in &old {
            sys.delete(name, &DeleteParams::default()).await.expect("delete the plugin's pod");
        }
        // the old plugin must be gone before its grace ran out: the kill is the new one's
        wait_for("the DaemonSet's new plugin pod Running", Duration::from_secs(90), || {
            let (sys, lp, old) = (sys.clone(), lp.clone(), old.clone());
            async move {
                let pods = sys.list(&lp).await.map_err(|e| e.to_string())?.items;
                let fresh = pods.iter().any(|p| !old.contains(&p.name_any()) && super::running(p));
                let old_left = pods.iter().any(|p| old.contains(&p.name_any()));
                if fresh && !old_left {
                    Ok(())
                } else {
                    Err(format!("new pod running {fresh}, old pod left {old_left}"))
                }
            }
        })
        .await;
        assert!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "the process was stopped before the new plugin was up ({:.1} s): the kill was not the restarted plugin's",
            t.elapsed().as_secs_f64()
        );
    }
    wait_for(
        &format!("{small}'s process {pid} killed"),
        Duration::from_secs(if restart_plugin { 120 } else { 30 }),
        || {
            let pods = pods.clone();
            async move {
                let alive = Path::new(&format!("/proc/{pid}")).exists();
                let p = pods.get(small).await.map_err(|e| e.to_string())?;
                let (_, now) = container(&p);
                if !alive && now > restarts {
                    Ok(())
                } else {
                    Err(format!(
                        "process alive {alive}, restarts {restarts} -> {now}; the plugins' guard log:\n{}",
                        guard_log(node_dir)
                    ))
                }
            }
        },
    )
    .await;
    (event_s, t.elapsed().as_secs_f64())
}

/// The node publishes the mode its plugin runs in (`driver-limits`: the fake driver has per-cgroup
/// limits and the chart lets the plugin set them; the guard runs behind them), and a pod that
/// requires `mps` is refused there with the reason.
async fn the_mode_is_published_and_required(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get(NODE).await.expect("the node");
    let inventory = n.annotations().get(ANNOTATION_INVENTORY).map(|t| NodeInventory::parse(t).expect("the inventory"));
    let mode = inventory.and_then(|i| i.isolation);
    assert_eq!(mode, Some(IsolationMode::DriverLimits), "the node's published isolation mode");
    let mut needs_mps = pod("needs-mps", &[("gpu", "1"), ("gpu-mem", "1000"), ("gpu-core", "10")], &[], None);
    needs_mps.metadata.annotations = Some([("gpuplace.io/isolation".to_string(), "mps".to_string())].into());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(&PostParams::default(), &needs_mps).await.expect("create needs-mps");
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let mut said = String::new();
    wait_for("needs-mps refused for its isolation mode", Duration::from_secs(30), || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await.map_err(|e| e.to_string())?.items;
            let notes: Vec<String> = list
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("needs-mps"))
                .filter(|e| e.reason.as_deref() == Some("FailedScheduling"))
                .filter_map(|e| e.note)
                .collect();
            match notes.iter().find(|n| n.contains("isolation mode")) {
                Some(_) => Ok(()),
                None => Err(format!("its FailedScheduling notes: {notes:?}")),
            }
        }
    })
    .await;
    let p = pods.get("needs-mps").await.expect("needs-mps");
    assert!(p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none(), "needs-mps was bound");
    for e in events.list(&ListParams::default()).await.expect("events").items {
        if e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("needs-mps") {
            said = e.note.unwrap_or_default();
        }
    }
    figure(&format!("real node: isolation mode driver-limits published; a pod requiring mps: {said}"));
    pods.delete("needs-mps", &DeleteParams::default().grace_period(0)).await.expect("delete needs-mps");
}

pub(super) async fn shares_hold_on_the_real_node(client: &Client, node_dir: &Path) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    delete_all(&pods).await;
    the_mode_is_published_and_required(client).await;
    let dir = host_dir(node_dir);
    let share = |n: &str, mem: &str| pod(n, &[("gpu", "1"), ("gpu-mem", mem), ("gpu-core", "30")], &[], None);
    let (small, big) = ("guard-20g", "guard-40g");
    let up = create_and_time(client, vec![share(small, "20480"), share(big, "40960")], Duration::from_secs(60)).await;
    assert_eq!(up.len(), 2, "the guard's shares Running: {up:?}\n{}", pending_report(client).await);
    let (ps, pb) = (pods.get(small).await.expect("small"), pods.get(big).await.expect("big"));
    let gpu = gpu_of(&ps);
    assert_eq!(gpu_of(&pb), gpu, "the two shares are on different GPUs; binpacking puts them on one");
    let (big_cid, big_restarts) = container(&pb);
    let big_pid = *pids_of(&big_cid).first().expect("the big share's process");
    // driver-limits: each share's cgroup capped at its grant (the kubelet makes no pod cgroups here,
    // so the containers' own; a fake node keeps no context overhead)
    let small_cap_s = capped(node_dir, small, &container(&ps).0, 20 * 1024).await;
    let big_cap_s = capped(node_dir, big, &big_cid, 40 * 1024).await;
    figure(&format!(
        "real node: driver-limits: the 20 GiB and 40 GiB shares' container cgroups capped at 20480 and 40960 MiB \
         ({small_cap_s:.1} s and {big_cap_s:.1} s after both were Running)"
    ));
    // within their grants: nothing happens
    let small_pid = *pids_of(&container(&ps).0).first().expect("the small share's process");
    write_processes(&dir, &[(gpu, small_pid, 20 * 1024), (gpu, big_pid, 40 * 1024)]);
    tokio::time::sleep(SAMPLE * 3).await;
    assert!(!events_of(client, small).await.contains_key("GpuMemoryOverGrant"), "an Event within the grant");

    let (event_s, kill_s) = round(client, node_dir, gpu, small, big_pid, 0, false).await;
    figure(&format!(
        "real node: guard: the 20 GiB share at 30 GiB on GPU {gpu}: GpuMemoryOverGrant after {event_s:.1} s (sample {} s), its process killed after {kill_s:.1} s (grace {} s)",
        SAMPLE.as_secs(),
        GRACE.as_secs()
    ));
    assert!(event_s <= 2.0 * SAMPLE.as_secs_f64() + 2.0, "the Event came after {event_s:.1} s");
    assert!(kill_s >= GRACE.as_secs_f64(), "killed before the grace: {kill_s:.1} s");
    let ev = events_of(client, small).await;
    assert!(ev.contains_key("GpuMemoryGuardKilled"), "{ev:?}");
    // the restarted container is a new cgroup: capped in turn
    let restarted = container(&pods.get(small).await.expect("small")).0;
    let recap_s = capped(node_dir, small, &restarted, 20 * 1024).await;
    figure(&format!("real node: driver-limits: the small share's restarted container capped {recap_s:.1} s after its restart was seen"));

    // the same, with the plugin's pod deleted once the Event is out
    let (event_s, kill_s) = round(client, node_dir, gpu, small, big_pid, ev["GpuMemoryOverGrant"], true).await;
    figure(&format!(
        "real node: guard: again with the device plugin's pod deleted after the Event ({event_s:.1} s): the new plugin killed it {kill_s:.1} s after it went over"
    ));
    let pb = pods.get(big).await.expect("big");
    assert_eq!(container(&pb), (big_cid.clone(), big_restarts), "the 40 GiB neighbour's container was touched");
    assert!(Path::new(&format!("/proc/{big_pid}")).exists(), "the 40 GiB neighbour's process is gone");
    assert!(events_of(client, big).await.keys().all(|r| !r.starts_with("GpuMemory")), "the neighbour got an Event");
    figure(&format!(
        "real node: guard: the 40 GiB neighbour kept container {} with {big_restarts} restarts through both",
        &big_cid[..12]
    ));
    write_processes(&dir, &[]);
    delete_all(&pods).await;
}
