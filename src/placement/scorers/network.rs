//! Network locality for jobs of several pods (`gpuplace.io/group`): the same ToR as the group's pods
//! already placed, else the same spine, and room under that switch for the rest of the group.

use std::collections::HashMap;
use std::sync::Arc;

use crate::placement::feasibility::Placement;
use crate::placement::scorer::{Data, ScoreContext, Scorer, Shared};
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::resources::GroupSpec;

/// The scorer's name in profiles, weights and placement logs.
pub const NAME: &str = "network";

/// How much closeness to a group's placed pods and room under its switch count.
pub const DEFAULT_WEIGHT: f64 = 3.0;

#[derive(Debug, Default, Clone, Copy)]
pub struct NetworkScorer;

/// A node's network path: its value for each configured level, coarse to fine.
pub type NetPath = Vec<Option<String>>;

pub fn path_of(cluster: &Cluster, node: &Node) -> NetPath {
    cluster.network_path(node).map(|v| v.map(str::to_string)).collect()
}

/// Where a pod's group stands: what the scorer prepares once per pod rather than once per node.
#[derive(Debug, Clone, Default)]
pub struct GroupView {
    /// Network paths of the nodes holding the group's placed pods.
    pub peer_paths: Vec<NetPath>,
    pub placed: usize,
    pub size: usize,
    /// Idle healthy GPUs under each leaf switch (full path; nodes missing a label are left out).
    pub idle_by_leaf: HashMap<NetPath, usize>,
    pub levels: usize,
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
            // a node missing a label is under no known leaf: pooling all such nodes would promise room
            // near it that may be anywhere in the network
            if path.iter().all(Option::is_some) {
                *v.idle_by_leaf.entry(path).or_default() += n.idle_gpus();
            }
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
        NAME
    }

    /// Where the pod's group stands (nothing for a pod without a group).
    fn prepare(&self, ctx: &ScoreContext<'_>, _facts: Option<&Shared>) -> Option<Shared> {
        let group = ctx.request.group.as_ref()?;
        Some(Arc::new(GroupView::new(ctx.cluster, group)))
    }

    fn score(&self, ctx: &ScoreContext<'_>, data: Data<'_>, node: &Node, placement: &Placement) -> f64 {
        let Some(view) = data.get::<GroupView>() else { return 1.0 };
        // no network labels anywhere: nothing to prefer, as with no levels configured
        if view.levels == 0 || view.size <= 1 || view.idle_by_leaf.is_empty() {
            return 1.0;
        }
        let path = path_of(ctx.cluster, node);
        let remaining = view.size.saturating_sub(view.placed + 1);
        let per_pod = placement.gpus().len().max(1);
        // room: can the rest of the group follow under this node's leaf switch?
        let leaf_idle = if path.iter().all(Option::is_some) {
            view.idle_by_leaf.get(&path).copied().unwrap_or(0)
        } else {
            node.idle_gpus()
        };
        let near = leaf_idle.saturating_sub(per_pod);
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::placement::engine::Engine;
    use crate::placement::mix::WorkloadMix;
    use crate::placement::{
        profile::{Profile, ProfileConfig},
        registry::Weights,
    };
    use gpuplace_core::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use gpuplace_core::cluster::Cluster;
    use gpuplace_core::cluster::DEFAULT_NETWORK_LEVELS;
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::GroupSpec;
    use gpuplace_core::resources::{GpuDemand, PackingPolicy, PodRequest};

    fn node(name: &str, gpus: u32, spine: Option<&str>, tor: Option<&str>) -> Node {
        let board = Board::Flat { gpus, model: "A100".into(), memory_mib: 40960 }.resolve(Path::new(".")).unwrap();
        let labels: BTreeMap<String, String> = DEFAULT_NETWORK_LEVELS
            .iter()
            .zip([spine, tor])
            .filter_map(|(k, v)| Some((k.to_string(), v?.to_string())))
            .collect();
        board.node(name, labels, 0, 0)
    }

    /// `pod` holds whole GPUs `gpus` of `node`, as a member of `group` (or of none).
    fn hold(c: &mut Cluster, pod: &str, node: &str, gpus: &[u32], group: Option<&str>) {
        let slices = gpus.iter().map(|&gpu| GpuSlice { gpu, mem_mib: 40960, core_pct: 100, exclusive: true });
        c.allocate(PodAssignment {
            pod: pod.into(),
            node: node.into(),
            containers: vec![ContainerAssignment { name: "c".into(), init: false, slices: slices.collect() }],
            cpu_milli: 0,
            memory_mib: 0,
            group: group.map(str::to_string),
        })
        .unwrap();
    }

    fn member(gpus: u32, size: u32) -> PodRequest {
        let mut r = PodRequest::single("ns/job-x", GpuDemand::Whole { gpus });
        r.group = Some(GroupSpec::labelled("ns/job", size));
        r
    }

    /// The network score of `req` on `node`, with the engine's own GPU choice there.
    fn score(c: &Cluster, req: &PodRequest, node: &str) -> f64 {
        let i = c.node_index(node).unwrap();
        let placement = Engine::default().place(c, req, i).unwrap();
        let mix = WorkloadMix::default();
        let ctx = ScoreContext {
            cluster: c,
            request: req,
            node_policy: PackingPolicy::Binpack,
            mix: &mix,
            now_unix_ms: 0,
            max_sample_age_ms: 60_000,
        };
        let view = NetworkScorer.prepare(&ctx, None);
        NetworkScorer.score(&ctx, Data::of(view.as_ref()), &c.nodes()[i], &placement)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// One group pod placed on `peer` (spine s1, ToR t1); candidates at every distance from it.
    fn locality_cluster() -> Cluster {
        let mut c = Cluster::new(vec![
            node("peer", 8, Some("s1"), Some("t1")),
            node("tor", 8, Some("s1"), Some("t1")),
            node("spine", 8, Some("s1"), Some("t2")),
            node("far", 8, Some("s2"), Some("t3")),
            // the same ToR name under another spine is another switch
            node("alias", 8, Some("s2"), Some("t1")),
            node("bare", 8, None, None),
        ]);
        hold(&mut c, "ns/job-0", "peer", &[0, 1], Some("ns/job"));
        c
    }

    #[test]
    fn same_tor_beats_same_spine_beats_elsewhere() {
        let c = locality_cluster();
        let req = member(2, 4);
        let s = |n: &str| score(&c, &req, n);
        // every candidate has room for the 2 pods still to come, so only closeness differs:
        // 0.8 x (levels shared / 2) + 0.2 x room
        assert!(close(s("peer"), 1.0), "{}", s("peer"));
        assert!(close(s("tor"), 1.0), "{}", s("tor"));
        assert!(close(s("spine"), 0.6), "{}", s("spine"));
        assert!(close(s("far"), 0.2), "{}", s("far"));
        assert!(close(s("alias"), 0.2), "{}", s("alias"));
        assert!(close(s("bare"), 0.2), "{}", s("bare"));
        assert!(s("tor") > s("spine") && s("spine") > s("far"));
    }

    #[test]
    fn the_engine_ranks_by_locality() {
        let c = locality_cluster();
        let weights = Weights::none().with("network", 1.0);
        let engine =
            Engine::new(Profile::new(ProfileConfig { weights, ..ProfileConfig::default() }), WorkloadMix::default());
        let ev = engine.evaluate_all(&c, &member(2, 4), 0);
        let names: Vec<&str> = ev.ranked.iter().map(|r| c.nodes()[r.node].name.as_str()).collect();
        // ties (alias, bare, far) go by name
        assert_eq!(names, ["peer", "tor", "spine", "alias", "bare", "far"]);
        assert!(ev.rejected.is_empty());
    }

    #[test]
    fn closeness_is_to_the_farthest_peer() {
        let mut c = locality_cluster();
        hold(&mut c, "ns/job-1", "spine", &[0, 1], Some("ns/job"));
        let req = member(2, 4);
        // "tor" shares both levels with "peer" but only the spine with "spine"
        assert!(close(score(&c, &req, "tor"), 0.8 * 0.5 + 0.2));
        assert!(close(score(&c, &req, "far"), 0.2));
    }

    #[test]
    fn room_for_the_rest_of_the_group() {
        let mut c = Cluster::new(vec![
            node("big0", 8, Some("s1"), Some("t1")),
            node("big1", 8, Some("s1"), Some("t1")),
            node("small", 4, Some("s1"), Some("t2")),
            node("busy", 8, Some("s1"), Some("t3")),
            node("bare0", 4, None, None),
            node("bare1", 4, None, None),
        ]);
        hold(&mut c, "other/a", "busy", &[0, 1, 2, 3, 4, 5], None);
        // the first of 4 pods of 2 GPUs: no peers yet, so the score is room for the other 3 x 2 GPUs
        let req = member(2, 4);
        assert!(close(score(&c, &req, "big0"), 1.0)); // 16 idle under t1, 14 after this pod
        assert!(close(score(&c, &req, "small"), 2.0 / 6.0));
        assert!(close(score(&c, &req, "busy"), 0.0)); // the other pod's GPUs are not room
                                                      // a node without labels counts only its own GPUs, not every other unlabeled node's
        assert!(close(score(&c, &req, "bare0"), 2.0 / 6.0), "{}", score(&c, &req, "bare0"));
        // a smaller group fits under t2 as well
        assert!(close(score(&c, &member(2, 2), "small"), 1.0));
        // the last pod of a group needs no room: only closeness counts
        hold(&mut c, "ns/job-0", "big0", &[0, 1], Some("ns/job"));
        let last = member(2, 2);
        assert!(close(score(&c, &last, "busy"), 0.8 * 0.5 + 0.2));
        assert!(close(score(&c, &last, "big1"), 1.0));
    }

    #[test]
    fn neutral_without_a_group_or_network() {
        let mut c = locality_cluster();
        let solo = PodRequest::single("ns/solo", GpuDemand::Whole { gpus: 2 });
        let single = member(2, 1);
        for n in ["peer", "tor", "spine", "far", "alias", "bare"] {
            assert_eq!(score(&c, &solo, n), 1.0, "{n}: no group");
            assert_eq!(score(&c, &single, n), 1.0, "{n}: group of one");
        }
        c.network_levels.clear();
        for n in ["peer", "far", "bare"] {
            assert_eq!(score(&c, &member(2, 4), n), 1.0, "{n}: no network levels");
        }
        // levels configured but no node labeled: nothing to tell nodes apart
        let mut c = Cluster::new(vec![node("a", 8, None, None), node("b", 2, None, None)]);
        hold(&mut c, "ns/job-0", "a", &[0], Some("ns/job"));
        for n in ["a", "b"] {
            assert_eq!(score(&c, &member(1, 4), n), 1.0, "{n}: no labels anywhere");
        }
    }
}
