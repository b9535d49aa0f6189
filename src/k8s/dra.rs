//! The DRA front end on the API server (issue 32): gpuplace allocates the ResourceClaims of its
//! DeviceClass, and kube-scheduler binds their pods by the allocations' node selectors.
//!
//! - [`watch_slices`]: ResourceSlices of gpuplace's driver become the model's DRA nodes
//!   ([`Scheduler::observe_slices`]).
//! - [`watch_claims`]: every ResourceClaim's allocation on the driver's devices is counted under the
//!   claim's key ([`Scheduler::observe_claim`]); the claims are kept for the gate controller.
//! - [`run_gates`]: pods held by gpuplace's scheduling gate ([`SCHEDULING_GATE`], added at admission
//!   to every pod with claims: scheduler-config/dra/) are taken oldest first; a pod whose claims are
//!   not of the class is let go at once; otherwise its claims are placed together
//!   ([`crate::dra::plan`]) and held in the model under one write lock ([`Scheduler::hold`]), each
//!   claim gets the delete-protection finalizer and its `status.allocation`, and the gate is lifted.
//!   A pod that fits nowhere stays gated (an Event says why) and is tried again when the cluster
//!   changes. Only the leader writes.
//!
//! Every claim of the class is allocated here, never by kube-scheduler: its pods reach kube-scheduler
//! only once their claims are allocated, and the device plugin can taint the devices
//! (`--dra-allocator gpuplace`) so that a pod that got past the gate cannot have kube-scheduler
//! allocate them beside gpuplace (nothing checks capacity across claims). The admission policy
//! `gpuplace-dra-gate-holds` (scheduler-config/dra/gpuplace-allocates.yaml) keeps tenants from
//! lifting the gate or tolerating the taint, and refuses any other writer's allocation of them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use gpuplace_core::api_client::events::EventSink;
use gpuplace_core::assignment::PodAssignment;
use gpuplace_core::cluster::Gpu;
use gpuplace_core::dra::claims::{
    allocated, claim_demand, claim_key, host_key, host_record, DELETE_PROTECTION_FINALIZER,
};
use gpuplace_core::dra::slices::slice_gpus;
use gpuplace_core::resources::PodRequest;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::{watch, Notify};

use crate::dra::plan::{self, PlanError, PodClaim, Written};
use crate::k8s::watch::next_event;
use crate::scheduler::metrics::Watched;
use crate::scheduler::service::claims::HoldError;
use crate::scheduler::Scheduler;

/// The scheduling gate gpuplace's admission policy adds to pods with claims, and lifts once their
/// claims of gpuplace's class are allocated (or they have none).
pub const SCHEDULING_GATE: &str = "gpuplace.io/dra";

/// Event reasons on pods.
pub const REASON_NOT_PLACED: &str = "ClaimsNotAllocated";
pub const REASON_ALLOCATED: &str = "ClaimsAllocated";

/// How often gated pods are looked at again without any change seen (a safety net: changes wake the
/// controller at once).
const RETRY: Duration = Duration::from_secs(5);

/// The DRA front end's configuration.
#[derive(Debug, Clone)]
pub struct DraOptions {
    /// The driver gpuplace's device plugins publish under (`--dra-driver`).
    pub driver: String,
    /// The DeviceClass whose claims gpuplace allocates (`--dra-class`).
    pub class: String,
}

/// The claims as last seen, by `namespace/name`, and a wake-up for the gate controller.
#[derive(Debug, Default)]
pub struct ClaimStore {
    claims: Mutex<HashMap<String, ResourceClaim>>,
    changed: Notify,
}

impl ClaimStore {
    fn get(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.claims.lock().unwrap_or_else(|e| e.into_inner()).get(&format!("{namespace}/{name}")).cloned()
    }

    fn put(&self, claim: ResourceClaim) {
        let key = format!("{}/{}", claim.namespace().unwrap_or_default(), claim.name_any());
        self.claims.lock().unwrap_or_else(|e| e.into_inner()).insert(key, claim);
    }

    fn remove(&self, namespace: &str, name: &str) {
        self.claims.lock().unwrap_or_else(|e| e.into_inner()).remove(&format!("{namespace}/{name}"));
    }
}

