//! Reserve: keeps back the last free hosts of the largest requests seen.
//!
//! Fragmentation rates a placement by what the *typical* requests could still use, so requests far
//! too rare to be in the mix get no protection. On the Alibaba trace, pods of 8 GPUs with 120 cores
//! and 625-720 GiB of host memory fit only on a nearly empty 128-core node; the host-aware measure
//! rates shares on exactly those nodes as the cheapest, so all of them take a share long before the
//! next such pod arrives, and it fails in a three-quarters-full cluster
//! (docs/performance-journal.md, "Early failures").
//!
//! The mix therefore carries, besides its entries, a few *reserve classes*
//! ([`WorkloadMix::reserve`](crate::placement::mix::WorkloadMix::reserve)): the largest request types seen recently, each with how many free
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
//! scorer's [`ReserveFacts`] count each class's free hosts per cluster state (the engine updates
//! them only for the nodes whose stamp changed), and callers that cache per-node verdicts key them
//! on which classes are scarce too ([`Engine::shared_key`](crate::placement::engine::Engine::shared_key)).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::placement::feasibility::Placement;
use crate::placement::mix::{HostFree, MixEntry, ReserveClass, WorkloadMix};
use crate::placement::scorer::{Data, Facts, ScoreContext, Scorer, Shared};
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::PodRequest;

/// At most this many reserve classes are looked at (a bit each in the scarcity mask).
pub const MAX_CLASSES: usize = 64;

/// Bit `k` set: class `k` of a [`Reserve`] is scarce (at most `keep` free hosts left).
pub type ScarceMask = u64;

/// What the scorer reads: the reserve classes that hold for a cluster state, and which are scarce.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Reserve {
    /// The mix's classes (learned from requests), then those of the node inventory
    /// ([`inventory_classes`]), at most [`MAX_CLASSES`].
    pub classes: Vec<ReserveClass>,
    pub scarce: ScarceMask,
}

/// Each class's free hosts, kept per node ([`Facts`]).
#[derive(Debug, Default)]
pub struct ReserveFacts {
    /// The mix's classes they were built for.
    learned: Vec<ReserveClass>,
    classes: Vec<ReserveClass>,
    /// Per node, the classes it is a free host of.
    hosts: Vec<u64>,
    /// Per class, its free hosts.
    counts: Vec<u32>,
    /// The last snapshot, kept while no class turns scarce or plentiful.
    last: Option<(ScarceMask, Shared, u64)>,
}

fn host_bits(classes: &[ReserveClass], node: &Node) -> u64 {
    classes.iter().enumerate().filter(|(_, c)| c.hosted_by(node)).fold(0, |m, (k, _)| m | (1 << k))
}

impl ReserveFacts {
    fn scarce(&self) -> ScarceMask {
        self.classes
            .iter()
            .zip(&self.counts)
            .enumerate()
            .filter(|(_, (c, &n))| c.keep > 0 && n <= c.keep)
            .fold(0, |s, (k, _)| s | (1 << k))
    }

    /// Each class with its free hosts now and whether it is scarce (what `/inspect` shows).
    pub fn classes_with_hosts(&self) -> Vec<(ReserveClass, u32, bool)> {
        let scarce = self.scarce();
        let flag = |k: usize| (scarce >> k) & 1 == 1;
        self.classes.iter().zip(&self.counts).enumerate().map(|(k, (c, &n))| (c.clone(), n, flag(k))).collect()
    }
}

impl Facts for ReserveFacts {
    fn stale(&self, _cluster: &Cluster, mix: &WorkloadMix) -> bool {
        self.learned != mix.reserve
    }

    fn rebuild(&mut self, cluster: &Cluster, mix: &WorkloadMix) {
        let nodes = cluster.nodes();
        self.learned = mix.reserve.clone();
        self.classes = mix.reserve.iter().cloned().chain(inventory_classes(cluster)).take(MAX_CLASSES).collect();
        self.hosts = nodes.iter().map(|n| host_bits(&self.classes, n)).collect();
        self.counts = vec![0; self.classes.len()];
        for &h in &self.hosts {
            for (k, c) in self.counts.iter_mut().enumerate() {
                *c += ((h >> k) & 1) as u32;
            }
        }
        self.last = None;
    }

