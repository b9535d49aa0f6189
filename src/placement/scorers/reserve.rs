//! Reserve: keeps back the last free hosts of the largest requests seen.
//!
//! Fragmentation rates a placement by what the *typical* requests could still use, so requests far
//! too rare to be in the mix get no protection. On the Alibaba trace, pods of 8 GPUs with 120 cores
//! and 625-720 GiB of host memory fit only on a nearly empty 128-core node; the host-aware measure
//! rates shares on exactly those nodes as the cheapest, so all of them take a share long before the
//! next such pod arrives, and it fails in a three-quarters-full cluster (docs/performance.md,
//! "Early failures").
//!
//! The mix therefore carries, besides its entries, a few *reserve classes*
//! ([`WorkloadMix::reserve`](crate::placement::scorers::fragmentation::WorkloadMix::reserve)): the largest request types seen recently, each with how many free
//! hosts to keep back (`keep`: how many requests needing such a host were seen recently, see
//! [`MixLearner::reserve`](crate::placement::mix_learner::MixLearner::reserve)). A node is a *free
//! host* of a class when one request of it fits the node's free GPUs, CPU and memory right now. A
//! class is *scarce* when the cluster has at most `keep` free hosts of it left.
//!
//! Learned classes come too late for the first request of a kind: on the trace every 128-core node
//! holds a share after a few hundred requests, thousands before the first 120-core pod. So the node
//! inventory adds its own classes ([`inventory_classes`]): a request that only the nodes with the
//! most host CPU can host, keeping back half of them from the start.
//!
//! The [`ReserveScorer`] gives 0 to a placement that turns a free host of a scarce class into a
//! non-host, unless the pod is itself at least as large as the class (the reserve is for it), and
//! 1 otherwise. While no class is scarce, or every scarce class is one the pod may consume, the
//! scorer has nothing to say and is left out of the weighting ([`Scorer::applies`]), so the other
//! scorers' ranking (and the extender's 0..10 scale) is exactly what it is without it.
//!
//! Whether a class is scarce depends on every node of the cluster, not only on the one scored. The
//! engine works it out once per cluster state ([`ScarcityMemo`], updated only for the nodes whose
//! stamp changed), and callers that cache per-node verdicts key them on it too
//! ([`Engine::shared_key`](crate::placement::engine::Engine::shared_key)).

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::core::cluster::{Cluster, Node};
use crate::core::resources::PodRequest;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};
use crate::placement::scorers::fragmentation::MixEntry;
use crate::placement::scorers::model_supply::{self, BoundDemand, Supply};