/// A pod's host requests as kube-scheduler counts them, in millicores and MiB (rounded up): the
/// larger of its app containers' (and sidecars') sum and each init container beside the sidecars
/// started before it, plus its overhead.
pub fn host_request(pod: &Pod) -> (u64, u64) {
    let Some(spec) = pod.spec.as_ref() else { return (0, 0) };
    let of = |r: Option<&k8s_openapi::api::core::v1::ResourceRequirements>| -> (i128, i128) {
        let list = r.and_then(|r| r.requests.as_ref());
        (milli_in(list, "cpu"), milli_in(list, "memory"))
    };
    let add = |a: (i128, i128), b: (i128, i128)| (a.0 + b.0, a.1 + b.1);
    let max = |a: (i128, i128), b: (i128, i128)| (a.0.max(b.0), a.1.max(b.1));
    let mut sidecars = (0, 0);
    let mut init_peak = (0, 0);
    for c in spec.init_containers.iter().flatten() {
        let r = of(c.resources.as_ref());
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = add(sidecars, r);
        } else {
            init_peak = max(init_peak, add(sidecars, r));
        }
    }
    let apps = spec.containers.iter().fold((0, 0), |acc, c| add(acc, of(c.resources.as_ref())));
    let overhead = spec.overhead.as_ref();
    let total = add(max(add(apps, sidecars), init_peak), (milli_in(overhead, "cpu"), milli_in(overhead, "memory")));
    let cpu = u64::try_from(total.0).unwrap_or(u64::MAX);
    let mib = u64::try_from((total.1 + MIB_MILLI - 1) / MIB_MILLI).unwrap_or(u64::MAX);
    (cpu, mib)
}

/// Thousandths of a MiB: memory quantities read by [`milli_in`] are in these.
const MIB_MILLI: i128 = 1024 * 1024 * 1000;

/// `name`'s quantity in a resource list, in thousandths of its unit (0 when absent or unreadable).
fn milli_in(list: Option<&BTreeMap<String, Quantity>>, name: &str) -> i128 {
    list.and_then(|l| l.get(name))
        .and_then(|q| gpuplace_core::quantity::parse(&q.0).ok())
        .map_or(0, |q| q.milli().max(0))
}

/// A Node's allocatable CPU (millicores) and memory (MiB, rounded down): what gpuplace checks a DRA
/// node's host against.
pub fn allocatable(node: &k8s_openapi::api::core::v1::Node) -> (u64, u64) {
    let list = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let cpu = u64::try_from(milli_in(list, "cpu")).unwrap_or(u64::MAX);
    let mib = u64::try_from(milli_in(list, "memory") / MIB_MILLI).unwrap_or(u64::MAX);
    (cpu, mib)
}

/// A pod's host use for [`Scheduler::observe_host_use`]: its node and requests while it is bound
/// and not finished.
pub fn host_use(pod: &Pod) -> Option<(&str, u64, u64)> {
    let node = pod.spec.as_ref()?.node_name.as_deref().filter(|n| !n.is_empty())?;
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    let (cpu, mib) = host_request(pod);
    Some((node, cpu, mib))
}

/// Refreshes one node from the slices that name it.
fn refresh_node(
    ext: &Scheduler,
    node: &str,
    slices: &HashMap<String, ResourceSliceSpec>,
    last: &mut HashMap<String, Vec<Gpu>>,
) {
    let specs: Vec<&ResourceSliceSpec> = slices.values().filter(|s| s.node_name.as_deref() == Some(node)).collect();
    match slice_gpus(&specs, last.get(node).map(Vec::as_slice)) {
        Ok(Some(g)) => {
            last.insert(node.to_string(), g.gpus.clone());
            ext.observe_slices(node, Some(g));
        }
        Ok(None) => ext.observe_slices(node, None),
        Err(e) => tracing::warn!(node = %node, error = %e, "ResourceSlices not read; the node stays as it was"),
    }
}

