//! Model supply: keeps enough free GPUs of each model for the pods that can run on nothing else.
//!
//! A pod may name the GPU models it runs on (`gpu_spec`, a list such as `V100M16|V100M32`). Such a
//! pod can use only those GPUs, while a pod that names none can use any. The fragmentation measure
//! rates how well the free GPUs fit the typical requests, not whose they are, so nothing stops the
//! pods that could run anywhere from taking the GPUs of a model first: on the openb trace with
//! model-bound pods (`gpuspec-openb=5`, seeds 42-51) the 2-GPU `T4` nodes, whose hosts have CPU for
//! every pod, were nine tenths full by 75 percent arrival, mostly with pods that named no model, and
//! the `T4` pods that came after had nowhere to go (docs/performance.md).
//!
//! The learned mix carries, per list of models, the share of the arriving GPU demand (in GPUs)
//! bound to it ([`BoundDemand`], [`MixLearner`](crate::placement::mix_learner::MixLearner)). If the
//! pods keep coming in that mix, the pods bound inside a list `L` (to `L` or to a list within it)
//! will need that share of whatever the cluster has free. A list is *short* when its models' free
//! GPUs are less than [`HEADROOM`] times that ([`short_lists`]): `free(L) < HEADROOM x demand(L) x
//! free(all)`. Only the learned shares and the cluster's free GPUs are read: nothing about the
//! future beyond "more of the same".
//!
//! The [`ModelSupplyScorer`] gives 0 to a placement on a GPU of a short list by a pod that could
//! run outside that list (one that names no model, or a model outside the list), and 1 otherwise. It
//! is a preference, never a refusal: such a pod still goes there when nothing else fits. While no
//! list is short, or the pod is bound within every short list, it is left out of the weighting
//! ([`Scorer::applies`]), so on workloads without model-bound pods nothing changes.

use serde::{Deserialize, Serialize};

use crate::core::cluster::Node;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};

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

/// A list is short while the GPUs it could use are less than this many times what the pods bound
/// within it would take of the cluster's free GPUs (docs/performance.md, "Model-bound pods").
pub const HEADROOM: f64 = 2.0;

/// A list of models as [`BoundDemand`] keeps it: sorted, each once, in the case first seen.
pub fn normalize(models: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(models.len());
    for m in models {
        if !out.iter().any(|o| o.eq_ignore_ascii_case(m)) {
            out.push(m.clone());
        }
    }
    out.sort_by_key(|m| m.to_ascii_lowercase());
    out
}

fn contains(list: &[String], model: &str) -> bool {
    list.iter().any(|m| m.eq_ignore_ascii_case(model))
}

/// Whether a pod bound to `pod_models` can run only within `list` (a pod that names no model can
/// run anywhere).
pub fn bound_within(pod_models: &[String], list: &[String]) -> bool {
    !pod_models.is_empty() && pod_models.iter().all(|m| contains(list, m))
}

/// One request (or request type, weighted by how often it was seen) as [`bound_demand`] counts it.
#[derive(Debug, Clone, Copy)]
pub struct Demand<'a> {
    pub models: &'a [String],
    /// How often it was seen (1 for one request).
    pub count: f64,
    /// GPUs it takes (a share as its fraction), host CPU and memory it asks.
    pub gpus: f64,
    pub cpu_milli: f64,
    pub memory_mib: f64,
}

/// The demand bound to each list of models: every GPU request counts toward the total, those that
/// name models also toward their list's share and host needs. Lists in name order.
pub fn bound_demand<'a>(requests: impl IntoIterator<Item = Demand<'a>>) -> Vec<BoundDemand> {
    let mut total = 0.0;
    // per list (by its models in lower case; named as first seen): pods, GPUs, CPU, memory (each
    // times the count)
    let mut by: std::collections::BTreeMap<Vec<String>, (Vec<String>, [f64; 4])> = Default::default();
    for d in requests {
        let gpus = d.count * d.gpus;
        if !(gpus.is_finite() && gpus > 0.0) {
            continue;
        }
        total += gpus;
        if !d.models.is_empty() {
            let models = normalize(d.models);
            let key = models.iter().map(|m| m.to_ascii_lowercase()).collect();
            let (_, slot) = by.entry(key).or_insert_with(|| (models, [0.0; 4]));
            slot[0] += d.count;
            slot[1] += gpus;
            slot[2] += d.count * d.cpu_milli;
            slot[3] += d.count * d.memory_mib;
        }
    }
    by.into_values()
        .map(|(models, [pods, gpus, cpu, mem])| BoundDemand {
            models,
            share: gpus / total,
            gpus_per_pod: gpus / pods,
            cpu_milli_per_pod: cpu / pods,
            memory_mib_per_pod: mem / pods,
        })
        .collect()
}

