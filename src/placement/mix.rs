//! The typical request mix and what is measured against it.
//!
//! [`WorkloadMix`] holds the request types the workload is made of ([`MixEntry`], with how often
//! each comes), the reserve classes whose last hosts are kept back ([`ReserveClass`],
//! `scorers::reserve`) and the GPU demand bound to lists of models ([`BoundDemand`],
//! `scorers::model_supply`). The extender and the simulator learn it online
//! (`placement::mix_learner`); FGD is given it in advance.
//!
//! The fragmentation measure lives here too, because the GPU choice (`placement::gpu_select`) reads
//! it as well as the fragmentation scorer. In the spirit of FGD (Weng et al., USENIX ATC '23): for
//! each typical request `t` with weight `p_t`, a node's idle GPU share counts as fragment:
//! - all of it, when `t` cannot run there at all (model, host CPU, or not enough GPUs with room), or
//!   when `t` needs no GPU (GPUs idle beside CPU-only work are stranded for it);
//! - otherwise only the GPUs whose free share is smaller than what `t` needs per GPU.
//!
//! The node's fragmentation is the weighted sum; a good placement is one that raises it least.
//!
//! gpuplace's measure ([`WorkloadMix::fragmentation`]) extends FGD's with the host: FGD asks only
//! whether *one* request of type `t` still fits the node's CPU, so 8 idle GPUs beside 12 free cores
//! look fine for 11-core pods although 7 of those GPUs can never be fed. Here the GPUs that `t` could
//! use are capped by how many `t` requests the node's free CPU and host memory can still hold; the
//! rest count as fragment. On the Alibaba trace this alone cuts FGD's unallocated GPUs by a tenth
//! (docs/performance-journal.md). It also weighs each type by its popularity over the square root of
//! the GPUs it takes ([`MixEntry::gap_weight`]), not by popularity alone. The paper's own measure
//! stays available as [`WorkloadMix::fgd_fragmentation`] for the FGD baseline and for reporting
//! comparable fragment rates.

use serde::{Deserialize, Serialize};

use gpuplace_core::cluster::Node;

/// One typical request of the workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixEntry {
    /// GPUs it spans (0 for CPU-only work).
    pub gpus: u32,
    /// Share of each GPU, in thousandths (1000 = whole GPU).
    pub milli: u32,
    /// Host CPU it needs, in millicores.
    pub cpu_milli: u64,
    /// Host memory it typically needs, in MiB (the median over the requests of this type; 0 = not
    /// known, which never limits).
    #[serde(default)]
    pub memory_mib: u64,
    /// Allowed GPU models; empty means any.
    pub models: Vec<String>,
    /// Popularity; the weights of a mix sum to 1.
    pub weight: f64,
}

/// The typical request mix a cluster serves.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkloadMix {
    pub entries: Vec<MixEntry>,
    /// The largest request types seen, whose last free hosts are kept back (`scorers::reserve`);
    /// none in a mix given without them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserve: Vec<ReserveClass>,
    /// The share of the GPU demand bound to each list of GPU models (`scorers::model_supply`);
    /// none in a mix given without it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bound: Vec<BoundDemand>,
    /// The entries' [`MixEntry::gap_weight`]s, normalized, worked out on first use: the measure runs
    /// for every candidate GPU of every node, and the square roots were half its time. A mix is
    /// built, not edited; an entry added or removed later is noticed (the length differs) and the
    /// weights are then worked out on each call.
    #[serde(skip)]
    gap_weights: std::sync::OnceLock<Vec<f64>>,
}

/// Two mixes are equal when their entries and reserve are (the cached weights follow from them).
impl PartialEq for WorkloadMix {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries && self.reserve == other.reserve && self.bound == other.bound
    }
}

impl WorkloadMix {
    /// A mix of `entries` (their weights: popularity, summing to 1) and `reserve` classes.
    pub fn new(entries: Vec<MixEntry>, reserve: Vec<ReserveClass>) -> Self {
        Self { entries, reserve, bound: Vec::new(), gap_weights: Default::default() }
    }

    /// The same mix with `bound` as its demand bound to model lists.
    pub fn with_bound(mut self, bound: Vec<BoundDemand>) -> Self {
        self.bound = bound;
        self
    }

