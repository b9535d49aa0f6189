//! `/metrics`: Prometheus text exposition format 0.0.4.
//!
//! DCGM-exporter's names, help texts and units where they exist (its `default-counters.csv`), so
//! existing dashboards and alerts work unchanged, and dcgm-exporter's labels: `gpu`, `UUID`,
//! `pci_bus_id`, `device`, `modelName`, `Hostname`, plus `container`, `namespace`, `pod` when
//! pod-resources names the container holding the GPU and the operator asks for them
//! (`--metrics-pod-series`; off by default, since whoever may scrape would otherwise read every
//! tenant's pod names, issue 48). A GPU shared by several containers then gets one series per (GPU,
//! container), each with the whole GPU's value: the driver measures the GPU, not the container, so
//! `sum` over containers over-counts; aggregate with `max by (UUID)`.
//!
//! Then gpuplace's own gauges per GPU (allocated vs used memory and compute, health, XIDs) and the
//! sampler's counters. The HTTP side is hyper's HTTP/1 server, already in the build through tonic: a
//! framework (actix-web) would bring its own runtime next to the plugin's tokio one for one route.
//! It holds at most [`ServeLimits::max_connections`] connections (further ones wait in the kernel's
//! backlog, holding no descriptor of the plugin's) and closes idle and slow ones ([`ServeLimits`]).

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::isolation::IsolationStatus;
use crate::nvml::GpuInfo;
use crate::plugin::{GpuHealth, GrantKey, GrantedSlice, Plugin};
use crate::podresources::ContainerRef;
use crate::publish::PublishReason;
use crate::sampler::{Telemetry, TelemetryState, POD_RESOURCES_REASONS};
use crate::server::StopSignal;
use gpuplace_core::isolation::IsolationMode;

/// The exposition format's content type.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// dcgm-exporter's default port.
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9400";

/// Connections the metrics port holds at once (`--metrics-max-connections`): a scraper keeps one.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = 64;

/// What `/metrics` reads.
pub struct MetricsSource {
    pub hostname: String,
    pub plugin: Arc<Plugin>,
    pub telemetry: Arc<Telemetry>,
    /// The DCGM series carry the `namespace`, `pod` and `container` holding the GPU
    /// (`--metrics-pod-series`).
    pub pod_labels: bool,
}

impl MetricsSource {
    pub fn render(&self) -> String {
        let mut page = render(
            &self.hostname,
            self.plugin.gpus(),
            &self.plugin.health(),
            &self.plugin.grants(),
            &self.telemetry.snapshot(),
            self.pod_labels,
        );
        if let Some(status) = &self.plugin.config().isolation {
            render_isolation(&mut page, &self.hostname, status);
        }
        page
    }
}

/// The node's isolation mode (1 for the mode in use, 0 for the others), what it could run in, and
/// whether the driver can cap a cgroup's GPU memory.
pub fn render_isolation(out: &mut String, hostname: &str, status: &IsolationStatus) {
    let name = "gpuplace_isolation_mode";
    let mut f =
        Family::new(out, name, "gauge", "The isolation mode the plugin runs in: 1 for its mode, 0 for the others.");
    for m in IsolationMode::ALL {
        f.series(name, &labels(&[("Hostname", hostname), ("mode", m.name())]), u8::from(m == status.mode));
    }
    let name = "gpuplace_isolation_available";
    let mut f = Family::new(out, name, "gauge", "Whether the node could run in each isolation mode (found at start).");
    for m in IsolationMode::ALL {
        f.series(name, &labels(&[("Hostname", hostname), ("mode", m.name())]), u8::from(status.capabilities.has(m)));
    }
    let name = "gpuplace_driver_memory_limits";
    let mut f = Family::new(
        out,
        name,
        "gauge",
        "Whether the driver can cap a cgroup's GPU memory (NVML nvmlDeviceSetMemoryLimits_v1 with cgroup v2): always 1, on the series of its answer.",
    );
    let supported = if status.driver_memory_limits.supported { "true" } else { "false" };
    f.series(name, &labels(&[("Hostname", hostname), ("supported", supported)]), 1);
}

