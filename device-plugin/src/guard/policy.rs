//! What the guard decides from one sample of every GPU's processes: pure, no I/O, no clock of its
//! own (the caller passes `now`), so every rule is tested here.
//!
//! - **Memory.** A container's footprint on a GPU is the memory its processes hold there. Its limit is
//!   its grant plus one CUDA context per process (the grant is what the container may allocate; the
//!   context is the driver's, outside it). Over the limit: one [`Action::MemoryOver`] at once, then,
//!   if it is still over when the grace has passed, one process is stopped per sample, the largest
//!   first ([`Action::Kill`]), or the pod evicted once ([`Action::Evict`]), by policy. Back under the
//!   limit ends the episode. Whole-GPU grants are not capped (the GPU is theirs).
//! - **Compute.** A container whose SM use stays above its `gpu-core` share for `compute_samples`
//!   samples in a row, on a busy GPU, while a neighbour with a share of its own uses less than that
//!   share: one [`Action::ComputeOver`] per episode. Reported, never killed: compute overuse slows a
//!   neighbour down but does not fail it.
//! - Only processes of containers gpuplace granted are judged. Anything else on a GPU (the MPS
//!   server, a monitoring agent, a pod gpuplace did not place) is counted, never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// What happens to a container still over its memory grant after the grace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OverrunAction {
    /// SIGKILL its largest process on that GPU (the container's restart policy decides what next).
    Kill,
    /// Evict the pod through the Eviction API (PodDisruptionBudgets apply).
    Evict,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardConfig {
    /// How long a container may stay over its memory limit before it is stopped.
    pub grace: Duration,
    /// Memory one process's CUDA context holds beyond what it allocates.
    pub context_overhead_mib: u64,
    pub action: OverrunAction,
    /// Consecutive samples over the compute share before it is reported.
    pub compute_samples: u32,
    /// Percent points of SM use tolerated above a share (and below it, for a starved neighbour).
    pub compute_tolerance_pct: u32,
    /// GPU utilization from which a GPU counts as busy (contended).
    pub busy_pct: u32,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(10),
            context_overhead_mib: 0,
            action: OverrunAction::Kill,
            compute_samples: 3,
            compute_tolerance_pct: 10,
            busy_pct: 90,
        }
    }
}

/// A container, as the guard names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    pub container: String,
    pub container_id: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} container {}", self.namespace, self.pod, self.container)
    }
}

/// What a container was granted on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub mem_mib: u64,
    pub core_pct: u32,
    pub exclusive: bool,
}

/// Whose a process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// A container of a pod gpuplace placed; `grant` is what it holds on this GPU (`None`: nothing,
    /// so its memory here is all over).
    Granted { holder: Holder, grant: Option<Grant> },
    /// Anything else, with what is known of it (for logs).
    Other(String),
}

/// One process on one GPU, attributed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub gpu: u32,
    pub pid: u32,
    pub used_mib: Option<u64>,
    pub sm_pct: Option<u32>,
    pub owner: Owner,
}

/// What to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A container went over its memory limit (an Event and the metric, at once).
    MemoryOver {
        holder: Holder,
        gpu: u32,
        /// Its processes on that GPU, ascending.
        pids: Vec<u32>,
        used_mib: u64,
        granted_mib: u64,
        limit_mib: u64,
        grace: Duration,
    },
    /// Stop this process now.
    Kill { holder: Holder, gpu: u32, pid: u32, used_mib: u64, limit_mib: u64 },
    /// Evict the container's pod now.
    Evict { holder: Holder, gpu: u32, used_mib: u64, limit_mib: u64 },
    /// The container is back within its limit before anything was stopped.
    MemoryBack { holder: Holder, gpu: u32 },
    /// A container used more than its compute share while a neighbour was starved.
    ComputeOver { holder: Holder, gpu: u32, sm_pct: u32, core_pct: u32, starved: Vec<Holder> },
}

/// Counts of one step, for gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// (container, GPU) pairs over their memory limit now.
    pub over_memory: usize,
    /// Processes of no container gpuplace granted.
    pub unattributed: usize,
    /// Granted containers whose memory the driver did not report.
    pub unmeasured: usize,
}

