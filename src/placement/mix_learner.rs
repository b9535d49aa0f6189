//! The typical request mix, learned online from the requests a scheduler sees.
//!
//! Fragmentation is measured against the requests a cluster typically serves ([`WorkloadMix`]).
//! Nobody knows that mix in advance, so it is learned: every GPU pod that arrives is one
//! observation, older observations fade with a half-life counted in requests, and a small bundled
//! prior covers the cold start. The extender and the simulator's `gpuplace` policy use this same
//! learner, fed only with the pods that have arrived so far.
//!
//! Pure: no I/O, no clock. Decay is counted in observations, so a replay and a live cluster that
//! see the same requests in the same order learn the same mix.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::placement::mix::BoundDemand;
use crate::placement::mix::ReserveClass;
use crate::placement::mix::{MixEntry, WorkloadMix};
use crate::placement::scorers::model_supply;
use gpuplace_core::resources::PodRequest;

/// How the learner weighs what it sees.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LearnerConfig {
    /// Observations after which an observation counts half as much as a new one.
    pub half_life: f64,
    /// Weight of the prior, in observations (it does not fade: it only matters while few requests
    /// have been seen).
    pub prior_weight: f64,
    /// Share of the (weighted) requests the mix keeps, most popular first (FGD: 0.95).
    pub coverage: f64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        // a half-life of 2,000 requests left sampling noise of 0.03-0.07 in the mix (total
        // variation), above MIX_CHANGE, so the mix was retaken every check for nothing
        Self { half_life: 5000.0, prior_weight: 20.0, coverage: 0.95 }
    }
}

/// See [`MixLearner::refresh_due`].
pub const REFRESH_EVERY: u64 = 1024;

/// See [`MixLearner::refreshed`]: a change of the mix smaller than this (total variation) is not
/// taken. Replaying the openb `default` trace (seeds 42-51): 0.02 gave 4.48 percent unallocated at
/// 100 percent arrival, 0.05 gave 4.50-4.53 and 0.1 gave 4.65 (docs/performance-journal.md).
pub const MIX_CHANGE: f64 = 0.02;

/// The reserve (`scorers::reserve`) is kept for at most this many of the largest request types seen.
pub const RESERVE_TYPES: usize = 6;

/// A reserve keeps back at most this many free hosts: only the last few are protected.
pub const RESERVE_MAX_KEEP: u32 = 8;

/// A list of GPU models keeps back at most this many free hosts for the requests bound to it. With
/// a third of the GPU pods bound to a model (`default+gpuspec=33`, seeds 42-51), a cap of 8 gave
/// 29.19 percent unallocated at 75 percent arrival, 32 gave 29.08, 64 gave 29.06 and none 29.12
/// (FGD: 29.16; docs/performance-journal.md).
pub const MODEL_RESERVE_MAX_KEEP: u32 = 32;

/// At most this many lists of GPU models get a reserve class.
pub const MODEL_RESERVE_CLASSES: usize = 16;

/// A request type is a reserve class only while its faded count is at least this (observations).
const RESERVE_MIN_COUNT: f64 = 0.5;

/// How far apart two mixes are: the total variation distance of their weights (0 same, 1 disjoint),
/// where an entry whose typical host memory moved by more than a quarter counts as a different one.
pub fn mix_distance(a: &WorkloadMix, b: &WorkloadMix) -> f64 {
    let same = |x: &MixEntry, y: &MixEntry| {
        let (lo, hi) = (x.memory_mib.min(y.memory_mib), x.memory_mib.max(y.memory_mib));
        x.gpus == y.gpus
            && x.milli == y.milli
            && x.cpu_milli == y.cpu_milli
            && x.models == y.models
            && hi - lo <= hi / 4
    };
    let mut diff = 0.0;
    for x in &a.entries {
        let w = b.entries.iter().find(|y| same(x, y)).map_or(0.0, |y| y.weight);
        diff += (x.weight - w).abs();
    }
    for y in &b.entries {
        if !a.entries.iter().any(|x| same(x, y)) {
            diff += y.weight;
        }
    }
    diff / 2.0
}

/// Host memory values kept per request type for its median.
const MEMORY_SAMPLES: usize = 255;

