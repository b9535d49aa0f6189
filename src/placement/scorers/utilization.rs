//! Live utilization: a bounded penalty for GPUs measured busier than what is allocated on them
//! (a tenant that exceeds its share slows its neighbours). Stale samples are ignored, and this never
//! filters a node out: measurements are noisy, allocations are the contract.

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, ScoreContext, Scorer};
use gpuplace_core::cluster::Node;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "utilization";

/// How much GPUs measured busier than allocated count; bounded, never a filter.
pub const DEFAULT_WEIGHT: f64 = 1.0;

#[derive(Debug, Default, Clone, Copy)]
pub struct UtilizationScorer;

/// Samples stamped this far ahead of now are taken as clock skew; further ahead, as garbage.
const FUTURE_SKEW_MS: i64 = 60_000;

/// How far a GPU's measured load exceeds its allocation, 0.0..=1.0 (0 when unknown or stale).
pub fn excess(ctx: &ScoreContext<'_>, node: &Node, g: usize) -> f64 {
    let Some(sample) = node.utilization(g) else { return 0.0 };
    if !is_fresh(sample.at_unix_ms, ctx.now_unix_ms, ctx.max_sample_age_ms) {
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

/// Whether a sample taken at `at` counts at `now`.
fn is_fresh(at: i64, now: i64, max_age_ms: i64) -> bool {
    // saturating: a corrupt timestamp must read as stale, not overflow (a panic, or a wrap to "fresh")
    let age = now.saturating_sub(at);
    !(age > max_age_ms || age < -FUTURE_SKEW_MS)
}

/// The span of time around `now`, `[from, until)`, in which every sample on `node` stays as fresh
/// or as stale as it is at `now`: a score computed at `now` holds throughout it, and no longer
/// (caches of per-node verdicts expire with it). `(i64::MIN, i64::MAX)` for a node without samples.
///
/// A sample counts while `at - FUTURE_SKEW_MS <= now <= at + max_age_ms`; computed exactly in
/// 128 bits, which agrees with `is_fresh`'s saturating arithmetic (where it saturates, the exact
/// age is out of range on the same side) for `max_age_ms >= 0`. Bounds are clamped inward.
pub fn stable_window(node: &Node, now: i64, max_age_ms: i64) -> (i64, i64) {
    let (mut from, mut until) = (i128::from(i64::MIN), i128::from(i64::MAX));
    let now128 = i128::from(now);
    for g in 0..node.gpus.len() {
        let Some(s) = node.utilization(g) else { continue };
        let at = i128::from(s.at_unix_ms);
        // the two instants where freshness flips: counted from the first, stale from the second
        for edge in [at - i128::from(FUTURE_SKEW_MS), at + i128::from(max_age_ms.max(0)) + 1] {
            if edge <= now128 {
                from = from.max(edge);
            } else {
                until = until.min(edge);
            }
        }
    }
    let clamp = |x: i128| x.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    (clamp(from), clamp(until))
}

impl Scorer for UtilizationScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, _data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        // the worst GPU of any container (a GPU seen twice changes nothing; none at all gives 1.0)
        let slices = placement.assignment.containers.iter().flat_map(|c| &c.slices);
        1.0 - slices.map(|s| excess(ctx, node, s.gpu as usize)).fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::placement::engine::Engine;
    use crate::placement::mix::WorkloadMix;
    use crate::placement::{
        profile::{Profile, ProfileConfig},
        registry::Weights,
    };
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_core::cluster::{Cluster, UtilSample};
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::{GpuDemand, PackingPolicy, PodRequest};

    const MEM: u64 = 16000;
    const NOW: i64 = 1_700_000_000_000;
    const MAX_AGE: i64 = 60_000;

    fn cluster(names: &[&str]) -> Cluster {
        let board = Board::Flat { gpus: 4, model: "V100".into(), memory_mib: MEM }.resolve(Path::new(".")).unwrap();
        Cluster::new(names.iter().map(|n| board.node(n, BTreeMap::new(), 0, 0)).collect())
    }

    fn assignment(pod: &str, node: &str, slices: Vec<GpuSlice>) -> PodAssignment {
        PodAssignment {
            pod: pod.into(),
            node: node.into(),
            containers: vec![ContainerAssignment { name: "c".into(), init: false, slices }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        }
    }

    fn sample(sm_pct: u32, mem_used_mib: u64, at_unix_ms: i64) -> Option<UtilSample> {
        Some(UtilSample { sm_pct, mem_used_mib, at_unix_ms })
    }

    /// The utilization score of a placement on `gpus` of node "n" at time `now`.
    fn score_at(c: &Cluster, gpus: &[u32], now: i64) -> f64 {
        let slices = gpus.iter().map(|&gpu| GpuSlice { gpu, mem_mib: 1000, core_pct: 10, exclusive: false }).collect();
        let placement = Placement { assignment: assignment("ns/new", "n", slices), set_scores: vec![0] };
        let req = PodRequest::single("ns/new", GpuDemand::Whole { gpus: 1 });
        let mix = WorkloadMix::default();
        let ctx = ScoreContext {
            cluster: c,
            request: &req,
            node_policy: PackingPolicy::Binpack,
            mix: &mix,
            now_unix_ms: now,
            max_sample_age_ms: MAX_AGE,
        };
        UtilizationScorer.score(&ctx, Data::NONE, &c.nodes()[0], &placement)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn busier_than_allocated_is_penalized_in_proportion() {
        let mut c = cluster(&["n"]);
        // GPU 1: a 30 % / 4000 MiB share; GPU 2: held whole
        c.allocate(assignment(
            "a/share",
            "n",
            vec![GpuSlice { gpu: 1, mem_mib: 4000, core_pct: 30, exclusive: false }],
        ))
        .unwrap();
        c.allocate(assignment("a/whole", "n", vec![GpuSlice { gpu: 2, mem_mib: MEM, core_pct: 100, exclusive: true }]))
            .unwrap();
        {
            let mut n = c.node_mut("n").unwrap();
            n.set_utilization(0, sample(80, 0, NOW)); // nothing allocated, 80 % busy
            n.set_utilization(1, sample(50, 4000, NOW)); // 20 points over its share
            n.set_utilization(2, sample(100, MEM, NOW)); // busy, but it is all allocated
            n.set_utilization(3, sample(0, 12000, NOW)); // memory nobody asked for: 75 % of the GPU
        }
        assert!(close(score_at(&c, &[0], NOW), 0.2));
        assert!(close(score_at(&c, &[1], NOW), 0.8));
        assert!(close(score_at(&c, &[2], NOW), 1.0));
        assert!(close(score_at(&c, &[3], NOW), 0.25));
        // a set is as good as its worst GPU
        assert!(close(score_at(&c, &[1, 2], NOW), 0.8));
        assert!(close(score_at(&c, &[0, 1, 2, 3], NOW), 0.2));
        // within its allocation is no penalty
        c.node_mut("n").unwrap().set_utilization(1, sample(30, 3000, NOW));
        assert!(close(score_at(&c, &[1], NOW), 1.0));
    }

    #[test]
    fn the_penalty_is_bounded() {
        let mut c = cluster(&["n"]);
        {
            let mut n = c.node_mut("n").unwrap();
            n.set_utilization(0, sample(u32::MAX, u64::MAX, NOW));
            n.set_utilization(1, sample(100, MEM * 3, NOW));
        }
        for g in [0, 1] {
            let s = score_at(&c, &[g], NOW);
            assert!((0.0..=1.0).contains(&s), "GPU {g}: {s}");
            assert!(close(s, 0.0), "GPU {g}: {s}");
        }
        // no GPU in the placement, nothing to penalize
        assert_eq!(score_at(&c, &[], NOW), 1.0);
    }

    #[test]
    fn stale_and_future_samples_are_ignored() {
        let mut c = cluster(&["n"]);
        {
            let mut n = c.node_mut("n").unwrap();
            n.set_utilization(0, sample(100, 0, NOW - MAX_AGE - 1)); // just too old
            n.set_utilization(1, sample(100, 0, NOW - MAX_AGE)); // just fresh enough
            n.set_utilization(2, sample(100, 0, NOW + 61_000)); // from the future: garbage
            n.set_utilization(3, sample(100, 0, NOW + 30_000)); // clock skew: counted
        }
        assert_eq!(score_at(&c, &[0], NOW), 1.0);
        assert!(close(score_at(&c, &[1], NOW), 0.0));
        assert_eq!(score_at(&c, &[2], NOW), 1.0);
        assert!(close(score_at(&c, &[3], NOW), 0.0));
        // extreme timestamps read as stale rather than overflowing
        {
            let mut n = c.node_mut("n").unwrap();
            n.set_utilization(0, sample(100, 0, i64::MIN));
            n.set_utilization(1, sample(100, 0, i64::MAX));
        }
        assert_eq!(score_at(&c, &[0], NOW), 1.0);
        assert_eq!(score_at(&c, &[1], NOW), 1.0);
        assert_eq!(score_at(&c, &[0], i64::MAX), 1.0);
        assert_eq!(score_at(&c, &[1], i64::MIN), 1.0);
        // no sample at all: no penalty
        assert_eq!(score_at(&cluster(&["n"]), &[0, 1, 2, 3], NOW), 1.0);
    }

    #[test]
    fn freshness_is_constant_within_the_stable_window() {
        let edges = |at: i64| [at.saturating_sub(60_000), at.saturating_add(MAX_AGE), at.saturating_add(MAX_AGE + 1)];
        for at in [NOW, NOW - MAX_AGE, NOW + 30_000, NOW + 61_000, 0, i64::MIN, i64::MAX, i64::MIN + 5, i64::MAX - 5] {
            let mut c = cluster(&["n"]);
            c.node_mut("n").unwrap().set_utilization(1, sample(100, 0, at));
            let node = &c.nodes()[0];
            let mut probes = vec![NOW, 0, i64::MIN, i64::MAX, NOW - 1, NOW + 1];
            for e in edges(at) {
                probes.extend([e.saturating_sub(1), e, e.saturating_add(1)]);
            }
            for now in probes {
                let (from, until) = stable_window(node, now, MAX_AGE);
                assert!(from <= now && (now < until || until == i64::MAX), "{at} {now}: [{from}, {until})");
                let fresh = is_fresh(at, now, MAX_AGE);
                let last = until.saturating_sub(1);
                for t in [from, from.saturating_add(1), now, last.saturating_sub(1), last] {
                    if t >= from && t <= last.max(from) {
                        assert_eq!(
                            is_fresh(at, t, MAX_AGE),
                            fresh,
                            "sample at {at}, now {now}, t {t}: [{from}, {until})"
                        );
                    }
                }
                if until != i64::MAX {
                    assert_ne!(is_fresh(at, until, MAX_AGE), fresh, "the window ends where freshness flips");
                }
            }
        }
        let c = cluster(&["n"]);
        assert_eq!(stable_window(&c.nodes()[0], NOW, MAX_AGE), (i64::MIN, i64::MAX), "no samples: forever");
    }

    #[test]
    fn never_a_filter() {
        // "hot": every GPU measured fully busy with nothing allocated; "cool": no samples
        let mut c = cluster(&["cool", "hot"]);
        {
            let mut hot = c.node_mut("hot").unwrap();
            for g in 0..4 {
                hot.set_utilization(g, sample(100, MEM, NOW));
            }
        }
        let req = PodRequest::single("ns/p", GpuDemand::Whole { gpus: 2 });
        let engine = Engine::default();
        let ev = engine.evaluate_all(&c, &req, NOW);
        assert!(ev.rejected.is_empty(), "{:?}", ev.rejected);
        let names: Vec<&str> = ev.ranked.iter().map(|r| c.nodes()[r.node].name.as_str()).collect();
        assert_eq!(names, ["cool", "hot"]);
        // the ranking keeps totals only; re-score in full for each scorer's part
        let full = |i: usize| {
            let cand = &ev.ranked[i];
            let p = cand.placement(&c, &req).unwrap();
            let s = engine.score(&c, &req, cand.node, &p, NOW);
            assert!(close(s.total, cand.total));
            s
        };
        let (cool, hot) = (&full(0), &full(1));
        assert!(hot.total > 0.0, "{hot:?}");
        let util = |s: &crate::placement::engine::NodeScore| s.parts.iter().find(|p| p.0 == "utilization").unwrap().1;
        assert!(close(util(hot), 0.0) && util(cool) > 0.0);
        // the whole difference is the utilization scorer's weighted share (the reserve, the model
        // supply and the whole units have nothing to say here: no class is scarce, no list short, no
        // NVLink board, so their weights are left out)
        let w = engine.profile.config.weights;
        let w = |name| w.get(name).expect("a registered scorer");
        let share = w(NAME) / (engine.profile.total_weight(false) - w("reserve") - w("model_supply") - w("whole"));
        assert!(close(cool.total - hot.total, share), "{} vs {}", cool.total - hot.total, share);
        // with utilization as the only scorer the hot node scores 0 but is still feasible
        let weights = Weights::none().with("utilization", 1.0);
        let only =
            Engine::new(Profile::new(ProfileConfig { weights, ..ProfileConfig::default() }), WorkloadMix::default());
        let ev = only.evaluate_all(&c, &req, NOW);
        assert_eq!(ev.ranked.len(), 2);
        assert!(ev.rejected.is_empty());
        // it is still chosen when it is the only node with room
        let mut c = c;
        c.allocate(assignment(
            "x/fill",
            "cool",
            (0..4).map(|gpu| GpuSlice { gpu, mem_mib: MEM, core_pct: 100, exclusive: true }).collect(),
        ))
        .unwrap();
        let a = only.schedule(&mut c, &req, NOW).unwrap();
        assert_eq!(a.node, "hot");
    }
}