    /// Each entry's `gap_weight`, normalized to sum to 1 (all 0 when they sum to 0).
    fn gap_weights(&self) -> std::borrow::Cow<'_, [f64]> {
        let compute = || {
            let w: Vec<f64> = self.entries.iter().map(MixEntry::gap_weight).collect();
            let total: f64 = w.iter().sum();
            w.into_iter().map(|x| if total > 0.0 { x / total } else { 0.0 }).collect::<Vec<f64>>()
        };
        let cached = self.gap_weights.get_or_init(compute);
        if cached.len() == self.entries.len() {
            std::borrow::Cow::Borrowed(cached.as_slice())
        } else {
            std::borrow::Cow::Owned(compute())
        }
    }

    /// Builds a mix from observed requests: counts each distinct request, keeps the most popular
    /// ones until `coverage` (0..=1) of all requests is covered, and normalizes their weights.
    pub fn from_requests(requests: impl IntoIterator<Item = MixEntry>, coverage: f64) -> Self {
        let mut counts: Vec<(MixEntry, u64)> = Vec::new();
        let mut memories: Vec<Vec<u64>> = Vec::new();
        let mut index: std::collections::HashMap<(u32, u32, u64, Vec<String>), usize> = Default::default();
        let mut total = 0u64;
        for r in requests {
            total += 1;
            // FGD's key: host memory varies within a type, so it is summarized, not split on
            let key = (r.gpus, r.milli, r.cpu_milli, r.models.clone());
            match index.get(&key) {
                Some(&i) => {
                    counts[i].1 += 1;
                    memories[i].push(r.memory_mib);
                }
                None => {
                    index.insert(key, counts.len());
                    memories.push(vec![r.memory_mib]);
                    counts.push((r, 1));
                }
            }
        }
        for ((e, _), mut m) in counts.iter_mut().zip(memories) {
            m.sort_unstable();
            e.memory_mib = m[(m.len() - 1) / 2];
        }
        // most popular first; equal counts: larger requests first, so the order is deterministic
        counts.sort_by(|(a, ca), (b, cb)| cb.cmp(ca).then(a.larger_first(b)));
        let mut kept = Vec::new();
        let mut covered = 0u64;
        for (e, c) in counts {
            if total > 0 && covered as f64 >= coverage * total as f64 {
                break;
            }
            covered += c;
            kept.push((e, c));
        }
        let entries = kept
            .into_iter()
            .map(|(mut e, c)| {
                e.weight = c as f64 / covered.max(1) as f64;
                e
            })
            .collect();
        Self::new(entries, Vec::new())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// FGD's fragmentation (in thousandths of a GPU) of a node whose GPUs have `free_milli` left,
    /// with `cpu_left` millicores free (`None` when host CPU is not tracked) and GPU model `model`.
    /// Kept exactly as the paper defines it, for the FGD baseline and comparable fragment rates.
    pub fn fgd_fragmentation(&self, free_milli: &[u32], cpu_left: Option<u64>, model: &str) -> f64 {
        let idle: u32 = free_milli.iter().sum();
        if idle == 0 {
            return 0.0;
        }
        let idle = f64::from(idle);
        let mut frag = 0.0;
        for t in &self.entries {
            let cpu_ok = cpu_left.is_none_or(|c| c >= t.cpu_milli);
            if !t.wants_gpus_of(model) || !cpu_ok {
                frag += t.weight * idle;
                continue;
            }
            let (mut fit, mut stranded) = (0u32, 0u32);
            for &f in free_milli {
                if f >= t.milli {
                    fit += 1;
                } else {
                    stranded += f;
                }
            }
            frag += t.weight * if fit >= t.gpus { f64::from(stranded) } else { idle };
        }
        frag
    }

    /// gpuplace's fragmentation (thousandths of a GPU): FGD's, with the GPUs each typical request
    /// could use capped by how many such requests the host's free CPU and memory still hold, and the
    /// types weighted toward small requests ([`MixEntry::gap_weight`]); except on a GPU model that
    /// some typical request is bound to (a `gpu_spec`), where it is FGD's.
    ///
    /// Why not host-aware there: a node whose host can feed fewer of its GPUs than it has counts its
    /// unfed GPUs as fragment, so any pod that fills them lowers the measure. On a model that pods
    /// are bound to, those pods could run nowhere else, and the pull toward such nodes handed their
    /// GPUs to pods that could run anywhere: with a third of the GPU pods bound to a model
    /// (`default+gpuspec=33`, seeds 42-51) the bound pods then failed from a quarter of the cluster
    /// free on, and gpuplace left 29.68 percent unallocated at 75 percent arrival against FGD's
    /// 29.16 (29.30 with FGD's measure on such models; docs/performance-journal.md).
    pub fn fragmentation(&self, free_milli: &[u32], host: HostFree, model: &str) -> f64 {
        let n = free_milli.len().min(64);
        if self.binds_model(model) {
            return self.fgd_fragmentation(&free_milli[..n], host.cpu_milli, model);
        }
        let mut sorted = [0u32; 64];
        sorted[..n].copy_from_slice(&free_milli[..n]);
        // most free first, so "the GPUs t would use" are a prefix
        sorted[..n].sort_unstable_by(|a, b| b.cmp(a));
        let mut prefix = [0u32; 65];
        for i in 0..n {
            prefix[i + 1] = prefix[i] + sorted[i];
        }
        let idle = prefix[n];
        if idle == 0 {
            return 0.0;
        }
        let weights = self.gap_weights();
        let mut frag = 0.0;
        for (t, &w) in self.entries.iter().zip(weights.iter()) {
            if !t.wants_gpus_of(model) {
                frag += w * f64::from(idle);
                continue;
            }
            let fit = sorted[..n].partition_point(|&f| f >= t.milli);
            let fed = host.requests_of(t).saturating_mul(t.gpus as usize);
            let usable = if fit < t.gpus as usize { 0 } else { prefix[fit.min(fed)] };
            frag += w * f64::from(idle - usable);
        }
        frag
    }

    /// Whether some typical GPU request of the mix is bound to GPUs of `model` (and so
    /// [`WorkloadMix::fragmentation`] is FGD's measure on nodes of that model).
    pub fn binds_model(&self, model: &str) -> bool {
        self.entries.iter().any(|t| t.wants_gpus_of(model) && !t.models.is_empty())
    }
}

