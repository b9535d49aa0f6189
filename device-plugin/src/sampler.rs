//! The sampling loop: every `--sample-interval`, one sweep over the GPUs (`GpuBackend::sample`), one
//! pod-resources `List` for attribution and the cross-check of Allocate's grants
//! ([`crate::crosscheck`]), then the utilization publish policy. The results go into
//! [`Telemetry`], which `/metrics` reads; nothing here fails the plugin: a GPU that does not answer,
//! a missing pod-resources socket or a failed publish is counted, logged once per change, and retried
//! at the next tick.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpuplace_core::annotations::AllocationCounts;

use crate::crosscheck::{Limits, MismatchReporter};
use crate::nvml::{BackendError, GpuBackend, GpuSample};
use crate::plugin::Plugin;
use crate::podresources::{attribute, Attribution, PodResourcesClient, PodResourcesError};
use crate::publish::{GpuReading, Outcome, Publisher};

/// Labels of `gpuplace_podresources_errors_total`, all exported from the start.
pub const POD_RESOURCES_REASONS: [&str; 4] = ["socket_missing", "connect", "call", "timeout"];

/// What the sampler saw last, and its counters: the state `/metrics` renders.
#[derive(Debug, Clone, Default)]
pub struct TelemetryState {
    pub sweeps: u64,
    pub last_sweep_unix_ms: Option<i64>,
    /// By GPU index; `None` before the first sweep and while the GPU does not answer.
    pub samples: Vec<Option<GpuSample>>,
    /// (GPU index, reason) -> failed samples.
    pub sample_errors: BTreeMap<(u32, &'static str), u64>,
    /// The last pod-resources `List`, `None` while it fails or when attribution is off: metrics then
    /// carry no pod labels rather than stale ones.
    pub attribution: Option<Attribution>,
    pub pod_resources_enabled: bool,
    pub pod_resources_errors: BTreeMap<&'static str, u64>,
    /// Why the last `List` failed, for the log-once-per-change rule.
    pub pod_resources_last_error: Option<&'static str>,
    pub publishes: BTreeMap<&'static str, u64>,
    pub publish_errors: u64,
    /// Whether the plugin talks to the API server: its error series are exported only then.
    pub api_enabled: bool,
    /// Failed API-server calls, by operation (`crate::k8s::API_OPS`).
    pub api_errors: BTreeMap<&'static str, u64>,
    /// Devices that Allocate granted as one pod's assignment and kubelet gave to another pod with
    /// other limits (or unknown ones), over the plugin's restarts once
    /// [`allocation_counts_loaded`](Self::allocation_counts_loaded).
    pub allocation_mismatches: u64,
    /// The same with identical limits (a match among interchangeable pods): the record corrected.
    pub allocation_corrections: u64,
    /// Whether the counts of earlier runs are in the two above: read from the Node's
    /// `gpuplace.io/allocation-counts` by the node pass, so a restart does not reset the counters
    /// (without an API server there is nothing to read: loaded from the start). Until then the two
    /// series are not exported, since 0 followed by the persisted total would read as an increase.
    pub allocation_counts_loaded: bool,
    /// DRA mode: its series are exported only then.
    pub dra_enabled: bool,
    /// DRA mode: claims by outcome ([`DRA_CLAIM_OUTCOMES`]).
    pub dra_claims: BTreeMap<&'static str, u64>,
    /// DRA mode: times kubelet said the driver's registration succeeded.
    pub dra_registrations: u64,
    /// The guard's counts, when it runs ([`crate::guard`]).
    pub guard: Option<GuardStats>,
    /// Managed MPS (`--mps-daemon`): its series are exported only then.
    pub mps: Option<crate::mps::daemon::MpsStatus>,
    /// Driver memory caps ([`crate::driver_limits`]), when they are kept.
    pub driver_limits: Option<DriverLimitStats>,
}

/// The driver's memory caps: how many are set now, and how often the driver refused one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverLimitStats {
    pub applied: u64,
    pub errors: u64,
}