#[derive(Debug, Clone)]
struct Episode {
    since: Instant,
    /// Processes already told to stop (still listed until they exit).
    stopped: BTreeSet<u32>,
    evicted: bool,
}

#[derive(Debug, Clone, Default)]
struct ComputeWatch {
    samples_over: u32,
    reported: bool,
}

type Key = (Holder, u32);

/// See the module docs.
#[derive(Debug)]
pub struct Guard {
    cfg: GuardConfig,
    memory: BTreeMap<Key, Episode>,
    compute: BTreeMap<Key, ComputeWatch>,
}

/// One container's processes on one GPU, summed.
#[derive(Debug, Default)]
struct Footprint {
    grant: Option<Grant>,
    used_mib: u64,
    measured: bool,
    sm_pct: u32,
    sm_measured: bool,
    /// (used MiB, pid), for picking what to stop.
    processes: Vec<(u64, u32)>,
}

impl Guard {
    pub fn new(cfg: GuardConfig) -> Self {
        Self { cfg, memory: BTreeMap::new(), compute: BTreeMap::new() }
    }

    pub fn config(&self) -> &GuardConfig {
        &self.cfg
    }

    /// One sample: `util` is each GPU's utilization (by index, `None` when unknown), `seen` every
    /// process on every GPU. Returns what to do and the step's counts.
    pub fn step(&mut self, now: Instant, util: &BTreeMap<u32, u32>, seen: &[Seen]) -> (Vec<Action>, StepSummary) {
        let mut summary = StepSummary::default();
        let mut feet: BTreeMap<Key, Footprint> = BTreeMap::new();
        for s in seen {
            match &s.owner {
                Owner::Other(_) => summary.unattributed += 1,
                Owner::Granted { holder, grant } => {
                    let f = feet.entry((holder.clone(), s.gpu)).or_default();
                    f.grant = *grant;
                    if let Some(m) = s.used_mib {
                        f.used_mib += m;
                        f.measured = true;
                    }
                    if let Some(u) = s.sm_pct {
                        f.sm_pct += u;
                        f.sm_measured = true;
                    }
                    f.processes.push((s.used_mib.unwrap_or(0), s.pid));
                }
            }
        }
        let mut actions = Vec::new();
        self.memory_rules(now, &feet, &mut actions, &mut summary);
        self.compute_rules(util, &feet, &mut actions);
        (actions, summary)
    }

    fn limit(&self, grant: Option<Grant>, processes: usize) -> Option<u64> {
        match grant {
            Some(g) if g.exclusive => None,
            g => Some(g.map_or(0, |g| g.mem_mib) + self.cfg.context_overhead_mib * processes as u64),
        }
    }

