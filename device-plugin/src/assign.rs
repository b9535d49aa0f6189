//! Pod identity: which pod is kubelet admitting?
//!
//! kubelet's `GetPreferredAllocation` and `Allocate` carry device IDs and a count, never the pod. The
//! extender writes each pod's assignment (exact GPUs and slices) when it binds the pod; the plugin
//! has to find the pod being admitted among this node's bound pods whose assignment is not yet
//! allocated. [`AssignmentSource`] is the lookup (the Kubernetes implementation reads the pods on this
//! node and the extender's assignment annotation, whose schema lives in the core crate); the matching
//! rules are here, pure, so they are tested without an API server:
//!
//! 1. Only the next container of each pod can be admitted (kubelet allocates a pod's init containers,
//!    then its app containers, in order, and one pod at a time).
//! 2. `Allocate`: a container matches only if its assigned GPU set equals the GPUs of the device IDs
//!    kubelet sent. No match is an error, never a guess: the container does not start rather than
//!    start on a GPU the extender did not give it.
//! 3. Among several matches, the pod whose earlier container was just allocated comes first (kubelet
//!    finishes one pod before the next), then the earliest bind. Matches on the same GPUs with
//!    different slice sizes are told apart only by bind order; that residual risk is documented in
//!    docs/device-plugin.md.

use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;

use gpuplace::core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};

/// A pod, by `namespace/name` and UID (a re-created pod with the same name is another pod).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub pod: String,
    pub uid: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.pod)
    }
}

/// A pod bound to this node with an extender assignment, not yet fully allocated.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingPod {
    pub key: PodKey,
    /// The extender's bind sequence on this node: kubelet sees pods in this order.
    pub bind_seq: u64,
    pub assignment: PodAssignment,
    /// Containers the pod is already marked allocated for.
    pub allocated: BTreeSet<String>,
}

/// What one container gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub pod: PodKey,
    pub container: String,
    /// One per GPU, sorted by GPU index.
    pub slices: Vec<GpuSlice>,
}

impl Grant {
    pub fn gpus(&self) -> Vec<u32> {
        self.slices.iter().map(|s| s.gpu).collect()
    }
}

/// Why the lookup itself failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("assignment lookup failed: {0}")]
    Unavailable(String),
    #[error("marking {pod} container {container} allocated failed: {message}")]
    Mark { pod: String, container: String, message: String },
}

/// Why `Allocate` refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MatchError {
    #[error(
        "no pod bound to this node has a gpuplace assignment for GPU(s) {gpus:?}; containers awaiting devices: \
         {waiting}; refusing rather than starting the container on GPUs the extender did not assign"
    )]
    NoMatch { gpus: Vec<u32>, waiting: String },
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// The seam to the API server. Implementations must be cheap to call once per container admission.
#[tonic::async_trait]
pub trait AssignmentSource: Send + Sync {
    /// This node's bound gpuplace pods whose assignment is not fully allocated, any order.
    async fn pending(&self) -> Result<Vec<PendingPod>, SourceError>;
    /// The same, read fresh from the source of truth: called when [`pending`](Self::pending) (which
    /// may be served from a cache) has no match, since kubelet admits a pod moments after binding.
    async fn refresh(&self) -> Result<Vec<PendingPod>, SourceError> {
        self.pending().await
    }
    /// Records on the pod that `container` got its devices, so no later admission matches it again
    /// (the Kubernetes implementation patches an annotation on the pod).
    async fn mark_allocated(&self, pod: &PodKey, container: &str) -> Result<(), SourceError>;
}

/// Containers a pod still waits to be allocated, in kubelet's order: init containers, then app
/// containers, each in listed order; containers without GPUs are not allocated by us at all.
fn waiting<'a>(
    p: &'a PendingPod,
    claimed: &'a HashSet<(PodKey, String)>,
) -> impl Iterator<Item = &'a ContainerAssignment> {
    let inits = p.assignment.containers.iter().filter(|c| c.init);
    let apps = p.assignment.containers.iter().filter(|c| !c.init);
    inits.chain(apps).filter(move |c| {
        !c.slices.is_empty() && !p.allocated.contains(&c.name) && !claimed.contains(&(p.key.clone(), c.name.clone()))
    })
}

fn grant(p: &PendingPod, c: &ContainerAssignment) -> Grant {
    let mut slices = c.slices.clone();
    slices.sort_by_key(|s| s.gpu);
    Grant { pod: p.key.clone(), container: c.name.clone(), slices }
}

fn gpu_set(c: &ContainerAssignment) -> Vec<u32> {
    let mut g: Vec<u32> = c.slices.iter().map(|s| s.gpu).collect();
    g.sort_unstable();
    g.dedup();
    g
}

/// Next containers of every pod, best candidate first (sticky pod, then bind order, then name).
fn candidates<'a>(
    pending: &'a [PendingPod],
    claimed: &'a HashSet<(PodKey, String)>,
    sticky: Option<&PodKey>,
) -> Vec<(&'a PendingPod, &'a ContainerAssignment)> {
    let mut c: Vec<_> = pending.iter().filter_map(|p| waiting(p, claimed).next().map(|c| (p, c))).collect();
    c.sort_by_key(|(p, _)| (Some(&p.key) != sticky, p.bind_seq, p.key.clone()));
    c
}

