//! The scorers' cluster-wide facts ([`Facts`]), kept per cluster state under each scorer's name.
//!
//! Facts depend on every node, not only on the one scored (which reserve classes have at most
//! `keep` free hosts left, which model lists are short of free GPUs, which switches are whole), so
//! the engine works them out once per cluster state rather than once per pod: a cluster state is
//! known by its node stamps ([`Cluster::stamps`], process-wide unique) and node indexing
//! ([`Cluster::layout`]), and only nodes whose stamp changed are looked at again. Callers that cache
//! per-node verdicts key them on the facts' keys
//! ([`Engine::shared_key`](crate::placement::engine::Engine::shared_key)).

use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard};

use crate::placement::mix::WorkloadMix;
use crate::placement::scorer::{Facts, Shared};
use gpuplace_core::cluster::Cluster;

/// Every scorer's facts, by its name, kept up to date incrementally.
#[derive(Debug, Default)]
pub struct FactsMemo {
    state: Mutex<MemoState>,
}

#[derive(Debug, Default)]
struct MemoState {
    facts: Vec<(&'static str, Box<dyn Facts>)>,
    /// Whether `layout`, `stamps` and `shapes` are those the facts were brought up to.
    built: bool,
    layout: u64,
    stamps: Vec<u64>,
    /// Per node, its GPUs and host CPU: what the node inventory's reserve classes and model lists
    /// are read from, so a node whose shape changed rebuilds every fact.
    shapes: Vec<(usize, u64)>,
}

fn shape(node: &gpuplace_core::cluster::Node) -> (usize, u64) {
    (node.gpus.len(), node.cpu_milli)
}

/// The facts for one cluster state: each scorer's, by name, and their joint key.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub by_name: Vec<(&'static str, Shared)>,
    /// Differs whenever some scorer's facts may score differently (never 0).
    pub key: u64,
}

impl Snapshot {
    /// The facts of the scorer called `name`.
    pub fn get(&self, name: &str) -> Option<&Shared> {
        self.by_name.iter().find(|(n, _)| *n == name).map(|(_, s)| s)
    }
}

impl FactsMemo {
    /// Keeps `facts`, each under its scorer's name.
    pub fn new(facts: Vec<(&'static str, Box<dyn Facts>)>) -> Self {
        Self { state: Mutex::new(MemoState { facts, ..MemoState::default() }) }
    }

    /// The facts for `cluster` with `mix`.
    pub fn snapshot(&self, cluster: &Cluster, mix: &WorkloadMix) -> Snapshot {
        let mut m = self.current(cluster, mix);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let by_name = m
            .facts
            .iter_mut()
            .map(|(name, f)| {
                let (shared, key) = f.snapshot();
                (*name, key).hash(&mut h);
                (*name, shared)
            })
            .collect();
        Snapshot { by_name, key: h.finish() | 1 }
    }

    /// Reads the facts of the scorer called `name`, as their own type `F`, for `cluster` with
    /// `mix` (`None` when no such facts are kept).
    pub fn read<F: Facts + 'static, R>(
        &self,
        cluster: &Cluster,
        mix: &WorkloadMix,
        name: &str,
        read: impl FnOnce(&F) -> R,
    ) -> Option<R> {
        let mut m = self.current(cluster, mix);
        let (_, f) = m.facts.iter_mut().find(|(n, _)| *n == name)?;
        // brought up to this state's snapshot first (some facts settle there, as a short list does)
        f.snapshot();
        f.as_any().downcast_ref::<F>().map(read)
    }

