//! The room jobs actually have, for capacity planners: GPU fractions say how much is free, not
//! whether a job of 2 x 8 GPUs under one ToR can start. Per node size: the whole nodes (every GPU
//! free and healthy); per network level: the whole switches (every GPU node under them whole) and
//! the largest job of node-sized pods one switch can take now; and the idle GPUs stranded on broken
//! nodes of the largest size, which no node-sized pod can use. Pure: read from a [`Cluster`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cluster::Cluster;

/// One network level's room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LevelRoom {
    /// The label key (`network.gpuplace.io/tor`).
    pub level: String,
    pub switches: u64,
    /// Switches whose every GPU node is whole.
    pub whole: u64,
    /// The most whole nodes of the largest size under one switch: the largest job of node-sized
    /// pods that fits under one switch now.
    pub largest_job_pods: u64,
}

/// The room for node-sized pods and jobs of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Room {
    /// GPUs of the largest nodes (the node-sized pod's GPUs); 0 without GPU nodes.
    pub node_gpus: u32,
    /// Whole nodes by their GPU count.
    pub whole_nodes: BTreeMap<u32, u64>,
    /// Coarse to fine, as the cluster's network levels.
    pub levels: Vec<LevelRoom>,
    /// Idle healthy GPUs on nodes of the largest size that are not whole.
    pub stranded_idle_gpus: u64,
}

impl Room {
    /// One line: `room: whole nodes 14 of 8 GPUs, 1 of 2 GPUs; tor: 2 of 4 whole, largest job 4 x 8
    /// GPUs; spine: ...; 14 idle GPUs stranded on broken 8-GPU nodes`.
    pub fn summary(&self) -> String {
        let sizes: Vec<String> = self.whole_nodes.iter().rev().map(|(g, n)| format!("{n} of {g} GPUs")).collect();
        let mut out =
            format!("room: whole nodes {}", if sizes.is_empty() { "none".to_string() } else { sizes.join(", ") });
        for l in self.levels.iter().rev() {
            let name = l.level.rsplit('/').next().unwrap_or(&l.level);
            out.push_str(&format!(
                "; {name}: {} of {} whole, largest job {} x {} GPUs",
                l.whole, l.switches, l.largest_job_pods, self.node_gpus
            ));
        }
        out.push_str(&format!(
            "; {} idle GPUs stranded on broken {}-GPU nodes",
            self.stranded_idle_gpus, self.node_gpus
        ));
        out
    }