/// At most this many reserve classes are looked at (a bit each in the scarcity mask).
pub const MAX_CLASSES: usize = 64;

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
    /// others), `cpu_free` and `mem_free` (`None`: not tracked, never a limit) on GPUs of `model`.
    fn fits(
        &self,
        free_milli: impl Iterator<Item = u32>,
        cpu_free: Option<u64>,
        mem_free: Option<u64>,
        model: &str,
    ) -> bool {
        cpu_free.is_none_or(|c| c >= self.cpu_milli)
            && mem_free.is_none_or(|m| m >= self.memory_mib)
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
        let n = node.gpus.len();
        self.fits(
            (0..n).map(|g| node.free_milli(g)),
            (node.cpu_milli > 0).then(|| node.cpu_free()),
            (node.memory_mib > 0).then(|| node.mem_free()),
            node.gpus.first().map_or("", |g| g.model.as_str()),
        )
    }

    /// Whether `node` would still be a free host after `placement`.
    fn hosted_after(&self, node: &Node, placement: &Placement) -> bool {
        let n = node.gpus.len().min(64);
        let mut free = [0u32; 64];
        for (g, slot) in free.iter_mut().enumerate().take(n) {
            *slot = node.free_milli(g);
        }
        for c in placement.assignment.containers.iter().filter(|c| !c.init) {
            for s in &c.slices {
                let g = s.gpu as usize;
                if g < n {
                    free[g] = free[g].saturating_sub(s.milli_on(node.gpus[g].memory_mib));
                }
            }
        }
        let a = &placement.assignment;
        self.fits(
            free[..n].iter().copied(),
            (node.cpu_milli > 0).then(|| node.cpu_free().saturating_sub(a.cpu_milli)),
            (node.memory_mib > 0).then(|| node.mem_free().saturating_sub(a.memory_mib)),
            node.gpus.first().map_or("", |g| g.model.as_str()),
        )
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

/// Bit `k` set: class `k` of a [`ReserveView`] is scarce (at most `keep` free hosts left).
pub type ScarceMask = u64;

/// Of the nodes that have the most host CPU of all nodes with as many GPUs or more, this share is
/// kept back from the start (at least one), before any request that needs one has been seen.
///
/// A quarter was enough while such requests were rare (`default`), but with more multi-GPU pods
/// (`default+multigpu=30` and `=40`, seeds 42-51) 8-GPU pods of 120 cores failed from 63 percent
/// arrival on: 25.09 and 25.33 percent unallocated at 75 percent against FGD's 25.02 and 24.96.
/// Half gave 25.02 and 24.96, and left `default` as it was (docs/performance.md).
pub const INVENTORY_KEEP_SHARE: f64 = 0.5;

/// The reserve classes that hold for a cluster state, and which of them are scarce.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ReserveView {
    /// The mix's classes (learned from requests), then those of the node inventory
    /// ([`inventory_classes`]), at most [`MAX_CLASSES`].
    pub classes: Vec<ReserveClass>,
    pub scarce: ScarceMask,
    /// The lists of GPU models whose free GPUs are short of what the pods bound to them need
    /// ([`model_supply::short_lists`]).
    pub short: Vec<Vec<String>>,
    /// The GPU models of the cluster's nodes (each node's first GPU's), each once.
    pub models: Vec<String>,
}

impl ReserveView {
    /// A key that differs whenever scores may: the scarce classes (what the scorer reads; a
    /// class's `keep` only decides whether it is scarce).
    pub fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        if self.scarce == 0 && self.short.is_empty() {
            // nothing scarce or short: both scorers are left out, whatever the classes
            return 0;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for (k, c) in self.classes.iter().enumerate().filter(|(k, _)| (self.scarce >> k) & 1 == 1) {
            (k, c.gpus, c.milli, c.cpu_milli, c.memory_mib, &c.models).hash(&mut h);
        }
        self.short.hash(&mut h);
        h.finish() | 1
    }
}

/// Classes that only the nodes with the most host CPU can host, read from the node inventory alone
/// (what any scheduler knows before the first pod): for nodes of `g` GPUs whose CPU no other node
/// with `g` GPUs or more reaches, a request of `g` whole GPUs with more CPU than any of those others
/// has. On the Alibaba cluster: 8 GPUs with more than 96 cores, which only the 39 nodes of 128
/// cores host. The first request that large would otherwise find every such node holding a share
/// (the host-aware fragmentation measure rates their CPU best), long before the learned reserve
/// knows of it.
pub fn inventory_classes(cluster: &Cluster) -> Vec<ReserveClass> {
    let mut shapes: Vec<(u32, u64, u32)> = Vec::new();
    for n in cluster.nodes().iter().filter(|n| !n.gpus.is_empty() && n.cpu_milli > 0) {
        let g = n.gpus.len() as u32;
        match shapes.iter_mut().find(|s| s.0 == g && s.1 == n.cpu_milli) {
            Some(s) => s.2 += 1,
            None => shapes.push((g, n.cpu_milli, 1)),
        }
    }
    shapes.sort_unstable();
    let mut out = Vec::new();
    for &(g, cpu, count) in &shapes {
        let others = shapes.iter().filter(|s| s.0 >= g && (s.0, s.1) != (g, cpu));
        if others.clone().any(|s| s.1 >= cpu) {
            continue;
        }
        let Some(second) = others.map(|s| s.1).max() else { continue };
        let keep = (f64::from(count) * INVENTORY_KEEP_SHARE).ceil().max(1.0) as u32;
        out.push(ReserveClass { gpus: g, milli: 1000, cpu_milli: second + 1, memory_mib: 0, models: Vec::new(), keep });
    }
    out
}

