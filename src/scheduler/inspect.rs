//! What `/inspect` and `gpuplace inspect` show: per node and per GPU, allocated against total memory
//! and compute, the pods on each GPU, and live utilization. JSON for tools, a table for people.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::scheduler::mix::MixReport;
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::isolation::IsolationMode;
use gpuplace_core::room::Room;
use gpuplace_core::summary::ClusterSummary;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReport {
    pub ready: bool,
    pub generated_unix_ms: i64,
    pub summary: ClusterSummary,
    /// The room node-sized pods and jobs of them have (`core::room`).
    #[serde(default)]
    pub room: Room,
    pub nodes: Vec<NodeReport>,
    /// The request mix fragmentation is scored against (a running extender's; none for a cluster
    /// file).
    #[serde(default)]
    pub mix: Option<MixReport>,
    /// Groups placed whole: members, plan and reserved GPUs (a running extender's; none for a
    /// cluster file).
    #[serde(default)]
    pub groups: Vec<crate::scheduler::groups::GroupReport>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Pods holding GPUs here.
    pub pods: usize,
    /// The isolation mode its device plugin published (`None`: none, so advisory).
    #[serde(default)]
    pub isolation: Option<IsolationMode>,
    pub gpus: Vec<GpuReport>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuReport {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub healthy: bool,
    pub memory_mib: u64,
    pub allocated_mib: u64,
    /// Compute allocated, percent of this GPU.
    pub allocated_percent: u32,
    pub exclusive: bool,
    /// Device-plugin slots its containers hold, and how many the GPU has (`None`: not limited).
    #[serde(default)]
    pub slots_used: u32,
    #[serde(default)]
    pub slots: Option<u32>,
    pub holders: Vec<Holder>,
    pub utilization: Option<Utilization>,
}

/// One container's slice of a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub pod: String,
    pub container: String,
    pub init: bool,
    pub memory_mib: u64,
    pub core_percent: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Utilization {
    pub sm_percent: u32,
    pub memory_used_mib: u64,
    pub at_unix_ms: i64,
}

impl InspectReport {
    /// The report for every node, or for `only` (None when that node is unknown).
    pub fn build(cluster: &Cluster, only: Option<&str>, ready: bool, now_unix_ms: i64) -> Option<Self> {
        let nodes: Vec<NodeReport> = match only {
            Some(name) => vec![node_report(cluster.node(name)?)],
            None => cluster.nodes().iter().map(node_report).collect(),
        };
        Some(Self {
            ready,
            generated_unix_ms: now_unix_ms,
            summary: ClusterSummary::of(cluster),
            room: Room::of(cluster),
            nodes,
            mix: None,
            groups: Vec::new(),
        })
    }

    /// A table per node, one line per GPU.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let s = &self.summary;
        let _ = writeln!(
            out,
            "{} node(s), {} GPU(s): {} idle, {} shared, {} exclusive, {} unhealthy; memory {} of {} MiB allocated, compute {}% of {}%; fragmentation {:.2}{}",
            s.nodes,
            s.gpus,
            s.idle,
            s.shared,
            s.exclusive,
            s.unhealthy,
            s.mem_alloc,
            s.mem_total,
            s.core_alloc,
            s.core_total,
            s.fragmentation(),
            if self.ready { "" } else { " (NOT READY)" }
        );
        let _ = writeln!(out, "{}", self.room.summary());
        if let Some(mix) = &self.mix {
            let _ = writeln!(out, "{}", mix.summary());
        }
        for g in &self.groups {
            let reserved: f64 = g.reserved.iter().map(|r| r.gpu_share).sum();
            let state = match (&g.domain, &g.waiting) {
                (Some(d), _) => format!(
                    "planned in {d} {:.0} s ago, {reserved:.2} GPU(s) reserved on {}",
                    g.plan_age_s.unwrap_or(0.0),
                    g.reserved.iter().map(|r| r.node.as_str()).collect::<Vec<_>>().join(",")
                ),
                (None, Some(w)) => format!("waiting: {w}"),
                (None, None) => "no reservation".into(),
            };
            let _ = writeln!(
                out,
                "group {}{}: {} of {} bound, {} seen; {state}",
                g.group,
                if g.gang { " (PodGroup)" } else { "" },
                g.members_bound,
                g.size,
                g.members_seen
            );
        }
        for n in &self.nodes {
            let net: Vec<String> = n
                .labels
                .iter()
                .filter(|(k, _)| k.starts_with("network.gpuplace.io/"))
                .map(|(k, v)| format!("{}={v}", k.trim_start_matches("network.gpuplace.io/")))
                .collect();
            let model = n.gpus.first().map_or("", |g| g.model.as_str());
            let _ = writeln!(
                out,
                "\nNODE {}  {} x {}  {}  {} pod(s)  isolation {}",
                n.name,
                n.gpus.len(),
                model,
                if net.is_empty() { String::new() } else { format!("[{}]", net.join(" ")) },
                n.pods,
                n.isolation.map_or("advisory (none published)", IsolationMode::name)
            );
            let _ = writeln!(
                out,
                "{:<4} {:<14} {:>24} {:>13} {:>11}  PODS",
                "GPU", "UUID", "MEMORY MiB (alloc/total)", "COMPUTE %", "UTIL SM/MEM"
            );
            for g in &n.gpus {
                let mem_pct = (g.allocated_mib * 100).checked_div(g.memory_mib).unwrap_or(0);
                let util = match &g.utilization {
                    Some(u) => format!("{}%/{}Mi", u.sm_percent, u.memory_used_mib),
                    None => "-".into(),
                };
                let mut pods: Vec<String> = g
                    .holders
                    .iter()
                    .map(|h| {
                        let c = if h.init { format!("init:{}", h.container) } else { h.container.clone() };
                        format!("{}[{c}] {}Mi/{}%", h.pod, h.memory_mib, h.core_percent)
                    })
                    .collect();
                if pods.is_empty() {
                    pods.push("-".into());
                }
                let mut flags = String::new();
                if g.exclusive {
                    flags.push_str(" whole");
                }
                if let Some(k) = g.slots.filter(|&k| g.slots_used >= k) {
                    let _ = write!(flags, " slots-full({k})");
                }
                if !g.healthy {
                    flags.push_str(" UNHEALTHY");
                }
                let _ = writeln!(
                    out,
                    "{:<4} {:<14} {:>24} {:>13} {:>11}  {}{flags}",
                    g.index,
                    short_uuid(&g.uuid),
                    format!("{}/{} ({mem_pct}%)", g.allocated_mib, g.memory_mib),
                    format!("{}/100", g.allocated_percent),
                    util,
                    pods.join(", ")
                );
            }
        }
        out
    }
}

