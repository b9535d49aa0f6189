//! Network locality for jobs of several pods (`gpuplace.io/group`): the same ToR as the group's pods
//! already placed, else the same spine, and room under that switch for the rest of the group.

use std::collections::HashMap;

use crate::core::cluster::{Cluster, Node};
use crate::core::resources::GroupSpec;
use crate::placement::feasibility::Placement;
use crate::placement::scorer::{ScoreContext, Scorer};

#[derive(Debug, Default, Clone, Copy)]
pub struct NetworkScorer;

/// A node's network path: its value for each configured level, coarse to fine.
pub type NetPath = Vec<Option<String>>;

/// Where a group stands, computed once per pod rather than once per node.
#[derive(Debug, Clone, Default)]
pub struct GroupView {
    /// Network paths of the nodes holding the group's placed pods.
    pub peer_paths: Vec<NetPath>,
    pub placed: usize,
    pub size: usize,
    /// Idle healthy GPUs under each leaf switch (full path).
    pub idle_by_leaf: HashMap<NetPath, usize>,
    pub levels: usize,
}

pub fn path_of(cluster: &Cluster, node: &Node) -> NetPath {
    cluster.network_path(node).map(|v| v.map(str::to_string)).collect()
}

impl GroupView {
    pub fn new(cluster: &Cluster, group: &GroupSpec) -> Self {
        let mut v = Self { size: group.size as usize, levels: cluster.network_levels.len(), ..Self::default() };
        for n in cluster.nodes() {
            let path = path_of(cluster, n);
            let holds = n.pods().filter(|p| p.group.as_deref() == Some(group.key.as_str())).count();
            if holds > 0 {
                v.placed += holds;
                v.peer_paths.push(path.clone());
            }
            let idle = (0..n.gpus.len()).filter(|&g| n.is_gpu_free(g) && n.gpus[g].healthy).count();
            *v.idle_by_leaf.entry(path).or_default() += idle;
        }
        v
    }
}

/// How many levels (coarse to fine) two paths share before they differ or a label is missing.
pub fn shared_levels(a: &[Option<String>], b: &[Option<String>]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x.is_some() && x == y).count()
}

impl Scorer for NetworkScorer {
    fn name(&self) -> &'static str {
        "network"
    }

    fn score(&self, ctx: &ScoreContext<'_>, node: &Node, placement: &Placement) -> f64 {
        let Some(view) = ctx.group else { return 1.0 };
        if view.levels == 0 || view.size <= 1 {
            return 1.0;
        }
        let path = path_of(ctx.cluster, node);
        let remaining = view.size.saturating_sub(view.placed + 1);
        let per_pod = placement.gpus().len().max(1);
        // room: can the rest of the group follow under this node's leaf switch?
        let near = view.idle_by_leaf.get(&path).copied().unwrap_or(0).saturating_sub(per_pod);
        let room = if remaining == 0 { 1.0 } else { (near as f64 / (remaining * per_pod) as f64).min(1.0) };
        if view.peer_paths.is_empty() {
            return room;
        }
        // closeness to the group's farthest peer, as a fraction of the levels shared
        let closeness = view
            .peer_paths
            .iter()
            .map(|p| shared_levels(&path, p) as f64 / view.levels as f64)
            .fold(f64::INFINITY, f64::min);
        0.8 * closeness + 0.2 * room
    }
}
