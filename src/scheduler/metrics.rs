//! Prometheus metrics, in the text exposition format (version 0.0.4).
//!
//! Hand-written rather than the `prometheus` crate: the set is small and fixed (a few counters with
//! closed label sets and one histogram family), the state gauges are computed from the cluster model
//! at scrape time rather than kept up to date on every change, and the text format is a page of
//! code. That keeps a dependency (and its default protobuf feature) out of the build. Counters are
//! relaxed atomics: a scrape may see one counter a request ahead of another, which Prometheus
//! tolerates.
//!
//! Per-pod series (what each pod holds on each GPU) exist only for pods holding GPUs, and pending
//! pods are counted by reason class, never listed: the series grow with the GPUs in use, not with
//! the pods that come and go.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::scheduler::exposition::{escape, gauge, header};
use crate::scheduler::verdict_cache::RejectClass;
use gpuplace_core::cluster::Cluster;
use gpuplace_core::room::Room;
use gpuplace_core::summary::ClusterSummary;

/// The four extender verbs, as metric label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Filter,
    Prioritize,
    Bind,
    Preempt,
}

impl Verb {
    pub const ALL: [Verb; 4] = [Verb::Filter, Verb::Prioritize, Verb::Bind, Verb::Preempt];

    pub fn name(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
            Verb::Preempt => "preempt",
        }
    }
}

/// How a bind ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindOutcome {
    Bound,
    /// A retry of a bind already done: answered as success, nothing counted twice.
    Repeated,
    /// kube-scheduler named a pod gpuplace has not seen in a filter (or watch).
    UnknownPod,
    /// The pod's request breaks the contract.
    Refused,
    UnknownNode,
    /// The pod no longer fits on the chosen node (state changed since filter).
    NoFit,
    /// The pod is already bound elsewhere, or a bind of it is in flight.
    Conflict,
    /// The Binding (or the annotation patch) failed; the allocation was rolled back.
    BinderFailed,
    /// The state is not complete, or this replica is not the leader.
    NotReady,
    /// Pods the node's device plugin could confuse with this one were not admitted in time
    /// (`scheduler::service`'s admission rule); rolled back, kube-scheduler retries.
    AdmissionWait,
}

impl BindOutcome {
    pub const ALL: [BindOutcome; 10] = [
        BindOutcome::Bound,
        BindOutcome::Repeated,
        BindOutcome::UnknownPod,
        BindOutcome::Refused,
        BindOutcome::UnknownNode,
        BindOutcome::NoFit,
        BindOutcome::Conflict,
        BindOutcome::BinderFailed,
        BindOutcome::NotReady,
        BindOutcome::AdmissionWait,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BindOutcome::Bound => "bound",
            BindOutcome::Repeated => "repeated",
            BindOutcome::UnknownPod => "unknown_pod",
            BindOutcome::Refused => "refused",
            BindOutcome::UnknownNode => "unknown_node",
            BindOutcome::NoFit => "no_fit",
            BindOutcome::Conflict => "conflict",
            BindOutcome::BinderFailed => "binder_failed",
            BindOutcome::NotReady => "not_ready",
            BindOutcome::AdmissionWait => "admission_wait",
        }
    }

    pub fn is_success(self) -> bool {
        matches!(self, BindOutcome::Bound | BindOutcome::Repeated)
    }
}

/// Disagreements between gpuplace's records and what it is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictKind {
    /// A pod name bound again under a new UID while the old UID still held GPUs (its deletion was
    /// missed): the old record was released.
    StaleUid,
    /// A Node object's inventory annotation was refused.
    BadInventory,
    /// An assignment annotation was refused (forged, stale, or colliding with another pod).
    BadAssignment,
    /// A counted pod's assignment annotation was removed or rewritten after gpuplace bound it (its
    /// GPUs stay counted, from the books after a restart, and the record is written back).
    TamperedAssignment,
}

impl ConflictKind {
    pub const ALL: [ConflictKind; 4] = [
        ConflictKind::StaleUid,
        ConflictKind::BadInventory,
        ConflictKind::BadAssignment,
        ConflictKind::TamperedAssignment,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ConflictKind::StaleUid => "stale_uid",
            ConflictKind::BadInventory => "bad_inventory",
            ConflictKind::BadAssignment => "bad_assignment",
            ConflictKind::TamperedAssignment => "tampered_assignment",
        }
    }
}

/// The resources API-server mode watches, as metric label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    Nodes,
    Pods,
    /// The device plugins' utilization ConfigMaps (optional: readiness does not wait on them).
    UtilizationConfigMaps,
    /// kube-scheduler's PodGroups (optional: served only with the alpha API enabled).
    PodGroups,
    /// DRA (`--dra-driver`): the driver's ResourceSlices, every ResourceClaim, and unscheduled pods
    /// (for gpuplace's scheduling gate).
    ResourceSlices,
    ResourceClaims,
    GatedPods,
}