/// Watches the driver's ResourceSlices; `synced` turns true after the first complete list.
pub async fn watch_slices(api: Api<ResourceSlice>, driver: String, ext: Arc<Scheduler>, synced: watch::Sender<bool>) {
    let config = watcher::Config::default().fields(&format!("spec.driver={driver}"));
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut slices: HashMap<String, ResourceSliceSpec> = HashMap::new();
    let mut listing: HashMap<String, ResourceSliceSpec> = HashMap::new();
    let mut last: HashMap<String, Vec<Gpu>> = HashMap::new();
    let node_of = |s: &ResourceSliceSpec| s.node_name.clone();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::ResourceSlices).await {
        match ev {
            Event::Init => listing.clear(),
            Event::InitApply(s) => {
                listing.insert(s.name_any(), s.spec);
            }
            Event::InitDone => {
                let old = std::mem::take(&mut slices);
                slices = std::mem::take(&mut listing);
                let nodes: HashSet<String> = old.values().chain(slices.values()).filter_map(node_of).collect();
                for n in nodes {
                    refresh_node(&ext, &n, &slices, &mut last);
                }
                synced.send_replace(true);
            }
            Event::Apply(s) => {
                let name = s.name_any();
                let before = slices.insert(name, s.spec.clone()).and_then(|o| node_of(&o));
                for n in before.into_iter().chain(node_of(&s.spec)).collect::<HashSet<_>>() {
                    refresh_node(&ext, &n, &slices, &mut last);
                }
            }
            Event::Delete(s) => {
                slices.remove(&s.name_any());
                if let Some(n) = node_of(&s.spec) {
                    refresh_node(&ext, &n, &slices, &mut last);
                }
            }
        }
    }
}

fn observe_claim(ext: &Scheduler, driver: &str, claim: &ResourceClaim) {
    let key = claim_key(&claim.namespace().unwrap_or_default(), &claim.name_any());
    match allocated(claim, driver) {
        Ok(record) => {
            ext.observe_claim(&key, record);
        }
        Err(e) => tracing::warn!(claim = %key, error = %e, "claim allocation not read; counted as it was"),
    }
}

/// Watches every ResourceClaim; `synced` turns true after the first complete list.
pub async fn watch_claims(
    api: Api<ResourceClaim>,
    driver: String,
    ext: Arc<Scheduler>,
    store: Arc<ClaimStore>,
    synced: watch::Sender<bool>,
) {
    let mut stream = watcher::watcher(api, watcher::Config::default().page_size(500)).default_backoff().boxed();
    let mut listed: HashSet<String> = HashSet::new();
    let mut list_started = std::time::Instant::now();
    while let Some(ev) = next_event(&mut stream, &ext, Watched::ResourceClaims).await {
        match ev {
            Event::Init => {
                listed.clear();
                list_started = std::time::Instant::now();
            }
            Event::InitApply(c) | Event::Apply(c) => {
                listed.insert(claim_key(&c.namespace().unwrap_or_default(), &c.name_any()));
                observe_claim(&ext, &driver, &c);
                store.put(c);
            }
            Event::InitDone => {
                ext.retain_claims(&listed, list_started);
                synced.send_replace(true);
            }
            Event::Delete(c) => {
                let (ns, name) = (c.namespace().unwrap_or_default(), c.name_any());
                ext.observe_claim(&claim_key(&ns, &name), None);
                store.remove(&ns, &name);
            }
        }
        store.changed.notify_one();
    }
}

/// Where a gated pod stands. (A failed write of one of a pod's claims leaves the others written:
/// they pin the pod's next try to their node.)
enum Gated {
    /// None of its claims is of gpuplace's class, or all of them are allocated: let it go.
    Release,
    /// A claim it names does not exist yet (a template's claim is made after the pod).
    Waiting,
    /// Its claims to place.
    Place(Box<ToPlace>),
    /// It cannot be placed by gpuplace as it is (the reason goes to an Event).
    Refused(String),
}

/// A gated pod's claims to place, on the node its claims already allocated are on (one the pod
/// shares with another pod, or one written before a failed write of the others), as the engine's
/// request (`plan::request`: the claims, with the pod's gpuplace annotations, group and host
/// requests).
struct ToPlace {
    claims: Vec<PodClaim>,
    on: Option<String>,
    request: PodRequest,
}

fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

/// The pod's claims: the name the pod gives each, and the claim's own name; `None` while a
/// template's claim is not made yet.
fn claim_names(pod: &Pod) -> Option<Vec<(String, String)>> {
    let spec = pod.spec.as_ref()?;
    let statuses = pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_ref());
    let mut names = Vec::new();
    for c in spec.resource_claims.iter().flatten() {
        if let Some(n) = &c.resource_claim_name {
            names.push((c.name.clone(), n.clone()));
        } else if c.resource_claim_template_name.is_some() {
            let made = statuses.into_iter().flatten().find(|s| s.name == c.name)?;
            // no claim made for it (the template's claim is not needed): nothing to allocate
            if let Some(n) = &made.resource_claim_name {
                names.push((c.name.clone(), n.clone()));
            }
        }
    }
    Some(names)
}

fn judge(pod: &Pod, store: &ClaimStore, opts: &DraOptions) -> Gated {
    let Some(names) = claim_names(pod) else { return Gated::Waiting };
    let ns = pod.namespace().unwrap_or_default();
    let mut ours = Vec::new();
    let mut unallocated = 0;
    for (entry, name) in names {
        let Some(claim) = store.get(&ns, &name) else { return Gated::Waiting };
        match claim_demand(&claim.spec, &opts.class, &opts.driver) {
            Ok(None) => {}
            Ok(Some(demand)) => {
                let done = claim.status.as_ref().is_some_and(|s| s.allocation.is_some());
                unallocated += usize::from(!done);
                ours.push((PodClaim { claim, demand, entry }, done));
            }
            Err(e) => return Gated::Refused(format!("claim {name}: {e}")),
        }
    }
    if unallocated == 0 {
        return Gated::Release;
    }
    // claims already allocated pin the pod to their node
    let mut on: Option<String> = None;
    for (c, done) in &ours {
        if !done {
            continue;
        }
        let node = match allocated(&c.claim, &opts.driver) {
            Ok(Some(r)) => r.node,
            Ok(None) => continue,
            Err(e) => return Gated::Refused(format!("claim {}: {e}", c.name())),
        };
        match &on {
            Some(n) if *n != node => {
                return Gated::Refused(format!("the pod's claims are allocated on two nodes ({n} and {node})"))
            }
            _ => on = Some(node),
        }
    }
    match crate::scheduler::input::PodView::request(pod) {
        Ok(r) if !r.is_gpu_free() => Gated::Refused(format!(
            "the pod asks for gpuplace's resources and for GPUs through claims of {}; ask through one or the other",
            opts.class
        )),
        Ok(mut base) => {
            (base.cpu_milli, base.memory_mib) = host_request(pod);
            let claims: Vec<PodClaim> = ours.into_iter().filter(|(_, done)| !done).map(|(c, _)| c).collect();
            match plan::request(&base, &claims) {
                Ok(request) => Gated::Place(Box::new(ToPlace { claims, on, request })),
                Err(e) => Gated::Refused(e.to_string()),
            }
        }
        Err(e) => Gated::Refused(format!("the pod's gpuplace annotations: {e}")),
    }
}

/// Why the pod's claims are not allocated when it belongs to a PodGroup with
/// `schedulingConstraints.topology`: kube-scheduler 1.36 schedules such a group by placements
/// (`TopologyAwareWorkloadScheduling`), and that path rejects pods whose claims are allocated before
/// it on every placement (`cannot allocate all claims`, retried without pause: measured in
/// tests/e2e/dra_groups.rs), so they would never bind. The same keys as gpuplace's annotation keep
/// the group under one domain with a plain gang.
fn placement_gang(ext: &Scheduler, req: &PodRequest) -> Option<String> {
    let group = req.group.as_ref().filter(|g| g.pod_group)?;
    let keys = ext.pod_group_topology(&group.key);
    (!keys.is_empty()).then(|| {
        format!(
            "PodGroup {} has schedulingConstraints.topology, and kube-scheduler does not bind such a group's pods \
             once their claims are allocated; remove it and set the annotation gpuplace.io/group-topology: {} on the pods",
            group.key,
            keys.join(",")
        )
    })
}

