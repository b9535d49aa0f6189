//! NUMA locality across nodes: each multi-GPU container's GPUs on as few NUMA nodes as the node's
//! board allows for that many GPUs.
//!
//! The GPU choice already takes the fewest NUMA nodes a node can give (after the set's link score),
//! and `gpuplace.io/numa: required` filters out nodes that cannot give one. What neither does is
//! prefer, among nodes that fit, the one where the pod's GPUs share a socket: the `topology` scorer
//! rates links between GPUs, not the GPUs' distance to the pod's CPUs and host memory. Jobs whose
//! input pipeline crosses the socket (data loaders feeding several GPUs) are slowed by that, so a
//! profile can weigh it (`weights: {numa: 2}`). Off by default: the trace replays have no host
//! traffic to show a gain, and a default weight would move every multi-GPU placement.

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, ScoreContext, Scorer};
use gpuplace_core::cluster::Node;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "numa";

/// Off until a profile names it (see the module doc).
pub const DEFAULT_WEIGHT: f64 = 0.0;

#[derive(Debug, Default, Clone, Copy)]
pub struct NumaScorer;

impl Scorer for NumaScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    /// Only pods with a container of two GPUs or more: for the others every node scores alike.
    fn applies(&self, ctx: &ScoreContext<'_>, _data: Data<'_>) -> bool {
        ctx.request.containers.iter().any(|c| c.demand.gpus() >= 2)
    }

    fn score(&self, _ctx: &ScoreContext<'_>, _data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        let mut total = 0.0;
        let mut counted = 0;
        for c in placement.assignment.containers.iter().filter(|c| !c.init && c.slices.len() >= 2) {
            let numa: Option<Vec<u32>> =
                c.slices.iter().map(|s| node.gpus.get(s.gpu as usize).and_then(|g| g.numa_node)).collect();
            // a GPU whose NUMA node is unknown: nothing to rate
            let Some(mut numa) = numa else { continue };
            numa.sort_unstable();
            numa.dedup();
            total += fewest_numa_nodes(node, c.slices.len()) as f64 / numa.len() as f64;
            counted += 1;
        }
        if counted == 0 {
            1.0
        } else {
            (total / counted as f64).min(1.0)
        }
    }
}

/// The fewest NUMA nodes any `k` GPUs of `node` span (its largest NUMA nodes first).
fn fewest_numa_nodes(node: &Node, k: usize) -> usize {
    let mut sizes = std::collections::BTreeMap::<u32, usize>::new();
    for g in &node.gpus {
        *sizes.entry(g.numa_node.unwrap_or(u32::MAX)).or_default() += 1;
    }
    let mut sizes: Vec<usize> = sizes.into_values().collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut left = k;
    let mut used = 0;
    for s in sizes {
        if left == 0 {
            break;
        }
        left = left.saturating_sub(s);
        used += 1;
    }
    used.max(1)
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

    fn engine(numa: f64) -> Engine {
        let weights = Weights::none().with("packing", 1.0).with(NAME, numa);
        Engine::new(Profile::new(ProfileConfig { weights, ..ProfileConfig::default() }), WorkloadMix::default())
    }

    /// The numa scorer's weighted part of `req` on node `i`, with the engine's own GPU choice.
    fn part(e: &Engine, c: &Cluster, req: &PodRequest, i: usize) -> f64 {
        let placement = e.place(c, req, i).expect("fits");
        let s = e.score(c, req, i, &placement, 0);
        s.parts.iter().find(|(n, _)| *n == NAME).map_or(f64::NAN, |p| p.1)
    }

    #[test]
    fn the_fewest_numa_nodes_a_board_gives_k_gpus() {
        let c = pcie_cluster(&[&[]]);
        let n = &c.nodes()[0];
        assert_eq!([1, 2, 4, 5, 8].map(|k| fewest_numa_nodes(n, k)), [1, 1, 1, 2, 2]);
    }

    #[test]
    fn a_node_that_keeps_a_set_on_one_socket_outranks_one_that_must_split_it() {
        // n0: two GPUs free on each socket, so 4 GPUs span both; n1: socket 1 whole; n2: empty
        let c = pcie_cluster(&[&[0, 1, 4, 5], &[0, 1, 2], &[]]);
        let req = PodRequest::single("ns/p", GpuDemand::Whole { gpus: 4 });
        let e = engine(1.0);
        // packing (weight 1) and numa (weight 1): numa's part is half its score
        assert_eq!(part(&e, &c, &req, 0), 0.25, "4 GPUs over 2 sockets where 1 would do");
        assert_eq!(part(&e, &c, &req, 1), 0.5);
        assert_eq!(part(&e, &c, &req, 2), 0.5);
        // binpack alone prefers the fullest node, n0; with numa weighed as much, n1 wins
        let best = |e: &Engine| c.nodes()[e.evaluate_all(&c, &req, 0).ranked[0].node].name.clone();
        assert_eq!(best(&engine(0.0)), "n0");
        assert_eq!(best(&e), "n1");
        // single-GPU pods and shares: left out (every node alike)
        let one = PodRequest::single("ns/q", GpuDemand::Whole { gpus: 1 });
        assert_eq!(part(&e, &c, &one, 0), 0.0);
        assert!(e.score(&c, &one, 0, &e.place(&c, &one, 0).unwrap(), 0).total > 0.0);
    }
}
