//! Live utilization: a bounded penalty for GPUs measured busier than what is allocated on them
//! (a tenant that exceeds its share slows its neighbours). Stale samples are ignored, and this never
//! filters a node out: measurements are noisy, allocations are the contract.

use crate::core::cluster::Node;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};

#[derive(Debug, Default, Clone, Copy)]
pub struct UtilizationScorer;

/// How far a GPU's measured load exceeds its allocation, 0.0..=1.0 (0 when unknown or stale).
pub fn excess(ctx: &ScoreContext<'_>, node: &Node, g: usize) -> f64 {
    let Some(sample) = node.utilization(g) else { return 0.0 };
    if ctx.now_unix_ms - sample.at_unix_ms > ctx.max_sample_age_ms || sample.at_unix_ms > ctx.now_unix_ms + 60_000 {
        return 0.0;
    }
    let u = node.usage(g);
    let cap = node.gpus[g].memory_mib.max(1) as f64;
    let allocated_core = if u.exclusive { 100.0 } else { f64::from(u.core_pct) };
    let allocated_mem = if u.exclusive { cap } else { u.mem_mib as f64 };
    let core_excess = (f64::from(sample.sm_pct.min(100)) - allocated_core).max(0.0) / 100.0;
    let mem_excess = (sample.mem_used_mib as f64 - allocated_mem).max(0.0) / cap;
    core_excess.max(mem_excess).min(1.0)
}

impl Scorer for UtilizationScorer {
    fn name(&self) -> &'static str {
        "utilization"
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        // the worst GPU of any container (a GPU seen twice changes nothing; none at all gives 1.0)
        let slices = placement.assignment.containers.iter().flat_map(|c| &c.slices);
        1.0 - slices.map(|s| excess(ctx, node, s.gpu as usize)).fold(0.0, f64::max)
    }
}
