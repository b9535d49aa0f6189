//! Binpack or spread at node level: fill busy nodes first (keeps whole nodes free for big jobs) or
//! spread load (keeps headroom everywhere). GPU-level packing happens in the GPU choice.

use crate::core::cluster::Node;
use crate::core::resources::PackingPolicy;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};

#[derive(Debug, Default, Clone, Copy)]
pub struct PackingScorer;

/// The node's allocated GPU share after the placement, 0.0..=1.0.
pub fn load_after(node: &Node, placement: &Placement) -> f64 {
    if node.gpus.is_empty() {
        return 0.0;
    }
    let mut used: Vec<f64> = (0..node.gpus.len()).map(|g| node.gpu_used_fraction(g)).collect();
    for c in placement.assignment.containers.iter().filter(|c| !c.init) {
        for s in &c.slices {
            let g = s.gpu as usize;
            let cap = node.gpus[g].memory_mib.max(1) as f64;
            let add = if s.exclusive { 1.0 } else { (f64::from(s.core_pct) / 100.0).max(s.mem_mib as f64 / cap) };
            used[g] = (used[g] + add).min(1.0);
        }
    }
    used.iter().sum::<f64>() / node.gpus.len() as f64
}

impl Scorer for PackingScorer {
    fn name(&self) -> &'static str {
        "packing"
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        let load = load_after(node, placement);
        match ctx.node_policy {
            PackingPolicy::Binpack => load,
            PackingPolicy::Spread => 1.0 - load,
        }
    }
}
