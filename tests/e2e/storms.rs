//! Storms of mixed pods through kube-scheduler and the extender (300 on 16 nodes; 700 on 32 with a
//! node deleted mid-storm), the placement log compacted and read back, and the extender killed in
//! the middle of a storm.

use super::*;

#[tokio::test(flavor = "current_thread")]
async fn storm_of_300_mixed_pods_on_16_nodes() {
    storm("storm", 16, 300, false).await;
}

/// The storm of issue 20's first report: 700 pods on 32 nodes, one Node deleted mid-storm.
#[tokio::test(flavor = "current_thread")]
#[ignore = "a measurement for docs/performance.md"]
async fn storm_of_700_mixed_pods_on_32_nodes_with_a_node_deleted() {
    storm("storm-700", 32, 700, true).await;
}

/// The node a storm with `delete_node` deletes.
const STORM_DELETED_NODE: &str = "gpu-05";

/// `pods` mixed pods on `nodes` nodes; `delete_node`: one Node (and, as kube-controller-manager's
/// pod garbage collector would, its pods) deleted when half the pods are created. The extender
/// writes a line per call (`--placement-log-every-call`) so that the log can be compacted here as
/// the default would write it, and both reported.
async fn storm(name: &str, nodes: usize, pods: usize, delete_node: bool) {
    let _serial = SERIAL.lock().await;
    let (mut st, mut ext) = stage_with_extender_of(name, nodes, &["--placement-log-every-call"]).await;
    st.cp.start_scheduler(&scheduler_config(), Some(&ext.url()));

    // created as a Job or ReplicaSet controller creates pods (the kill scenario creates its storm as
    // fast as the API server takes it; `binds_in_a_burst_of_creates...` measures binds in that burst)
    let shapes = storm_shapes(pods);
    let started = Instant::now();
    let creates = create_pods_as_a_controller(&st.admin, NS, "storm", &shapes);
    let deletion = async {
        if !delete_node {
            return;
        }
        let half = pods as f64 / 2.0 / fleet::CONTROLLER_QPS;
        tokio::time::sleep(Duration::from_secs_f64(half)).await;
        let gone = STORM_DELETED_NODE;
        Api::<k8s_openapi::api::core::v1::Node>::all(st.admin.clone())
            .delete(gone, &DeleteParams::default())
            .await
            .expect("delete a node");
        let api: Api<Pod> = Api::namespaced(st.admin.clone(), NS);
        let on_it = api.list(&kube::api::ListParams::default().fields(&format!("spec.nodeName={gone}"))).await;
        for p in on_it.expect("list its pods").items {
            let _ = api.delete(&p.metadata.name.unwrap_or_default(), &DeleteParams::default().grace_period(0)).await;
        }
        figure(&format!("{name}: node {gone} deleted {:.1} s after the first create", started.elapsed().as_secs_f64()));
    };
    futures::join!(creates, deletion);
    let created_s = started.elapsed().as_secs_f64();
    let settled_s = settle(&st.admin, NS, Duration::from_secs(6), Duration::from_secs(300)).await;

    let snap = snapshot(&st.admin, NS).await;
    let audit = Audit::of(&snap);
    figure(&format!(
        "{name}: {} pods created in {created_s:.1} s (a controller's pace: {} a second after a burst of {}), \
         settled after {settled_s:.1} s: {} bound, {} pending",
        audit.pods,
        fleet::CONTROLLER_QPS,
        fleet::CONTROLLER_BURST,
        audit.bound,
        audit.pending
    ));
    let gpu_pods = snap.pods.iter().filter(|p| node_name(p).is_some() && audit::asks_gpuplace(p)).count();
    figure(&format!(
        "{name}: over-commits {} (memory, compute, exclusivity, slots over {} GPUs in use), bad assignments {}, \
         {gpu_pods} bound GPU pods",
        audit.over_commits.len(),
        audit.gpus.len(),
        audit.bad_assignments.len()
    ));
    figure(&format!(
        "{name}: pending without a FailedScheduling event {} of {}; {} distinct messages, longest {} chars",
        audit.pending_without_event.len(),
        audit.pending,
        audit.pending_messages.len(),
        audit.longest_message
    ));
    for (m, n) in &audit.pending_messages {
        figure(&format!("{name}: {n} pending: {m}"));
    }
    audit.assert_sound(true);
    assert!(
        audit.pending_without_event.is_empty(),
        "pending without a FailedScheduling event: {:?}",
        audit.pending_without_event
    );
    for m in audit.pending_messages.keys() {
        assert!(m.contains("nodes are available"), "a FailedScheduling message that does not say why: {m}");
    }
    let by_kind = |kind: &'static str| {
        snap.pods.iter().filter(move |p| p.metadata.labels.as_ref().is_some_and(|l| l["e2e/kind"] == kind))
    };
    assert!(by_kind("invalid").all(|p| node_name(p).is_none()), "an invalid request was bound");
    for kind in
        ["mem-share", "core-share", "mem-core-share", "whole-1", "whole-2", "share-3gpu", "numa-required", "group"]
    {
        assert!(by_kind(kind).any(|p| node_name(p).is_some()), "no {kind} pod was bound");
    }
    // the ToR-local job: its bound pods share one ToR
    let tors: std::collections::BTreeSet<String> = by_kind("group")
        .filter_map(|p| node_name(p))
        .map(|n| n[4..].parse::<usize>().map(|i| i / 4).unwrap_or(99).to_string())
        .collect();
    figure(&format!("{name}: the 4-pod group landed on ToR(s) {tors:?}"));
    assert_eq!(tors.len(), 1, "the group spread over ToRs {tors:?}");
    // kube-scheduler may assume a pod on a node before the previous pod's bind there reaches
    // gpuplace; the bind then finds the GPUs gone. Rare for single pods; group members have plans.
    let binds = log_lines(&ext.placement_log, "bind");
    let no_longer_fits = |group: bool| {
        binds
            .iter()
            .filter(|d| d["group"].is_string() == group)
            .filter(|d| d["error"].as_str().is_some_and(|e| e.contains("no longer fits")))
            .count()
    };
    let (singles, members) = (no_longer_fits(false), no_longer_fits(true));
    figure(&format!(
        "{name}: binds refused with `no longer fits`: {singles} of single pods, {members} of group members, \
         among {} binds",
        binds.len()
    ));
    assert_eq!(members, 0, "a group member's bind found its planned GPUs gone");

    let diffs = audit.compare_inspect(&inspect(&ext));
    figure(&format!("{name}: /inspect differs from the annotations on {} GPUs", diffs.len()));
    assert!(diffs.is_empty(), "/inspect differs from the annotations: {diffs:#?}");

    // filter calls per minute per pending pod: with the device plugins publishing utilization to
    // their ConfigMaps (now), then with a Node write per node every 5 s as the device plugins used
    // to publish it (before): kube-scheduler re-queues its pending pods on Node updates
    let window = Duration::from_secs(20);
    let filters = || counter(&ext.metrics(), "gpuplace_requests_total", "verb=\"filter\"");
    let before = filters();
    tokio::time::sleep(window).await;
    let quiet = (filters() - before) / window.as_secs_f64() * 60.0;
    let nodes_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(st.admin.clone());
    let before = filters();
    let started = Instant::now();
    let mut round = 0;
    while started.elapsed() < window {
        // (not the node the storm deleted, if it did)
        for n in st.nodes.iter().filter(|n| !delete_node || n.name != STORM_DELETED_NODE) {
            let patch = json!({"metadata": {"annotations": {"e2e/utilization-as-before": round.to_string()}}});
            nodes_api.patch(&n.name, &Default::default(), &kube::api::Patch::Merge(&patch)).await.expect("node patch");
        }
        round += 1;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let churn = (filters() - before) / started.elapsed().as_secs_f64() * 60.0;
    let pending = audit.pending.max(1) as f64;
    figure(&format!(
        "{name}: filter calls per minute per pending pod ({} pending): {:.2} with utilization in ConfigMaps (now), \
         {:.2} with a Node write per node every 5 s (utilization on the Node, as before)",
        audit.pending,
        quiet / pending,
        churn / pending
    ));
    assert!(
        quiet / pending < 0.5,
        "pending pods are re-filtered without cause: {:.2} per minute each",
        quiet / pending
    );
    latency_figure(name, &ext.placement_log);
    ext.proc.terminate(Duration::from_secs(10));
    compaction_figure(name, &ext.placement_log);
}