/// The reserve for one cluster state, kept up to date incrementally: a cluster state is known by
/// its node stamps ([`Cluster::stamps`], process-wide unique) and node indexing
/// ([`Cluster::layout`]), so only nodes whose stamp changed are looked at again.
#[derive(Debug, Default)]
pub struct ScarcityMemo {
    state: Mutex<MemoState>,
}

#[derive(Debug, Default)]
struct MemoState {
    learned: Vec<ReserveClass>,
    /// The mix's bound demand, and the lists looked at: those and the inventory's.
    learned_bound: Vec<BoundDemand>,
    lists: Vec<BoundDemand>,
    /// Each list's [`model_supply::limits`].
    limits: Vec<(f64, f64)>,
    /// What the cluster has free for the bound lists (their shortness), and each node's part.
    supply: Supply,
    node_supply: Vec<Supply>,
    /// Per bound list (`short_models`), whether it was short at the last look.
    short: Vec<bool>,
    short_models: Vec<Vec<String>>,
    models: Vec<String>,
    classes: Vec<ReserveClass>,
    layout: u64,
    stamps: Vec<u64>,
    /// Per node, its GPUs and host CPU (what [`inventory_classes`] reads).
    shapes: Vec<(usize, u64)>,
    /// Per node, the classes it is a free host of.
    hosts: Vec<u64>,
    /// Per class, its free hosts.
    counts: Vec<u32>,
}

fn host_bits(classes: &[ReserveClass], node: &Node) -> u64 {
    classes.iter().enumerate().filter(|(_, c)| c.hosted_by(node)).fold(0, |m, (k, _)| m | (1 << k))
}

impl MemoState {
    fn rebuild(&mut self, cluster: &Cluster, learned: &[ReserveClass], bound: &[BoundDemand]) {
        let nodes = cluster.nodes();
        self.learned = learned.to_vec();
        self.learned_bound = bound.to_vec();
        self.models = Vec::new();
        for m in nodes.iter().filter_map(|n| n.gpus.first()).map(|g| &g.model) {
            if !self.models.contains(m) {
                self.models.push(m.clone());
            }
        }
        self.lists = bound.iter().cloned().chain(model_supply::inventory_lists(cluster, bound)).collect();
        self.limits = model_supply::limits(&self.lists, bound.len());
        self.node_supply = nodes.iter().map(|n| Supply::of_node(&self.lists, n)).collect();
        self.supply = Supply::new(self.lists.len());
        // a list keeps its state through a new mix or reserve (they change often)
        let was: Vec<(Vec<String>, bool)> =
            std::mem::take(&mut self.short_models).into_iter().zip(std::mem::take(&mut self.short)).collect();
        self.short = self.lists.iter().map(|b| was.iter().any(|(m, s)| *s && *m == b.models)).collect();
        self.short_models = self.lists.iter().map(|b| b.models.clone()).collect();
        for part in &self.node_supply {
            self.supply.add(part);
        }
        self.classes = learned.iter().cloned().chain(inventory_classes(cluster)).take(MAX_CLASSES).collect();
        self.layout = cluster.layout();
        self.stamps = cluster.stamps().to_vec();
        self.shapes = nodes.iter().map(|n| (n.gpus.len(), n.cpu_milli)).collect();
        self.hosts = nodes.iter().map(|n| host_bits(&self.classes, n)).collect();
        self.counts = vec![0; self.classes.len()];
        for &h in &self.hosts {
            for (k, c) in self.counts.iter_mut().enumerate() {
                *c += ((h >> k) & 1) as u32;
            }
        }
    }
}

impl MemoState {
    /// The classes, and which are scarce (free hosts at most their keep).
    fn view(&mut self) -> ReserveView {
        let scarce = self
            .classes
            .iter()
            .zip(&self.counts)
            .enumerate()
            .filter(|(_, (c, &n))| c.keep > 0 && n <= c.keep)
            .fold(0, |s, (k, _)| s | (1 << k));
        let short = model_supply::short_lists(&self.lists, &self.limits, &self.supply, &mut self.short);
        ReserveView { classes: self.classes.clone(), scarce, short, models: self.models.clone() }
    }
}