impl Watched {
    pub const ALL: [Watched; 7] = [
        Watched::Nodes,
        Watched::Pods,
        Watched::UtilizationConfigMaps,
        Watched::PodGroups,
        Watched::ResourceSlices,
        Watched::ResourceClaims,
        Watched::GatedPods,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Watched::Nodes => "nodes",
            Watched::Pods => "pods",
            Watched::UtilizationConfigMaps => "configmaps",
            Watched::PodGroups => "podgroups",
            Watched::ResourceSlices => "resourceslices",
            Watched::ResourceClaims => "resourceclaims",
            Watched::GatedPods => "gatedpods",
        }
    }

    fn index(self) -> usize {
        Watched::ALL.iter().position(|&w| w == self).unwrap_or(0)
    }
}

/// How long a pod every candidate turned down counts as pending without another filter of it.
/// kube-scheduler retries an unschedulable pod at least every 5 minutes
/// (`podMaxInUnschedulablePodsDuration`), sooner when the cluster changes; a pending pod deleted
/// without a watch seeing it (static mode), or placed by another scheduler, drops out after this.
pub const PENDING_TTL: Duration = Duration::from_secs(6 * 60);

/// Pending pods remembered at most: a bound on memory (they are exported as counts per class).
const PENDING_CAP: usize = 100_000;

/// Upper bounds of the latency histogram, in seconds: 50 µs to 1 s, finest where the 5 ms target is.
const BUCKETS: [f64; 13] = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];

#[derive(Debug, Default)]
struct Histogram {
    /// Per bucket (not cumulative), plus one for +Inf.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS.iter().position(|&b| s <= b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// Every counter and histogram the service keeps. Gauges come from the cluster at scrape time.
#[derive(Debug, Default)]
pub struct Metrics {
    /// [verb][ok, client error, server error]
    requests: [[AtomicU64; 3]; 4],
    latency: [Histogram; 4],
    rejections: [AtomicU64; 4],
    binds: [AtomicU64; BindOutcome::ALL.len()],
    conflicts: [AtomicU64; 4],
    /// Preempt: nodes whose victims were kept (possibly fewer) and nodes dropped.
    preempt_nodes: [AtomicU64; 2],
    preempt_victims_dropped: AtomicU64,
    placement_log_errors: AtomicU64,
    /// Per watched resource: Unix time (ms) of the last event or completed (re)list; 0 until the
    /// watcher first reports (static mode has none, and renders no staleness).
    watch_fresh_ms: [AtomicI64; Watched::ALL.len()],
    watch_errors: [AtomicU64; Watched::ALL.len()],
    /// -1: no leader election (static mode, or disabled); 0/1: this replica leads.
    leader: AtomicI64,
    /// Counted assignments whose MAC is not the primary key's (or that are unsigned): set from the
    /// state at scrape time.
    signed_with_old_key: AtomicU64,
    /// `--accept-unsigned-assignments` is on: unsigned assignments are counted.
    accept_unsigned: std::sync::atomic::AtomicBool,
    /// `serve --metrics-pod-series`: the `gpuplace_pod_gpu_*` series, which name every GPU pod.
    pod_series: std::sync::atomic::AtomicBool,
    /// GPU pods counted into the learned mix, and entries of the mix in use: set at scrape time.
    mix_observed: AtomicU64,
    mix_entries: AtomicU64,
    /// Reserve classes: [scarce, plenty]; set at scrape time.
    reserve_classes: [AtomicU64; 2],
    /// Groups placed whole (`scheduler::groups`): [waiting with no plan, holding a plan, thousandths
    /// of GPUs reserved, age of the oldest plan in ms].
    groups: [AtomicU64; 4],
    /// Pods sent back to kube-scheduler's queue after GPUs were freed (`scheduler::requeue`):
    /// [annotated, failed].
    requeued: [AtomicU64; 2],
    /// UID → why every candidate turned the pod down at its last filter, and when.
    pending: Mutex<HashMap<String, (RejectClass, Instant)>>,
    /// The client certificates that verbs came with (mTLS): subject common name to its end (Unix
    /// seconds), the latest seen per subject; at most [`CLIENT_CERT_CAP`] subjects.
    client_certs: Mutex<std::collections::BTreeMap<String, i64>>,
}

/// Subjects kept for `gpuplace_client_certificate_expiry_timestamp_seconds` (kube-scheduler's, the
/// other replica's, a few more for operators' own certificates).
const CLIENT_CERT_CAP: usize = 16;

fn verb_index(v: Verb) -> usize {
    Verb::ALL.iter().position(|&x| x == v).unwrap_or(0)
}

impl Metrics {
    pub fn new() -> Self {
        let m = Self::default();
        m.leader.store(-1, Ordering::Relaxed);
        m
    }

