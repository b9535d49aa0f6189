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
//! 3. Several matches are taken only when either is right for the container's limits: their pods are
//!    interchangeable, or have the same limits from these containers on (`core::admission`). The
//!    pod whose earlier container was just allocated comes first (kubelet finishes one pod before the
//!    next), then the earliest bind, and the match is marked unconfirmed until pod-resources shows
//!    which pod got the devices ([`crate::crosscheck`]). Other matches are refused
//!    ([`MatchError::Ambiguous`]): kubelet may be admitting either pod, and a guess would start the
//!    container with the other's limits. The extender never has two such pods waiting at once on a
//!    node whose plugin confirms its allocations.
//!
//! `Allocate` decides on a fresh view of the node's pods ([`AssignmentSource::refresh`]): kubelet
//! learns of a binding through its own watch, and a pod it admits that a cached view lacks would
//! leave the only other pod waiting on those GPUs looking like the match.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Mutex;

use gpuplace_core::admission::{admission_order, gpu_set, interchangeable, same_from, sorted_slices};
use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};

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
    /// Those of `allocated` matched among pods with the same limits and not yet confirmed by
    /// pod-resources (`gpuplace.io/allocated`'s `unconfirmed`).
    pub unconfirmed: BTreeSet<String>,
}

/// What one container gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub pod: PodKey,
    pub container: String,
    /// One per GPU, sorted by GPU index.
    pub slices: Vec<GpuSlice>,
    /// Chosen among interchangeable pods waiting for the same GPUs: the limits are right whichever
    /// kubelet admits, but which pod got the devices is known only from pod-resources.
    pub guessed: bool,
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
    #[error(
        "the kubelet is admitting a pod that gpuplace did not place: its pod-resources lists none of the {waiting} \
         pod(s) with a gpuplace assignment on this node waiting for devices (GPU(s) {gpus:?} asked); a pod bound by \
         nodeName or by another scheduler gets no GPU here, schedule it through gpuplace's scheduler"
    )]
    NotPlaced { gpus: Vec<u32>, waiting: usize },
    #[error(
        "{first} and {second} both wait for devices on GPU(s) {gpus:?} with different limits, and kubelet's Allocate \
         does not say which pod it admits; refusing rather than starting the container with the other pod's limits \
         (the extender binds such pods one at a time on nodes whose plugin confirms allocations)"
    )]
    Ambiguous { gpus: Vec<u32>, first: String, second: String },
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
    /// (the Kubernetes implementation patches an annotation on the pod). `unconfirmed`: the match was
    /// one of several interchangeable pods ([`Grant::guessed`]), to be confirmed or moved once
    /// pod-resources shows who got the devices.
    async fn mark_allocated(&self, pod: &PodKey, container: &str, unconfirmed: bool) -> Result<(), SourceError>;
    /// The pod `namespace/name` on this node with a valid assignment, allocated or not (the
    /// cross-check's holder of a device, compared with the grant). `None`: no such pod, or one
    /// whose assignment is skipped.
    async fn assigned(&self, pod: &str) -> Result<Option<PendingPod>, SourceError>;
    /// Corrects the pod's record after pod-resources showed who holds the devices: `confirm` got
    /// their devices (marked, and no longer unconfirmed), `unmark` did not (no longer marked, so
    /// their own admission matches them).
    async fn correct_allocated(&self, pod: &PodKey, confirm: &[String], unmark: &[String]) -> Result<(), SourceError>;
    /// The pods the last [`refresh`](Self::refresh) left out because their assignment cannot be
    /// applied (unsigned, altered, invalid, or a GPU another pod holds exclusively), as
    /// `namespace/name: why`: what a refused Allocate tells the pod it may be about.
    fn skipped(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Containers a pod still waits to be allocated, in kubelet's order (`core::admission`), each with its
/// position in that order.
fn waiting<'a>(
    p: &'a PendingPod,
    claimed: &'a HashSet<(PodKey, String)>,
) -> impl Iterator<Item = (usize, &'a ContainerAssignment)> {
    admission_order(&p.assignment)
        .enumerate()
        .filter(move |(_, c)| !p.allocated.contains(&c.name) && !claimed.contains(&(p.key.clone(), c.name.clone())))
}