    fn update(&mut self, cluster: &Cluster, i: usize) -> bool {
        // a node whose GPUs or host CPU changed (the inventory's classes may have) never comes
        // here: the memo rebuilds every fact then
        let (Some(node), Some(hosts)) = (cluster.nodes().get(i), self.hosts.get_mut(i)) else { return false };
        let bits = host_bits(&self.classes, node);
        let was = std::mem::replace(hosts, bits);
        for (k, c) in self.counts.iter_mut().enumerate() {
            *c = *c + ((bits >> k) & 1) as u32 - ((was >> k) & 1) as u32;
        }
        true
    }

    /// Keyed on the scarce classes alone (a class's `keep` only decides whether it is scarce); 0
    /// while none is, as the scorer is then left out whatever the classes.
    fn snapshot(&mut self) -> (Shared, u64) {
        let scarce = self.scarce();
        if let Some((mask, shared, key)) = &self.last {
            if *mask == scarce {
                return (shared.clone(), *key);
            }
        }
        let key = if scarce == 0 {
            0
        } else {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for (k, c) in self.classes.iter().enumerate().filter(|(k, _)| (scarce >> k) & 1 == 1) {
                (k, c.gpus, c.milli, c.cpu_milli, c.memory_mib, &c.models).hash(&mut h);
            }
            h.finish() | 1
        };
        let shared: Shared = Arc::new(Reserve { classes: self.classes.clone(), scarce });
        self.last = Some((scarce, shared.clone(), key));
        (shared, key)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Of the nodes that have the most host CPU of all nodes with as many GPUs or more, this share is
/// kept back from the start (at least one), before any request that needs one has been seen.
///
/// A quarter was enough while such requests were rare (`default`), but with more multi-GPU pods
/// (`default+multigpu=30` and `=40`, seeds 42-51) 8-GPU pods of 120 cores failed from 63 percent
/// arrival on: 25.09 and 25.33 percent unallocated at 75 percent against FGD's 25.02 and 24.96.
/// Half gave 25.02 and 24.96, and left `default` as it was (docs/performance-journal.md).
pub const INVENTORY_KEEP_SHARE: f64 = 0.5;

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

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "reserve";

/// It counts only for pods that would take one of the last free hosts of the largest requests; high,
/// so that such a pod goes elsewhere whenever it can.
pub const DEFAULT_WEIGHT: f64 = 6.0;

/// Keeps back the last free hosts of the reserve's scarce classes (module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReserveScorer;

/// A pod's size as a reserve class reads it: a share by its compute alone, the same on every node
/// (a share given in GPU memory reads no larger than it is, so a reserve is never given away by
/// mistake), and the models it is bound to. `None` for a pod without GPUs.
fn pod_size(req: &PodRequest) -> Option<MixEntry> {
    let gpus = req.total_gpus();
    let share =
        |d: &gpuplace_core::resources::GpuDemand| if d.is_whole() { 1000 } else { (d.core_on() * 10).min(1000) };
    let milli = req.containers.iter().map(|c| share(&c.demand)).max()?;
    (gpus > 0).then(|| MixEntry::of_request(req, milli))
}

/// The scarce classes `ctx`'s pod is not large enough to consume.
fn guarded<'a>(ctx: &ScoreContext<'_>, reserve: &'a Reserve) -> impl Iterator<Item = &'a ReserveClass> + 'a {
    let pod = pod_size(ctx.request);
    let scarce = reserve.scarce;
    reserve
        .classes
        .iter()
        .enumerate()
        .filter(move |(k, c)| (scarce >> k) & 1 == 1 && !pod.as_ref().is_some_and(|p| c.is_consumed_by(p)))
        .map(|(_, c)| c)
}

/// Whether `node` would still be a free host of `class` after `placement`.
fn hosted_after(class: &ReserveClass, node: &Node, placement: &Placement) -> bool {
    let (_, free, n) = placement.free_milli_before_after(node);
    let a = &placement.assignment;
    let model = node.gpus.first().map_or("", |g| g.model.as_str());
    class.fits(free[..n].iter().copied(), HostFree::of(node, a.cpu_milli, a.memory_mib), model)
}

impl Scorer for ReserveScorer {
    fn name(&self) -> &'static str {
        NAME
    }

    fn facts(&self) -> Option<Box<dyn Facts>> {
        Some(Box::<ReserveFacts>::default())
    }

