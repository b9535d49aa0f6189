//! The placement log: one JSON object per line for every filter, prioritize, bind and preempt
//! decision, for capacity planners (docs/placement-log.md is the schema they read).
//!
//! This file holds the line's schema ([`Decision`] and what it carries); [`writer`] writes lines
//! (to stdout or a file that rotates by size), [`compact`] folds a pending pod's repeated filter
//! verdicts into counts, and [`read`] reads a log back.

pub mod capacity;
pub mod compactor;
pub mod read;
pub mod writer;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use gpuplace_core::resources::ContainerDemand;
use gpuplace_core::room::Room;

/// Schema version of a line (`"v"`); bumped on incompatible changes, fields may be added.
pub const PLACEMENT_LOG_VERSION: u32 = 1;

/// One decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub v: u32,
    /// When the answer was sent, Unix milliseconds.
    pub ts_unix_ms: i64,
    /// `filter`, `prioritize`, `bind` or `preempt`.
    pub verb: String,
    /// `namespace/name`.
    pub pod: String,
    pub uid: String,
    /// `names` (nodeCacheCapable) or `nodes` (full Node objects); null for bind and preempt.
    pub mode: Option<String>,
    /// The pod's GPU containers as the contract reads them; null when the request was refused.
    pub requests: Option<Requests>,
    /// Why the resource contract refused the pod (it then fits nowhere).
    pub refused: Option<String>,
    /// Nodes offered (filter, prioritize, preempt) or 1 (bind).
    pub candidates: usize,
    /// Nodes where the pod fits (filter, prioritize), or preempt nodes kept.
    pub feasible: usize,
    /// Exact rejection reason → how many nodes gave it.
    pub rejections: BTreeMap<String, usize>,
    /// Reason class (`contract`, `unknown_node`, `unresolvable`, `preemptable`) → nodes.
    pub rejection_classes: BTreeMap<String, usize>,
    /// Node → its own figures behind the reason it was given (which `rejections` leaves out, so that
    /// nodes group): filter, for the first 32 rejected candidates in the order sent; bind, for the
    /// chosen node when the pod no longer fits there.
    #[serde(default)]
    pub rejection_details: BTreeMap<String, String>,
    /// The best nodes, best first (at most 5), with each scorer's share of the total.
    pub top: Vec<TopScore>,
    /// Bind: where the pod went and on which GPUs.
    pub chosen: Option<Chosen>,
    /// Bind: `bound`, `repeated`, `unknown_pod`, `refused`, `unknown_node`, `no_fit`, `conflict`,
    /// `binder_failed`. Preempt: null.
    pub outcome: Option<String>,
    /// The error answered to kube-scheduler, if any.
    pub error: Option<String>,
    /// From the request's arrival to the answer (bind: including the Binding), microseconds.
    pub latency_us: u64,
    /// Bind: the cluster's GPUs right after it, for reports (absent on lines written before it was
    /// added, read as null).
    #[serde(default)]
    pub cluster: Option<CapacitySummary>,
    /// Present (true) only on a line that was cut to [`MAX_LINE_BYTES`]: `rejection_details` emptied
    /// and `rejections` kept to its first [`TRUNCATED_REJECTIONS`] reasons.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// The pod's group (`namespace/name`), for members of one; on `group` lines, the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Filter of a group member with a plan: the node its slot is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_node: Option<String>,
    /// `group` lines: what happened to the group (planned, no_plan, expired, replanned, bound, deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_event: Option<GroupEvent>,
    /// Bind of a group member: every group's totals right after it (groups waiting, GPUs reserved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_totals: Option<GroupTotals>,
    /// Filter calls of this pod since its previous filter line that gave the same verdict as that
    /// line and were not written (see [`compact`]); on a filter or bind line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<Repeats>,
    /// Filter: how many of the `feasible` nodes the answer named, when it named fewer (the best,
    /// for kube-scheduler to score: `serve --nodes-to-score`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered: Option<usize>,
}

/// The longest line written: a request that would make a longer one (thousands of distinct
/// reasons) gets a cut line instead, so no line outgrows the file's rotation size.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Reasons kept on a cut line.
pub const TRUNCATED_REJECTIONS: usize = 100;

