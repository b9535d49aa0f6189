//! [`CapacitySummary`]'s figures, kept per node between bind lines ([`SummaryMemo`]).
//!
//! A bind line carries the whole cluster's GPUs after the bind, and between two binds usually one
//! node changed. Summing every GPU of every node at every bind read each GPU's model name (a heap
//! string per GPU): at 1,000 nodes that was a sixth of the extender's CPU per pod, nearly all in
//! `memcmp` cache misses (docs/performance-journal.md, "The extender's CPU per pod at 1,000 nodes").
//! The memo keeps each node's part under the node's stamp (a new one on every change to the node,
//! never reused: `Cluster::stamps`), and models by index, so a bind re-reads only the nodes that
//! changed.

use std::collections::BTreeMap;

use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::room::Room;

use super::{gpus_of_milli, CapacitySummary, ModelCapacity, NodeCapacity};

impl CapacitySummary {
    /// The figures of `cluster` now; `node` is the bind's node. Reads every GPU once (a bind's
    /// Binding call costs far more), and only when a placement log is written.
    pub fn of(cluster: &Cluster, node: &str) -> Self {
        Self::sampled(cluster, node, true, &mut SummaryMemo::default())
    }

    /// [`Self::of`] with the room (`core::room`, which reads every node's network labels) only when
    /// `with_room` (the extender writes it at most every [`ROOM_EVERY`](super::ROOM_EVERY): `PlacementLog::room_due`),
    /// and each node's part taken from `memo` while the node is unchanged.
    pub fn sampled(cluster: &Cluster, node: &str, with_room: bool, memo: &mut SummaryMemo) -> Self {
        let mut s = memo.summarize(cluster, node);
        s.room = with_room.then(|| Room::of(cluster));
        s
    }
}

/// Figures of some GPUs, in thousandths of a GPU where they are shares.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Acc {
    gpus: u32,
    allocated: u64,
    idle: u32,
    fragmented: u64,
}

impl Acc {
    fn add(&mut self, o: &Acc) {
        self.gpus += o.gpus;
        self.allocated += o.allocated;
        self.idle += o.idle;
        self.fragmented += o.fragmented;
    }

    /// Takes back what [`Self::add`] added (exact: only parts that were added are taken back).
    fn sub(&mut self, o: &Acc) {
        self.gpus -= o.gpus;
        self.allocated -= o.allocated;
        self.idle -= o.idle;
        self.fragmented -= o.fragmented;
    }
}

/// One node's part: its figures per model (by index into [`SummaryMemo::models`]).
#[derive(Debug, Clone)]
struct NodePart {
    stamp: u64,
    by_model: Vec<(usize, Acc)>,
    allocated: u64,
    unhealthy: u32,
}

/// Each node's part of the summary, by node index, valid while the node's stamp is the one stored,
/// and the sums of those parts: a bind line changes one node or two, so a summary takes the other
/// nodes' parts as summed for the previous line instead of adding up every node again (at 1,000
/// nodes that was 2 % of the extender's CPU; docs/performance-journal.md, "The last third").
#[derive(Debug, Default)]
pub struct SummaryMemo {
    models: Vec<String>,
    nodes: Vec<Option<NodePart>>,
    /// The cluster layout the parts are indexed by ([`Cluster::layout`]).
    layout: u64,
    by_model: Vec<Acc>,
    total: Acc,
    unhealthy: u32,
}

impl SummaryMemo {
    fn model_index(&mut self, model: &str) -> usize {
        match self.models.iter().position(|m| m == model) {
            Some(i) => i,
            None => {
                self.models.push(model.to_string());
                self.models.len() - 1
            }
        }
    }

    fn part_of(&mut self, n: &Node, stamp: u64) -> NodePart {
        let mut part = NodePart { stamp, by_model: Vec::new(), allocated: 0, unhealthy: 0 };
        // a node's GPUs are one model, nearly always: one model lookup per run of a model
        let mut run: Option<(&str, Acc)> = None;
        for (i, used) in n.used_milli().enumerate() {
            let used = u64::from(used);
            let healthy = n.gpu_facts()[i].healthy;
            let idle = healthy && n.is_gpu_free(i);
            let fragmented = if healthy && !idle { 1000u64.saturating_sub(used) } else { 0 };
            part.unhealthy += u32::from(!healthy);
            part.allocated += used;
            let model = n.gpus[i].model.as_str();
            if run.as_ref().is_some_and(|(m, _)| *m != model) {
                if let Some((m, acc)) = run.take() {
                    let at = self.model_index(m);
                    part.by_model.push((at, acc));
                }
            }
            let one = Acc { gpus: 1, allocated: used, idle: u32::from(idle), fragmented };
            run.get_or_insert_with(|| (model, Acc::default())).1.add(&one);
        }
        if let Some((m, acc)) = run {
            let at = self.model_index(m);
            part.by_model.push((at, acc));
        }
        part
    }