/// A request type: GPUs, per-GPU share, host CPU and allowed models (host memory is summarized).
type Key = (u32, u32, u64, Vec<String>);

fn key_of(e: &MixEntry) -> Key {
    (e.gpus, e.milli, e.cpu_milli, e.models.clone())
}

/// The entry of a request type, weight 0.
fn entry_of((gpus, milli, cpu_milli, models): &Key, memory_mib: u64) -> MixEntry {
    MixEntry { gpus: *gpus, milli: *milli, cpu_milli: *cpu_milli, memory_mib, models: models.clone(), weight: 0.0 }
}

/// Larger request types first: GPUs times share, host CPU, then GPUs, share and models, so the order
/// never depends on hashing.
fn larger_type(a: &Key, b: &Key) -> std::cmp::Ordering {
    let size = |k: &Key| u64::from(k.0) * u64::from(k.1);
    size(b).cmp(&size(a)).then(b.2.cmp(&a.2)).then(b.0.cmp(&a.0)).then(b.1.cmp(&a.1)).then(a.3.cmp(&b.3))
}

/// The lower median of `values` (0 for none).
fn lower_median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct TypeStats {
    /// Decayed count, in the learner's current scale.
    weight: f64,
    /// The latest host memory values (MiB) of this type.
    memory: VecDeque<u64>,
}

/// What the learner knows, as it can be saved and restored (`gpuplace serve --mix-state`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixLearnerState {
    pub config: LearnerConfig,
    /// Requests seen (lifetime).
    pub observed: u64,
    /// (type, decayed weight normalized to the newest observation = 1, host memory samples).
    pub types: Vec<(MixEntry, f64, Vec<u64>)>,
}

/// Learns the typical request mix from observed requests. See the module documentation.
#[derive(Debug, Clone)]
pub struct MixLearner {
    config: LearnerConfig,
    prior: WorkloadMix,
    types: HashMap<Key, TypeStats>,
    /// Weight of the next observation. Grows by 2^(1/half_life) per observation (the same as
    /// decaying every older one), and everything is rescaled before it gets large.
    scale: f64,
    observed: u64,
    /// The last observation was of one of the [`RESERVE_TYPES`] largest types, or bound to GPU
    /// models: the reserve may have changed.
    reserve_may_change: bool,
}

impl Default for MixLearner {
    fn default() -> Self {
        Self::new(LearnerConfig::default(), bundled_prior())
    }
}

/// The cold-start prior: whole GPUs (1, 2, 4, 8) and common shares (half, quarter, a tenth), with
/// no host CPU or memory (unknown: never a limit). Deliberately generic, not fitted to any trace:
/// at the default weight, 200 observations outweigh it ten to one.
pub fn bundled_prior() -> WorkloadMix {
    let e = |gpus: u32, milli: u32, weight: f64| MixEntry {
        gpus,
        milli,
        cpu_milli: 0,
        memory_mib: 0,
        models: Vec::new(),
        weight,
    };
    WorkloadMix::new(
        vec![
            e(1, 1000, 0.30),
            e(1, 500, 0.20),
            e(1, 250, 0.15),
            e(1, 100, 0.10),
            e(2, 1000, 0.10),
            e(4, 1000, 0.08),
            e(8, 1000, 0.07),
        ],
        Vec::new(),
    )
}

impl MixLearner {
    pub fn new(config: LearnerConfig, prior: WorkloadMix) -> Self {
        Self { config, prior, types: HashMap::new(), scale: 1.0, observed: 0, reserve_may_change: false }
    }

    pub fn config(&self) -> LearnerConfig {
        self.config
    }

    /// Requests observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Whether the mix is looked at again now: after observations 1, 2, 4, .. 512, then every
    /// [`REFRESH_EVERY`]. Each new mix costs a re-evaluation of every node for every request shape
    /// (the simulator's replay of the openb trace: about 100,000 evaluations), so it is looked at
    /// often while the learner knows little, then rarely.
    pub fn refresh_due(&self) -> bool {
        let n = self.observed;
        n > 0 && if n < REFRESH_EVERY { n.is_power_of_two() } else { n.is_multiple_of(REFRESH_EVERY) }
    }