fn grant(p: &PendingPod, c: &ContainerAssignment) -> Grant {
    Grant { pod: p.key.clone(), container: c.name.clone(), slices: sorted_slices(c), guessed: false }
}

/// A container as the refusal names it: pod, bind, container and its slices.
fn describe(p: &PendingPod, c: &ContainerAssignment) -> String {
    let slices: Vec<String> =
        sorted_slices(c).iter().map(|s| format!("{} MiB and {}% of GPU {}", s.mem_mib, s.core_pct, s.gpu)).collect();
    format!("{} (bind #{}, container {}: {})", p.key, p.bind_seq, c.name, slices.join(", "))
}

/// The next waiting container of one pod, and its position in kubelet's order.
type Candidate<'a> = (&'a PendingPod, &'a ContainerAssignment, usize);

/// Next containers of every pod, best candidate first (sticky pod, then bind order, then name).
fn candidates<'a>(
    pending: &'a [PendingPod],
    claimed: &'a HashSet<(PodKey, String)>,
    sticky: Option<&PodKey>,
) -> Vec<Candidate<'a>> {
    let mut c: Vec<_> = pending.iter().filter_map(|p| waiting(p, claimed).next().map(|(i, c)| (p, c, i))).collect();
    c.sort_by_key(|(p, ..)| (Some(&p.key) != sticky, p.bind_seq, p.key.clone()));
    c
}

/// Whether matching `chosen` is right for the container's limits whichever of `chosen` and `other`
/// kubelet is admitting: their pods are interchangeable, or have the same limits from these
/// containers on (`core::admission`).
fn harmless(chosen: &Candidate<'_>, other: &Candidate<'_>) -> bool {
    let ((p, _, i), (q, _, j)) = (chosen, other);
    interchangeable(&p.assignment, &q.assignment) || same_from(&p.assignment, *i, &q.assignment, *j)
}

/// `Allocate`: the container whose assignment is exactly `gpus` (sorted, distinct). `pending` must
/// be a fresh view of the node: a pod kubelet admits but the view lacks could be mistaken for the
/// only other one waiting on those GPUs.
pub fn match_allocation(
    gpus: &[u32],
    pending: &[PendingPod],
    claimed: &HashSet<(PodKey, String)>,
    sticky: Option<&PodKey>,
) -> Result<Grant, MatchError> {
    let all = candidates(pending, claimed, sticky);
    let hits: Vec<&Candidate<'_>> = all.iter().filter(|(_, c, _)| gpu_set(c) == gpus).collect();
    let Some(&chosen) = hits.first() else {
        let waiting: Vec<String> = all
            .iter()
            .map(|(p, c, _)| format!("{}/{} on {:?} (bind #{})", p.key, c.name, gpu_set(c), p.bind_seq))
            .collect();
        return Err(MatchError::NoMatch {
            gpus: gpus.to_vec(),
            waiting: if waiting.is_empty() { "none".into() } else { waiting.join(", ") },
        });
    };
    let (p, c, _) = *chosen;
    // not only this container's slices: a guess between pods whose later containers differ would
    // give one of those the wrong limits at a later Allocate of the same admission
    if let Some(&&(q, d, _)) = hits.iter().skip(1).find(|other| !harmless(chosen, other)) {
        return Err(MatchError::Ambiguous { gpus: gpus.to_vec(), first: describe(p, c), second: describe(q, d) });
    }
    let mut g = grant(p, c);
    g.guessed = hits.len() > 1;
    if g.guessed {
        let twins: Vec<String> = hits.iter().skip(1).map(|(q, ..)| q.key.to_string()).collect();
        tracing::info!(
            chosen = %p.key, container = %c.name, twins = ?twins, gpus = ?gpus,
            "pods with the same limits wait for the same GPUs; either match is right, pod-resources will show which pod got the devices"
        );
    }
    Ok(g)
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
    candidates(pending, claimed, sticky).into_iter().find_map(|(p, c, _)| {
        let set = gpu_set(c);
        let fits = set.len() == count
            && set.iter().all(|g| free_gpus.contains(g) || required.contains(g))
            && required.iter().all(|g| set.contains(g));
        fits.then(|| grant(p, c))
    })
}