/// `Allocate`: the container whose assignment is exactly `gpus` (sorted, distinct).
pub fn match_allocation(
    gpus: &[u32],
    pending: &[PendingPod],
    claimed: &HashSet<(PodKey, String)>,
    sticky: Option<&PodKey>,
) -> Result<Grant, MatchError> {
    let all = candidates(pending, claimed, sticky);
    let mut hits = all.iter().filter(|(_, c)| gpu_set(c) == gpus);
    match hits.next() {
        Some((p, c)) => {
            let chosen = grant(p, c);
            if let Some((q, d)) = hits.find(|(q, d)| grant(q, d).slices != chosen.slices) {
                tracing::warn!(
                    chosen = %p.key, other = %q.key, other_container = %d.name,
                    "two pods wait for the same GPUs with different slices; bind order decides"
                );
            }
            Ok(chosen)
        }
        None => {
            let waiting: Vec<String> = all
                .iter()
                .map(|(p, c)| format!("{}/{} on {:?} (bind #{})", p.key, c.name, gpu_set(c), p.bind_seq))
                .collect();
            Err(MatchError::NoMatch {
                gpus: gpus.to_vec(),
                waiting: if waiting.is_empty() { "none".into() } else { waiting.join(", ") },
            })
        }
    }
}

/// `GetPreferredAllocation`: the next container asking for `count` GPUs whose assigned GPUs all have
/// a free slot and include `required`; `None` leaves the choice to the topology search.
pub fn match_preference(
    count: usize,
    free_gpus: &BTreeSet<u32>,
    required: &BTreeSet<u32>,
    pending: &[PendingPod],
    claimed: &HashSet<(PodKey, String)>,
    sticky: Option<&PodKey>,
) -> Option<Grant> {
    candidates(pending, claimed, sticky).into_iter().find_map(|(p, c)| {
        let set = gpu_set(c);
        let fits = set.len() == count
            && set.iter().all(|g| free_gpus.contains(g) || required.contains(g))
            && required.iter().all(|g| set.contains(g));
        fits.then(|| grant(p, c))
    })
}

/// An in-memory source: the fake for tests and demos, and the reference for what the Kubernetes one
/// must do (drop a pod once all its GPU containers are marked).
#[derive(Debug, Default)]
pub struct StaticAssignments {
    pods: Mutex<Vec<PendingPod>>,
    marks: Mutex<Vec<(PodKey, String)>>,
    fail_marks: std::sync::atomic::AtomicBool,
}

impl StaticAssignments {
    pub fn new(pods: Vec<PendingPod>) -> Self {
        Self { pods: Mutex::new(pods), ..Default::default() }
    }

    /// A pod bound after the others.
    pub fn bind(&self, pod: PendingPod) {
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).push(pod);
    }

    /// Every `mark_allocated` so far, in order.
    pub fn marks(&self) -> Vec<(PodKey, String)> {
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes `mark_allocated` fail, as an API server outage would.
    pub fn fail_marks(&self, fail: bool) {
        self.fail_marks.store(fail, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl AssignmentSource for StaticAssignments {
    async fn pending(&self) -> Result<Vec<PendingPod>, SourceError> {
        let marks = self.marks();
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        Ok(pods
            .iter()
            .cloned()
            .map(|mut p| {
                p.allocated.extend(marks.iter().filter(|(k, _)| *k == p.key).map(|(_, c)| c.clone()));
                p
            })
            .filter(|p| p.assignment.containers.iter().any(|c| !c.slices.is_empty() && !p.allocated.contains(&c.name)))
            .collect())
    }

    async fn mark_allocated(&self, pod: &PodKey, container: &str) -> Result<(), SourceError> {
        if self.fail_marks.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(SourceError::Mark {
                pod: pod.pod.clone(),
                container: container.into(),
                message: "injected failure".into(),
            });
        }
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).push((pod.clone(), container.to_string()));
        Ok(())
    }
}

/// Test and demo helper: a pod with one app container per `(name, slices)`.
pub fn pending_pod(name: &str, bind_seq: u64, containers: &[(&str, bool, Vec<GpuSlice>)]) -> PendingPod {
    PendingPod {
        key: PodKey { pod: name.to_string(), uid: format!("uid-{name}") },
        bind_seq,
        assignment: PodAssignment {
            pod: name.to_string(),
            node: String::new(),
            containers: containers
                .iter()
                .map(|(c, init, slices)| ContainerAssignment {
                    name: c.to_string(),
                    init: *init,
                    slices: slices.clone(),
                })
                .collect(),
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        },
        allocated: BTreeSet::new(),
    }
}

/// Test and demo helper: a share of one GPU.
pub fn share(gpu: u32, mem_mib: u64, core_pct: u32) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct, exclusive: false }
}