    /// A verb came with a verified client certificate for `subject`, valid until `not_after` (Unix
    /// seconds): what kube-scheduler presents, so that an alert sees it near its end (kube-scheduler
    /// reads a renewed one only when it restarts).
    pub fn client_certificate(&self, subject: &str, not_after: i64) {
        let mut certs = self.client_certs.lock().unwrap_or_else(|e| e.into_inner());
        if certs.len() >= CLIENT_CERT_CAP && !certs.contains_key(subject) {
            return;
        }
        certs.insert(subject.to_string(), not_after);
    }

    /// A watcher delivered an event or completed a (re)list at `now_ms` (Unix ms).
    pub fn watch_fresh(&self, w: Watched, now_ms: i64) {
        self.watch_fresh_ms[w.index()].store(now_ms.max(1), Ordering::Relaxed);
    }

    /// After a filter of the pod `uid` at `now`: `Some(class)` when every candidate turned it down,
    /// with what it waits on ([`RejectClass::of_pending`]); `None` when it fits somewhere.
    pub fn pod_filtered(&self, uid: &str, pending: Option<RejectClass>, now: Instant) {
        if uid.is_empty() {
            return;
        }
        let mut p = self.pending();
        let Some(class) = pending else {
            p.remove(uid);
            return;
        };
        if p.len() >= PENDING_CAP && !p.contains_key(uid) {
            p.retain(|_, (_, at)| now.saturating_duration_since(*at) < PENDING_TTL);
            if p.len() >= PENDING_CAP {
                // still full of live entries: the longest unseen goes
                if let Some(oldest) = p.iter().min_by_key(|(_, (_, at))| *at).map(|(uid, _)| uid.clone()) {
                    p.remove(&oldest);
                }
            }
        }
        p.insert(uid.to_string(), (class, now));
    }

    /// The pod `uid` was bound, or is gone: no longer pending.
    pub fn pod_settled(&self, uid: &str) {
        self.pending().remove(uid);
    }