    /// The mix to score with from now on, when it differs from `current` by more than
    /// [`MIX_CHANGE`] ([`mix_distance`]) at a [`MixLearner::refresh_due`] point; `None` to keep
    /// `current`. A new mix invalidates every cached score, so it is not taken after every request,
    /// nor for changes too small to move a placement; the extender and the simulator follow this same
    /// rule, so they score with the same mix after the same requests.
    ///
    /// The reserve ([`MixLearner::reserve`]) is looked at also after every observation of one of the
    /// largest types, and a new one is taken whenever it differs: the next large request must not
    /// wait for a refresh point. When only the reserve changed, the entries stay `current`'s.
    pub fn refreshed(&self, current: &WorkloadMix) -> Option<WorkloadMix> {
        let due = self.refresh_due();
        if !due && !self.reserve_may_change {
            return None;
        }
        if due {
            let next = self.mix();
            if mix_distance(&next, current) > MIX_CHANGE {
                return Some(next);
            }
            // the bound demand moves scores only through which lists are short (the engine's
            // shared key), so a new one is taken at every refresh point without voiding caches
            return (next.reserve != current.reserve || next.bound != current.bound)
                .then(|| WorkloadMix::new(current.entries.clone(), next.reserve).with_bound(next.bound));
        }
        let reserve = self.reserve();
        (reserve != current.reserve)
            .then(|| WorkloadMix::new(current.entries.clone(), reserve).with_bound(current.bound.clone()))
    }

    /// Counts one arriving request (`weight` on an entry is ignored).
    pub fn observe(&mut self, e: &MixEntry) {
        let key = key_of(e);
        self.reserve_may_change = e.gpus > 0 && (!e.models.is_empty() || self.is_among_largest(&key));
        let scale = self.scale;
        let t = self.types.entry(key).or_default();
        t.weight += scale;
        if t.memory.len() == MEMORY_SAMPLES {
            t.memory.pop_front();
        }
        t.memory.push_back(e.memory_mib);
        self.observed += 1;
        let half_life = self.config.half_life.max(1.0);
        self.scale *= 2f64.powf(1.0 / half_life);
        if self.scale > 1e100 {
            self.rescale();
        }
    }

    /// Counts a pod's request, if it asks for GPUs. `gpu_memory_mib` turns a share given in memory
    /// into a share of a GPU (the cluster's typical GPU memory).
    pub fn observe_request(&mut self, req: &PodRequest, gpu_memory_mib: u64) {
        if let Some(e) = MixEntry::from_request(req, gpu_memory_mib) {
            self.observe(&e);
        }
    }

    /// Brings the weights back to a scale where the newest observation counts 1.
    fn rescale(&mut self) {
        let s = self.scale;
        for t in self.types.values_mut() {
            t.weight /= s;
        }
        // types that faded to nothing are forgotten
        self.types.retain(|_, t| t.weight > 1e-9);
        self.scale = 1.0;
    }

    /// The weight of the newest observation, in the learner's current scale.
    fn newest(&self) -> f64 {
        self.scale / 2f64.powf(1.0 / self.config.half_life.max(1.0))
    }

    /// Whether a type with `key` is, or would be, one of the [`RESERVE_TYPES`] largest counted ones.
    fn is_among_largest(&self, key: &Key) -> bool {
        let min = RESERVE_MIN_COUNT * self.newest();
        let larger =
            self.types.iter().filter(|(k, t)| *k != key && t.weight >= min && larger_type(k, key).is_lt()).count();
        larger < RESERVE_TYPES
    }