impl MixEntry {
    /// Orders larger requests first (host CPU, then share, GPUs, models): the tie-break that keeps a
    /// mix's order deterministic among equally popular types.
    pub fn larger_first(&self, other: &MixEntry) -> std::cmp::Ordering {
        other
            .cpu_milli
            .cmp(&self.cpu_milli)
            .then(other.milli.cmp(&self.milli))
            .then(other.gpus.cmp(&self.gpus))
            .then(other.models.cmp(&self.models))
    }

    /// Its weight in gpuplace's measure ([`WorkloadMix::fragmentation`]): its popularity divided by
    /// the square root of the GPUs it takes (`gpus x milli / 1000`; CPU-only types count as 1).
    ///
    /// Why not popularity alone, as in FGD: a large type counts every idle GPU of a partly used node
    /// as fragment, so popularity weights let the few 4- and 8-GPU types pull every share toward
    /// the already used nodes, although the reserve scorer keeps their hosts back anyway. The gaps
    /// that a share leaves are filled by the many small requests, and they are what the measure
    /// should protect. Exponents tried on 26 workloads and two seed sets
    /// (docs/performance-journal.md, "The fragmentation measure"): 0 (popularity) left `default` at
    /// 4.46 percent unallocated at 100 percent arrival, -0.5 at 4.29, -0.7 at 4.22; -1 began to turn
    /// multi-GPU pods away before 75 percent arrival where FGD places them (`multigpu=40`, `=45`).
    pub fn gap_weight(&self) -> f64 {
        let gpus = f64::from(self.gpus) * f64::from(self.milli) / 1000.0;
        if gpus > 0.0 {
            self.weight / gpus.sqrt()
        } else {
            self.weight
        }
    }

    /// Whether this request type may run on GPUs of `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m.eq_ignore_ascii_case(model))
    }

    /// Whether this request could use GPUs of `model` at all (CPU-only requests cannot).
    fn wants_gpus_of(&self, model: &str) -> bool {
        self.gpus > 0 && self.allows(model)
    }
}

/// A node's free host resources; `None` where the node does not track them (never a limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostFree {
    pub cpu_milli: Option<u64>,
    pub memory_mib: Option<u64>,
}

