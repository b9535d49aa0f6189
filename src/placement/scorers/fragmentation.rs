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
            let cpu_ok = cpu_left.is_none_or(|c| c >= t.cpu_milli);
            let model_ok = t.models.is_empty() || t.models.iter().any(|m| m.eq_ignore_ascii_case(model));
            if t.gpus == 0 || !model_ok || !cpu_ok {
                frag += t.weight * idle;
                continue;
            }
            let mut fit = 0u32;
            let mut stranded = 0u32;
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
        *slot = free_milli_now(node, g);
    }
    let mut after = before;
    for c in placement.assignment.containers.iter().filter(|c| !c.init) {
        for s in &c.slices {
            let g = s.gpu as usize;
            if g >= n {
                continue;
            }
            let take = if s.exclusive {
                1000
            } else {
                let cap = node.gpus[g].memory_mib.max(1);
                (s.core_pct * 10).max((s.mem_mib * 1000).div_ceil(cap) as u32)
            };
            after[g] = after[g].saturating_sub(take);
        }
    }
    let model = node.gpus.first().map_or("", |g| g.model.as_str());
    let tracked = node.cpu_milli > 0;
    let cpu_before = tracked.then(|| node.cpu_free());
    let cpu_after = tracked.then(|| node.cpu_free().saturating_sub(placement.assignment.cpu_milli));
    mix.fragmentation(&after[..n], cpu_after, model) - mix.fragmentation(&before[..n], cpu_before, model)
}

/// Free share of a GPU now, in thousandths (0 for unhealthy GPUs: nobody can use them).
pub fn free_milli_now(node: &Node, g: usize) -> u32 {
    let u = node.usage(g);
    let gpu = &node.gpus[g];
    if u.exclusive || !gpu.healthy {
        return 0;
    }
    let mem = (node.free_mem(g) * 1000).checked_div(gpu.memory_mib).unwrap_or(0) as u32;
    (node.free_core(g) * 10).min(mem)
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
