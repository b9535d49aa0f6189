//! Issue 33's measurements beside the pace: a burst of pods created while kube-scheduler runs
//! (bind latency from the extender's side, the API server's and the pods'), and the extender's
//! memory after a restart with many pods bound.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::Value;

use super::{apiserver_metrics, buckets, quantile_ms, scheduler_attempts, Binds, Scale};
use crate::audit::percentile;
use crate::cluster::{figure, ControlPlane};
use crate::fleet::{create_pods, http_get, Extender, Shape};
use crate::proc_usage::usage;
use crate::{counter, wait_scheduler_leading, NS};

/// kube-scheduler started again with `config` (and `ext`), once it leads: with a new log, from
/// which leading is read (the killed one's lease is waited out first).
async fn lead_anew(cp: &mut ControlPlane, config: &std::path::Path, ext: Option<&Extender>) {
    if let Some(mut old) = cp.scheduler.take() {
        old.kill();
    }
    let _ = std::fs::remove_file(cp.dir.join("kube-scheduler.log"));
    let url = ext.map(Extender::url);
    cp.start_scheduler(config, url.as_deref());
    wait_scheduler_leading(cp).await;
}

/// Issue 33's restart: `s.restart_pods` pods of half a GPU created and bound (kube-scheduler with
/// gpuplace and `config`), the extender's memory in that steady state, then again once it is ready
/// after a SIGKILL and restart (its first list of every pod read). Returns the new extender.
pub(super) async fn restart_rss(
    cp: &mut ControlPlane,
    admin: &Client,
    s: &Scale,
    config: &std::path::Path,
    ext: Extender,
) -> Extender {
    let n = s.restart_pods;
    lead_anew(cp, config, Some(&ext)).await;
    let binds = Binds::start(admin);
    let half = Shape { gpu: Some("1"), core: Some("50"), kind: "share", ..Shape::default() };
    let started = Instant::now();
    create_pods(admin, NS, "held", &vec![half; n]).await;
    let bound = binds.wait(n, Duration::from_secs(60), Duration::from_secs(1800)).await;
    assert_eq!(bound, n, "restart: only {bound} of {n} pods bound");
    let bound_s = started.elapsed().as_secs_f64();
    let (steady, steady_peak, _) = usage(ext.proc.pid());
    let port = ext.port;
    drop(ext);
    let started = Instant::now();
    let mut ext = Extender::start(cp, "replica-a", port, &[]);
    ext.wait_ready(Duration::from_secs(600)).await;
    let ready_s = started.elapsed().as_secs_f64();
    let (rss, peak, _) = usage(ext.proc.pid());
    figure(&format!(
        "scale {}: {n} pods of half a GPU bound in {bound_s:.1} s; extender RSS {steady:.0} MiB (peak {steady_peak:.0}); \
         after a SIGKILL and restart ready in {ready_s:.2} s, RSS {rss:.0} MiB (peak {peak:.0}): {:.2} x steady ({:.2} x at the peak)",
        s.name,
        rss / steady,
        peak / steady
    ));
    ext
}

