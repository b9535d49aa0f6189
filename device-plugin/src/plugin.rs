//! The `DevicePlugin` service: slots, health, preferred allocation and `Allocate`.
//!
//! [`Plugin`] holds the state and outlives gRPC servers: when kubelet restarts, [`crate::server`]
//! starts a new server on the same `Plugin`, so health and allocation bookkeeping carry over.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuplace_core::assignment::GpuSlice;
use gpuplace_core::topology::{GpuTopology, SubsetError};
use tokio::sync::watch;
use tonic::Status;

use crate::admitting::admitting;
use crate::assign::{
    match_allocation, match_preference, AssignmentSource, Grant, MatchError, PendingPod, PodKey, SourceError,
};
use crate::container_env::{gpu_env, limit_env, GpuLimit, MpsConnect};
use crate::crosscheck::{check_grant, holder_container, sole_holder, Mismatch, Verdict};
use crate::kubelet_api::podresources::ListPodResourcesResponse;
use crate::kubelet_api::v1beta1::{
    ContainerAllocateRequest, ContainerAllocateResponse, ContainerPreferredAllocationRequest, Device,
    DevicePluginOptions, Mount, NumaNode, TopologyInfo,
};
use crate::kubelet_api::{HEALTHY, UNHEALTHY};
use crate::mps::daemon::ShareSource;
use crate::mps::limits::ShareSlice;
use crate::nvml::{xid_is_critical, GpuEvent, GpuEventKind, GpuInfo, Inventory};
use crate::podresources::{Attribution, PodResourcesClient};
use crate::slots::{Slot, SlotError, SlotTable, DEFAULT_SLOTS_PER_GPU};

pub mod service;

/// The extended resource kubelet advertises for us.
pub const RESOURCE_NAME: &str = "gpuplace.io/gpu";

/// How long a grant pod-resources has never listed is kept: kubelet lists a container's devices as
/// soon as Allocate answers, so one still missing after several sampling rounds was not admitted.
pub const UNSEEN_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub resource_name: String,
    pub slots_per_gpu: u32,
    /// Host directory of the MPS control daemon's pipes, mounted into containers with a share.
    pub mps_pipe_dir: Option<PathBuf>,
    /// Host directory that is the MPS daemon's `/dev/shm`, mounted as a share container's
    /// `/dev/shm` (with `mps_pipe_dir` only).
    pub mps_shm_dir: Option<PathBuf>,
    /// The isolation mode chosen at start and what it was chosen from (published with the node's
    /// inventory and DRA devices, on `/metrics`); `None`: not decided (tests), published as nothing.
    pub isolation: Option<crate::isolation::IsolationStatus>,
}

impl PluginConfig {
    /// How share containers reach the MPS daemon, when there is one.
    pub fn mps_connect(&self) -> Option<MpsConnect> {
        self.mps_pipe_dir.clone().map(|pipe_dir| MpsConnect { pipe_dir, shm_dir: self.mps_shm_dir.clone() })
    }
}

impl Default for PluginConfig {
    fn default() -> Self {
        Self {
            resource_name: RESOURCE_NAME.into(),
            slots_per_gpu: DEFAULT_SLOTS_PER_GPU,
            mps_pipe_dir: None,
            mps_shm_dir: None,
            isolation: None,
        }
    }
}

impl PluginConfig {
    /// The mode to publish.
    pub fn isolation_mode(&self) -> Option<gpuplace_core::isolation::IsolationMode> {
        self.isolation.as_ref().map(|s| s.mode)
    }
}

/// Why the plugin could not be built from an inventory.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("slot layout: {0}")]
    Slots(#[from] SlotError),
    #[error("topology: {0}")]
    Topology(String),
    #[error("inventory: {0}")]
    Backend(#[from] crate::nvml::BackendError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Health {
    healthy: bool,
    reason: String,
    /// XIDs seen since start (application ones included: they are what a user debugs).
    xid_count: u64,
    last_xid: Option<u64>,
}

/// A GPU's health as metrics report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealth {
    pub healthy: bool,
    pub reason: String,
    pub xid_count: u64,
    pub last_xid: Option<u64>,
}

/// What one container was granted on one GPU by an Allocate that matched an extender assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantedSlice {
    pub mem_mib: u64,
    pub core_pct: u32,
}

pub use crate::crosscheck::GrantKey;