impl ScarcityMemo {
    /// The reserve of `cluster` with the mix's `learned` classes and `bound` demand.
    pub fn view(&self, cluster: &Cluster, learned: &[ReserveClass], bound: &[BoundDemand]) -> ReserveView {
        self.current(cluster, learned, bound).view()
    }

    /// [`ScarcityMemo::view`], with each class's free hosts now (by class index, as in the view).
    pub fn view_with_hosts(
        &self,
        cluster: &Cluster,
        learned: &[ReserveClass],
        bound: &[BoundDemand],
    ) -> (ReserveView, Vec<u32>) {
        let mut m = self.current(cluster, learned, bound);
        (m.view(), m.counts.clone())
    }

    /// The model lists looked at (the mix's `bound` and the inventory's), each with the GPUs its
    /// pods could use now (thousandths) and whether it is short.
    pub fn lists_with_supply(
        &self,
        cluster: &Cluster,
        learned: &[ReserveClass],
        bound: &[BoundDemand],
    ) -> Vec<(BoundDemand, u64, bool)> {
        let mut m = self.current(cluster, learned, bound);
        m.view();
        let MemoState { lists, supply, short, .. } = &*m;
        lists.iter().zip(&supply.within).zip(short).map(|((l, &w), &s)| (l.clone(), w, s)).collect()
    }

    /// The memo brought up to `cluster`'s state.
    fn current(
        &self,
        cluster: &Cluster,
        learned: &[ReserveClass],
        bound: &[BoundDemand],
    ) -> std::sync::MutexGuard<'_, MemoState> {
        let mut m = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let stamps = cluster.stamps();
        let nodes = cluster.nodes();
        if m.learned != learned
            || m.learned_bound != bound
            || m.layout != cluster.layout()
            || m.stamps.len() != stamps.len()
        {
            m.rebuild(cluster, learned, bound);
        } else {
            let mut reshaped = false;
            let MemoState { classes, lists, stamps: seen, shapes, hosts, counts, supply, node_supply, .. } = &mut *m;
            for (i, (old, &new)) in seen.iter_mut().zip(stamps).enumerate() {
                if *old == new {
                    continue;
                }
                *old = new;
                let node = &nodes[i];
                if shapes[i] != (node.gpus.len(), node.cpu_milli) {
                    reshaped = true;
                    break;
                }
                let part = Supply::of_node(lists, node);
                let was = std::mem::replace(&mut node_supply[i], part);
                supply.remove(&was);
                supply.add(&node_supply[i]);
                let bits = host_bits(classes, node);
                let was = std::mem::replace(&mut hosts[i], bits);
                for (k, c) in counts.iter_mut().enumerate() {
                    *c = *c + ((bits >> k) & 1) as u32 - ((was >> k) & 1) as u32;
                }
            }
            if reshaped {
                // a node's capacity changed: the inventory's classes may have too
                m.rebuild(cluster, learned, bound);
            }
        }
        m
    }
}

/// Keeps back the last free hosts of the reserve's scarce classes (module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReserveScorer;

/// A pod's size as a reserve class reads it: a share by its compute alone, the same on every node
/// (a share given in GPU memory reads no larger than it is, so a reserve is never given away by
/// mistake), and the models it is bound to. `None` for a pod without GPUs.
fn pod_size(req: &PodRequest) -> Option<MixEntry> {
    let gpus = req.total_gpus();
    let share = |d: &crate::core::resources::GpuDemand| if d.is_whole() { 1000 } else { (d.core_on() * 10).min(1000) };
    let milli = req.containers.iter().map(|c| share(&c.demand)).max()?;
    (gpus > 0).then(|| MixEntry::of_request(req, milli))
}

/// The scarce classes `ctx`'s pod is not large enough to consume.
fn guarded<'a>(ctx: &'a ScoreContext<'_>) -> impl Iterator<Item = &'a ReserveClass> + 'a {
    let pod = pod_size(ctx.request);
    let scarce = ctx.reserve.scarce;
    ctx.reserve
        .classes
        .iter()
        .enumerate()
        .filter(move |(k, c)| (scarce >> k) & 1 == 1 && !pod.as_ref().is_some_and(|p| c.is_consumed_by(p)))
        .map(|(_, c)| c)
}

