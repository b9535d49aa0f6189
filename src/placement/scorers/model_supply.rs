//! Model supply: keeps enough free GPUs of each model for the pods that can run on nothing else.
//!
//! A pod may name the GPU models it runs on (`gpu_spec`, a list such as `V100M16|V100M32`). Such a
//! pod can use only those GPUs, while a pod that names none can use any. The fragmentation measure
//! rates how well the free GPUs fit the typical requests, not whose they are, so nothing stopped
//! the pods that could run anywhere from taking the GPUs of a model first: on the openb trace with
//! model-bound pods (`gpuspec-openb=5`, seeds 42-51) the 2-GPU `T4` and `P100` nodes, the best fit
//! for a 1-GPU pod, were nearly full by 75 percent arrival, mostly with pods that named no model,
//! and the `T4` and `P100` pods that came after had nowhere to go (docs/performance-journal.md,
//! "Model-bound pods").
//!
//! The learned mix carries, per list of models, the share of the arriving GPU demand (in GPUs)
//! bound to it and the size of its pods ([`BoundDemand`], learned by
//! [`MixLearner`](crate::placement::mix_learner::MixLearner)); the node inventory adds a list per
//! model ([`inventory_lists`]). If pods keep coming in that mix, the pods bound within a list `L`
//! (to `L` or to a list inside it) will need that share of whatever the cluster has free. A list is
//! *short* when the free GPUs of its models that their hosts can still feed, counted in its pods,
//! fall below [`HEADROOM`] times that, plus [`FLOOR_PODS`] of its pods ([`short_lists`]; the same
//! host-fed count is taken over every model for the "whatever the cluster has free"). Only the
//! learned shares, the inventory and the cluster's free GPUs are read: nothing about the future
//! beyond "more of the same".
//!
//! The [`ModelSupplyScorer`] gives 0 to a placement on a GPU of a short list by a GPU pod that could
//! run outside that list (one that names no model, or a model outside the list), and 1 otherwise.
//! It is a preference, never a refusal: such a pod still goes there when nothing else fits. It is
//! left out of the weighting ([`Scorer::applies`]) while no list is short, for pods bound within
//! every short list, for CPU-only pods, and where every model the pod may use is short (it would
//! score every node alike).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::placement::feasibility::Placement;
use crate::placement::mix::{BoundDemand, WorkloadMix};
use crate::placement::scorer::{Data, Facts, ScoreContext, Scorer, Shared};
use gpuplace_core::cluster::{Cluster, Node};

/// A list is short while the GPUs it could use are less than this many times what the pods bound
/// within it would take of the cluster's free GPUs, plus [`FLOOR_PODS`] of its pods
/// (docs/performance-journal.md, "Model-bound pods").
pub const HEADROOM: f64 = 2.0;

/// However small its share, a list keeps room for this many of its typical pods, each counted as
/// at least one GPU: a share learned from a few pods says little, and those pods differ in size
/// (`gpuspec-openb=5`, seeds 42-51: the `P100` shares of 12 cores and 47 GiB failed with room left
/// for the average `P100` pod). Counted at their average size, the first `P100` pods of the
/// published `gpuspec05` (seed 45: small shares, 0.22 GPU each) kept 7 GPUs, unbound pods took the
/// `P100` nodes down to 11 usable GPUs by 13 percent arrival, and seven `P100` pods failed from 63
/// percent on (docs/performance-journal.md, "Model-bound pods").
pub const FLOOR_PODS: f64 = 32.0;

/// Each GPU model of the node inventory that no learned list names alone is a list of its own,
/// bound to this share of its part of the cluster's GPUs ([`inventory_lists`]).
pub const INVENTORY_SHARE: f64 = 0.5;