    /// The summary of `cluster` now (without the room); `node` is the bind's node.
    pub fn summarize(&mut self, cluster: &Cluster, node: &str) -> CapacitySummary {
        let nodes = cluster.nodes();
        let stamps = cluster.stamps();
        if self.layout != cluster.layout() || self.nodes.len() > nodes.len() {
            // indices moved: every part is summed again (the model names are kept)
            *self =
                SummaryMemo { models: std::mem::take(&mut self.models), layout: cluster.layout(), ..Self::default() };
        }
        self.nodes.resize(nodes.len(), None);
        for (i, n) in nodes.iter().enumerate() {
            let stamp = stamps[i];
            if self.nodes[i].as_ref().is_some_and(|p| p.stamp == stamp) {
                continue;
            }
            if let Some(old) = self.nodes[i].take() {
                for (m, acc) in &old.by_model {
                    self.by_model[*m].sub(acc);
                    self.total.sub(acc);
                }
                self.unhealthy -= old.unhealthy;
            }
            let part = self.part_of(n, stamp);
            if self.by_model.len() < self.models.len() {
                self.by_model.resize(self.models.len(), Acc::default());
            }
            for (m, acc) in &part.by_model {
                self.by_model[*m].add(acc);
                self.total.add(acc);
            }
            self.unhealthy += part.unhealthy;
            self.nodes[i] = Some(part);
        }
        let (total, unhealthy_gpus, by_model) = (self.total, self.unhealthy, &self.by_model);
        let this = cluster.node_index(node).and_then(|i| {
            let n = nodes.get(i)?;
            let part = self.nodes.get(i)?.as_ref()?;
            Some(NodeCapacity {
                name: n.name.clone(),
                model: n.gpus.first().map(|g| g.model.clone()).unwrap_or_default(),
                gpus: n.gpus.len() as u32,
                allocated_gpus: gpus_of_milli(part.allocated),
            })
        });
        let by_model: BTreeMap<String, ModelCapacity> = by_model
            .iter()
            .enumerate()
            .filter(|(_, a)| a.gpus > 0)
            .map(|(m, a)| {
                let s = ModelCapacity {
                    gpus: a.gpus,
                    allocated_gpus: gpus_of_milli(a.allocated),
                    idle_gpus: a.idle,
                    fragmented_gpus: gpus_of_milli(a.fragmented),
                };
                (self.models[m].clone(), s)
            })
            .collect();
        CapacitySummary {
            nodes: nodes.len(),
            gpus: total.gpus,
            allocated_gpus: gpus_of_milli(total.allocated),
            idle_gpus: total.idle,
            fragmented_gpus: gpus_of_milli(total.fragmented),
            unhealthy_gpus,
            by_model,
            node: this,
            room: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};

    #[test]
    fn a_kept_summary_equals_a_fresh_one_through_changes() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/clusters/fixture-cluster.yaml");
        let mut cluster = gpuplace_core::inventory::load_cluster(&path).unwrap();
        let mut memo = SummaryMemo::default();
        let names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
        for (k, node) in names.iter().cycle().take(12).enumerate() {
            let fresh = SummaryMemo::default().summarize(&cluster, node);
            assert_eq!(memo.summarize(&cluster, node), fresh, "step {k}");
            let slices =
                vec![GpuSlice { gpu: (k / names.len()) as u32, mem_mib: 20480, core_pct: 30, exclusive: false }];
            let a = PodAssignment {
                pod: format!("ns/p{k}"),
                node: node.clone(),
                containers: vec![ContainerAssignment { name: "main".into(), init: false, slices }],
                cpu_milli: 0,
                memory_mib: 0,
                group: None,
            };
            if cluster.node_index(node).is_some() {
                cluster.allocate(a).unwrap();
            }
            if k == 5 {
                // a node leaves: indices shift, stamps still tell
                cluster.remove_node(&names[0]);
            }
            if k == 8 {
                // a node comes (appended) and a pod goes: sums taken back exactly
                let back = gpuplace_core::inventory::load_cluster(&path).unwrap().nodes()[0].clone();
                cluster.upsert_node(back);
                let _ = cluster.release("ns/p7");
            }
        }
        let last = names.last().unwrap();
        assert_eq!(memo.summarize(&cluster, last), SummaryMemo::default().summarize(&cluster, last));
        assert_eq!(memo.summarize(&cluster, last).node.unwrap().name, *last);
    }
}
