//! Topology quality: how well the chosen GPUs of each container are connected, relative to the best
//! set of that size the node's board offers at all (so H100 NVSwitch and L40S PCIe boards compare
//! fairly).

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};
use gpuplace_core::cluster::Node;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "topology";

/// How much the chosen GPUs' links count against the board's best set of that size.
pub const DEFAULT_WEIGHT: f64 = 2.0;

#[derive(Debug, Default, Clone, Copy)]
pub struct TopologyScorer;

impl Scorer for TopologyScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn score(&self, _ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        let mut total = 0.0;
        let mut counted = 0;
        for (c, &got) in placement.assignment.containers.iter().zip(&placement.set_scores) {
            let k = c.slices.len();
            if c.init || k < 2 {
                continue;
            }
            let best = node.topology.best_set_score(k);
            total += if best == 0 { 1.0 } else { (f64::from(got) / f64::from(best)).min(1.0) };
            counted += 1;
        }
        // single-GPU pods: topology does not separate nodes
        if counted == 0 {
            1.0
        } else {
            total / counted as f64
        }
    }
}
