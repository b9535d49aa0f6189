//! Native DRA: where kube-scheduler v1.36 puts a pod whose GPUs come from a ResourceClaim when
//! gpuplace has no say (the simulator's `native-dra` policy, issue 32).
//!
//! - **Which nodes are looked at.** kube-scheduler stops filtering once it has found
//!   `percentageOfNodesToScore` of the nodes feasible, left unset as by default: 50 percent less one
//!   per 125 nodes, at least 5 percent and at least 100 nodes ([`feasible_nodes_to_find`]). The
//!   search starts where the last one stopped, so successive pods see successive parts of the
//!   node list.
//! - **How they are scored.** DynamicResources scores only claims with `firstAvailable`
//!   alternatives, so a plain `exactly` request leaves the choice to the default profile's resource
//!   scores: NodeResourcesFit with LeastAllocated over CPU and memory (weight 1 each) plus
//!   NodeResourcesBalancedAllocation ([`node_score`]). The other default scores (taints, affinity,
//!   spreading, images) rate every node of the trace alike. Ties are broken at random, as
//!   kube-scheduler's `selectHost` does.
//! - **Which GPUs on the node.** The DRA allocator takes devices in slice order, the first that
//!   satisfy the request ([`first_fit`]): a share goes to the first GPU with room, whole GPUs to the
//!   first idle ones.
//!
//! Node requests are counted as placed; kube-scheduler's LeastAllocated counts a pod without a CPU
//! or memory request as 100 millicores and 200 MiB, which only the incoming pod is given here (the
//! openb traces have no pod without CPU and one without memory).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::sim::state::{SimNode, SimState};
use crate::sim::trace::TracePod;

/// kube-scheduler looks for at least this many feasible nodes (`minFeasibleNodesToFind`).
pub const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;

/// ... and at least this percentage of the nodes (`minFeasibleNodesPercentageToFind`).
pub const MIN_FEASIBLE_NODES_PERCENTAGE: usize = 5;

/// kube-scheduler's `MaxNodeScore`.
const MAX_NODE_SCORE: u64 = 100;

/// The default non-zero requests LeastAllocated counts for a pod that asks none.
const DEFAULT_CPU_MILLI: u64 = 100;
const DEFAULT_MEMORY_MIB: u64 = 200;