impl Decision {
    /// The class most rejected nodes gave (ties: the first by name); none when no node was
    /// rejected. What `gpuplace report` files a pod turned away under.
    pub fn main_rejection_class(&self) -> Option<&str> {
        self.rejection_classes.iter().max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0))).map(|(c, _)| c.as_str())
    }

    /// The line cut to what fits [`MAX_LINE_BYTES`] (the per-node details and all but the first
    /// reasons go; the counts by class stay whole).
    fn cut(&self) -> Decision {
        let mut d = self.clone();
        d.rejection_details.clear();
        d.rejections = std::mem::take(&mut d.rejections).into_iter().take(TRUNCATED_REJECTIONS).collect();
        for text in [&mut d.refused, &mut d.error] {
            if let Some(t) = text.as_mut().filter(|t| t.len() > 4096) {
                let mut end = 4096;
                while !t.is_char_boundary(end) {
                    end -= 1;
                }
                t.truncate(end);
            }
        }
        d.truncated = true;
        d
    }
}

/// Every field a line may carry, for readers that refuse what they do not know.
pub const FIELDS: [&str; 26] = [
    "v",
    "ts_unix_ms",
    "verb",
    "pod",
    "uid",
    "mode",
    "requests",
    "refused",
    "candidates",
    "feasible",
    "rejections",
    "rejection_classes",
    "rejection_details",
    "top",
    "chosen",
    "outcome",
    "error",
    "latency_us",
    "cluster",
    "truncated",
    "group",
    "planned_node",
    "group_event",
    "group_totals",
    "repeats",
    "offered",
];

/// The pod's GPU containers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Requests {
    pub containers: Vec<ContainerDemand>,
    pub init_containers: Vec<ContainerDemand>,
    pub group: Option<String>,
}

/// One node's score.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TopScore {
    pub node: String,
    /// What kube-scheduler gets, 0..=10.
    pub score: i64,
    /// Weighted mean of the scorers, 0..=1.
    pub total: f64,
    /// Scorer → its weighted contribution to `total` (the parts add up to `total`).
    pub parts: BTreeMap<String, f64>,
}

/// A bind's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Chosen {
    pub node: String,
    pub bind_seq: u64,
    pub gpus: Vec<ChosenGpu>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChosenGpu {
    pub container: String,
    pub init: bool,
    pub index: u32,
    pub uuid: String,
    pub memory_mib: u64,
    pub core_percent: u32,
    pub exclusive: bool,
}

/// The cluster's GPUs right after a bind (bind lines only), so that a report can chart capacity,
/// fragmentation and per-node allocation over time without a copy of the cluster. Releases between
/// two binds show in the next bind's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CapacitySummary {
    pub nodes: usize,
    pub gpus: u32,
    /// GPU-equivalents held: a whole GPU counts 1, a share its fraction (the larger of its compute
    /// and memory fractions).
    pub allocated_gpus: f64,
    /// Healthy GPUs that nobody holds.
    pub idle_gpus: u32,
    /// Free share left on healthy GPUs that are partly held: capacity free only as fractions.
    pub fragmented_gpus: f64,
    pub unhealthy_gpus: u32,
    /// The same figures per GPU model.
    pub by_model: BTreeMap<String, ModelCapacity>,
    /// The bind's node after the bind; null when it is not in the model.
    pub node: Option<NodeCapacity>,
    /// The room jobs have after the bind: whole nodes, whole switches, the largest job of node-sized
    /// pods under one switch, idle GPUs stranded (`core::room`). Absent in logs written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<Room>,
}

/// One GPU model's figures in a [`CapacitySummary`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelCapacity {
    pub gpus: u32,
    pub allocated_gpus: f64,
    pub idle_gpus: u32,
    pub fragmented_gpus: f64,
}

/// One node's figures in a [`CapacitySummary`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeCapacity {
    pub name: String,
    /// The model of its first GPU (empty for a node without GPUs).
    pub model: String,
    pub gpus: u32,
    pub allocated_gpus: f64,
}

/// The room jobs have goes on a bind line at most this often: working it out reads every node's
/// network labels, and at 1,000 nodes it was a fifth of the extender's CPU per pod when written on
/// every bind (docs/performance-journal.md, "The extender's CPU per pod at 1,000 nodes").
pub const ROOM_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Thousandths of a GPU as GPUs.
fn gpus_of_milli(milli: u64) -> f64 {
    milli as f64 / 1000.0
}

/// What happened to a group, for the placement log and the debug log.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GroupEvent {
    pub group: String,
    /// `planned`, `no_plan`, `expired`, `replanned` (a planned node left or changed), `bound`
    /// (every slot bound), `deleted` (every member gone).
    pub event: String,
    /// The plan's domain (`tor tor-2`), for `planned`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Node of each slot, for `planned`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Every group's totals right after the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub totals: Option<GroupTotals>,
}

