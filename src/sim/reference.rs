//! A clairvoyant offline reference for the replay, not a scheduler: it sees every pod that arrives up
//! to 100 % of cluster GPU capacity at once and packs them largest first with best fit, on the same
//! nodes with host CPU and memory made unlimited (GPU models still apply).
//!
//! Online policies must place each pod as it comes and within each node's CPU and memory, so this is
//! what knowing the future buys when only GPUs are packed. It is a heuristic, not a proven optimum
//! (and a CPU-blind best fit does badly once CPU counts: it stacks big shares on one node and strands
//! its GPUs, so no CPU-limited variant is offered); it puts the online figures in proportion
//! (docs/performance.md).

use std::cmp::Reverse;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::placement::mix::WorkloadMix;
use crate::sim::protocol::{arrival_order, gpu_milli_total};
use crate::sim::run::{SeedResult, MAX_COLUMN};
use crate::sim::state::{SimNode, SimState};
use crate::sim::trace::UNLIMITED;
use crate::sim::trace::{TraceNode, TracePod};

/// The arrived-workload column the reference fills (% of cluster GPU capacity).
pub const REFERENCE_COLUMN: usize = 100;

/// Name of the reference in reports.
pub const REFERENCE_NAME: &str = "offline-bfd";

/// Packs the pods that arrive, in `seed`'s order, up to 100 % of GPU capacity: whole-GPU pods by
/// GPU count (most first) on the node with the fewest idle GPUs that hold them, then shares largest
/// first on the fullest GPU that holds them (cluster-wide), then CPU-only pods.
pub fn offline_best_fit_decreasing(
    nodes: &[TraceNode],
    pods: &[TracePod],
    mix: &WorkloadMix,
    seed: u64,
    tune: f64,
) -> SeedResult {
    let start = Instant::now();
    let unlimited: Vec<TraceNode> =
        nodes.iter().map(|n| TraceNode { cpu_milli: UNLIMITED, memory_mib: UNLIMITED, ..n.clone() }).collect();
    let mut state = SimState::new(&unlimited, mix.clone());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let order = arrival_order(pods, state.capacity_milli, tune, &mut rng);
    let mut arrived = 0u64;
    let mut batch: Vec<&TracePod> = order
        .iter()
        .take_while(|p| {
            arrived += gpu_milli_total(p);
            arrived <= state.capacity_milli * REFERENCE_COLUMN as u64 / 100
        })
        .collect();
    // Largest GPU demand first; whole GPUs before shares of the same total; name for determinism.
    batch.sort_by_key(|p| (Reverse(gpu_milli_total(p)), Reverse(p.num_gpu), p.name.clone()));
    let mut failed = 0usize;
    for pod in &batch {
        let placed = match choose(&state.nodes, pod) {
            Some((node, gpus)) => state.apply(node, pod, &gpus).is_ok(),
            None => false,
        };
        failed += usize::from(!placed);
    }
    let mut allocated_pct = vec![None; MAX_COLUMN + 1];
    let pct = 100.0 * state.used_milli() as f64 / state.capacity_milli.max(1) as f64;
    allocated_pct[REFERENCE_COLUMN] = Some((pct * 100.0).round_ties_even() / 100.0);
    SeedResult {
        seed,
        allocated_pct,
        frag_rate_pct: vec![None; MAX_COLUMN + 1],
        pods: batch.len(),
        failed_pods: failed,
        wall_s: start.elapsed().as_secs_f64(),
        groups: Default::default(),
        jobs: Default::default(),
        // packed offline, largest first: no arrival point to speak of
        first_refusal_pct: None,
        refused_75_to_100: 0,
    }
}

/// Best fit over the whole cluster: the feasible node (and GPU) that leaves the least room.
fn choose(nodes: &[SimNode], pod: &TracePod) -> Option<(usize, Vec<usize>)> {
    let models = pod.models();
    let milli = pod.milli();
    let feasible = nodes.iter().enumerate().filter(|(_, n)| n.fits(pod, &models));
    if milli == 0 {
        // CPU-only: the node with the least CPU left that holds it
        return feasible.min_by_key(|(i, n)| (n.cpu_left, *i)).map(|(i, _)| (i, Vec::new()));
    }
    if pod.num_gpu == 1 && milli < 1000 {
        return feasible
            .filter_map(|(i, n)| n.best_fit_gpu(milli).map(|g| (n.left[g], i, g)))
            .min()
            .map(|(_, i, g)| (i, vec![g]));
    }
    feasible
        .min_by_key(|(i, n)| (n.left.iter().filter(|&&l| l >= 1000).count(), *i))
        .map(|(i, n)| (i, n.first_idle(pod.num_gpu)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::tests::pod;

    fn node(name: &str, gpus: u32) -> TraceNode {
        TraceNode {
            name: name.into(),
            cpu_milli: 64_000,
            memory_mib: 262_144,
            gpu: gpus,
            model: "V100M16".into(),
            nvswitch: false,
        }
    }

    #[test]
    fn packs_pairs_that_an_unlucky_online_order_would_split() {
        // 2 GPUs; 600, 600, 400, 400 fit exactly as 600+400 twice. Largest first gets it.
        let nodes = [node("n0", 2)];
        let pods = [pod("a", 1, 400), pod("b", 1, 400), pod("c", 1, 600), pod("d", 1, 600)];
        let r = offline_best_fit_decreasing(&nodes, &pods, &WorkloadMix::default(), 7, 1.0);
        assert_eq!(r.pods, 4);
        assert_eq!(r.failed_pods, 0);
        assert_eq!(r.allocated_pct[REFERENCE_COLUMN], Some(100.0));
    }

    #[test]
    fn whole_gpus_go_where_they_fit_tightest() {
        // n1's 2 GPUs take one 2-GPU pod, n0 the other; the shares pair up 600+400 and 500+500
        let nodes = [node("n0", 4), node("n1", 2)];
        let pods = [
            pod("s1", 1, 500),
            pod("w2", 2, 1000),
            pod("s2", 1, 500),
            pod("s3", 1, 400),
            pod("w2b", 2, 1000),
            pod("s4", 1, 600),
        ];
        // demand equals capacity at tune 1: the order is neither grown nor trimmed
        let r = offline_best_fit_decreasing(&nodes, &pods, &WorkloadMix::default(), 1, 1.0);
        assert_eq!((r.pods, r.failed_pods), (6, 0));
        assert_eq!(r.allocated_pct[REFERENCE_COLUMN], Some(100.0));
        assert!(r.allocated_pct.iter().enumerate().all(|(k, v)| k == REFERENCE_COLUMN || v.is_none()));
    }
}