    /// The reserve: the [`RESERVE_TYPES`] largest GPU request types seen recently (GPUs times share,
    /// then host CPU; host memory is each type's median), each keeping back as many free hosts as
    /// requests needing such a host were seen recently (faded counts, as the mix's, of the types at
    /// least as large and as constrained: [`ReserveClass::needed_by`]), rounded up, at most
    /// [`RESERVE_MAX_KEEP`].
    pub fn reserve(&self) -> Vec<ReserveClass> {
        let newest = self.newest();
        let mut types: Vec<(&Key, &TypeStats)> = self.types.iter().filter(|(k, _)| k.0 > 0).collect();
        types.sort_by(|a, b| larger_type(a.0, b.0));
        let mut entries: Vec<(MixEntry, f64)> = Vec::new();
        let mut out = Vec::new();
        for (key, t) in types {
            let count = t.weight / newest;
            let entry = entry_of(key, lower_median(t.memory.iter().copied().collect()));
            if out.len() < RESERVE_TYPES && count >= RESERVE_MIN_COUNT {
                // a type needing this one's hosts is at least as large: it came before (or is it)
                entries.push((entry.clone(), count));
                let class = ReserveClass::of(&entry, 0);
                let demand: f64 = entries.iter().filter(|(d, _)| class.needed_by(d)).map(|(_, w)| w).sum();
                let keep = (demand - 1e-9).ceil().clamp(0.0, f64::from(RESERVE_MAX_KEEP)) as u32;
                out.push(ReserveClass { keep, ..class });
            } else {
                entries.push((entry, count));
            }
            if out.len() >= RESERVE_TYPES {
                break;
            }
        }
        out.extend(self.model_classes());
        out
    }

    /// One reserve class per list of GPU models that recent requests were bound to (`gpu_spec`):
    /// the smallest such request in GPUs, share, CPU and memory, keeping back as many free hosts as
    /// bound requests were seen recently (faded counts, rounded up, at most
    /// [`MODEL_RESERVE_MAX_KEEP`]); the [`MODEL_RESERVE_CLASSES`] most seen lists. Only requests
    /// bound to those models consume it, so pods that could run anywhere leave the last GPUs of a
    /// model to the pods that can run nowhere else.
    fn model_classes(&self) -> Vec<ReserveClass> {
        let newest = self.newest();
        let mut bound: BTreeMap<&[String], (MixEntry, f64)> = BTreeMap::new();
        for (key, t) in self.types.iter().filter(|(k, _)| k.0 > 0 && !k.3.is_empty()) {
            let e = entry_of(key, lower_median(t.memory.iter().copied().collect()));
            let slot = bound.entry(key.3.as_slice()).or_insert_with(|| (e.clone(), 0.0));
            slot.0.gpus = slot.0.gpus.min(e.gpus);
            slot.0.milli = slot.0.milli.min(e.milli);
            slot.0.cpu_milli = slot.0.cpu_milli.min(e.cpu_milli);
            slot.0.memory_mib = slot.0.memory_mib.min(e.memory_mib);
            slot.1 += t.weight / newest;
        }
        let cap = f64::from(MODEL_RESERVE_MAX_KEEP);
        let mut kept: Vec<(&[String], (MixEntry, f64))> =
            bound.into_iter().filter(|(_, (_, count))| *count >= RESERVE_MIN_COUNT).collect();
        // with more lists than classes, the most seen lists (a stable sort: ties in name order),
        // then back in name order
        kept.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        kept.truncate(MODEL_RESERVE_CLASSES);
        kept.sort_by(|a, b| a.0.cmp(b.0));
        kept.into_iter()
            .map(|(_, (e, count))| ReserveClass::of(&e, (count - 1e-9).ceil().clamp(0.0, cap) as u32))
            .collect()
    }

    /// The mix now: the observed types with their faded weights, plus the prior, the most popular
    /// kept until `coverage` of the weight is covered, normalized; and the reserve.
    pub fn mix(&self) -> WorkloadMix {
        // observed weights in units of "one new observation"; their sum is the effective count
        let newest = self.newest();
        let mut weighted: Vec<(MixEntry, f64)> = self
            .types
            .iter()
            .map(|(key, t)| (entry_of(key, lower_median(t.memory.iter().copied().collect())), t.weight / newest))
            .collect();
        let prior_total: f64 = self.prior.entries.iter().map(|e| e.weight).sum();
        if prior_total > 0.0 && self.config.prior_weight > 0.0 {
            for p in &self.prior.entries {
                let w = self.config.prior_weight * p.weight / prior_total;
                let key = key_of(p);
                match weighted.iter_mut().find(|(e, _)| key_of(e) == key) {
                    Some((_, x)) => *x += w,
                    None => weighted.push((MixEntry { weight: 0.0, ..p.clone() }, w)),
                }
            }
        }
        // most weight first; ties: larger requests first, so the order never depends on hashing
        weighted.sort_by(|(a, wa), (b, wb)| wb.total_cmp(wa).then(a.larger_first(b)));
        let total: f64 = weighted.iter().map(|(_, w)| w).sum();
        let mut covered = 0.0;
        let mut kept = Vec::new();
        for (e, w) in weighted {
            if total > 0.0 && covered >= self.config.coverage * total {
                break;
            }
            covered += w;
            kept.push((e, w));
        }
        let entries = kept
            .into_iter()
            .map(|(e, w)| MixEntry { weight: if covered > 0.0 { w / covered } else { 0.0 }, ..e })
            .collect();
        WorkloadMix::new(entries, self.reserve()).with_bound(self.bound_demand())
    }

