//! Aggregating seeds into the figures `gpuplace simulate` prints.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::sim::run::SeedResult;

/// Columns shown in the table and JSON (arrived workload, % of GPU capacity).
pub const REPORT_COLUMNS: [usize; 12] = [75, 80, 85, 90, 95, 100, 105, 110, 115, 120, 125, 130];

/// One policy's results over all seeds: the JSON object `--json` prints (and `gpuplace report`
/// reads, refusing fields it does not know).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyReport {
    pub policy: String,
    pub workload: String,
    /// How the pods arrived (`sim::arrivals`): `shuffled` is the paper's protocol.
    #[serde(default = "shuffled", skip_serializing_if = "is_shuffled")]
    pub arrival: String,
    /// The nodes' boards (`sim::state::Boards`): `flat` is the paper's protocol.
    #[serde(default = "flat", skip_serializing_if = "is_flat")]
    pub boards: String,
    pub seeds: Vec<u64>,
    /// Mean over seeds of the unallocated GPU share (%) by arrived-workload column ("75".."130"),
    /// only for columns the arrivals reached; written in numeric column order.
    #[serde(serialize_with = "columns_in_numeric_order")]
    pub unallocated_gpu_pct: BTreeMap<String, f64>,
    /// Mean fragment rate (% of idle GPU capacity that is fragmented) at 80 % arrived workload;
    /// NaN (`null` in JSON) when the arrivals never reached 80 %.
    #[serde(deserialize_with = "nan_when_null")]
    pub frag_rate_pct_at_80: f64,
    /// Where each seed first turned a pod away (arrived workload, % of GPU capacity; `null`: never),
    /// and the mean over the seeds that did.
    #[serde(default)]
    pub first_refusal_pct_per_seed: Vec<Option<f64>>,
    #[serde(default)]
    pub first_refusal_pct: Option<f64>,
    /// Mean over seeds of the pods turned away while 75 to 100 % of the capacity had arrived.
    #[serde(default)]
    pub refused_75_to_100: f64,
    /// Mean over seeds of pods that could not be placed.
    pub failed_pods: f64,
    pub failed_pods_per_seed: Vec<usize>,
    pub pods_per_seed: f64,
    /// Wall time of all seeds of this policy (run in parallel).
    pub wall_s: f64,
    /// Pods placed or refused per second of single-core time.
    pub pods_per_s: f64,
    /// The paper's mean unallocated GPU % at 100 % arrival, where `fgd-paper-results/` has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paper_unallocated_gpu_pct_at_100: Option<f64>,
    /// How the workload's groups ended (`gangs=P` workloads only), means over seeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<GroupsReport>,
    /// How the jobs fared (groups and pods of two or more GPUs), means over seeds; none without jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs: Option<JobsReport>,
}

fn shuffled() -> String {
    crate::sim::arrivals::Arrival::Shuffled.name().to_string()
}

fn is_shuffled(a: &str) -> bool {
    a == crate::sim::arrivals::Arrival::Shuffled.name()
}

fn flat() -> String {
    crate::sim::state::Boards::Flat.name().to_string()
}

fn is_flat(b: &str) -> bool {
    b == crate::sim::state::Boards::Flat.name()
}

/// Jobs' figures of one policy (groups, and pods of two or more GPUs), means over seeds. The replay
/// has no retries: a job turned away waits for good.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobsReport {
    pub jobs: f64,
    /// Jobs not started whole.
    pub waited: f64,
    /// Jobs not started whole although the cluster had as many idle GPUs as they needed when they
    /// arrived: room held in pieces.
    pub waited_with_room: f64,
    /// GPUs holding shares on nodes that hold nothing but shares, mean over job arrivals.
    pub share_gpus_alone_at_job_arrival: f64,
}

impl JobsReport {
    /// `None` when the replay had no jobs.
    fn of(results: &[SeedResult]) -> Option<Self> {
        if results.iter().all(|r| r.jobs.jobs == 0) {
            return None;
        }
        let m = |f: fn(&crate::sim::run::JobOutcome) -> f64| round2(mean(results.iter().map(|r| f(&r.jobs))));
        let arrivals: usize = results.iter().map(|r| r.jobs.jobs).sum();
        let held: f64 = results.iter().map(|r| r.jobs.share_gpus_alone_sum).sum();
        Some(Self {
            jobs: m(|o| o.jobs as f64),
            waited: m(|o| o.waited as f64),
            waited_with_room: m(|o| o.waited_with_room as f64),
            share_gpus_alone_at_job_arrival: round2(held / arrivals.max(1) as f64),
        })
    }
}