    /// Pending pods at `now` per class, in [`RejectClass::ALL`] order; those not filtered for
    /// [`PENDING_TTL`] are forgotten.
    pub fn pending_pods(&self, now: Instant) -> [u64; 4] {
        let mut p = self.pending();
        p.retain(|_, (_, at)| now.saturating_duration_since(*at) < PENDING_TTL);
        let mut out = [0; 4];
        for (class, _) in p.values() {
            out[class.index()] += 1;
        }
        out
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<String, (RejectClass, Instant)>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pod sent back to kube-scheduler's queue (`ok`: its annotation update went through).
    pub fn requeued(&self, ok: bool) {
        self.requeued[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    /// A watcher's stream reported an error (it retries with backoff).
    pub fn watch_error(&self, w: Watched) {
        self.watch_errors[w.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Seconds since the watcher was last fresh, at `now_ms`; `None` before it first reported.
    pub fn watch_staleness(&self, w: Watched, now_ms: i64) -> Option<f64> {
        let at = self.watch_fresh_ms[w.index()].load(Ordering::Relaxed);
        (at > 0).then(|| (now_ms - at).max(0) as f64 / 1000.0)
    }

    pub fn watch_errors(&self, w: Watched) -> u64 {
        self.watch_errors[w.index()].load(Ordering::Relaxed)
    }

    /// Whether this replica holds the leader Lease (API-server mode with leader election).
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(i64::from(leader), Ordering::Relaxed);
    }

    /// Counted assignments not signed with the primary key (an old key can leave the Secret at 0).
    pub fn set_accept_unsigned(&self, on: bool) {
        self.accept_unsigned.store(on, Ordering::Relaxed);
    }

    /// Whether the page has a series per pod and GPU held (off: whoever may scrape learns no pod's
    /// namespace or name; issue 48).
    pub fn set_pod_series(&self, on: bool) {
        self.pod_series.store(on, Ordering::Relaxed);
    }

    pub fn set_signed_with_old_key(&self, n: u64) {
        self.signed_with_old_key.store(n, Ordering::Relaxed);
    }

    /// The learned mix: pods counted (0 for a fixed mix) and entries of the mix in use.
    pub fn set_mix(&self, observed: u64, entries: u64) {
        self.mix_observed.store(observed, Ordering::Relaxed);
        self.mix_entries.store(entries, Ordering::Relaxed);
    }

    /// The reserve's classes now: how many are scarce, and how many are not.
    pub fn set_groups(&self, g: &crate::scheduler::groups::GroupStats) {
        self.groups[0].store(g.waiting as u64, Ordering::Relaxed);
        self.groups[1].store(g.planned as u64, Ordering::Relaxed);
        self.groups[2].store((g.gpus_reserved * 1000.0).round() as u64, Ordering::Relaxed);
        self.groups[3].store((g.oldest_plan_s * 1000.0).round() as u64, Ordering::Relaxed);
    }

    pub fn set_reserve(&self, scarce: u64, plenty: u64) {
        self.reserve_classes[0].store(scarce, Ordering::Relaxed);
        self.reserve_classes[1].store(plenty, Ordering::Relaxed);
    }

    /// Conflicts of this kind counted so far.
    pub fn conflicts(&self, kind: ConflictKind) -> u64 {
        let i = ConflictKind::ALL.iter().position(|&c| c == kind).unwrap_or(0);
        self.conflicts[i].load(Ordering::Relaxed)
    }

    /// One answered request: its HTTP status and how long it took.
    pub fn request(&self, verb: Verb, status: u16, took: Duration) {
        let v = verb_index(verb);
        let class = match status {
            200..=399 => 0,
            400..=499 => 1,
            _ => 2,
        };
        self.requests[v][class].fetch_add(1, Ordering::Relaxed);
        self.latency[v].observe(took);
    }

    pub fn rejection(&self, class: RejectClass, n: u64) {
        let i = RejectClass::ALL.iter().position(|&c| c == class).unwrap_or(0);
        self.rejections[i].fetch_add(n, Ordering::Relaxed);
    }

    pub fn bind(&self, outcome: BindOutcome) {
        let i = BindOutcome::ALL.iter().position(|&c| c == outcome).unwrap_or(0);
        self.binds[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn conflict(&self, kind: ConflictKind) {
        let i = ConflictKind::ALL.iter().position(|&c| c == kind).unwrap_or(0);
        self.conflicts[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn preempt_node(&self, kept: bool, victims_dropped: u64) {
        self.preempt_nodes[usize::from(!kept)].fetch_add(1, Ordering::Relaxed);
        self.preempt_victims_dropped.fetch_add(victims_dropped, Ordering::Relaxed);
    }

    pub fn placement_log_error(&self) {
        self.placement_log_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Count of binds that ended this way (for tests and `/inspect`).
    pub fn binds(&self, outcome: BindOutcome) -> u64 {
        let i = BindOutcome::ALL.iter().position(|&c| c == outcome).unwrap_or(0);
        self.binds[i].load(Ordering::Relaxed)
    }

    /// The exposition text: counters, histograms, then gauges computed from `cluster`.
    pub fn render(&self, cluster: &Cluster, bound_pods: usize, ready: bool) -> String {
        let mut out = String::with_capacity(8192);
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        header(&mut out, "gpuplace_requests_total", "counter", "Extender requests answered, by verb and status class.");
        for v in Verb::ALL {
            for (c, class) in ["2xx", "4xx", "5xx"].iter().enumerate() {
                let n = ld(&self.requests[verb_index(v)][c]);
                let _ = writeln!(out, "gpuplace_requests_total{{verb=\"{}\",code=\"{class}\"}} {n}", v.name());
            }
        }
        header(
            &mut out,
            "gpuplace_request_duration_seconds",
            "histogram",
            "Time to answer an extender request, by verb (decoding to encoding, binder call included).",
        );
        for v in Verb::ALL {
            let h = &self.latency[verb_index(v)];
            let mut cum = 0;
            for (i, b) in BUCKETS.iter().enumerate() {
                cum += ld(&h.counts[i]);
                let _ =
                    writeln!(out, "gpuplace_request_duration_seconds_bucket{{verb=\"{}\",le=\"{b}\"}} {cum}", v.name());
            }
            cum += ld(&h.counts[BUCKETS.len()]);
            let _ =
                writeln!(out, "gpuplace_request_duration_seconds_bucket{{verb=\"{}\",le=\"+Inf\"}} {cum}", v.name());
            let sum = ld(&h.sum_ns) as f64 / 1e9;
            let _ = writeln!(out, "gpuplace_request_duration_seconds_sum{{verb=\"{}\"}} {sum}", v.name());
            let _ = writeln!(out, "gpuplace_request_duration_seconds_count{{verb=\"{}\"}} {cum}", v.name());
        }
        header(
            &mut out,
            "gpuplace_filter_rejections_total",
            "counter",
            "Nodes turned down by filter, by reason class.",
        );
        for (i, c) in RejectClass::ALL.iter().enumerate() {
            let _ = writeln!(
                out,
                "gpuplace_filter_rejections_total{{reason=\"{}\"}} {}",
                c.name(),
                ld(&self.rejections[i])
            );
        }
        header(
            &mut out,
            "gpuplace_binds_total",
            "counter",
            "Bind requests by outcome (bound and repeated are successes).",
        );
        for (i, c) in BindOutcome::ALL.iter().enumerate() {
            let _ = writeln!(out, "gpuplace_binds_total{{result=\"{}\"}} {}", c.name(), ld(&self.binds[i]));
        }
        header(&mut out, "gpuplace_bind_failures_total", "counter", "Bind requests answered with an error.");
        let failed: u64 =
            BindOutcome::ALL.iter().enumerate().filter(|(_, o)| !o.is_success()).map(|(i, _)| ld(&self.binds[i])).sum();
        let _ = writeln!(out, "gpuplace_bind_failures_total {failed}");
        header(
            &mut out,
            "gpuplace_conflicts_total",
            "counter",
            "Records or annotations that disagreed with gpuplace's state, by kind.",
        );
        for (i, c) in ConflictKind::ALL.iter().enumerate() {
            let _ = writeln!(out, "gpuplace_conflicts_total{{kind=\"{}\"}} {}", c.name(), ld(&self.conflicts[i]));
        }
        header(&mut out, "gpuplace_preempt_nodes_total", "counter", "Preemption candidate nodes kept or dropped.");
        let _ = writeln!(out, "gpuplace_preempt_nodes_total{{result=\"kept\"}} {}", ld(&self.preempt_nodes[0]));
        let _ = writeln!(out, "gpuplace_preempt_nodes_total{{result=\"dropped\"}} {}", ld(&self.preempt_nodes[1]));
        header(
            &mut out,
            "gpuplace_preempt_victims_spared_total",
            "counter",
            "Victims proposed by kube-scheduler that preemption did not need.",
        );
        let _ = writeln!(out, "gpuplace_preempt_victims_spared_total {}", ld(&self.preempt_victims_dropped));
        header(
            &mut out,
            "gpuplace_placement_log_errors_total",
            "counter",
            "Placement log lines that could not be written.",
        );
        let _ = writeln!(out, "gpuplace_placement_log_errors_total {}", ld(&self.placement_log_errors));
        header(
            &mut out,
            "gpuplace_mix_observed_total",
            "counter",
            "GPU pods counted into the learned request mix (those before a restart with --mix-state included; 0 with a fixed --mix).",
        );
        let _ = writeln!(out, "gpuplace_mix_observed_total {}", ld(&self.mix_observed));
        self.render_apiserver(&mut out);
        header(
            &mut out,
            "gpuplace_pending_pods",
            "gauge",
            "GPU pods every candidate turned down at their last filter, by what they wait on: preemptable (capacity), unknown_node (nodes without a gpuplace inventory), unresolvable (fits no node), contract (the request is refused). Until bound, deleted, placeable, or not filtered for 6 minutes.",
        );
        let pending = self.pending_pods(Instant::now());
        for c in RejectClass::ALL {
            let _ = writeln!(out, "gpuplace_pending_pods{{reason=\"{}\"}} {}", c.name(), pending[c.index()]);
        }

        let s = ClusterSummary::of(cluster);
        gauge(&mut out, "gpuplace_ready", "1 when the extender answers from a complete state.", u8::from(ready));
        gauge(&mut out, "gpuplace_nodes", "GPU nodes known.", s.nodes);
        gauge(&mut out, "gpuplace_pods_bound", "Pods holding gpuplace GPUs.", bound_pods);
        gauge(
            &mut out,
            "gpuplace_assignments_signed_with_old_key",
            "Counted assignments not signed with the primary key (or unsigned); the leader re-signs them. Remove an old key only at 0.",
            ld(&self.signed_with_old_key),
        );
        let certs = self.client_certs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if !certs.is_empty() {
            header(
                &mut out,
                "gpuplace_client_certificate_expiry_timestamp_seconds",
                "gauge",
                "When the client certificate the verbs last came with expires (Unix seconds), by its subject's common name: kube-scheduler's, the other replica's.",
            );
            for (subject, not_after) in certs {
                let _ = writeln!(
                    out,
                    "gpuplace_client_certificate_expiry_timestamp_seconds{{subject=\"{}\"}} {not_after}",
                    escape(&subject)
                );
            }
        }
        gauge(
            &mut out,
            "gpuplace_accept_unsigned_assignments",
            "1 while --accept-unsigned-assignments is on: assignments without a signature are counted, so anyone who can edit a pod can forge one (migration only).",
            u8::from(self.accept_unsigned.load(Ordering::Relaxed)),
        );
        gauge(
            &mut out,
            "gpuplace_mix_entries",
            "Request types in the mix fragmentation is scored against (0: fragmentation not scored).",
            ld(&self.mix_entries),
        );
        header(
            &mut out,
            "gpuplace_reserve_classes",
            "gauge",
            "Request types whose last free hosts are kept back (learned, and from the node inventory), by whether at most their keep is left (scarce).",
        );
        for (state, n) in [("scarce", &self.reserve_classes[0]), ("plenty", &self.reserve_classes[1])] {
            let _ = writeln!(out, "gpuplace_reserve_classes{{state=\"{state}\"}} {}", ld(n));
        }
        header(
            &mut out,
            "gpuplace_groups",
            "gauge",
            "Groups placed whole, by state: waiting (members to place, no plan possible now), planned (a plan holds GPUs for members not bound yet).",
        );
        for (state, n) in [("waiting", &self.groups[0]), ("planned", &self.groups[1])] {
            let _ = writeln!(out, "gpuplace_groups{{state=\"{state}\"}} {}", ld(n));
        }
        header(
            &mut out,
            "gpuplace_group_reserved_gpus",
            "gauge",
            "GPUs held by group plans for members not bound yet (a share counts its fraction).",
        );
        let _ = writeln!(out, "gpuplace_group_reserved_gpus {}", ld(&self.groups[2]) as f64 / 1000.0);
        header(
            &mut out,
            "gpuplace_group_plan_age_seconds",
            "gauge",
            "Age of the oldest group plan still holding GPUs (0 when none).",
        );
        let _ = writeln!(out, "gpuplace_group_plan_age_seconds {}", ld(&self.groups[3]) as f64 / 1000.0);
        header(
            &mut out,
            "gpuplace_gpus",
            "gauge",
            "GPUs by state: total, idle (healthy, nobody on it), shared (slices), exclusive (whole), unhealthy.",
        );
        for (state, n) in [
            ("total", s.gpus),
            ("idle", s.idle),
            ("shared", s.shared),
            ("exclusive", s.exclusive),
            ("unhealthy", s.unhealthy),
        ] {
            let _ = writeln!(out, "gpuplace_gpus{{state=\"{state}\"}} {n}");
        }
        header(&mut out, "gpuplace_gpu_memory_mib", "gauge", "GPU memory in MiB: total, allocated, free.");
        for (state, n) in [("total", s.mem_total), ("allocated", s.mem_alloc), ("free", s.mem_total - s.mem_alloc)] {
            let _ = writeln!(out, "gpuplace_gpu_memory_mib{{state=\"{state}\"}} {n}");
        }
        header(
            &mut out,
            "gpuplace_gpu_core_percent",
            "gauge",
            "GPU compute in percent of one GPU (100 per GPU): total, allocated, free.",
        );
        for (state, n) in [("total", s.core_total), ("allocated", s.core_alloc), ("free", s.core_total - s.core_alloc)]
        {
            let _ = writeln!(out, "gpuplace_gpu_core_percent{{state=\"{state}\"}} {n}");
        }
        header(
            &mut out,
            "gpuplace_fragmentation_ratio",
            "gauge",
            "Share of free GPU capacity that sits on partly used GPUs, where no whole-GPU request can use it (0..1).",
        );
        let _ = writeln!(out, "gpuplace_fragmentation_ratio {}", s.fragmentation());
        header(
            &mut out,
            "gpuplace_gpu_free_capacity_gpus",
            "gauge",
            "Free GPU capacity in GPUs (a partly used GPU counts its free share): on idle GPUs, and on partly used ones (only the idle part can take whole-GPU requests).",
        );
        for (state, milli) in [("idle", s.free_milli_idle), ("partial", s.free_milli_partial)] {
            let _ = writeln!(out, "gpuplace_gpu_free_capacity_gpus{{state=\"{state}\"}} {}", milli as f64 / 1000.0);
        }
        crate::scheduler::room_gauges::render(&mut out, &Room::of(cluster));
        if self.pod_series.load(Ordering::Relaxed) {
            render_pod_gpus(&mut out, cluster);
        }
        out
    }
}

/// What each pod holds on each GPU: one series per (pod, GPU) held, labelled as the device plugin
/// labels the GPU (`gpu` is its NVML index, `UUID`), so the two join.
fn render_pod_gpus(out: &mut String, cluster: &Cluster) {
    let mut rows = Vec::new();
    for n in cluster.nodes() {
        for pod in n.pods() {
            let (namespace, name) = pod.pod.split_once('/').unwrap_or(("", pod.pod.as_str()));
            for (g, mem_mib, core_pct, exclusive) in pod.holdings() {
                let Some(gpu) = n.gpus.get(g as usize) else { continue };
                let labels = format!(
                    "namespace=\"{}\",pod=\"{}\",node=\"{}\",gpu=\"{}\",UUID=\"{}\"",
                    escape(namespace),
                    escape(name),
                    escape(&n.name),
                    gpu.index,
                    escape(&gpu.uuid)
                );
                // a whole GPU is all taken, as in the cluster totals
                let (mem, core) =
                    if exclusive { (gpu.memory_mib, 100) } else { (mem_mib.min(gpu.memory_mib), core_pct.min(100)) };
                rows.push((labels, mem, core));
            }
        }
    }
    header(
        out,
        "gpuplace_pod_gpu_memory_allocated_mib",
        "gauge",
        "GPU memory gpuplace assigned to a pod on one GPU, in MiB (a whole GPU: its size). Only pods holding GPUs.",
    );
    for (labels, mem, _) in &rows {
        let _ = writeln!(out, "gpuplace_pod_gpu_memory_allocated_mib{{{labels}}} {mem}");
    }
    header(
        out,
        "gpuplace_pod_gpu_core_allocated_percent",
        "gauge",
        "GPU compute gpuplace assigned to a pod on one GPU, in percent of the GPU (a whole GPU: 100). Only pods holding GPUs.",
    );
    for (labels, _, core) in &rows {
        let _ = writeln!(out, "gpuplace_pod_gpu_core_allocated_percent{{{labels}}} {core}");
    }
}

impl Metrics {
    /// API-server mode's families: watch staleness and errors, leadership. Left out in static mode.
    fn render_apiserver(&self, out: &mut String) {
        let now = gpuplace_core::clock::now_unix_ms();
        let started: Vec<Watched> =
            Watched::ALL.into_iter().filter(|&w| self.watch_staleness(w, now).is_some()).collect();
        if !started.is_empty() {
            header(
                out,
                "gpuplace_watch_staleness_seconds",
                "gauge",
                "Seconds since the watch last delivered an event or completed a (re)list (bookmarks are not seen; rises in a quiet cluster too).",
            );
            for &w in &started {
                let s = self.watch_staleness(w, now).unwrap_or_default();
                let _ = writeln!(out, "gpuplace_watch_staleness_seconds{{resource=\"{}\"}} {s}", w.name());
            }
            header(
                out,
                "gpuplace_watch_errors_total",
                "counter",
                "Watch or list errors, by resource (each is retried).",
            );
            for &w in &started {
                let _ =
                    writeln!(out, "gpuplace_watch_errors_total{{resource=\"{}\"}} {}", w.name(), self.watch_errors(w));
            }
        }
        let requeued = [&self.requeued[0], &self.requeued[1]].map(|c| c.load(Ordering::Relaxed));
        if !started.is_empty() || requeued.iter().any(|&n| n > 0) {
            header(
                out,
                "gpuplace_requeued_pods_total",
                "counter",
                "Pending pods sent back to kube-scheduler's queue because GPUs they had just been turned away from were freed.",
            );
            let _ = writeln!(out, "gpuplace_requeued_pods_total{{result=\"annotated\"}} {}", requeued[0]);
            let _ = writeln!(out, "gpuplace_requeued_pods_total{{result=\"failed\"}} {}", requeued[1]);
        }
        let leader = self.leader.load(Ordering::Relaxed);
        if leader >= 0 {
            header(out, "gpuplace_leader", "gauge", "1 while this replica holds the leader Lease.");
            let _ = writeln!(out, "gpuplace_leader {leader}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_core::inventory::Board;

    #[test]
    fn a_pod_waits_on_a_refused_request_then_capacity_then_unknown_nodes() {
        use RejectClass::*;
        // [contract, unknown_node, unresolvable, preemptable]
        assert_eq!(RejectClass::of_pending(&[0, 2, 5, 1]), Some(Preemptable));
        assert_eq!(RejectClass::of_pending(&[0, 2, 5, 0]), Some(UnknownNode));
        assert_eq!(RejectClass::of_pending(&[0, 0, 5, 0]), Some(Unresolvable));
        assert_eq!(RejectClass::of_pending(&[4, 0, 0, 0]), Some(Contract));
        assert_eq!(RejectClass::of_pending(&[0, 0, 0, 0]), None);
    }

    #[test]
    fn pending_pods_count_until_placeable_bound_or_unseen() {
        let m = Metrics::new();
        let t0 = Instant::now();
        m.pod_filtered("a", Some(RejectClass::Preemptable), t0);
        m.pod_filtered("b", Some(RejectClass::Contract), t0);
        m.pod_filtered("c", Some(RejectClass::Preemptable), t0);
        m.pod_filtered("", Some(RejectClass::Preemptable), t0);
        assert_eq!(m.pending_pods(t0), [1, 0, 0, 2]);
        // a later filter moves it to its new class, or out when it fits
        m.pod_filtered("a", Some(RejectClass::Unresolvable), t0);
        m.pod_filtered("c", None, t0);
        assert_eq!(m.pending_pods(t0), [1, 0, 1, 0]);
        m.pod_settled("b");
        assert_eq!(m.pending_pods(t0), [0, 0, 1, 0]);
        // not filtered again within the TTL: gone (deleted unseen, or placed by someone else)
        m.pod_filtered("d", Some(RejectClass::UnknownNode), t0 + PENDING_TTL / 2);
        assert_eq!(m.pending_pods(t0 + PENDING_TTL), [0, 1, 0, 0]);
    }

    #[test]
    fn each_pod_has_a_series_per_gpu_it_holds_and_pending_pods_every_class() {
        let board = Board::Flat { gpus: 4, model: "A100".into(), memory_mib: 40960 }.resolve(Path::new(".")).unwrap();
        let mut c = Cluster::new(vec![board.node("n1", BTreeMap::new(), 0, 0)]);
        let share = |gpu| GpuSlice { gpu, mem_mib: 10240, core_pct: 25, exclusive: false };
        c.allocate(PodAssignment {
            pod: "ml/train".into(),
            node: "n1".into(),
            containers: vec![
                ContainerAssignment { name: "a".into(), init: false, slices: vec![share(0), share(1)] },
                ContainerAssignment { name: "b".into(), init: false, slices: vec![share(1)] },
            ],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        })
        .unwrap();
        c.allocate(PodAssignment {
            pod: "web/infer".into(),
            node: "n1".into(),
            containers: vec![ContainerAssignment {
                name: "c".into(),
                init: false,
                slices: vec![GpuSlice { gpu: 3, mem_mib: 40960, core_pct: 100, exclusive: true }],
            }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        })
        .unwrap();
        let m = Metrics::new();
        m.pod_filtered("p", Some(RejectClass::Preemptable), Instant::now());
        // off by default: no pod's name on the page
        let page = m.render(&c, 2, true);
        assert!(!page.contains("gpuplace_pod_gpu") && !page.contains("train"), "{page}");
        m.set_pod_series(true);
        let page = m.render(&c, 2, true);
        let uuid = |g: usize| c.nodes()[0].gpus[g].uuid.clone();
        let mem: Vec<&str> = page.lines().filter(|l| l.starts_with("gpuplace_pod_gpu_memory_allocated_mib{")).collect();
        assert_eq!(
            mem,
            [
                format!(
                    r#"gpuplace_pod_gpu_memory_allocated_mib{{namespace="ml",pod="train",node="n1",gpu="0",UUID="{}"}} 10240"#,
                    uuid(0)
                ),
                format!(
                    r#"gpuplace_pod_gpu_memory_allocated_mib{{namespace="ml",pod="train",node="n1",gpu="1",UUID="{}"}} 20480"#,
                    uuid(1)
                ),
                format!(
                    r#"gpuplace_pod_gpu_memory_allocated_mib{{namespace="web",pod="infer",node="n1",gpu="3",UUID="{}"}} 40960"#,
                    uuid(3)
                ),
            ]
        );
        assert!(page.contains(&format!(
            r#"gpuplace_pod_gpu_core_allocated_percent{{namespace="ml",pod="train",node="n1",gpu="1",UUID="{}"}} 50"#,
            uuid(1)
        )));
        for (class, n) in [("contract", 0), ("unknown_node", 0), ("unresolvable", 0), ("preemptable", 1)] {
            assert!(page.contains(&format!("gpuplace_pending_pods{{reason=\"{class}\"}} {n}\n")), "{class}");
        }
        // GPU 2 idle; GPUs 0 and 1 three quarters and half free
        assert!(page.contains("gpuplace_gpu_free_capacity_gpus{state=\"idle\"} 1\n"), "{page}");
        assert!(page.contains("gpuplace_gpu_free_capacity_gpus{state=\"partial\"} 1.25\n"), "{page}");
        // one HELP and TYPE per family
        let types: Vec<&str> = page.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let names: std::collections::BTreeSet<&str> = types.iter().map(|l| l.split(' ').nth(2).unwrap()).collect();
        assert_eq!(names.len(), types.len());
    }
}
