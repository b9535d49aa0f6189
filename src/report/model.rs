//! What the report shows, worked out from the inputs: capacity over time, pods turned away, per-node
//! allocation (from a placement log), and the policies' curves (from `simulate --json`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::placement_log::read::LogLine;
use crate::placement_log::{Decision, ModelCapacity, Requests};
use crate::sim::figures::PolicyReport;
use gpuplace_core::resources::{GpuDemand, MemoryDemand};
use gpuplace_core::room::Room;

/// One point of the capacity charts: the cluster right after a bind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacitySample {
    pub ts_unix_ms: i64,
    pub gpus: f64,
    pub allocated: f64,
    pub fragmented: f64,
    pub idle: f64,
}

impl CapacitySample {
    /// Share of free capacity that is free only as fractions of GPUs, in percent (0 when nothing is
    /// free).
    pub fn fragmentation_pct(&self) -> f64 {
        let free = self.fragmented + self.idle;
        if free <= 0.0 {
            0.0
        } else {
            100.0 * self.fragmented / free
        }
    }
}

/// One point of the groups chart: every group's totals right after a `group` line or a group
/// member's bind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupSample {
    pub ts_unix_ms: i64,
    /// Groups with members to place and no plan.
    pub waiting: usize,
    /// GPUs held by plans for members not bound yet.
    pub reserved_gpus: f64,
}

/// One point of the room charts: the room jobs had right after a bind (whole nodes and switches,
/// the largest job of node-sized pods, idle GPUs stranded).
#[derive(Debug, Clone, PartialEq)]
pub struct RoomSample {
    pub ts_unix_ms: i64,
    pub room: Room,
}

/// A node's allocation as the binds to it showed it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeTrack {
    pub model: String,
    pub gpus: u32,
    /// (time, allocated GPUs) after each bind to it, in log order.
    pub points: Vec<(i64, f64)>,
}

/// Pods turned away, for one category (a reason class or a request shape).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TurnedAway {
    /// Not bound by the end of the log.
    pub pending: usize,
    /// Bound after being turned away.
    pub bound_later: usize,
}

impl TurnedAway {
    pub fn total(&self) -> usize {
        self.pending + self.bound_later
    }
}

/// Latency of one verb, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    /// Calls: lines, and the filter calls their `repeats` counted.
    pub count: usize,
    /// Lines written (p50 and p99 are of these alone: a `repeats` summary keeps no percentiles).
    pub lines: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    /// Mean and max of every call, repeats included.
    pub mean_us: u64,
    pub max_us: u64,
}

/// Latencies of one verb as read.
#[derive(Default)]
struct LatencyAcc {
    lines: Vec<u64>,
    calls: usize,
    sum: u64,
    max: u64,
}

impl LatencyAcc {
    fn add(&mut self, calls: usize, sum: u64, max: u64) {
        self.calls += calls;
        self.sum = self.sum.saturating_add(sum);
        self.max = self.max.max(max);
    }
}

/// Everything the report reads from placement logs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogModel {
    pub files: Vec<PathBuf>,
    pub lines: usize,
    /// The first and last call (a line's, or the first and last of its `repeats`).
    pub first_ts_unix_ms: i64,
    pub last_ts_unix_ms: i64,
    /// Calls per verb: lines, and for `filter` the calls counted in `repeats` (on filter and bind
    /// lines), so that a log written with and without `--placement-log-every-call` agree.
    pub verbs: BTreeMap<String, usize>,
    /// Bind lines by outcome.
    pub bind_outcomes: BTreeMap<String, usize>,
    /// Distinct pods (UIDs) bound (outcome `bound`).
    pub pods_bound: usize,
    /// Bind lines that carry a cluster summary (the capacity charts' points).
    pub samples: Vec<CapacitySample>,
    /// Bind lines that carry the room jobs had (logs written since issue 30; empty before).
    pub rooms: Vec<RoomSample>,
    /// Per GPU model, from the last cluster summary.
    pub models: BTreeMap<String, ModelCapacity>,
    pub nodes: BTreeMap<String, NodeTrack>,
    /// Distinct pods turned away at least once (a filter found no node, or the contract refused the
    /// request, or a bind failed), by the class of the last time.
    pub by_class: BTreeMap<String, TurnedAway>,
    /// The same pods by request shape.
    pub by_shape: BTreeMap<String, TurnedAway>,
    pub latency: BTreeMap<String, Latency>,
    /// Groups waiting and GPUs reserved over time (placement logs written since groups are placed
    /// whole; empty before, or with no group).
    pub groups: Vec<GroupSample>,
    /// `group` lines by event (`planned`, `no_plan`, `expired`, …).
    pub group_events: BTreeMap<String, usize>,
}