    /// The share of the recent GPU demand bound to each list of models (faded counts, as the
    /// mix's; the prior is not demand): what `scorers::model_supply` keeps free GPUs for.
    pub fn bound_demand(&self) -> Vec<BoundDemand> {
        let newest = self.newest();
        model_supply::bound_demand(self.types.iter().filter(|(k, _)| k.0 > 0).map(|(k, t)| model_supply::Demand {
            models: &k.3,
            count: t.weight / newest,
            gpus: f64::from(k.0) * f64::from(k.1) / 1000.0,
            cpu_milli: k.2 as f64,
            memory_mib: lower_median(t.memory.iter().copied().collect()) as f64,
        }))
    }

    /// What to save; [`MixLearner::restore`] takes it back.
    pub fn state(&self) -> MixLearnerState {
        let mut types: Vec<(MixEntry, f64, Vec<u64>)> = self
            .types
            .iter()
            .map(|(key, t)| (entry_of(key, 0), t.weight / self.scale, t.memory.iter().copied().collect()))
            .collect();
        types.sort_by(|a, b| b.1.total_cmp(&a.1));
        MixLearnerState { config: self.config, observed: self.observed, types }
    }

    /// A learner that continues from `state` (its own config kept), with `prior`.
    pub fn restore(state: &MixLearnerState, prior: WorkloadMix) -> Self {
        let mut l = Self::new(state.config, prior);
        l.observed = state.observed;
        for (e, w, mem) in &state.types {
            if !(w.is_finite() && *w > 0.0) {
                continue;
            }
            let memory: VecDeque<u64> = mem.iter().rev().take(MEMORY_SAMPLES).rev().copied().collect();
            l.types.insert(key_of(e), TypeStats { weight: *w, memory });
        }
        l
    }
}

/// The GPU memory that turns a share asked in memory into a share of a GPU: the median over the
/// cluster's GPUs (0 for a cluster without GPUs).
pub fn typical_gpu_memory_mib(cluster: &gpuplace_core::cluster::Cluster) -> u64 {
    lower_median(cluster.nodes().iter().flat_map(|n| n.gpus.iter().map(|g| g.memory_mib)).collect())
}

impl MixEntry {
    /// The mix entry of a pod's request: its GPUs (app containers), the largest per-GPU share among
    /// them (a share given in memory taken on a GPU of `gpu_memory_mib`), host CPU and memory, and
    /// allowed models. `None` for a pod that asks for no GPU.
    pub fn from_request(req: &PodRequest, gpu_memory_mib: u64) -> Option<MixEntry> {
        let gpus = req.total_gpus();
        if gpus == 0 {
            return None;
        }
        let milli = req.containers.iter().map(|c| c.demand.milli_on(gpu_memory_mib)).max().unwrap_or(1000);
        Some(MixEntry::of_request(req, milli))
    }