    fn memory_rules(
        &mut self,
        now: Instant,
        feet: &BTreeMap<Key, Footprint>,
        actions: &mut Vec<Action>,
        summary: &mut StepSummary,
    ) {
        let mut still = BTreeSet::new();
        for (key, f) in feet {
            let Some(limit) = self.limit(f.grant, f.processes.len()) else { continue };
            if !f.measured {
                summary.unmeasured += 1;
                continue;
            }
            if f.used_mib <= limit {
                continue;
            }
            summary.over_memory += 1;
            still.insert(key.clone());
            let (holder, gpu) = (key.0.clone(), key.1);
            let ep = match self.memory.get_mut(key) {
                Some(ep) => ep,
                None => {
                    let mut pids: Vec<u32> = f.processes.iter().map(|(_, pid)| *pid).collect();
                    pids.sort_unstable();
                    actions.push(Action::MemoryOver {
                        holder,
                        gpu,
                        pids,
                        used_mib: f.used_mib,
                        granted_mib: f.grant.map_or(0, |g| g.mem_mib),
                        limit_mib: limit,
                        grace: self.cfg.grace,
                    });
                    self.memory.insert(key.clone(), Episode { since: now, stopped: BTreeSet::new(), evicted: false });
                    // the grace starts now, even when it is zero: the Event goes out first
                    continue;
                }
            };
            if now.duration_since(ep.since) < self.cfg.grace {
                continue;
            }
            match self.cfg.action {
                OverrunAction::Evict if !ep.evicted => {
                    ep.evicted = true;
                    actions.push(Action::Evict { holder, gpu, used_mib: f.used_mib, limit_mib: limit });
                }
                OverrunAction::Evict => {}
                OverrunAction::Kill => {
                    // one at a time, largest first: stopping it may bring the container under
                    let next = f
                        .processes
                        .iter()
                        .filter(|(_, pid)| !ep.stopped.contains(pid))
                        .max_by_key(|(used, pid)| (*used, std::cmp::Reverse(*pid)));
                    if let Some(&(used, pid)) = next {
                        ep.stopped.insert(pid);
                        actions.push(Action::Kill { holder, gpu, pid, used_mib: used, limit_mib: limit });
                    }
                }
            }
        }
        // episodes that ended: back under before anything was done is worth saying
        let ended: Vec<Key> = self.memory.keys().filter(|k| !still.contains(*k)).cloned().collect();
        for key in ended {
            if let Some(ep) = self.memory.remove(&key) {
                if ep.stopped.is_empty() && !ep.evicted && feet.contains_key(&key) {
                    actions.push(Action::MemoryBack { holder: key.0, gpu: key.1 });
                }
            }
        }
    }

