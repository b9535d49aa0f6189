//! Fragmentation, in the spirit of FGD (Weng et al., USENIX ATC '23): a placement is rated by how
//! much it raises the node's fragmentation, the idle GPU capacity the workload's typical requests
//! could not use. The measure itself ([`WorkloadMix::fragmentation`]) is in `placement::mix`, since
//! the GPU choice reads it too.

use crate::core::cluster::Node;
use crate::placement::feasibility::Placement;
use crate::placement::mix::{HostFree, WorkloadMix};
use crate::placement::scorer::{ScoreContext, Scorer};

/// Rates a placement by how little it adds to the node's fragmentation.
#[derive(Debug, Default, Clone, Copy)]
pub struct FragmentationScorer;

/// Change in fragmentation (thousandths of a GPU) if the placement is made on the node.
pub fn fragmentation_delta(mix: &WorkloadMix, node: &Node, placement: &Placement) -> f64 {
    let n = node.gpus.len().min(64);
    let mut before = [0u32; 64];
    for (g, slot) in before.iter_mut().enumerate().take(n) {
        *slot = node.free_milli(g);
    }
    let mut after = before;
    for c in placement.assignment.containers.iter().filter(|c| !c.init) {
        for s in &c.slices {
            let g = s.gpu as usize;
            if g >= n {
                continue;
            }
            after[g] = after[g].saturating_sub(s.milli_on(node.gpus[g].memory_mib));
        }
    }
    let model = node.gpus.first().map_or("", |g| g.model.as_str());
    let a = &placement.assignment;
    mix.fragmentation(&after[..n], HostFree::of(node, a.cpu_milli, a.memory_mib), model)
        - mix.fragmentation(&before[..n], HostFree::of(node, 0, 0), model)
}

/// Fragmentation changes beyond this many GPUs all score the same (0 or 1).
const DELTA_SPAN_MILLI: f64 = 8000.0;

impl Scorer for FragmentationScorer {
    fn name(&self) -> &'static str {
        "fragmentation"
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        if ctx.mix.is_empty() {
            return 0.5;
        }
        let delta = fragmentation_delta(ctx.mix, node, placement);
        (0.5 - delta / (2.0 * DELTA_SPAN_MILLI)).clamp(0.0, 1.0)
    }
}