/// Labels of `gpuplace_guard_actions_total`, all exported from the start.
pub const GUARD_ACTIONS: [&str; 5] = ["memory_over", "killed", "evicted", "stop_failed", "compute_over"];

/// What the guard saw at its last sample, and what it did since the start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuardStats {
    pub over_memory: u64,
    pub unattributed: u64,
    pub unmeasured: u64,
    pub actions: BTreeMap<&'static str, u64>,
}

/// Labels of `gpuplace_dra_claims_total`, all exported from the start: claims prepared, refused
/// (the reason is in the claim's entry, kubelet's Event and the log), unprepared.
pub const DRA_CLAIM_OUTCOMES: [&str; 3] = ["prepared", "refused", "unprepared"];

/// Shared between the sampler (writer) and the metrics endpoint (reader).
#[derive(Debug, Default)]
pub struct Telemetry {
    state: Mutex<TelemetryState>,
    /// Rung when the allocation counts change, for the node pass that persists them.
    counts_changed: tokio::sync::Notify,
}

impl Telemetry {
    pub fn new(gpus: usize, pod_resources_enabled: bool) -> Arc<Self> {
        let state = TelemetryState {
            samples: vec![None; gpus],
            pod_resources_enabled,
            allocation_counts_loaded: true,
            ..TelemetryState::default()
        };
        Arc::new(Self { state: Mutex::new(state), counts_changed: tokio::sync::Notify::new() })
    }

    /// Counts what one cross-check found.
    pub fn count_allocations(&self, mismatches: u64, corrections: u64) {
        if mismatches + corrections == 0 {
            return;
        }
        let mut st = self.lock();
        st.allocation_mismatches += mismatches;
        st.allocation_corrections += corrections;
        drop(st);
        self.counts_changed.notify_one();
    }

    /// Adds the counts of earlier runs, once (later calls change nothing).
    pub fn load_allocation_counts(&self, counts: AllocationCounts) {
        let mut st = self.lock();
        if !st.allocation_counts_loaded {
            st.allocation_mismatches += counts.mismatches;
            st.allocation_corrections += counts.corrections;
            st.allocation_counts_loaded = true;
        }
    }

    /// The counts to persist, once those of earlier runs are in.
    pub fn allocation_counts(&self) -> Option<AllocationCounts> {
        let st = self.lock();
        st.allocation_counts_loaded.then(|| AllocationCounts::new(st.allocation_mismatches, st.allocation_corrections))
    }

    /// Resolves when the allocation counts changed since the last call (at once if they did).
    pub async fn allocation_counts_changed(&self) {
        self.counts_changed.notified().await;
    }

    fn lock(&self) -> MutexGuard<'_, TelemetryState> {
        // plain data: a panic elsewhere leaves it usable
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Exports the API-server error series (zero until a call fails); the allocation counts wait for
    /// those of earlier runs from then on.
    pub fn enable_api(&self) {
        let mut st = self.lock();
        st.api_enabled = true;
        st.allocation_counts_loaded = false;
    }

    /// Exports the DRA series (zero until something happens).
    pub fn enable_dra(&self) {
        self.lock().dra_enabled = true;
    }

    /// Counts one claim's outcome (one of [`DRA_CLAIM_OUTCOMES`]).
    pub fn dra_claim(&self, outcome: &'static str) {
        *self.lock().dra_claims.entry(outcome).or_insert(0) += 1;
    }

    /// Counts one successful registration with kubelet as the DRA driver.
    pub fn dra_registered(&self) {
        self.lock().dra_registrations += 1;
    }

    /// Exports the guard's series (zero until it acts).
    pub fn enable_guard(&self) {
        self.lock().guard.get_or_insert_with(GuardStats::default);
    }

    /// The guard's gauges after one sample.
    pub fn guard_sampled(&self, over_memory: usize, unattributed: usize, unmeasured: usize) {
        let mut st = self.lock();
        let g = st.guard.get_or_insert_with(GuardStats::default);
        (g.over_memory, g.unattributed, g.unmeasured) = (over_memory as u64, unattributed as u64, unmeasured as u64);
    }