    fn applies(&self, ctx: &ScoreContext<'_>, data: Data<'_>) -> bool {
        data.get::<Reserve>().is_some_and(|r| r.scarce != 0 && guarded(ctx, r).next().is_some())
    }

    fn score(&self, ctx: &ScoreContext<'_>, data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        let Some(reserve) = data.get::<Reserve>().filter(|r| r.scarce != 0) else { return 1.0 };
        let taken = guarded(ctx, reserve).any(|c| c.hosted_by(node) && !hosted_after(c, node, placement));
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
    use crate::placement::engine::Engine;
    use crate::placement::mix::{BoundDemand, WorkloadMix};
    use crate::placement::profile::Profile;
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::{GpuDemand, PodRequest};

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
        // demand bound to the nodes' model: its usable GPUs are kept incrementally too
        let bound = vec![BoundDemand {
            models: vec!["G".into()],
            share: 0.5,
            gpus_per_pod: 1.0,
            cpu_milli_per_pod: 4000.0,
            memory_mib_per_pod: 0.0,
        }];
        let mix = WorkloadMix::new(Vec::new(), vec![large(2), large(3)]).with_bound(bound);
        // one engine follows the cluster; each check compares it with an engine that starts afresh
        let kept = Engine::new(Profile::gpuplace(), mix.clone());
        let fresh = || Engine::new(Profile::gpuplace(), mix.clone());
        let agree = |c: &Cluster| {
            let f = fresh();
            assert_eq!(kept.reserve_classes(c), f.reserve_classes(c));
            assert_eq!(kept.model_lists(c), f.model_lists(c));
            assert_eq!(kept.shared_key(c), f.shared_key(c));
        };
        let scarce = |c: &Cluster| {
            kept.reserve_classes(c).iter().enumerate().filter(|(_, (_, _, s))| *s).fold(0, |m, (k, _)| m | (1 << k))
        };
        // the inventory adds its own class: 8 GPUs with more than 96 cores, 2 of 3 hosts kept
        let classes = kept.reserve_classes(&c);
        assert_eq!(classes.len(), 3);
        assert_eq!((classes[2].0.gpus, classes[2].0.cpu_milli, classes[2].0.keep), (8, 96_001, 2));
        assert_eq!(scarce(&c), 0b010, "3 free hosts: scarce only for a keep of 3");
        let e = engine(0);
        e.schedule(&mut c, &whole("ns/a", 1, 4000, 1024), 0).unwrap();
        // the incremental count equals a fresh one, whichever node took the pod
        agree(&c);
        let a = c.pod_node("ns/a").unwrap().name.clone();
        // on a big node it leaves 2 free hosts: scarce for keeps of 2 and 3, and for the inventory's 2
        assert_eq!(scarce(&c), if a.starts_with("big") { 0b111 } else { 0b010 }, "{a}");
        for i in 0..2 {
            let name = format!("ns/b{i}");
            c.allocate(gpuplace_core::assignment::PodAssignment {
                pod: name,
                node: format!("big-{i}"),
                containers: Vec::new(),
                cpu_milli: 40_000,
                memory_mib: 0,
                group: None,
            })
            .unwrap();
        }
        agree(&c);
        // its free-host counts are each class's hosts, counted afresh
        let recount: Vec<u32> = (kept.reserve_classes(&c).iter())
            .map(|(k, _, _)| c.nodes().iter().filter(|n| k.hosted_by(n)).count() as u32)
            .collect();
        let hosts: Vec<u32> = kept.reserve_classes(&c).iter().map(|(_, h, _)| *h).collect();
        assert_eq!(hosts, recount);
        c.release("ns/a").unwrap();
        c.release("ns/b0").unwrap();
        c.release("ns/b1").unwrap();
        assert_eq!(scarce(&c), 0b010);
        agree(&c);
        // a new mix: the classes are worked out anew
        let mut renewed = Engine::new(Profile::gpuplace(), mix.clone());
        renewed.shared_key(&c);
        renewed.mix = WorkloadMix::new(Vec::new(), vec![large(0)]);
        let now = renewed.reserve_classes(&c);
        assert_eq!(now.len(), 2);
        assert!(now.iter().all(|(_, _, s)| !s), "keep 0 never protects; 3 of 3 inventory hosts free");
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
        let parts =
            e.score(&c, &small, ev.ranked[first_big].node, &ev.ranked[first_big].placement(&c, &small).unwrap(), 0);
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