/// Test and demo helper: a whole GPU.
pub fn whole(gpu: u32, mem_mib: u64) -> GpuSlice {
    GpuSlice { gpu, mem_mib, core_pct: 100, exclusive: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> HashSet<(PodKey, String)> {
        HashSet::new()
    }

    #[test]
    fn same_shape_pods_go_in_bind_order_and_never_to_a_wrong_gpu() {
        // a and b both want one share of GPU 1; c wants GPU 2
        let pending = vec![
            pending_pod("ns/b", 2, &[("main", false, vec![share(1, 2048, 20)])]),
            pending_pod("ns/a", 1, &[("main", false, vec![share(1, 4096, 40)])]),
            pending_pod("ns/c", 3, &[("main", false, vec![share(2, 1024, 10)])]),
        ];
        let g = match_allocation(&[1], &pending, &none(), None).unwrap();
        assert_eq!(g.pod.pod, "ns/a");
        let claimed: HashSet<_> = [(g.pod.clone(), g.container.clone())].into();
        assert_eq!(match_allocation(&[1], &pending, &claimed, None).unwrap().pod.pod, "ns/b");
        // admitted out of order: c's GPU identifies c even though a and b were bound first
        assert_eq!(match_allocation(&[2], &pending, &none(), None).unwrap().pod.pod, "ns/c");
        // GPUs nobody was assigned: an error that names what is waiting
        let e = match_allocation(&[5], &pending, &none(), None).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("[5]") && s.contains("ns/a/main on [1]") && s.contains("refusing"), "{s}");
        // a superset or subset of an assignment is not a match either
        assert!(match_allocation(&[1, 2], &pending, &none(), None).is_err());
    }

    #[test]
    fn containers_go_in_kubelet_order_and_the_admitted_pod_is_finished_first() {
        let pending = vec![
            pending_pod(
                "ns/multi",
                1,
                &[
                    ("app", false, vec![whole(3, 80000)]),
                    ("init", true, vec![whole(3, 80000)]),
                    ("sidecar", false, vec![share(4, 100, 5)]),
                ],
            ),
            pending_pod("ns/other", 0, &[("main", false, vec![share(4, 100, 5)])]),
        ];
        // init first, even though it is listed second
        let g = match_allocation(&[3], &pending, &none(), None).unwrap();
        assert_eq!((g.pod.pod.as_str(), g.container.as_str()), ("ns/multi", "init"));
        let mut claimed: HashSet<_> = [(g.pod.clone(), g.container.clone())].into();
        let g = match_allocation(&[3], &pending, &claimed, Some(&g.pod)).unwrap();
        assert_eq!(g.container, "app");
        claimed.insert((g.pod.clone(), g.container.clone()));
        // the sidecar's share matches both pods; the pod being admitted wins over the earlier bind
        let g = match_allocation(&[4], &pending, &claimed, Some(&g.pod)).unwrap();
        assert_eq!((g.pod.pod.as_str(), g.container.as_str()), ("ns/multi", "sidecar"));
        // without the sticky pod, bind order picks ns/other
        assert_eq!(match_allocation(&[4], &pending, &claimed, None).unwrap().pod.pod, "ns/other");
    }

    #[test]
    fn preference_follows_the_next_assignment_that_fits() {
        let pending = vec![
            pending_pod("ns/x", 1, &[("main", false, vec![whole(0, 1), whole(1, 1)])]),
            pending_pod("ns/y", 2, &[("main", false, vec![share(6, 1, 10)])]),
        ];
        let free: BTreeSet<u32> = (0..8).collect();
        let g = match_preference(2, &free, &BTreeSet::new(), &pending, &none(), None).unwrap();
        assert_eq!(g.gpus(), vec![0, 1]);
        assert_eq!(match_preference(1, &free, &BTreeSet::new(), &pending, &none(), None).unwrap().gpus(), vec![6]);
        // GPU 1 has no free slot: no preference from assignments
        let busy: BTreeSet<u32> = [0, 2, 3].into();
        assert!(match_preference(2, &busy, &BTreeSet::new(), &pending, &none(), None).is_none());
        // a required GPU outside the assignment rules it out
        assert!(match_preference(2, &free, &[5].into(), &pending, &none(), None).is_none());
        // count 3 matches nobody
        assert!(match_preference(3, &free, &BTreeSet::new(), &pending, &none(), None).is_none());
    }

    #[tokio::test]
    async fn static_source_drops_pods_once_allocated() {
        let src = StaticAssignments::new(vec![pending_pod("ns/a", 1, &[("main", false, vec![share(1, 1, 1)])])]);
        assert_eq!(src.pending().await.unwrap().len(), 1);
        let key = PodKey { pod: "ns/a".into(), uid: "uid-ns/a".into() };
        src.fail_marks(true);
        assert!(src.mark_allocated(&key, "main").await.is_err());
        src.fail_marks(false);
        src.mark_allocated(&key, "main").await.unwrap();
        assert!(src.pending().await.unwrap().is_empty());
        assert_eq!(src.marks(), vec![(key, "main".to_string())]);
    }
}
