//! The FGD paper's replay protocol: pod order per seed, resizing the workload to a target share of
//! cluster GPU capacity, and the typical request mix that fragmentation is measured against.

use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::placement::scorers::fragmentation::{MixEntry, WorkloadMix};
use crate::sim::trace::TracePod;

/// Share of requests the typical mix covers (FGD: 95 %).
pub const MIX_COVERAGE: f64 = 0.95;

/// The typical request mix of a pod list (CPU-only pods included), built from the original list.
pub fn typical_mix(pods: &[TracePod]) -> WorkloadMix {
    typical_mix_with(pods, MIX_COVERAGE)
}

/// The request mix covering `coverage` (0..=1) of the pods.
pub fn typical_mix_with(pods: &[TracePod], coverage: f64) -> WorkloadMix {
    WorkloadMix::from_requests(
        pods.iter().map(|p| MixEntry {
            gpus: if p.milli() == 0 { 0 } else { p.num_gpu },
            milli: p.milli(),
            cpu_milli: p.cpu_milli,
            memory_mib: p.memory_mib,
            models: p.models(),
            weight: 0.0,
        }),
        coverage,
    )
}

/// GPU request of a pod in thousandths of a GPU.
pub fn gpu_milli_total(p: &TracePod) -> u64 {
    u64::from(p.milli()) * u64::from(p.num_gpu)
}

/// The arrival order for one seed: sorted by name, shuffled, then trimmed or grown to `tune` times
/// the cluster's GPU capacity (`capacity_milli`).
///
/// Growing appends random copies of the original pods until the next copy would pass the target,
/// and trimming removes random pods until the total is at or below it, as the FGD simulator does
/// (its growth test compares the per-GPU share, which we keep so results stay comparable).
pub fn arrival_order(pods: &[TracePod], capacity_milli: u64, tune: f64, rng: &mut ChaCha8Rng) -> Vec<TracePod> {
    let mut sorted: Vec<TracePod> = pods.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut order = sorted.clone();
    order.shuffle(rng);
    let target = (tune * capacity_milli as f64) as u64;
    let mut total: u64 = order.iter().map(gpu_milli_total).sum();
    if total > target {
        while total > target && !order.is_empty() {
            let k = rng.random_range(0..order.len());
            total -= gpu_milli_total(&order[k]);
            order.remove(k);
        }
    } else if !sorted.is_empty() {
        let mut i = 0;
        loop {
            let s = &sorted[rng.random_range(0..sorted.len())];
            if total + u64::from(s.milli()) > target {
                break;
            }
            total += gpu_milli_total(s);
            let mut copy = s.clone();
            copy.name = format!("{}-tuned-{i}", s.name);
            order.push(copy);
            i += 1;
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::tests::pod;
    use rand::SeedableRng;

    #[test]
    fn grows_to_target_and_is_deterministic_per_seed() {
        let pods: Vec<TracePod> = (0..50).map(|i| pod(&format!("p{i:02}"), 1, 500)).collect();
        let order = arrival_order(&pods, 20_000, 1.3, &mut ChaCha8Rng::seed_from_u64(42));
        let total: u64 = order.iter().map(gpu_milli_total).sum();
        assert!(total <= 26_000 && total > 25_000, "{total}");
        assert_eq!(order, arrival_order(&pods, 20_000, 1.3, &mut ChaCha8Rng::seed_from_u64(42)));
        assert_ne!(order, arrival_order(&pods, 20_000, 1.3, &mut ChaCha8Rng::seed_from_u64(43)));
    }

    #[test]
    fn trims_to_target() {
        let pods: Vec<TracePod> = (0..50).map(|i| pod(&format!("p{i:02}"), 1, 1000)).collect();
        let order = arrival_order(&pods, 10_000, 1.3, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(order.iter().map(gpu_milli_total).sum::<u64>(), 13_000);
    }

    #[test]
    fn mix_keeps_popular_requests_and_normalizes() {
        let mut pods: Vec<TracePod> = (0..90).map(|i| pod(&format!("a{i}"), 1, 500)).collect();
        pods.extend((0..9).map(|i| pod(&format!("b{i}"), 2, 1000)));
        pods.push(pod("c", 0, 0));
        let mix = typical_mix(&pods);
        assert_eq!(mix.entries.len(), 2);
        let w: f64 = mix.entries.iter().map(|e| e.weight).sum();
        assert!((w - 1.0).abs() < 1e-9);
        assert_eq!(mix.entries[0].milli, 500);
    }
}