/// How the metrics port treats its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections held at once; at the cap the port accepts none until one closes.
    pub max_connections: usize,
    /// A request head (the first, or the next on a kept-alive connection) must be complete within
    /// this: an idle connection, or one sending half a request line, is closed after it.
    pub header_timeout: Duration,
    /// Any connection is closed after this, whatever it does (a client that never reads its answer).
    pub max_age: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_METRICS_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs(2),
            max_age: Duration::from_secs(30),
        }
    }
}

/// Memory (MiB) and compute (%) promised on one GPU.
///
/// With pod-resources: the containers holding one of its slots, each with its Allocate grant when the
/// plugin matched an extender assignment, else the whole GPU (without an assignment a container runs
/// unlimited). Without pod-resources: the grants the plugin recorded. Capped at the GPU's size.
pub fn allocated(
    gpu: &GpuInfo,
    holders: Option<&BTreeSet<ContainerRef>>,
    attributed: bool,
    grants: &BTreeMap<GrantKey, BTreeMap<u32, GrantedSlice>>,
) -> (u64, u32) {
    let whole = GrantedSlice { mem_mib: gpu.memory_mib, core_pct: 100 };
    let slices: Vec<GrantedSlice> = if attributed {
        holders
            .into_iter()
            .flatten()
            .map(|c| grants.get(&c.grant_key()).and_then(|s| s.get(&gpu.index)).copied().unwrap_or(whole))
            .collect()
    } else {
        grants.values().filter_map(|s| s.get(&gpu.index)).copied().collect()
    };
    let mem = slices.iter().map(|s| s.mem_mib).fold(0u64, u64::saturating_add).min(gpu.memory_mib);
    let core = slices.iter().map(|s| s.core_pct).fold(0u32, u32::saturating_add).min(100);
    (mem, core)
}

/// `name="value"` pairs, escaped as the format requires.
fn labels(pairs: &[(&str, &str)]) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push_str("=\"");
        for c in v.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
    out
}

/// One metric family being written: the header once, then its series.
struct Family<'a> {
    out: &'a mut String,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &str, kind: &str, help: &str) -> Self {
        // writing to a String cannot fail
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        Self { out }
    }

    fn series(&mut self, name: &str, labels: &str, value: impl std::fmt::Display) {
        let _ = writeln!(self.out, "{name}{labels} {value}");
    }
}

/// A DCGM field from a sample.
type Field = fn(&crate::nvml::GpuSample) -> f64;

const DCGM_FIELDS: [(&str, &str, Field); 6] = [
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", |s| f64::from(s.util_pct)),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", |s| s.mem_used_mib as f64),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", |s| s.mem_free_mib as f64),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", |s| f64::from(s.temperature_c)),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", |s| f64::from(s.power_mw) / 1000.0),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", |s| f64::from(s.sm_clock_mhz)),
];

