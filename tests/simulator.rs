//! The simulator: the bundled example runs, results are deterministic per seed, and on the Alibaba
//! trace our FGD and BestFit reproduce the paper's cached results within 0.5 points.

use std::path::{Path, PathBuf};

use gpuplace::placement::profile::ProfileConfig;
use gpuplace::sim::policies::PolicyKind;
use gpuplace::sim::{simulate, SimConfig};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cfg(policies: Vec<PolicyKind>, seeds: Vec<u64>) -> SimConfig {
    SimConfig { workload: "default".into(), policies, seeds, tune: 1.3, profile: ProfileConfig::default() }
}

#[test]
fn bundled_example_runs_every_policy_deterministically() {
    let dir = root().join("examples/traces/demo");
    let a = simulate(&dir, &cfg(PolicyKind::ALL.to_vec(), vec![1, 2])).unwrap();
    let b = simulate(&dir, &cfg(PolicyKind::ALL.to_vec(), vec![1, 2])).unwrap();
    assert_eq!(a.len(), 7);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.unallocated_gpu_pct, y.unallocated_gpu_pct, "{}", x.policy);
        assert_eq!(x.failed_pods_per_seed, y.failed_pods_per_seed);
        let at100 = x.unallocated_gpu_pct["100"];
        assert!((0.0..100.0).contains(&at100), "{}: {at100}", x.policy);
        // columns are complete from 75 to 130
        assert_eq!(x.unallocated_gpu_pct.len(), 12, "{}: {:?}", x.policy, x.unallocated_gpu_pct);
    }
}

#[test]
fn missing_trace_is_a_clear_error() {
    let err = simulate(Path::new("/nonexistent"), &cfg(vec![PolicyKind::Fgd], vec![1])).unwrap_err();
    assert!(err.to_string().contains("openb_node_list_gpu_node.csv"), "{err}");
}

#[test]
fn fgd_and_bestfit_reproduce_the_paper() {
    let dir = root().join("../shared/traces/alibaba-openb");
    let reports = simulate(&dir, &cfg(vec![PolicyKind::Fgd, PolicyKind::BestFit], (42..=51).collect())).unwrap();
    for r in reports {
        let ours = r.unallocated_gpu_pct["100"];
        let paper = r.paper_unallocated_gpu_pct_at_100.expect("paper results present");
        eprintln!("{}: ours {ours:.2}, paper {paper:.2}", r.policy);
        assert!((ours - paper).abs() <= 0.5, "{}: ours {ours:.2} vs paper {paper:.2}", r.policy);
    }
}
