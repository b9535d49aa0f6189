//! `simulate --from-placement-log`: the pods a real placement log bound, replayed in the log's order
//! on a cluster file under several policies, so a planner can ask what another policy, or a cluster
//! with more nodes, would have done with the same pods.
//!
//! What the log does not hold, the replay cannot know: pods never leave (the log records binds, not
//! departures), host CPU and memory do not limit placement (the log records GPU requests only), and
//! pods may use any GPU model (the log does not record model constraints).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use crate::placement_log::read::{read_placement_log, InputError};
use crate::placement_log::Decision;
use crate::sim::figures::PolicyReport;
use crate::sim::trace::UNLIMITED;
use crate::sim::trace::{TraceNode, TracePod};
use crate::sim::{protocol, run, SimConfig};
use gpuplace_core::cluster::Cluster;
use gpuplace_core::inventory::{load_cluster, InventoryError};
use gpuplace_core::resources::GpuDemand;

/// Arrived-workload columns of a replay: every percent, since a log's pods may fill a few percent
/// of a large cluster or more than all of a small one.
pub const REPLAY_COLUMNS: std::ops::RangeInclusive<usize> = 1..=run::MAX_COLUMN;

/// Why a replay could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("placement log {0}")]
    Log(#[from] InputError),
    #[error("cluster file: {0}")]
    Cluster(#[from] InventoryError),
    #[error("cluster file {path}: node {node} has {gpus} GPUs; the simulator takes at most 64 a node")]
    TooManyGpus { path: String, node: String, gpus: usize },
    #[error("cluster file {path}: no GPU node in it")]
    NoGpus { path: String },
    #[error("placement log {path}: no pod in it asks for GPUs, so there is nothing to replay{skipped}")]
    NoPods { path: String, skipped: String },
}

/// The pods of a placement log, in the order they first appeared, and those left out (why → how
/// many pods).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogWorkload {
    pub pods: Vec<TracePod>,
    /// Of `pods`, how many the log shows bound (the others were still waiting when it ended).
    pub bound: usize,
    pub skipped: BTreeMap<&'static str, usize>,
}

/// A pod as the simulator's pod: whole GPUs, or one GPU request with a share of each GPU (the larger
/// of its compute and memory fractions on a GPU of `gpu_memory_mib`). Init containers are left out
/// (they finish before the pod runs).
pub fn trace_pod(d: &Decision, gpu_memory_mib: u64) -> Result<TracePod, &'static str> {
    let Some(r) = &d.requests else { return Err("no request recorded") };
    let (num_gpu, gpu_milli) = match r.containers.as_slice() {
        [] => return Err("asks for no GPU"),
        [one] => match one.demand {
            GpuDemand::Whole { gpus } => (gpus, 1000),
            shared => (shared.gpus(), shared.milli_on(gpu_memory_mib)),
        },
        several if several.iter().all(|c| c.demand.is_whole()) => (several.iter().map(|c| c.demand.gpus()).sum(), 1000),
        _ => return Err("several GPU containers, some sharing (the simulator's pods have one GPU request)"),
    };
    if num_gpu == 0 || gpu_milli == 0 {
        return Err("asks for no GPU");
    }
    Ok(TracePod {
        name: d.pod.clone(),
        cpu_milli: 0,
        memory_mib: 0,
        num_gpu,
        gpu_milli,
        gpu_spec: String::new(),
        group: None,
    })
}