#[derive(Debug, Clone)]
struct GrantRecord {
    /// Whose assignment was applied: the pod as the source knows it, and the container.
    pod: PodKey,
    container: String,
    /// GPU index -> slice.
    slices: BTreeMap<u32, GrantedSlice>,
    /// The slices as assigned, sorted by GPU: the limits the container was started with.
    limits: Vec<GpuSlice>,
    /// The device IDs kubelet sent with the Allocate.
    devices: BTreeSet<String>,
    at: Instant,
    /// Compared with pod-resources already (confirmed, or its mismatch reported once).
    checked: bool,
    /// Matched among interchangeable pods ([`Grant::guessed`]): marked unconfirmed on the pod.
    guessed: bool,
}

/// The name a corrected grant is kept under, and the holder's pod and container when it has an
/// assignment.
type Renamed = (GrantKey, Option<PodKey>, Option<String>);

/// Containers this process has matched, so a stale pod list cannot match one twice.
#[derive(Debug, Default)]
struct Claims {
    claimed: HashSet<(PodKey, String)>,
    /// The pod whose container was matched last: kubelet admits one pod's containers together.
    sticky: Option<PodKey>,
    /// When the last container was matched: a pod-resources listing that began before it may not
    /// show that container yet, so its absence proves nothing and records are not corrected from it.
    last_claim: Option<Instant>,
}

/// See the module docs.
pub struct Plugin {
    config: PluginConfig,
    gpus: Vec<GpuInfo>,
    topology: GpuTopology,
    slots: SlotTable,
    health: Mutex<Vec<Health>>,
    devices: watch::Sender<Arc<Vec<Device>>>,
    /// Successful registrations with kubelet so far: a new one means kubelet (re)started and rewrote
    /// the node's status, so the node-status writer re-applies gpu-mem and gpu-core.
    registrations: watch::Sender<u64>,
    source: Option<Arc<dyn AssignmentSource>>,
    claims: tokio::sync::Mutex<Claims>,
    /// Slices of matched Allocates, for the allocated-vs-used metrics. Pruned by the sampler to the
    /// containers pod-resources still lists.
    grants: Mutex<BTreeMap<GrantKey, GrantRecord>>,
    /// Bumped when grants come or go (or DRA prepares a claim), so the MPS daemon's limits follow.
    share_changes: watch::Sender<u64>,
    /// The kubelet's pod-resources API: which pod it is admitting ([`crate::admitting`]).
    pod_resources: std::sync::OnceLock<PodResourcesClient>,
    /// Whether this kubelet's pod-resources `List` has shown a pod being admitted (one of ours,
    /// waiting without its devices). From then on a `List` that shows none of ours waiting means
    /// the kubelet admits a pod gpuplace did not place, and Allocate refuses it.
    lists_admitting: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("config", &self.config).field("gpus", &self.gpus.len()).finish_non_exhaustive()
    }
}