impl Scorer for ReserveScorer {
    fn name(&self) -> &'static str {
        "reserve"
    }

    fn applies(&self, ctx: &ScoreContext<'_>) -> bool {
        ctx.reserve.scarce != 0 && guarded(ctx).next().is_some()
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        if ctx.reserve.scarce == 0 {
            return 1.0;
        }
        let taken = guarded(ctx).any(|c| c.hosted_by(node) && !c.hosted_after(node, placement));
        if taken {
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
    use crate::core::inventory::Board;
    use crate::core::resources::{GpuDemand, PodRequest};
    use crate::placement::engine::Engine;
    use crate::placement::profile::Profile;
    use crate::placement::scorers::fragmentation::WorkloadMix;

    /// `big-0..big-2`: 8 GPUs, 128 cores, 768 GiB (the only hosts of the large class); `small-0..3`:
    /// 8 GPUs, 96 cores, 384 GiB.
    fn cluster() -> Cluster {
        let board = Board::Flat { gpus: 8, model: "G".into(), memory_mib: 32768 }.resolve(Path::new(".")).unwrap();
        let mut nodes = Vec::new();
        for i in 0..3 {
            nodes.push(board.node(&format!("big-{i}"), BTreeMap::new(), 128_000, 786_432));
        }
        for i in 0..4 {
            nodes.push(board.node(&format!("small-{i}"), BTreeMap::new(), 96_000, 393_216));
        }
        Cluster::new(nodes)
    }

    fn large(keep: u32) -> ReserveClass {
        ReserveClass { gpus: 8, milli: 1000, cpu_milli: 120_000, memory_mib: 700_000, models: Vec::new(), keep }
    }

    fn whole(name: &str, gpus: u32, cpu_milli: u64, memory_mib: u64) -> PodRequest {
        let mut r = PodRequest::single(name, GpuDemand::Whole { gpus });
        r.cpu_milli = cpu_milli;
        r.memory_mib = memory_mib;
        r
    }

    fn engine(keep: u32) -> Engine {
        Engine::new(Profile::gpuplace(), WorkloadMix::new(Vec::new(), vec![large(keep)]))
    }

    fn best(e: &Engine, c: &Cluster, req: &PodRequest) -> String {
        let ev = e.evaluate_all(c, req, 0);
        c.nodes()[ev.ranked[0].node].name.clone()
    }

    #[test]
    fn a_class_bound_to_models_is_consumed_only_by_requests_bound_to_them() {
        let class =
            ReserveClass { gpus: 1, milli: 500, cpu_milli: 4000, memory_mib: 0, models: vec!["P100".into()], keep: 2 };
        let request = |models: &[&str]| MixEntry {
            gpus: 1,
            milli: 1000,
            cpu_milli: 8000,
            memory_mib: 1024,
            models: models.iter().map(|m| m.to_string()).collect(),
            weight: 0.0,
        };
        assert!(class.is_consumed_by(&request(&["p100"])));
        // larger, but free to run anywhere, or bound to models the class does not keep
        assert!(!class.is_consumed_by(&request(&[])));
        assert!(!class.is_consumed_by(&request(&["P100", "T4"])));
        // a class that names no model is consumed by size alone
        let any = ReserveClass { models: Vec::new(), ..class };
        assert!(any.is_consumed_by(&request(&[])) && any.is_consumed_by(&request(&["T4"])));
    }

    #[test]
    fn scarcity_follows_the_cluster_incrementally() {
        let mut c = cluster();
        let memo = ScarcityMemo::default();
        let classes = [large(2), large(3)];
        // demand bound to the nodes' model: its usable GPUs are kept incrementally too
        let bound = [BoundDemand {
            models: vec!["G".into()],
            share: 0.5,
            gpus_per_pod: 1.0,
            cpu_milli_per_pod: 4000.0,
            memory_mib_per_pod: 0.0,
        }];
        // the inventory adds its own class: 8 GPUs with more than 96 cores, 2 of 3 hosts kept
        let view = memo.view(&c, &classes, &bound);
        assert_eq!(view.classes.len(), 3);
        assert_eq!((view.classes[2].gpus, view.classes[2].cpu_milli, view.classes[2].keep), (8, 96_001, 2));
        assert_eq!(view.scarce, 0b010, "3 free hosts: scarce only for a keep of 3");
        let scarce = |c: &Cluster| memo.view(c, &classes, &bound).scarce;
        let e = engine(0);
        e.schedule(&mut c, &whole("ns/a", 1, 4000, 1024), 0).unwrap();
        // the incremental count equals a fresh one, whichever node took the pod
        assert_eq!(memo.view(&c, &classes, &bound), ScarcityMemo::default().view(&c, &classes, &bound));
        let a = c.pod_node("ns/a").unwrap().name.clone();
        // on a big node it leaves 2 free hosts: scarce for keeps of 2 and 3, and for the inventory's 2
        assert_eq!(scarce(&c), if a.starts_with("big") { 0b111 } else { 0b010 }, "{a}");
        for i in 0..2 {
            let name = format!("ns/b{i}");
            c.allocate(crate::core::cluster::PodAssignment {
                pod: name,
                node: format!("big-{i}"),
                containers: Vec::new(),
                cpu_milli: 40_000,
                memory_mib: 0,
                group: None,
            })
            .unwrap();
        }
        assert_eq!(memo.view(&c, &classes, &bound), ScarcityMemo::default().view(&c, &classes, &bound));
        // its free-host counts are each class's hosts, counted afresh
        let (view, hosts) = memo.view_with_hosts(&c, &classes, &bound);
        let recount: Vec<u32> =
            view.classes.iter().map(|k| c.nodes().iter().filter(|n| k.hosted_by(n)).count() as u32).collect();
        assert_eq!(hosts, recount);
        c.release("ns/a").unwrap();
        c.release("ns/b0").unwrap();
        c.release("ns/b1").unwrap();
        assert_eq!(scarce(&c), 0b010);
        assert_eq!(memo.view(&c, &[large(0)], &[]).scarce, 0, "keep 0 never protects; 3 of 3 inventory hosts free");
    }

    #[test]
    fn the_last_free_hosts_are_kept_for_the_large_requests() {
        let mut c = cluster();
        // a share-like pod with plenty of CPU: the host-aware fragmentation measure alone might put
        // it anywhere; with 3 hosts and a keep of 3 it must stay off the big nodes
        let small = whole("ns/s", 1, 8000, 16_384);
        let e = engine(3);
        assert_ne!(e.shared_key(&c), 0);
        let ev = e.evaluate_all(&c, &small, 0);
        let first_small = ev.ranked.iter().position(|r| c.nodes()[r.node].name.starts_with("small")).unwrap();
        let first_big = ev.ranked.iter().position(|r| c.nodes()[r.node].name.starts_with("big")).unwrap();
        assert!(first_small < first_big, "{:?}", ev.ranked);
        let parts = e.score(
            &c,
            &small,
            ev.ranked[first_big].node,
            &ev.ranked[first_big].placement(&c, &small).unwrap(),
            0,
            None,
        );
        assert!(parts.parts.iter().any(|(n, v)| *n == "reserve" && *v == 0.0));
        // a large request is what the reserve is for: no penalty, and it goes to a big node
        let monster = whole("ns/m", 8, 120_000, 720_000);
        assert!(best(&e, &c, &monster).starts_with("big"));
        // while plenty of hosts are left (keep 1 of 3), the scorer is left out: scores are those of
        // a profile without it
        let relaxed = engine(1);
        let plain = Engine::new(Profile::gpuplace(), WorkloadMix::default());
        let (a, b) = (relaxed.evaluate_all(&c, &small, 0), plain.evaluate_all(&c, &small, 0));
        assert_eq!(
            a.ranked.iter().map(|r| (r.node, r.total)).collect::<Vec<_>>(),
            b.ranked.iter().map(|r| (r.node, r.total)).collect::<Vec<_>>()
        );
        // small nodes full: the big ones are still used rather than failing the pod
        for i in 0..4 {
            e.schedule(&mut c, &whole(&format!("ns/fill{i}"), 8, 90_000, 100_000), 0).unwrap();
        }
        assert!(c.nodes().iter().filter(|n| n.name.starts_with("small")).all(|n| n.cpu_free() < 8000));
        assert!(best(&e, &c, &small).starts_with("big"));
    }
}