/// Every pod that asked for GPUs in `decisions` (filter and bind lines), once, in the order it first
/// appeared: those bound and those still waiting at the end of the log, which are demand too.
pub fn workload(decisions: impl IntoIterator<Item = Decision>, gpu_memory_mib: u64) -> LogWorkload {
    let mut w = LogWorkload::default();
    let mut seen: HashMap<String, Option<usize>> = HashMap::new();
    let mut bound: HashSet<String> = HashSet::new();
    for d in decisions {
        if d.verb != "filter" && d.verb != "bind" {
            continue;
        }
        let key = if d.uid.is_empty() { d.pod.clone() } else { d.uid.clone() };
        if d.outcome.as_deref() == Some("bound") {
            bound.insert(key.clone());
        }
        if seen.contains_key(&key) {
            continue;
        }
        if d.requests.is_none() {
            // refused by the contract: never placeable, so not demand; unknown at a bind: a later
            // line may still tell
            if d.refused.is_some() {
                seen.insert(key, None);
                *w.skipped.entry("refused by the resource contract").or_default() += 1;
            }
            continue;
        }
        match trace_pod(&d, gpu_memory_mib) {
            Ok(p) => {
                seen.insert(key, Some(w.pods.len()));
                w.pods.push(p);
            }
            Err(why) => {
                seen.insert(key, None);
                *w.skipped.entry(why).or_default() += 1;
            }
        }
    }
    w.bound = bound.iter().filter(|k| matches!(seen.get(*k), Some(Some(_)))).count();
    w
}

/// The simulator's nodes from a cluster file's model. A node that does not track host CPU or memory
/// (0) gets unlimited; the GPU model is the node's first GPU's.
pub fn nodes_of(cluster: &Cluster, path: &Path) -> Result<Vec<TraceNode>, ReplayError> {
    let mut out = Vec::new();
    for n in cluster.nodes().iter().filter(|n| !n.gpus.is_empty()) {
        if n.gpus.len() > 64 {
            return Err(ReplayError::TooManyGpus {
                path: path.display().to_string(),
                node: n.name.clone(),
                gpus: n.gpus.len(),
            });
        }
        out.push(TraceNode {
            name: n.name.clone(),
            cpu_milli: if n.cpu_milli == 0 { UNLIMITED } else { n.cpu_milli },
            memory_mib: if n.memory_mib == 0 { UNLIMITED } else { n.memory_mib },
            gpu: n.gpus.len() as u32,
            model: n.gpus[0].model.clone(),
            // the simulator's boards are flat or NVSwitch: an NVLink board counts as the latter
            nvswitch: crate::placement::whole_units::built_for_jobs(n),
        });
    }
    if out.is_empty() {
        return Err(ReplayError::NoGpus { path: path.display().to_string() });
    }
    Ok(out)
}

/// The largest GPU memory in the cluster: a share that asks for memory counts against it.
pub fn largest_gpu_memory(cluster: &Cluster) -> u64 {
    cluster.nodes().iter().flat_map(|n| n.gpus.iter().map(|g| g.memory_mib)).max().unwrap_or(0)
}

/// Replays `pods` in their order on `nodes` under each policy and seed of `cfg` (its workload, tune
/// and offline reference do not apply: the order and size are the log's). Seeds only change random
/// choices (the `random` policy's, and ties some policies break at random).
pub fn replay(nodes: &[TraceNode], pods: &[TracePod], workload: &str, cfg: &SimConfig) -> Vec<PolicyReport> {
    let mut nodes = nodes.to_vec();
    crate::sim::apply_host_limits(&mut nodes, cfg);
    let mix = protocol::typical_mix(pods);
    let columns: Vec<usize> = REPLAY_COLUMNS.collect();
    crate::sim::run_policies(cfg, |kind, setup, seed| run::run_in_order(&nodes, pods, &mix, kind, setup, seed))
        .into_iter()
        .map(|p| PolicyReport::with_columns(p.name, workload, &p.results, p.wall_s, &columns))
        .collect()
}

/// A replay's results and what it replayed.
#[derive(Debug, Clone)]
pub struct Replayed {
    pub reports: Vec<PolicyReport>,
    pub workload: LogWorkload,
    pub capacity_gpus: u32,
}

