//! Topology quality: how well the chosen GPUs of each container are connected, relative to the best
//! set of that size the node's board offers at all (so H100 NVSwitch and L40S PCIe boards compare
//! fairly).

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, ScoreContext, Scorer};
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

    fn score(&self, _ctx: &ScoreContext<'_>, _data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::engine::Engine;
    use crate::placement::mix::WorkloadMix;
    use crate::placement::profile::{Profile, ProfileConfig};
    use crate::placement::registry::Weights;
    use crate::placement::test_fixtures::pcie_cluster;
    use gpuplace_core::cluster::Cluster;
    use gpuplace_core::resources::{GpuDemand, PodRequest};

    /// The topology score of `gpus` whole GPUs on node `i`, with the engine's own GPU choice (the
    /// only scorer, so the node's total is its score).
    fn score(c: &Cluster, gpus: u32, i: usize) -> f64 {
        let weights = Weights::none().with(NAME, 1.0);
        let e =
            Engine::new(Profile::new(ProfileConfig { weights, ..ProfileConfig::default() }), WorkloadMix::default());
        let req = PodRequest::single("ns/p", GpuDemand::Whole { gpus });
        e.score(c, &req, i, &e.place(c, &req, i).expect("fits"), 0).total
    }

    #[test]
    fn a_set_scores_against_the_best_set_of_its_size_on_the_board() {
        // n0 empty; n1 has one GPU of every switch taken, so no free pair shares a switch; n2 has
        // socket 0 full, so 4 GPUs stay on socket 1's two switches, the best 4 the board has
        let c = pcie_cluster(&[&[], &[1, 3, 5, 7], &[0, 1, 2, 3]]);
        assert_eq!(score(&c, 2, 0), 1.0, "two GPUs under one switch: the board's best pair");
        let split = score(&c, 2, 1);
        assert!(split > 0.0 && split < 1.0, "a pair across switches: {split}");
        assert_eq!(score(&c, 4, 2), 1.0);
        assert!(score(&c, 4, 1) < 1.0, "4 GPUs over both sockets: {}", score(&c, 4, 1));
        // one GPU: topology does not separate nodes
        assert_eq!(score(&c, 1, 1), 1.0);
    }
}
