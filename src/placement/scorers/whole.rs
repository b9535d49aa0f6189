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
//! While no node is whole the scorer has nothing to say and is left out ([`Scorer::applies`]).

use crate::core::cluster::Node;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};

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
pub fn breaks(ctx: &ScoreContext<'_>, node: &Node) -> u8 {
    index_of(ctx, node).and_then(|i| ctx.reserve.whole.breaks.get(i).copied()).unwrap_or(0)
}

impl Scorer for WholeScorer {
    fn name(&self) -> &'static str {
        "whole"
    }

    fn applies(&self, ctx: &ScoreContext<'_>) -> bool {
        ctx.reserve.whole.any && ctx.request.total_gpus() > 0
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        let uses_gpus = placement.assignment.containers.iter().any(|c| !c.slices.is_empty());
        let units = ctx.reserve.whole.units.max(1);
        if !uses_gpus {
            return 1.0;
        }
        1.0 - f64::from(breaks(ctx, node).min(units)) / f64::from(units)
    }
}