/// The placement log written a line per call against what the default writes (the same log
/// compacted by `gpuplace compact-log`): bytes, lines, and `gpuplace report`'s summary of both,
/// which must agree on every figure but the lines and the per-line latency percentiles.
fn compaction_figure(name: &str, full: &std::path::Path) {
    let compact = full.with_extension("compact.jsonl");
    let gpuplace = cluster::workspace_bin("gpuplace");
    let out = std::process::Command::new(&gpuplace)
        .arg("compact-log")
        .arg("--placement-log")
        .arg(full)
        .arg("--output")
        .arg(&compact)
        .output()
        .expect("run gpuplace compact-log");
    assert!(out.status.success(), "compact-log: {}", String::from_utf8_lossy(&out.stderr));
    let summary = |log: &std::path::Path| {
        let html = log.with_extension("html");
        let out = std::process::Command::new(&gpuplace)
            .arg("report")
            .arg("--placement-log")
            .arg(log)
            .arg("--output")
            .arg(&html)
            .output()
            .expect("run gpuplace report");
        assert!(out.status.success(), "report: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // the files' names, the line counts and the per-line percentiles differ by design
        text.lines()
            .filter(|l| !l.starts_with("placement log:") && !l.contains("per line") && !l.starts_with("report:"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (a, b) = (summary(full), summary(&compact));
    let bytes = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let lines = |p: &std::path::Path| std::fs::read_to_string(p).map_or(0, |t| t.lines().count());
    let (full_bytes, compact_bytes) = (bytes(full), bytes(&compact));
    figure(&format!(
        "{name}: placement log {full_bytes} bytes / {} lines a line per call, {compact_bytes} bytes / {} lines \
         as the default writes it ({:.1} percent of the bytes); report figures identical: {}",
        lines(full),
        lines(&compact),
        compact_bytes as f64 * 100.0 / full_bytes.max(1) as f64,
        a == b
    ));
    assert_eq!(a, b, "the report of the compacted log differs");
    assert!(compact_bytes * 4 <= full_bytes, "the compacted log is over 25 percent of a line per call");
}

#[tokio::test(flavor = "current_thread")]
async fn extender_killed_mid_storm_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let (mut st, mut ext) = stage_with_extender("kill").await;
    st.cp.start_scheduler(&scheduler_config(), Some(&ext.url()));
    create_pods(&st.admin, NS, "kill", &storm_shapes(300)).await;
    let at_kill = wait_bound(&st.admin, NS, 60, Duration::from_secs(120)).await;
    ext.proc.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // the container restarts: same identity (it renews its own Lease), same port behind the Service
    let mut ext = Extender::start(&st.cp, "replica-a", ext.port, &[]);
    ext.wait_ready(Duration::from_secs(60)).await;
    let down_s = killed.elapsed().as_secs_f64();
    let settled_s = settle(&st.admin, NS, Duration::from_secs(6), Duration::from_secs(300)).await;
    // binds cut by the kill leave assignments on pending pods; the leader removes them after a
    // Lease duration (src/apiserver/stale.rs)
    let mut stale_seen = 0;
    let until = Instant::now() + gpuplace::k8s::serve::DEFAULT_STALE_GRACE + Duration::from_secs(20);
    let audit = loop {
        let audit = Audit::of(&snapshot(&st.admin, NS).await);
        stale_seen = stale_seen.max(audit.stale_pending.len());
        if audit.stale_pending.is_empty() || Instant::now() > until {
            break audit;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    figure(&format!("kill: {stale_seen} pending pods carried an assignment from a cut bind; removed by the leader"));
    let diffs = audit.compare_inspect(&inspect(&ext));
    figure(&format!(
        "kill: SIGKILL after {at_kill} binds, ready again {down_s:.1} s after the kill, settled {settled_s:.1} s later: \
         {} bound, {} pending",
        audit.bound, audit.pending
    ));
    figure(&format!(
        "kill: over-commits {}, bad or lost assignments {}, pending pods with a stale assignment {}, \
         /inspect differences {}",
        audit.over_commits.len(),
        audit.bad_assignments.len(),
        audit.stale_pending.len(),
        diffs.len()
    ));
    audit.assert_sound(true);
    assert!(diffs.is_empty(), "/inspect differs from the annotations after the restart: {diffs:#?}");
    assert!(audit.bound > at_kill, "nothing bound after the restart");
    latency_figure("kill", &ext.placement_log);
}
