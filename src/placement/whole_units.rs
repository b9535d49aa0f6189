//! Which nodes, leaf switches and spines are still *whole*: every GPU under them free. A whole node
//! is what a node-sized pod needs, a whole ToR or spine what a job of several such pods under one
//! switch needs. `scorers::whole` keeps these units whole while a broken one can take the pod.
//!
//! Only nodes built for multi-GPU jobs count: two GPUs or more joined by NVLink (direct or through
//! NVSwitch). That is what the inventory says of a training cluster (HGX and DGX boards under a ToR
//! and spine fabric) before its first job arrives. PCIe-only boards (L40S, T4, the Alibaba trace's
//! nodes) serve inference and shares; there the fragmentation measure alone decides, as consolidating
//! shares on them cost 0.7 points of unallocated GPUs on the trace (docs/performance-journal.md,
//! "Room for jobs"). Such nodes are neutral: they neither break a switch nor keep one whole.
//!
//! Whether a switch is whole depends on every node under it, so these are the scorer's [`Facts`],
//! kept per cluster state and updated only for the nodes whose stamp changed.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::placement::mix::WorkloadMix;
use crate::placement::scorer::{Facts, Shared};
use gpuplace_core::cluster::{Cluster, Node};
use gpuplace_core::topology::NvlinkFabric;

/// What `scorers::whole` reads: per node, how many whole units a placement there would break.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct WholeView {
    /// Per node index: 0 when the node is not whole; else 1 (the node) plus its whole switches.
    pub breaks: Arc<[u8]>,
    /// Units a node can be part of: itself and one switch per network level.
    pub units: u8,
    /// Some node built for jobs is whole (else nothing is left to keep and the scorer is left out).
    pub any: bool,
    /// Differs whenever a switch's wholeness or `any` does (a node's own wholeness is part of the
    /// node's state, which a verdict cache already keys on).
    pub key: u64,
}

/// A node's part in its switches' wholeness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not built for multi-GPU jobs: it neither breaks a switch nor keeps one whole.
    Neutral,
    /// Every GPU free and healthy (a node with a dead GPU cannot host a node-sized pod, so it is as
    /// good as broken for the rest).
    Whole,
    Broken,
}

/// Two GPUs or more, joined by NVLink.
pub fn built_for_jobs(node: &Node) -> bool {
    node.gpus.len() >= 2
        && (node.topology.fabric() != NvlinkFabric::None || node.topology.links().any(|(_, _, l)| l.nvlinks > 0))
}

fn state(node: &Node) -> State {
    if !built_for_jobs(node) {
        State::Neutral
    } else if node.is_whole() {
        State::Whole
    } else {
        State::Broken
    }
}

/// The units, kept up to date per node.
#[derive(Debug, Default)]
pub struct WholeUnits {
    levels: Vec<String>,
    /// Per node, its value for each network level, coarse to fine.
    paths: Vec<Vec<Option<String>>>,
    /// Per node, its switches (indices into `broken`), coarse to fine; a level whose label (or a
    /// coarser one) is missing has none, as the node is under no known switch there.
    units: Vec<Vec<u32>>,
    states: Vec<State>,
    /// Per switch, its broken nodes.
    broken: Vec<u32>,
    view: Option<Arc<WholeView>>,
}

impl WholeUnits {
    /// Rebuilt from scratch for `cluster`.
    pub fn rebuild(&mut self, cluster: &Cluster) {
        let nodes = cluster.nodes();
        self.levels = cluster.network_levels.clone();
        let owned = |n| cluster.network_path(n).map(|v| v.map(str::to_string)).collect();
        self.paths = nodes.iter().map(owned).collect();
        let mut ids: HashMap<(usize, &[Option<String>]), u32> = HashMap::new();
        let mut units = Vec::with_capacity(nodes.len());
        for path in &self.paths {
            let known = path.iter().take_while(|p| p.is_some()).count();
            let mine: Vec<u32> = (0..known)
                .map(|l| {
                    let next = ids.len() as u32;
                    *ids.entry((l, &path[..=l])).or_insert(next)
                })
                .collect();
            units.push(mine);
        }
        self.broken = vec![0; ids.len()];
        self.units = units;
        self.states = nodes.iter().map(state).collect();
        for (i, s) in self.states.iter().enumerate() {
            if *s == State::Broken {
                for &u in &self.units[i] {
                    self.broken[u as usize] += 1;
                }
            }
        }
        self.view = None;
    }

    /// Node `i` of `cluster` changed (for a `cluster` of the same network levels, see
    /// [`WholeUnits::has_levels`]). `false` when its switches may have (its labels): then only a
    /// rebuild will do.
    pub fn update(&mut self, cluster: &Cluster, i: usize) -> bool {
        let (Some(node), Some(path)) = (cluster.nodes().get(i), self.paths.get(i)) else { return false };
        // compared in place: this runs for every node a placement changes
        if !path.iter().map(Option::as_deref).eq(cluster.network_path(node)) {
            return false;
        }
        let (was, now) = (self.states[i], state(node));
        if was == now {
            return true;
        }
        self.states[i] = now;
        self.view = None;
        if (was == State::Broken) != (now == State::Broken) {
            for &u in &self.units[i] {
                let b = &mut self.broken[u as usize];
                *b = if now == State::Broken { *b + 1 } else { b.saturating_sub(1) };
            }
        }
        true
    }

    /// Whether it was built for `cluster`'s network levels.
    pub fn has_levels(&self, cluster: &Cluster) -> bool {
        self.levels == cluster.network_levels
    }

