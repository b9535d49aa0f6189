//! Whole nodes and switches: keeps the room that node-sized pods and jobs of several of them under
//! one switch need, whatever arrives first.
//!
//! Fragmentation measures what the *typical* requests could still use; while shares are all that
//! has come, a share on an empty node costs it nothing, and with it as a tie another small part
//! (live utilization, say) spread 40 shares over 21 of 32 empty nodes, and the training jobs that
//! followed waited while 150 GPUs were idle (issue 30). The cluster is built for those jobs: its
//! inventory has 8-GPU nodes for 8-GPU pods and its network levels for groups. So a placement is
//! rated by the whole units it breaks (`placement::whole_units`): none (the node is already broken)
//! scores 1; the node alone, less; the node and its whole ToR, less still; and a node of a whole
//! spine, 0. Shares consolidate onto broken nodes before they break whole ones, and a node-sized
//! pod takes a node of a broken ToR before one of a whole ToR.
//!
//! A node that is already broken is room to use only while its host can still feed its idle GPUs:
//! packing GPU pods onto it until its CPU or memory runs out strands its remaining GPUs, which the
//! host-aware fragmentation scorer would have avoided. So a placement that leaves a broken node's idle
//! GPUs less than their share of its host is rated as breaking the node (on the Alibaba trace with its
//! 8-GPU nodes as HGX boards, the scorer without this cost 0.79 points, with it 0.52; with unlimited
//! hosts it cost nothing: docs/performance-journal.md, "The same on an NVLink training cluster").
//!
//! While no node is whole the scorer has nothing to say and is left out ([`Scorer::applies`]).

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, Facts, ScoreContext, Scorer};
use crate::placement::whole_units::{WholeUnits, WholeView};
use gpuplace_core::cluster::Node;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "whole";

/// A pod breaks a whole node, ToR or spine only when no broken node takes it. High, so that live
/// utilization or a fragmentation tie never spreads shares over empty nodes.
pub const DEFAULT_WEIGHT: f64 = 6.0;

#[derive(Debug, Default, Clone, Copy)]
pub struct WholeScorer;

/// `node`'s index in `nodes` when it is one of them (by address, as scorers are given the node
/// itself), else by name.
fn index_of(ctx: &ScoreContext<'_>, node: &Node) -> Option<usize> {
    let nodes = ctx.cluster.nodes();
    let offset = (node as *const Node as usize).checked_sub(nodes.as_ptr() as usize)?;
    let i = offset / std::mem::size_of::<Node>().max(1);
    match nodes.get(i) {
        Some(n) if std::ptr::eq(n, node) => Some(i),
        _ => ctx.cluster.node_index(&node.name),
    }
}

/// How many whole units (the node, then its switches) a placement on `node` would break.
pub fn breaks(ctx: &ScoreContext<'_>, whole: &WholeView, node: &Node) -> u8 {
    index_of(ctx, node).and_then(|i| whole.breaks.get(i).copied()).unwrap_or(0)
}

/// Whether `node`'s host still feeds its idle GPUs after `placement`: each GPU left idle keeps at
/// least its share of the node's CPU and memory (where the node counts them).
pub fn host_keeps_up(node: &Node, placement: &Placement) -> bool {
    let n = node.gpus.len() as u64;
    if n == 0 {
        return true;
    }
    // distinct GPUs (`PodAssignment::gpus` sorts and dedups)
    let newly = placement.gpus().iter().filter(|&&g| node.is_gpu_free(g as usize)).count() as u64;
    let idle_after = (node.idle_gpus() as u64).saturating_sub(newly);
    let a = &placement.assignment;
    let fed = |total: u64, free: u64, used: u64| total == 0 || free.saturating_sub(used) * n >= idle_after * total;
    fed(node.cpu_milli, node.cpu_free(), a.cpu_milli) && fed(node.memory_mib, node.mem_free(), a.memory_mib)
}

impl Scorer for WholeScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn facts(&self) -> Option<Box<dyn Facts>> {
        Some(Box::<WholeUnits>::default())
    }

    fn applies(&self, ctx: &ScoreContext<'_>, data: Data<'_>) -> bool {
        data.get::<WholeView>().is_some_and(|w| w.any) && ctx.request.total_gpus() > 0
    }

    fn score(&self, ctx: &ScoreContext<'_>, data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        let uses_gpus = placement.assignment.containers.iter().any(|c| !c.slices.is_empty());
        let Some(whole) = data.get::<WholeView>().filter(|_| uses_gpus) else { return 1.0 };
        let units = whole.units.max(1);
        // a broken node whose host would run short counts as broken again
        let b = match breaks(ctx, whole, node) {
            0 if !host_keeps_up(node, placement) => 1,
            b => b,
        };
        1.0 - f64::from(b.min(units)) / f64::from(units)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_core::inventory::Board;

    fn share_on_gpu_0(cpu_milli: u64) -> Placement {
        let slice = GpuSlice { gpu: 0, mem_mib: 20480, core_pct: 25, exclusive: false };
        let assignment = PodAssignment {
            pod: "ml/share".into(),
            node: "hgx".into(),
            containers: vec![ContainerAssignment { name: "main".into(), init: false, slices: vec![slice] }],
            cpu_milli,
            memory_mib: 1024,
            group: None,
        };
        Placement { assignment, set_scores: vec![0] }
    }

    #[test]
    fn a_host_keeps_up_while_each_idle_gpu_keeps_its_share_of_cpu_and_memory() {
        let board = Board::Flat { gpus: 8, model: "H100".into(), memory_mib: 81920 }.resolve(Path::new(".")).unwrap();
        // 96 cores for 8 GPUs: 12 per GPU; a share on an idle GPU leaves 7 idle, which need 84
        let node = board.node("hgx", BTreeMap::new(), 96_000, 1 << 20);
        assert!(host_keeps_up(&node, &share_on_gpu_0(12_000)));
        assert!(!host_keeps_up(&node, &share_on_gpu_0(12_001)));
        // a node that does not count its host always keeps up
        let uncounted = board.node("hgx", BTreeMap::new(), 0, 0);
        assert!(host_keeps_up(&uncounted, &share_on_gpu_0(1_000_000)));
    }
}