/// Groups' figures of one policy, means over seeds. The replay has no departures, so GPUs held by a
/// partly placed group are held to the end of the replay: wasted, since the job cannot start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupsReport {
    pub groups: f64,
    /// Groups with every member placed.
    pub started_whole: f64,
    /// Groups with some members placed, not all.
    pub partial: f64,
    /// GPUs held by the placed members of partial groups.
    pub gpus_held_by_incomplete_groups: f64,
    /// Leaf switches spanned per whole group: mean, and the largest over all seeds.
    pub tors_per_group_mean: f64,
    pub tors_per_group_max: usize,
}

/// The map's own order is by string ("100" before "75"); readers of the JSON expect 75..130.
fn columns_in_numeric_order<S: Serializer>(m: &BTreeMap<String, f64>, s: S) -> Result<S::Ok, S::Error> {
    let mut entries: Vec<(&String, &f64)> = m.iter().collect();
    entries.sort_by_key(|(k, _)| (k.parse::<u64>().unwrap_or(u64::MAX), k.as_str()));
    s.collect_map(entries)
}

/// `null` (no figure) reads back as NaN, as it was before it was written.
fn nan_when_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

impl PolicyReport {
    pub fn new(policy: &str, workload: &str, results: &[SeedResult], wall_s: f64) -> Self {
        Self::with_columns(policy, workload, results, wall_s, &REPORT_COLUMNS)
    }

    /// With unallocated GPU % at `columns` (arrived workload, % of capacity, at most
    /// [`MAX_COLUMN`](crate::sim::run::MAX_COLUMN)) instead of the paper's.
    pub fn with_columns(policy: &str, workload: &str, results: &[SeedResult], wall_s: f64, columns: &[usize]) -> Self {
        let mut unallocated = BTreeMap::new();
        for &k in columns {
            let m = mean(results.iter().filter_map(|r| r.allocated_pct.get(k).copied().flatten()).map(|a| 100.0 - a));
            if m.is_finite() {
                unallocated.insert(k.to_string(), round2(m));
            }
        }
        let pods: usize = results.iter().map(|r| r.pods).sum();
        let cpu_s: f64 = results.iter().map(|r| r.wall_s).sum();
        Self {
            policy: policy.to_string(),
            workload: workload.to_string(),
            arrival: shuffled(),
            boards: flat(),
            seeds: results.iter().map(|r| r.seed).collect(),
            unallocated_gpu_pct: unallocated,
            frag_rate_pct_at_80: round2(mean(results.iter().filter_map(|r| r.frag_rate_pct[80]))),
            first_refusal_pct_per_seed: results.iter().map(|r| r.first_refusal_pct.map(round2)).collect(),
            first_refusal_pct: {
                let m = mean(results.iter().filter_map(|r| r.first_refusal_pct));
                m.is_finite().then(|| round2(m))
            },
            refused_75_to_100: round2(mean(results.iter().map(|r| r.refused_75_to_100 as f64))),
            failed_pods: mean(results.iter().map(|r| r.failed_pods as f64)),
            failed_pods_per_seed: results.iter().map(|r| r.failed_pods).collect(),
            pods_per_seed: mean(results.iter().map(|r| r.pods as f64)),
            wall_s,
            pods_per_s: if cpu_s > 0.0 { (pods as f64 / cpu_s).round() } else { 0.0 },
            paper_unallocated_gpu_pct_at_100: None,
            groups: GroupsReport::of(results),
            jobs: JobsReport::of(results),
        }
    }
}

