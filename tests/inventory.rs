//! Example cluster files load and match the boards they describe.

use std::path::PathBuf;

use gpuplace_core::inventory::{load_cluster, load_topology_file};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn fixture_cluster_matches_the_fixture_nodes_and_the_h100_board() {
    let c = load_cluster(&root().join("examples/clusters/fixture-cluster.yaml")).unwrap();
    let names: Vec<&str> = c.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"]);
    let tors: Vec<&str> = c.nodes().iter().map(|n| n.labels["network.gpuplace.io/tor"].as_str()).collect();
    assert_eq!(tors, ["tor-0", "tor-0", "tor-1", "tor-1"]);
    let board = load_topology_file(&root().join("../shared/topologies/hgx-h100-8.json")).unwrap();
    let reference = board.graph().unwrap();
    for n in c.nodes() {
        assert_eq!(n.gpus.len(), 8);
        assert!(n.gpus.iter().all(|g| g.memory_mib == 81559 && g.uuid.starts_with("GPU-")));
        for a in 0..8 {
            assert_eq!(n.gpus[a].numa_node, board.gpus[a].numa_node);
            for b in a + 1..8 {
                assert_eq!(n.topology.link(a, b), reference.link(a, b), "{} pair {a}-{b}", n.name);
            }
        }
    }
    // UUIDs are unique across the cluster
    let mut uuids: Vec<&str> = c.nodes().iter().flat_map(|n| n.gpus.iter().map(|g| g.uuid.as_str())).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 32);
    // the device plugin's default K, as the DaemonSet runs it
    assert!(c.nodes().iter().all(|n| n.slots_per_gpu == Some(10)));
}

#[test]
fn bad_cluster_files_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("gpuplace-inv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("bad.yaml");
    std::fs::write(&p, "node_groups: [{prefix: a, count: 1, board: {kind: warp}}]").unwrap();
    let err = load_cluster(&p).unwrap_err().to_string();
    assert!(err.contains("bad.yaml"), "{err}");
    std::fs::write(&p, "node_groups: [{prefix: a, count: 1, board: {kind: file, path: missing.json}}]").unwrap();
    assert!(load_cluster(&p).unwrap_err().to_string().contains("missing.json"));
    let flat = "board: {kind: flat, gpus: 1, model: T4, memory_mib: 15109}";
    std::fs::write(&p, format!("node_groups: [{{prefix: a, count: 1, {flat}, slots_per_gpu: 0}}]")).unwrap();
    let err = load_cluster(&p).unwrap_err().to_string();
    assert!(err.contains("node group a: slots_per_gpu is 0; it must be 1 to 1000"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