/// What the cluster has free for the bound lists, in thousandths of a GPU: per list, the free GPUs
/// that the hosts can still feed at the list's host need per GPU, on the list's models (`within`)
/// and on every model (`anywhere`). Kept per node, so that a changed node is counted again alone.
///
/// Both sides are read at the list's own host need: where hosts run short of CPU, every GPU counts
/// less, on the list's models and elsewhere alike, and only the balance between them matters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Supply {
    pub within: Vec<u64>,
    pub anywhere: Vec<u64>,
}

impl Supply {
    /// An empty supply for `lists` lists.
    pub fn new(lists: usize) -> Self {
        Self { within: vec![0; lists], anywhere: vec![0; lists] }
    }

    /// One node's part (what [`Supply::add`] adds for it).
    pub fn of_node(bound: &[BoundDemand], node: &Node) -> Self {
        let free: u64 = (0..node.gpus.len()).map(|g| u64::from(node.free_milli(g))).sum();
        let model = node.gpus.first().map_or("", |g| g.model.as_str());
        // thousandths of a GPU in the pods the host can still take whole
        let feeds = |have: Option<u64>, per_pod: f64, gpus: f64| match have {
            Some(h) if per_pod > 0.0 => (h as f64 / per_pod).floor() * gpus * 1000.0,
            _ => f64::INFINITY,
        };
        let cpu = (node.cpu_milli > 0).then(|| node.cpu_free());
        let mem = (node.memory_mib > 0).then(|| node.mem_free());
        // whole thousandths, so the sums are kept exactly as nodes change
        let anywhere: Vec<u64> = bound
            .iter()
            .map(|b| {
                let by_cpu = feeds(cpu, b.cpu_milli_per_pod, b.gpus_per_pod);
                (free as f64).min(by_cpu).min(feeds(mem, b.memory_mib_per_pod, b.gpus_per_pod)) as u64
            })
            .collect();
        let within =
            bound.iter().zip(&anywhere).map(|(b, &a)| if contains(&b.models, model) { a } else { 0 }).collect();
        Self { within, anywhere }
    }

    /// Adds a node's part.
    pub fn add(&mut self, part: &Supply) {
        for (x, y) in self.within.iter_mut().zip(&part.within).chain(self.anywhere.iter_mut().zip(&part.anywhere)) {
            *x += y;
        }
    }

    /// Takes away a node's part, added before.
    pub fn remove(&mut self, part: &Supply) {
        for (x, y) in self.within.iter_mut().zip(&part.within).chain(self.anywhere.iter_mut().zip(&part.anywhere)) {
            *x = x.saturating_sub(*y);
        }
    }
}

/// The lists of `bound` whose usable free GPUs are short of what the pods bound within them need
/// (module documentation), in `bound`'s order.
pub fn short_lists(bound: &[BoundDemand], supply: &Supply) -> Vec<Vec<String>> {
    bound
        .iter()
        .zip(supply.within.iter().zip(&supply.anywhere))
        .filter(|(l, (&within, &anywhere))| {
            let demand: f64 = bound.iter().filter(|d| bound_within(&d.models, &l.models)).map(|d| d.share).sum();
            demand > 0.0 && (within as f64) < HEADROOM * demand * anywhere as f64
        })
        .map(|(l, _)| l.models.clone())
        .collect()
}

/// The short lists that `ctx`'s pod could run outside of.
fn guarded<'a>(ctx: &'a ScoreContext<'_>) -> impl Iterator<Item = &'a Vec<String>> + 'a {
    let pod = &ctx.request.allowed_models;
    ctx.reserve.short.iter().filter(move |l| !bound_within(pod, l))
}

/// Keeps the GPUs of short model lists for the pods bound to them (module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct ModelSupplyScorer;