/// An API error in one line: the API server's message, not the whole Status.
fn brief(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

/// Lifts the gate (a JSON patch that tests the gate is still at its place, so nothing else moves).
async fn lift_gate(pods: &Api<Pod>, pod: &Pod) -> Result<(), kube::Error> {
    let gates = pod.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref());
    let Some(i) = gates.and_then(|g| g.iter().position(|g| g.name == SCHEDULING_GATE)) else { return Ok(()) };
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": format!("/spec/schedulingGates/{i}/name"), "value": SCHEDULING_GATE},
        {"op": "remove", "path": format!("/spec/schedulingGates/{i}")},
    ]))
    .map_err(kube::Error::SerdeError)?;
    pods.patch(&pod.name_any(), &PatchParams::default(), &Patch::Json::<()>(patch)).await.map(|_| ())
}

/// Writes one claim's allocation: the delete-protection finalizer, then `status.allocation`, each
/// conditional on the claim being as read.
async fn write_claim(client: &Client, claim: &ResourceClaim, w: &Written) -> Result<(), kube::Error> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace().unwrap_or_default());
    let name = claim.name_any();
    let mut rv = claim.resource_version().unwrap_or_default();
    if !claim.finalizers().iter().any(|f| f == DELETE_PROTECTION_FINALIZER) {
        let add = if claim.metadata.finalizers.is_none() {
            json!({"op": "add", "path": "/metadata/finalizers", "value": [DELETE_PROTECTION_FINALIZER]})
        } else {
            json!({"op": "add", "path": "/metadata/finalizers/-", "value": DELETE_PROTECTION_FINALIZER})
        };
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, add]))
                .map_err(kube::Error::SerdeError)?;
        let after = api.patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch)).await?;
        rv = after.resource_version().unwrap_or_default();
    }
    let status = json!({"metadata": {"resourceVersion": rv}, "status": {"allocation": w.allocation}});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)).await.map(|_| ())
}

/// Places one gated pod's claims and writes them; `Err` is why it stays gated.
async fn place(
    client: &Client,
    ext: &Scheduler,
    pod: &Pod,
    ToPlace { claims, on, request: req }: ToPlace,
    opts: &DraOptions,
    class_config: &[k8s_openapi::api::resource::v1::DeviceClassConfiguration],
) -> Result<String, String> {
    let constraints = crate::scheduler::input::PodView::node_constraints(pod)
        .map_err(|e| format!("the pod's node selector, affinity or tolerations: {e}"))?;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let uid = pod.uid().unwrap_or_default();
    let host = host_key(&uid);
    // the node its allocated claims are on, and the pod's selector, affinity and tolerations
    let admits = |n: &gpuplace_core::cluster::Node| {
        on.as_ref().is_none_or(|on| *on == n.name)
            && constraints.admits(&n.name, &n.labels, &ext.taints_of(&n.name)).is_ok()
    };
    let mut written: Vec<Written> = Vec::new();
    let held = ext.hold_pod(&uid, &req, &admits, |v| -> Result<_, PlanError> {
        let here = |n: &gpuplace_core::cluster::Node| v.may_use(&n.name) && admits(n);
        let p = plan::choose(v.engine, v.cluster, &req, &claims, &opts.driver, &here, v.now_ms)?;
        written = plan::allocations(v.cluster, &p, &claims, &opts.driver, class_config, now.clone())?;
        let mut records: Vec<PodAssignment> = written.iter().map(|w| w.record.clone()).collect();
        // the pod's own host requests, counted with its claims until the pod watcher sees it bound
        records.push(host_record(&uid, &p.assignment.node, req.cpu_milli, req.memory_mib));
        Ok(records)
    });
    held.map_err(|e: HoldError<PlanError>| e.to_string())?;
    let node = written.first().map(|w| w.record.node.clone()).unwrap_or_default();
    for (i, (c, w)) in claims.iter().zip(&written).enumerate() {
        if let Err(e) = write_claim(client, &c.claim, w).await {
            // the claims written so far hold their devices (the watcher counts them); the rest go back
            let mut rest: Vec<String> = written[i..].iter().map(|w| w.key.clone()).collect();
            rest.push(host);
            ext.release_held(&rest);
            if req.group.is_some() {
                ext.member_not_written(&uid);
            }
            return Err(format!("claim {} not written: {}", c.name(), brief(&e)));
        }
    }
    if req.group.is_some() {
        ext.member_written(&uid);
    }
    Ok(node)
}