/// How many feasible nodes kube-scheduler finds before it scores, with `percentageOfNodesToScore`
/// unset (`numFeasibleNodesToFind`).
pub fn feasible_nodes_to_find(all: usize) -> usize {
    if all < MIN_FEASIBLE_NODES_TO_FIND {
        return all;
    }
    let percentage = 50usize.saturating_sub(all / 125).max(MIN_FEASIBLE_NODES_PERCENTAGE);
    (all * percentage / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// `leastRequestedScore`: the share of `capacity` left after `requested`, 0..=100.
fn least_requested(requested: u64, capacity: u64) -> u64 {
    if capacity == 0 || requested > capacity {
        return 0;
    }
    (capacity - requested) * MAX_NODE_SCORE / capacity
}

/// NodeResourcesFit (LeastAllocated: CPU and memory, weight 1 each) plus
/// NodeResourcesBalancedAllocation for `pod` on `s`, each 0..=100.
pub fn node_score(s: &SimNode, pod: &TracePod) -> u64 {
    let used = |total: u64, left: u64| total.saturating_sub(left);
    let cpu = used(s.cpu_total, s.cpu_left);
    let mem = used(s.mem_total, s.mem_left);
    let fit = [
        (cpu + pod.cpu_milli.max(DEFAULT_CPU_MILLI), s.cpu_total),
        (mem + pod.memory_mib.max(DEFAULT_MEMORY_MIB), s.mem_total),
    ];
    let counted: Vec<(u64, u64)> = fit.into_iter().filter(|&(_, c)| c > 0).collect();
    let least = match counted.len() as u64 {
        0 => 0,
        n => counted.iter().map(|&(r, c)| least_requested(r, c)).sum::<u64>() / n,
    };
    // BalancedAllocation reads the requests as they are (no defaults)
    let fractions: Vec<f64> = [(cpu + pod.cpu_milli, s.cpu_total), (mem + pod.memory_mib, s.mem_total)]
        .into_iter()
        .filter(|&(_, c)| c > 0)
        .map(|(r, c)| (r as f64 / c as f64).min(1.0))
        .collect();
    let std = match fractions.as_slice() {
        [a, b] => ((a - b) / 2.0).abs(),
        _ => 0.0,
    };
    let balanced = ((1.0 - std) * MAX_NODE_SCORE as f64) as u64;
    least + balanced
}

/// The devices the allocator takes on `s`: in slice order, the first with room for a share, the
/// first idle ones for whole GPUs (none for a pod without GPUs).
pub fn first_fit(s: &SimNode, pod: &TracePod) -> Vec<usize> {
    let milli = pod.milli();
    if milli == 0 {
        Vec::new()
    } else if pod.num_gpu == 1 && milli < 1000 {
        (0..s.left.len()).find(|&g| s.left[g] >= milli).into_iter().collect()
    } else {
        s.first_idle(pod.num_gpu)
    }
}

/// kube-scheduler's search state: where the next search for feasible nodes starts.
#[derive(Debug, Clone, Default)]
pub struct NativeDra {
    next_start: usize,
}

impl NativeDra {
    /// The node and GPUs (indices) kube-scheduler and the DRA allocator would give `pod`, or `None`
    /// when no node fits.
    pub fn choose(&mut self, state: &SimState, pod: &TracePod, rng: &mut ChaCha8Rng) -> Option<(usize, Vec<usize>)> {
        let models = pod.models();
        let all = state.nodes.len();
        if all == 0 {
            return None;
        }
        let want = feasible_nodes_to_find(all);
        let start = self.next_start % all;
        let mut feasible = Vec::with_capacity(want);
        let mut processed = 0;
        for k in 0..all {
            if feasible.len() >= want {
                break;
            }
            let i = (start + k) % all;
            processed += 1;
            if state.nodes[i].fits(pod, &models) {
                feasible.push(i);
            }
        }
        self.next_start = (start + processed) % all;
        // the highest score; among equals, each as likely (selectHost's reservoir sampling)
        let mut best: Option<(u64, usize)> = None;
        let mut ties = 0u32;
        for &i in &feasible {
            let score = node_score(&state.nodes[i], pod);
            match best {
                Some((b, _)) if score < b => {}
                Some((b, _)) if score == b => {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        best = Some((score, i));
                    }
                }
                _ => {
                    best = Some((score, i));
                    ties = 1;
                }
            }
        }
        let (_, node) = best?;
        Some((node, first_fit(&state.nodes[node], pod)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rand::SeedableRng;

    use super::*;
    use crate::placement::mix::WorkloadMix;
    use crate::sim::trace::TraceNode;

    fn node(cpu_total: u64, cpu_left: u64, left: Vec<u32>) -> SimNode {
        SimNode {
            model: "V100M16".into(),
            cpu_total,
            cpu_left,
            mem_total: 262_144,
            mem_left: 262_144,
            left,
            kinds: BTreeMap::new(),
            generation: 0,
        }
    }

    fn pod(cpu_milli: u64, num_gpu: u32, gpu_milli: u32) -> TracePod {
        TracePod {
            name: "p".into(),
            cpu_milli,
            memory_mib: 8192,
            num_gpu,
            gpu_milli,
            gpu_spec: String::new(),
            group: None,
        }
    }

    #[test]
    fn the_share_of_nodes_kube_scheduler_looks_at() {
        assert_eq!(feasible_nodes_to_find(32), 32);
        assert_eq!(feasible_nodes_to_find(100), 100);
        // 1,213 nodes (the openb cluster): 50 - 9 = 41 percent
        assert_eq!(feasible_nodes_to_find(1213), 497);
        // 5,000 nodes: 50 - 40 = 10 percent; 10,000: at least 5 percent
        assert_eq!(feasible_nodes_to_find(5000), 500);
        assert_eq!(feasible_nodes_to_find(10_000), 500);
        assert_eq!(feasible_nodes_to_find(200), 100, "49 percent is 98, under the minimum");
    }

    #[test]
    fn the_emptier_node_wins_and_gpus_go_first_fit() {
        // a share on a busy node with a free GPU 0 and a part-used GPU 1 goes to GPU 0, first in
        // slice order, where best fit would take GPU 1
        let busy = node(96_000, 24_000, vec![1000, 400, 0, 0]);
        let idle = node(96_000, 96_000, vec![1000; 4]);
        let share = pod(4000, 1, 300);
        assert_eq!(first_fit(&busy, &share), vec![0]);
        assert!(node_score(&idle, &share) > node_score(&busy, &share));
        let whole = pod(4000, 2, 1000);
        assert_eq!(first_fit(&idle, &whole), vec![0, 1]);
        // LeastAllocated and BalancedAllocation by hand: CPU 4.1 of 96 cores used, memory 8 of 256 GiB
        let cpu = (96_000 - 4000) * 100 / 96_000; // 95
        let mem = (262_144 - 8192) * 100 / 262_144; // 96
        let balanced = ((1.0 - ((4000.0 / 96_000.0 - 8192.0 / 262_144.0) / 2.0f64).abs()) * 100.0) as u64;
        assert_eq!(node_score(&idle, &share), (cpu + mem) / 2 + balanced);
    }

    #[test]
    fn successive_searches_start_where_the_last_stopped() {
        // 200 idle nodes: 100 are looked for, so the second pod searches the other half
        let nodes: Vec<TraceNode> = (0..200)
            .map(|i| TraceNode {
                name: format!("n{i}"),
                cpu_milli: 96_000,
                memory_mib: 262_144,
                gpu: 8,
                model: "V100M16".into(),
                nvswitch: false,
            })
            .collect();
        let mut state = SimState::new(&nodes, WorkloadMix::default());
        let mut dra = NativeDra::default();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (a, _) = dra.choose(&state, &pod(4000, 1, 500), &mut rng).unwrap();
        assert!(a < 100, "{a}");
        let (b, _) = dra.choose(&state, &pod(4000, 1, 500), &mut rng).unwrap();
        assert!((100..200).contains(&b), "{b}");
        // nothing fits: no choice
        state.nodes.iter_mut().for_each(|n| n.left = vec![0; 8]);
        assert_eq!(dra.choose(&state, &pod(4000, 1, 500), &mut rng), None);
    }
}