impl GroupsReport {
    /// `None` when the replay had no groups.
    fn of(results: &[SeedResult]) -> Option<Self> {
        if results.iter().all(|r| r.groups.groups == 0) {
            return None;
        }
        let g = |f: fn(&crate::sim::run::GroupOutcome) -> f64| round2(mean(results.iter().map(|r| f(&r.groups))));
        let whole: usize = results.iter().map(|r| r.groups.whole).sum();
        let spanned: usize = results.iter().map(|r| r.groups.tors_spanned_sum).sum();
        Some(Self {
            groups: g(|o| o.groups as f64),
            started_whole: g(|o| o.whole as f64),
            partial: g(|o| o.partial as f64),
            gpus_held_by_incomplete_groups: g(|o| o.gpus_held_by_incomplete),
            tors_per_group_mean: if whole == 0 { 0.0 } else { round2(spanned as f64 / whole as f64) },
            tors_per_group_max: results.iter().map(|r| r.groups.tors_spanned_max).max().unwrap_or(0),
        })
    }
}

/// The results table.
pub fn table(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let cols = [75usize, 90, 100, 110, 130];
    out.push_str("Unallocated GPU % by arrived workload (% of cluster GPU capacity), mean over seeds");
    if let Some(r) = reports.iter().find(|r| !is_shuffled(&r.arrival)) {
        out.push_str(&format!("; arrival order {}", r.arrival));
    }
    if let Some(r) = reports.iter().find(|r| !is_flat(&r.boards)) {
        out.push_str(&format!("; boards {} (what-if)", r.boards));
    }
    out.push('\n');
    // wide enough for the what-if's label and generated workload names
    let pw = reports.iter().map(|r| r.policy.len()).chain([11]).max().unwrap_or(11);
    let ww = reports.iter().map(|r| r.workload.len()).chain([9]).max().unwrap_or(9);
    out.push_str(&format!("{:<pw$} {:<ww$}", "policy", "workload"));
    for c in cols {
        out.push_str(&format!(" {:>6}", format!("@{c}")));
    }
    out.push_str(&format!(
        " {:>7} {:>9} {:>9} {:>10} {:>8} {:>7} {:>9}\n",
        "paper", "frag@80", "1st out@", "out 75-100", "failed", "wall_s", "pods/s"
    ));
    for r in reports {
        out.push_str(&format!("{:<pw$} {:<ww$}", r.policy, r.workload));
        for c in cols {
            match r.unallocated_gpu_pct.get(&c.to_string()) {
                Some(v) => out.push_str(&format!(" {v:>6.2}")),
                None => out.push_str(&format!(" {:>6}", "-")),
            }
        }
        let paper = r.paper_unallocated_gpu_pct_at_100.map_or("-".to_string(), |p| format!("{p:.2}"));
        // no figure at 80 % (the arrivals stopped short of it): a dash, as for the columns
        let frag =
            if r.frag_rate_pct_at_80.is_finite() { format!("{:.2}", r.frag_rate_pct_at_80) } else { "-".to_string() };
        // the mean over the seeds that turned a pod away, with how many did where not all
        let refused = r.first_refusal_pct_per_seed.iter().filter(|f| f.is_some()).count();
        let first = match r.first_refusal_pct {
            None => "-".to_string(),
            Some(f) if refused < r.first_refusal_pct_per_seed.len() => {
                format!("{f:.1}({refused}/{})", r.first_refusal_pct_per_seed.len())
            }
            Some(f) => format!("{f:.1}"),
        };
        out.push_str(&format!(
            " {paper:>7} {frag:>9} {first:>9} {:>10.1} {:>8.1} {:>7.2} {:>9.0}\n",
            r.refused_75_to_100, r.failed_pods, r.wall_s, r.pods_per_s
        ));
    }
    if reports.iter().any(|r| r.groups.is_some()) {
        out.push_str("\nGroups (pods that must start together), mean over seeds\n");
        out.push_str(&format!(
            "{:<pw$} {:>8} {:>13} {:>8} {:>22} {:>14} {:>13}\n",
            "policy", "groups", "started whole", "partial", "GPUs held by partial", "ToRs/group", "max ToRs"
        ));
        for r in reports {
            let Some(g) = &r.groups else { continue };
            out.push_str(&format!(
                "{:<pw$} {:>8.1} {:>13.1} {:>8.1} {:>22.2} {:>14.2} {:>13}\n",
                r.policy,
                g.groups,
                g.started_whole,
                g.partial,
                g.gpus_held_by_incomplete_groups,
                g.tors_per_group_mean,
                g.tors_per_group_max
            ));
        }
    }
    if reports.iter().any(|r| r.jobs.is_some()) {
        out.push_str("\nJobs (groups and pods of 2 GPUs or more), mean over seeds\n");
        out.push_str(&format!(
            "{:<pw$} {:>8} {:>8} {:>17} {:>30}\n",
            "policy", "jobs", "waited", "waited with room", "share-only GPUs at job arrival"
        ));
        for r in reports {
            let Some(j) = &r.jobs else { continue };
            out.push_str(&format!(
                "{:<pw$} {:>8.1} {:>8.1} {:>17.1} {:>30.2}\n",
                r.policy, j.jobs, j.waited, j.waited_with_room, j.share_gpus_alone_at_job_arrival
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(columns: &[usize], frag: f64) -> PolicyReport {
        PolicyReport {
            policy: "fgd".into(),
            workload: "default".into(),
            arrival: shuffled(),
            boards: flat(),
            seeds: vec![1],
            unallocated_gpu_pct: columns.iter().map(|c| (c.to_string(), 1.5)).collect(),
            frag_rate_pct_at_80: frag,
            first_refusal_pct_per_seed: vec![None],
            first_refusal_pct: None,
            refused_75_to_100: 0.0,
            failed_pods: 0.0,
            failed_pods_per_seed: vec![0],
            pods_per_seed: 10.0,
            wall_s: 0.1,
            pods_per_s: 100.0,
            paper_unallocated_gpu_pct_at_100: None,
            groups: None,
            jobs: None,
        }
    }

    #[test]
    fn the_first_refusal_and_the_refusals_from_75_to_100_are_columns() {
        let mut never = report(&[75, 100], 10.0);
        never.policy = "never".into();
        let mut some = report(&[75, 100], 10.0);
        some.policy = "some".into();
        some.first_refusal_pct_per_seed = vec![Some(88.0), None];
        some.first_refusal_pct = Some(88.0);
        some.refused_75_to_100 = 12.5;
        let t = table(&[never, some]);
        let header = t.lines().nth(1).unwrap();
        assert!(header.contains("1st out@") && header.contains("out 75-100"), "{t}");
        let line = |p: &str| t.lines().find(|l| l.starts_with(p)).unwrap().split_whitespace().collect::<Vec<_>>();
        // policy workload @75 @90 @100 @110 @130 paper frag@80 1st-out out-75-100 failed ...
        assert_eq!(line("never")[9..11], ["-", "0.0"], "{t}");
        assert_eq!(line("some")[9..11], ["88.0(1/2)", "12.5"], "{t}");
    }

    #[test]
    fn json_columns_in_numeric_order() {
        let json = serde_json::to_string(&report(&REPORT_COLUMNS, 3.0)).unwrap();
        let at: Vec<usize> = REPORT_COLUMNS.iter().map(|c| json.find(&format!("\"{c}\":")).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{json}");
        assert!(!json.contains("paper_unallocated"), "absent paper figure is left out: {json}");
    }

    #[test]
    fn json_reads_back() {
        for r in [report(&REPORT_COLUMNS, 3.0), report(&[], f64::NAN)] {
            let json = serde_json::to_string(&r).unwrap();
            let back: PolicyReport = serde_json::from_str(&json).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), json);
        }
        let extra = serde_json::to_string(&report(&[], 1.0)).unwrap().replacen('{', "{\"nope\":1,", 1);
        assert!(serde_json::from_str::<PolicyReport>(&extra).unwrap_err().to_string().contains("nope"));
    }

    #[test]
    fn missing_figures_are_null_in_json_and_dashes_in_the_table() {
        let r = report(&[], f64::NAN);
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert!(v["frag_rate_pct_at_80"].is_null());
        let t = table(&[r]);
        assert!(!t.contains("NaN"), "{t}");
        let row = t.lines().last().unwrap();
        assert_eq!(
            row.split_whitespace().filter(|w| *w == "-").count(),
            8,
            "5 columns, paper, frag, first refusal: {row}"
        );
    }
}
