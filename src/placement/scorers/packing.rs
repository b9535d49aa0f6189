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
    let n = node.gpus.len();
    if n == 0 {
        return 0.0;
    }
    // on the stack for the usual boards (this runs for every feasible node); the sum runs over GPUs
    // in index order either way
    let mut small = [0.0; 16];
    let mut large = Vec::new();
    let used: &mut [f64] = if n <= small.len() {
        &mut small[..n]
    } else {
        large.resize(n, 0.0);
        &mut large
    };
    for (slot, u) in used.iter_mut().zip(node.used_fractions()) {
        *slot = u;
    }
    let facts = node.gpu_facts();
    for c in placement.assignment.containers.iter().filter(|c| !c.init) {
        for s in &c.slices {
            let g = s.gpu as usize;
            let (Some(u), Some(gpu)) = (used.get_mut(g), facts.get(g)) else { continue };
            *u = (*u + s.fraction_on(gpu.memory_mib)).min(1.0);
        }
    }
    used.iter().sum::<f64>() / n as f64
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