fn short_uuid(u: &str) -> String {
    if u.len() > 14 {
        format!("{}..", &u[..u.char_indices().nth(12).map_or(u.len(), |(i, _)| i)])
    } else {
        u.to_string()
    }
}

fn node_report(n: &Node) -> NodeReport {
    let mut holders: Vec<Vec<Holder>> = vec![Vec::new(); n.gpus.len()];
    for p in n.pods() {
        for c in &p.containers {
            for s in &c.slices {
                if let Some(h) = holders.get_mut(s.gpu as usize) {
                    h.push(Holder {
                        pod: p.pod.clone(),
                        container: c.name.clone(),
                        init: c.init,
                        memory_mib: s.mem_mib,
                        core_percent: s.core_pct,
                    });
                }
            }
        }
    }
    let gpus = n
        .gpus
        .iter()
        .enumerate()
        .zip(holders)
        .map(|((i, g), holders)| {
            let u = n.usage(i);
            GpuReport {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                healthy: g.healthy,
                memory_mib: g.memory_mib,
                allocated_mib: if u.exclusive { g.memory_mib } else { u.mem_mib },
                allocated_percent: if u.exclusive { 100 } else { u.core_pct },
                exclusive: u.exclusive,
                slots_used: u.slots,
                slots: n.slots_per_gpu,
                holders,
                utilization: n.utilization(i).map(|s| Utilization {
                    sm_percent: s.sm_pct,
                    memory_used_mib: s.mem_used_mib,
                    at_unix_ms: s.at_unix_ms,
                }),
            }
        })
        .collect();
    NodeReport { name: n.name.clone(), labels: n.labels.clone(), pods: n.pods().count(), isolation: n.isolation, gpus }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplace_core::inventory::Board;

    #[test]
    fn each_nodes_isolation_mode_is_in_the_table_and_the_json() {
        let board = Board::Flat { gpus: 2, model: "T4".into(), memory_mib: 15109 }.resolve(".".as_ref()).unwrap();
        let cluster = Cluster::new(vec![
            board.node("guarded", BTreeMap::new(), 0, 0).with_isolation(Some(IsolationMode::Guard)),
            board.node("older", BTreeMap::new(), 0, 0),
        ]);
        let report = InspectReport::build(&cluster, None, true, 0).unwrap();
        let table = report.table();
        assert!(table.contains("NODE guarded  2 x T4    0 pod(s)  isolation guard"), "{table}");
        assert!(table.contains("NODE older  2 x T4    0 pod(s)  isolation advisory (none published)"), "{table}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["nodes"][0]["isolation"], "guard");
        assert!(json["nodes"][1]["isolation"].is_null());
        let back: InspectReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, report);
    }
}