    /// The facts brought up to `cluster`'s state.
    fn current(&self, cluster: &Cluster, mix: &WorkloadMix) -> MutexGuard<'_, MemoState> {
        let mut m = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (stamps, nodes) = (cluster.stamps(), cluster.nodes());
        let reshaped = !m.built
            || m.layout != cluster.layout()
            || m.stamps.len() != stamps.len()
            || (m.stamps.iter().zip(stamps).zip(&m.shapes).zip(nodes))
                .any(|(((old, new), was), node)| old != new && *was != shape(node));
        if reshaped {
            for (_, f) in &mut m.facts {
                f.rebuild(cluster, mix);
            }
            m.layout = cluster.layout();
            m.stamps = stamps.to_vec();
            m.shapes = nodes.iter().map(shape).collect();
            m.built = true;
            return m;
        }
        let MemoState { facts, stamps: seen, .. } = &mut *m;
        let mut redo: Vec<bool> = facts.iter().map(|(_, f)| f.stale(cluster, mix)).collect();
        for (i, (old, &new)) in seen.iter_mut().zip(stamps).enumerate() {
            if *old == new {
                continue;
            }
            *old = new;
            for ((_, f), redo) in facts.iter_mut().zip(&mut redo) {
                *redo = *redo || !f.update(cluster, i);
            }
        }
        for ((_, f), _) in facts.iter_mut().zip(&redo).filter(|(_, &r)| r) {
            f.rebuild(cluster, mix);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::placement::test_fixtures::pcie_cluster;
    use gpuplace_core::resources::{GpuDemand, PodRequest};

    /// Facts that count idle GPUs per node, and how often they were rebuilt and updated.
    #[derive(Debug, Default)]
    struct IdleCount {
        mix_entries: usize,
        per_node: Vec<usize>,
        rebuilds: usize,
        updates: usize,
        /// Node index whose update asks for a rebuild.
        refuse: Option<usize>,
    }

    impl Facts for IdleCount {
        fn stale(&self, _cluster: &Cluster, mix: &WorkloadMix) -> bool {
            self.mix_entries != mix.entries.len()
        }
        fn rebuild(&mut self, cluster: &Cluster, mix: &WorkloadMix) {
            self.mix_entries = mix.entries.len();
            self.per_node = cluster.nodes().iter().map(|n| n.idle_gpus()).collect();
            self.rebuilds += 1;
        }
        fn update(&mut self, cluster: &Cluster, i: usize) -> bool {
            self.updates += 1;
            self.per_node[i] = cluster.nodes()[i].idle_gpus();
            self.refuse != Some(i)
        }
        fn snapshot(&mut self) -> (Shared, u64) {
            let total: usize = self.per_node.iter().sum();
            (Arc::new(total), total as u64)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    fn counts(memo: &FactsMemo, c: &Cluster, mix: &WorkloadMix) -> (usize, usize) {
        memo.read(c, mix, "idle", |f: &IdleCount| (f.rebuilds, f.updates)).unwrap()
    }

    fn take(c: &mut Cluster, node: usize, pod: &str) {
        let req = PodRequest::single(pod, GpuDemand::Whole { gpus: 1 });
        let p = crate::placement::engine::Engine::default().place(c, &req, node).unwrap();
        c.allocate(p.assignment).unwrap();
    }

    #[test]
    fn facts_are_kept_by_name_and_follow_only_the_nodes_that_changed() {
        let mut c = pcie_cluster(&[&[], &[], &[]]);
        let mix = WorkloadMix::default();
        let memo = FactsMemo::new(vec![("idle", Box::<IdleCount>::default())]);
        let first = memo.snapshot(&c, &mix);
        let idle = |s: &Snapshot| *s.get("idle").unwrap().downcast_ref::<usize>().unwrap();
        assert_eq!(idle(&first), 24);
        assert!(first.get("other").is_none());
        assert_eq!(counts(&memo, &c, &mix), (1, 0));
        // the same state: nothing is looked at again, and the key stays
        assert_eq!(memo.snapshot(&c, &mix).key, first.key);
        assert_eq!(counts(&memo, &c, &mix), (1, 0));
        // one node changed: one update
        take(&mut c, 1, "ns/a");
        let after = memo.snapshot(&c, &mix);
        assert_eq!(idle(&after), 23);
        assert_ne!(after.key, first.key);
        assert_eq!(counts(&memo, &c, &mix), (1, 1));
        // a new mix makes them stale: rebuilt
        let entry = crate::placement::mix::MixEntry {
            gpus: 1,
            milli: 1000,
            cpu_milli: 0,
            memory_mib: 0,
            models: Vec::new(),
            weight: 1.0,
        };
        let mix2 = WorkloadMix::new(vec![entry], Vec::new());
        assert_eq!(idle(&memo.snapshot(&c, &mix2)), 23);
        assert_eq!(counts(&memo, &c, &mix2), (2, 1));
        // an update that cannot be done in place: rebuilt
        memo.state.lock().unwrap().facts[0].1 = Box::new(IdleCount { refuse: Some(2), ..IdleCount::default() });
        memo.state.lock().unwrap().built = false;
        memo.snapshot(&c, &mix2);
        take(&mut c, 2, "ns/b");
        assert_eq!(idle(&memo.snapshot(&c, &mix2)), 22);
        assert_eq!(counts(&memo, &c, &mix2), (2, 1), "rebuilt after the refused update");
        // a node's host CPU changed (the inventory's classes read it): every fact rebuilt
        c.node_mut("n0").unwrap().cpu_milli = 64_000;
        memo.snapshot(&c, &mix2);
        assert_eq!(counts(&memo, &c, &mix2), (3, 1));
        // another cluster (another layout): rebuilt
        let other = pcie_cluster(&[&[0]]);
        assert_eq!(idle(&memo.snapshot(&other, &mix2)), 7);
        assert_eq!(counts(&memo, &other, &mix2), (4, 1));
    }
}
