//! The cluster-wide facts behind the reserve, model-supply and whole scorers, kept per cluster state: which
//! reserve classes have at most `keep` free hosts left, and which lists of GPU models are short of
//! free GPUs for the pods bound to them, and which nodes and switches are whole
//! (`placement::whole_units`). All depend on every node, not only on the one scored, so
//! the engine works them out once per cluster state ([`ScarcityMemo`], updated only for the nodes
//! whose stamp changed), and callers that cache per-node verdicts key them on the result
//! ([`Engine::shared_key`](crate::placement::engine::Engine::shared_key)).

use std::sync::Mutex;

use crate::placement::mix::{BoundDemand, ReserveClass};
use crate::placement::scorers::model_supply::{self, Supply};
use crate::placement::scorers::reserve::inventory_classes;
use crate::placement::views::{ReserveView, MAX_CLASSES};
use crate::placement::whole_units::WholeUnits;
use gpuplace_core::cluster::{Cluster, Node};

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
    /// The whole nodes and switches (`scorers::whole`).
    whole: WholeUnits,
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
        self.whole.rebuild(cluster);
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
        let whole = self.whole.view();
        ReserveView { classes: self.classes.clone(), scarce, short, models: self.models.clone(), whole }
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
            || !m.whole.has_levels(cluster)
        {
            m.rebuild(cluster, learned, bound);
        } else {
            let mut reshaped = false;
            let MemoState { classes, lists, stamps: seen, shapes, hosts, counts, supply, node_supply, whole, .. } =
                &mut *m;
            for (i, (old, &new)) in seen.iter_mut().zip(stamps).enumerate() {
                if *old == new {
                    continue;
                }
                *old = new;
                let node = &nodes[i];
                // a node's capacity changed (the inventory's classes may have too), or its switches
                if shapes[i] != (node.gpus.len(), node.cpu_milli) || !whole.update(cluster, i) {
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
                m.rebuild(cluster, learned, bound);
            }
        }
        m
    }
}