/// Lists for the models of the inventory, before any pod bound to them is seen. Learned demand comes
/// too late for the first pods of a model: on the openb trace the first pod bound to `P100` came
/// at 7 percent arrival in one seed, when unbound pods already held 229 of the 265 `P100` GPUs.
/// So each model that no learned list names alone counts as bound to [`INVENTORY_SHARE`] of its
/// share of the cluster's GPUs: with the [`HEADROOM`] of 2, unbound pods stop taking a model's GPUs
/// once its free share of the free GPUs falls below its share of all GPUs (and [`FLOOR_PODS`]
/// GPUs), so no model is used up long before the others. Its pods are one GPU with no host need.
pub fn inventory_lists(cluster: &Cluster, learned: &[BoundDemand]) -> Vec<BoundDemand> {
    let mut gpus: Vec<(String, f64)> = Vec::new();
    let mut total = 0.0;
    for n in cluster.nodes() {
        let Some(model) = n.gpus.first().map(|g| g.model.as_str()).filter(|m| !m.is_empty()) else { continue };
        total += n.gpus.len() as f64;
        match gpus.iter_mut().find(|(m, _)| m.eq_ignore_ascii_case(model)) {
            Some(slot) => slot.1 += n.gpus.len() as f64,
            None => gpus.push((model.to_string(), n.gpus.len() as f64)),
        }
    }
    gpus.into_iter()
        .filter(|(m, _)| !learned.iter().any(|l| l.models.len() == 1 && l.models[0].eq_ignore_ascii_case(m)))
        .map(|(m, g)| BoundDemand {
            models: vec![m],
            share: INVENTORY_SHARE * g / total,
            gpus_per_pod: 1.0,
            cpu_milli_per_pod: 0.0,
            memory_mib_per_pod: 0.0,
        })
        .collect()
}

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

/// Per list of `bound`, what its limit is made of: the demand share it keeps (twice over,
/// [`HEADROOM`]) of the GPUs usable anywhere, and a floor in thousandths of a GPU. The first
/// `learned` lists are the mix's: their demand is that of the learned lists within them (the
/// inventory's are a hedge, not demand) and they keep [`FLOOR_PODS`] of their pods (at least a GPU
/// each); the others are the inventory's ([`inventory_lists`]), with their own share and no floor.
/// It depends on the lists alone, so it is worked out once per set of lists, not at every look.
pub fn limits(bound: &[BoundDemand], learned: usize) -> Vec<(f64, f64)> {
    bound
        .iter()
        .enumerate()
        .map(|(k, l)| {
            if k < learned {
                let demand: f64 =
                    bound[..learned].iter().filter(|d| bound_within(&d.models, &l.models)).map(|d| d.share).sum();
                (demand, FLOOR_PODS * l.gpus_per_pod.max(1.0) * 1000.0)
            } else {
                (l.share, 0.0)
            }
        })
        .collect()
}

/// The lists of `bound` whose usable free GPUs are short of what the pods bound within them need
/// (module documentation), in `bound`'s order, with each list's [`limits`]. `was` holds, per list,
/// whether it was short at the last look, and is brought up to date: a short list stays short
/// until its GPUs are [`RELEASE`] times the limit, so that a list near its limit does not flip with
/// every pod (each flip voids every cached score).
pub fn short_lists(
    bound: &[BoundDemand],
    limits: &[(f64, f64)],
    supply: &Supply,
    was: &mut Vec<bool>,
) -> Vec<Vec<String>> {
    was.resize(bound.len(), false);
    let mut out = Vec::new();
    for (k, (l, &(demand, floor))) in bound.iter().zip(limits).enumerate() {
        let anywhere = supply.anywhere.get(k).copied().unwrap_or(0) as f64;
        let limit = HEADROOM * demand * anywhere + floor;
        let within = supply.within.get(k).copied().unwrap_or(0) as f64;
        was[k] = limit > 0.0 && within < if was[k] { limit * RELEASE } else { limit };
        if was[k] {
            out.push(l.models.clone());
        }
    }
    out
}

/// See [`short_lists`]. With 1.25 the lists of the inventory flipped so often on `default` that the
/// 10-seed replay took 11-14 s instead of 6 (each flip voids the cached scores); 2 took 8 s, with
/// the same placements within 0.02 points.
pub const RELEASE: f64 = 2.0;

/// What the scorer reads: the short lists, and the GPU models of the cluster's nodes (each node's
/// first GPU's), each once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelSupply {
    pub short: Vec<Vec<String>>,
    pub models: Vec<String>,
}