impl Replayed {
    /// What `simulate --from-placement-log` prints: what was replayed, and the table.
    pub fn summary(&self, log: &Path, cluster: &Path) -> String {
        let w = &self.workload;
        let mut out = format!("placement log: {} replayed on {}\n", log.display(), cluster.display());
        out.push_str(&format!(
            "{} pods in the order they first appeared: {} bound in the log, {} still waiting when it ended\n",
            w.pods.len(),
            w.bound,
            w.pods.len() - w.bound
        ));
        if !w.skipped.is_empty() {
            let why: Vec<String> = w.skipped.iter().map(|(why, n)| format!("{n} {why}")).collect();
            out.push_str(&format!("left out: {}\n", why.join(", ")));
        }
        out.push_str(&table(&self.reports, w.pods.len(), self.capacity_gpus));
        out
    }
}

/// Reads the placement log and the cluster file and replays the log's pods under `cfg`'s policies
/// and seeds. The results' workload is `placement-log:FILE NAME`.
pub fn replay_log(log: &Path, cluster_file: &Path, cfg: &SimConfig) -> Result<Replayed, ReplayError> {
    let cluster = load_cluster(cluster_file)?;
    let nodes = nodes_of(&cluster, cluster_file)?;
    let lines = read_placement_log(log)?;
    let workload = workload(lines.into_iter().map(|l| l.decision), largest_gpu_memory(&cluster));
    if workload.pods.is_empty() {
        let skipped = if workload.skipped.is_empty() {
            String::new()
        } else {
            let why: Vec<String> = workload.skipped.iter().map(|(w, n)| format!("{n} {w}")).collect();
            format!(" (left out: {})", why.join(", "))
        };
        return Err(ReplayError::NoPods { path: log.display().to_string(), skipped });
    }
    let name = log.file_name().map_or_else(|| log.display().to_string(), |n| n.to_string_lossy().into_owned());
    let reports = replay(&nodes, &workload.pods, &format!("placement-log:{name}"), cfg);
    Ok(Replayed { reports, workload, capacity_gpus: nodes.iter().map(|n| n.gpu).sum() })
}

