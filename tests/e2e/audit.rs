//! What the API server says after a run, checked independently of the extender's own model: GPU
//! use per GPU summed from the pods' `gpuplace.io/assignment` annotations (the fields the extender
//! writes) against each node's `gpuplace.io/inventory` (what the device plugin publishes), every
//! bound pod's assignment validated for its UID and node, every pending pod's FailedScheduling
//! event, and the extender's `/inspect` against the annotations.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gpuplace::scheduler::inspect::InspectReport;
use gpuplace_core::annotations::{AssignmentAnnotation, NodeInventory, ANNOTATION_ASSIGNMENT, ANNOTATION_INVENTORY};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

/// The API server's objects at one moment.
pub struct Snapshot {
    pub pods: Vec<Pod>,
    pub nodes: Vec<Node>,
    /// FailedScheduling messages by pod name (latest last).
    pub failed_scheduling: BTreeMap<String, Vec<String>>,
}

pub async fn snapshot(client: &Client, ns: &str) -> Snapshot {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let nodes: Api<Node> = Api::all(client.clone());
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let pods = pods.list(&ListParams::default()).await.expect("list pods").items;
    let nodes = nodes.list(&ListParams::default()).await.expect("list nodes").items;
    let mut failed_scheduling: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in events.list(&ListParams::default()).await.expect("list events").items {
        if e.reason.as_deref() == Some("FailedScheduling") {
            if let Some(pod) = e.involved_object.name.clone() {
                failed_scheduling.entry(pod).or_default().push(e.message.clone().unwrap_or_default());
            }
        }
    }
    Snapshot { pods, nodes, failed_scheduling }
}

pub fn node_name(p: &Pod) -> Option<&str> {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a String> {
    p.metadata.annotations.as_ref().and_then(|a| a.get(key))
}

/// Whether any container asks for a `gpuplace.io/` resource.
pub fn asks_gpuplace(p: &Pod) -> bool {
    p.spec.iter().flat_map(|s| &s.containers).any(|c| {
        c.resources
            .iter()
            .flat_map(|r| r.limits.iter().chain(r.requests.iter()))
            .flatten()
            .any(|(k, _)| k.starts_with("gpuplace.io/"))
    })
}

/// (pod, container, MiB, percent) per holder of a GPU.
pub type Holders = Vec<(String, String, u64, u32)>;

/// Use of one GPU summed over the assignments that name it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuUse {
    pub memory_mib: u64,
    pub core_percent: u32,
    pub exclusive_holders: usize,
    /// Pods holding it.
    pub pods: BTreeSet<String>,
    /// Containers holding it (device-plugin slots).
    pub containers: u32,
    /// (pod, container, MiB, percent), sorted: compared with `/inspect`.
    pub holders: Holders,
}

/// The findings; a run is sound when every list is empty.
#[derive(Debug, Default)]
pub struct Audit {
    pub pods: usize,
    pub bound: usize,
    pub pending: usize,
    /// Per GPU (node, uuid): what the annotations add up to.
    pub gpus: BTreeMap<(String, String), GpuUse>,
    pub over_commits: Vec<String>,
    pub bad_assignments: Vec<String>,
    /// Pending pods that still carry an assignment annotation.
    pub stale_pending: Vec<String>,
    pub pending_without_event: Vec<String>,
    pub garbled_events: Vec<String>,
    /// The latest FailedScheduling message per pending pod, counted.
    pub pending_messages: BTreeMap<String, usize>,
    pub longest_message: usize,
}