/// A pod's marks: (containers marked allocated, those of them unconfirmed).
type MarkRecord = (BTreeSet<String>, BTreeSet<String>);

/// An in-memory source: the fake for tests and demos, and the reference for what the Kubernetes one
/// must do (drop a pod once all its GPU containers are marked; marks corrected by the cross-check).
#[derive(Debug, Default)]
pub struct StaticAssignments {
    pods: Mutex<Vec<PendingPod>>,
    marks: Mutex<Vec<(PodKey, String)>>,
    records: Mutex<HashMap<PodKey, MarkRecord>>,
    fail_marks: std::sync::atomic::AtomicBool,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // plain bookkeeping: a panic elsewhere leaves it usable
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StaticAssignments {
    pub fn new(pods: Vec<PendingPod>) -> Self {
        Self { pods: Mutex::new(pods), ..Default::default() }
    }

    /// A pod bound after the others.
    pub fn bind(&self, pod: PendingPod) {
        locked(&self.pods).push(pod);
    }

    /// Every `mark_allocated` so far, in order.
    pub fn marks(&self) -> Vec<(PodKey, String)> {
        locked(&self.marks).clone()
    }

    /// The pod's record now: (containers marked allocated, those of them unconfirmed).
    pub fn record(&self, pod: &str) -> MarkRecord {
        locked(&self.records).iter().find(|(k, _)| k.pod == pod).map(|(_, r)| r.clone()).unwrap_or_default()
    }

    /// Makes `mark_allocated` fail, as an API server outage would.
    pub fn fail_marks(&self, fail: bool) {
        self.fail_marks.store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    fn with_record(&self, mut p: PendingPod) -> PendingPod {
        if let Some((allocated, unconfirmed)) = locked(&self.records).get(&p.key) {
            p.allocated.extend(allocated.iter().cloned());
            p.unconfirmed.extend(unconfirmed.iter().cloned());
        }
        p
    }
}

#[tonic::async_trait]
impl AssignmentSource for StaticAssignments {
    async fn pending(&self) -> Result<Vec<PendingPod>, SourceError> {
        let pods = locked(&self.pods).clone();
        Ok(pods
            .into_iter()
            .map(|p| self.with_record(p))
            .filter(|p| admission_order(&p.assignment).any(|c| !p.allocated.contains(&c.name)))
            .collect())
    }

    async fn mark_allocated(&self, pod: &PodKey, container: &str, unconfirmed: bool) -> Result<(), SourceError> {
        if self.fail_marks.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(SourceError::Mark {
                pod: pod.pod.clone(),
                container: container.into(),
                message: "injected failure".into(),
            });
        }
        locked(&self.marks).push((pod.clone(), container.to_string()));
        let mut records = locked(&self.records);
        let r = records.entry(pod.clone()).or_default();
        r.0.insert(container.to_string());
        if unconfirmed {
            r.1.insert(container.to_string());
        }
        Ok(())
    }

    async fn assigned(&self, pod: &str) -> Result<Option<PendingPod>, SourceError> {
        let found = locked(&self.pods).iter().find(|p| p.key.pod == pod).cloned();
        Ok(found.map(|p| self.with_record(p)))
    }

    async fn correct_allocated(&self, pod: &PodKey, confirm: &[String], unmark: &[String]) -> Result<(), SourceError> {
        let mut records = locked(&self.records);
        let r = records.entry(pod.clone()).or_default();
        for c in confirm {
            r.0.insert(c.clone());
            r.1.remove(c);
        }
        for c in unmark {
            r.0.remove(c);
            r.1.remove(c);
        }
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
        unconfirmed: BTreeSet::new(),
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
        // a and b both want the same share of GPU 1; c wants GPU 2
        let pending = vec![
            pending_pod("ns/b", 2, &[("main", false, vec![share(1, 4096, 40)])]),
            pending_pod("ns/a", 1, &[("main", false, vec![share(1, 4096, 40)])]),
            pending_pod("ns/c", 3, &[("main", false, vec![share(2, 1024, 10)])]),
        ];
        // either is right for the limits: bind order picks, and the pick is marked a guess
        let g = match_allocation(&[1], &pending, &none(), None).unwrap();
        assert_eq!((g.pod.pod.as_str(), g.guessed), ("ns/a", true));
        let claimed: HashSet<_> = [(g.pod.clone(), g.container.clone())].into();
        let g = match_allocation(&[1], &pending, &claimed, None).unwrap();
        assert_eq!((g.pod.pod.as_str(), g.guessed), ("ns/b", false));
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
    fn pods_waiting_on_one_gpu_with_other_limits_are_refused_never_guessed() {
        let pending = vec![
            pending_pod("ns/b", 2, &[("main", false, vec![share(1, 2048, 20)])]),
            pending_pod("ns/a", 1, &[("main", false, vec![share(1, 4096, 40)])]),
        ];
        let e = match_allocation(&[1], &pending, &none(), None).unwrap_err();
        assert!(matches!(e, MatchError::Ambiguous { .. }), "{e}");
        let s = e.to_string();
        assert!(s.contains("ns/a (bind #1, container main: 4096 MiB and 40% of GPU 1)"), "{s}");
        assert!(
            s.contains("ns/b (bind #2, container main: 2048 MiB and 20% of GPU 1)") && s.contains("refusing"),
            "{s}"
        );
        // once one of them is allocated, the other is the only one left: no doubt
        let claimed: HashSet<_> = [(pending[1].key.clone(), "main".to_string())].into();
        assert_eq!(match_allocation(&[1], &pending, &claimed, None).unwrap().pod.pod, "ns/b");
        // equal slices now, but different containers after them: a guess would go wrong later
        let pending = vec![
            pending_pod(
                "ns/x",
                1,
                &[("init", true, vec![share(1, 1000, 10)]), ("app", false, vec![share(2, 5000, 50)])],
            ),
            pending_pod(
                "ns/y",
                2,
                &[("init", true, vec![share(1, 1000, 10)]), ("app", false, vec![share(2, 8000, 50)])],
            ),
        ];
        assert!(matches!(match_allocation(&[1], &pending, &none(), None), Err(MatchError::Ambiguous { .. })));
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
        // the sidecar's share matches both pods, each the last container of its pod: either is right;
        // the pod being admitted wins over the earlier bind
        let g = match_allocation(&[4], &pending, &claimed, Some(&g.pod)).unwrap();
        assert_eq!((g.pod.pod.as_str(), g.container.as_str(), g.guessed), ("ns/multi", "sidecar", true));
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

    /// xorshift64*: the simulation's randomness, reproducible by seed without a crate.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
        }
    }

    /// A pod of 1 to 3 containers, each an init container or not, on one or two of GPUs 0..3, with
    /// one of two sizes: shared GPU sets and equal limits are common.
    fn random_pod(rng: &mut Rng, name: &str, bind_seq: u64) -> PendingPod {
        let n = 1 + rng.below(3);
        let containers: Vec<(String, bool, Vec<GpuSlice>)> = (0..n)
            .map(|i| {
                let first = rng.below(3) as u32;
                let mut gpus = vec![first];
                if rng.below(4) == 0 {
                    gpus.push((first + 1) % 3);
                }
                let (mem, core) = if rng.below(2) == 0 { (1000, 10) } else { (2000, 20) };
                (format!("c{i}"), rng.below(4) == 0, gpus.into_iter().map(|g| share(g, mem, core)).collect())
            })
            .collect();
        let refs: Vec<(&str, bool, Vec<GpuSlice>)> =
            containers.iter().map(|(c, i, s)| (c.as_str(), *i, s.clone())).collect();
        pending_pod(name, bind_seq, &refs)
    }

    /// kubelet admitting `pods` in a random order, each pod's containers one after the other in its
    /// order, against the matching rules. Returns the refusals and the guesses among pods with the
    /// same limits; panics on a container given other limits than its own. `gated`: no two pods the extender would keep from waiting together
    /// (`core::admission::confusable`) are bound at once, and twins are common.
    fn simulate(seed: u64, gated: bool) -> (usize, usize) {
        use gpuplace_core::admission::confusable;
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut pods: Vec<PendingPod> = Vec::new();
        while pods.len() < 2 + rng.below(5) as usize {
            let (name, seq) = (format!("ns/p{}", pods.len()), pods.len() as u64 + 1);
            let mut p = random_pod(&mut rng, &name, seq);
            if gated && !pods.is_empty() && rng.below(2) == 0 {
                // a twin of an earlier pod, under other container names
                let twin = &pods[rng.below(pods.len() as u64) as usize];
                p.assignment.containers = twin.assignment.containers.clone();
                for c in &mut p.assignment.containers {
                    c.name.push('t');
                }
            }
            if gated && pods.iter().any(|q| confusable(&p.assignment, &q.assignment)) {
                continue;
            }
            pods.push(p);
        }
        let mut order: Vec<usize> = (0..pods.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut view = pods.clone();
        let mut claimed = HashSet::new();
        let mut sticky = None;
        let (mut refused, mut guessed) = (0, 0);
        for t in order {
            let truth = pods[t].clone();
            // guesses made for this admission: undone if it fails (the plugin gives them up when
            // pod-resources never lists them, before kubelet admits anything else in this model)
            let mut guesses = Vec::new();
            for c in admission_order(&truth.assignment) {
                match match_allocation(&gpu_set(c), &view, &claimed, sticky.as_ref()) {
                    Ok(g) => {
                        assert_eq!(g.slices, sorted_slices(c), "seed {seed}: {}/{} got {g:?}", truth.key, c.name);
                        guessed += usize::from(g.guessed);
                        if g.pod != truth.key {
                            guesses.push((g.pod.clone(), g.container.clone()));
                        }
                        claimed.insert((g.pod.clone(), g.container.clone()));
                        sticky = Some(g.pod);
                    }
                    Err(e) => {
                        assert!(!gated, "seed {seed}: {}/{} refused: {e}", truth.key, c.name);
                        refused += 1;
                        // kubelet rejects the pod: it leaves the node
                        view.retain(|p| p.key != truth.key);
                        for g in &guesses {
                            claimed.remove(g);
                        }
                        break;
                    }
                }
            }
        }
        (refused, guessed)
    }

    #[test]
    fn no_admission_order_gives_a_container_another_pods_limits() {
        // where the extender gates binds: never a refusal, never a wrong limit, many a harmless guess
        let guessed: usize = (0..3000).map(|seed| simulate(seed, true).1).sum();
        assert!(guessed > 1000, "only {guessed} guesses: the runs hardly met pods with the same limits");
        // anything bound at once: refusals, never a wrong limit
        let refused: usize = (0..3000).map(|seed| simulate(seed, false).0).sum();
        assert!(refused > 0, "the ungated runs never met two confusable pods");
    }

    #[tokio::test]
    async fn static_source_drops_pods_once_allocated() {
        let src = StaticAssignments::new(vec![pending_pod("ns/a", 1, &[("main", false, vec![share(1, 1, 1)])])]);
        assert_eq!(src.pending().await.unwrap().len(), 1);
        let key = PodKey { pod: "ns/a".into(), uid: "uid-ns/a".into() };
        src.fail_marks(true);
        assert!(src.mark_allocated(&key, "main", false).await.is_err());
        src.fail_marks(false);
        src.mark_allocated(&key, "main", false).await.unwrap();
        assert!(src.pending().await.unwrap().is_empty());
        assert_eq!(src.marks(), vec![(key, "main".to_string())]);
    }
}