    /// A pod's request as an entry of weight 0, with its per-GPU share (`milli`) read by the
    /// caller: its GPUs, host CPU and memory, and allowed models.
    pub(crate) fn of_request(req: &PodRequest, milli: u32) -> MixEntry {
        MixEntry {
            gpus: req.total_gpus(),
            milli,
            cpu_milli: req.cpu_milli,
            memory_mib: req.memory_mib,
            models: req.allowed_models.clone(),
            weight: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(gpus: u32, milli: u32, cpu_milli: u64) -> MixEntry {
        MixEntry { gpus, milli, cpu_milli, memory_mib: 1024, models: Vec::new(), weight: 0.0 }
    }

    #[test]
    fn the_demand_bound_to_model_lists_is_learned_with_the_mix() {
        let mut l = MixLearner::new(LearnerConfig { half_life: 1e12, ..LearnerConfig::default() }, bundled_prior());
        let t4 = MixEntry { models: vec!["T4".into()], ..entry(1, 500, 4000) };
        for i in 0..100 {
            l.observe(&if i % 5 == 0 { t4.clone() } else { entry(1, 1000, 8000) });
        }
        // 20 pods of half a T4 among 80 whole GPUs: 10 of 90 GPUs
        let bound = l.bound_demand();
        assert_eq!(bound.len(), 1);
        assert_eq!(bound[0].models, vec!["T4".to_string()]);
        assert!((bound[0].share - 10.0 / 90.0).abs() < 1e-9, "{bound:?}");
        assert!((bound[0].gpus_per_pod - 0.5).abs() < 1e-9 && (bound[0].cpu_milli_per_pod - 4000.0).abs() < 1e-6);
        assert_eq!(l.mix().bound, bound, "the mix carries it");
    }

    fn weight_of(mix: &WorkloadMix, gpus: u32, milli: u32) -> f64 {
        mix.entries.iter().filter(|e| e.gpus == gpus && e.milli == milli).map(|e| e.weight).sum()
    }

    #[test]
    fn a_cold_learner_is_its_prior() {
        let l = MixLearner::default();
        let mix = l.mix();
        assert!(!mix.is_empty());
        assert!((mix.entries.iter().map(|e| e.weight).sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(weight_of(&mix, 1, 1000) > 0.25);
    }

    #[test]
    fn what_it_sees_outweighs_the_prior_and_old_requests_fade() {
        let cfg = LearnerConfig { half_life: 100.0, prior_weight: 10.0, coverage: 1.0 };
        let mut l = MixLearner::new(cfg, bundled_prior());
        for _ in 0..1000 {
            l.observe(&entry(1, 300, 4000));
        }
        let mix = l.mix();
        assert!(weight_of(&mix, 1, 300) > 0.9, "{mix:?}");
        assert_eq!(mix.entries[0].cpu_milli, 4000);
        assert_eq!(mix.entries[0].memory_mib, 1024);
        // the workload changes: after 5 half-lives the old type is a few percent
        for _ in 0..500 {
            l.observe(&entry(2, 1000, 8000));
        }
        let mix = l.mix();
        assert!(weight_of(&mix, 2, 1000) > 0.9, "{mix:?}");
        assert!(weight_of(&mix, 1, 300) < 0.05, "{mix:?}");
        assert_eq!(l.observed(), 1500);
    }

    #[test]
    fn equal_observations_give_equal_weights_and_coverage_drops_the_tail() {
        let cfg = LearnerConfig { half_life: 1e9, prior_weight: 0.0, coverage: 0.9 };
        let mut l = MixLearner::new(cfg, bundled_prior());
        for i in 0..100 {
            l.observe(&entry(1, if i % 2 == 0 { 500 } else { 1000 }, 0));
        }
        for _ in 0..5 {
            l.observe(&entry(4, 1000, 0));
        }
        let mix = l.mix();
        assert_eq!(mix.entries.len(), 2, "the 5 percent tail is dropped: {mix:?}");
        assert!((weight_of(&mix, 1, 500) - 0.5).abs() < 1e-6);
    }

    #[test]
    fn rescaling_keeps_the_mix() {
        let cfg = LearnerConfig { half_life: 1.0, prior_weight: 0.0, coverage: 1.0 };
        let mut l = MixLearner::new(cfg, WorkloadMix::default());
        // half-life 1: the scale doubles per observation and is rescaled every ~330
        for i in 0..2000 {
            l.observe(&entry(1, if i % 4 == 0 { 250 } else { 500 }, 0));
        }
        let mix = l.mix();
        let total: f64 = mix.entries.iter().map(|e| e.weight).sum();
        assert!((total - 1.0).abs() < 1e-9 && mix.entries.iter().all(|e| e.weight.is_finite()), "{mix:?}");
        assert!(weight_of(&mix, 1, 500) > 0.5);
    }

    #[test]
    fn refreshes_often_at_first_then_every_1024() {
        let mut l = MixLearner::default();
        let mut due = Vec::new();
        for _ in 0..2100 {
            l.observe(&entry(1, 1000, 0));
            if l.refresh_due() && l.observed() < 200 {
                due.push(l.observed());
            }
        }
        assert_eq!(due, [1, 2, 4, 8, 16, 32, 64, 128]);
        assert!(l.refresh_due() == l.observed().is_multiple_of(REFRESH_EVERY));
    }

    #[test]
    fn a_new_mix_is_taken_only_when_it_moved() {
        let mut l = MixLearner::default();
        let mut current = l.mix();
        let (mut taken, mut reserve_only) = (0, 0);
        for i in 0..5000u64 {
            l.observe(&entry(1, if i % 2 == 0 { 500 } else { 1000 }, 0));
            if let Some(m) = l.refreshed(&current) {
                if mix_distance(&m, &current) > MIX_CHANGE {
                    taken += 1;
                } else {
                    // only the reserve moved (its keeps grow with the first observations)
                    assert!(m.reserve != current.reserve && m.entries == current.entries);
                    reserve_only += 1;
                }
                current = m;
            }
        }
        assert!(reserve_only <= 2 * RESERVE_MAX_KEEP, "{reserve_only}");
        // the prior gives way at first; a steady workload then stops moving the mix
        assert!((1..=12).contains(&taken), "{taken}");
        assert!((weight_of(&current, 1, 500) - 0.5).abs() < 0.05, "{current:?}");
        assert_eq!(mix_distance(&current, &current), 0.0);
        assert!((mix_distance(&current, &WorkloadMix::default()) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn the_reserve_keeps_hosts_for_the_largest_types_seen_and_is_taken_at_once() {
        let mut l = MixLearner::default();
        let mut current = l.mix();
        for _ in 0..1500 {
            l.observe(&entry(1, 500, 4000));
        }
        let mut big = entry(8, 1000, 120_000);
        big.memory_mib = 700_000;
        l.observe(&big);
        // observation 1501 is no refresh point, yet the new reserve is taken, with the old entries
        assert!(!l.refresh_due());
        current = l.refreshed(&current).inspect(|m| assert_eq!(m.entries, current.entries)).unwrap_or(current);
        assert_eq!(
            current.reserve.first().map(|c| (c.gpus, c.cpu_milli, c.memory_mib, c.keep)),
            Some((8, 120_000, 700_000, 1))
        );
        // a type at least as large counts for the smaller one's hosts too; the smallest types are
        // not reserved for
        let mut huge = entry(8, 1000, 128_000);
        huge.memory_mib = 750_000;
        l.observe(&huge);
        l.observe(&huge);
        let r = l.reserve();
        assert_eq!(
            r.iter().map(|c| (c.cpu_milli, c.keep)).collect::<Vec<_>>(),
            [(128_000, 2), (120_000, 3), (4000, 1500)].map(|(c, k)| (c, k.min(RESERVE_MAX_KEEP)))
        );
        assert!(l.refreshed(&current).is_some());
        // an observation that moves no keep gives no new mix away from the refresh points
        l.observe(&entry(1, 500, 4000));
        assert!(l.refreshed(&l.mix()).is_none());
    }

    #[test]
    fn requests_bound_to_models_get_a_class_per_list_of_models() {
        let mut l = MixLearner::default();
        for _ in 0..100 {
            l.observe(&entry(1, 1000, 4000));
        }
        let bound = |gpus, milli, cpu, models: &[&str]| MixEntry {
            models: models.iter().map(|m| m.to_string()).collect(),
            ..entry(gpus, milli, cpu)
        };
        let current = l.mix();
        for _ in 0..3 {
            l.observe(&bound(1, 1000, 8000, &["P100"]));
        }
        l.observe(&bound(2, 500, 6000, &["P100"]));
        // taken at once, away from the refresh points
        assert!(!l.refresh_due());
        let taken = l.refreshed(&current).expect("a new reserve");
        let p100: Vec<_> = taken.reserve.iter().filter(|c| c.models == ["P100"] && c.keep == 4).collect();
        // the smallest bound request in each respect, keeping a host per bound request seen
        assert_eq!(p100.iter().map(|c| (c.gpus, c.milli, c.cpu_milli)).collect::<Vec<_>>(), [(1, 500, 6000)]);
        for _ in 0..2 * MODEL_RESERVE_MAX_KEEP {
            l.observe(&bound(1, 1000, 8000, &["V100M16", "V100M32"]));
        }
        let r = l.reserve();
        // the model classes follow the largest types' (which may name models too)
        let v100 = r.iter().rev().find(|c| c.models == ["V100M16", "V100M32"]).expect("a class for the second list");
        assert_eq!(v100.keep, MODEL_RESERVE_MAX_KEEP);
        // requests that may run anywhere get no model class
        assert!(r.iter().all(|c| !c.models.is_empty() || c.cpu_milli != 8000));
    }

    #[test]
    fn with_more_lists_of_models_than_classes_the_most_seen_lists_get_them() {
        let mut l = MixLearner::default();
        for _ in 0..100 {
            l.observe(&entry(1, 1000, 4000));
        }
        let bound = |model: String| MixEntry { models: vec![model], ..entry(1, 1000, 8000) };
        // lists "M00".."M19", each seen 3 times, except "M00" (first in name order) seen twice and
        // "M19" (last) seen 9 times
        for i in 0..MODEL_RESERVE_CLASSES + 4 {
            let times = match i {
                0 => 2,
                i if i == MODEL_RESERVE_CLASSES + 3 => 9,
                _ => 3,
            };
            for _ in 0..times {
                l.observe(&bound(format!("M{i:02}")));
            }
        }
        let lists: Vec<String> =
            l.model_classes().iter().map(|c| c.models.first().cloned().unwrap_or_default()).collect();
        assert_eq!(lists.len(), MODEL_RESERVE_CLASSES);
        assert!(lists.contains(&format!("M{:02}", MODEL_RESERVE_CLASSES + 3)), "the most seen list: {lists:?}");
        assert!(!lists.contains(&"M00".to_string()), "the least seen list: {lists:?}");
        let mut sorted = lists.clone();
        sorted.sort();
        assert_eq!(lists, sorted, "in name order");
    }

    #[test]
    fn state_round_trips() {
        let mut l = MixLearner::default();
        for i in 0..300 {
            l.observe(&entry(1 + i % 3, 1000, 1000 * u64::from(i % 5)));
        }
        let text = serde_json::to_string(&l.state()).unwrap();
        let back = MixLearner::restore(&serde_json::from_str(&text).unwrap(), bundled_prior());
        assert_eq!(back.observed(), 300);
        let (a, b) = (l.mix(), back.mix());
        assert_eq!(a.entries.len(), b.entries.len());
        for (x, y) in a.entries.iter().zip(&b.entries) {
            assert_eq!((x.gpus, x.milli, x.cpu_milli, x.memory_mib), (y.gpus, y.milli, y.cpu_milli, y.memory_mib));
            assert!((x.weight - y.weight).abs() < 1e-9);
        }
    }

    #[test]
    fn requests_become_entries() {
        use gpuplace_core::resources::{GpuDemand, MemoryDemand};
        let mut r =
            PodRequest::single("p", GpuDemand::Shared { gpus: 1, memory: MemoryDemand::Mib(8192), core_pct: 20 });
        r.cpu_milli = 4000;
        // 8 GiB of a 32 GiB GPU is a quarter, more than 20 percent of compute
        let e = MixEntry::from_request(&r, 32768).unwrap();
        assert_eq!((e.gpus, e.milli, e.cpu_milli), (1, 250, 4000));
        let whole = PodRequest::single("w", GpuDemand::Whole { gpus: 4 });
        assert_eq!(MixEntry::from_request(&whole, 32768).map(|e| (e.gpus, e.milli)), Some((4, 1000)));
        let mut cpu_only = whole.clone();
        cpu_only.containers.clear();
        assert!(MixEntry::from_request(&cpu_only, 32768).is_none());
    }
}