/// The whole page; `pod_labels`: the DCGM series name the container holding the GPU. Pure:
/// everything comes in as arguments.
pub fn render(
    hostname: &str,
    gpus: &[GpuInfo],
    health: &[GpuHealth],
    grants: &BTreeMap<GrantKey, BTreeMap<u32, GrantedSlice>>,
    t: &TelemetryState,
    pod_labels: bool,
) -> String {
    let mut out = String::with_capacity(8192);
    let idx: Vec<String> = gpus.iter().map(|g| g.index.to_string()).collect();
    let dev: Vec<String> = gpus.iter().map(|g| format!("nvidia{}", g.index)).collect();
    let base = |i: usize| -> Vec<(&str, &str)> {
        let g = &gpus[i];
        vec![
            ("gpu", idx[i].as_str()),
            ("UUID", g.uuid.as_str()),
            ("pci_bus_id", g.pci_bus_id.as_str()),
            ("device", dev[i].as_str()),
            ("modelName", g.model.as_str()),
            ("Hostname", hostname),
        ]
    };
    let short = |i: usize| -> Vec<(&str, &str)> {
        let g = &gpus[i];
        vec![
            ("gpu", idx[i].as_str()),
            ("UUID", g.uuid.as_str()),
            ("modelName", g.model.as_str()),
            ("Hostname", hostname),
        ]
    };
    let holders = |i: usize| t.attribution.as_ref().and_then(|a| a.by_gpu.get(&gpus[i].index));
    // one label set per (GPU, container holding it), or one without pod labels
    let dcgm_labels = |i: usize| -> Vec<String> {
        match holders(i).filter(|h| pod_labels && !h.is_empty()) {
            Some(h) => h
                .iter()
                .map(|c| {
                    let mut l = base(i);
                    l.extend([
                        ("container", c.container.as_str()),
                        ("namespace", c.namespace.as_str()),
                        ("pod", c.pod.as_str()),
                    ]);
                    labels(&l)
                })
                .collect(),
            None => vec![labels(&base(i))],
        }
    };
    let all_labels: Vec<Vec<String>> = (0..gpus.len()).map(dcgm_labels).collect();
    let sample = |i: usize| t.samples.get(i).copied().flatten();

    for (name, help, field) in DCGM_FIELDS {
        let mut f = Family::new(&mut out, name, "gauge", help);
        for (i, ls) in all_labels.iter().enumerate() {
            // a GPU that does not answer has no reading: no series rather than a stale one
            let Some(s) = sample(i) else { continue };
            for l in ls {
                f.series(name, l, field(&s));
            }
        }
    }
    {
        let name = "DCGM_FI_DEV_XID_ERRORS";
        let mut f = Family::new(&mut out, name, "gauge", "Value of the last XID error encountered.");
        for (i, ls) in all_labels.iter().enumerate() {
            // from health events, so a GPU that fell off the bus still shows its XID 79
            let last = health.get(i).and_then(|h| h.last_xid).unwrap_or(0);
            for l in ls {
                f.series(name, l, last);
            }
        }
    }

    let attributed = t.attribution.is_some();
    let alloc: Vec<(u64, u32)> =
        gpus.iter().enumerate().map(|(i, g)| allocated(g, holders(i), attributed, grants)).collect();
    // (name, help, value of GPU i; `None` leaves the GPU out)
    type PerGpu<'a> = (&'a str, &'a str, Box<dyn Fn(usize) -> Option<u64> + 'a>);
    let per_gpu: [PerGpu; 5] = [
        ("gpuplace_gpu_memory_total_mib", "GPU memory size (MiB).", Box::new(|i| Some(gpus[i].memory_mib))),
        (
            "gpuplace_gpu_memory_allocated_mib",
            "GPU memory promised to containers (MiB): their Allocate grants, or the whole GPU for a container without one.",
            Box::new(|i| Some(alloc[i].0)),
        ),
        (
            "gpuplace_gpu_memory_used_mib",
            "GPU memory in use, as last sampled (MiB).",
            Box::new(|i| sample(i).map(|s| s.mem_used_mib)),
        ),
        (
            "gpuplace_gpu_core_allocated_percent",
            "GPU compute promised to containers (percent of the GPU), as for memory.",
            Box::new(|i| Some(u64::from(alloc[i].1))),
        ),
        (
            "gpuplace_gpu_core_used_percent",
            "GPU utilization, as last sampled (percent of the GPU).",
            Box::new(|i| sample(i).map(|s| u64::from(s.util_pct))),
        ),
    ];
    for (name, help, value) in &per_gpu {
        let mut f = Family::new(&mut out, name, "gauge", help);
        for i in 0..gpus.len() {
            // a GPU that does not answer has no "used" value rather than a stale one
            if let Some(v) = value(i) {
                f.series(name, &labels(&short(i)), v);
            }
        }
    }
    if attributed {
        let name = "gpuplace_gpu_containers";
        let mut f = Family::new(&mut out, name, "gauge", "Containers holding a device of the GPU (pod-resources).");
        for i in 0..gpus.len() {
            f.series(name, &labels(&short(i)), holders(i).map_or(0, BTreeSet::len));
        }
    }
    {
        let name = "gpuplace_gpu_healthy";
        let mut f =
            Family::new(&mut out, name, "gauge", "1 when the GPU's devices are advertised Healthy to kubelet, else 0.");
        for i in 0..gpus.len() {
            f.series(name, &labels(&short(i)), u8::from(health.get(i).is_some_and(|h| h.healthy)));
        }
    }
    {
        let name = "gpuplace_gpu_xid_errors_total";
        let mut f =
            Family::new(&mut out, name, "counter", "XID errors reported by the driver since the plugin started.");
        for i in 0..gpus.len() {
            f.series(name, &labels(&short(i)), health.get(i).map_or(0, |h| h.xid_count));
        }
    }
    {
        let name = "gpuplace_sampler_sweeps_total";
        let mut f = Family::new(&mut out, name, "counter", "Sampling rounds over the node's GPUs.");
        f.series(name, &labels(&[("Hostname", hostname)]), t.sweeps);
    }
    {
        let name = "gpuplace_sampler_errors_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "GPU samples that failed, by reason (gpu_lost, nvml, unknown_gpu, other).",
        );
        for ((gpu, reason), n) in &t.sample_errors {
            let Some(i) = gpus.iter().position(|g| g.index == *gpu) else { continue };
            let mut l = short(i);
            l.push(("reason", reason));
            f.series(name, &labels(&l), n);
        }
    }
    {
        let name = "gpuplace_podresources_up";
        let mut f = Family::new(
            &mut out,
            name,
            "gauge",
            "1 when the last pod-resources List answered (metrics carry pod labels), else 0.",
        );
        f.series(name, &labels(&[("Hostname", hostname)]), u8::from(attributed));
    }
    if t.pod_resources_enabled {
        let name = "gpuplace_podresources_errors_total";
        let mut f = Family::new(&mut out, name, "counter", "Failed pod-resources List calls, by reason.");
        for reason in POD_RESOURCES_REASONS {
            let n = t.pod_resources_errors.get(reason).copied().unwrap_or(0);
            f.series(name, &labels(&[("Hostname", hostname), ("reason", reason)]), n);
        }
    }
    // counted over the plugin's restarts: not exported until the earlier runs' counts are in, or a
    // restart would read as an increase
    if t.pod_resources_enabled && t.allocation_counts_loaded {
        let name = "gpuplace_allocation_mismatches_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "Devices Allocate granted with one pod's gpuplace assignment that kubelet gave to another pod with other limits (pod-resources cross-check); each such container runs with the other pod's limits. Kept across plugin restarts.",
        );
        f.series(name, &labels(&[("Hostname", hostname)]), t.allocation_mismatches);
        let name = "gpuplace_allocation_corrections_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "Devices Allocate matched to one of several pods with the same limits that kubelet gave to another of them: the container runs with its own limits, the record was corrected (informational). Kept across plugin restarts.",
        );
        f.series(name, &labels(&[("Hostname", hostname)]), t.allocation_corrections);
    }
    {
        let name = "gpuplace_utilization_publishes_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "gpuplace.io/utilization values published, by reason (first, moved, gpus_changed, max_interval).",
        );
        for reason in PublishReason::LABELS {
            let n = t.publishes.get(reason).copied().unwrap_or(0);
            f.series(name, &labels(&[("Hostname", hostname), ("reason", reason)]), n);
        }
    }
    {
        let name = "gpuplace_utilization_publish_errors_total";
        let mut f = Family::new(&mut out, name, "counter", "gpuplace.io/utilization writes that failed.");
        f.series(name, &labels(&[("Hostname", hostname)]), t.publish_errors);
    }
    if t.dra_enabled {
        {
            let name = "gpuplace_dra_claims_total";
            let mut f = Family::new(
                &mut out,
                name,
                "counter",
                "DRA mode: claims kubelet asked to prepare or unprepare, by outcome (prepared, refused, unprepared).",
            );
            for outcome in crate::sampler::DRA_CLAIM_OUTCOMES {
                let n = t.dra_claims.get(outcome).copied().unwrap_or(0);
                f.series(name, &labels(&[("Hostname", hostname), ("outcome", outcome)]), n);
            }
        }
        let name = "gpuplace_dra_registrations_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "DRA mode: times kubelet confirmed the driver's registration (again after each kubelet restart).",
        );
        f.series(name, &labels(&[("Hostname", hostname)]), t.dra_registrations);
    }
    if let Some(g) = &t.guard {
        {
            let name = "gpuplace_guard_containers_over_memory";
            let mut f = Family::new(
                &mut out,
                name,
                "gauge",
                "Containers (per GPU) holding more GPU memory than their grant plus one CUDA context per process, at the guard's last sample.",
            );
            f.series(name, &labels(&[("Hostname", hostname)]), g.over_memory);
        }
        {
            let name = "gpuplace_guard_unattributed_processes";
            let mut f = Family::new(
                &mut out,
                name,
                "gauge",
                "GPU processes of no container gpuplace granted (the MPS server, host daemons, pods gpuplace did not place): counted, never stopped.",
            );
            f.series(name, &labels(&[("Hostname", hostname)]), g.unattributed);
        }
        {
            let name = "gpuplace_guard_unmeasured_containers";
            let mut f = Family::new(
                &mut out,
                name,
                "gauge",
                "Granted containers (per GPU) whose processes' memory the driver did not report at the guard's last sample.",
            );
            f.series(name, &labels(&[("Hostname", hostname)]), g.unmeasured);
        }
        let name = "gpuplace_guard_actions_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "What the guard did, by action (memory_over, killed, evicted, stop_failed, compute_over).",
        );
        for action in crate::sampler::GUARD_ACTIONS {
            let n = g.actions.get(action).copied().unwrap_or(0);
            f.series(name, &labels(&[("Hostname", hostname), ("action", action)]), n);
        }
    }
    if let Some(d) = &t.driver_limits {
        {
            let name = "gpuplace_driver_limits_applied";
            let mut f = Family::new(
                &mut out,
                name,
                "gauge",
                "GPU memory caps the driver holds now for shares (one per cgroup and GPU; isolation mode driver-limits).",
            );
            f.series(name, &labels(&[("Hostname", hostname)]), d.applied);
        }
        let name = "gpuplace_driver_limit_errors_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "GPU memory caps the driver refused (retried at every pass; the guard holds those shares meanwhile).",
        );
        f.series(name, &labels(&[("Hostname", hostname)]), d.errors);
    }
    if t.api_enabled {
        let name = "gpuplace_apiserver_errors_total";
        let mut f = Family::new(
            &mut out,
            name,
            "counter",
            "Failed API-server calls, by operation (pods_list, pods_watch, pod_patch, node_get, node_patch, node_status_patch, configmap_*, resourceslice*, resourceclaim_get).",
        );
        for op in crate::k8s::API_OPS {
            let n = t.api_errors.get(op).copied().unwrap_or(0);
            f.series(name, &labels(&[("Hostname", hostname), ("op", op)]), n);
        }
    }
    if let Some(m) = &t.mps {
        render_mps(&mut out, hostname, m);
    }
    out
}

