//! Fragmentation, in the spirit of FGD (Weng et al., USENIX ATC '23): how much of a node's idle GPU
//! capacity the workload's typical requests could not use, and how much a placement changes that.
//!
//! For each typical request `t` with weight `p_t`, a node's idle GPU share counts as fragment:
//! - all of it, when `t` cannot run there at all (model, host CPU, or not enough GPUs with room), or
//!   when `t` needs no GPU (GPUs idle beside CPU-only work are stranded for it);
//! - otherwise only the GPUs whose free share is smaller than what `t` needs per GPU.
//!
//! The node's fragmentation is the weighted sum; a good placement is one that raises it least.

use serde::{Deserialize, Serialize};

use crate::core::cluster::Node;
use crate::placement::feasibility::Placement;
use crate::placement::gpu_select::FreeState;
use crate::placement::scorer::{ScoreContext, Scorer};

/// One typical request of the workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixEntry {
    /// GPUs it spans (0 for CPU-only work).
    pub gpus: u32,
    /// Share of each GPU, in thousandths (1000 = whole GPU).
    pub milli: u32,
    /// Host CPU it needs, in millicores.
    pub cpu_milli: u64,
    /// Allowed GPU models; empty means any.
    pub models: Vec<String>,
    /// Popularity; the weights of a mix sum to 1.
    pub weight: f64,
}

impl MixEntry {
    /// Whether this request could use the node's GPUs at all: it needs a GPU, the model is allowed
    /// and the host has the CPU.
    fn usable(&self, cpu_left: Option<u64>, model: &str) -> bool {
        self.wants_gpus_of(model) && self.cpu_fits(cpu_left)
    }

    fn wants_gpus_of(&self, model: &str) -> bool {
        self.gpus > 0 && (self.models.is_empty() || self.models.iter().any(|m| m.eq_ignore_ascii_case(model)))
    }

    fn cpu_fits(&self, cpu_left: Option<u64>) -> bool {
        cpu_left.is_none_or(|c| c >= self.cpu_milli)
    }

    /// This request's weighted part of a node's fragmentation: all idle share when it cannot run
    /// there, else the share stranded on GPUs too small for it (`fit` GPUs are large enough).
    fn fragment(&self, usable: bool, fit: u32, stranded: u32, idle: f64) -> f64 {
        if !usable {
            return self.weight * idle;
        }
        self.weight * if fit >= self.gpus { f64::from(stranded) } else { idle }
    }
}

/// How many GPUs have at least `milli` free, and the free share on the others.
fn fit_and_stranded(free_milli: &[u32], milli: u32) -> (u32, u32) {
    let mut fit = 0u32;
    let mut stranded = 0u32;
    for &f in free_milli {
        if f >= milli {
            fit += 1;
        } else {
            stranded += f;
        }
    }
    (fit, stranded)
}

/// The typical request mix a cluster serves.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadMix {
    pub entries: Vec<MixEntry>,
}