/// What the cluster has free for each list, kept per node ([`Facts`]).
#[derive(Debug, Default)]
pub struct SupplyFacts {
    /// The mix's bound demand they were built for; the lists looked at are those and the
    /// inventory's ([`inventory_lists`]).
    learned: Vec<BoundDemand>,
    lists: Vec<BoundDemand>,
    /// Each list's [`limits`].
    limits: Vec<(f64, f64)>,
    /// What the cluster has free for the lists (their shortness), and each node's part.
    supply: Supply,
    node_supply: Vec<Supply>,
    /// Per list, whether it was short at the last look ([`short_lists`]).
    short: Vec<bool>,
    models: Vec<String>,
    /// The last snapshot, kept while no node's supply changes.
    last: Option<(Shared, u64)>,
}

impl SupplyFacts {
    /// The lists looked at (the mix's and the inventory's), each with the GPUs its pods could use
    /// now (thousandths) and whether it is short (what `/inspect` shows).
    pub fn lists_with_supply(&self) -> Vec<(BoundDemand, u64, bool)> {
        let short = |k: usize| self.short.get(k).copied().unwrap_or(false);
        let within = self.lists.iter().zip(&self.supply.within).enumerate();
        within.map(|(k, (l, &w))| (l.clone(), w, short(k))).collect()
    }
}

impl Facts for SupplyFacts {
    fn stale(&self, _cluster: &Cluster, mix: &WorkloadMix) -> bool {
        self.learned != mix.bound
    }

    fn rebuild(&mut self, cluster: &Cluster, mix: &WorkloadMix) {
        let nodes = cluster.nodes();
        let bound = &mix.bound;
        self.learned = bound.clone();
        self.models = Vec::new();
        for m in nodes.iter().filter_map(|n| n.gpus.first()).map(|g| &g.model) {
            if !self.models.contains(m) {
                self.models.push(m.clone());
            }
        }
        // a list keeps its state through a new mix (it changes often)
        let was: Vec<(Vec<String>, bool)> =
            self.lists.iter().map(|l| l.models.clone()).zip(std::mem::take(&mut self.short)).collect();
        self.lists = bound.iter().cloned().chain(inventory_lists(cluster, bound)).collect();
        self.limits = limits(&self.lists, bound.len());
        self.short = self.lists.iter().map(|b| was.iter().any(|(m, s)| *s && *m == b.models)).collect();
        self.node_supply = nodes.iter().map(|n| Supply::of_node(&self.lists, n)).collect();
        self.supply = Supply::new(self.lists.len());
        for part in &self.node_supply {
            self.supply.add(part);
        }
        self.last = None;
    }

    fn update(&mut self, cluster: &Cluster, i: usize) -> bool {
        // a node whose GPUs changed (the inventory's lists may have) never comes here: the memo
        // rebuilds every fact then
        let (Some(node), Some(was)) = (cluster.nodes().get(i), self.node_supply.get_mut(i)) else { return false };
        let part = Supply::of_node(&self.lists, node);
        if part != *was {
            let was = std::mem::replace(was, part);
            self.supply.remove(&was);
            self.supply.add(&self.node_supply[i]);
            self.last = None;
        }
        true
    }

    /// Keyed on the short lists; 0 while none is, as the scorer is then left out.
    fn snapshot(&mut self) -> (Shared, u64) {
        if let Some(last) = &self.last {
            return last.clone();
        }
        let short = short_lists(&self.lists, &self.limits, &self.supply, &mut self.short);
        let key = if short.is_empty() {
            0
        } else {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            short.hash(&mut h);
            h.finish() | 1
        };
        let shared: Shared = Arc::new(ModelSupply { short, models: self.models.clone() });
        self.last = Some((shared.clone(), key));
        (shared, key)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The short lists that `ctx`'s pod could run outside of.
fn guarded<'a>(ctx: &ScoreContext<'a>, supply: &'a ModelSupply) -> impl Iterator<Item = &'a Vec<String>> + 'a {
    let pod = &ctx.request.allowed_models;
    supply.short.iter().filter(move |l| !bound_within(pod, l))
}

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "model_supply";

/// It counts only for pods that could run elsewhere than on a model whose free GPUs run short.
pub const DEFAULT_WEIGHT: f64 = 6.0;

/// Keeps the GPUs of short model lists for the pods bound to them (module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct ModelSupplyScorer;

impl Scorer for ModelSupplyScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn facts(&self) -> Option<Box<dyn Facts>> {
        Some(Box::<SupplyFacts>::default())
    }