    /// The view for the current state (worked out again only after a change).
    pub fn view(&mut self) -> Arc<WholeView> {
        if let Some(v) = &self.view {
            return v.clone();
        }
        let mut any = false;
        let breaks: Vec<u8> = (0..self.states.len())
            .map(|i| {
                if self.states[i] != State::Whole {
                    return 0;
                }
                any = true;
                let switches = self.units[i].iter().filter(|&&u| self.broken[u as usize] == 0).count();
                (1 + switches).min(u8::MAX as usize) as u8
            })
            .collect();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        any.hash(&mut h);
        for b in &self.broken {
            (*b == 0).hash(&mut h);
        }
        let units = (1 + self.levels.len()).min(u8::MAX as usize) as u8;
        let v = Arc::new(WholeView { breaks: breaks.into(), units, any, key: h.finish() });
        self.view = Some(v.clone());
        v
    }
}

impl Facts for WholeUnits {
    fn stale(&self, cluster: &Cluster, _mix: &WorkloadMix) -> bool {
        !self.has_levels(cluster)
    }

    fn rebuild(&mut self, cluster: &Cluster, _mix: &WorkloadMix) {
        WholeUnits::rebuild(self, cluster);
    }

    fn update(&mut self, cluster: &Cluster, i: usize) -> bool {
        WholeUnits::update(self, cluster, i)
    }

    fn snapshot(&mut self) -> (Shared, u64) {
        let v = self.view();
        let key = v.key;
        (v, key)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::placement::engine::Engine;
    use gpuplace_core::cluster::network_labels;
    use gpuplace_core::inventory::Board;
    use gpuplace_core::resources::{GpuDemand, PodRequest};

    /// 16 HGX nodes (4 per ToR, 8 per spine), then 2 PCIe nodes under their own ToR.
    fn cluster() -> Cluster {
        let hgx = Board::Nvswitch { gpus: 8, model: "H100".into(), memory_mib: 81920, numa_nodes: 2, nvlinks: 18 }
            .resolve(Path::new("."))
            .unwrap();
        let pcie = Board::Pcie {
            model: "L40S".into(),
            memory_mib: 46068,
            sockets: 1,
            switches_per_socket: 2,
            gpus_per_switch: 2,
        }
        .resolve(Path::new("."))
        .unwrap();
        let labels = |i: usize| network_labels(format!("spine-{}", i / 8), format!("tor-{}", i / 4));
        let mut nodes: Vec<Node> = (0..16).map(|i| hgx.node(&format!("hgx-{i:02}"), labels(i), 0, 0)).collect();
        nodes.extend((16..18).map(|i| pcie.node(&format!("pcie-{i}"), labels(i), 0, 0)));
        Cluster::new(nodes)
    }

    fn take(c: &mut Cluster, node: &str, gpus: u32) -> String {
        let i = c.node_index(node).unwrap();
        let req =
            PodRequest::single(format!("ns/{node}-{gpus}-{}", c.nodes()[i].generation()), GpuDemand::Whole { gpus });
        let p = Engine::default().place(c, &req, i).unwrap();
        let pod = p.assignment.pod.clone();
        c.allocate(p.assignment).unwrap();
        pod
    }

    fn fresh(c: &Cluster) -> Arc<WholeView> {
        let mut w = WholeUnits::default();
        w.rebuild(c);
        w.view()
    }

    #[test]
    fn breaks_count_the_node_and_its_whole_switches() {
        let mut c = cluster();
        let v = fresh(&c);
        assert_eq!(v.units, 3);
        assert!(v.any);
        // every HGX node breaks itself, its ToR and its spine; the PCIe nodes are neutral
        assert!(v.breaks[..16].iter().all(|&b| b == 3), "{:?}", v.breaks);
        assert_eq!(&v.breaks[16..], &[0, 0]);
        take(&mut c, "hgx-00", 1);
        let v = fresh(&c);
        assert_eq!(v.breaks[0], 0, "already broken");
        assert_eq!(&v.breaks[1..4], &[1, 1, 1], "tor-0 and spine-0 are broken");
        assert_eq!(&v.breaks[4..8], &[2, 2, 2, 2], "tor-1 is whole, spine-0 is not");
        assert!(v.breaks[8..16].iter().all(|&b| b == 3));
        // a PCIe node in use breaks nothing
        take(&mut c, "pcie-16", 1);
        assert_eq!(fresh(&c).breaks, v.breaks);
    }

    #[test]
    fn updates_agree_with_a_rebuild() {
        let mut c = cluster();
        let mut w = WholeUnits::default();
        w.rebuild(&c);
        let mut stamps = c.stamps().to_vec();
        let mut pods: Vec<String> = Vec::new();
        let keys = |w: &mut WholeUnits, c: &Cluster| {
            let (a, b) = (w.view(), fresh(c));
            assert_eq!(a, b);
        };
        for step in 0..40usize {
            let node = format!("hgx-{:02}", (step * 7) % 16);
            if step % 3 == 2 {
                if let Some(pod) = pods.pop() {
                    c.release(&pod).unwrap();
                }
            } else if c.node(&node).is_some_and(|n| (0..8).any(|g| n.is_gpu_free(g))) {
                pods.push(take(&mut c, &node, 1));
            }
            for (i, (old, &new)) in stamps.iter_mut().zip(c.stamps()).enumerate() {
                if *old != new {
                    *old = new;
                    assert!(w.update(&c, i));
                }
            }
            keys(&mut w, &c);
        }
        // the key moves with a switch's wholeness, not with a node's alone
        let mut c = cluster();
        let k0 = fresh(&c).key;
        take(&mut c, "hgx-00", 1);
        let k1 = fresh(&c).key;
        assert_ne!(k0, k1, "tor-0 and spine-0 broke");
        take(&mut c, "hgx-01", 1);
        assert_eq!(fresh(&c).key, k1, "only a node broke");
    }
}
