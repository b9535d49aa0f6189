//! Fragmentation, in the spirit of FGD (Weng et al., USENIX ATC '23): a placement is rated by how
//! much it raises the node's fragmentation, the idle GPU capacity the workload's typical requests
//! could not use. The measure itself ([`WorkloadMix::fragmentation`]) is in `placement::mix`, since
//! the GPU choice reads it too.

use crate::placement::feasibility::Placement;
use crate::placement::mix::{HostFree, WorkloadMix};
use crate::placement::scorer::{Data, ScoreContext, Scorer};
use gpuplace_core::cluster::Node;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "fragmentation";

/// How much a placement raising its node's fragmentation counts; the profile's main concern.
pub const DEFAULT_WEIGHT: f64 = 6.0;

/// Rates a placement by how little it adds to the node's fragmentation.
#[derive(Debug, Default, Clone, Copy)]
pub struct FragmentationScorer;

/// Change in fragmentation (thousandths of a GPU) if the placement is made on the node.
pub fn fragmentation_delta(mix: &WorkloadMix, node: &Node, placement: &Placement) -> f64 {
    let (before, after, n) = placement.free_milli_before_after(node);
    let model = node.gpus.first().map_or("", |g| g.model.as_str());
    let a = &placement.assignment;
    mix.fragmentation(&after[..n], HostFree::of(node, a.cpu_milli, a.memory_mib), model)
        - mix.fragmentation(&before[..n], HostFree::of(node, 0, 0), model)
}

/// Fragmentation changes beyond this many GPUs all score the same (0 or 1).
const DELTA_SPAN_MILLI: f64 = 8000.0;

impl Scorer for FragmentationScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, _data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        if ctx.mix.is_empty() {
            return 0.5;
        }
        let delta = fragmentation_delta(ctx.mix, node, placement);
        (0.5 - delta / (2.0 * DELTA_SPAN_MILLI)).clamp(0.0, 1.0)
    }
}