/// Whether the slice and claim watchers have listed once: the model's DRA side is whole.
#[derive(Debug)]
pub struct Synced {
    pub slices: watch::Receiver<bool>,
    pub claims: watch::Receiver<bool>,
}

impl Synced {
    fn both(&self) -> bool {
        *self.slices.borrow() && *self.claims.borrow()
    }
}

/// The gate controller: watches unscheduled pods and places those held by [`SCHEDULING_GATE`],
/// once the model is whole ([`Synced`]) and this replica decides ([`Scheduler::is_ready`]).
pub async fn run_gates(
    client: Client,
    ext: Arc<Scheduler>,
    opts: DraOptions,
    store: Arc<ClaimStore>,
    events: Option<EventSink>,
    synced: Synced,
) {
    let pods_api: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields("spec.nodeName=");
    let mut stream = watcher::watcher(pods_api, config).default_backoff().boxed();
    let mut gated: BTreeMap<(String, String), Pod> = BTreeMap::new();
    let mut listing: BTreeMap<(String, String), Pod> = BTreeMap::new();
    // the reason last raised per pod UID, so an unchanged refusal is not raised again
    let mut reported: HashMap<String, String> = HashMap::new();
    let order = |p: &Pod| {
        let at = p.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default();
        (at, format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
    };
    loop {
        tokio::select! {
            ev = next_event(&mut stream, &ext, Watched::GatedPods) => {
                let Some(ev) = ev else { return };
                match ev {
                    Event::Init => listing.clear(),
                    Event::InitApply(p) => {
                        if has_gate(&p) {
                            listing.insert(order(&p), p);
                        }
                    }
                    Event::InitDone => gated = std::mem::take(&mut listing),
                    Event::Apply(p) => {
                        gated.retain(|_, q| q.uid() != p.uid());
                        if has_gate(&p) {
                            gated.insert(order(&p), p);
                        }
                    }
                    Event::Delete(p) => gated.retain(|_, q| q.uid() != p.uid()),
                }
            }
            _ = store.changed.notified() => {}
            _ = tokio::time::sleep(RETRY) => {}
        }
        if !ext.is_ready() || !synced.both() || gated.is_empty() {
            continue;
        }
        let class_config = match Api::<DeviceClass>::all(client.clone()).get_opt(&opts.class).await {
            Ok(c) => c.and_then(|c| c.spec.config).unwrap_or_default(),
            Err(e) => {
                tracing::warn!(class = %opts.class, error = %e, "DeviceClass not read; gated pods wait");
                continue;
            }
        };
        let judged: Vec<(&(String, String), &Pod, Gated)> = gated
            .iter()
            .map(|(k, pod)| {
                let g = judge(pod, &store, &opts);
                let refused = match &g {
                    Gated::Place(p) => placement_gang(&ext, &p.request),
                    _ => None,
                };
                (k, pod, refused.map_or(g, Gated::Refused))
            })
            .collect();
        // every gated member of a group is known to its planning before one is placed: the group is
        // planned for all of them at once (a PodGroup's size is the pods that name it)
        for (_, pod, g) in &judged {
            if let Gated::Place(p) = g {
                ext.observe_pending_member(&pod.uid().unwrap_or_default(), &p.request);
            }
        }
        let mut done = Vec::new();
        for (k, pod, judgement) in judged {
            let k = k.clone();
            let ns = pod.namespace().unwrap_or_default();
            let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let outcome = match judgement {
                Gated::Waiting => continue,
                Gated::Release => Ok(None),
                Gated::Refused(why) => Err(why),
                Gated::Place(to_place) => {
                    // the watch may lag: a pod deleted (and maybe made again under its name) must not
                    // get claims allocated for it
                    match pods.get_opt(&pod.name_any()).await {
                        Ok(Some(now)) if now.uid() == pod.uid() && has_gate(&now) => {}
                        Ok(_) => {
                            done.push(k.clone());
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(pod = %k.1, error = %brief(&e), "pod not read; retried");
                            continue;
                        }
                    }
                    place(&client, &ext, pod, *to_place, &opts, &class_config).await.map(Some)
                }
            };
            match outcome {
                Ok(node) => match lift_gate(&pods, pod).await {
                    Ok(()) => {
                        if let (Some(node), Some(ev)) = (&node, &events) {
                            let note = format!("claims allocated on node {node}");
                            ev.normal(pod.object_ref(&()), REASON_ALLOCATED, "AllocateClaims", &note);
                        }
                        tracing::info!(pod = %k.1, node = ?node, "scheduling gate lifted");
                        reported.remove(&pod.uid().unwrap_or_default());
                        done.push(k.clone());
                    }
                    Err(e) => tracing::warn!(pod = %k.1, error = %brief(&e), "scheduling gate not lifted; retried"),
                },
                Err(why) => {
                    let uid = pod.uid().unwrap_or_default();
                    if reported.get(&uid) != Some(&why) {
                        tracing::info!(pod = %k.1, reason = %why, "claims not allocated; the pod stays gated");
                        if let Some(ev) = &events {
                            ev.warn(pod.object_ref(&()), REASON_NOT_PLACED, "AllocateClaims", &why);
                        }
                        reported.insert(uid, why);
                    }
                }
            }
        }
        for k in done {
            gated.remove(&k);
        }
        // reasons are remembered for pods still gated only
        reported.retain(|uid, _| gated.values().any(|p| p.uid().as_deref() == Some(uid.as_str())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).expect("a pod")
    }

    #[test]
    fn host_requests_are_counted_as_kube_scheduler_counts_them() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {
            "initContainers": [
                {"name": "sidecar", "image": "x", "restartPolicy": "Always", "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
                {"name": "setup", "image": "x", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}},
            ],
            "containers": [
                {"name": "a", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1.5Gi"}}},
                {"name": "b", "image": "x", "resources": {"requests": {"cpu": "1", "memory": "1000"}}},
            ],
            "overhead": {"cpu": "50m", "memory": "10Mi"},
        }}));
        // apps 1500m + sidecar 100m = 1600m, below the init peak 4100m; memory 1.5Gi + 1000 B +
        // 64Mi = 1600 MiB and a bit, above the init's 1024 + 64 MiB; then the overhead
        assert_eq!(host_request(&p), (4150, 1611));
        assert_eq!(host_use(&p), None, "not bound");
        let mut bound = p.clone();
        bound.spec.as_mut().unwrap().node_name = Some("n1".into());
        assert_eq!(host_use(&bound), Some(("n1", 4150, 1611)));
        bound.status =
            Some(k8s_openapi::api::core::v1::PodStatus { phase: Some("Succeeded".into()), ..Default::default() });
        assert_eq!(host_use(&bound), None, "finished");
        assert_eq!(
            host_request(&pod(json!({"metadata": {"name": "q"}, "spec": {"containers": [{"name": "c"}]}}))),
            (0, 0)
        );
    }

    #[test]
    fn claim_names_wait_for_the_claims_templates_make() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {
            "resourceClaims": [{"name": "a", "resourceClaimName": "shared"}, {"name": "b", "resourceClaimTemplateName": "t"}],
            "containers": [{"name": "c"}],
        }}));
        assert_eq!(claim_names(&p), None, "the template's claim is not made yet");
        let mut made = p.clone();
        made.status = Some(
            serde_json::from_value(json!({"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x1"}]}))
                .unwrap(),
        );
        let both = vec![("a".to_string(), "shared".to_string()), ("b".to_string(), "p-b-x1".to_string())];
        assert_eq!(claim_names(&made), Some(both));
        assert!(!has_gate(&p));
    }
}