    /// Counts one thing the guard did ([`GUARD_ACTIONS`]).
    pub fn guard_action(&self, action: &'static str) {
        let mut st = self.lock();
        *st.guard.get_or_insert_with(GuardStats::default).actions.entry(action).or_insert(0) += 1;
    }

    /// A GPU's utilization at the sampler's last sweep (`None` before the first or where that
    /// sample failed): the guard judges compute on it rather than sampling the GPU a second time.
    pub fn last_util(&self, gpu: u32) -> Option<u32> {
        self.lock().samples.get(gpu as usize).copied().flatten().map(|s| s.util_pct)
    }

    /// Records a sweep's samples as the sampler does (tests of their readers).
    pub fn record_samples(&self, samples: Vec<Option<GpuSample>>) {
        self.lock().samples = samples;
    }

    /// Exports the driver-limits series (zero until a cap is set).
    pub fn enable_driver_limits(&self) {
        self.lock().driver_limits.get_or_insert_with(DriverLimitStats::default);
    }

    /// Caps set now (cgroup and GPU pairs).
    pub fn driver_limits_applied(&self, n: usize) {
        self.lock().driver_limits.get_or_insert_with(DriverLimitStats::default).applied = n as u64;
    }

    /// One cap the driver refused.
    pub fn driver_limit_error(&self) {
        self.lock().driver_limits.get_or_insert_with(DriverLimitStats::default).errors += 1;
    }

    /// Managed MPS's state now (exports its series from then on).
    pub fn set_mps(&self, status: &crate::mps::daemon::MpsStatus) {
        self.lock().mps = Some(status.clone());
    }

    /// Counts one failed API-server call.
    pub fn api_error(&self, op: &'static str) {
        *self.lock().api_errors.entry(op).or_insert(0) += 1;
    }

    /// A copy for rendering (taken under the lock, rendered without it).
    pub fn snapshot(&self) -> TelemetryState {
        self.lock().clone()
    }
}

/// The metric label of a failed sample.
pub fn sample_error_reason(e: &BackendError) -> &'static str {
    match e {
        BackendError::GpuLost(_) => "gpu_lost",
        BackendError::Nvml { .. } | BackendError::NvmlUnavailable(_) => "nvml",
        BackendError::UnknownGpu(_) => "unknown_gpu",
        BackendError::Inconsistent(_) | BackendError::Fake(_) => "other",
    }
}

fn unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The loop's parts; [`tick`](Self::tick) is one round, so tests drive it without waiting.
pub struct Sampler {
    backend: Arc<dyn GpuBackend>,
    plugin: Arc<Plugin>,
    telemetry: Arc<Telemetry>,
    pod_resources: Option<PodResourcesClient>,
    publisher: Publisher,
    start: Instant,
    reporter: Option<Arc<dyn MismatchReporter>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").field("pod_resources", &self.pod_resources).finish_non_exhaustive()
    }
}