    fn compute_rules(&mut self, util: &BTreeMap<u32, u32>, feet: &BTreeMap<Key, Footprint>, actions: &mut Vec<Action>) {
        let tol = self.cfg.compute_tolerance_pct;
        let mut seen_keys = BTreeSet::new();
        for (key, f) in feet {
            let Some(g) = f.grant.filter(|g| !g.exclusive && (1..100).contains(&g.core_pct)) else { continue };
            if !f.sm_measured {
                continue;
            }
            seen_keys.insert(key.clone());
            let gpu = key.1;
            let busy = util.get(&gpu).is_some_and(|u| *u >= self.cfg.busy_pct);
            let starved: Vec<Holder> = feet
                .iter()
                .filter(|((h, n), o)| {
                    *n == gpu
                        && *h != key.0
                        && o.sm_measured
                        && o.grant.is_some_and(|og| !og.exclusive && og.core_pct > 0 && o.sm_pct + tol < og.core_pct)
                })
                .map(|((h, _), _)| h.clone())
                .collect();
            let over = busy && f.sm_pct > g.core_pct + tol && !starved.is_empty();
            let w = self.compute.entry(key.clone()).or_default();
            if !over {
                *w = ComputeWatch::default();
                continue;
            }
            w.samples_over += 1;
            if w.samples_over >= self.cfg.compute_samples.max(1) && !w.reported {
                w.reported = true;
                actions.push(Action::ComputeOver {
                    holder: key.0.clone(),
                    gpu,
                    sm_pct: f.sm_pct,
                    core_pct: g.core_pct,
                    starved,
                });
            }
        }
        self.compute.retain(|k, _| seen_keys.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pod: &str) -> Holder {
        Holder {
            namespace: "ml".into(),
            pod: pod.into(),
            pod_uid: format!("uid-{pod}"),
            container: "main".into(),
            container_id: format!("cid-{pod}"),
        }
    }

    fn share(mem: u64, core: u32) -> Option<Grant> {
        Some(Grant { mem_mib: mem, core_pct: core, exclusive: false })
    }

    fn proc_(gpu: u32, pid: u32, used: u64, pod: &str, grant: Option<Grant>) -> Seen {
        Seen { gpu, pid, used_mib: Some(used), sm_pct: None, owner: Owner::Granted { holder: holder(pod), grant } }
    }

    fn cfg() -> GuardConfig {
        GuardConfig { grace: Duration::from_secs(10), context_overhead_mib: 500, ..GuardConfig::default() }
    }

    #[test]
    fn over_memory_is_reported_at_once_and_killed_after_the_grace_and_only_the_offender() {
        let mut g = Guard::new(cfg());
        let t0 = Instant::now();
        let util = BTreeMap::new();
        // a 20 GiB share at 30 GiB beside a 40 GiB share within its grant (context included)
        let seen =
            vec![proc_(0, 100, 30_720, "small", share(20_480, 30)), proc_(0, 200, 40_960, "big", share(40_960, 50))];
        let (a, s) = g.step(t0, &util, &seen);
        assert_eq!(
            a,
            vec![Action::MemoryOver {
                holder: holder("small"),
                gpu: 0,
                pids: vec![100],
                used_mib: 30_720,
                granted_mib: 20_480,
                limit_mib: 20_980,
                grace: Duration::from_secs(10)
            }]
        );
        assert_eq!(s.over_memory, 1);
        // within the grace: nothing more
        let (a, _) = g.step(t0 + Duration::from_secs(5), &util, &seen);
        assert!(a.is_empty(), "{a:?}");
        // after it: the offender's process, never the neighbour's
        let (a, _) = g.step(t0 + Duration::from_secs(10), &util, &seen);
        assert_eq!(
            a,
            vec![Action::Kill { holder: holder("small"), gpu: 0, pid: 100, used_mib: 30_720, limit_mib: 20_980 }]
        );
        // still listed while it exits: not killed twice
        let (a, _) = g.step(t0 + Duration::from_secs(11), &util, &seen);
        assert!(a.is_empty(), "{a:?}");
        // gone: the episode ends quietly, the neighbour was never named
        let (a, s) = g.step(t0 + Duration::from_secs(12), &util, &seen[1..]);
        assert!(a.is_empty() && s.over_memory == 0, "{a:?}");
    }

    #[test]
    fn largest_process_first_then_the_next_while_still_over() {
        let mut g = Guard::new(GuardConfig { grace: Duration::ZERO, ..cfg() });
        let t0 = Instant::now();
        let seen = vec![
            proc_(1, 10, 9_000, "p", share(10_000, 0)),
            proc_(1, 11, 12_000, "p", share(10_000, 0)),
            proc_(1, 12, 1_000, "p", share(10_000, 0)),
        ];
        let (a, _) = g.step(t0, &BTreeMap::new(), &seen);
        assert!(matches!(a[..], [Action::MemoryOver { limit_mib: 11_500, used_mib: 22_000, .. }]), "{a:?}");
        let (a, _) = g.step(t0, &BTreeMap::new(), &seen);
        assert!(matches!(a[..], [Action::Kill { pid: 11, .. }]), "{a:?}");
        // 11 exited, 10 + 12 = 10_000 + 2 contexts: within 11_000
        let (a, s) = g.step(t0, &BTreeMap::new(), &[seen[0].clone(), seen[2].clone()]);
        assert!(a.is_empty() && s.over_memory == 0, "{a:?}");
    }

    #[test]
    fn back_under_within_the_grace_stops_nothing_and_says_so() {
        let mut g = Guard::new(cfg());
        let t0 = Instant::now();
        let (a, _) = g.step(t0, &BTreeMap::new(), &[proc_(0, 1, 25_000, "p", share(20_000, 10))]);
        assert_eq!(a.len(), 1);
        let (a, _) =
            g.step(t0 + Duration::from_secs(3), &BTreeMap::new(), &[proc_(0, 1, 19_000, "p", share(20_000, 10))]);
        assert_eq!(a, vec![Action::MemoryBack { holder: holder("p"), gpu: 0 }]);
        // over again later: a new episode with a new grace
        let (a, _) =
            g.step(t0 + Duration::from_secs(30), &BTreeMap::new(), &[proc_(0, 1, 25_000, "p", share(20_000, 10))]);
        assert!(matches!(a[..], [Action::MemoryOver { .. }]), "{a:?}");
    }

    #[test]
    fn evict_policy_evicts_once() {
        let mut g = Guard::new(GuardConfig { action: OverrunAction::Evict, grace: Duration::ZERO, ..cfg() });
        let t0 = Instant::now();
        let seen = [proc_(0, 1, 25_000, "p", share(20_000, 10))];
        g.step(t0, &BTreeMap::new(), &seen);
        let (a, _) = g.step(t0, &BTreeMap::new(), &seen);
        assert!(matches!(a[..], [Action::Evict { used_mib: 25_000, limit_mib: 20_500, .. }]), "{a:?}");
        let (a, _) = g.step(t0 + Duration::from_secs(1), &BTreeMap::new(), &seen);
        assert!(a.is_empty(), "{a:?}");
    }

    #[test]
    fn whole_gpus_unknown_owners_and_unmeasured_memory_are_never_stopped() {
        let mut g = Guard::new(GuardConfig { grace: Duration::ZERO, ..cfg() });
        let t0 = Instant::now();
        let whole = Some(Grant { mem_mib: 80_000, core_pct: 100, exclusive: true });
        let seen = vec![
            proc_(0, 1, 80_000, "whole", whole),
            Seen { gpu: 1, pid: 2, used_mib: Some(70_000), sm_pct: None, owner: Owner::Other("mps server".into()) },
            Seen {
                gpu: 1,
                pid: 3,
                used_mib: None,
                sm_pct: None,
                owner: Owner::Granted { holder: holder("q"), grant: share(1_000, 10) },
            },
        ];
        for _ in 0..3 {
            let (a, s) = g.step(t0, &BTreeMap::new(), &seen);
            assert!(a.is_empty(), "{a:?}");
            assert_eq!((s.over_memory, s.unattributed, s.unmeasured), (0, 1, 1));
        }
    }

    #[test]
    fn a_granted_container_on_a_gpu_it_was_not_granted_is_all_over() {
        let mut g = Guard::new(cfg());
        let (a, _) = g.step(Instant::now(), &BTreeMap::new(), &[proc_(3, 9, 600, "p", None)]);
        assert!(matches!(a[..], [Action::MemoryOver { granted_mib: 0, limit_mib: 500, .. }]), "{a:?}");
    }

    #[test]
    fn compute_overuse_is_reported_only_on_a_busy_gpu_with_a_starved_neighbour() {
        let mut g = Guard::new(GuardConfig { compute_samples: 2, ..cfg() });
        let t0 = Instant::now();
        let with_sm = |mut s: Seen, sm: u32| {
            s.sm_pct = Some(sm);
            s
        };
        let hog = with_sm(proc_(0, 1, 1_000, "hog", share(10_000, 30)), 85);
        let starved = with_sm(proc_(0, 2, 1_000, "victim", share(10_000, 50)), 10);
        let content = with_sm(proc_(0, 2, 1_000, "victim", share(10_000, 50)), 45);
        let busy = BTreeMap::from([(0, 97)]);
        let idle = BTreeMap::from([(0, 60)]);
        // not busy: nothing, however long
        for _ in 0..3 {
            assert!(g.step(t0, &idle, &[hog.clone(), starved.clone()]).0.is_empty());
        }
        // busy but the neighbour gets its share: nothing
        for _ in 0..3 {
            assert!(g.step(t0, &busy, &[hog.clone(), content.clone()]).0.is_empty());
        }
        // busy and starved: after 2 samples, once
        assert!(g.step(t0, &busy, &[hog.clone(), starved.clone()]).0.is_empty());
        let (a, _) = g.step(t0, &busy, &[hog.clone(), starved.clone()]);
        assert_eq!(
            a,
            vec![Action::ComputeOver {
                holder: holder("hog"),
                gpu: 0,
                sm_pct: 85,
                core_pct: 30,
                starved: vec![holder("victim")]
            }]
        );
        assert!(g.step(t0, &busy, &[hog.clone(), starved.clone()]).0.is_empty());
        // the episode ends when it stops, and a new one is reported again
        assert!(g.step(t0, &busy, &[hog.clone(), content.clone()]).0.is_empty());
        g.step(t0, &busy, &[hog.clone(), starved.clone()]);
        assert_eq!(g.step(t0, &busy, &[hog, starved]).0.len(), 1);
    }
}