impl HostFree {
    /// What `node` has free after taking `cpu_milli` and `memory_mib` more.
    pub fn of(node: &Node, cpu_milli: u64, memory_mib: u64) -> Self {
        Self {
            cpu_milli: (node.cpu_milli > 0).then(|| node.cpu_free().saturating_sub(cpu_milli)),
            memory_mib: (node.memory_mib > 0).then(|| node.mem_free().saturating_sub(memory_mib)),
        }
    }

    /// How many requests of type `t` the host could still hold.
    fn requests_of(&self, t: &MixEntry) -> usize {
        let by = |free: Option<u64>, need: u64| match free {
            Some(f) if need > 0 => usize::try_from(f / need).unwrap_or(usize::MAX),
            _ => usize::MAX,
        };
        by(self.cpu_milli, t.cpu_milli).min(by(self.memory_mib, t.memory_mib))
    }
}

/// A request type whose last free hosts are kept back.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReserveClass {
    /// GPUs one request spans.
    pub gpus: u32,
    /// Share of each GPU, in thousandths.
    pub milli: u32,
    /// Host CPU, in millicores.
    pub cpu_milli: u64,
    /// Host memory, in MiB (the type's median).
    pub memory_mib: u64,
    /// Allowed GPU models; empty means any.
    pub models: Vec<String>,
    /// Free hosts kept back: the class is scarce while at most this many are left.
    pub keep: u32,
}

impl ReserveClass {
    /// The class of a mix entry (its weight dropped).
    pub fn of(e: &MixEntry, keep: u32) -> Self {
        Self {
            gpus: e.gpus,
            milli: e.milli,
            cpu_milli: e.cpu_milli,
            memory_mib: e.memory_mib,
            models: e.models.clone(),
            keep,
        }
    }

    fn allows(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m.eq_ignore_ascii_case(model))
    }

    /// Whether one request of this class fits GPUs with `free_milli` free (healthy ones; 0 for the
    /// others) and a host with `host` free, on GPUs of `model`.
    pub fn fits(&self, free_milli: impl Iterator<Item = u32>, host: HostFree, model: &str) -> bool {
        host.cpu_milli.is_none_or(|c| c >= self.cpu_milli)
            && host.memory_mib.is_none_or(|m| m >= self.memory_mib)
            && self.allows(model)
            && free_milli.filter(|&f| f >= self.milli).take(self.gpus as usize).count() >= self.gpus as usize
    }

    /// Whether a request `r` may only run on models this class keeps hosts of (always, for a class
    /// that names no model).
    fn covers_models_of(&self, r: &MixEntry) -> bool {
        self.models.is_empty() || (!r.models.is_empty() && r.models.iter().all(|m| self.allows(m)))
    }

    /// Whether `node` is a free host of this class now.
    pub fn hosted_by(&self, node: &Node) -> bool {
        let model = node.gpus.first().map_or("", |g| g.model.as_str());
        self.fits((0..node.gpus.len()).map(|g| node.free_milli(g)), HostFree::of(node, 0, 0), model)
    }

    /// Whether a request `r` is at least as large as this class in GPUs, share, CPU and memory: such
    /// a request is what the reserve is kept for, so taking a reserved host is no loss.
    /// A class that names GPU models is kept for requests bound to those models only.
    pub fn is_consumed_by(&self, r: &MixEntry) -> bool {
        let models = self.covers_models_of(r);
        models
            && r.gpus >= self.gpus
            && r.milli >= self.milli
            && r.cpu_milli >= self.cpu_milli
            && r.memory_mib >= self.memory_mib
    }

    /// Whether a request `r` needs one of the hosts this class keeps back: it takes at least as
    /// many GPUs, share and host CPU, on models among this class's. Host memory is left out: it is
    /// a type's median, and two large types that differ only in it (120 cores with 720 or with 625
    /// GiB) compete for the same nearly empty nodes.
    pub fn needed_by(&self, r: &MixEntry) -> bool {
        let models = self.covers_models_of(r);
        r.gpus >= self.gpus && r.milli >= self.milli && r.cpu_milli >= self.cpu_milli && models
    }
}