impl Audit {
    pub fn of(s: &Snapshot) -> Audit {
        let mut a = Audit { pods: s.pods.len(), ..Audit::default() };
        let mut capacity: BTreeMap<(String, String), (u64, u32)> = BTreeMap::new();
        let mut models = BTreeMap::new();
        for n in &s.nodes {
            let Some(text) = n.annotations().get(ANNOTATION_INVENTORY) else { continue };
            let inv = NodeInventory::parse(text).unwrap_or_else(|e| panic!("node {}: {e}", n.name_any()));
            for g in &inv.gpus {
                capacity.insert((n.name_any(), g.uuid.clone()), (g.memory_mib, inv.slots_per_gpu.unwrap_or(u32::MAX)));
            }
            models.insert(n.name_any(), inv.to_node(&n.name_any(), n.labels().clone()).expect("a valid inventory"));
        }
        for p in &s.pods {
            let key = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
            let finished = p
                .status
                .as_ref()
                .and_then(|st| st.phase.as_deref())
                .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
            if finished {
                continue;
            }
            let assignment = annotation(p, ANNOTATION_ASSIGNMENT);
            let Some(node) = node_name(p) else {
                a.pending += 1;
                if assignment.is_some() {
                    a.stale_pending.push(key.clone());
                }
                match s.failed_scheduling.get(&p.name_any()).and_then(|m| m.last()) {
                    None => a.pending_without_event.push(key.clone()),
                    Some(m) => {
                        if m.contains("%!") {
                            a.garbled_events.push(format!("{key}: {m}"));
                        }
                        a.longest_message = a.longest_message.max(m.len());
                        *a.pending_messages.entry(without_pod_name(m, &key)).or_default() += 1;
                    }
                }
                continue;
            };
            a.bound += 1;
            if !asks_gpuplace(p) {
                continue;
            }
            let Some(text) = assignment else {
                a.bad_assignments.push(format!("{key}: bound to {node} without an assignment"));
                continue;
            };
            let parsed = match AssignmentAnnotation::parse(text) {
                Ok(x) => x,
                Err(e) => {
                    a.bad_assignments.push(format!("{key}: {e}"));
                    continue;
                }
            };
            let uid = p.uid().unwrap_or_default();
            // the extender's own validation, against the device plugin's inventory of that node
            // (`PodView` by path: kube's ResourceExt, in scope, names the same methods)
            let valid = match (gpuplace::scheduler::input::PodView::request(p), models.get(node)) {
                (Ok(req), Some(model)) => {
                    parsed.validate(&uid, node, &req, model).map(|_| ()).map_err(|e| e.to_string())
                }
                (Err(e), _) => Err(format!("request refused: {e}")),
                (_, None) => Err(format!("node {node} has no inventory")),
            };
            if let Err(e) = valid {
                a.bad_assignments.push(format!("{key}: {e}"));
                continue;
            }
            for c in &parsed.containers {
                for g in &c.gpus {
                    let u = a.gpus.entry((node.to_string(), g.uuid.clone())).or_default();
                    u.memory_mib += g.memory_mib;
                    u.core_percent += g.core_percent;
                    u.exclusive_holders += usize::from(g.exclusive);
                    u.pods.insert(key.clone());
                    u.containers += u32::from(!c.init);
                    u.holders.push((key.clone(), c.name.clone(), g.memory_mib, g.core_percent));
                }
            }
        }
        for ((node, uuid), u) in &mut a.gpus {
            u.holders.sort();
            let (mem, slots) = capacity.get(&(node.clone(), uuid.clone())).copied().unwrap_or((0, 0));
            let gpu = format!("{node} {uuid}");
            if u.memory_mib > mem {
                a.over_commits.push(format!("{gpu}: memory {} of {mem} MiB", u.memory_mib));
            }
            if u.core_percent > 100 {
                a.over_commits.push(format!("{gpu}: compute {} percent", u.core_percent));
            }
            if u.exclusive_holders > 0 && u.pods.len() > 1 {
                a.over_commits.push(format!("{gpu}: exclusive, but held by {:?}", u.pods));
            }
            if u.containers > slots {
                a.over_commits.push(format!("{gpu}: {} containers, {slots} slots", u.containers));
            }
        }
        a
    }