impl Sampler {
    /// `pod_resources: None` turns attribution off.
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        plugin: Arc<Plugin>,
        telemetry: Arc<Telemetry>,
        pod_resources: Option<PodResourcesClient>,
        publisher: Publisher,
    ) -> Self {
        Self { backend, plugin, telemetry, pod_resources, publisher, start: Instant::now(), reporter: None }
    }

    /// Also reports each allocation mismatch there (Events, with an API server).
    pub fn set_reporter(&mut self, reporter: Arc<dyn MismatchReporter>) {
        self.reporter = Some(reporter);
    }

    /// Ticks every `interval` (the first at once) until the task is dropped or aborted.
    pub async fn run(mut self, interval: Duration) {
        let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(10)));
        // a slow sweep (a wedged NVML call) pushes the next one back rather than bunching them up
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            self.tick().await;
        }
    }

    /// One round: sweep, attribute, publish.
    pub async fn tick(&mut self) {
        let samples = self.sweep().await;
        let at_unix_ms = unix_ms();
        let attribution = self.attribute().await;

        let gpus = self.plugin.gpus();
        let readings: Vec<GpuReading> = samples
            .iter()
            .zip(gpus)
            .filter_map(|(s, g)| {
                s.as_ref().ok().map(|s| GpuReading {
                    uuid: g.uuid.clone(),
                    memory_mib: g.memory_mib,
                    sm_percent: s.util_pct,
                    memory_used_mib: s.mem_used_mib,
                })
            })
            .collect();
        {
            let mut st = self.telemetry.lock();
            st.sweeps += 1;
            st.last_sweep_unix_ms = Some(at_unix_ms);
            st.samples = samples.iter().map(|s| s.as_ref().ok().copied()).collect();
            for (i, r) in samples.iter().enumerate() {
                if let Err(e) = r {
                    *st.sample_errors.entry((i as u32, sample_error_reason(e))).or_default() += 1;
                }
            }
            match attribution {
                Some(Ok(a)) => {
                    if st.pod_resources_last_error.take().is_some() {
                        tracing::info!("pod-resources answers again; metrics carry pod labels");
                    }
                    st.attribution = Some(a);
                }
                Some(Err(e)) => {
                    let reason = e.reason();
                    *st.pod_resources_errors.entry(reason).or_default() += 1;
                    // once per change of reason, not every tick
                    if st.pod_resources_last_error != Some(reason) {
                        tracing::warn!(error = %e, "pod-resources List failed; metrics carry no pod labels until it answers");
                    }
                    st.pod_resources_last_error = Some(reason);
                    st.attribution = None;
                }
                None => st.attribution = None,
            }
        }

        let outcome = self.publisher.offer(readings, self.start.elapsed(), at_unix_ms).await;
        let mut st = self.telemetry.lock();
        match outcome {
            Outcome::Published(r) => {
                tracing::debug!(reason = r.label(), "utilization published");
                *st.publishes.entry(r.label()).or_default() += 1;
            }
            Outcome::Failed(e) => {
                tracing::warn!(error = %e, "utilization publish failed; retried after the minimum interval");
                st.publish_errors += 1;
            }
            Outcome::Held(_) | Outcome::Skipped => {}
        }
    }

    /// Samples every GPU on a blocking thread (NVML calls block).
    async fn sweep(&self) -> Vec<Result<GpuSample, BackendError>> {
        let n = self.plugin.gpus().len() as u32;
        let backend = self.backend.clone();
        match tokio::task::spawn_blocking(move || (0..n).map(|i| backend.sample(i)).collect::<Vec<_>>()).await {
            Ok(v) => {
                for (i, r) in v.iter().enumerate() {
                    if let Err(e) = r {
                        tracing::debug!(gpu = i, error = %e, "sample failed");
                    }
                }
                v
            }
            Err(e) => {
                tracing::warn!(error = %e, "GPU sweep panicked");
                (0..n).map(|_| Err(BackendError::Fake(format!("sweep panicked: {e}")))).collect()
            }
        }
    }

    /// One `List`, mapped to our GPUs; checks the plugin's grant records against it (correcting
    /// them), then forgets those of containers that are gone.
    async fn attribute(&self) -> Option<Result<Attribution, PodResourcesError>> {
        let client = self.pod_resources.as_ref()?;
        let listed_at = Instant::now();
        let resp = match client.list().await {
            Ok(resp) => resp,
            Err(e) => return Some(Err(e)),
        };
        let a = attribute(&resp, &self.plugin.config().resource_name, self.plugin.slots());
        let found = self.plugin.cross_check(&a, listed_at).await;
        let corrections = found.iter().filter(|m| m.limits == Limits::Identical).count() as u64;
        self.telemetry.count_allocations(found.len() as u64 - corrections, corrections);
        for m in &found {
            match m.limits {
                Limits::Different => tracing::error!(device = %m.device, granted = ?m.granted_to, "{m}"),
                Limits::Identical => tracing::info!(device = %m.device, granted = ?m.granted_to, "{m}"),
            }
            if let Some(r) = &self.reporter {
                r.report(m);
            }
        }
        if a.unknown_ids > 0 {
            tracing::debug!(ids = a.unknown_ids, "pod-resources lists device IDs this node does not have");
        }
        Some(Ok(a))
    }
}