/// A list of GPU models, the share of the arriving GPU demand bound to exactly that list, and the
/// host those requests need per GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundDemand {
    /// The models, sorted, each once.
    pub models: Vec<String>,
    /// GPUs requested by pods bound to this list, over the GPUs requested by all GPU pods (0..=1).
    pub share: f64,
    /// What one of those pods asks on average: GPUs (a share as its fraction), host CPU
    /// (millicores) and memory (MiB). A node's free GPUs are of use to them only as far as its host
    /// can still take such pods whole.
    pub gpus_per_pod: f64,
    pub cpu_milli_per_pod: f64,
    pub memory_mib_per_pod: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(gpus: u32, milli: u32, cpu_milli: u64, memory_mib: u64, weight: f64) -> MixEntry {
        MixEntry { gpus, milli, cpu_milli, memory_mib, models: Vec::new(), weight }
    }

    const UNLIMITED: HostFree = HostFree { cpu_milli: None, memory_mib: None };

    #[test]
    fn fgd_measure_counts_gpus_too_small_for_each_type() {
        // half the requests want a whole GPU, half want 0.5 of one
        let mix =
            WorkloadMix { entries: vec![entry(1, 1000, 0, 0, 0.5), entry(1, 500, 0, 0, 0.5)], ..Default::default() };
        let free = [1000, 600, 300, 0];
        // whole: 600 + 300 are fragments; half: only 300
        assert_eq!(mix.fgd_fragmentation(&free, None, "H100"), 0.5 * 900.0 + 0.5 * 300.0);
        // one more whole request would not fit the CPU: all idle share is fragment for both types
        let cpu_bound = WorkloadMix { entries: vec![entry(1, 1000, 4000, 0, 1.0)], ..Default::default() };
        assert_eq!(cpu_bound.fgd_fragmentation(&free, Some(3999), "H100"), 1900.0);
        assert_eq!(cpu_bound.fgd_fragmentation(&free, Some(4000), "H100"), 900.0);
    }

    /// The mix with each type's weight replaced by its normalized `gap_weight`.
    fn gap_weighted(mix: &WorkloadMix) -> WorkloadMix {
        let total: f64 = mix.entries.iter().map(MixEntry::gap_weight).sum();
        let entries = mix.entries.iter().map(|e| MixEntry { weight: e.gap_weight() / total, ..e.clone() }).collect();
        WorkloadMix { entries, ..Default::default() }
    }

    #[test]
    fn small_requests_weigh_more_than_their_popularity() {
        // a whole GPU weighs its popularity; 4 GPUs half of theirs; a quarter GPU twice
        assert_eq!(entry(1, 1000, 0, 0, 0.3).gap_weight(), 0.3);
        assert_eq!(entry(4, 1000, 0, 0, 0.3).gap_weight(), 0.15);
        assert_eq!(entry(1, 250, 0, 0, 0.3).gap_weight(), 0.6);
        assert_eq!(entry(0, 0, 4000, 0, 0.1).gap_weight(), 0.1);
        // equally popular 8-GPU and quarter-GPU types: a node with one busy GPU of 8 is fragment
        // for the 8-GPU type (all 7 idle GPUs) and not at all for the quarter
        let mix =
            WorkloadMix { entries: vec![entry(8, 1000, 0, 0, 0.5), entry(1, 250, 0, 0, 0.5)], ..Default::default() };
        let free = [0, 1000, 1000, 1000, 1000, 1000, 1000, 1000];
        let (big, small) = (0.5 / 8f64.sqrt(), 0.5 / 0.25f64.sqrt());
        let expected = big / (big + small) * 7000.0;
        assert!((mix.fragmentation(&free, UNLIMITED, "A100") - expected).abs() < 1e-9);
        // FGD's measure weighs both alike
        assert_eq!(mix.fgd_fragmentation(&free, None, "A100"), 3500.0);
    }

    #[test]
    fn host_aware_measure_equals_fgd_when_the_host_is_not_a_limit() {
        let mix = WorkloadMix {
            entries: vec![
                entry(1, 1000, 2000, 1024, 0.4),
                entry(1, 470, 1000, 512, 0.3),
                entry(2, 1000, 8000, 0, 0.2),
                entry(0, 0, 4000, 0, 0.1),
            ],
            ..Default::default()
        };
        let gap = gap_weighted(&mix);
        for free in [[1000u32, 1000, 530, 60], [0, 0, 0, 0], [1000, 0, 0, 0], [300, 300, 300, 300]] {
            let fgd = gap.fgd_fragmentation(&free, None, "T4");
            assert!((mix.fragmentation(&free, UNLIMITED, "T4") - fgd).abs() < 1e-9, "{free:?}");
            let plenty = HostFree { cpu_milli: Some(1_000_000), memory_mib: Some(1 << 30) };
            assert!((mix.fragmentation(&free, plenty, "T4") - fgd).abs() < 1e-9, "{free:?}");
        }
    }

    #[test]
    fn gpus_the_host_cannot_feed_are_fragments() {
        let mix = WorkloadMix { entries: vec![entry(1, 1000, 11_000, 40_000, 1.0)], ..Default::default() };
        let free = [1000u32; 8];
        // FGD: one more 11-core pod fits, so nothing looks fragmented
        assert_eq!(mix.fgd_fragmentation(&free, Some(12_000), "G2"), 0.0);
        // but 12 cores feed only one of the 8 idle GPUs
        let cpu = HostFree { cpu_milli: Some(12_000), memory_mib: None };
        assert_eq!(mix.fragmentation(&free, cpu, "G2"), 7000.0);
        // host memory caps the same way: 100 GiB holds two 40 GiB pods
        let mem = HostFree { cpu_milli: None, memory_mib: Some(100_000) };
        assert_eq!(mix.fragmentation(&free, mem, "G2"), 6000.0);
        // the GPUs a type would use are the freest ones
        let shares = WorkloadMix { entries: vec![entry(1, 400, 5_000, 0, 1.0)], ..Default::default() };
        let cpu = HostFree { cpu_milli: Some(10_000), memory_mib: None };
        assert_eq!(shares.fragmentation(&[500, 1000, 400, 200], cpu, "G2"), 400.0 + 200.0);
    }

    #[test]
    fn other_models_and_cpu_only_types_count_all_idle() {
        let mut gpu_t4 = entry(1, 500, 0, 0, 0.5);
        gpu_t4.models = vec!["T4".into()];
        let mix = WorkloadMix { entries: vec![gpu_t4, entry(0, 0, 1000, 0, 0.5)], ..Default::default() };
        assert_eq!(mix.fragmentation(&[1000, 200], UNLIMITED, "t4"), 0.5 * 200.0 + 0.5 * 1200.0);
        assert_eq!(mix.fragmentation(&[1000, 200], UNLIMITED, "A10"), 1200.0);
    }

    #[test]
    fn on_a_model_that_requests_are_bound_to_the_measure_is_fgds() {
        // a 12-core type: the host-aware measure counts 7 of 8 idle GPUs beside 12 free cores
        let mut bound = entry(1, 1000, 1000, 0, 0.2);
        bound.models = vec!["P100".into()];
        let mix = WorkloadMix { entries: vec![entry(1, 1000, 12_000, 0, 0.8), bound], ..Default::default() };
        let free = [1000u32; 8];
        let cpu = HostFree { cpu_milli: Some(12_000), memory_mib: None };
        assert!(mix.binds_model("p100") && !mix.binds_model("G2"));
        // on G2 nobody is bound: host-aware (0.8 * 7 GPUs; the P100 type counts all 8 here)
        assert!((mix.fragmentation(&free, cpu, "G2") - (0.8 * 7000.0 + 0.2 * 8000.0)).abs() < 1e-9);
        // on P100 the bound type lives: FGD's (one more 12-core pod fits, nothing is fragment)
        assert_eq!(mix.fragmentation(&free, cpu, "P100"), mix.fgd_fragmentation(&free, Some(12_000), "P100"));
        assert_eq!(mix.fragmentation(&free, cpu, "P100"), 0.0);
        // and FGD's counts everything once one more request no longer fits the CPU
        let short = HostFree { cpu_milli: Some(11_999), memory_mib: None };
        assert_eq!(mix.fragmentation(&free, short, "P100"), mix.fgd_fragmentation(&free, Some(11_999), "P100"));
    }

    #[test]
    fn mix_summarizes_host_memory_by_median() {
        let reqs = [4096, 1024, 2048].map(|m| entry(1, 500, 1000, m, 0.0));
        let mix = WorkloadMix::from_requests(reqs, 1.0);
        assert_eq!(mix.entries.len(), 1);
        assert_eq!(mix.entries[0].memory_mib, 2048);
        assert!((mix.entries[0].weight - 1.0).abs() < 1e-12);
    }
}