fn status_from_slot(e: SlotError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// Pods named in a refusal's message at most; the rest are counted.
const SKIPPED_NAMED: usize = 4;

/// `message`, plus the pods whose assignment is not applied (the refused pod may be one of them, and
/// this says why).
fn with_skipped(message: String, skipped: &[String]) -> String {
    if skipped.is_empty() {
        return message;
    }
    let mut named = skipped.iter().take(SKIPPED_NAMED).cloned().collect::<Vec<_>>().join("; ");
    if skipped.len() > SKIPPED_NAMED {
        named.push_str(&format!("; and {} more", skipped.len() - SKIPPED_NAMED));
    }
    format!("{message}. Assignments on this node not applied: {named}")
}

impl Plugin {
    /// `source`: where pod assignments come from; `None` runs without the extender (kubelet's slots
    /// decide the GPUs, no per-pod limits), as the plugin does until the Kubernetes source exists.
    pub fn new(
        config: PluginConfig,
        inventory: &Inventory,
        source: Option<Arc<dyn AssignmentSource>>,
    ) -> Result<Arc<Self>, PluginError> {
        inventory.validate()?;
        let topology = inventory.topology().map_err(|e| PluginError::Topology(e.to_string()))?;
        let slots = SlotTable::new(inventory.gpus.iter().map(|g| g.uuid.clone()).collect(), config.slots_per_gpu)?;
        let health =
            vec![Health { healthy: true, reason: String::new(), xid_count: 0, last_xid: None }; inventory.gpus.len()];
        let plugin = Self {
            config,
            gpus: inventory.gpus.clone(),
            topology,
            slots,
            devices: watch::Sender::new(Arc::new(Vec::new())),
            registrations: watch::Sender::new(0),
            health: Mutex::new(health),
            source,
            claims: tokio::sync::Mutex::new(Claims::default()),
            grants: Mutex::new(BTreeMap::new()),
            share_changes: watch::Sender::new(0),
            pod_resources: std::sync::OnceLock::new(),
            lists_admitting: std::sync::atomic::AtomicBool::new(false),
        };
        let list = plugin.device_list(&plugin.lock_health());
        plugin.devices.send_replace(Arc::new(list));
        Ok(Arc::new(plugin))
    }

    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// Asks the kubelet's pod-resources API which pod it is admitting before matching an
    /// assignment ([`crate::admitting`]); without it only [`crate::assign`]'s rules decide. Set once.
    pub fn set_pod_resources(&self, client: PodResourcesClient) {
        let _ = self.pod_resources.set(client);
    }

    /// The kubelet's pod-resources `List`, asked once per admission step; `None` when it cannot be
    /// asked (no socket configured, or the call failed).
    async fn admission_list(&self) -> Option<ListPodResourcesResponse> {
        let pr = self.pod_resources.get()?;
        match pr.list().await {
            Ok(list) => Some(list),
            Err(e) => {
                tracing::warn!(error = %e, "pod-resources List failed; matching by the assignment rules alone");
                None
            }
        }
    }

    /// `pending` narrowed to the pods `list` shows the kubelet admitting; unchanged without a list,
    /// or when it lists none of them waiting. The flag is that last case: a list read, none of
    /// `pending` shown waiting (the kubelet admits a pod gpuplace did not place, once it is known to
    /// list the pod it admits).
    fn narrow_to_admitting(
        &self,
        list: Option<&ListPodResourcesResponse>,
        pending: Vec<PendingPod>,
    ) -> (Vec<PendingPod>, bool) {
        let Some(list) = list else { return (pending, false) };
        let now = admitting(list, &self.config.resource_name, &pending);
        if now.is_empty() {
            tracing::debug!(waiting = pending.len(), "pod-resources shows none of the waiting pods being admitted");
            return (pending, true);
        }
        self.lists_admitting.store(true, std::sync::atomic::Ordering::Relaxed);
        if now.len() > 1 {
            let pods: Vec<String> = now.iter().map(ToString::to_string).collect();
            tracing::warn!(pods = ?pods, "pod-resources lists several waiting pods without their devices");
        }
        (pending.into_iter().filter(|p| now.contains(&p.key)).collect(), false)
    }

    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    fn lock_health(&self) -> std::sync::MutexGuard<'_, Vec<Health>> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn options(&self) -> DevicePluginOptions {
        DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }
    }

    fn device_list(&self, health: &[Health]) -> Vec<Device> {
        let mut out = Vec::with_capacity(self.gpus.len() * self.slots.per_gpu() as usize);
        for (g, h) in self.gpus.iter().zip(health) {
            // kubelet's Topology Manager aligns CPUs with this; no NUMA info means no hint
            let topology = g.numa_node.map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] });
            for id in self.slots.ids_of(g.index) {
                out.push(Device {
                    id,
                    health: if h.healthy { HEALTHY } else { UNHEALTHY }.into(),
                    topology: topology.clone(),
                });
            }
        }
        out
    }

    /// The device list as last advertised.
    pub fn devices(&self) -> Arc<Vec<Device>> {
        self.devices.borrow().clone()
    }

    /// Every change of the device list, for ListAndWatch.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Vec<Device>>> {
        self.devices.subscribe()
    }

    /// Records a successful registration with kubelet (called by [`crate::server`]).
    pub fn note_registered(&self) {
        self.registrations.send_modify(|n| *n += 1);
    }

    /// Every registration with kubelet, counted from 1.
    pub fn subscribe_registrations(&self) -> watch::Receiver<u64> {
        self.registrations.subscribe()
    }

    /// A kubelet has registered this plugin (so it sends Allocate calls).
    pub fn registered(&self) -> bool {
        *self.registrations.borrow() > 0
    }

    /// Allocate applies extender assignments and marks each on the pod (an assignment source is
    /// configured), rather than leaving the GPUs to kubelet's slots.
    pub fn applies_assignments(&self) -> bool {
        self.source.is_some()
    }

    /// Every GPU's health and XID record, by index.
    pub fn health(&self) -> Vec<GpuHealth> {
        self.lock_health()
            .iter()
            .map(|h| GpuHealth {
                healthy: h.healthy,
                reason: h.reason.clone(),
                xid_count: h.xid_count,
                last_xid: h.last_xid,
            })
            .collect()
    }

    fn lock_grants(&self) -> std::sync::MutexGuard<'_, BTreeMap<GrantKey, GrantRecord>> {
        self.grants.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The shares (not whole GPUs) granted by matched Allocates: what the MPS daemon's server-side
    /// limits are computed from.
    pub fn share_slices(&self) -> Vec<ShareSlice> {
        self.lock_grants()
            .values()
            .flat_map(|r| {
                r.limits.iter().filter(|s| !s.exclusive).map(|s| ShareSlice {
                    gpu: s.gpu,
                    mem_mib: s.mem_mib,
                    core_pct: s.core_pct,
                    pod: r.pod.pod.clone(),
                })
            })
            .collect()
    }

    /// Tells the watchers of [`subscribe_shares`](Self::subscribe_shares) that the shares changed.
    pub fn note_shares_changed(&self) {
        self.share_changes.send_modify(|n| *n += 1);
    }

    /// Every change of the node's shares.
    pub fn subscribe_shares(&self) -> watch::Receiver<u64> {
        self.share_changes.subscribe()
    }

    /// The slices granted by matched Allocates, per container.
    pub fn grants(&self) -> BTreeMap<GrantKey, BTreeMap<u32, GrantedSlice>> {
        self.lock_grants().iter().map(|(k, r)| (k.clone(), r.slices.clone())).collect()
    }

    /// Compares the grants not yet checked with a pod-resources listing that began at `listed_at`
    /// (see [`crate::crosscheck`]), corrects the records of who got which devices, and forgets the
    /// grants of containers that are gone. Each mismatch is returned once, with how its limits
    /// compare; a grant whose devices are not all listed yet waits for the next listing (one whose
    /// marking could not be corrected too). Holds the claim lock throughout, so no Allocate runs
    /// meanwhile; a listing that began before the last Allocate is not used, since that container
    /// may be missing from it and its absence would prove nothing.
    pub async fn cross_check(&self, a: &Attribution, listed_at: Instant) -> Vec<Mismatch> {
        let Some(source) = self.source.as_deref() else { return Vec::new() };
        let mut claims = self.claims.lock().await;
        if claims.last_claim.is_some_and(|t| t >= listed_at) {
            return Vec::new();
        }
        let due: Vec<(GrantKey, GrantRecord, Verdict)> = self
            .lock_grants()
            .iter()
            .filter(|(_, r)| !r.checked)
            .map(|(k, r)| (k.clone(), r.clone(), check_grant(k, &r.devices, &a.by_device)))
            .collect();
        let mut out = Vec::new();
        // grants to keep under their holders' names: moved once all are corrected, since two grants
        // may swap names (twins admitted in each other's place)
        let mut moved = Vec::new();
        for (key, record, verdict) in due {
            match verdict {
                Verdict::Unseen => {}
                Verdict::Confirmed => {
                    if record.guessed {
                        let confirm = [record.container.clone()];
                        if let Err(e) = source.correct_allocated(&record.pod, &confirm, &[]).await {
                            tracing::warn!(pod = %record.pod, error = %e, "confirming a match among pods with the same limits failed; retried at the next listing");
                            continue;
                        }
                        tracing::info!(pod = %record.pod, container = %record.container, "pod-resources confirms the match made among pods with the same limits");
                    }
                    if let Some(r) = self.lock_grants().get_mut(&key) {
                        (r.checked, r.guessed) = (true, false);
                    }
                }
                Verdict::Mismatched(found) => match self.correct(source, &mut claims, a, &record, found).await {
                    Ok((found, renamed)) => {
                        out.extend(found);
                        moved.push((key, renamed));
                    }
                    Err(e) => {
                        tracing::warn!(pod = %record.pod, container = %record.container, error = %e, "correcting the record of an allocation failed; retried at the next listing");
                    }
                },
            }
        }
        self.rename_grants(moved);
        self.prune(source, a, listed_at).await;
        out
    }

    /// A grant whose devices pod-resources shows held by another pod: how the holder's own limits
    /// compare, and the records corrected to name the holder: its container marked allocated, the
    /// granted pod's unmarked when it holds nothing (so its own admission matches it), and the claims
    /// moved with them. Returns the mismatches and the name to keep the grant under: the holder's
    /// as pod-resources reports it (what the allocated-vs-used gauges look up), with the holder's
    /// pod and container where it has an assignment.
    async fn correct(
        &self,
        source: &dyn AssignmentSource,
        claims: &mut Claims,
        a: &Attribution,
        record: &GrantRecord,
        mut found: Vec<Mismatch>,
    ) -> Result<(Vec<Mismatch>, Renamed), SourceError> {
        let keep = (record.pod.pod.clone(), record.container.clone());
        let Some(h) = sole_holder(&found).cloned() else {
            // several pods hold its devices: nothing to name as the one that got them
            return Ok((found, (keep, None, None)));
        };
        let assigned = source.assigned(&format!("{}/{}", h.namespace, h.pod)).await?;
        let (container, limits) = holder_container(&record.limits, &h, assigned.as_ref());
        for m in &mut found {
            m.limits = limits;
        }
        let holder = assigned.map(|p| p.key);
        if let Some((pod, c)) = holder.as_ref().zip(container.as_ref()) {
            source.correct_allocated(pod, std::slice::from_ref(c), &[]).await?;
        }
        // admitted pods are listed: one that is not still waits, and its container must match again
        let granted_admitted = a.containers.iter().any(|c| format!("{}/{}", c.namespace, c.pod) == record.pod.pod);
        if !granted_admitted {
            source.correct_allocated(&record.pod, &[], std::slice::from_ref(&record.container)).await?;
            claims.claimed.remove(&(record.pod.clone(), record.container.clone()));
        }
        if let Some((pod, c)) = holder.as_ref().zip(container.as_ref()) {
            tracing::info!(
                granted = %record.pod, container = %record.container, holder = %pod, holder_container = %c,
                limits = ?limits, "record corrected from pod-resources: the holder's container is marked allocated"
            );
            claims.claimed.insert((pod.clone(), c.clone()));
        }
        Ok((found, (h.grant_key(), holder, container)))
    }

    /// Keeps each corrected grant under its new name (all removed first: two may swap names).
    fn rename_grants(&self, moved: Vec<(GrantKey, Renamed)>) {
        let mut grants = self.lock_grants();
        let staged: Vec<_> =
            moved.into_iter().filter_map(|(key, renamed)| Some((renamed, grants.remove(&key)?))).collect();
        for ((new_key, pod, container), mut r) in staged {
            (r.checked, r.guessed) = (true, false);
            if let Some((pod, container)) = pod.zip(container) {
                (r.pod, r.container) = (pod, container);
            }
            grants.insert(new_key, r);
        }
    }

    /// Forgets the grants of containers that are gone: not in the listing and granted before it
    /// began (a container allocated during the call may not be listed yet). A grant never seen in
    /// any listing is kept [`UNSEEN_GRACE`] first; a match among pods with the same limits that was
    /// never seen then is taken back from its pod's record (kubelet gave up that admission), so
    /// the pod's own admission matches it.
    async fn prune(&self, source: &dyn AssignmentSource, a: &Attribution, listed_at: Instant) {
        let live: BTreeSet<GrantKey> = a.containers.iter().map(|c| c.grant_key()).collect();
        let gone: Vec<(GrantKey, GrantRecord)> = self
            .lock_grants()
            .iter()
            .filter(|(k, r)| {
                let unseen_recently = !r.checked && listed_at.saturating_duration_since(r.at) < UNSEEN_GRACE;
                !live.contains(*k) && r.at < listed_at && !unseen_recently
            })
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        for (key, r) in gone {
            if r.guessed && !r.checked {
                if let Err(e) = source.correct_allocated(&r.pod, &[], std::slice::from_ref(&r.container)).await {
                    tracing::warn!(pod = %r.pod, container = %r.container, error = %e, "taking back a match never seen in pod-resources failed; retried at the next listing");
                    continue;
                }
                tracing::info!(pod = %r.pod, container = %r.container, "a match among pods with the same limits was never seen in pod-resources; taken back");
            }
            self.lock_grants().remove(&key);
            self.note_shares_changed();
        }
    }

    pub fn is_healthy(&self, gpu: u32) -> bool {
        self.lock_health().get(gpu as usize).is_some_and(|h| h.healthy)
    }

    /// Sets a GPU's health; a change is streamed to kubelet at once. Returns whether it changed.
    pub fn set_health(&self, gpu: u32, healthy: bool, reason: &str) -> bool {
        let mut h = self.lock_health();
        let Some(entry) = h.get_mut(gpu as usize) else { return false };
        if entry.healthy == healthy {
            return false;
        }
        entry.healthy = healthy;
        entry.reason = reason.to_string();
        if healthy {
            tracing::info!(gpu, reason, "GPU healthy again");
        } else {
            tracing::warn!(gpu, reason, "GPU unhealthy");
        }
        let list = self.device_list(&h);
        self.devices.send_replace(Arc::new(list));
        drop(h);
        // the GPUs that serve shares changed: managed MPS follows
        self.note_shares_changed();
        true
    }

    /// Applies one backend event. Repeated events of a GPU already unhealthy (an XID storm) change
    /// nothing and send nothing.
    pub fn apply_event(&self, e: &GpuEvent) -> bool {
        if let GpuEventKind::Xid(x) = e.kind {
            if let Some(h) = self.lock_health().get_mut(e.index as usize) {
                h.xid_count += 1;
                h.last_xid = Some(x);
            }
        }
        match e.kind {
            GpuEventKind::Xid(x) if xid_is_critical(x) => self.set_health(e.index, false, &format!("XID {x}")),
            GpuEventKind::Xid(x) => {
                tracing::debug!(gpu = e.index, xid = x, "application XID; GPU stays healthy");
                false
            }
            GpuEventKind::Lost => self.set_health(e.index, false, "fell off the bus"),
            GpuEventKind::Recovered => self.set_health(e.index, true, "recovered"),
        }
    }

    /// GetPreferredAllocation for one container: device IDs on the GPUs the extender assigned to the
    /// pod being admitted when that is known, else on the best-connected set of GPUs with free slots.
    pub async fn preferred(&self, req: &ContainerPreferredAllocationRequest) -> Result<Vec<String>, Status> {
        let size = usize::try_from(req.allocation_size).ok().filter(|&s| s > 0).ok_or_else(|| {
            Status::invalid_argument(format!("allocation size {} is not positive", req.allocation_size))
        })?;
        let must = self.slots.parse_all(&req.must_include_device_i_ds).map_err(status_from_slot)?;
        let available = self.slots.parse_all(&req.available_device_i_ds).map_err(status_from_slot)?;
        if must.len() > size {
            return Err(Status::invalid_argument(format!(
                "{} devices must be included in an allocation of {size}",
                must.len()
            )));
        }
        let must_set: BTreeSet<Slot> = must.iter().copied().collect();
        // kubelet's must-include devices (reused from init containers) are always among the available
        // ones; anything else is a malformed request, not something to allocate around
        let available_set: BTreeSet<Slot> = available.iter().copied().collect();
        if let Some(s) = must_set.iter().find(|s| !available_set.contains(s)) {
            return Err(Status::invalid_argument(format!(
                "must-include device {} is not among the available devices",
                self.slots.id(*s)
            )));
        }
        // free slots per healthy GPU, must-include ones aside
        let mut free: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for s in available.iter().filter(|s| !must_set.contains(s) && self.is_healthy(s.gpu)) {
            free.entry(s.gpu).or_default().push(s.slot);
        }
        for v in free.values_mut() {
            v.sort_unstable();
            v.dedup();
        }
        let required: BTreeSet<u32> = must.iter().map(|s| s.gpu).collect();
        let new_gpus = size - must_set.len();

        let chosen = match self.preferred_from_assignment(size, &free, &required).await {
            Some(g) => g.gpus(),
            None => self.preferred_by_topology(&free, &required, required.len() + new_gpus)?,
        };
        let mut out: Vec<String> = must.iter().map(|&s| self.slots.id(s)).collect();
        out.sort();
        out.dedup();
        for gpu in chosen.into_iter().filter(|g| !required.contains(g)) {
            // lowest free slot: deterministic, and keeps high slots free for the next sharers
            if let Some(&slot) = free.get(&gpu).and_then(|v| v.first()) {
                out.push(self.slots.id(Slot { gpu, slot }));
            }
        }
        Ok(out)
    }

    /// The extender-assignment path of GetPreferredAllocation (`None` without a source, on lookup
    /// errors, or when no pending container fits the request).
    async fn preferred_from_assignment(
        &self,
        size: usize,
        free: &BTreeMap<u32, Vec<u32>>,
        required: &BTreeSet<u32>,
    ) -> Option<Grant> {
        let source = self.source.as_ref()?;
        let pending = match source.pending().await {
            Ok(p) => p,
            Err(e) => {
                // preference is advisory; Allocate will refuse if the lookup still fails
                tracing::warn!(error = %e, "no assignments for GetPreferredAllocation; using topology");
                return None;
            }
        };
        // one List for both views below: the kubelet is admitting the same pod meanwhile
        let list = self.admission_list().await;
        let (pending, _) = self.narrow_to_admitting(list.as_ref(), pending);
        let free_gpus: BTreeSet<u32> = free.keys().copied().collect();
        {
            let claims = self.claims.lock().await;
            let hit = match_preference(size, &free_gpus, required, &pending, &claims.claimed, claims.sticky.as_ref());
            if hit.is_some() {
                return hit;
            }
        }
        // kubelet admits a pod moments after it is bound: a cached view may not have it yet
        let fresh = match source.refresh().await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "no fresh assignments for GetPreferredAllocation; using topology");
                return None;
            }
        };
        let (fresh, _) = self.narrow_to_admitting(list.as_ref(), fresh);
        let claims = self.claims.lock().await;
        match_preference(size, &free_gpus, required, &fresh, &claims.claimed, claims.sticky.as_ref())
    }

    fn preferred_by_topology(
        &self,
        free: &BTreeMap<u32, Vec<u32>>,
        required: &BTreeSet<u32>,
        k: usize,
    ) -> Result<Vec<u32>, Status> {
        if k == required.len() {
            return Ok(required.iter().copied().collect());
        }
        if required.is_empty() && k == 1 {
            // every single GPU scores the same; take the least shared (most free slots), so a pod
            // without an assignment does not land next to others when an idle GPU exists
            let best = free.iter().max_by_key(|(g, slots)| (slots.len(), std::cmp::Reverse(**g)));
            return best
                .map(|(g, _)| vec![*g])
                .ok_or_else(|| Status::resource_exhausted("no GPU has a free healthy slot"));
        }
        let mut candidates: Vec<usize> = free.keys().map(|&g| g as usize).collect();
        candidates.extend(required.iter().map(|&g| g as usize));
        let req: Vec<usize> = required.iter().map(|&g| g as usize).collect();
        match self.topology.best_subset_including(&candidates, &req, k) {
            Ok((_, set)) => Ok(set.into_iter().map(|g| g as u32).collect()),
            Err(SubsetError::NotEnoughAvailable { available, request }) => Err(Status::resource_exhausted(format!(
                "a container asking for {request} {} needs {request} different GPUs, but only {available} have a free healthy slot",
                self.config.resource_name
            ))),
            Err(e) => Err(Status::invalid_argument(e.to_string())),
        }
    }

    /// Allocate for one container.
    pub async fn allocate(&self, req: &ContainerAllocateRequest) -> Result<ContainerAllocateResponse, Status> {
        let slots = self.slots.parse_all(&req.devices_ids).map_err(status_from_slot)?;
        if slots.is_empty() {
            return Err(Status::invalid_argument("Allocate without device IDs"));
        }
        let mut gpus: Vec<u32> = slots.iter().map(|s| s.gpu).collect();
        gpus.sort_unstable();
        gpus.dedup();
        if gpus.len() != slots.len() {
            // each device is one GPU of the container; two slots of one GPU would silently shrink it
            return Err(Status::failed_precondition(format!(
                "kubelet chose {} {} devices on only {} GPU(s) {gpus:?}; a container asking for {} GPUs needs that many different GPUs",
                slots.len(),
                self.config.resource_name,
                gpus.len(),
                slots.len()
            )));
        }
        if let Some(&g) = gpus.iter().find(|&&g| !self.is_healthy(g)) {
            let reason = self.lock_health().get(g as usize).map(|h| h.reason.clone()).unwrap_or_default();
            return Err(Status::failed_precondition(format!("GPU {g} is unhealthy ({reason})")));
        }
        let grant = match &self.source {
            None => None,
            Some(source) => Some(self.claim(source.as_ref(), &gpus, &req.devices_ids).await?),
        };
        Ok(self.container_response(&slots, &gpus, grant.as_ref()))
    }

    /// Finds the pod being admitted and marks its container allocated, under one lock so two
    /// admissions can never claim the same container. Always on a fresh view of the node's pods
    /// (see [`crate::assign`]).
    async fn claim(&self, source: &dyn AssignmentSource, gpus: &[u32], devices: &[String]) -> Result<Grant, Status> {
        let mut claims = self.claims.lock().await;
        let pending = source.refresh().await.map_err(|e| Status::unavailable(e.to_string()))?;
        let live: HashSet<PodKey> = pending.iter().map(|p| p.key.clone()).collect();
        claims.claimed.retain(|(k, _)| live.contains(k));
        let list = self.admission_list().await;
        let (pending, none_of_ours) = self.narrow_to_admitting(list.as_ref(), pending);
        if none_of_ours && self.lists_admitting.load(std::sync::atomic::Ordering::Relaxed) {
            // a kubelet known to list the pod it admits, listing none of ours waiting: the pod it
            // admits has no gpuplace assignment (bound by nodeName or by another scheduler); any
            // assignment matched now would be another pod's, so that pod would lose its slice
            let e = MatchError::NotPlaced { gpus: gpus.to_vec(), waiting: pending.len() };
            tracing::warn!(error = %e, "Allocate refused");
            return Err(Status::failed_precondition(e.to_string()));
        }
        let grant = match_allocation(gpus, &pending, &claims.claimed, claims.sticky.as_ref()).map_err(|e| match e {
            MatchError::NoMatch { .. } => Status::failed_precondition(with_skipped(e.to_string(), &source.skipped())),
            MatchError::Ambiguous { .. } | MatchError::NotPlaced { .. } => Status::failed_precondition(e.to_string()),
            MatchError::Source(e) => Status::unavailable(e.to_string()),
        })?;
        // not marked means a restarted plugin could match the container again: refuse instead
        source
            .mark_allocated(&grant.pod, &grant.container, grant.guessed)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        claims.claimed.insert((grant.pod.clone(), grant.container.clone()));
        claims.last_claim = Some(Instant::now());
        let slices =
            grant.slices.iter().map(|s| (s.gpu, GrantedSlice { mem_mib: s.mem_mib, core_pct: s.core_pct })).collect();
        let record = GrantRecord {
            pod: grant.pod.clone(),
            container: grant.container.clone(),
            slices,
            limits: grant.slices.clone(),
            devices: devices.iter().cloned().collect(),
            at: Instant::now(),
            checked: false,
            guessed: grant.guessed,
        };
        self.lock_grants().insert((grant.pod.pod.clone(), grant.container.clone()), record);
        self.note_shares_changed();
        claims.sticky = Some(grant.pod.clone());
        tracing::info!(pod = %grant.pod, container = %grant.container, gpus = ?gpus, guessed = grant.guessed, "allocated");
        Ok(grant)
    }

    fn container_response(&self, slots: &[Slot], gpus: &[u32], grant: Option<&Grant>) -> ContainerAllocateResponse {
        let join = |v: Vec<String>| v.join(",");
        let ids: Vec<(u32, &str)> = gpus.iter().map(|&g| (g, self.slots.uuid(g).unwrap_or_default())).collect();
        let mut envs: HashMap<String, String> = gpu_env(&ids).into_iter().collect();
        // in GPU index order like the two lists above, whatever order kubelet sent the devices in
        // (kubelet's own, e.g. 7,4,6,5 for a four-GPU container), so the i-th entries of all three name
        // one GPU
        let mut by_gpu: Vec<Slot> = slots.to_vec();
        by_gpu.sort_by_key(|s| (s.gpu, s.slot));
        envs.insert("GPUPLACE_DEVICE_IDS".to_string(), join(by_gpu.iter().map(|&s| self.slots.id(s)).collect()));
        let mut mounts = Vec::new();
        if let Some(g) = grant {
            envs.insert("GPUPLACE_POD".to_string(), g.pod.pod.clone());
            envs.insert("GPUPLACE_CONTAINER".to_string(), g.container.clone());
            // one value per GPU, in NVIDIA_VISIBLE_DEVICES order (container ordinals 0, 1, ...)
            let limits: Vec<GpuLimit> = g
                .slices
                .iter()
                .map(|s| GpuLimit { mem_mib: s.mem_mib, core_pct: s.core_pct, exclusive: s.exclusive })
                .collect();
            let uuids: Vec<&str> = ids.iter().map(|i| i.1).collect();
            let (limit_vars, mps_mounts) = limit_env(&limits, &uuids, self.config.mps_connect().as_ref());
            envs.extend(limit_vars);
            mounts.extend(mps_mounts.into_iter().map(|m| Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: false,
            }));
        }
        ContainerAllocateResponse {
            envs,
            mounts,
            devices: Vec::new(),
            annotations: HashMap::new(),
            cdi_devices: Vec::new(),
        }
    }
}

/// The plugin as managed MPS's view of the node: the shares of matched Allocates, and the healthy
/// GPUs as those that can serve shares.
impl ShareSource for Plugin {
    fn shares(&self) -> Vec<ShareSlice> {
        self.share_slices()
    }

    fn serving(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.index).filter(|&g| self.is_healthy(g)).collect()
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.subscribe_shares())
    }
}