/// The reason class of a filter that found no node: the class most nodes gave (ties: the first by
/// name), `contract` when the request itself was refused, `no_candidates` when none were offered.
pub fn class_of(d: &Decision) -> String {
    if d.refused.is_some() {
        return "contract".into();
    }
    d.main_rejection_class().unwrap_or("no_candidates").to_string()
}

/// A request's shape as a short label: `4 GPU`, `1 × 30% GPU`, `1 × 30% GPU, 20480 MiB`; several
/// containers are joined with ` + `.
pub fn shape_of(r: Option<&Requests>) -> String {
    let Some(r) = r else { return "invalid request".into() };
    let parts: Vec<String> = r
        .containers
        .iter()
        .map(|c| match c.demand {
            GpuDemand::Whole { gpus } => format!("{gpus} GPU"),
            GpuDemand::Shared { gpus, memory: MemoryDemand::ProportionalToCore, core_pct } => {
                format!("{gpus} × {core_pct}% GPU")
            }
            GpuDemand::Shared { gpus, memory: MemoryDemand::Mib(m), core_pct } => {
                format!("{gpus} × {core_pct}% GPU, {m} MiB")
            }
        })
        .collect();
    if parts.is_empty() {
        "no GPU".into()
    } else {
        parts.join(" + ")
    }
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn is_bind_success(outcome: Option<&str>) -> bool {
    matches!(outcome, Some("bound" | "repeated"))
}

impl LogModel {
    /// Builds the model from the files' lines, in the order given (a rotated `PATH.1` first).
    pub fn build(files: Vec<(PathBuf, Vec<LogLine>)>) -> Self {
        let mut m = LogModel { first_ts_unix_ms: i64::MAX, last_ts_unix_ms: i64::MIN, ..Self::default() };
        let mut latencies: BTreeMap<String, LatencyAcc> = BTreeMap::new();
        let mut bound: BTreeSet<String> = BTreeSet::new();
        // pod UID → (class, shape) of its last turn-away, and whether a bind succeeded after it
        let mut turned: BTreeMap<String, (String, String, bool)> = BTreeMap::new();
        for (path, lines) in files {
            m.files.push(path);
            for LogLine { decision: d, .. } in lines {
                m.lines += 1;
                m.first_ts_unix_ms = m.first_ts_unix_ms.min(d.ts_unix_ms);
                m.last_ts_unix_ms = m.last_ts_unix_ms.max(d.ts_unix_ms);
                *m.verbs.entry(d.verb.clone()).or_default() += 1;
                // a group event (a plan made or given up) is not a call kube-scheduler timed
                if d.group_event.is_none() {
                    let acc = latencies.entry(d.verb.clone()).or_default();
                    acc.lines.push(d.latency_us);
                    acc.add(1, d.latency_us, d.latency_us);
                }
                if let Some(r) = d.repeats.filter(|r| r.count > 0) {
                    // filter calls that repeated the pod's verdict, counted instead of written
                    m.first_ts_unix_ms = m.first_ts_unix_ms.min(r.first_ts_unix_ms);
                    m.last_ts_unix_ms = m.last_ts_unix_ms.max(r.last_ts_unix_ms);
                    let calls = usize::try_from(r.count).unwrap_or(usize::MAX);
                    *m.verbs.entry("filter".into()).or_default() += calls;
                    latencies.entry("filter".into()).or_default().add(calls, r.latency_us_sum, r.latency_us_max);
                }
                let key = if d.uid.is_empty() { d.pod.clone() } else { d.uid.clone() };
                let totals = d.group_event.as_ref().and_then(|e| e.totals).or(d.group_totals);
                if let Some(t) = totals {
                    m.groups.push(GroupSample {
                        ts_unix_ms: d.ts_unix_ms,
                        waiting: t.waiting,
                        reserved_gpus: t.reserved_gpus,
                    });
                }
                if let Some(e) = &d.group_event {
                    *m.group_events.entry(e.event.clone()).or_default() += 1;
                }
                match d.verb.as_str() {
                    "filter" if d.feasible == 0 => {
                        turned.insert(key, (class_of(&d), shape_of(d.requests.as_ref()), false));
                    }
                    "bind" => {
                        let outcome = d.outcome.as_deref();
                        *m.bind_outcomes.entry(outcome.unwrap_or("none").to_string()).or_default() += 1;
                        if outcome == Some("bound") {
                            bound.insert(key.clone());
                        }
                        if is_bind_success(outcome) {
                            if let Some(t) = turned.get_mut(&key) {
                                t.2 = true;
                            }
                        } else {
                            turned.insert(key, ("bind_failed".into(), shape_of(d.requests.as_ref()), false));
                        }
                        if let Some(c) = &d.cluster {
                            m.samples.push(CapacitySample {
                                ts_unix_ms: d.ts_unix_ms,
                                gpus: f64::from(c.gpus),
                                allocated: c.allocated_gpus,
                                fragmented: c.fragmented_gpus,
                                idle: f64::from(c.idle_gpus),
                            });
                            m.models = c.by_model.clone();
                            if let Some(room) = &c.room {
                                m.rooms.push(RoomSample { ts_unix_ms: d.ts_unix_ms, room: room.clone() });
                            }
                            if let Some(n) = &c.node {
                                let t = m.nodes.entry(n.name.clone()).or_default();
                                t.model = n.model.clone();
                                t.gpus = n.gpus;
                                t.points.push((d.ts_unix_ms, n.allocated_gpus));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        m.pods_bound = bound.len();
        for (class, shape, later) in turned.into_values() {
            for entry in [m.by_class.entry(class).or_default(), m.by_shape.entry(shape).or_default()] {
                if later {
                    entry.bound_later += 1;
                } else {
                    entry.pending += 1;
                }
            }
        }
        for (verb, mut acc) in latencies {
            acc.lines.sort_unstable();
            let lat = Latency {
                count: acc.calls,
                lines: acc.lines.len(),
                p50_us: percentile(&acc.lines, 0.5),
                p99_us: percentile(&acc.lines, 0.99),
                mean_us: acc.sum / acc.calls.max(1) as u64,
                max_us: acc.max,
            };
            m.latency.insert(verb, lat);
        }
        if m.lines == 0 {
            m.first_ts_unix_ms = 0;
            m.last_ts_unix_ms = 0;
        }
        m
    }

    /// Pods turned away at least once.
    pub fn turned_away(&self) -> TurnedAway {
        self.by_class.values().fold(TurnedAway::default(), |a, t| TurnedAway {
            pending: a.pending + t.pending,
            bound_later: a.bound_later + t.bound_later,
        })
    }

    /// The sample with the most GPUs allocated.
    pub fn peak(&self) -> Option<&CapacitySample> {
        self.samples.iter().max_by(|a, b| a.allocated.total_cmp(&b.allocated))
    }
}

/// Everything the report reads from `simulate --json` files.
#[derive(Debug, Clone, Default)]
pub struct SimModel {
    pub files: Vec<PathBuf>,
    pub policies: Vec<PolicyReport>,
}

impl SimModel {
    pub fn build(files: Vec<(PathBuf, Vec<PolicyReport>)>) -> Self {
        let mut m = SimModel::default();
        for (path, reports) in files {
            m.files.push(path);
            m.policies.extend(reports);
        }
        m
    }

    /// A policy's name in charts and tables: with the workload when the inputs hold several.
    pub fn label(&self, r: &PolicyReport) -> String {
        let workloads: BTreeSet<&str> = self.policies.iter().map(|p| p.workload.as_str()).collect();
        if workloads.len() > 1 {
            format!("{} ({})", r.policy, r.workload)
        } else {
            r.policy.clone()
        }
    }

    /// The arrived-workload columns (percent) any policy reached, ascending.
    pub fn columns(&self) -> Vec<u32> {
        let set: BTreeSet<u32> =
            self.policies.iter().flat_map(|p| p.unallocated_gpu_pct.keys().filter_map(|k| k.parse().ok())).collect();
        set.into_iter().collect()
    }
}

/// A policy's curve: (arrived %, unallocated %) in column order.
pub fn curve(r: &PolicyReport) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> =
        r.unallocated_gpu_pct.iter().filter_map(|(k, v)| k.parse::<f64>().ok().map(|x| (x, *v))).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement_log::{CapacitySummary, NodeCapacity};
    use gpuplace_core::resources::ContainerDemand;

    fn line(d: Decision) -> LogLine {
        LogLine { line: 0, decision: d }
    }

    fn whole(n: u32) -> Option<Requests> {
        Some(Requests {
            containers: vec![ContainerDemand { name: "main".into(), demand: GpuDemand::Whole { gpus: n } }],
            ..Requests::default()
        })
    }

    fn filter(uid: &str, feasible: usize, classes: &[(&str, usize)]) -> Decision {
        Decision {
            v: 1,
            verb: "filter".into(),
            uid: uid.into(),
            requests: whole(4),
            feasible,
            rejection_classes: classes.iter().map(|(c, n)| (c.to_string(), *n)).collect(),
            ..Decision::default()
        }
    }

    fn bind(uid: &str, outcome: &str, ts: i64, allocated: f64) -> Decision {
        Decision {
            v: 1,
            verb: "bind".into(),
            uid: uid.into(),
            ts_unix_ms: ts,
            requests: whole(4),
            outcome: Some(outcome.into()),
            cluster: Some(CapacitySummary {
                nodes: 2,
                gpus: 16,
                allocated_gpus: allocated,
                idle_gpus: 16 - allocated.ceil() as u32,
                fragmented_gpus: allocated.ceil() - allocated,
                node: Some(NodeCapacity {
                    name: "n1".into(),
                    model: "H100".into(),
                    gpus: 8,
                    allocated_gpus: allocated,
                }),
                ..CapacitySummary::default()
            }),
            ..Decision::default()
        }
    }

    #[test]
    fn turned_away_pods_are_counted_once_by_their_last_reason() {
        let lines = vec![
            line(filter("a", 0, &[("preemptable", 2), ("unresolvable", 1)])),
            line(filter("a", 0, &[("unresolvable", 3)])),
            line(filter("b", 0, &[("preemptable", 3)])),
            line(filter("c", 2, &[])),
            line(bind("c", "bound", 10, 4.0)),
            line(bind("b", "bound", 20, 8.5)),
            line(bind("d", "no_fit", 30, 8.5)),
            line(Decision { refused: Some("bad".into()), requests: None, ..filter("e", 0, &[]) }),
        ];
        let m = LogModel::build(vec![(PathBuf::from("p"), lines)]);
        assert_eq!(m.lines, 8);
        assert_eq!(m.pods_bound, 2);
        assert_eq!(m.by_class["unresolvable"], TurnedAway { pending: 1, bound_later: 0 });
        assert_eq!(m.by_class["preemptable"], TurnedAway { pending: 0, bound_later: 1 });
        assert_eq!(m.by_class["bind_failed"], TurnedAway { pending: 1, bound_later: 0 });
        assert_eq!(m.by_class["contract"], TurnedAway { pending: 1, bound_later: 0 });
        assert_eq!(m.by_shape["4 GPU"], TurnedAway { pending: 2, bound_later: 1 });
        assert_eq!(m.by_shape["invalid request"].total(), 1);
        assert_eq!(m.turned_away().total(), 4);
        assert_eq!(m.samples.len(), 3);
        assert_eq!(m.peak().map(|s| s.allocated), Some(8.5));
        assert_eq!(m.nodes["n1"].points, [(10, 4.0), (20, 8.5), (30, 8.5)]);
        assert_eq!(m.bind_outcomes["no_fit"], 1);
        assert_eq!((m.first_ts_unix_ms, m.last_ts_unix_ms), (0, 30));
        // a group event is not a timed call: it makes no latency row (it showed 0 / 0 µs)
        let event = crate::placement_log::GroupEvent {
            group: "ns/job".into(),
            event: "planned".into(),
            domain: None,
            nodes: Vec::new(),
            reason: None,
            totals: None,
        };
        let group = Decision { v: 1, verb: "group".into(), group_event: Some(event), ..Decision::default() };
        let m = LogModel::build(vec![(PathBuf::from("p"), vec![line(filter("a", 1, &[])), line(group)])]);
        assert_eq!(m.latency.keys().collect::<Vec<_>>(), ["filter"]);
        assert_eq!(m.verbs["group"], 1);
    }

    /// A log as `--placement-log-every-call` writes it: pods retried by kube-scheduler (runs of the
    /// same verdict, now and then a new one), binds of every outcome with the cluster after them,
    /// prioritize and group lines, and pods still waiting at the end.
    fn full_log(seed: u64) -> Vec<Decision> {
        let mut next = crate::placement_log::compactor::draws(seed);
        let mut out = Vec::new();
        let mut ts = 1_700_000_000_000;
        let mut allocated = 0.0;
        // each pod's current verdict, which a retry mostly repeats
        let mut verdicts = [0u64; 12];
        for _ in 0..600 {
            ts += next(5_000) as i64;
            let pod = next(12) as usize;
            let uid = format!("p{pod}");
            if next(8) == 0 {
                verdicts[pod] = next(10);
            }
            let latency_us = 30 + next(900);
            let d = match next(40) {
                0 => {
                    allocated = (allocated + 0.5f64).min(16.0);
                    let outcome = ["bound", "bound", "no_fit", "conflict"][next(4) as usize];
                    bind(&uid, outcome, ts, allocated)
                }
                1 => Decision { verb: "prioritize".into(), ..filter(&uid, 2, &[]) },
                2 => Decision {
                    v: 1,
                    verb: "group".into(),
                    group_event: Some(crate::placement_log::GroupEvent {
                        event: "no_plan".into(),
                        ..Default::default()
                    }),
                    ..Decision::default()
                },
                _ => match verdicts[pod] {
                    0..=5 => filter(&uid, 0, &[("preemptable", 3), ("unresolvable", 1)]),
                    6 | 7 => filter(&uid, 0, &[("unresolvable", 4)]),
                    8 => Decision { refused: Some("bad".into()), requests: None, ..filter(&uid, 0, &[]) },
                    _ => filter(&uid, 2, &[("preemptable", 2)]),
                },
            };
            out.push(Decision { ts_unix_ms: ts, latency_us, ..d });
        }
        out
    }

    #[test]
    fn a_log_and_its_compaction_give_the_same_figures() {
        use crate::placement_log::compactor::{CompactOptions, Compactor};
        for seed in 1..=20 {
            let full = full_log(seed);
            let mut c = Compactor::new(CompactOptions::default());
            let mut compact: Vec<Decision> = full.iter().cloned().flat_map(|d| c.push(d)).collect();
            compact.extend(c.finish());
            assert!(compact.len() * 2 < full.len(), "seed {seed}: {} of {} lines", compact.len(), full.len());
            assert!(compact.iter().any(|d| d.verb == "bind" && d.repeats.is_some()), "seed {seed}");
            let model = |lines: &[Decision]| {
                LogModel::build(vec![(PathBuf::from("p"), lines.iter().cloned().map(line).collect())])
            };
            let (a, mut b) = (model(&full), model(&compact));
            assert_eq!(a.verbs["filter"], full.iter().filter(|d| d.verb == "filter").count(), "calls, not lines");
            assert!(b.lines < a.lines);
            // what a summary cannot keep: the lines, and percentiles of every call
            b.lines = a.lines;
            for (verb, l) in &mut b.latency {
                let full = a.latency[verb];
                assert_eq!(
                    (l.count, l.mean_us, l.max_us),
                    (full.count, full.mean_us, full.max_us),
                    "seed {seed} {verb}"
                );
                (l.lines, l.p50_us, l.p99_us) = (full.lines, full.p50_us, full.p99_us);
            }
            assert_eq!(a, b, "seed {seed}");
            // simulate --from-placement-log reads the same pods, in the same order, bound alike
            let w = |lines: &[Decision]| crate::sim::replay::workload(lines.iter().cloned(), 81559);
            assert_eq!(w(&full), w(&compact), "seed {seed}");
        }
    }

    #[test]
    fn fragmentation_is_a_share_of_free_capacity() {
        let s = CapacitySample { ts_unix_ms: 0, gpus: 8.0, allocated: 4.5, fragmented: 0.5, idle: 3.0 };
        assert!((s.fragmentation_pct() - 100.0 / 7.0).abs() < 1e-9);
        let full = CapacitySample { allocated: 8.0, fragmented: 0.0, idle: 0.0, ..s };
        assert_eq!(full.fragmentation_pct(), 0.0);
    }

    #[test]
    fn shapes_read_like_requests() {
        assert_eq!(shape_of(whole(8).as_ref()), "8 GPU");
        let shared = Requests {
            containers: vec![
                ContainerDemand {
                    name: "a".into(),
                    demand: GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(20480), core_pct: 30 },
                },
                ContainerDemand {
                    name: "b".into(),
                    demand: GpuDemand::Shared { gpus: 2, memory: MemoryDemand::ProportionalToCore, core_pct: 50 },
                },
            ],
            ..Requests::default()
        };
        assert_eq!(shape_of(Some(&shared)), "1 × 30% GPU, 20480 MiB + 2 × 50% GPU");
        assert_eq!(shape_of(Some(&Requests::default())), "no GPU");
        assert_eq!(shape_of(None), "invalid request");
    }
}