    pub fn of(cluster: &Cluster) -> Self {
        let nodes = cluster.nodes();
        let node_gpus = nodes.iter().map(|n| n.gpus.len() as u32).max().unwrap_or(0);
        let mut room = Room { node_gpus, ..Room::default() };
        // per level, per switch (its path down to that level): (GPU nodes broken, whole of the largest size)
        let mut switches: Vec<BTreeMap<Vec<&str>, (u64, u64)>> = vec![BTreeMap::new(); cluster.network_levels.len()];
        for n in nodes.iter().filter(|n| !n.gpus.is_empty()) {
            let is_whole = n.is_whole();
            let largest = n.gpus.len() as u32 == node_gpus;
            if is_whole {
                *room.whole_nodes.entry(n.gpus.len() as u32).or_default() += 1;
            } else if largest {
                room.stranded_idle_gpus += n.idle_gpus() as u64;
            }
            let path: Vec<Option<&str>> = cluster.network_path(n).collect();
            for (l, level) in switches.iter_mut().enumerate() {
                // a node missing a label (or a coarser one) is under no known switch at that level
                let Some(key) = path[..=l].iter().copied().collect::<Option<Vec<&str>>>() else { break };
                let e = level.entry(key).or_default();
                e.0 += u64::from(!is_whole);
                e.1 += u64::from(is_whole && largest);
            }
        }
        room.levels = cluster
            .network_levels
            .iter()
            .zip(switches)
            .map(|(level, s)| LevelRoom {
                level: level.clone(),
                switches: s.len() as u64,
                whole: s.values().filter(|(broken, _)| *broken == 0).count() as u64,
                largest_job_pods: s.values().map(|(_, w)| *w).max().unwrap_or(0),
            })
            .collect();
        room
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::assignment::{ContainerAssignment, GpuSlice, PodAssignment};
    use crate::cluster::{network_labels, Node, DEFAULT_NETWORK_LEVELS};
    use crate::inventory::Board;

    /// 16 nodes of 8 GPUs (4 per ToR, 8 per spine), and one of 2 GPUs without network labels.
    fn cluster() -> Cluster {
        let big = Board::Flat { gpus: 8, model: "H100".into(), memory_mib: 81920 }.resolve(Path::new(".")).unwrap();
        let small = Board::Flat { gpus: 2, model: "T4".into(), memory_mib: 15360 }.resolve(Path::new(".")).unwrap();
        let mut nodes: Vec<Node> = (0..16)
            .map(|i| {
                let labels = network_labels(format!("spine-{}", i / 8), format!("tor-{}", i / 4));
                big.node(&format!("gpu-{i:02}"), labels, 0, 0)
            })
            .collect();
        nodes.push(small.node("t4", BTreeMap::new(), 0, 0));
        Cluster::new(nodes)
    }

    fn share(c: &mut Cluster, pod: &str, node: &str, gpu: u32) {
        let slices = vec![GpuSlice { gpu, mem_mib: 1024, core_pct: 10, exclusive: false }];
        c.allocate(PodAssignment {
            pod: pod.into(),
            node: node.into(),
            containers: vec![ContainerAssignment { name: "c".into(), init: false, slices }],
            cpu_milli: 0,
            memory_mib: 0,
            group: None,
        })
        .unwrap();
    }

    #[test]
    fn whole_nodes_switches_and_the_largest_job() {
        let mut c = cluster();
        let r = Room::of(&c);
        assert_eq!(r.node_gpus, 8);
        assert_eq!(r.whole_nodes, BTreeMap::from([(2, 1), (8, 16)]));
        assert_eq!(
            r.levels[0],
            LevelRoom { level: DEFAULT_NETWORK_LEVELS[0].into(), switches: 2, whole: 2, largest_job_pods: 8 }
        );
        assert_eq!(r.levels[1].whole, 4);
        assert_eq!(r.levels[1].largest_job_pods, 4);
        assert_eq!(r.stranded_idle_gpus, 0);
        // a share on one node of each ToR of spine-0 and on the T4 node
        for n in ["gpu-00", "gpu-04"] {
            share(&mut c, &format!("ns/{n}"), n, 0);
        }
        share(&mut c, "ns/t4", "t4", 0);
        let r = Room::of(&c);
        assert_eq!(r.whole_nodes, BTreeMap::from([(8, 14)]));
        assert_eq!((r.levels[0].whole, r.levels[0].largest_job_pods), (1, 8));
        assert_eq!((r.levels[1].whole, r.levels[1].largest_job_pods), (2, 4));
        // 7 idle GPUs on each broken 8-GPU node; the T4's are not of the largest size
        assert_eq!(r.stranded_idle_gpus, 14);
        // every ToR broken: the largest job under one ToR is 3 pods
        for n in ["gpu-08", "gpu-12"] {
            share(&mut c, &format!("ns/{n}"), n, 0);
        }
        let r = Room::of(&c);
        assert_eq!((r.levels[1].whole, r.levels[1].largest_job_pods), (0, 3));
        assert_eq!((r.levels[0].whole, r.levels[0].largest_job_pods), (0, 6));
        assert_eq!(
            r.summary(),
            "room: whole nodes 12 of 8 GPUs; tor: 0 of 4 whole, largest job 3 x 8 GPUs; spine: 0 of 2 whole, \
             largest job 6 x 8 GPUs; 28 idle GPUs stranded on broken 8-GPU nodes"
        );
    }
}