impl WorkloadMix {
    /// Builds a mix from observed requests: counts each distinct request, keeps the most popular
    /// ones until `coverage` (0..=1) of all requests is covered, and normalizes their weights.
    pub fn from_requests(requests: impl IntoIterator<Item = MixEntry>, coverage: f64) -> Self {
        let mut counts: Vec<(MixEntry, u64)> = Vec::new();
        let mut index: std::collections::HashMap<(u32, u32, u64, Vec<String>), usize> = Default::default();
        let mut total = 0u64;
        for r in requests {
            total += 1;
            let key = (r.gpus, r.milli, r.cpu_milli, r.models.clone());
            match index.get(&key) {
                Some(&i) => counts[i].1 += 1,
                None => {
                    index.insert(key, counts.len());
                    counts.push((r, 1));
                }
            }
        }
        // most popular first; equal counts: larger requests first, so the order is deterministic
        counts.sort_by(|(a, ca), (b, cb)| {
            cb.cmp(ca)
                .then(b.cpu_milli.cmp(&a.cpu_milli))
                .then(b.milli.cmp(&a.milli))
                .then(b.gpus.cmp(&a.gpus))
                .then(b.models.cmp(&a.models))
        });
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
        Self { entries }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Fragmentation (in thousandths of a GPU) of a node whose GPUs have `free_milli` left, with
    /// `cpu_left` millicores free (`None` when host CPU is not tracked) and GPU model `model`.
    pub fn fragmentation(&self, free_milli: &[u32], cpu_left: Option<u64>, model: &str) -> f64 {
        let idle: u32 = free_milli.iter().sum();
        if idle == 0 {
            return 0.0;
        }
        let idle = f64::from(idle);
        let mut frag = 0.0;
        for t in &self.entries {
            let usable = t.usable(cpu_left, model);
            let (fit, stranded) = if usable { fit_and_stranded(free_milli, t.milli) } else { (0, 0) };
            frag += t.fragment(usable, fit, stranded, idle);
        }
        frag
    }

    /// `fragmentation(after, cpu_after) - fragmentation(before, cpu_before)` where `after` differs from
    /// `before` only on the GPUs whose bits are set in `changed`: one pass over the mix, and after
    /// each entry's sums over all GPUs only the changed GPUs are looked at again. Each side adds up
    /// the same terms in the same order as [`fragmentation`](Self::fragmentation), so the result is
    /// bit-for-bit the difference of the two calls.
    pub fn fragmentation_change(
        &self,
        before: &[u32],
        after: &[u32],
        changed: u64,
        cpu: (Option<u64>, Option<u64>),
        model: &str,
    ) -> f64 {
        let idle_b: u32 = before.iter().sum();
        let idle_a: u32 = after.iter().sum();
        let (idle_bf, idle_af) = (f64::from(idle_b), f64::from(idle_a));
        let (mut frag_b, mut frag_a) = (0.0, 0.0);
        for t in &self.entries {
            let wanted = t.wants_gpus_of(model);
            let (usable_b, usable_a) = (wanted && t.cpu_fits(cpu.0), wanted && t.cpu_fits(cpu.1));
            let (mut fit, mut stranded) = (0, 0);
            if usable_b || usable_a {
                (fit, stranded) = fit_and_stranded(before, t.milli);
            }
            if usable_b {
                frag_b += t.fragment(true, fit, stranded, idle_bf);
            } else {
                frag_b += t.fragment(false, 0, 0, idle_bf);
            }
            if usable_a {
                let mut bits = changed;
                while bits != 0 {
                    let g = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let (Some(&b), Some(&a)) = (before.get(g), after.get(g)) else { continue };
                    // move GPU g from its place in `before`'s sums to its place in `after`'s
                    if b >= t.milli {
                        fit -= 1;
                    } else {
                        stranded -= b;
                    }
                    if a >= t.milli {
                        fit += 1;
                    } else {
                        stranded += a;
                    }
                }
                frag_a += t.fragment(true, fit, stranded, idle_af);
            } else {
                frag_a += t.fragment(false, 0, 0, idle_af);
            }
        }
        let frag_b = if idle_b == 0 { 0.0 } else { frag_b };
        let frag_a = if idle_a == 0 { 0.0 } else { frag_a };
        frag_a - frag_b
    }

    /// Fragmentation of a node in the given free state (host CPU as the node has it now).
    pub fn node_fragmentation(&self, node: &Node, state: &FreeState) -> f64 {
        let mut free = [0u32; 64];
        let n = node.gpus.len().min(64);
        for (g, slot) in free.iter_mut().enumerate().take(n) {
            *slot = if node.gpus[g].healthy { state.free_milli(node, g) } else { 0 };
        }
        let cpu = (node.cpu_milli > 0).then(|| node.cpu_free());
        self.fragmentation(&free[..n], cpu, node.gpus.first().map_or("", |g| g.model.as_str()))
    }
}

/// Rates a placement by how little it adds to the node's fragmentation.
#[derive(Debug, Default, Clone, Copy)]
pub struct FragmentationScorer;

/// Change in fragmentation (thousandths of a GPU) if the placement is made on the node.
pub fn fragmentation_delta(mix: &WorkloadMix, node: &Node, placement: &Placement) -> f64 {
    let n = node.gpus.len().min(64);
    let mut before = [0u32; 64];
    for (g, slot) in before.iter_mut().enumerate().take(n) {
        *slot = node.free_milli(g);
    }
    let mut after = before;
    let mut changed = 0u64;
    for c in placement.assignment.containers.iter().filter(|c| !c.init) {
        for s in &c.slices {
            let g = s.gpu as usize;
            if g >= n {
                continue;
            }
            after[g] = after[g].saturating_sub(s.milli_on(node.gpus[g].memory_mib));
            changed |= 1 << g;
        }
    }
    let model = node.gpus.first().map_or("", |g| g.model.as_str());
    let tracked = node.cpu_milli > 0;
    let cpu_before = tracked.then(|| node.cpu_free());
    let cpu_after = tracked.then(|| node.cpu_free().saturating_sub(placement.assignment.cpu_milli));
    mix.fragmentation_change(&before[..n], &after[..n], changed, (cpu_before, cpu_after), model)
}

/// Fragmentation changes beyond this many GPUs all score the same (0 or 1).
const DELTA_SPAN_MILLI: f64 = 8000.0;

impl Scorer for FragmentationScorer {
    fn name(&self) -> &'static str {
        "fragmentation"
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        if ctx.mix.is_empty() {
            return 0.5;
        }
        let delta = fragmentation_delta(ctx.mix, node, placement);
        (0.5 - delta / (2.0 * DELTA_SPAN_MILLI)).clamp(0.0, 1.0)
    }
}
