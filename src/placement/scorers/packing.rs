//! Binpack or spread at node level: fill busy nodes first (keeps whole nodes free for big jobs) or
//! spread load (keeps headroom everywhere). GPU-level packing happens in the GPU choice.

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, ScoreContext, Scorer};
use gpuplace_core::cluster::Node;
use gpuplace_core::resources::PackingPolicy;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "packing";

/// Only a tie-break by default: on the Alibaba trace even a weight of 0.1 next to fragmentation's
/// 6 costs half a point of unallocated GPUs (docs/performance-journal.md), because consolidating nodes and
/// avoiding fragments pull apart. A pod that asks for `binpack` or `spread` gets
/// [`ProfileConfig::requested_packing_weight`](crate::placement::profile::ProfileConfig::requested_packing_weight) instead.
pub const DEFAULT_WEIGHT: f64 = 0.01;

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
        NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, _data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        let load = load_after(node, placement);
        match ctx.node_policy {
            PackingPolicy::Binpack => load,
            PackingPolicy::Spread => 1.0 - load,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use crate::placement::engine::Engine;
    use crate::placement::mix::{MixEntry, WorkloadMix};
    use crate::placement::profile::Profile;
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_core::cluster::Cluster;
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::{GpuDemand, PackingPolicy, PodRequest};

    /// `busy` has 3 of 4 GPUs taken, `empty` none.
    fn cluster() -> Cluster {
        let board = Board::Flat { gpus: 4, model: "A100".into(), memory_mib: 40960 }.resolve(Path::new(".")).unwrap();
        let mut c =
            Cluster::new(vec![board.node("busy", BTreeMap::new(), 0, 0), board.node("empty", BTreeMap::new(), 0, 0)]);
        let slices = (0..3).map(|gpu| GpuSlice { gpu, mem_mib: 40960, core_pct: 100, exclusive: true }).collect();
        c.allocate(PodAssignment {
            pod: "ns/fill".into(),
            node: "busy".into(),
            containers: vec![ContainerAssignment { name: "c".into(), init: false, slices }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        })
        .unwrap();
        c
    }

    fn ranking(c: &Cluster, policy: Option<PackingPolicy>) -> Vec<String> {
        let mut req = PodRequest::single("ns/p", GpuDemand::Whole { gpus: 1 });
        req.node_policy = policy;
        // a mix of 2-GPU requests: filling busy's last GPU removes a fragment, so fragmentation
        // alone would always pick busy
        let mix = WorkloadMix::new(
            vec![MixEntry { gpus: 2, milli: 1000, cpu_milli: 0, memory_mib: 0, models: vec![], weight: 1.0 }],
            Vec::new(),
        );
        let ev = Engine::new(Profile::gpuplace(), mix).evaluate_all(c, &req, 0);
        ev.ranked.iter().map(|r| c.nodes()[r.node].name.clone()).collect()
    }

    #[test]
    fn a_pods_node_policy_outranks_the_profiles_tie_break() {
        let c = cluster();
        assert_eq!(ranking(&c, Some(PackingPolicy::Binpack)), ["busy", "empty"]);
        assert_eq!(ranking(&c, Some(PackingPolicy::Spread)), ["empty", "busy"]);
        // the profile's own default is binpack, as a tie-break only
        assert_eq!(ranking(&c, None), ["busy", "empty"]);
    }
}