    fn applies(&self, ctx: &ScoreContext<'_>, data: Data<'_>) -> bool {
        // GPU pods only: steering CPU-only pods off such nodes put them on the GPU nodes whose
        // hosts the GPU pods needed (`gpuspec-openb=5`: 7.67 percent unallocated at 100 percent
        // arrival instead of 4.52)
        // and only where some node it may use is on no guarded list: where all of them are, it
        // would score every node alike
        let r = ctx.request;
        let Some(supply) = data.get::<ModelSupply>() else { return false };
        r.total_gpus() > 0
            && guarded(ctx, supply).next().is_some()
            && supply.models.iter().any(|m| r.allows_model(m) && !guarded(ctx, supply).any(|l| contains(l, m)))
    }

    fn score(&self, ctx: &ScoreContext<'_>, data: Data<'_>, node: &Node, _placement: &Placement) -> f64 {
        let Some(supply) = data.get::<ModelSupply>() else { return 1.0 };
        let model = node.gpus.first().map_or("", |g| g.model.as_str());
        if !node.gpus.is_empty() && guarded(ctx, supply).any(|l| contains(l, model)) {
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
    use gpuplace_core::assignment::PodAssignment;
    use gpuplace_core::cluster::Cluster;
    use gpuplace_core::inventory::Board;

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
        cluster_of(12)
    }

    /// 4 nodes of 2 T4 and 16 cores, `g2` nodes of 8 G2 and 96 cores.
    fn cluster_of(g2: usize) -> Cluster {
        let mut nodes = Vec::new();
        for (model, gpus, count, cpu) in [("T4", 2, 4, 16_000), ("G2", 8, g2, 96_000)] {
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
    fn the_hosts_decide_how_many_gpus_a_list_can_use() {
        // T4 pods take 8 cores and one GPU: 2 a T4 node (8 GPUs usable), 12 a G2 node of 96 cores
        // but only 8 GPUs (104 usable anywhere at their need, 8 on T4)
        let bound = vec![demand("T4", 0.03), demand("A10|T4", 0.01)];
        let mut c = cluster();
        let s = supply(&bound, &c);
        assert_eq!((s.within.clone(), s.anywhere.clone()), (vec![8000, 8000], vec![104_000, 104_000]));
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
        assert_eq!((s.within[0], s.anywhere[0]), (6000, 102_000));
        // parts taken away as nodes change leave the sums a fresh count gives
        let mut kept = supply(&bound, &cluster());
        kept.remove(&Supply::of_node(&bound, &cluster().nodes()[0]));
        kept.add(&Supply::of_node(&bound, &c.nodes()[0]));
        assert_eq!(kept, s);
    }

    #[test]
    fn a_list_is_short_below_its_demand_with_headroom_and_stays_so_until_it_has_twice_that() {
        // two learned lists and one of the inventory
        let bound = vec![demand("T4", 0.03), demand("A10|T4", 0.01), demand("G2", 0.5)];
        let at = |t4: u64, a10_t4: u64, g2: u64| Supply { within: vec![t4, a10_t4, g2], anywhere: vec![100_000; 3] };
        let mut was = Vec::new();
        let limits = limits(&bound, 2);
        // limits: T4 2 x 0.03 x 100 + 32 pods = 38 GPUs; A10|T4 (the T4 pods are bound within it
        // too) 2 x 0.04 x 100 + 32 = 40; G2 (the inventory's: no floor) 2 x 0.5 x 100 = 100
        assert_eq!(short_lists(&bound, &limits, &at(39_000, 39_500, 100_000), &mut was), vec![list("A10|T4")]);
        assert_eq!(short_lists(&bound, &limits, &at(37_000, 39_500, 99_000), &mut was).len(), 3);
        // short until twice the limit
        assert_eq!(short_lists(&bound, &limits, &at(75_000, 79_000, 199_000), &mut was).len(), 3);
        assert_eq!(short_lists(&bound, &limits, &at(77_000, 80_000, 200_000), &mut was), Vec::<Vec<String>>::new());
        // nothing free: nothing is short of anything but the floor
        assert_eq!(short_lists(&bound, &limits, &Supply::new(3), &mut Vec::new()), vec![list("T4"), list("A10|T4")]);
    }

    /// The short lists `e` sees in `c`.
    fn short(e: &crate::placement::engine::Engine, c: &Cluster) -> Vec<Vec<String>> {
        e.model_lists(c).into_iter().filter(|(_, _, short)| *short).map(|(l, _, _)| l.models).collect()
    }

    fn engine(bound: Vec<BoundDemand>) -> crate::placement::engine::Engine {
        use crate::placement::mix::WorkloadMix;
        use crate::placement::profile::Profile;
        crate::placement::engine::Engine::new(Profile::gpuplace(), WorkloadMix::default().with_bound(bound))
    }

    fn pod(name: &str, models: &[&str]) -> gpuplace_core::resources::PodRequest {
        let mut r =
            gpuplace_core::resources::PodRequest::single(name, gpuplace_core::resources::GpuDemand::Whole { gpus: 1 });
        r.cpu_milli = 8000;
        r.allowed_models = models.iter().map(|m| m.to_string()).collect();
        r
    }

    /// 4 nodes of 2 T4 and 16 cores, 40 of 8 G2 and 96 cores; one T4 GPU taken, so packing alone
    /// would fill that node first.
    fn big_cluster() -> Cluster {
        let mut c = cluster_of(40);
        engine(Vec::new()).schedule(&mut c, &pod("ns/first", &["T4"]), 0).unwrap();
        c
    }

    #[test]
    fn pods_that_could_run_anywhere_leave_a_short_model_to_the_pods_bound_to_it() {
        let c = big_cluster();
        let best = |e: &crate::placement::engine::Engine, r: &gpuplace_core::resources::PodRequest| -> String {
            let ev = e.evaluate_all(&c, r, 0);
            c.nodes()[ev.ranked[0].node].name.clone()
        };
        let free = pod("ns/free", &[]);
        // without the scorer the pod goes where packing puts it
        let plain = {
            use crate::placement::{
                profile::{Profile, ProfileConfig},
                registry::Weights,
            };
            let weights = Weights::default().with("model_supply", 0.0);
            crate::placement::engine::Engine::new(
                Profile::new(ProfileConfig { weights, ..ProfileConfig::default() }),
                Default::default(),
            )
        };
        assert_eq!(best(&plain, &free), "T4-0");
        // nothing learned: T4, one GPU below its share of the free GPUs, is short for the
        // inventory's list already
        assert_eq!(short(&engine(Vec::new()), &c), vec![list("T4")]);
        assert!(best(&engine(Vec::new()), &free).starts_with("G2"));
        // a third of the demand bound to T4: its 7 free GPUs are short of it
        let bound = engine(vec![demand("T4", 0.3)]);
        assert_eq!(short(&bound, &c), vec![list("T4")]);
        assert!(best(&bound, &free).starts_with("G2"), "{}", best(&bound, &free));
        // the pods bound to T4 still go there, and the scorer has nothing to say about them
        assert_eq!(best(&bound, &pod("ns/t4", &["T4"])), "T4-0");
        let ev = bound.evaluate_all(&c, &pod("ns/t4", &["t4"]), 0);
        let plain_ev = plain.evaluate_all(&c, &pod("ns/t4", &["t4"]), 0);
        assert_eq!(
            ev.ranked.iter().map(|r| (r.node, r.total)).collect::<Vec<_>>(),
            plain_ev.ranked.iter().map(|r| (r.node, r.total)).collect::<Vec<_>>()
        );
        // a list short of everything the pod may use scores all its nodes alike: left out
        let both = engine(vec![demand("T4", 0.3), demand("G2", 0.9)]);
        assert_eq!(short(&both, &c).len(), 2);
        assert_eq!(best(&both, &free), "T4-0");
    }
}
