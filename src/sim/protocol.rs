//! The FGD paper's replay protocol: pod order per seed, resizing the workload to a target share of
//! cluster GPU capacity, and the typical request mix that fragmentation is measured against.

use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::placement::mix::{MixEntry, WorkloadMix};
use crate::placement::scorers::model_supply;
use crate::sim::trace::TracePod;

/// Share of requests the typical mix covers (FGD: 95 %).
pub const MIX_COVERAGE: f64 = 0.95;

/// The typical request mix of a pod list (CPU-only pods included), built from the original list.
pub fn typical_mix(pods: &[TracePod]) -> WorkloadMix {
    typical_mix_with(pods, MIX_COVERAGE)
}

/// The request mix covering `coverage` (0..=1) of the pods.
pub fn typical_mix_with(pods: &[TracePod], coverage: f64) -> WorkloadMix {
    let models: Vec<Vec<String>> = pods.iter().map(TracePod::models).collect();
    let bound = model_supply::bound_demand(pods.iter().zip(&models).map(|(p, m)| model_supply::Demand {
        models: m,
        count: 1.0,
        gpus: gpu_milli_total(p) as f64 / 1000.0,
        cpu_milli: p.cpu_milli as f64,
        memory_mib: p.memory_mib as f64,
    }));
    let mix = WorkloadMix::from_requests(
        pods.iter().map(|p| MixEntry {
            gpus: if p.milli() == 0 { 0 } else { p.num_gpu },
            milli: p.milli(),
            cpu_milli: p.cpu_milli,
            memory_mib: p.memory_mib,
            models: p.models(),
            weight: 0.0,
        }),
        coverage,
    );
    mix.with_bound(bound)
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
///
/// The protocol runs over *units*, a unit being one pod or all the pods of one group
/// (`TracePod::group`), so that a group's pods arrive together (a job's controller creates them at
/// once), are trimmed together, and are copied together (under a new group name) when the workload
/// grows. With every unit a single pod this is the paper's pod-by-pod protocol draw for draw: the
/// shuffle and the random picks depend only on the number of units.
pub fn arrival_order(pods: &[TracePod], capacity_milli: u64, tune: f64, rng: &mut ChaCha8Rng) -> Vec<TracePod> {
    let mut sorted: Vec<TracePod> = pods.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut units: Vec<Vec<TracePod>> = Vec::new();
    let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for p in sorted {
        match p.group.clone() {
            Some(g) => match at.get(&g) {
                Some(&u) => units[u].push(p),
                None => {
                    at.insert(g, units.len());
                    units.push(vec![p]);
                }
            },
            None => units.push(vec![p]),
        }
    }
    let milli = |u: &[TracePod]| u.iter().map(gpu_milli_total).sum::<u64>();
    let originals = units.clone();
    units.shuffle(rng);
    let target = (tune * capacity_milli as f64) as u64;
    let mut total: u64 = units.iter().map(|u| milli(u)).sum();
    if total > target {
        while total > target && !units.is_empty() {
            let k = rng.random_range(0..units.len());
            total -= milli(&units[k]);
            units.remove(k);
        }
    } else if !originals.is_empty() {
        let mut i = 0;
        loop {
            let u = &originals[rng.random_range(0..originals.len())];
            // a single pod's growth test compares its per-GPU share, as the pod-by-pod protocol does
            let step = if u.len() == 1 && u[0].group.is_none() { u64::from(u[0].milli()) } else { milli(u) };
            if total + step > target {
                break;
            }
            total += milli(u);
            let copy = u
                .iter()
                .map(|p| {
                    let mut c = p.clone();
                    c.name = format!("{}-tuned-{i}", p.name);
                    c.group = p.group.as_ref().map(|g| format!("{g}-tuned-{i}"));
                    c
                })
                .collect();
            units.push(copy);
            i += 1;
        }
    }
    units.into_iter().flatten().collect()
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
    fn a_groups_pods_arrive_together_and_are_trimmed_and_copied_whole() {
        let member =
            |g: usize, i: usize| TracePod { group: Some(format!("g{g}")), ..pod(&format!("g{g}-{i}"), 8, 1000) };
        let mut pods: Vec<TracePod> = (0..40).map(|i| pod(&format!("p{i:02}"), 1, 500)).collect();
        pods.extend((0..5).flat_map(|g| (0..4).map(move |i| member(g, i))));
        let check = |order: &[TracePod]| {
            let mut seen = std::collections::HashSet::new();
            let mut at = 0;
            while at < order.len() {
                if let Some(g) = &order[at].group {
                    assert!(seen.insert(g.clone()), "group {g} arrives in two pieces");
                    let n = order[at..].iter().take_while(|p| p.group.as_ref() == Some(g)).count();
                    assert_eq!(n, 4, "group {g}");
                    at += n;
                } else {
                    at += 1;
                }
            }
        };
        // grown (copies of whole groups under new names) and trimmed (whole groups dropped)
        for capacity in [400_000, 100_000, 30_000] {
            let order = arrival_order(&pods, capacity, 1.3, &mut ChaCha8Rng::seed_from_u64(7));
            check(&order);
            let total: u64 = order.iter().map(gpu_milli_total).sum();
            assert!(total <= (1.3 * capacity as f64) as u64, "{capacity}: {total}");
        }
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