/// The replay's table: what each policy placed, and what it left unallocated at the last column the
/// arrivals reached.
pub fn table(reports: &[PolicyReport], pods: usize, capacity_gpus: u32) -> String {
    let mut out = String::new();
    let pw = reports.iter().map(|r| r.policy.len()).chain([6]).max().unwrap_or(6);
    let last = |r: &PolicyReport| {
        r.unallocated_gpu_pct.iter().filter_map(|(k, v)| k.parse::<u32>().ok().map(|k| (k, *v))).max_by_key(|(k, _)| *k)
    };
    out.push_str(&format!(
        "{pods} pods on {capacity_gpus} GPUs; unallocated GPU % at the last arrived workload reached (% of capacity, at most 130), mean over seeds\n"
    ));
    out.push_str(&format!(
        "{:<pw$} {:>8} {:>8} {:>12} {:>12}\n",
        "policy", "placed", "failed", "arrived %", "unallocated"
    ));
    for r in reports {
        let (arrived, unalloc) = match last(r) {
            Some((k, v)) => (k.to_string(), format!("{v:.2}")),
            None => ("-".into(), "-".into()),
        };
        out.push_str(&format!(
            "{:<pw$} {:>8.1} {:>8.1} {arrived:>12} {unalloc:>12}\n",
            r.policy,
            r.pods_per_seed - r.failed_pods,
            r.failed_pods
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement_log::Requests;
    use crate::sim::policies::PolicyKind;
    use gpuplace_core::resources::{ContainerDemand, MemoryDemand};

    fn bind(pod: &str, outcome: &str, demands: &[GpuDemand]) -> Decision {
        Decision {
            v: 1,
            verb: "bind".into(),
            pod: pod.into(),
            uid: format!("uid-{pod}"),
            outcome: Some(outcome.into()),
            requests: Some(Requests {
                containers: demands
                    .iter()
                    .enumerate()
                    .map(|(i, d)| ContainerDemand { name: format!("c{i}"), demand: *d })
                    .collect(),
                ..Requests::default()
            }),
            ..Decision::default()
        }
    }

    #[test]
    fn pods_become_simulator_pods_in_order_of_first_appearance() {
        let share = GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(40_000), core_pct: 30 };
        let filter = |pod: &str, demands: &[GpuDemand]| Decision {
            verb: "filter".into(),
            outcome: None,
            ..bind(pod, "", demands)
        };
        let refused = Decision { requests: None, refused: Some("bad".into()), ..filter("ns/r", &[]) };
        let w = workload(
            [
                filter("ns/pending", &[GpuDemand::Whole { gpus: 8 }]),
                filter("ns/a", &[GpuDemand::Whole { gpus: 4 }]),
                refused.clone(),
                refused,
                bind("ns/a", "bound", &[GpuDemand::Whole { gpus: 4 }]),
                bind("ns/a", "repeated", &[GpuDemand::Whole { gpus: 4 }]),
                bind("ns/c", "bound", &[share]),
                bind("ns/d", "bound", &[GpuDemand::Whole { gpus: 1 }, GpuDemand::Whole { gpus: 2 }]),
                bind("ns/e", "bound", &[GpuDemand::Whole { gpus: 1 }, share]),
                bind("ns/f", "bound", &[]),
                filter("ns/f", &[]),
            ],
            80_000,
        );
        let got: Vec<(&str, u32, u32)> = w.pods.iter().map(|p| (p.name.as_str(), p.num_gpu, p.gpu_milli)).collect();
        // c: 40 000 of 80 000 MiB is half the GPU, more than its 30 % of compute
        assert_eq!(got, [("ns/pending", 8, 1000), ("ns/a", 4, 1000), ("ns/c", 1, 500), ("ns/d", 3, 1000)]);
        assert_eq!(w.bound, 3);
        assert_eq!(w.skipped.values().sum::<usize>(), 3, "{:?}", w.skipped);
        assert_eq!(w.skipped["refused by the resource contract"], 1);
    }

    #[test]
    fn replay_places_in_log_order_and_counts_what_does_not_fit() {
        let nodes = vec![TraceNode {
            name: "n0".into(),
            cpu_milli: UNLIMITED,
            memory_mib: UNLIMITED,
            gpu: 8,
            model: "H100".into(),
            nvswitch: false,
        }];
        let pods: Vec<TracePod> = (0..3)
            .map(|i| TracePod {
                name: format!("p{i}"),
                cpu_milli: 0,
                memory_mib: 0,
                num_gpu: 4,
                gpu_milli: 1000,
                gpu_spec: String::new(),
                group: None,
            })
            .collect();
        let cfg = SimConfig {
            workload: String::new(),
            policies: vec![PolicyKind::BestFit, PolicyKind::Fgd],
            seeds: vec![1, 2],
            tune: 1.0,
            profile: Default::default(),
            mix_source: Default::default(),
            offline_reference: false,
            arrival: Default::default(),
            boards: Default::default(),
            unlimited_host: false,
        };
        let reports = replay(&nodes, &pods, "placement-log:p", &cfg);
        assert_eq!(reports.len(), 2);
        for r in &reports {
            assert_eq!(r.failed_pods, 1.0, "{}: the third 4-GPU pod does not fit on 8 GPUs", r.policy);
            assert_eq!(r.pods_per_seed, 3.0);
            // 12 GPUs arrived on 8: the 150 % column is past the last one reported
            assert_eq!(r.unallocated_gpu_pct.get("100"), Some(&0.0), "{:?}", r.unallocated_gpu_pct);
            assert_eq!(r.unallocated_gpu_pct.get("50"), Some(&50.0));
            // turned away when 12 of 8 GPUs had arrived, past the 75-100 % stretch
            assert_eq!(r.first_refusal_pct, Some(150.0));
            assert_eq!(r.first_refusal_pct_per_seed, vec![Some(150.0), Some(150.0)]);
            assert_eq!(r.refused_75_to_100, 0.0);
        }
        let t = table(&reports, 3, 8);
        assert!(t.lines().any(|l| l.starts_with("bestfit") && l.contains("2.0") && l.contains("1.0")), "{t}");
    }
}