/// The burst (`s.burst` whole-GPU pods created at once, 50 in flight, while kube-scheduler runs with
/// `config`, with gpuplace when `ext`): each Binding call's time as the API server measured it (its
/// `apiserver_request_duration_seconds`, bucketed; the same call whoever makes it); with gpuplace,
/// every bind as the extender measured it (its placement log's bind lines, from the request to the
/// Binding's answer; exact); and each pod's time from its create returning to the test's watch
/// seeing it bound, which holds kube-scheduler's queue, cycle and bind. The pods are deleted after.
pub(super) async fn burst(
    cp: &mut ControlPlane,
    admin: &Client,
    s: &Scale,
    config: &std::path::Path,
    ext: Option<&Extender>,
) {
    let n = s.burst;
    let label = if ext.is_some() { "kube-scheduler with gpuplace" } else { "kube-scheduler alone" };
    lead_anew(cp, config, ext).await;
    let binds = Binds::start(admin);
    let log_from = ext.and_then(|e| std::fs::metadata(&e.placement_log).ok()).map_or(0, |m| m.len()) as usize;
    let cpu_of = || ext.map_or(0.0, |e| usage(e.proc.pid()).2);
    let cpu_before = cpu_of();
    // the API server's and etcd's metrics before and after: histograms over the burst
    let (api_before, etcd_before) = (apiserver_metrics(admin).await, etcd_metrics(cp));
    let attempts_before = scheduler_attempts(cp);
    let api: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let whole = Shape { gpu: Some("1"), kind: "whole-1", ..Shape::default() };
    let started = Instant::now();
    let mut created: HashMap<String, Instant> = HashMap::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let futs = chunk.iter().map(|&i| {
            let name = format!("burst-{i:04}");
            let (pod, api) = (whole.pod(&name), api.clone());
            async move {
                api.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("create pod {name}: {e}"));
                (name, Instant::now())
            }
        });
        created.extend(futures::future::join_all(futs).await);
    }
    let created_s = started.elapsed().as_secs_f64();
    let bound = binds.wait(n, Duration::from_secs(60), Duration::from_secs(900)).await;
    let cpu_after = cpu_of();
    let (api_after, etcd_after) = (apiserver_metrics(admin).await, etcd_metrics(cp));
    let storage = Storage::read(&api_after, &etcd_after).since(&Storage::read(&api_before, &etcd_before));
    let apf = apf_waits(&api_before, &api_after);
    assert_eq!(bound, n, "burst, {label}: only {bound} of {n} whole-GPU pods bound");
    let attempts = scheduler_attempts(cp) - attempts_before;
    let bound_at = binds.bound_at();
    let last = bound_at.values().max().map_or(0.0, |t| t.duration_since(started).as_secs_f64());
    let mut waited: Vec<f64> = created
        .iter()
        .filter_map(|(name, at)| Some(bound_at.get(name)?.saturating_duration_since(*at).as_secs_f64() * 1e3))
        .collect();
    // the extender's bind lines written since the burst began (each bind is one line)
    let log = ext.and_then(|e| std::fs::read(&e.placement_log).ok()).unwrap_or_default();
    let (mut ext_ms, mut failed) = (Vec::new(), 0);
    for line in log.get(log_from..).unwrap_or_default().split(|b| *b == b'\n') {
        let Ok(d) = serde_json::from_slice::<Value>(line) else { continue };
        if d["verb"] == "bind" && d["pod"].as_str().is_some_and(|p| p.contains("/burst-")) {
            ext_ms.push(d["latency_us"].as_f64().unwrap_or(f64::NAN) / 1e3);
            failed += usize::from(d["outcome"] != "bound");
        }
    }
    let q = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let max = v.last().copied().unwrap_or(f64::NAN);
        format!("p50/p99/max {:.1}/{:.1}/{max:.1} ms", percentile(v, 0.5), percentile(v, 0.99))
    };
    // the API server's Binding histogram over the burst: after less before, bucket by bucket
    let binding = since(&binding_buckets(&api_after), &binding_buckets(&api_before));
    let extender = if ext.is_some() {
        format!(
            "; bind as the extender measured it {} over {} binds ({failed} failed); extender CPU {:.2} ms per pod",
            q(&mut ext_ms),
            ext_ms.len(),
            (cpu_after - cpu_before) * 1e3 / n as f64
        )
    } else {
        String::new()
    };
    figure(&format!(
        "scale {}: burst of {n} whole-GPU pods created in {created_s:.1} s, {label} running (client limits raised): \
         all bound {last:.1} s after the first create, {attempts} scheduling attempts; created to bound {}; \
         the API server's Binding p50/p99 {:.0}/{:.0} ms{extender}; {storage}; \
         waits in the API server's priority and fairness queues p99: {apf}",
        s.name,
        q(&mut waited),
        quantile_ms(&binding, 0.5),
        quantile_ms(&binding, 0.99),
    ));
    api.delete_collection(&DeleteParams::default().grace_period(0), &Default::default()).await.expect("delete pods");
    let until = Instant::now() + Duration::from_secs(120);
    while binds.pods() > 0 || ext.is_some_and(|e| counter(&e.metrics(), "gpuplace_pods_bound", "") > 0.0) {
        assert!(Instant::now() < until, "burst, {label}: pods not deleted, or still counted by the extender");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long the requests executed during the burst waited in the API server's priority and fairness
/// queues (`apiserver_flowcontrol_request_wait_duration_seconds`, the metrics text `before` and
/// `after`), per priority level that executed any: `level P99 ms over N`. kube-scheduler's calls and,
/// through the project's FlowSchema, the extender's go to `workload-high`; the test's own are
/// `system:masters` (exempt, never queued).
fn apf_waits(before: &str, after: &str) -> String {
    const PREFIX: &str = "apiserver_flowcontrol_request_wait_duration_seconds_bucket{";
    let mut levels: Vec<&str> = after
        .lines()
        .filter(|l| l.starts_with(PREFIX))
        .filter_map(|l| l.split("priority_level=\"").nth(1)?.split('"').next())
        .collect();
    levels.sort_unstable();
    levels.dedup();
    let parts: Vec<String> = levels
        .iter()
        .filter_map(|level| {
            let level_label = format!("priority_level=\"{level}\"");
            let labels = [level_label.as_str(), "execute=\"true\""];
            let diff = since(&buckets(after, PREFIX, &labels), &buckets(before, PREFIX, &labels));
            let n = diff.last().map_or(0.0, |b| b.1);
            (n > 0.0).then(|| format!("{level} {:.1} ms over {n:.0}", quantile_ms(&diff, 0.99)))
        })
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// A histogram's buckets over the time between two readings (`then`, `now`): bucket by bucket.
fn since(now: &[(f64, f64)], then: &[(f64, f64)]) -> Vec<(f64, f64)> {
    now.iter().map(|&(le, cum)| (le, cum - then.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1))).collect()
}

/// Where a Binding's time goes below the API server, over the burst: the API server's writes of pods
/// to etcd (`etcd_request_duration_seconds`, operation `update`, the Binding's storage update) and
/// etcd's own WAL fsync and backend commit (its `/metrics`). Each field is a histogram's buckets.
/// Read from the metrics texts of the API server (`api`) and of etcd (`etcd`).
struct Storage {
    pod_updates: Vec<(f64, f64)>,
    fsync: Vec<(f64, f64)>,
    commit: Vec<(f64, f64)>,
}

impl Storage {
    fn read(api: &str, etcd: &str) -> Storage {
        Storage {
            pod_updates: buckets(
                api,
                "etcd_request_duration_seconds_bucket{",
                &["group=\"\"", "operation=\"update\"", "resource=\"pods\""],
            ),
            fsync: buckets(etcd, "etcd_disk_wal_fsync_duration_seconds_bucket{", &[]),
            commit: buckets(etcd, "etcd_disk_backend_commit_duration_seconds_bucket{", &[]),
        }
    }

    /// The histograms over the time between `before` and `self`.
    fn since(&self, before: &Storage) -> Storage {
        Storage {
            pod_updates: since(&self.pod_updates, &before.pod_updates),
            fsync: since(&self.fsync, &before.fsync),
            commit: since(&self.commit, &before.commit),
        }
    }
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = |b: &[(f64, f64)]| {
            let n = b.last().map_or(0.0, |x| x.1);
            format!("p50/p99 {:.1}/{:.1} ms over {n:.0}", quantile_ms(b, 0.5), quantile_ms(b, 0.99))
        };
        write!(
            f,
            "the API server's pod updates in etcd {}; etcd's WAL fsync {}, backend commit {}",
            p(&self.pod_updates),
            p(&self.fsync),
            p(&self.commit)
        )
    }
}

/// etcd's metrics text (empty when it cannot be read).
fn etcd_metrics(cp: &ControlPlane) -> String {
    http_get(cp.etcd_port, "/metrics").map(|(_, body)| body).unwrap_or_default()
}

/// The API server's latency histogram of Binding calls (`POST pods/binding`), from whichever client,
/// in its metrics text.
fn binding_buckets(metrics: &str) -> Vec<(f64, f64)> {
    let labels = ["verb=\"POST\"", "resource=\"pods\"", "subresource=\"binding\""];
    buckets(metrics, "apiserver_request_duration_seconds_bucket{", &labels)
}