/// Managed MPS's series (`--mps-daemon`; see [`crate::mps`]).
fn render_mps(out: &mut String, hostname: &str, m: &crate::mps::daemon::MpsStatus) {
    let host = labels(&[("Hostname", hostname)]);
    let families: [(&str, &str, &str, u64); 7] = [
        ("gpuplace_mps_daemon_up", "gauge", "Managed MPS: 1 when the MPS control daemon answered its last health check.", u64::from(m.up)),
        ("gpuplace_mps_daemon_restarts_total", "counter", "Managed MPS: starts of the MPS control daemon after the first (it died, hung, or the GPUs serving shares changed).", m.restarts),
        ("gpuplace_mps_servers", "gauge", "Managed MPS: MPS servers running (one per user ID at a time).", m.servers.len() as u64),
        ("gpuplace_mps_server_faults_total", "counter", "Managed MPS: client faults that ended every client of an MPS server (control.log).", m.server_faults),
        ("gpuplace_mps_uid_conflicts_total", "counter", "Managed MPS: clients that connected while another user's MPS server ran, and so waited for it to end.", m.uid_conflicts),
        ("gpuplace_mps_clients_waiting", "gauge", "Managed MPS: clients waiting for another user's MPS server to end.", m.clients_waiting),
        ("gpuplace_mps_limit_errors_total", "counter", "Managed MPS: server-side limit commands the daemon refused or did not answer.", m.limit_errors),
    ];
    for (name, kind, help, value) in families {
        Family::new(out, name, kind, help).series(name, &host, value);
    }
}

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("binding the metrics endpoint on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// Binds the listener (separately from [`serve`], so a taken port fails the start, not later).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr).await.map_err(|source| MetricsError::Bind { addr, source })
}

