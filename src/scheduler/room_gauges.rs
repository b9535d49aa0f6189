//! The `/metrics` gauges of the room jobs have (`core::room`): whole nodes, whole switches, the
//! largest job of node-sized pods under one switch, and idle GPUs no node-sized pod can use.

use std::fmt::Write as _;

use crate::scheduler::exposition::{escape, gauge, header};
use gpuplace_core::room::Room;

/// The room jobs have (`core::room`): whole nodes, whole switches, the largest job of node-sized
/// pods under one switch, and idle GPUs that no node-sized pod can use.
pub fn render(out: &mut String, room: &Room) {
    header(out, "gpuplace_whole_nodes", "gauge", "GPU nodes with every GPU free and healthy, by their GPU count.");
    for (gpus, n) in &room.whole_nodes {
        let _ = writeln!(out, "gpuplace_whole_nodes{{gpus=\"{gpus}\"}} {n}");
    }
    header(
        out,
        "gpuplace_whole_switches",
        "gauge",
        "Switches whose every GPU node is whole, by network level (label key).",
    );
    for l in &room.levels {
        let _ = writeln!(out, "gpuplace_whole_switches{{level=\"{}\"}} {}", escape(&l.level), l.whole);
    }
    header(
        out,
        "gpuplace_largest_job_pods",
        "gauge",
        "The most pods of a whole node of the largest size (gpus_per_pod) that one switch of the level can take now: the largest job that starts under one switch.",
    );
    for l in &room.levels {
        let _ = writeln!(
            out,
            "gpuplace_largest_job_pods{{level=\"{}\",gpus_per_pod=\"{}\"}} {}",
            escape(&l.level),
            room.node_gpus,
            l.largest_job_pods
        );
    }
    gauge(
        out,
        "gpuplace_stranded_idle_gpus",
        "Idle GPUs on broken nodes of the largest size: free, but not for a node-sized pod.",
        room.stranded_idle_gpus,
    );
}