    /// `/inspect`'s holders per GPU, against the annotations'. Returns the differences.
    pub fn compare_inspect(&self, report: &InspectReport) -> Vec<String> {
        let mut seen: BTreeMap<(String, String), Holders> = BTreeMap::new();
        for n in &report.nodes {
            for g in &n.gpus {
                let mut h: Vec<_> = g
                    .holders
                    .iter()
                    // group reservations (`namespace/group#slot`) hold GPUs for pods not bound yet
                    .filter(|h| !h.pod.contains('#'))
                    .map(|h| (h.pod.clone(), h.container.clone(), h.memory_mib, h.core_percent))
                    .collect();
                h.sort();
                if !h.is_empty() {
                    seen.insert((n.name.clone(), g.uuid.clone()), h);
                }
            }
        }
        let ours: BTreeMap<_, _> = self.gpus.iter().map(|(k, u)| (k.clone(), u.holders.clone())).collect();
        let mut diffs = Vec::new();
        for k in ours.keys().chain(seen.keys()).collect::<BTreeSet<_>>() {
            if ours.get(k) != seen.get(k) {
                diffs.push(format!("{k:?}: annotations {:?}, /inspect {:?}", ours.get(k), seen.get(k)));
            }
        }
        diffs
    }

    /// Panics with every finding when the run was not sound (`stale` also checks stale annotations
    /// on pending pods).
    pub fn assert_sound(&self, stale: bool) {
        assert!(self.over_commits.is_empty(), "over-commits: {:#?}", self.over_commits);
        assert!(self.bad_assignments.is_empty(), "bad assignments: {:#?}", self.bad_assignments);
        assert!(self.garbled_events.is_empty(), "garbled events: {:#?}", self.garbled_events);
        if stale {
            assert!(self.stale_pending.is_empty(), "pending pods with an assignment: {:#?}", self.stale_pending);
        }
    }
}

/// How often [`settle`] looks. Each look lists the namespace's pods and its FailedScheduling
/// events; at every 0.5 s (as before 2026-11-26) those lists took 20-56 ms of the API server's time
/// each in the middle of the storm, load no production cluster puts on it, competing with the
/// binds being measured.
const SETTLE_POLL: Duration = Duration::from_secs(2);

/// Waits until every pod in `ns` is bound or has a FailedScheduling event and nothing changed for
/// `quiet`; returns the seconds it took (to within [`SETTLE_POLL`]).
pub async fn settle(client: &Client, ns: &str, quiet: Duration, limit: Duration) -> f64 {
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let failed_scheduling = ListParams::default().fields("reason=FailedScheduling");
    let mut last: Option<(usize, usize)> = None;
    let mut stable_since = Instant::now();
    loop {
        tokio::time::sleep(SETTLE_POLL).await;
        let pods = pods.list(&ListParams::default()).await.expect("list pods").items;
        let explained_pods: BTreeSet<String> = events
            .list(&failed_scheduling)
            .await
            .expect("list FailedScheduling events")
            .items
            .into_iter()
            .filter_map(|e| e.involved_object.name)
            .collect();
        let bound = pods.iter().filter(|p| node_name(p).is_some()).count();
        let explained =
            pods.iter().filter(|p| node_name(p).is_none() && explained_pods.contains(&p.name_any())).count();
        let now = (bound, explained);
        if last != Some(now) {
            last = Some(now);
            stable_since = Instant::now();
        }
        if bound + explained == pods.len() && stable_since.elapsed() >= quiet {
            return started.elapsed().as_secs_f64();
        }
        assert!(
            started.elapsed() < limit,
            "not settled in {limit:?}: {bound} bound, {explained} pending with a reason, {} pods",
            pods.len()
        );
    }
}

/// A message with the pod's own name left out (reasons that name the pod they refuse), so that
/// messages group by cause in the figures.
fn without_pod_name(message: &str, key: &str) -> String {
    message.replace(key, "POD")
}

/// Percentile `q` (0..1) of a sorted list.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}