fn respond(source: &MetricsSource, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body, content_type) = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/metrics") => (StatusCode::OK, source.render(), CONTENT_TYPE_TEXT),
        (_, "/metrics") => (StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n".into(), "text/plain"),
        _ => (StatusCode::NOT_FOUND, "gpuplace-device-plugin serves /metrics\n".into(), "text/plain"),
    };
    let mut resp = Response::new(Full::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// Serves `/metrics` on `listener` until `stop` resolves, with the default [`ServeLimits`].
pub async fn serve(listener: TcpListener, source: Arc<MetricsSource>, stop: StopSignal) {
    serve_limited(listener, source, ServeLimits::default(), stop).await
}

/// Serves `/metrics` on `listener` until `stop` resolves, holding at most `limits.max_connections`.
pub async fn serve_limited(
    listener: TcpListener,
    source: Arc<MetricsSource>,
    limits: ServeLimits,
    mut stop: StopSignal,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, max_connections = limits.max_connections, "serving /metrics");
    }
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        // at the cap, accept nothing: further connections wait in the kernel's backlog, where they
        // cost the plugin no file descriptor (issue 48)
        let slot = tokio::select! {
            _ = stop.as_mut() => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = stop.as_mut() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // out of file descriptors and the like: back off instead of spinning
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let source = source.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let resp = respond(&source, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            // idle connections and ones that never finish their request head are closed (hyper arms
            // this timer whenever it waits for a head, kept-alive connections included)
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(limits.max_age, conn).await {
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics connection ended with an error"),
                Err(_) => tracing::debug!(%peer, "metrics connection closed at its maximum age"),
                Ok(Ok(())) => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::GpuSample;
    use crate::podresources::Attribution;

    fn gpu(index: u32) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 80_000,
            total_mib: 80_000,
            reserved_mib: Some(0),
            context_reserve_mib: 0,
            numa_node: None,
            pci_bus_id: format!("0000:{:02x}:00.0", index + 0x18),
            nvswitch_links: 0,
        }
    }

    fn sample(index: u32, util: u32) -> GpuSample {
        GpuSample {
            index,
            util_pct: util,
            mem_used_mib: 1000,
            mem_free_mib: 79_000,
            temperature_c: 40,
            power_mw: 123_456,
            sm_clock_mhz: 1980,
        }
    }

    fn healthy() -> GpuHealth {
        GpuHealth { healthy: true, reason: String::new(), xid_count: 0, last_xid: None }
    }

    fn who(ns: &str, pod: &str, c: &str) -> ContainerRef {
        ContainerRef { namespace: ns.into(), pod: pod.into(), container: c.into() }
    }

    #[test]
    fn the_isolation_mode_and_driver_limits_are_series() {
        let caps = crate::isolation::Capabilities::new(Err("no".into()), Err("no".into()), Ok(()));
        let status = IsolationStatus {
            mode: IsolationMode::Guard,
            capabilities: caps,
            driver_memory_limits: crate::nvml::DriverMemoryLimits::absent("driver 550"),
        };
        let mut page = String::new();
        render_isolation(&mut page, "node-a", &status);
        assert!(page.contains(r#"gpuplace_isolation_mode{Hostname="node-a",mode="guard"} 1"#), "{page}");
        assert!(page.contains(r#"gpuplace_isolation_mode{Hostname="node-a",mode="mps"} 0"#), "{page}");
        assert!(page.contains(r#"gpuplace_isolation_available{Hostname="node-a",mode="advisory"} 1"#), "{page}");
        assert!(page.contains(r#"gpuplace_isolation_available{Hostname="node-a",mode="driver-limits"} 0"#), "{page}");
        assert!(page.contains(r#"gpuplace_driver_memory_limits{Hostname="node-a",supported="false"} 1"#), "{page}");
        assert_eq!(page.matches("# TYPE").count(), 3);
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(labels(&[("a", "x\"y\\z\nw"), ("b", "")]), r#"{a="x\"y\\z\nw",b=""}"#);
    }

    #[test]
    fn allocation_counts_grants_and_whole_gpus_for_containers_without_one() {
        let g = gpu(1);
        let a = who("ns", "a", "main");
        let b = who("ns", "b", "main");
        let mut grants = BTreeMap::new();
        grants.insert(a.grant_key(), BTreeMap::from([(1, GrantedSlice { mem_mib: 20_000, core_pct: 25 })]));
        let holders = BTreeSet::from([a.clone()]);
        assert_eq!(allocated(&g, Some(&holders), true, &grants), (20_000, 25));
        // b has no grant (no assignment source): it may use the whole GPU
        let holders = BTreeSet::from([a, b]);
        assert_eq!(allocated(&g, Some(&holders), true, &grants), (80_000, 100));
        // pod-resources down: the recorded grants
        assert_eq!(allocated(&g, None, false, &grants), (20_000, 25));
        assert_eq!(allocated(&gpu(2), None, false, &grants), (0, 0));
        assert_eq!(allocated(&gpu(2), None, true, &grants), (0, 0));
    }

    #[test]
    fn page_has_headers_dcgm_series_per_container_and_no_series_for_silent_gpus() {
        let gpus = [gpu(0), gpu(1), gpu(2)];
        let mut health = vec![healthy(), healthy(), healthy()];
        health[2] = GpuHealth { healthy: false, reason: "fell off the bus".into(), xid_count: 2, last_xid: Some(79) };
        let mut a = Attribution::default();
        a.by_gpu.insert(0, BTreeSet::from([who("ml", "train", "main"), who("web", "infer", "srv")]));
        let t = TelemetryState {
            sweeps: 3,
            samples: vec![Some(sample(0, 90)), Some(sample(1, 0)), None],
            sample_errors: BTreeMap::from([((2, "gpu_lost"), 2)]),
            attribution: Some(a),
            pod_resources_enabled: true,
            ..TelemetryState::default()
        };
        // without --metrics-pod-series: the same page, no pod named
        let plain = render("node-a", &gpus, &health, &BTreeMap::new(), &t, false);
        assert!(!plain.contains("pod=") && !plain.contains("train"), "{plain}");
        assert!(plain.contains(
            r#"gpuplace_gpu_containers{gpu="0",UUID="GPU-0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 2"#
        ));
        let page = render("node-a", &gpus, &health, &BTreeMap::new(), &t, true);
        assert!(
            page.contains("# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n")
        );
        let util: Vec<&str> = page.lines().filter(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{")).collect();
        assert_eq!(util.len(), 3, "two containers on GPU 0, one unattributed series for GPU 1, none for 2: {util:#?}");
        assert_eq!(
            util[0],
            r#"DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",pci_bus_id="0000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="main",namespace="ml",pod="train"} 90"#
        );
        assert!(util[1].contains(r#"pod="infer"} 90"#));
        assert!(util[2].ends_with(r#"Hostname="node-a"} 0"#));
        assert!(page.contains(r#"DCGM_FI_DEV_POWER_USAGE{gpu="1","#) && page.contains("} 123.456\n"));
        assert!(page.contains(r#"DCGM_FI_DEV_XID_ERRORS{gpu="2",UUID="GPU-2",pci_bus_id="0000:1a:00.0",device="nvidia2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 79"#));
        assert!(page.contains(
            r#"gpuplace_gpu_healthy{gpu="2",UUID="GPU-2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 0"#
        ));
        assert!(page.contains(r#"gpuplace_sampler_errors_total{gpu="2",UUID="GPU-2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",reason="gpu_lost"} 2"#));
        assert!(page.contains(r#"gpuplace_gpu_memory_allocated_mib{gpu="0",UUID="GPU-0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 80000"#));
        assert!(page.contains(
            r#"gpuplace_gpu_containers{gpu="0",UUID="GPU-0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 2"#
        ));
        assert!(!page.contains(r#"gpuplace_gpu_memory_used_mib{gpu="2""#));
        assert!(page.contains(r#"gpuplace_podresources_errors_total{Hostname="node-a",reason="socket_missing"} 0"#));
        // every family has exactly one HELP and one TYPE, and every series line parses as name{..} value
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<f64>().unwrap_or_else(|_| panic!("{line}"));
        }
        let types: Vec<&str> = page.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let names: BTreeSet<&str> = types.iter().map(|l| l.split(' ').nth(2).unwrap()).collect();
        assert_eq!(names.len(), types.len());
    }
}