/// Groups waiting (members to place, no plan) and GPUs reserved, cluster-wide: on the placement
/// log's `group` lines and group members' bind lines, for `gpuplace report`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct GroupTotals {
    pub waiting: usize,
    pub reserved_gpus: f64,
}

/// Filter calls not written because they gave the same verdict as the pod's previous filter line.
/// Carried by the pod's next written line (a filter whose verdict changed, a re-statement, the
/// pod's bind, or the last held call itself when the pod is gone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repeats {
    /// Filter calls counted here and not written.
    pub count: u64,
    /// When the first and the last of them answered, Unix milliseconds.
    pub first_ts_unix_ms: i64,
    pub last_ts_unix_ms: i64,
    /// Their largest and their summed `latency_us`.
    pub latency_us_max: u64,
    pub latency_us_sum: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_summary_counts_shares_as_fractions() {
        use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/clusters/fixture-cluster.yaml");
        let mut cluster = gpuplace_core::inventory::load_cluster(&path).unwrap();
        let slice = |gpu, mem_mib, core_pct, exclusive| GpuSlice { gpu, mem_mib, core_pct, exclusive };
        let pod = |name: &str, slices| PodAssignment {
            pod: name.into(),
            node: "gpu-node-1".into(),
            containers: vec![ContainerAssignment { name: "main".into(), init: false, slices }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        };
        cluster.allocate(pod("ns/whole", vec![slice(0, 81559, 100, true), slice(1, 81559, 100, true)])).unwrap();
        // 30 % of the compute and 20480 of 81559 MiB: 30 % of the GPU
        cluster.allocate(pod("ns/share", vec![slice(2, 20480, 30, false)])).unwrap();
        let s = CapacitySummary::of(&cluster, "gpu-node-1");
        assert_eq!((s.nodes, s.gpus, s.idle_gpus, s.unhealthy_gpus), (4, 32, 29, 0));
        assert_eq!((s.allocated_gpus, s.fragmented_gpus), (2.3, 0.7));
        let node = s.node.as_ref().unwrap();
        assert_eq!((node.name.as_str(), node.gpus, node.allocated_gpus), ("gpu-node-1", 8, 2.3));
        assert_eq!(node.model, "NVIDIA H100 80GB HBM3");
        let m = &s.by_model["NVIDIA H100 80GB HBM3"];
        assert_eq!((m.gpus, m.allocated_gpus, m.idle_gpus, m.fragmented_gpus), (32, 2.3, 29, 0.7));
        assert!(CapacitySummary::of(&cluster, "elsewhere").node.is_none());

        // a node with two models: each model gets its own GPUs, and the totals all of them
        let mut nodes = cluster.nodes().to_vec();
        for g in nodes[0].gpus.iter_mut().skip(4) {
            g.model = "L40S".into();
        }
        let name = nodes[0].name.clone();
        let mixed = CapacitySummary::of(&gpuplace_core::cluster::Cluster::new(nodes), &name);
        assert_eq!((mixed.gpus, mixed.idle_gpus), (32, 29));
        let (h100, l40s) = (&mixed.by_model["NVIDIA H100 80GB HBM3"], &mixed.by_model["L40S"]);
        assert_eq!((h100.gpus + l40s.gpus, h100.idle_gpus + l40s.idle_gpus), (32, 29));
        assert_eq!(l40s.gpus, 4);
    }

    #[test]
    fn fields_name_every_field_a_line_has() {
        // `truncated` is written only when true, the group fields only for groups, `repeats` only
        // after held repeats
        let v = serde_json::to_value(Decision {
            truncated: true,
            group: Some("ns/job".into()),
            planned_node: Some("n".into()),
            group_event: Some(GroupEvent::default()),
            group_totals: Some(GroupTotals::default()),
            repeats: Some(Repeats::default()),
            offered: Some(1),
            ..Decision::default()
        })
        .unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut fields = FIELDS.to_vec();
        keys.sort_unstable();
        fields.sort_unstable();
        assert_eq!(keys, fields);
        // a line from before `cluster` was added still reads
        let mut old = v.clone();
        for later in
            ["cluster", "truncated", "group", "planned_node", "group_event", "group_totals", "repeats", "offered"]
        {
            old.as_object_mut().unwrap().remove(later);
        }
        assert_eq!(serde_json::from_value::<Decision>(old).unwrap(), Decision::default());
    }
}