impl Scorer for ModelSupplyScorer {
    fn name(&self) -> &'static str {
        "model_supply"
    }

    fn applies(&self, ctx: &ScoreContext<'_>) -> bool {
        // GPU pods only: steering CPU-only pods off such nodes put them on the GPU nodes whose
        // hosts the GPU pods needed (`gpuspec-openb=5`: 7.67 percent unallocated at 100 percent
        // arrival instead of 4.52)
        ctx.request.total_gpus() > 0 && guarded(ctx).next().is_some()
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, _placement: &Placement) -> f64 {
        let model = node.gpus.first().map_or("", |g| g.model.as_str());
        if !node.gpus.is_empty() && guarded(ctx).any(|l| contains(l, model)) {
            0.0
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::core::cluster::{Cluster, PodAssignment};
    use crate::core::inventory::Board;

    fn list(s: &str) -> Vec<String> {
        s.split('|').map(str::to_string).collect()
    }

    fn demand(models: &str, share: f64) -> BoundDemand {
        BoundDemand {
            models: list(models),
            share,
            gpus_per_pod: 1.0,
            cpu_milli_per_pod: 8000.0,
            memory_mib_per_pod: 0.0,
        }
    }

    #[test]
    fn lists_are_kept_sorted_once_and_pods_bound_within_them() {
        assert_eq!(normalize(&list("V100M32|v100m16|V100M32")), list("v100m16|V100M32"));
        assert!(bound_within(&list("T4"), &list("A10|T4")));
        assert!(!bound_within(&list("T4|P100"), &list("A10|T4")));
        assert!(!bound_within(&[], &list("T4")), "a pod that names no model runs anywhere");
    }

    #[test]
    fn demand_is_the_share_of_gpus_with_the_host_per_pod() {
        let one = |models: &'static [&'static str], count: f64, gpus: f64, cpu: f64| (models, count, gpus, cpu);
        let rows = [
            one(&["T4"], 2.0, 1.0, 8000.0),
            one(&[], 5.0, 1.0, 4000.0),
            one(&["t4"], 2.0, 0.5, 4000.0),
            one(&["V100M32", "P100", "V100M32"], 1.0, 2.0, 16000.0),
        ];
        let owned: Vec<(Vec<String>, f64, f64, f64)> =
            rows.iter().map(|(m, c, g, cpu)| (m.iter().map(|s| s.to_string()).collect(), *c, *g, *cpu)).collect();
        let d = bound_demand(owned.iter().map(|(m, count, gpus, cpu)| Demand {
            models: m,
            count: *count,
            gpus: *gpus,
            cpu_milli: *cpu,
            memory_mib: 0.0,
        }));
        // 10 GPUs in all: T4 pods take 3 (4 pods), P100|V100M32 2 (1 pod)
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].models.clone(), d[0].share, d[0].gpus_per_pod), (list("P100|V100M32"), 0.2, 2.0));
        assert_eq!((d[1].models.clone(), d[1].share, d[1].gpus_per_pod), (list("T4"), 0.3, 0.75));
        assert_eq!(d[1].cpu_milli_per_pod, 6000.0);
    }

    /// 4 nodes of 2 T4 and 16 cores, 12 nodes of 8 G2 and 96 cores.
    fn cluster() -> Cluster {
        let mut nodes = Vec::new();
        for (model, gpus, count, cpu) in [("T4", 2, 4, 16_000), ("G2", 8, 12, 96_000)] {
            let board = Board::Flat { gpus, model: model.into(), memory_mib: 16384 }.resolve(Path::new(".")).unwrap();
            for i in 0..count {
                nodes.push(board.node(&format!("{model}-{i}"), BTreeMap::new(), cpu, 0));
            }
        }
        Cluster::new(nodes)
    }

    fn supply(bound: &[BoundDemand], c: &Cluster) -> Supply {
        let mut s = Supply::new(bound.len());
        for n in c.nodes() {
            s.add(&Supply::of_node(bound, n));
        }
        s
    }

    #[test]
    fn a_list_is_short_when_its_usable_gpus_fall_below_its_demand_with_headroom() {
        // T4 pods take 8 cores and one GPU: 2 a T4 node (8 GPUs usable), 12 a G2 node of 96 cores
        // but only 8 GPUs (96 usable anywhere at their need, 8 on T4)
        let bound = vec![demand("T4", 0.03), demand("A10|T4", 0.01)];
        let mut c = cluster();
        let s = supply(&bound, &c);
        assert_eq!((s.within.clone(), s.anywhere.clone()), (vec![8000, 8000], vec![104_000, 104_000]));
        // T4: 8 < 2 x 0.03 x 104 = 6.24? no; A10|T4 (the T4 pods are bound within it too): 8 < 2 x
        // 0.04 x 104 = 8.32, short
        assert_eq!(short_lists(&bound, &s), vec![list("A10|T4")]);
        // a pod that takes 9 cores of a T4 node leaves it no room for a T4 pod
        c.allocate(PodAssignment {
            pod: "ns/cpu".into(),
            node: "T4-0".into(),
            containers: Vec::new(),
            cpu_milli: 9000,
            memory_mib: 0,
            group: None,
        })
        .unwrap();
        let s = supply(&bound, &c);
        assert_eq!(s.within[0], 6000);
        assert_eq!(short_lists(&bound, &s), vec![list("T4"), list("A10|T4")]);
        // nothing free: nothing is short of anything
        assert!(short_lists(&bound, &Supply::new(bound.len())).is_empty());
        // parts taken away as nodes change leave the sums a fresh count gives
        let mut kept = supply(&bound, &cluster());
        kept.remove(&Supply::of_node(&bound, &cluster().nodes()[0]));
        kept.add(&Supply::of_node(&bound, &c.nodes()[0]));
        assert_eq!(kept, s);
    }
}
